// Engine: ZeRO training of a LibTorch model across device memory, host DRAM and NVMe.
//
// What a model must do to be trained: be a torch::nn::Sequential of blocks, each a module whose
// forward maps one Tensor to one Tensor (embedding, transformer blocks, head), built from standard
// LibTorch layers. LibTorch C++ modules have no forward hooks, so the engine runs the blocks one
// by one itself: before a block's forward it materializes the block's parameters, after it
// releases them. The loss is computed by the caller from Forward's output.
//
// Materialization (stage 3): the block's chunks are brought to the device (NVMe -> host ->
// device, then all-gather across ranks) into one buffer per chunk, and each parameter's data is
// pointed at its slice (Tensor::set_data). After the block's forward the parameters are pointed
// at empty tensors; a hook on the block's output gathers them again when backward reaches the
// block (Note [backward order] in engine.cc). Stages 0-2 keep full parameters on the device.
//
// Gradients: when backward has left a block, its parameters' .grad are copied into per-chunk fp32
// buffers, reduce-scattered (averaged over ranks) into each rank's shard and accumulated into the
// shard's grad block; .grad is then cleared. The optimizer (CPU Adam/AdamW on the shards of
// master32 / exp_avg / exp_avg_sq, writing the new working copy) runs per chunk:
// - during backward, as soon as a chunk's gradients are complete, when the step's result cannot
//   depend on global conditions (no gradient clipping and no fp16 loss scaling);
// - otherwise after backward (deferred): the global gradient norm and the fp16 overflow flag are
//   reduced over every shard and rank first, then the chunks update in order with their states
//   prefetched. Deferring, not rolling back, keeps the result identical to a non-overlapped step.
// Either way the update equals torch.optim's step after a plain backward.
//
// Thread-safety: one thread drives Forward / Backward / Step. Errors inside Forward and Backward
// (I/O, collectives) surface as exceptions from Forward (the LibTorch boundary) and as Status
// from Backward / Step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runtime/config.h"
#include "runtime/status.h"
#include "tiers/nvme/io_engine.h"

namespace strata {

class Communicator;
class Device;

struct EngineOptions {
  std::vector<std::string> nvme_path;  // overrides both offload nvme_path settings when set
  bool force_fallback_io = false;      // use the pread/pwrite engine (tests)
  nvme::IoFaultHook nvme_fault_hook;   // test-only: forwarded to NvmeTierOptions::fault_hook
};

// One optimizer step, as seen by every lane.
struct StepReport {
  int64_t step = 0;             // optimizer steps taken so far (skipped ones excluded)
  bool skipped = false;         // fp16 overflow: no update this step
  double lr = 0;
  double loss_scale = 1;
  double grad_norm = 0;         // global L2 norm of the unscaled gradients (0 when not computed)
  double step_time_s = 0;       // wall: first Forward of the step to the end of Step
  // Busy time per lane (seconds). compute excludes time it stalled on data.
  double compute_s = 0;
  double copy_s = 0;            // host<->device copies
  double comm_s = 0;            // collectives
  double nvme_s = 0;            // NVMe tier busy time
  double optimizer_s = 0;       // CPU Adam
  double stall_s = 0;           // compute waiting for parameters or states
  double overlap_efficiency = 0;  // longest lane / step time (1.0: perfectly overlapped)
  uint64_t bytes_host_to_device = 0;
  uint64_t bytes_device_to_host = 0;
  uint64_t bytes_nvme_to_host = 0;
  uint64_t bytes_host_to_nvme = 0;
  uint64_t peak_device_bytes = 0;
  uint64_t peak_host_bytes = 0;  // engine-managed host memory (states and staging)
  nlohmann::json ToJson() const;
};

class Engine {
 public:
  // Takes over `model`'s parameters: they are partitioned, their full storage is freed, and from
  // now on only the engine materializes them. `comm` and `device` must outlive the engine.
  static StatusOr<std::unique_ptr<Engine>> Create(torch::nn::Sequential model, const Config& config,
                                                  Communicator* comm, Device* device,
                                                  const EngineOptions& options = {});
  ~Engine();

  // Runs the blocks in order. Throws std::runtime_error with the Status text on failure.
  torch::Tensor Forward(const torch::Tensor& input);
  // Backward of `loss` (divided by gradient_accumulation_steps and multiplied by the fp16 loss
  // scale here, as DeepSpeed does) and the gradient reduction.
  Status Backward(const torch::Tensor& loss);
  // Completes an optimizer step once gradient_accumulation_steps micro-steps have run; before
  // that it returns FAILED_PRECONDITION.
  StatusOr<StepReport> Step();

  // The full fp32 master values of every parameter, in registration order (collective when
  // world_size > 1: every rank must call it).
  StatusOr<std::vector<torch::Tensor>> GatherMasterParams();

  // Saves this rank's partitions and the training state into `dir` atomically; loads them back.
  // `extra` is stored in the manifest and returned by Load (data position, RNG, ...).
  Status SaveCheckpoint(const std::string& dir, const nlohmann::json& extra);
  StatusOr<nlohmann::json> LoadCheckpoint(const std::string& dir);

  int64_t global_step() const;
  int64_t micro_step() const;
  int64_t num_parameters() const;  // elements, padding excluded
  // Bytes of model state (params + grads + optimizer states) over all ranks, padding excluded.
  uint64_t model_state_bytes() const;
  nlohmann::json Describe() const;  // placement, chunking and sizes, for logs

  class Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
