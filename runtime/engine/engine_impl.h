// Engine::Impl: the engine facade's wiring and the compute thread's state. Each other room is a
// class that owns its state (its header says what it owns, what it borrows and its thread rules):
//   StepPlan           runtime/state/step_plan.h  the mode decisions, placements, state formats and
//                                                 block sizes (a value, made once in Init)
//   ChunkTable         chunk_table.h        each chunk's working copy and residency on the device
//   UnitCoordinator    unit_coordinator.h   the units, the order they ran in, reuse and prefetch
//   ChunkMaterializer  chunk_materializer.h stage 3's chunks installed, filled, held and dropped
//   GatherLane         gather_lane.h        stage 3's shards copied into their chunks ahead of use
//   GradientReducer    gradient_reducer.h   a complete chunk gradient's collective and hand-off
//   ReduceLane         reduce_lane.h        the reducer's thread, all-gathers ahead in one queue
//   ChunkUpdater       chunk_updater.h      one chunk's update, every optimizer and state layout
//   OptimizerLane      optimizer_lane.h     chunk updates in order, the step's inputs
//   PublishLane        publish_lane.h       a host optimizer's new values taken to the device
//   ActivationStash    activation_stash.h   checkpointed units' saved inputs in the tier manager
//   StepMeter          step_meter.h         one window's timing and byte counters, the lane trace
//   ClientStepSession  client_step_session.h  one step of a client optimizer
// Impl's own methods, by file: engine.cc (the facade, reports), engine_init.cc (Init and its
// named steps), unit_discovery.cc (units by unit_rule.h, the partitioner, chunk maps),
// initial_blocks.cc, unit_protocol.cc (micro-steps, BeginUnit/EndUnit, forward), backward.cc,
// engine_step.cc (Step), client_step.cc, engine_checkpoint.cc, param_state.cc (per-parameter
// reads and writes), state_offload.cc (offload_states).
// Private to runtime/: nothing outside the engine includes it.
#pragma once
#include "runtime/engine/engine.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <utility>

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>
#include <tbb/task_arena.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "optim/cpu_adam.h"
#include "optim/loss_scaler.h"
#include "runtime/base/check.h"
#include "runtime/base/device.h"
#include "runtime/base/host_info.h"
#include "runtime/base/logging.h"
#include "runtime/base/units.h"
#include "runtime/comm/communicator.h"
#include "runtime/engine/activation_stash.h"
#include "runtime/engine/chunk_materializer.h"
#include "runtime/engine/chunk_table.h"
#include "runtime/engine/chunk_updater.h"
#include "runtime/engine/client_step_session.h"
#include "runtime/engine/comm_memory.h"
#include "runtime/engine/compute_dtype.h"
#include "runtime/engine/compute_fence.h"
#include "runtime/engine/engine_state.h"
#include "runtime/engine/engine_test_hooks.h"
#include "runtime/engine/gather_lane.h"
#include "runtime/engine/gradient_reducer.h"
#include "runtime/engine/lane_trace.h"
#include "runtime/engine/optimizer_lane.h"
#include "runtime/engine/publish_lane.h"
#include "runtime/engine/reduce_lane.h"
#include "runtime/engine/run_unit.h"
#include "runtime/engine/start_rollback.h"
#include "runtime/engine/step_meter.h"
#include "runtime/engine/unit_coordinator.h"
#include "runtime/engine/zero_init.h"
#include "runtime/state/start_disk.h"
#include "runtime/state/block_store.h"
#include "runtime/state/checkpoint.h"
#include "runtime/state/lr_schedule.h"
#include "runtime/state/partitioner.h"
#include "runtime/state/step_plan.h"
#include "tiers/host/staging_buffer.h"
#include "tiers/nvme/crc32c.h"
#include "tiers/nvme/nvme_tier.h"

namespace strata {
namespace engine_detail {

using Clock = std::chrono::steady_clock;

inline double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

[[noreturn]] inline void Throw(const Status& s) { throw std::runtime_error(s.ToString()); }

}  // namespace engine_detail

class Engine::Impl {
 public:
  Impl(std::shared_ptr<torch::nn::Module> model, const Config& config, Communicator* comm,
       Device* device)
      : model_{std::move(model), std::nullopt}, config_(config), comm_(comm), device_(device) {}
  ~Impl();

  Status Init(Engine* owner, const EngineOptions& options);
  // After a failed Init: gives the model back what the start took (StartRollback), marks the
  // parameters whose values went with it, and says which happened, for the start's error ("" when
  // the start had taken nothing). Idempotent; ~Impl calls it too.
  std::string AbandonStart();
  torch::Tensor Forward(const torch::Tensor& input);
  void BeginUnit(int64_t u, bool checkpointed);
  void EndUnit(int64_t u, const std::vector<torch::Tensor>& outputs);
  Status Backward(const torch::Tensor& loss);
  std::exception_ptr TakeAutogradException() {
    return std::exchange(step_.autograd_exception, nullptr);
  }
  StatusOr<StepReport> Step();
  Status SetGroupHyperparameters(const std::vector<GroupHyperparameters>& groups);
  int num_param_groups() const { return static_cast<int>(groups_.hyper.size()); }
  Status WriteParameters(const std::vector<torch::Tensor>& params);  // param_state.cc
  // offload_states / reload_states (state_offload.cc).
  StatusOr<uint64_t> OffloadStates(const std::vector<StateKind>& kinds);
  StatusOr<uint64_t> ReloadStates();
  Status CheckStatesResident(const char* what) const;
  // CheckStatesResident, and FAILED_PRECONDITION naming the checkpoint while a load cut short
  // left the state part saved, part the run's own (Note [a load cut short]): training forwards,
  // Backward, Step and saves.
  Status CheckStateWhole(const char* what) const;
  // FAILED_PRECONDITION, naming `what`, while a step is open (a training forward ran since the
  // last Step), with the ways out (engine_step.cc).
  Status CheckBetweenSteps(const char* what) const;
  // The same for a reader of the step's starting state (SaveCheckpoint), which may also run
  // after forwards alone: only a backward since the last Step refuses it (engine_step.cc).
  Status CheckNoBackwardSinceStep(const char* what) const;
  // FAILED_PRECONDITION when `key` (read or written as `wanted`) is offloaded.
  Status CheckBlockResident(const BlockKey& key, StateKind wanted) const;
  // Per-parameter state (param_state.cc).
  StatusOr<std::vector<torch::Tensor>> GatherMasterParams();
  StatusOr<std::vector<torch::Tensor>> GatherParamState(StateKind kind,
                                                        const std::vector<torch::Tensor>& params);
  StatusOr<std::vector<torch::Tensor>> LocalParamState(StateKind kind,
                                                       const std::vector<torch::Tensor>& params);
  Status WriteParamState(StateKind kind, const std::vector<torch::Tensor>& params,
                         const std::vector<torch::Tensor>& values);
  StatusOr<std::vector<Engine::Residency>> ParamResidency(
      const std::vector<torch::Tensor>& params) const;
  Status Save(const std::string& dir, const nlohmann::json& extra, const std::string& client_file,
              bool with_frozen);
  StatusOr<std::string> ReadClientFile(const std::string& dir);
  // EngineOptions::client_optimizer (client_step.cc).
  StatusOr<Engine::ClientStep> BeginClientStep();
  StatusOr<StepReport> FinishClientStep(bool apply);
  std::vector<std::vector<int64_t>> ClientSegments() const;
  StatusOr<nlohmann::json> Load(const std::string& dir, Engine::LoadParts parts);
  nlohmann::json LayoutJson() const;  // Manifest::layout of this rank
  // Save's and Load's phases (engine_checkpoint.cc): the temporary folder made afresh (Note
  // [saving over a step]), the manifest's header, the states and buffers streamed into the rank's
  // file, the folder published; the manifest checked against this run, the buffers and blocks
  // read back and checked. SavedBytes: a chunk's shard of a saved state.
  Status PrepareSaveDir(const std::string& root, const std::string& name);
  checkpoint::Manifest NewManifest(const nlohmann::json& extra) const;
  Status WriteStateFile(const std::string& bin, checkpoint::Manifest* m, bool with_frozen,
                        uint64_t* bytes_written);
  Status PublishSave(const std::string& root, const std::string& name);
  // One phase of a save, agreed over the ranks: when any rank's `own` failed, every rank
  // returns an error (its own, or one naming the highest failing rank and `what` it could not
  // do), so that none waits in a later collective for a rank that has left the save.
  Status AgreeOnSave(Status own, const std::string& dir, const char* what);
  Status CheckManifestFits(const checkpoint::Manifest& m, const std::string& dir) const;
  // The loss scaler's saved state, checked; none when the checkpoint was saved without fp16
  // (Note [a saved loss scale]).
  StatusOr<std::optional<optim::DynamicLossScaler::State>> SavedScalerState(
      const checkpoint::Manifest& m, const std::string& mpath) const;
  Status ReadSavedBuffers(int fd, const std::string& bin, const checkpoint::Manifest& m,
                          const std::string& mpath, std::vector<torch::Tensor>* out);
  Status ReadSavedBlocks(int fd, const std::string& bin, const checkpoint::Manifest& m,
                         const std::string& mpath, bool weights_only);
  // Another chunk layout saved them (Note [loading another chunk layout]): each shard filled by
  // parameter from the saving ranks' files (SavedStateReader), then encoded in this layout.
  bool SameChunks(const checkpoint::Manifest& m) const;
  // SameChunks, sharded over as many ranks: this rank's file holds its shards as they are.
  bool SameShards(const checkpoint::Manifest& m) const;
  // The micro-step a run resumes at: the saved one, in this run's accumulation windows.
  int64_t ResumedMicroStep(const checkpoint::Manifest& m, const std::string& mpath) const;
  Status ReadRelaidBlocks(const std::string& dir, const checkpoint::Manifest& m, bool weights_only);
  // A loaded master or moment block of chunk c, in this run's layout, into its home.
  Status WriteLoadedBlock(int64_t c, StateKind kind, const std::vector<char>& bytes);
  uint64_t SavedBytes(int64_t c, StateKind kind) const;

  int64_t global_step() const { return step_.global_step; }
  int64_t micro_step() const { return step_.micro_step; }
  double loss_scale() const { return step_.scaler ? step_.scaler->scale() : 1.0; }
  // The model came with its forward (Engine::Create's AnyModule overload).
  void SetForward(torch::nn::AnyModule any) { model_.any = std::move(any); }
  nlohmann::json Describe() const;
  int64_t num_params() const { return partitioner_ ? partitioner_->param_numel() : 0; }
  uint64_t model_state_bytes() const;
  int64_t num_units() const { return units_.size(); }
  std::string unit_name(int64_t u) const { return units_.name(u); }
  uint64_t device_bytes() const { return device_->allocated(); }
  uint64_t device_peak_bytes() const { return device_->peak_allocated(); }
  bool cpu_checkpointing() const { return config_.activation_checkpointing.cpu_checkpointing; }
  // Lane trace (lane_trace.h): spans are recorded while armed.
  void SetTracing(bool on) { meter_.trace.Arm(on); }
  nlohmann::json TraceJson() const { return meter_.trace.ToJson(); }
  // Activation stash (activation_stash.h).
  StatusOr<int64_t> StashActivations(const std::vector<torch::Tensor>& tensors) {
    return stash_->Stash(tensors);
  }
  StatusOr<std::vector<torch::Tensor>> RestoreActivations(int64_t handle) {
    return stash_->Restore(handle);
  }

 private:
  // LibTorch hands out a parameter's AccumulateGrad node as a shared_ptr (1.13, 2.6) or as an
  // intrusive_ptr (2.14); holding whatever it returns keeps the engine building on each.
  using GradAccumulatorRef =
      decltype(torch::autograd::impl::grad_accumulator(std::declval<const torch::Tensor&>()));
  struct ParamInfo {
    torch::Tensor tensor;
    std::vector<int64_t> shape;
    std::vector<int64_t> units;                 // every unit that holds it (tied: several)
    GradAccumulatorRef acc;                      // its AccumulateGrad node, kept alive for the hook
    // This micro-step (Note [backward by gradients]): whether a plain (not checkpointed) unit run
    // used it, how many checkpointed runs did, how many gradient deliveries came, and whether
    // its gradient is complete.
    bool plain_use = false;
    int checkpointed_uses = 0;
    int arrivals = 0;
    bool grad_in = false;
  };

  // Device memory counted against the device budget, owned by the returned tensor: the memory
  // returns to the allocator when the last view of it dies.
  StatusOr<torch::Tensor> DeviceTensor(int64_t numel, torch::Dtype dtype);
  torch::TensorOptions DeviceOptions(torch::Dtype dtype) const;
  // Where a state's blocks live: the param16 shard with the parameters, every other state with
  // the optimizer.
  // Host code's only way into a block's bytes (Note [device blocks]): a device-placed block is
  // device memory, moved by the copy stream; a host or NVMe-staged block is host memory.
  // WriteBlockBytes with a null `src` zero-fills. Both return once the bytes have landed.
  Status ReadBlockBytes(void* dst, const void* block, size_t bytes, Placement where);
  // comm_memory.h's, with this engine's communicator and device.
  Status OnCommMemory(torch::Tensor& host, const std::function<Status(void*)>& collective) {
    return strata::OnCommMemory(*comm_, *device_, host, collective);
  }
  Status WriteBlockBytes(void* block, const void* src, size_t bytes, Placement where);

  // Init's steps, in the order Init runs them (engine_init.cc; DiscoverUnits in engine.cc).
  ComputeDtypeChoice ChooseDtype() const;
  Status DiscoverUnits(const EngineOptions& options, optim::DType compute_dtype);
  // DiscoverUnits' parts (unit_discovery.cc).
  StatusOr<std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>> UnitModules(
      const EngineOptions& options) const;
  Status AddUnit(const std::string& name, std::shared_ptr<torch::nn::Module> module,
                 const std::vector<std::pair<std::string, torch::Tensor>>& named, bool always_live,
                 Partitioner& part, std::map<const c10::TensorImpl*, int64_t>& seen);
  void MapUnitsToChunks();
  Status GroupParameters(const EngineOptions& options);  // param_groups.h; engine_init.cc
  Status MakePlan(const EngineOptions& options, optim::DType compute_dtype);
  Status StartStreamsAndArena();
  Status OpenNvmeTier(const EngineOptions& options);
  std::vector<std::string> NvmePaths(const EngineOptions& options) const;
  // zero::Init's staged space on the file system of `nvme_path`, chunk by chunk, by when the
  // start gives it back (Note [start's disk]). Empty when none is there.
  std::vector<ChunkStaging> StagedSpaceOn(const std::string& nvme_path) const;
  static uint64_t TotalOf(const std::vector<ChunkStaging>& staged);
  Status OpenBlockStore();
  Status PlaceBuffers();
  // Stage 3: refuses a start whose largest unit cannot be gathered on the device at all (Note [a
  // unit that cannot fit] in engine_init.cc). Runs before any block is written.
  Status CheckUnitsFitDevice() const;
  Status WriteInitialBlocks();
  Status MakeLanes();
  Status HookModel();
  void StartLanes();
  // Stages 0-2: parameters still viewing a chunk get their own copy of its working values.
  void GiveChunkViewsTheirOwnMemory();
  Status HookGradients();
  Status GatherUnit(int64_t u);
  void ReleaseUnit(int64_t u, int64_t reuse_distance);
  void PrefetchUnits(size_t trace_pos, int direction);
  void OpenMicroStep();
  void OnUnitBackwardReach(int64_t u);
  void OnParamGrad(int64_t pid);
  // Takes a delivery of a parameter's gradient; `settle` completes it whatever came.
  Status TakeParamGrad(int64_t pid, bool settle);
  // Chunk c's whole gradient in fp32 on the device, zeroed; a device without room for it is named
  // with the chunk and the size.
  StatusOr<torch::Tensor> ChunkGradient(int64_t c);
  // Hands chunk c's complete gradient to the reduce lane (Note [reduce lane]).
  Status ReduceChunk(int64_t c);
  Status ShareUpdatedShards();
  // param_state.cc's parts: the engine's index of each parameter tensor; this rank's shard of
  // chunk c's state `kind` in fp32; the shard with `values` (parameter, full fp32 value)
  // written where they overlap it (the patched shard to `shard_out` when given); the masters
  // written and the working copy following them.
  StatusOr<std::vector<int64_t>> ParamIds(const std::vector<torch::Tensor>& tensors) const;
  Status ReadShard(int64_t c, StateKind kind, float* out);
  Status PatchShard(int64_t c, StateKind kind,
                    const std::vector<std::pair<int64_t, torch::Tensor>>& values,
                    std::vector<float>* shard_out);
  Status WriteMasters(
      const std::map<int64_t, std::vector<std::pair<int64_t, torch::Tensor>>>& by_chunk);
  // Chunk c's working copy from its fp32 master shard: rounded to the working precision and
  // published, as after an update.
  Status PublishMaster(int64_t c, const std::vector<float>& master);

  // Optimizer lane (optimizer_lane.h): chunk c's update queued once its states' reads started.
  void EnqueueOptimizer(int64_t c);
  Status DrainOptimizer() { return opt_lane_->Drain(); }
  // Note [deferred optimizer]: blocks until chunk c's queued update (if any) has finished,
  // moving it to the head of the queue first; returns the lane's error if an update failed.
  // The wait counts as the compute lane's stall unless `waited` (another lane's) is given.
  Status WaitChunkUpdated(int64_t c, double* waited = nullptr);
  // Stage 3: chunk c's parameters get their shapes (gathered) or 0 elements (Note [released
  // parameters]); the materializer calls it as it installs and drops the chunk.
  void ShowChunkParams(int64_t c, bool gathered);

  // Reduce lane (Note [reduce lane]; the lane itself: reduce_lane.h).
  // The same wait outside a micro-step (Step, checkpoints, master values), before a collective
  // of the compute thread's own: a training forward may have left all-gathers issued ahead on
  // the lane. Leaves the lane's errors for DrainReductions.
  void WaitReduceLaneQuiet() { reducer_->WaitQuiet(); }
  // Compute thread: waits until every queued reduction has finished (before a collective of its
  // own, and at the end of Backward); returns and clears the lane's first failure.
  Status DrainReductions();
  // Every queued update finished (checkpoints, master values, a new step's global scan).
  Status FinishUpdates() {
    WaitReduceLaneQuiet();
    materializer_->FinishAllFills();
    Status f = materializer_->TakeGatherError();
    Status d = DrainOptimizer();
    if (d.ok()) return f;
    if (!f.ok()) STRATA_LOG(ERROR) << f;  // the failed update is the error reported
    return d;
  }
  // The same wait, leaving a failed update's error for the Step (or checkpoint) that reports it:
  // for readers that only need the lanes quiet (GatherMasterParams).
  void QuietLanes() {
    WaitReduceLaneQuiet();
    materializer_->FinishAllFills();
    opt_lane_->WaitIdle();
  }
  // The order the next forward needs chunks in: those that stay gathered across steps (the
  // root's own, persistent ones; Step refills them) first, then `trace`'s units', then any others.
  std::vector<int64_t> UpdateOrder(const std::vector<int64_t>& trace) const;
  // Step's parts, shared with FinishClientStep (engine_step.cc): the boundary check, the global
  // norm and overflow flag, the gradients' scale (clip factor times the loss scale's inverse),
  // and what follows the updates (the scaler, the step count, the working copy, the report).
  Status CheckStepBoundary() const;
  Status GlobalGradStats(double* norm, bool* nonfinite);
  float GradScale(double norm) const;
  StatusOr<StepReport> CompleteStep(StepReport rep, bool overflow);
  // Starts a new reporting window: the lanes' counters restart from zero.
  void ResetLanes();

  int64_t trace_step() const { return step_.global_step + 1; }
  bool last_micro_step() const {
    return (step_.micro_step + 1) % config_.gradient_accumulation_steps == 0;
  }

  EngineModel model_;
  Engine* owner_ = nullptr;
  bool started_ = false;  // Init went through: a failed start marks its chunks so (~Impl)
  // What a start that fails part-way gives back (start_rollback.h): filled by PlaceBuffers and
  // WriteInitialBlocks, committed once Init went through.
  StartRollback rollback_;
  bool abandoned_ = false;  // AbandonStart ran
  // Expires first thing in ~Impl. The hooks EndUnit leaves on a forward's outputs belong to its
  // autograd graph, which the caller may keep past the engine: they hold this, weakly, and
  // refuse a backward of an engine that has ended instead of calling into freed memory.
  std::shared_ptr<const bool> alive_ = std::make_shared<const bool>(true);
  EngineTestHooks hooks_;  // EngineOptions::test_hooks' (none outside tests)
  // EngineOptions::client_optimizer (client_step_session.h): the open step, made in
  // OpenBlockStore.
  std::unique_ptr<ClientStepSession> client_;
  Config config_;
  Communicator* comm_;
  Device* device_;
  std::shared_ptr<Device> device_owner_;  // EngineOptions::device_owner: kept by DeviceTensor's
  EngineStreams streams_;  // engine_state.h
  std::unique_ptr<nvme::NvmeTier> nvme_;
  // The NVMe tier asked for less free disk than its state, counting on the staging file's space
  // (OpenNvmeTier); WriteInitialBlocks then checks that the space comes back.
  bool nvme_counts_on_staging_ = false;
  std::unique_ptr<BlockStore> store_;
  std::optional<Partitioner> partitioner_;
  // The step's mode decisions (runtime/state/step_plan.h), made once in Init.
  StepPlan plan_;
  StepState step_;  // engine_state.h

  std::vector<ParamInfo> params_;
  // The units and the order they ran in (unit_coordinator.h).
  UnitCoordinator units_;
  std::vector<std::pair<std::string, torch::Tensor>> buffers_;  // unique, in registration order
  // The parameters no unit trains (requires_grad false at the start), unique, in registration
  // order: placed and saved beside the buffers.
  std::vector<std::pair<std::string, torch::Tensor>> frozen_;
  // Each chunk's working copy and residency (chunk_table.h): the compute thread's.
  ChunkTable chunks_;

  // Checkpointed units' saved inputs (activation_stash.h): made with the block store, used from
  // the caller's thread.
  std::unique_ptr<ActivationStash> stash_;

  // The reporting window's counters and the lane trace (step_meter.h). A window opens at the end
  // of each Step (or, before the first, at the first training forward), so that work a deferred
  // update does between steps counts in the window it ran in.
  StepMeter meter_;

  // One chunk's update, for every optimizer (chunk_updater.h); it owns the publish lane.
  std::unique_ptr<ChunkUpdater> updater_;
  // The lanes (each owns its thread, queue, lock and counters; see its header). Made by
  // MakeLanes, stopped in ~Impl: reduce first (its jobs queue updates), then the optimizer, then
  // publish (the optimizer's last update may submit a copy), then gather.
  std::unique_ptr<OptimizerLane> opt_lane_;
  // The gradient reducer (gradient_reducer.h); it owns the reduce lane.
  std::unique_ptr<GradientReducer> reducer_;
  // Stage 3's chunks in and out of device memory (chunk_materializer.h); it owns the gather
  // lane. Made in OpenBlockStore (WriteInitialBlocks installs through it), its lanes in MakeLanes.
  std::unique_ptr<ChunkMaterializer> materializer_;
  GroupLayout groups_;  // engine_state.h
  // The blocks offload_states took off the device, with their bytes (state_offload.cc).
  struct ParkedBlock {
    BlockKey key;
    std::vector<uint8_t> bytes;
  };
  std::vector<ParkedBlock> parked_;
  // The inputs of the step whose updates are about to start, handed to the (idle) optimizer
  // lane: the step, the gradient scale, each group's hyperparameters (engine_step.cc).
  void FixStepInputs(int64_t step, float grad_scale);
};

}  // namespace strata
