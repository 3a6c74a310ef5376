// One Adam/AdamW step over compact layouts: a bf16 master updated with nearest or stochastic
// rounding (no fp32 master), and moments in fp32, bf16 or 8 bits per element (compact_formats.h).
//
// How: the shard is walked in blocks of kInt8Block elements. Each block's compact values are
// widened into fp32 scratch (3 KB, in L1), the fp32 Adam kernel of optim/cpu_adam.h updates
// the scratch with exactly AdamStep's per-element operations, and the results are narrowed back:
// the master by FloatToBf16 (nearest) or FloatToBf16Stochastic, bf16 moments by FloatToBf16,
// 8-bit moments by QuantizeBlock. So a layout differs from fp32 AdamStep only by what its
// stores round, and every ISA gives the same bits. DRAM traffic per element: a bf16 master
// (2 B read, 2 B written), the gradient, and 8-bit moments (~2 B read, ~2 B written for both).
//
// Bytes per parameter held by the optimizer, summed over the master and both moments:
//   fp32 master + fp32 moments 12;  fp32 + bf16 moments 8;  fp32 + int8 moments 6.03;
//   bf16 master + bf16 moments 6;   bf16 master + int8 moments 4.03
// (the working copy and the gradient come on top; with a bf16 master the working copy is the
// master itself).
//
// 8-bit blocks start at element 0 of the buffers given: a shard's blocks are its own.
// Thread safety: as AdamStep (disjoint buffers, concurrent calls fine). Blocks until done.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "optim/compact_formats.h"
#include "optim/blockwise.h"
#include "optim/cpu_adagrad.h"
#include "optim/cpu_adam.h"
#include "optim/cpu_lion.h"
#include "optim/cpu_sgd.h"

namespace strata::optim {

enum class MasterFormat : uint8_t {
  kFp32,            // float, the default
  kBf16Nearest,     // bf16, round to nearest even (DeepSpeed's bf16_master_weights_and_grads)
  kBf16Stochastic,  // bf16, stochastic rounding (Note [stochastic rounding])
};
enum class MomentFormat : uint8_t { kFp32, kBf16, kInt8 };

// "fp32", "bf16", "bf16_sr"; "fp32", "bf16", "int8".
const char* MasterFormatName(MasterFormat f);
const char* MomentFormatName(MomentFormat f);
// Bytes of one buffer of n elements in each format.
size_t MasterBytes(MasterFormat f, size_t n);
size_t MomentBytes(MomentFormat f, size_t n);

struct CompactAdamBuffers {
  void* master = nullptr;  // n floats (kFp32) or n bf16 values; updated in place
  MasterFormat master_format = MasterFormat::kFp32;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  void* exp_avg = nullptr;     // MomentBytes(moment_format, n) bytes each, updated in place
  void* exp_avg_sq = nullptr;
  MomentFormat moment_format = MomentFormat::kFp32;
  // With an fp32 master only: its 16-bit copy for the device (as AdamBuffers::param16).
  void* param16 = nullptr;
  DType param16_dtype = DType::kBFloat16;
  size_t n = 0;
  // kBf16Stochastic: RoundingKey(seed, step), and the model-wide index of element 0 (element i
  // draws RoundingBits(rounding_key, index_base + i)).
  uint32_t rounding_key = 0;
  uint64_t index_base = 0;
};

// A run of elements [begin, begin + size) of a shard updated with one group's hyperparameters;
// element begin + j draws its rounding bits at model index index_base + j.
struct AdamRun {
  size_t begin = 0;
  size_t size = 0;
  AdamParams params;
  uint64_t index_base = 0;
};

// One update of a whole shard (bufs.n elements; bufs.index_base is unused) made of runs, sorted
// and disjoint, as a chunk's shard holds parameters of several groups. 8-bit blocks span runs:
// a block is widened once, each run in it is updated with its own hyperparameters, and it is
// narrowed once. Elements in no run keep their values (a block with no run is not touched).
StatusOr<AdamResult> CompactAdamStep(const std::vector<AdamRun>& runs, const CompactAdamBuffers& bufs,
                                     float grad_scale = 1.0f, const AdamOptions& options = {});

// SGD (momentum in exp_avg), Adagrad (its sum in exp_avg_sq) and Lion (its momentum in exp_avg)
// over the compact layouts, the same way: each block widened, the optimizer's own fp32 block
// function (cpu_sgd.h, cpu_adagrad.h, cpu_lion.h) on each run's part, then narrowed. The buffer
// the optimizer does not use may be null (and is for SGD without momentum); the gradient is fp32.
// The 16-bit copy (param16, fp32 master only) is written from the new master.
enum class ElementwiseKind : uint8_t { kSgd, kAdagrad, kLion };
struct ElementwiseRun {
  size_t begin = 0;
  size_t size = 0;
  uint64_t index_base = 0;
  SgdParams sgd;          // kSgd
  AdagradParams adagrad;  // kAdagrad
  LionParams lion;        // kLion
};
StatusOr<Isa> CompactElementwiseStep(ElementwiseKind kind, const std::vector<ElementwiseRun>& runs,
                                     const CompactAdamBuffers& bufs, float grad_scale = 1.0f,
                                     const ElementwiseOptions& options = {});

// The checks CompactAdamStep and CompactElementwiseStep make before they write anything: the
// buffers, the runs, each run's hyperparameters, the scale and the ISA. For callers that run the
// update elsewhere (kernels/: the GPU) and must refuse in the same words. They return what the
// step would (the ISA it would run).
StatusOr<AdamResult> CheckCompactAdam(const std::vector<AdamRun>& runs, const CompactAdamBuffers& bufs,
                                      float grad_scale = 1.0f, const AdamOptions& options = {});
StatusOr<Isa> CheckCompactElementwise(ElementwiseKind kind, const std::vector<ElementwiseRun>& runs,
                                      const CompactAdamBuffers& bufs, float grad_scale = 1.0f,
                                      const ElementwiseOptions& options = {});

// One update (cpu_adam.h's formula) of `bufs`. Errors as AdamStep's, plus INVALID_ARGUMENT for a
// param16 beside a bf16 master (the master is the 16-bit copy). GradCheck::kScanFirst skips the
// step (nothing written) on a non-finite scaled gradient, as AdamStep.
StatusOr<AdamResult> CompactAdamStep(const AdamParams& params, const CompactAdamBuffers& bufs,
                                     float grad_scale = 1.0f, const AdamOptions& options = {});

}  // namespace strata::optim
