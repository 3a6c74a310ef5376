// Compute calibration for strata-tune: times the model's own layers instead of trusting one
// large matmul's FLOP rate.
//
// Why: the profile's compute figure is a big square matmul, the best case for the BLAS. A small
// model's step is dominated by thin matmuls, attention's softmax and masking, layer norms and
// the loss, which reach a fraction of that rate: on the 2-core development machine the tiny
// config (d_model 128) ran its compute lane 3.4x slower than the matmul figure predicted.
//
// How: the model runs forward, loss and backward in plain LibTorch at the config's micro-batch
// and compute dtype, a few passes after a warm-up, and the median pass is the micro-batch's
// compute time.
// - When the whole model fits comfortably (CalibrationBytes(config, full) under the caller's
//   limit), the whole model is timed: exact for the shapes, and what small models need (their
//   embedding, head and loss are a large share, and timing noise between two small copies is
//   large against one block).
// - Otherwise two copies with one and with two blocks (same shapes otherwise) are timed, t1 and
//   t2, and
//     block = t2 - t1,   rest = t1 - block (embedding, head, loss),
//     micro-batch compute = rest + n_layers * block.
//   Only two blocks are built, so a model that does not fit in memory costs two of its layers.
#pragma once

#include <cstdint>

#include "runtime/base/config.h"
#include "runtime/base/status.h"

namespace strata::tune {

struct ComputeCalibration {
  bool whole_model = false;  // timed the whole model (else extrapolated from 1 and 2 blocks)
  double one_layer_s = 0;    // median forward+backward of the 1-block copy
  double two_layer_s = 0;    // ... of the 2-block copy
  double block_s = 0;        // per transformer block
  double rest_s = 0;         // embedding, head and loss
  double micro_batch_s = 0;  // extrapolated for config.model.n_layers
  double flops = 0;          // the cost model's FLOPs of one micro-batch
  double gflops = 0;         // flops / micro_batch_s / 1e9: the rate the cost model should use
};

// LibTorch's intra-op threads in this process: what the calibration times compute on, and what
// the engine's start takes compute to use when it sizes the optimizer lane beside it.
int ComputeThreads();

// The extrapolation alone (exposed for tests). Timing noise can make t2 <= t1 on a tiny model;
// then nothing is attributed to the blocks and the micro-batch costs t1.
void Extrapolate(double one_layer_s, double two_layer_s, int64_t n_layers, ComputeCalibration* c);

// Rough bytes a calibration model with `n_layers` blocks needs (fp32 parameters and gradients,
// plus activations), to pick the method and to refuse early on a machine that cannot hold it.
uint64_t CalibrationBytes(const Config& config, int64_t n_layers);

// Runs the calibration on the CPU with `reps` timed passes per model (after one warm-up each),
// timing the whole model when CalibrationBytes(config, n_layers) <= whole_model_limit.
// Fails with a message naming the problem when the model cannot run (e.g. fp16 matmuls that this
// LibTorch lacks on the CPU); callers then fall back to the profile's figure.
StatusOr<ComputeCalibration> CalibrateCompute(const Config& config, int reps,
                                              uint64_t whole_model_limit);

}  // namespace strata::tune
