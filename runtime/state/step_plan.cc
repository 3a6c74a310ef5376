#include "runtime/state/step_plan.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/check.h"
#include "runtime/base/units.h"

namespace strata {
namespace {

Placement PlacementOfDevice(OffloadDevice d) {
  return d == OffloadDevice::kNone  ? Placement::kDevice
         : d == OffloadDevice::kCpu ? Placement::kHost
                                    : Placement::kNvme;
}

// The pinned pool rounds each block to a power-of-two class of at least 4 KiB.
uint64_t PoolClass(uint64_t bytes) {
  uint64_t c = 4096;
  while (c < bytes) c <<= 1;
  return c;
}

}  // namespace

StatusOr<StepPlan> StepPlan::Make(const Inputs& in) {
  STRATA_CHECK(in.config != nullptr && in.partitioner != nullptr, "StepPlan::Make: no config or chunks");
  const Config& c = *in.config;
  StepPlan p;
  p.stage_ = c.zero_optimization.stage;
  p.rank_ = in.rank;
  p.world_ = in.world_size;
  p.device_kind_ = in.device_kind;
  p.compute_dtype_ = in.compute_dtype;
  p.state_dtype_ = c.strata.optimizer_state_dtype == StateDtype::kBf16 ? optim::DType::kBFloat16
                                                                       : optim::DType::kFloat32;
  p.loss_scaling_ = c.fp16.enabled || in.loss_scaling_option;
  p.client_optimizer_ = in.client_optimizer;
  STRATA_RETURN_IF_ERROR(p.ChoosePlacement(in));
  STRATA_RETURN_IF_ERROR(p.ChooseLayout(in));
  // Note [states the optimizer uses]: an SGD group may not gain momentum later
  // (SetGroupHyperparameters refuses it).
  const OptimizerType type = c.optimizer.type;
  p.holds_exp_avg_ = type != OptimizerType::kAdagrad && (type != OptimizerType::kSGD || in.sgd_momentum);
  p.holds_exp_avg_sq_ = type != OptimizerType::kSGD && type != OptimizerType::kLion;
  if (p.client_optimizer_) p.holds_exp_avg_ = p.holds_exp_avg_sq_ = false;  // the client's own
  p.immediate_ = c.strata.overlap_optimizer && c.gradient_clipping == 0 && !p.loss_scaling_ &&
                 !p.client_optimizer_;
  p.defer_ = c.strata.overlap_optimizer && !p.immediate_ && p.stage3();
  STRATA_ASSIGN_OR_RETURN(p.stage_plan_,
                          in.partitioner->PlanFor(p.stage_, p.shard_rank(),
                                                  static_cast<int>(optim::DTypeSize(p.state_dtype_))));
  // The stage plan counts elements times a size; the compact formats' blocks are sized here.
  for (StateKind k : {StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    const int i = static_cast<int>(k);
    const int64_t numel = p.stage_plan_.sharded[i] ? in.partitioner->shard_numel_per_rank()
                                                   : in.partitioner->total_numel();
    if (k != StateKind::kMaster32 || p.stage_plan_.bytes[i] != 0)
      p.stage_plan_.bytes[i] = p.BlockBytes(k, numel);
  }
  p.SizeTiers(in);
  // The host pool must hold the host-placed blocks and a working set of NVMe blocks.
  if (p.host_budget_ > 0) {
    uint64_t nvme_total = 0, largest = 0;
    for (const ChunkInfo& ci : in.partitioner->chunks()) {
      auto add = [&](uint64_t bytes, Placement where) {
        if (where == Placement::kNvme) nvme_total += PoolClass(bytes), largest = std::max(largest, PoolClass(bytes));
      };
      add(p.BlockBytes(StateKind::kMaster32, ci.shard_numel), p.optim_placement_);
      add(p.BlockBytes(StateKind::kGrad, ci.shard_numel), p.optim_placement_);
      if (p.holds_exp_avg_) add(p.BlockBytes(StateKind::kExpAvg, ci.shard_numel), p.optim_placement_);
      if (p.holds_exp_avg_sq_) add(p.BlockBytes(StateKind::kExpAvgSq, ci.shard_numel), p.optim_placement_);
      if (p.stage3()) add(p.BlockBytes(StateKind::kParam16, ci.shard_numel), p.param_placement_);
    }
    const uint64_t need = p.host_only_bytes_ + std::min(nvme_total, 8 * largest);
    if (p.host_budget_ < need)
      return InvalidArgument(StrCat(
          "strata.host_memory_budget=", FormatBytes(p.host_budget_), " cannot hold the ",
          FormatBytes(p.host_only_bytes_), " of host-offloaded state plus a working set of ",
          FormatBytes(need - p.host_only_bytes_),
          " of NVMe blocks; raise it, offload more to NVMe, or lower strata.chunk_size"));
  }
  return p;
}

// Where each state kind lives, with the combinations the device cannot run refused.
Status StepPlan::ChoosePlacement(const Inputs& in) {
  const Config& c = *in.config;
  const auto& z = c.zero_optimization;
  param_placement_ = PlacementOfDevice(z.offload_param.device);
  optim_placement_ = PlacementOfDevice(z.offload_optimizer.device);
  if (client_optimizer_ && (z.stage == 3 || param_placement_ != Placement::kDevice ||
                            optim_placement_ != Placement::kDevice))
    return InvalidArgument(StrCat(
        "a client optimizer (zero_allow_untested_optimizer) runs on the device's memory: it needs "
        "zero_optimization.stage 0-2 (this config: ", z.stage, ") with offload_param.device and "
        "offload_optimizer.device none (this config: ", PlacementName(param_placement_), ", ",
        PlacementName(optim_placement_), "); use one of Strata's optimizers (Adam, AdamW, SGD, "
        "Adagrad, Lion) for stage 3 and offload"));
  if (device_optimizer() && param_placement_ != Placement::kDevice)
    return InvalidArgument(StrCat(
        "offload_param.device offloads the parameters but offload_optimizer.device=none keeps the "
        "optimizer on the device (", in.device_name, "); offload the optimizer too "
        "(offload_optimizer.device: cpu or nvme), as DeepSpeed requires"));
  if (in.device_kind == DeviceKind::kCuda && !in.device_usable)
    return FailedPrecondition(StrCat(
        "the device is ", in.device_name, " but this LibTorch has no CUDA (or sees no GPU); "
        "build Strata against a CUDA LibTorch (pip torch: see the README) or use --device cpu"));
  if (in.world_size > 1 && in.comm_moves_host_memory && in.device_kind != DeviceKind::kCpu)
    return FailedPrecondition(StrCat("communicator ", in.comm_backend,
                                     " moves host memory but the device is ", in.device_name,
                                     "; use the nccl backend with CUDA"));
  if (c.fp16.enabled && in.device_kind == DeviceKind::kCpu && !in.fp16_ops_in_fp32)
    return InvalidArgument(
        "fp16.enabled=true on the cpu device for a LibTorch model: LibTorch has no fp16 CPU "
        "kernels for LayerNorm and matmul; use bf16.enabled=true instead (same memory, no loss "
        "scaling needed), run on a GPU, or train from Python (import deepspeed or strata), whose "
        "frontend computes fp16 operators in fp32");
  return Status::Ok();
}

// The host pool's budget and the NVMe bytes, from this rank's blocks.
void StepPlan::SizeTiers(const Inputs& in) {
  const Config& c = *in.config;
  uint64_t host_only = 0, nvme_total = 0, largest = 0, nvme_bytes = 0;
  auto round = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
  for (const ChunkInfo& ci : in.partitioner->chunks()) {
    const int64_t n = ci.shard_numel;
    const uint64_t master = BlockBytes(StateKind::kMaster32, n), grad = BlockBytes(StateKind::kGrad, n);
    const uint64_t m = BlockBytes(StateKind::kExpAvg, n), v = BlockBytes(StateKind::kExpAvgSq, n);
    const uint64_t work = BlockBytes(StateKind::kParam16, n);
    // master and grad, the moments the optimizer keeps, and at stage 3 the param16 shard.
    std::vector<std::pair<uint64_t, Placement>> blocks = {{master, optim_placement_}, {grad, optim_placement_}};
    if (holds_exp_avg_) blocks.push_back({m, optim_placement_});
    if (holds_exp_avg_sq_) blocks.push_back({v, optim_placement_});
    if (stage3()) blocks.push_back({work, param_placement_});
    for (auto [bytes, where] : blocks) {
      if (where == Placement::kHost) host_only += PoolClass(bytes);
      if (where == Placement::kNvme) nvme_total += PoolClass(bytes), largest = std::max(largest, PoolClass(bytes));
    }
    // On disk: grad, master (unless the working copy is it) and two moments; the param16 shard.
    if (optim_placement_ == Placement::kNvme)
      nvme_bytes += round(grad) + (master_is_param() ? 0 : round(master)) + round(m) + round(v);
    if (param_placement_ == Placement::kNvme && stage3()) nvme_bytes += round(work);
  }
  nvme_bytes_ = nvme_bytes;
  host_only_bytes_ = host_only;
  // Unset, the budget holds every host-placed block plus a working set of NVMe blocks: the
  // optimizer lane pins five blocks of a chunk while the compute lane pins two more.
  const uint64_t working = std::min(nvme_total, std::max<uint64_t>(16 * largest, 512ull << 20));
  uint64_t budget = c.strata.host_memory_budget;
  if (budget == 0 && host_only + nvme_total > 0) budget = host_only + working;
  if (host_only + nvme_total == 0) budget = 0;
  host_budget_ = budget;
}

uint64_t StepPlan::BlockBytes(StateKind kind, int64_t shard_numel) const {
  const uint64_t n = static_cast<uint64_t>(shard_numel);
  switch (kind) {
    case StateKind::kParam16: return n * optim::DTypeSize(compute_dtype_);
    case StateKind::kGrad: return n * 4;
    case StateKind::kMaster32:
    case StateKind::kExpAvg:
    case StateKind::kExpAvgSq: return layout().Bytes(kind, shard_numel);
    default: return 0;
  }
}

// Note [compact layouts]: which master and moment formats, and where they can run.
Status StepPlan::ChooseLayout(const Inputs& in) {
  const Config& c = *in.config;
  moment_format_ = c.strata.optimizer_state_dtype == StateDtype::kInt8   ? optim::MomentFormat::kInt8
                   : c.strata.optimizer_state_dtype == StateDtype::kBf16 ? optim::MomentFormat::kBf16
                                                                         : optim::MomentFormat::kFp32;
  if (c.bf16.bf16_master_weights_and_grads)
    master_format_ = c.strata.stochastic_rounding ? optim::MasterFormat::kBf16Stochastic
                                                  : optim::MasterFormat::kBf16Nearest;
  adam_ = c.optimizer.type == OptimizerType::kAdam || c.optimizer.type == OptimizerType::kAdamW;
  if (!compact_optimizer()) return Status::Ok();
  const std::string layout = StrCat(
      master_format_ != optim::MasterFormat::kFp32 ? "bf16.bf16_master_weights_and_grads" : "",
      master_format_ != optim::MasterFormat::kFp32 && moment_format_ != optim::MomentFormat::kFp32 ? " with " : "",
      moment_format_ != optim::MomentFormat::kFp32
          ? StrCat("strata.optimizer_state_dtype=", optim::MomentFormatName(moment_format_))
          : std::string());
  if (master_format_ != optim::MasterFormat::kFp32 && compute_dtype_ != optim::DType::kBFloat16)
    return InvalidArgument(StrCat(layout, " keeps the master as the bf16 working copy, but this run "
                                  "computes in ", optim::DTypeName(compute_dtype_),
                                  "; set bf16.enabled=true"));
  const OptimizerType t = c.optimizer.type;
  if (t == OptimizerType::kSGD && !in.sgd_momentum && moment_format_ != optim::MomentFormat::kFp32)
    return InvalidArgument(StrCat("strata.optimizer_state_dtype=", optim::MomentFormatName(moment_format_),
                                  ": SGD without momentum keeps no optimizer state; remove it"));
  if (client_optimizer_)
    return InvalidArgument(StrCat(layout, " is Strata's own optimizer's layout; a client optimizer "
                                  "(zero_allow_untested_optimizer) keeps its own states"));
  if (device_optimizer() && device_kind_ == DeviceKind::kCuda)
    return InvalidArgument(StrCat(layout, " runs on the CPU optimizer so far: set "
                                  "zero_optimization.offload_optimizer.device to cpu or nvme"));
  return Status::Ok();
}

const char* StepPlan::OptimizerOverlapName() const {
  return immediate_ ? "backward" : defer_ ? "next-forward" : "in-step";
}

nlohmann::json StepPlan::ToJson() const {
  nlohmann::json j = nlohmann::json::object();
  for (int k = 0; k < kNumStateKinds; ++k)
    j[StateKindName(static_cast<StateKind>(k))] = {{"sharded", stage_plan_.sharded[k]},
                                                   {"bytes", stage_plan_.bytes[k]}};
  return j;
}

}  // namespace strata
