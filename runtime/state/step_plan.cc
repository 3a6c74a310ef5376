#include "runtime/state/step_plan.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/check.h"
#include "runtime/base/units.h"
#include "tiers/host/pinned_pool.h"

namespace strata {
namespace {

Placement PlacementOfDevice(OffloadDevice d) {
  return d == OffloadDevice::kNone  ? Placement::kDevice
         : d == OffloadDevice::kCpu ? Placement::kHost
                                    : Placement::kNvme;
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
  // Note [states the optimizer uses]: an SGD group may not gain momentum later
  // (SetGroupHyperparameters refuses it).
  const OptimizerType type = c.optimizer.type;
  p.holds_exp_avg_ = type != OptimizerType::kAdagrad && (type != OptimizerType::kSGD || in.sgd_momentum);
  p.holds_exp_avg_sq_ = type != OptimizerType::kSGD && type != OptimizerType::kLion;
  if (p.client_optimizer_) p.holds_exp_avg_ = p.holds_exp_avg_sq_ = false;  // the client's own
  STRATA_RETURN_IF_ERROR(p.ChooseLayout(in));
  STRATA_RETURN_IF_ERROR(p.ChoosePlacement(in));
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
    const uint64_t need = p.host_only_bytes_ + std::min(p.nvme_pool_bytes_, 8 * p.largest_nvme_class_);
    if (p.host_budget_ < need)
      return InvalidArgument(StrCat(
          "strata.host_memory_budget=", FormatBytes(p.host_budget_), " cannot hold the ",
          FormatBytes(p.host_only_bytes_), " of host-offloaded state plus a working set of ",
          FormatBytes(need - p.host_only_bytes_),
          " of NVMe blocks; raise it, offload more to NVMe, or lower strata.chunk_size"));
  }
  return p;
}

Status StepPlan::CheckPrecisionOnDevice(const Config& c, DeviceKind device_kind,
                                        bool fp16_ops_in_fp32) {
  if (c.fp16.enabled && device_kind == DeviceKind::kCpu && !fp16_ops_in_fp32)
    return InvalidArgument(
        "fp16.enabled=true on the cpu device for a LibTorch model: LibTorch has no fp16 CPU "
        "kernels for LayerNorm and matmul; use bf16.enabled=true instead (same memory, no loss "
        "scaling needed), run on a GPU, or train from Python (import deepspeed or strata), whose "
        "frontend computes fp16 operators in fp32");
  return Status::Ok();
}

// Where each block lives (the placement plan), with the combinations the device cannot run
// refused.
Status StepPlan::ChoosePlacement(const Inputs& in) {
  const Config& c = *in.config;
  const auto& z = c.zero_optimization;
  param_section_ = PlacementOfDevice(z.offload_param.device);
  optim_section_ = PlacementOfDevice(z.offload_optimizer.device);
  if (client_optimizer_ && (z.stage == 3 || param_section_ != Placement::kDevice ||
                            optim_section_ != Placement::kDevice ||
                            c.strata.placement == PlacementMode::kAuto || z.offload_optimizer.ratio < 1))
    return InvalidArgument(StrCat(
        "a client optimizer (zero_allow_untested_optimizer) runs on the device's memory: it needs "
        "zero_optimization.stage 0-2 (this config: ", z.stage, ") with offload_param.device and "
        "offload_optimizer.device none (this config: ", PlacementName(param_section_), ", ",
        PlacementName(optim_section_), ") and strata.placement config; use one of Strata's "
        "optimizers (Adam, AdamW, SGD, Adagrad, Lion) for stage 3 and offload"));
  if (in.device_kind == DeviceKind::kCuda && !in.device_usable)
    return FailedPrecondition(StrCat(
        "the device is ", in.device_name, " but this LibTorch has no CUDA (or sees no GPU); "
        "build Strata against a CUDA LibTorch (pip torch: see the README) or use --device cpu"));
  if (in.world_size > 1 && in.comm_moves_host_memory && in.device_kind != DeviceKind::kCpu)
    return FailedPrecondition(StrCat("communicator ", in.comm_backend,
                                     " moves host memory but the device is ", in.device_name,
                                     "; use the nccl backend with CUDA"));
  STRATA_RETURN_IF_ERROR(CheckPrecisionOnDevice(c, in.device_kind, in.fp16_ops_in_fp32));
  PlacementPlan::Inputs pin;
  for (const ChunkInfo& ci : in.partitioner->chunks()) pin.shard_numel.push_back(ci.shard_numel);
  pin.block_bytes = [this](StateKind k, int64_t n) { return BlockBytes(k, n); };
  pin.stage3 = stage3();
  pin.kept[static_cast<int>(StateKind::kGrad)] = pin.kept[static_cast<int>(StateKind::kMaster32)] = true;
  pin.kept[static_cast<int>(StateKind::kExpAvg)] = holds_exp_avg_;
  pin.kept[static_cast<int>(StateKind::kExpAvgSq)] = holds_exp_avg_sq_;
  pin.master_shares_param = stage3() && compute_dtype_ == master_dtype();
  pin.param_floor = param_section_;
  pin.optim_floor = optim_section_;
  pin.mode = c.strata.placement;
  pin.ratio = z.offload_optimizer.ratio;
  pin.max_in_cpu = z.offload_param.max_in_cpu;
  pin.nvme_available = in.nvme_path_given;
  pin.shrink_hint = ShrinkHint();
  if (pin.mode == PlacementMode::kAuto) STRATA_RETURN_IF_ERROR(AutoBudgets(in, &pin));
  STRATA_ASSIGN_OR_RETURN(placement_, PlacementPlan::Make(pin));
  for (int64_t ch = 0; ch < placement_.num_chunks(); ++ch) any_staged_publish_ |= StagedPublish(ch);
  return Status::Ok();
}

// What is left to shrink of this run's layout (Note [compact layouts]): moments narrower than
// they are, where the optimizer keeps any, and a bf16 master where the master is fp32 (with bf16
// compute, which it needs); nothing for a client optimizer, which keeps its own states.
std::string StepPlan::ShrinkHint() const {
  if (client_optimizer_) return "";  // the compact layouts are Strata's optimizers' own
  std::vector<std::string> ways;
  if (holds_exp_avg_ || holds_exp_avg_sq_) {
    const optim::MomentFormat m = layout().moments;
    if (m == optim::MomentFormat::kFp32)
      ways.push_back("8-bit or bf16 moments (strata.optimizer_state_dtype: int8 or bf16)");
    else if (m == optim::MomentFormat::kBf16)
      ways.push_back("8-bit moments (strata.optimizer_state_dtype: int8)");
  }
  if (!layout().bf16_master)
    ways.push_back(compute_dtype_ == optim::DType::kBFloat16
                       ? "a bf16 master (bf16.bf16_master_weights_and_grads)"
                       : "bf16 compute with a bf16 master (bf16.enabled and "
                         "bf16.bf16_master_weights_and_grads)");
  std::string out;
  for (size_t i = 0; i < ways.size(); ++i) out += (i ? " or " : "") + ways[i];
  return out;
}

// strata.placement auto: what each tier may hold of this rank's state. The device keeps
// strata.device_reserve for compute (gathered chunks, gradient buffers, activations and
// workspace), by default a quarter of its memory and at least eight of the largest chunks. The host keeps an eighth of what is available (at least 2 GiB)
// for the process itself; the disk keeps 1 GiB.
Status StepPlan::AutoBudgets(const Inputs& in, PlacementPlan::Inputs* pin) const {
  const StrataConfig& s = in.config->strata;
  int64_t largest = 0;
  for (const ChunkInfo& ci : in.partitioner->chunks()) largest = std::max(largest, ci.numel);
  const uint64_t device = s.device_memory_budget ? s.device_memory_budget : in.device_capacity;
  pin->device_budget_source =
      !in.device_flag.empty()  ? StrCat(in.device_flag, " ", FormatBytes(device))
      : s.device_memory_budget ? StrCat("strata.device_memory_budget=", FormatBytes(device))
                               : StrCat("the device's ", FormatBytes(device));
  const uint64_t reserve = s.device_reserve ? s.device_reserve
                                            : std::max<uint64_t>(device / 4, 8ull * largest * optim::DTypeSize(compute_dtype_));
  pin->device_budget = device > reserve ? device - reserve : 0;
  if (s.host_memory_budget) {
    if (in.host_available && s.host_memory_budget > in.host_available)
      return InvalidArgument(StrCat("strata.host_memory_budget=", FormatBytes(s.host_memory_budget),
                                    " is more than this host has available (", FormatBytes(in.host_available),
                                    "); lower it, or set it to 0 for strata.placement auto to size it"));
    pin->host_budget = s.host_memory_budget;
    pin->host_budget_source = StrCat("strata.host_memory_budget=", FormatBytes(s.host_memory_budget));
  } else if (in.host_capacity) {
    pin->host_budget = in.host_capacity;
    pin->host_budget_source = StrCat("the host budget planned for, ", FormatBytes(in.host_capacity),
                                     " beside the run's own memory");
  } else {
    const uint64_t margin = std::max<uint64_t>(in.host_available / 8, 2ull << 30);
    pin->host_budget = in.host_available > margin ? in.host_available - margin : 0;
    pin->host_budget_source =
        StrCat(in.host_flag.empty() ? "available host memory" : in.host_flag, " ",
               FormatBytes(in.host_available), " less ", FormatBytes(margin));
  }
  if (s.nvme_capacity) {
    if (in.disk_free && s.nvme_capacity > in.disk_free + in.disk_given_back)
      return InvalidArgument(StrCat("strata.nvme_capacity=", FormatBytes(s.nvme_capacity),
                                    " is more than ", in.nvme_paths > 1 ? StrCat("the ", in.nvme_paths, " NVMe paths' shares hold (") : std::string("the NVMe path has free ("), FormatBytes(in.disk_free),
                                    in.disk_given_back ? StrCat(" and ", FormatBytes(in.disk_given_back),
                                                                " of zero::Init's staging file")
                                                       : std::string(),
                                    "); lower it, free disk space, or set it to 0 for strata.placement "
                                    "auto to use what is free"));
    pin->nvme_budget = s.nvme_capacity;
    pin->nvme_budget_source = StrCat("strata.nvme_capacity=", FormatBytes(s.nvme_capacity));
  } else {
    const uint64_t disk = in.disk_free + in.disk_given_back;
    pin->nvme_budget = disk > (1ull << 30) ? disk - (1ull << 30) : 0;
    pin->nvme_budget_source = StrCat(
        !in.disk_flag.empty() ? in.disk_flag + " "
        : in.nvme_paths > 1   ? StrCat("free disk for the ", in.nvme_paths, " nvme paths' shares ")
                              : std::string("free disk at the nvme_path "),
        FormatBytes(in.disk_free),
        in.disk_given_back ? StrCat(" and the ", FormatBytes(in.disk_given_back),
                                    " of zero::Init's staging file that the start gives back")
                           : std::string(),
        " less 1 GiB");
  }
  if (pin->optim_floor != Placement::kNvme && pin->param_floor != Placement::kNvme) pin->nvme_available = false;
  return Status::Ok();
}

bool StepPlan::Stored(int64_t c, StateKind kind) const {
  switch (kind) {
    case StateKind::kParam16: return stage3();
    case StateKind::kMaster32: return !MasterIsParam(c);
    case StateKind::kGrad: return true;
    case StateKind::kExpAvg:
    case StateKind::kExpAvgSq: return HoldsState(kind);
    default: return false;
  }
}

uint64_t StepPlan::ChunkNvmeBytes(int64_t c, int64_t shard_numel) const {
  uint64_t total = 0;
  for (int k = 0; k < kNumStateKinds; ++k) {
    const StateKind kind = static_cast<StateKind>(k);
    if (Stored(c, kind) && PlacementOf(c, kind) == Placement::kNvme)
      total += (BlockBytes(kind, shard_numel) + 4095) / 4096 * 4096;
  }
  return total;
}

// The host pool's budget and the NVMe bytes, from this rank's blocks.
void StepPlan::SizeTiers(const Inputs& in) {
  const Config& c = *in.config;
  uint64_t host_only = 0, nvme_total = 0, largest = 0, nvme_bytes = 0;
  const auto& chunks = in.partitioner->chunks();
  for (size_t ci = 0; ci < chunks.size(); ++ci) {
    const int64_t ch = static_cast<int64_t>(ci);
    nvme_bytes += ChunkNvmeBytes(ch, chunks[ci].shard_numel);
    for (int k = 0; k < kNumStateKinds; ++k) {
      const StateKind kind = static_cast<StateKind>(k);
      if (!Stored(ch, kind)) continue;
      const uint64_t bytes = BlockBytes(kind, chunks[ci].shard_numel);
      const Placement where = PlacementOf(ch, kind);
      if (where == Placement::kHost) host_only += PoolResidentBytes(bytes);
      if (where == Placement::kNvme) {
        nvme_total += PoolClassBytes(bytes);
        largest = std::max(largest, PoolClassBytes(bytes));
      }
    }
  }
  nvme_bytes_ = nvme_bytes;
  host_only_bytes_ = host_only;
  nvme_pool_bytes_ = nvme_total;
  largest_nvme_class_ = largest;
  // Unset, the budget holds every host-placed block plus a working set of NVMe blocks: the
  // optimizer lane pins five blocks of a chunk while the compute lane pins two more.
  const uint64_t working = std::min(nvme_total, std::max<uint64_t>(16 * largest, 512ull << 20));
  uint64_t budget = c.strata.host_memory_budget;
  if (budget == 0 && host_only + nvme_total > 0) budget = host_only + working;
  if (host_only + nvme_total == 0) budget = 0;
  host_budget_ = budget;
}

PartitionerOptions StepPlan::ChunkLayout(const Config& config, int shard_world, int element_size) {
  PartitionerOptions po;
  po.chunk_size = config.strata.chunk_size;
  po.world_size = shard_world;
  po.element_size = element_size;
  if (config.strata.optimizer_state_dtype == StateDtype::kInt8)
    po.param_alignment = std::max<uint64_t>(po.param_alignment, optim::kInt8Block * static_cast<uint64_t>(element_size));
  return po;
}

uint64_t StepPlan::BlockBytes(StateKind kind, int64_t shard_numel) const {
  const uint64_t n = static_cast<uint64_t>(shard_numel);
  switch (kind) {
    case StateKind::kParam16: return n * optim::DTypeSize(compute_dtype_);
    case StateKind::kGrad: return n * optim::DTypeSize(grad_dtype());
    case StateKind::kMaster32:
    case StateKind::kExpAvg:
    case StateKind::kExpAvgSq: return layout().Bytes(kind, shard_numel);
    default: return 0;
  }
}

// Note [compact layouts]: which master and moment formats, and where they can run.
Status StepPlan::ChooseLayout(const Inputs& in) {
  const Config& c = *in.config;
  moment_format_ = StateLayout::MomentsOf(c.strata.optimizer_state_dtype);
  if (c.bf16.bf16_master_weights_and_grads)
    master_format_ = c.strata.stochastic_rounding ? optim::MasterFormat::kBf16Stochastic
                                                  : optim::MasterFormat::kBf16Nearest;
  adam_ = c.optimizer.type == OptimizerType::kAdam || c.optimizer.type == OptimizerType::kAdamW;
  if (!compact_optimizer()) return Status::Ok();
  const std::string layout = LayoutKeys();
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
  return Status::Ok();
}

// The keys that chose a compact layout, for messages.
std::string StepPlan::LayoutKeys() const {
  return StrCat(
      master_format_ != optim::MasterFormat::kFp32 ? "bf16.bf16_master_weights_and_grads" : "",
      master_format_ != optim::MasterFormat::kFp32 && moment_format_ != optim::MomentFormat::kFp32 ? " with " : "",
      moment_format_ != optim::MomentFormat::kFp32
          ? StrCat("strata.optimizer_state_dtype=", optim::MomentFormatName(moment_format_))
          : std::string());
}

std::string StepPlan::MasterStorageName() const {
  int64_t shared = 0;
  const int64_t n = placement_.num_chunks();
  for (int64_t c = 0; c < n; ++c) shared += MasterIsParam(c) ? 1 : 0;
  if (shared == n && n > 0) return "param16 (shared)";
  if (shared == 0) return "master32";
  return StrCat("mixed (", shared, " of ", n, " chunks share)");
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
