#include "runtime/state/placement_plan.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "runtime/base/check.h"
#include "runtime/base/units.h"
#include "tiers/host/pinned_pool.h"

namespace strata {
namespace {

constexpr StateKind kOptimKinds[] = {StateKind::kGrad, StateKind::kMaster32, StateKind::kExpAvg,
                                     StateKind::kExpAvgSq};

int Rank(Placement p) { return static_cast<int>(p); }  // device 0 < host 1 < nvme 2

// The pinned pool's working set for NVMe-homed blocks: the optimizer lane pins a chunk's
// group while compute pins shards and the trace prefetches ahead; 16 of the largest blocks keeps
// them all busy (StepPlan refuses a pool with room for fewer than 8).
uint64_t NvmeWorkingSet(uint64_t largest_class, uint64_t nvme_total) {
  return std::min(nvme_total, 16 * largest_class);
}

// The auto mode's filling, one tier at a time from the top.
class Filler {
 public:
  Filler(const PlacementPlan::Inputs& in, std::vector<Placement>* param, std::vector<Placement>* optim)
      : in_(in), shares_(in.master_shares_param && in.stage3), param_(*param), optim_(*optim) {
    const size_t n = in.shard_numel.size();
    p_bytes_.resize(n);
    o_bytes_.resize(n);
    master_bytes_.resize(n);
    p_host_.resize(n);
    o_host_.resize(n);
    master_host_.resize(n);
    for (size_t c = 0; c < n; ++c) {
      const int64_t e = in.shard_numel[c];
      // On the host a block takes its exact size in the pool's resident region; the NVMe
      // working set is counted in the arena's classes (Note [resident region] in
      // tiers/host/pinned_pool.cc).
      if (in.stage3) {
        p_bytes_[c] = in.block_bytes(StateKind::kParam16, e);
        p_host_[c] = PoolResidentBytes(p_bytes_[c]);
        largest_class_ = std::max(largest_class_, PoolClassBytes(p_bytes_[c]));
      }
      for (StateKind k : kOptimKinds) {
        if (!in.kept[static_cast<int>(k)]) continue;
        const uint64_t b = in.block_bytes(k, e);
        o_bytes_[c] += b;
        o_host_[c] += PoolResidentBytes(b);
        largest_class_ = std::max(largest_class_, PoolClassBytes(b));
        if (k == StateKind::kMaster32) master_bytes_[c] = b, master_host_[c] = PoolResidentBytes(b);
      }
    }
  }

  // Bytes chunk c's optimizer group takes in `tier` (in the pool's resident region on the host), given
  // where its shard is.
  uint64_t GroupBytes(size_t c, Placement tier) const {
    const bool shared = shares_ && param_[c] == tier;
    if (tier == Placement::kHost) return o_host_[c] - (shared ? master_host_[c] : 0);
    return o_bytes_[c] - (shared ? master_bytes_[c] : 0);
  }

  Status Fill() {
    const size_t n = p_bytes_.size();
    // Everything starts at its floor; filling lifts groups to higher tiers.
    for (size_t c = 0; c < n; ++c) {
      param_[c] = in_.stage3 ? in_.param_floor : Placement::kDevice;
      optim_[c] = in_.optim_floor;
    }
    // The device: what must be there, then shards in chunk order, then the groups of chunks
    // whose shard it holds.
    uint64_t dev = 0;
    for (size_t c = 0; c < n; ++c) {
      if (param_[c] == Placement::kDevice) dev += p_bytes_[c];
      if (optim_[c] == Placement::kDevice) dev += GroupBytes(c, Placement::kDevice);
    }
    device_must_ = dev;
    if (dev > in_.device_budget) return Refuse();
    // Note [whole chunks]: where the master can be the working shard (Note [shared master]),
    // lifting a shard without its group would store the master a second time below it, and a
    // master costs what the shard saves; there chunks move up whole.
    const bool whole = shares_;
    for (size_t c = 0; c < n; ++c) {
      if (param_[c] == Placement::kDevice) continue;
      if (whole && optim_[c] != Placement::kDevice) {
        const uint64_t both = p_bytes_[c] + o_bytes_[c] - master_bytes_[c];  // the master shared
        if (dev + both <= in_.device_budget) {
          param_[c] = optim_[c] = Placement::kDevice;
          dev += both;
        }
      } else if (dev + p_bytes_[c] <= in_.device_budget) {
        param_[c] = Placement::kDevice;
        dev += p_bytes_[c];
      }
    }
    for (size_t c = 0; c < n; ++c)
      if (param_[c] == Placement::kDevice && optim_[c] != Placement::kDevice &&
          dev + GroupBytes(c, Placement::kDevice) <= in_.device_budget) {
        optim_[c] = Placement::kDevice;
        dev += GroupBytes(c, Placement::kDevice);
      }
    // The host: if everything below the device fits, it all goes there (no NVMe working set).
    uint64_t below = 0, host_must = 0;
    for (size_t c = 0; c < n; ++c) {
      if (param_[c] != Placement::kDevice) {
        below += p_host_[c];
        if (param_[c] == Placement::kHost) host_must += p_host_[c];
      }
      if (optim_[c] != Placement::kDevice) {
        below += o_host_[c];
        if (optim_[c] == Placement::kHost) host_must += GroupBytes(c, Placement::kHost);
      }
    }
    uint64_t host_room = in_.host_budget;
    if (below > in_.host_budget) {
      const uint64_t working = NvmeWorkingSet(largest_class_, below);
      host_room = in_.host_budget > working ? in_.host_budget - working : 0;
    }
    uint64_t host = host_must;
    host_must_ = host_must;
    if (host > host_room) return Refuse();
    for (size_t c = 0; c < n; ++c) {
      if (param_[c] != Placement::kNvme) continue;
      if (whole && optim_[c] == Placement::kNvme) {  // Note [whole chunks]
        param_[c] = Placement::kHost;
        const uint64_t both = p_host_[c] + GroupBytes(c, Placement::kHost);
        if (host + both <= host_room) {
          optim_[c] = Placement::kHost;
          host += both;
        } else {
          param_[c] = Placement::kNvme;
        }
      } else if (host + p_host_[c] <= host_room) {
        param_[c] = Placement::kHost;
        host += p_host_[c];
      }
    }
    for (size_t c = 0; c < n; ++c)
      if (optim_[c] == Placement::kNvme && host + GroupBytes(c, Placement::kHost) <= host_room) {
        optim_[c] = Placement::kHost;
        host += GroupBytes(c, Placement::kHost);
      }
    // NVMe: the rest.
    uint64_t nvme = 0;
    for (size_t c = 0; c < n; ++c) {
      if (param_[c] == Placement::kNvme) nvme += p_bytes_[c];
      if (optim_[c] == Placement::kNvme) nvme += GroupBytes(c, Placement::kNvme);
    }
    nvme_need_ = nvme;
    if (nvme > 0 && (!in_.nvme_available || nvme > in_.nvme_budget)) return Refuse();
    return Status::Ok();
  }

 private:
  // One message with every tier's need and capacity and the smallest change that would fit.
  Status Refuse() const {
    // The least the state takes: with every master that can be its working shard shared.
    uint64_t total = 0, params = 0;
    for (size_t c = 0; c < p_bytes_.size(); ++c) {
      total += p_bytes_[c] + o_bytes_[c] - (shares_ ? master_bytes_[c] : 0);
      params += in_.shard_numel[c];
    }
    const uint64_t nvme_cap = in_.nvme_available ? in_.nvme_budget : 0;
    const uint64_t have = in_.device_budget + in_.host_budget + nvme_cap;
    std::string fix;
    if (device_must_ > in_.device_budget) {
      fix = StrCat("the sections whose device is none need ", FormatBytes(device_must_),
                   " on the device; raise ", in_.device_budget_source,
                   " or offload them (offload_optimizer.device / offload_param.device: cpu or nvme)");
    } else if (host_must_ > in_.host_budget) {
      fix = StrCat("the sections whose device is cpu need ", FormatBytes(host_must_),
                   " of host memory; raise ", in_.host_budget_source,
                   " or let them spill to NVMe (device: nvme with an nvme_path)");
    } else if (!in_.nvme_available &&
               (in_.optim_floor == Placement::kNvme || in_.param_floor == Placement::kNvme)) {
      fix = StrCat("the state needs NVMe but no nvme_path is set: set "
                   "zero_optimization.offload_optimizer.nvme_path (or pass --nvme-path)");
    } else if (!in_.nvme_available) {
      fix = StrCat("nothing may go to NVMe: set offload_optimizer.device (and offload_param.device) "
                   "to nvme with an nvme_path, so that ",
                   FormatBytes(total > have ? total - have : 0), " or more can spill there");
    } else {
      const uint64_t short_by = nvme_need_ > in_.nvme_budget ? nvme_need_ - in_.nvme_budget : 0;
      const bool keyed = in_.nvme_budget_source.rfind("strata.", 0) == 0;
      fix = StrCat(keyed ? "raise strata.nvme_capacity" : "free more disk at the nvme_path", " by ",
                   FormatBytes(short_by),
                   in_.shrink_hint.empty() ? std::string() : StrCat(", or shrink the state: ", in_.shrink_hint));
    }
    return ResourceExhausted(StrCat(
        "strata.placement=auto: the state of this rank's ", params, " elements needs ", FormatBytes(total),
        " but the tiers hold device ", FormatBytes(in_.device_budget), " (", in_.device_budget_source,
        "), host ", FormatBytes(in_.host_budget), " (", in_.host_budget_source, ", less a working "
        "set for NVMe blocks), nvme ", in_.nvme_available ? FormatBytes(in_.nvme_budget) : "none",
        in_.nvme_available ? StrCat(" (", in_.nvme_budget_source, ")") : std::string(), "; ", fix));
  }

  const PlacementPlan::Inputs& in_;
  const bool shares_;  // Note [shared master]: a chunk homed whole in one tier stores no master
  std::vector<Placement>& param_;
  std::vector<Placement>& optim_;
  std::vector<uint64_t> p_bytes_, o_bytes_, master_bytes_;  // raw: the device and NVMe
  std::vector<uint64_t> p_host_, o_host_, master_host_;  // PoolResidentBytes: the host
  uint64_t largest_class_ = 0;
  uint64_t device_must_ = 0, host_must_ = 0, nvme_need_ = 0;
};

}  // namespace

const char* PlacementModeName(PlacementMode m) { return m == PlacementMode::kAuto ? "auto" : "config"; }

StatusOr<PlacementPlan> PlacementPlan::Make(const Inputs& in) {
  STRATA_CHECK(static_cast<bool>(in.block_bytes), "PlacementPlan::Make: no block_bytes");
  if (in.ratio < 0 || in.ratio > 1)
    return InvalidArgument(StrCat("zero_optimization.offload_optimizer.ratio=", in.ratio,
                                  ": must be within [0, 1] (the fraction of optimizer states offloaded)"));
  if (in.optim_floor == Placement::kDevice && in.param_floor != Placement::kDevice && in.stage3)
    return InvalidArgument(
        "offload_param.device offloads the parameters but offload_optimizer.device=none keeps the "
        "optimizer on the device; offload the optimizer too (offload_optimizer.device: cpu or "
        "nvme), as DeepSpeed requires");
  const size_t n = in.shard_numel.size();
  PlacementPlan p;
  p.mode_ = in.mode;
  p.shares_ = in.master_shares_param && in.stage3;
  p.param_.assign(n, in.stage3 ? in.param_floor : Placement::kDevice);
  p.optim_.assign(n, in.optim_floor);
  if (in.mode == PlacementMode::kAuto) {
    STRATA_RETURN_IF_ERROR(Filler(in, &p.param_, &p.optim_).Fill());
  } else {
    int64_t total = 0;
    for (int64_t e : in.shard_numel) total += e;
    // ratio: the first chunks' groups, up to (1 - ratio) of the elements, stay on the device.
    if (in.ratio < 1 && in.optim_floor != Placement::kDevice) {
      const double keep = (1.0 - in.ratio) * static_cast<double>(total);
      int64_t kept = 0;
      for (size_t c = 0; c < n && static_cast<double>(kept + in.shard_numel[c]) <= keep + 0.5; ++c) {
        kept += in.shard_numel[c];
        p.optim_[c] = Placement::kDevice;
        p.param_[c] = Placement::kDevice;
      }
    }
    // max_in_cpu: NVMe-floored working shards stay in host memory up to that many elements.
    if (in.max_in_cpu >= 0 && in.stage3 && in.param_floor == Placement::kNvme) {
      int64_t kept = 0;
      for (size_t c = 0; c < n; ++c) {
        if (p.param_[c] != Placement::kNvme) continue;
        if (kept + in.shard_numel[c] > in.max_in_cpu) break;
        kept += in.shard_numel[c];
        p.param_[c] = Placement::kHost;
      }
    }
  }
  for (size_t c = 0; c < n; ++c) {
    const int64_t e = in.shard_numel[c];
    if (in.stage3)
      p.bytes_[Rank(p.param_[c])][static_cast<int>(StateKind::kParam16)] += in.block_bytes(StateKind::kParam16, e);
    for (StateKind k : kOptimKinds) {
      if (!in.kept[static_cast<int>(k)]) continue;
      if (k == StateKind::kMaster32 && p.MasterSharesParam(static_cast<int64_t>(c))) continue;
      p.bytes_[Rank(p.optim_[c])][static_cast<int>(k)] += in.block_bytes(k, e);
    }
  }
  return p;
}

bool PlacementPlan::AnyParamIn(Placement tier) const {
  return std::find(param_.begin(), param_.end(), tier) != param_.end();
}

bool PlacementPlan::AnyOptimIn(Placement tier) const {
  return std::find(optim_.begin(), optim_.end(), tier) != optim_.end();
}

uint64_t PlacementPlan::TierBytes(Placement tier) const {
  uint64_t sum = 0;
  for (uint64_t b : bytes_[Rank(tier)]) sum += b;
  return sum;
}

std::vector<std::string> PlacementPlan::Lines() const {
  std::vector<std::string> lines;
  for (Placement t : {Placement::kDevice, Placement::kHost, Placement::kNvme}) {
    const uint64_t total = TierBytes(t);
    if (total == 0) continue;
    const int64_t shards = std::count(param_.begin(), param_.end(), t);
    const int64_t groups = std::count(optim_.begin(), optim_.end(), t);
    std::string kinds;
    for (int k = 0; k < kNumStateKinds; ++k) {
      if (bytes_[Rank(t)][k] == 0) continue;
      kinds += StrCat(kinds.empty() ? "" : ", ", StateKindName(static_cast<StateKind>(k)), " ",
                      FormatBytes(bytes_[Rank(t)][k]));
    }
    lines.push_back(StrCat(PlacementName(t), ": ", FormatBytes(total), " (", kinds, "; ", shards,
                           " chunk shards, ", groups, " optimizer groups)"));
  }
  return lines;
}

nlohmann::json PlacementPlan::ToJson() const {
  nlohmann::json j = {{"mode", PlacementModeName(mode_)}};
  for (Placement t : {Placement::kDevice, Placement::kHost, Placement::kNvme}) {
    nlohmann::json tier = nlohmann::json::object();
    for (int k = 0; k < kNumStateKinds; ++k)
      tier[StateKindName(static_cast<StateKind>(k))] = bytes_[Rank(t)][k];
    tier["total"] = TierBytes(t);
    tier["param_chunks"] = std::count(param_.begin(), param_.end(), t);
    tier["optimizer_chunks"] = std::count(optim_.begin(), optim_.end(), t);
    j[PlacementName(t)] = tier;
  }
  return j;
}

}  // namespace strata
