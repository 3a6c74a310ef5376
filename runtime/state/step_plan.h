// StepPlan: the engine's mode decisions, made once before anything is allocated and read-only
// after: the precision (compute and optimizer-state dtypes, loss scaling), where each state kind
// lives (device, pinned host, NVMe), which states the optimizer keeps, what this rank keeps of each
// (the stage's sharding), whether updates run during backward, in Step or beside the next forward,
// whether the fp32 master is the working copy itself, and the sizes the tiers must offer (the host
// pool's budget, the NVMe bytes). Every combination the engine cannot run is refused here, naming
// the settings and the fix, so the rest of the engine reads decisions instead of re-deriving them.
//
// A value: copyable, no LibTorch, no device access; Make is a pure function of its inputs (the
// truth table in tests/runtime/step_plan_test.cc). Thread-safety: const after Make.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "optim/compact_step.h"
#include "optim/dtype.h"
#include "runtime/base/config.h"
#include "runtime/base/device.h"
#include "runtime/base/status.h"
#include "runtime/state/block_store.h"
#include "runtime/state/partitioner.h"
#include "runtime/state/placement_plan.h"
#include "runtime/state/state_layout.h"

namespace strata {

class StepPlan {
 public:
  struct Inputs {
    const Config* config = nullptr;
    DeviceKind device_kind = DeviceKind::kCpu;
    std::string device_name;           // for messages
    bool device_usable = true;         // false: a CUDA device LibTorch cannot reach
    optim::DType compute_dtype = optim::DType::kFloat32;  // ChooseComputeDtype's
    int world_size = 1;
    int rank = 0;
    bool comm_moves_host_memory = true;  // Gloo or single; NCCL moves device memory
    std::string comm_backend;            // for messages
    bool client_optimizer = false;       // EngineOptions::client_optimizer
    bool loss_scaling_option = false;    // EngineOptions::loss_scaling (tests)
    bool sgd_momentum = false;           // some parameter group has momentum
    bool fp16_ops_in_fp32 = false;       // EngineOptions::fp16_ops_in_fp32
    const Partitioner* partitioner = nullptr;  // finalized: the chunks
    // strata.placement auto: what this machine has (0: unknown), measured by the caller.
    uint64_t device_capacity = 0;  // the device's memory for this rank (Device::capacity)
    uint64_t host_available = 0;   // MemAvailable
    // A planner's host tier, used as is where strata.host_memory_budget is 0 (strata-tune's
    // budget, less what its run needs beside the pool); 0: MemAvailable less its margin.
    uint64_t host_capacity = 0;
    // Free bytes at the NVMe path; over several (striped) paths, what their shares can hold:
    // nvme_paths x the least free per path over their file systems.
    uint64_t disk_free = 0;
    int nvme_paths = 1;
    // Of a staging file on that file system (zero::Init's), the bytes the engine's start gives
    // back as it reads the file: the NVMe tier may take them too (Note [start's disk]).
    uint64_t disk_given_back = 0;
    bool nvme_path_given = false;  // an nvme_path (section or EngineOptions) exists
    // A planner's flags that gave the figures above (strata-estimate's "--hbm", "--host",
    // "--disk"): a refusal names them, not the config key or the measure each stands in for.
    std::string device_flag, host_flag, disk_flag;
  };
  // Refuses (INVALID_ARGUMENT, FAILED_PRECONDITION) what cannot run, naming the settings.
  static StatusOr<StepPlan> Make(const Inputs& in);
  // The part of Make's refusals that needs only the config and the device: fp16 on the cpu
  // device without a frontend that computes fp16 operators in fp32. A tool checks it before it
  // builds (or stages) a model that the engine would then refuse.
  static Status CheckPrecisionOnDevice(const Config& config, DeviceKind device_kind,
                                       bool fp16_ops_in_fp32);
  // The chunk layout of a run of `config` whose states are sharded over `shard_world` ranks and
  // whose working copy takes `element_size` bytes an element: the engine and the estimator
  // partition with it, so their chunks are the same. Under 8-bit moments every parameter starts
  // at an optim::kInt8Block boundary (shards are whole blocks already, 4 KiB): each 8-bit block
  // then holds one parameter's elements at the same positions whatever the chunk size or rank
  // count, so the blocks' scales, and the run, depend on neither; and no block mixes a small
  // parameter with a large one's scale. (Checkpoints of other layouts load by parameter:
  // SavedStateReader.)
  static PartitionerOptions ChunkLayout(const Config& config, int shard_world, int element_size);

  int stage() const { return stage_; }
  bool stage3() const { return stage_ == 3; }
  // The rank and world the states are sharded over (stage 0 keeps everything on every rank).
  int shard_rank() const { return stage_ == 0 ? 0 : rank_; }
  int shard_world() const { return stage_ == 0 ? 1 : world_; }

  optim::DType compute_dtype() const { return compute_dtype_; }
  // The moments' element type for the formats with one (fp32, bf16); int8 moments are blocks
  // (moment_format, BlockBytes).
  optim::DType state_dtype() const { return state_dtype_; }
  // Note [compact layouts]: bf16.bf16_master_weights_and_grads keeps the master as bf16 (rounded
  // stochastically unless strata.stochastic_rounding is false); strata.optimizer_state_dtype
  // int8 keeps the moments as 8-bit blocks. Either runs the optimizer through
  // kernels::CompactAdamStep / CompactElementwiseStep: on the host optimizer, the CPU device's, or
  // the GPU's own kernels (the same bits on each).
  optim::MasterFormat master_format() const { return master_format_; }
  optim::MomentFormat moment_format() const { return moment_format_; }
  // SGD, Adagrad and Lion run every non-fp32 state through it too (their fast kernels are fp32).
  bool compact_optimizer() const {
    return master_format_ != optim::MasterFormat::kFp32 || moment_format_ == optim::MomentFormat::kInt8 ||
           (!adam_ && moment_format_ == optim::MomentFormat::kBf16);
  }
  // The gradient blocks' element type. DeepSpeed's bf16_master_weights_and_grads keeps them in
  // bf16 (each micro-step's fp32 shard rounded to nearest, accumulated in bf16) for Adam and
  // AdamW, whose kernels read bf16 gradients; SGD, Adagrad and Lion keep fp32 gradients (their
  // kernels take fp32). fp32 otherwise.
  optim::DType grad_dtype() const {
    return master_format_ != optim::MasterFormat::kFp32 && adam_ ? optim::DType::kBFloat16
                                                                 : optim::DType::kFloat32;
  }
  // The master's element type: fp32, or bf16 in the compact layouts.
  optim::DType master_dtype() const {
    return master_format_ == optim::MasterFormat::kFp32 ? optim::DType::kFloat32 : optim::DType::kBFloat16;
  }
  // The one rule for a state block's size: bytes of `kind` for a shard of `shard_numel`
  // elements (the working copy in the compute dtype, the gradient in grad_dtype, the master in
  // its dtype, the moments in their format). Every allocation, checkpoint entry and tier budget
  // asks here.
  uint64_t BlockBytes(StateKind kind, int64_t shard_numel) const;
  // How the master and moments are stored (state_layout.h); its Name() is what checkpoints
  // record as their "state_dtype".
  StateLayout layout() const {
    return {master_format_ != optim::MasterFormat::kFp32, moment_format_};
  }
  std::string StateLayoutName() const { return layout().Name(); }
  // The settings that would shrink this layout further, joined by "or" (narrower moments where
  // the optimizer keeps any, a bf16 master where it is fp32); empty for the smallest and for a
  // client optimizer. The placement's refusal offers them (PlacementPlan::Inputs::shrink_hint).
  std::string ShrinkHint() const;
  // fp16, or EngineOptions::loss_scaling: the loss is scaled and a step with a non-finite
  // gradient is skipped, so no update may start before the step's overflow flag is known.
  bool loss_scaling() const { return loss_scaling_; }
  // EngineOptions::client_optimizer: the caller's optimizer steps the lent shards.
  bool client_optimizer() const { return client_optimizer_; }

  // Where each (chunk, state) block lives (placement_plan.h): the sections' tiers, split by
  // offload_optimizer.ratio and offload_param.max_in_cpu, or filled under the budgets
  // (strata.placement: auto).
  const PlacementPlan& placement() const { return placement_; }
  Placement PlacementOf(int64_t c, StateKind kind) const { return placement_.Of(c, kind); }
  Placement ParamPlacement(int64_t c) const { return placement_.ParamOf(c); }
  // The sections as written (the floors of the placement plan), for reports.
  Placement param_section() const { return param_section_; }
  Placement optim_section() const { return optim_section_; }
  // Note [states the optimizer uses]: the master, param16 and grad always; exp_avg for Adam,
  // AdamW, Lion and SGD with momentum; exp_avg_sq for Adam, AdamW and Adagrad; neither with a
  // client optimizer. A state not kept has no blocks: no memory, no NVMe traffic, not in
  // checkpoints.
  bool HoldsState(StateKind k) const {
    return k == StateKind::kExpAvg ? holds_exp_avg_ : k == StateKind::kExpAvgSq ? holds_exp_avg_sq_ : true;
  }

  // Chunk c's optimizer is the device's own compute, on states in device memory: the GPU kernels
  // on CUDA, the CPU kernels on the CPU device's stream. Other chunks update on the host
  // optimizer (the optimizer lane), from host or NVMe homes.
  bool DeviceOptimizer(int64_t c) const { return placement_.OptimOf(c) == Placement::kDevice; }
  bool GpuOptimizer(int64_t c) const { return DeviceOptimizer(c) && device_kind_ == DeviceKind::kCuda; }
  bool any_device_optimizer() const { return placement_.AnyOptimIn(Placement::kDevice); }
  bool any_gpu_optimizer() const { return any_device_optimizer() && device_kind_ == DeviceKind::kCuda; }
  // A host optimizer's new values for a device-resident working copy go through the staging
  // slots and the publish lane (Note [pipelined publish]).
  bool StagedPublish(int64_t c) const {
    return !DeviceOptimizer(c) && (!stage3() || ParamPlacement(c) == Placement::kDevice);
  }
  bool any_staged_publish() const { return any_staged_publish_; }
  // Note [shared master]: under stage 3 with fp32 compute the working shard (param16) holds the
  // same bits as the fp32 master, so when both live in the same tier the master is not stored
  // twice: the param16 block is the master, which saves a chunk's worth of memory (on the device
  // too) and, off the device, of write-back and read per update. The checkpoint format is
  // unchanged (its "master32" entries are read from and written to this block).
  // A bf16 master (Note [compact layouts]) is likewise the bf16 working shard itself.
  bool MasterIsParam(int64_t c) const { return placement_.MasterSharesParam(c); }
  // Where the masters live, for logs: "param16 (shared)", "master32", or "mixed (k of n chunks
  // share)".
  std::string MasterStorageName() const;
  // Chunk c has a block of `kind`: param16 under stage 3, the master unless it is the param16
  // block, the moments the optimizer keeps, the gradient always.
  bool Stored(int64_t c, StateKind kind) const;
  BlockKey MasterKey(int64_t c) const {
    return {c, MasterIsParam(c) ? StateKind::kParam16 : StateKind::kMaster32};
  }
  // Updates run during backward: nothing global (clipping, loss scaling) gates them.
  bool immediate_optimizer() const { return immediate_; }
  // Note [deferred optimizer]: updates that wait for a global condition run after Step returns,
  // beside the next forward. Only under stage 3 (below it a caller may read the parameters right
  // after Step).
  bool defer_updates() const { return defer_; }
  // "backward", "next-forward" or "in-step".
  const char* OptimizerOverlapName() const;
  // Stages 0 and 1: every rank keeps the whole gradient until the step.
  bool full_gradients() const {
    return !stage_plan_.sharded[static_cast<int>(StateKind::kGrad)];
  }
  const StagePlan& stage_plan() const { return stage_plan_; }

  // The pinned host pool: its budget (0: no pool), of which the host-placed blocks take
  // host_only_bytes, the pool's resident region (PoolResidentBytes each: Note [resident region]
  // in tiers/host/pinned_pool.cc); the rest is the arena for NVMe blocks (power-of-two classes).
  uint64_t host_budget() const { return host_budget_; }
  uint64_t host_only_bytes() const { return host_only_bytes_; }
  // Bytes this rank's NVMe-placed blocks need on disk (0: nothing on NVMe), before the
  // activation stash's share.
  uint64_t nvme_bytes() const { return nvme_bytes_; }
  // Chunk c's share of nvme_bytes(): its NVMe-placed blocks, each rounded to 4 KiB.
  uint64_t ChunkNvmeBytes(int64_t c, int64_t shard_numel) const;

  // Per state kind: sharded, and the bytes this rank keeps.
  nlohmann::json ToJson() const;

 private:
  Status ChoosePlacement(const Inputs& in);
  Status AutoBudgets(const Inputs& in, PlacementPlan::Inputs* pin) const;
  std::string LayoutKeys() const;
  Status ChooseLayout(const Inputs& in);
  void SizeTiers(const Inputs& in);

  int stage_ = 0, rank_ = 0, world_ = 1;
  DeviceKind device_kind_ = DeviceKind::kCpu;
  optim::DType compute_dtype_ = optim::DType::kFloat32;
  optim::DType state_dtype_ = optim::DType::kFloat32;
  optim::MasterFormat master_format_ = optim::MasterFormat::kFp32;
  optim::MomentFormat moment_format_ = optim::MomentFormat::kFp32;
  bool adam_ = true;  // Adam or AdamW (the other optimizers' states go through the compact path)
  bool loss_scaling_ = false;
  bool client_optimizer_ = false;
  Placement param_section_ = Placement::kDevice;
  Placement optim_section_ = Placement::kDevice;
  PlacementPlan placement_;
  bool any_staged_publish_ = false;
  bool holds_exp_avg_ = true, holds_exp_avg_sq_ = true;
  bool immediate_ = false, defer_ = false;
  StagePlan stage_plan_;
  uint64_t host_budget_ = 0, host_only_bytes_ = 0, nvme_bytes_ = 0;
  // The NVMe-homed blocks in the pool's classes, and the largest (SizeTiers; Make's check).
  uint64_t nvme_pool_bytes_ = 0, largest_nvme_class_ = 0;
};

}  // namespace strata
