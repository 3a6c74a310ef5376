// Engine: ZeRO training of a LibTorch model across device memory, host DRAM and NVMe.
//
// The model contract (README "Bring your own model"):
// - Any torch::nn::Module built from stock LibTorch layers. Its trainable parameters are split
//   into units: by default each child of the root that holds parameters, looking through
//   containers (Sequential, ModuleList, ModuleDict) to their children; EngineOptions::units names
//   them instead. Parameters directly on the root form one more unit that stays gathered.
// - The model's own forward runs each unit through strata::RunUnit (runtime/engine/run_unit.h):
//       x = strata::RunUnit(*block, [&] { return block->forward(x, mask); });
//   with any signature and any number of tensor outputs. Without an engine RunUnit just calls
//   the function, so the same model trains with plain LibTorch. A Sequential needs nothing of
//   this: Engine::Forward runs its children as units.
// - A unit's parameters are valid only inside its RunUnit (stage 3): outside it their storage is
//   empty (nbytes 0, a null data pointer), so reading one crashes on the CPU device as it would
//   on a GPU instead of returning stale values.
// - Shared (tied) parameters are stored, reduced and updated once. Module buffers stay where the
//   model keeps them on the engine's device, start from rank 0's values, and are saved in
//   checkpoints.
//
// Materialization (stage 3): before a unit runs, its chunks are brought to the device (NVMe ->
// host -> device, then all-gather across ranks) into one buffer per chunk. Each parameter is a
// view of its chunk's storage for the engine's whole life; releasing a chunk frees the storage's
// memory and leaves the storage empty, gathering it again refills the same storage (the way FSDP
// resizes a flat parameter's storage). So tensors autograd saved from a parameter (a stock
// Linear saves the transposed weight, a view) stay valid across the release, and the memory is
// really returned between a unit's forward and its backward. A hook on each of a unit's outputs
// gathers the unit again when backward reaches it; the unit is released as soon as every
// parameter of it has its gradient (Note [backward by gradients] in gradient_reducer.cc). Stages 0-2 keep
// full parameters on the device.
//
// Gradients: a hook after each parameter's gradient accumulation copies .grad into its chunk's
// fp32 gradient buffer and clears .grad; when every parameter of a chunk is in, the chunk is
// reduce-scattered (averaged over ranks) into each rank's shard and accumulated into the shard's
// grad block. The optimizer (CPU Adam/AdamW on the shards of master32 / exp_avg / exp_avg_sq,
// writing the new working copy) runs per chunk:
// - during backward, as soon as a chunk's gradients are complete, when the step's result cannot
//   depend on global conditions (no gradient clipping and no fp16 loss scaling);
// - otherwise after backward (deferred): the global gradient norm and the fp16 overflow flag are
//   reduced over every shard and rank first, then the chunks update in order with their states
//   prefetched. Deferring, not rolling back, keeps the result identical to a non-overlapped step.
// Either way the update equals torch.optim's step after a plain backward.
//
// Thread-safety: one thread drives the model's forward, Backward and Step. Errors inside forward
// and backward (I/O, collectives) surface as exceptions from the forward (the LibTorch boundary)
// and as Status from Backward / Step.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runtime/base/config.h"
#include "runtime/base/status.h"
#include "runtime/state/param_groups.h"

namespace strata {

class BlockStore;
class Communicator;
class Device;
struct EngineTestHooks;

struct EngineOptions {
  // The modules the engine manages as units, in the order they run; empty: the default split
  // (each child of the root holding parameters, looking through containers).
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  std::vector<std::string> nvme_path;  // overrides both offload nvme_path settings when set
  // Fault and delay injection (runtime/engine/engine_test_hooks.h); null outside tests.
  std::shared_ptr<const EngineTestHooks> test_hooks;
  // Parameter groups, as torch.optim's param_groups: each group's hyperparameters and its
  // parameters (the model's own tensors). Empty: one group, the config's "optimizer" section,
  // for every parameter. A trainable parameter in no group joins group 0; one in two groups is
  // refused. The config's bias_correction and Adam/AdamW choice hold for every group.
  struct ParamGroup {
    GroupHyperparameters hyper;
    std::vector<torch::Tensor> params;
  };
  std::vector<ParamGroup> param_groups;
  // The optimizer is the caller's (DeepSpeed's zero_allow_untested_optimizer): the engine keeps
  // the fp32 master and the gradients but no optimizer state and runs no update. At each
  // accumulation boundary BeginClientStep hands the caller this rank's master and gradient
  // shards, its optimizer updates the master in place, and FinishClientStep takes the new values
  // to the working copy. Stages 0-2 with nothing offloaded only: the caller's optimizer works on
  // the device's memory (refused otherwise, naming the setting).
  bool client_optimizer = false;
  // The caller runs each operator on fp16 CPU tensors in fp32 and rounds the result to fp16 (the
  // Python package's torch function mode, python/strata/cpu_half.py), so fp16.enabled may run on
  // the cpu device, where LibTorch has no fp16 kernels for matmul or LayerNorm. Off: refused.
  bool fp16_ops_in_fp32 = false;
  // The device, when the caller shares its ownership: every tensor over the engine's device
  // memory then keeps it alive. Such a tensor may outlive the engine (an autograd graph built by
  // a forward before the engine ended holds the parameters' views of a chunk), and its memory
  // goes back to the device when it dies. Null: the device must outlive every such tensor.
  std::shared_ptr<Device> device_owner;
};

// One optimizer step, as seen by every lane.
struct StepReport {
  int64_t step = 0;             // optimizer steps taken so far (skipped ones excluded)
  bool skipped = false;         // fp16 overflow: no update this step
  double lr = 0;
  double loss_scale = 1;
  double grad_norm = 0;         // global L2 norm of the unscaled gradients (0 on a skipped step;
                                // NaN when a non-finite gradient was applied, with no overflow check)
  // Wall time of the step's window: from the end of the previous Step (for the first step, its
  // first training forward) to the end of this one. It includes whatever the caller did between
  // steps, and deferred optimizer work runs inside it (Note [deferred optimizer]).
  double step_time_s = 0;
  // Busy time per lane (seconds) within the window. compute is the forward and backward spans
  // less the time they waited (stall_s).
  double compute_s = 0;
  double copy_s = 0;            // host<->device copies
  double comm_s = 0;            // collectives
  double nvme_s = 0;            // NVMe tier busy time (any I/O in flight)
  double optimizer_s = 0;       // CPU Adam, its state reads and write-backs included
  double stall_s = 0;           // compute waiting for parameters, states or updates
  double update_wait_s = 0;     // of stall_s: waiting for a deferred optimizer update
  // Derived by FillOverlap from the lanes above (compute, copy, comm, nvme, optimizer):
  double lane_sum_s = 0;        // sum of the lanes' busy time
  double longest_lane_s = 0;    // the busiest lane's
  // (lane_sum - step) / (lane_sum - longest): 0 when the lanes ran one after another, 1 when
  // everything ran under the longest lane; NaN (JSON null) when only one lane was busy.
  double overlap = 0;
  double compute_idle_share = 0;  // 1 - compute / step: the share of the step compute was idle
  void FillOverlap();
  uint64_t bytes_host_to_device = 0;
  uint64_t bytes_device_to_host = 0;
  uint64_t bytes_nvme_to_host = 0;
  uint64_t bytes_host_to_nvme = 0;
  uint64_t peak_device_bytes = 0;
  uint64_t peak_host_bytes = 0;  // engine-managed host memory (states and staging)
  uint64_t bytes_activations_stashed = 0;  // cpu_checkpointing: saved inputs sent to the host tier
  nlohmann::json ToJson() const;
};

class Engine {
 public:
  // Takes over `model`'s parameters: they are partitioned, their full storage is freed, and from
  // now on only the engine materializes them. `comm` and `device` must outlive the engine (the
  // device, also every tensor over its memory: EngineOptions::device_owner), and the model must
  // outlive it too (the engine keeps a reference). A start that fails on one of several ranks
  // gives up `comm` (Communicator::Abort): the other ranks' starts fail at once naming its
  // error, and the communicator serves no later engine. A communicator that failed earlier is
  // refused before anything is taken.
  static StatusOr<std::unique_ptr<Engine>> Create(std::shared_ptr<torch::nn::Module> model,
                                                  const Config& config, Communicator* comm,
                                                  Device* device, const EngineOptions& options = {});
  // A module with a forward: Engine::Forward(input) calls the model's own forward(input).
  static StatusOr<std::unique_ptr<Engine>> Create(torch::nn::AnyModule model, const Config& config,
                                                  Communicator* comm, Device* device,
                                                  const EngineOptions& options = {});
  template <class M>
  static StatusOr<std::unique_ptr<Engine>> Create(torch::nn::ModuleHolder<M> model, const Config& config,
                                                  Communicator* comm, Device* device,
                                                  const EngineOptions& options = {}) {
    return Create(torch::nn::AnyModule(model), config, comm, device, options);
  }
  static StatusOr<std::unique_ptr<Engine>> Create(torch::nn::Sequential model, const Config& config,
                                                  Communicator* comm, Device* device,
                                                  const EngineOptions& options = {}) {
    return Create(std::static_pointer_cast<torch::nn::Module>(model.ptr()), config, comm, device,
                  options);
  }
  ~Engine();

  // For a Sequential root: runs its children in order, each as a unit. For a model given as an
  // AnyModule: its own forward(input), which runs its units through strata::RunUnit. (A model
  // given as a plain Module pointer is called by the caller directly.) Throws std::runtime_error
  // with the Status text on failure.
  torch::Tensor Forward(const torch::Tensor& input);

  // The unit protocol RunUnit, CheckpointUnit and the Python front end drive. BeginUnit
  // materializes the unit's parameters (throws on failure); EndUnit releases them and, when
  // autograd records, hooks the outputs that require grad so that backward gathers the unit
  // again before entering it. `checkpointed`: the run records nothing for autograd (activation
  // checkpointing) but is part of training; backward recomputes it, and a BeginUnit during
  // Backward gathers the unit for that recomputation. Calls nest only for different units.
  void BeginUnit(int64_t unit, bool checkpointed = false);
  void EndUnit(int64_t unit, const std::vector<torch::Tensor>& outputs);
  int64_t num_units() const;
  // activation_checkpointing.cpu_checkpointing: CheckpointUnit hands its saved inputs to
  // StashActivations in forward and takes them back with RestoreActivations in backward. The
  // stash is the tier manager: one block per checkpoint slot of the step, in the host pool and,
  // when NVMe is configured, backed by NVMe so that a full host budget evicts it there; slots are
  // reused step after step, so the tier manager's trace prefetches them back in reverse order.
  // Without a host tier (nothing offloaded) the inputs wait as plain host tensors. Restore
  // consumes the handle.
  bool cpu_checkpointing() const;
  StatusOr<int64_t> StashActivations(const std::vector<torch::Tensor>& tensors);
  StatusOr<std::vector<torch::Tensor>> RestoreActivations(int64_t handle);
  std::string unit_name(int64_t unit) const;
  // Bytes of the device allocator in use now (the engine's device, all of its allocations), and
  // the most it has held.
  uint64_t device_bytes_in_use() const;
  uint64_t device_peak_bytes() const;
  // DeepSpeed's offload_states / reload_states (ZeRO stage 3, between steps): the device-resident
  // blocks of `kinds` are copied to host memory and their device memory freed; ReloadStates puts
  // every parked block back bit for bit. While states are parked the engine does not train (a
  // training forward or Step fails with FAILED_PRECONDITION naming reload_states). Offload
  // waits for the step's pending updates first; kinds placed off the device are left alone.
  // Both return the bytes moved.
  StatusOr<uint64_t> OffloadStates(const std::vector<StateKind>& kinds);
  StatusOr<uint64_t> ReloadStates();
  // Backward of `loss` (divided by gradient_accumulation_steps and multiplied by the fp16 loss
  // scale here, as DeepSpeed does) and the gradient reduction.
  Status Backward(const torch::Tensor& loss);
  // After a Backward that autograd ended with an error not the engine's (a Python hook's or a
  // custom Function's own exception), that exception, taken once; null otherwise. A binding
  // rethrows it, so the caller meets its own exception type (a KeyboardInterrupt stays one) as
  // plain autograd would give it. The Backward's Status says the same in words.
  std::exception_ptr TakeAutogradException();
  // Completes an optimizer step once gradient_accumulation_steps micro-steps have run; before
  // that it returns FAILED_PRECONDITION.
  StatusOr<StepReport> Step();
  // EngineOptions::client_optimizer: Step is refused; a boundary is BeginClientStep, the
  // caller's update of the master shards it returns, then FinishClientStep.
  struct ClientStep {
    bool skipped = false;  // a non-finite gradient under loss scaling: no update this step
    double grad_norm = 0;  // as StepReport::grad_norm
    float grad_scale = 1;  // the clip factor times the loss scale's inverse, already applied
    // Per parameter group, this rank's shard of it as (fp32 master, fp32 gradient) tensors on
    // the device, one pair per run of the group's elements in a chunk's shard (the same runs,
    // in the same order, at every step). The gradients are unscaled and clipped. Valid until
    // FinishClientStep; empty when skipped.
    std::vector<std::vector<std::pair<torch::Tensor, torch::Tensor>>> groups;
  };
  StatusOr<ClientStep> BeginClientStep();
  // apply: the master shards now hold the step's new values (or, skipped, are unchanged): the
  // working copy takes them, the step counts. !apply (the caller's update failed): the blocks
  // are released and nothing else happens; the master keeps whatever the caller wrote.
  StatusOr<StepReport> FinishClientStep(bool apply = true);
  // Per parameter group, the element counts of the runs BeginClientStep hands out.
  std::vector<std::vector<int64_t>> ClientSegments() const;
  // Every group's hyperparameters from the next step whose updates start on, in place of the
  // groups' own and the config schedule's lr (what a Python optimizer's param_groups hold at each
  // step: a client scheduler, or a loop that writes the lr itself); one entry per group, in
  // EngineOptions::param_groups' order, checked as ValidateGroup checks. A step takes the values
  // set when its updates start: in the last micro-step's Backward when updates overlap backward
  // (no clipping, no loss scaling), else in Step. Call it from the thread that calls Backward.
  Status SetGroupHyperparameters(const std::vector<GroupHyperparameters>& groups);
  int num_param_groups() const;

  // Writes the values the given parameters hold now (a gathered stage-3 parameter, or a stage
  // 0-2 parameter, changed by the caller) into this rank's partitions: the fp32 master and the
  // working copy, wherever they live (device, host, NVMe). Optimizer states are untouched.
  // Between steps only; collective when world_size > 1 (every rank calls it with the same
  // parameters holding the same values: the caller broadcasts first).
  Status WriteParameters(const std::vector<torch::Tensor>& params);

  // The full fp32 master values of every parameter, in registration order (collective when
  // world_size > 1: every rank must call it).
  StatusOr<std::vector<torch::Tensor>> GatherMasterParams();

  // One parameter's share of the states, for DeepSpeed's per-parameter API (safe_get_full_*,
  // safe_set_full_*, a ZeRO-3 parameter's ds_status and ds_tensor). `params` are tensors the
  // engine trains (any other is INVALID_ARGUMENT); `kind` is kMaster32, kExpAvg or kExpAvgSq
  // (a state the optimizer does not keep is FAILED_PRECONDITION naming it), and kParam16 under
  // stage 3 for LocalParamState. The lanes are quieted first.
  //
  // Where each parameter's working copy stands on this rank: always available below stage 3;
  // under it, available while its chunk is gathered, in flight while a gather ahead lands.
  enum class Residency { kAvailable, kNotAvailable, kInflight };
  StatusOr<std::vector<Residency>> ParamResidency(const std::vector<torch::Tensor>& params) const;
  // Each parameter's full value of `kind` in fp32, shaped as the parameter, from every rank's
  // shards (an empty `params`: all of them, in registration order). Collective when
  // world_size > 1: every rank calls it with the same parameters.
  StatusOr<std::vector<torch::Tensor>> GatherParamState(StateKind kind,
                                                        const std::vector<torch::Tensor>& params);
  // This rank's elements of it, flat and possibly empty: kParam16 in the working dtype, the
  // others in fp32. Local: no collective.
  StatusOr<std::vector<torch::Tensor>> LocalParamState(StateKind kind,
                                                       const std::vector<torch::Tensor>& params);
  // Writes each full value (as many elements as its parameter) into this rank's shard of
  // `kind`, between steps. For kMaster32 the working copy follows, as WriteParameters does
  // (collective: every rank, the same values); a moment is this rank's write alone.
  Status WriteParamState(StateKind kind, const std::vector<torch::Tensor>& params,
                         const std::vector<torch::Tensor>& values);

  // Saves this rank's partitions and the training state into `dir` atomically; loads them back.
  // A save is taken between steps and after forwards alone (the state the last Step left); once
  // a backward has run in the step it is refused. A load is taken between steps only. `extra` is
  // stored in the manifest and returned by Load (data position, RNG, ...). `client_file`, when not
  // empty, is saved beside this rank's manifest (its size and crc32c in it) and published with the
  // rest: the caller's own per-rank state, such as a client optimizer's. ReadClientFile returns it
  // from a checkpoint, checked against the manifest. The parameters no unit trains (frozen at
  // the start) are saved once, by rank 0, unless `with_frozen` is false (DeepSpeed's
  // exclude_frozen_parameters); a load restores those the checkpoint holds on every rank and
  // leaves the others as they are.
  Status SaveCheckpoint(const std::string& dir, const nlohmann::json& extra,
                        const std::string& client_file = {}, bool with_frozen = true);
  StatusOr<std::string> ReadClientFile(const std::string& dir);
  // What a load restores. kAll: everything saved. kWeights: the fp32 masters (and the working
  // copy from them), the module buffers and the frozen parameters; the optimizer states, step
  // counters and loss scale keep their current values (DeepSpeed's load_module_only).
  // kWeightsAndCounters: kWeights and the step counters, which the config's schedule follows;
  // the optimizer states and loss scale keep theirs, and the optimizer's bias corrections go on
  // counting its own steps (DeepSpeed's load_optimizer_states=False).
  enum class LoadParts { kAll, kWeights, kWeightsAndCounters };
  StatusOr<nlohmann::json> LoadCheckpoint(const std::string& dir,
                                          LoadParts parts = LoadParts::kAll);

  int64_t global_step() const;
  int64_t micro_step() const;
  // The dynamic loss scale the next backward multiplies the loss by (fp16); 1 without scaling.
  double loss_scale() const;
  int64_t num_parameters() const;  // elements, padding excluded
  // Bytes of model state (params + grads + optimizer states) over all ranks, padding excluded.
  uint64_t model_state_bytes() const;
  nlohmann::json Describe() const;  // placement, chunking and sizes, for logs

  // Lane tracing: while on, every lane's spans (forward, backward, waits, copies, collectives,
  // NVMe busy intervals, each chunk's Adam) are recorded; TraceJson returns them all as a
  // Chrome/Perfetto trace-event document. Meant for a few steps: spans stay in memory.
  void SetTracing(bool on);
  nlohmann::json TraceJson() const;

  class Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The LibTorch device that compute on `device` runs on: cuda:N for a CUDA device, cpu for the
// CPU device. The engine keeps the model's parameters and buffers there; inputs and targets must
// be there too (`batch.to(TorchDevice(*device))`).
torch::Device TorchDevice(const Device& device);

}  // namespace strata
