// PlacementPlan: which tier (device, host, NVMe) homes each (chunk, state) block of one rank,
// decided once before anything is allocated, so that the tiers' capacities add up instead of
// each state kind living wholly in one tier.
//
// Two groups per chunk, each homed in one tier:
// - the working shard (param16; stage 3 only: below it the whole working copy is on the device);
// - the optimizer group: the gradient, the master and the moments. The optimizer runs where the
//   group is (the device's optimizer for a device-homed group, the host's for host and NVMe), so
//   a device-homed group needs its chunk's working shard on the device too.
//
// Each group has a floor, the lowest tier it may go to: its DeepSpeed section's device (none:
// the device; cpu: host; nvme: NVMe). Two modes (strata.placement):
// - kConfig (the default): every group at its floor, except that
//   - offload_optimizer.ratio r < 1 keeps the optimizer groups (and working shards) of the first
//     chunks, up to (1 - r) of this rank's elements, on the device (DeepSpeed's ZeRO-Offload++
//     meaning: the fraction r is offloaded, the rest update on the device);
//   - offload_param.max_in_cpu m >= 0 under offload_param.device nvme keeps the working shards of
//     the first chunks, up to m elements, in host memory; the rest go to NVMe.
// - kAuto: the tiers fill from the top under the budgets, most used first. The device takes the
//   working shards in chunk order, then the optimizer groups of chunks whose shard it holds; the
//   host takes the rest of the shards, then the rest of the groups (leaving a working set of
//   pool memory for NVMe-homed blocks when any are); NVMe takes what remains. Where the master
//   can be the working shard (below), a shard moves up only with its group (Note [whole
//   chunks] in placement_plan.cc): alone it would leave a master block behind. A group never goes
//   below its floor, nor above the device when the device cannot run the optimizer.
// Make refuses a plan that does not fit (auto mode), naming every tier's need and capacity and
// the smallest change that would fit.
//
// Note [shared master]: when the master and the working shard have the same dtype under stage 3
// and both are homed in one tier, the master is the working shard's block: it takes no bytes of
// its own (the engine's StepPlan::MasterIsParam). On the device too: the device's optimizer then
// updates the working shard in place, as a host optimizer does a host-homed one.
//
// A value: no LibTorch, no device access; Make is a pure function of its inputs (the table in
// tests/runtime/placement_plan_test.cc). Thread-safety: const after Make.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "runtime/base/config.h"
#include "runtime/base/status.h"
#include "runtime/state/block_store.h"
#include "runtime/state/partitioner.h"

namespace strata {

class PlacementPlan {
 public:
  struct Inputs {
    std::vector<int64_t> shard_numel;  // this rank's elements of each chunk
    // Bytes of a block of `kind` holding `numel` elements (StepPlan::BlockBytes).
    std::function<uint64_t(StateKind, int64_t)> block_bytes;
    bool stage3 = false;            // working shards are blocks (below stage 3 they are not)
    std::array<bool, kNumStateKinds> kept{};  // the optimizer-group kinds that have blocks
    bool master_shares_param = false;  // Note [shared master]: dtypes allow sharing
    Placement param_floor = Placement::kDevice;  // offload_param.device
    Placement optim_floor = Placement::kDevice;  // offload_optimizer.device
    PlacementMode mode = PlacementMode::kConfig;
    double ratio = 1.0;        // offload_optimizer.ratio
    int64_t max_in_cpu = -1;   // offload_param.max_in_cpu; < 0: not set
    // Auto mode: bytes each tier may hold of this rank's state (device: after its reserve for
    // compute; host: the pinned pool, before the NVMe working set; nvme: the disk's room).
    uint64_t device_budget = 0, host_budget = 0, nvme_budget = 0;
    bool nvme_available = false;  // a path exists for NVMe-homed blocks
    // Auto mode: how the budgets were set, for the refusal ("strata.host_memory_budget=8 GiB").
    std::string device_budget_source, host_budget_source, nvme_budget_source;
    // The settings that would shrink this run's state further, for the refusal ("bf16 moments
    // (strata.optimizer_state_dtype: bf16)"); empty when its layout is already the smallest.
    std::string shrink_hint;
  };
  static StatusOr<PlacementPlan> Make(const Inputs& in);

  int64_t num_chunks() const { return static_cast<int64_t>(param_.size()); }
  Placement Of(int64_t chunk, StateKind kind) const {
    return kind == StateKind::kParam16 ? param_[chunk] : optim_[chunk];
  }
  Placement ParamOf(int64_t chunk) const { return param_[chunk]; }
  Placement OptimOf(int64_t chunk) const { return optim_[chunk]; }
  // Some chunk homes its working shard (param16) or its optimizer group in `tier`.
  bool AnyParamIn(Placement tier) const;
  bool AnyOptimIn(Placement tier) const;
  bool Any(Placement tier) const { return AnyParamIn(tier) || AnyOptimIn(tier); }
  // Note [shared master] for chunk c.
  bool MasterSharesParam(int64_t chunk) const {
    return shares_ && param_[chunk] == optim_[chunk];
  }
  // Bytes of `kind` homed in `tier`, summed over chunks (a shared master counts nothing).
  uint64_t Bytes(Placement tier, StateKind kind) const {
    return bytes_[static_cast<int>(tier)][static_cast<int>(kind)];
  }
  uint64_t TierBytes(Placement tier) const;
  // One line per tier that holds anything: "host: 1.2 GiB (param16 400 MiB, grad 800 MiB)".
  std::vector<std::string> Lines() const;
  // {"device": {"param16": bytes, ...}, "host": {...}, "nvme": {...}, "mode": "auto"}.
  nlohmann::json ToJson() const;

 private:
  std::vector<Placement> param_, optim_;
  bool shares_ = false;
  PlacementMode mode_ = PlacementMode::kConfig;
  std::array<std::array<uint64_t, kNumStateKinds>, 3> bytes_{};
};

const char* PlacementModeName(PlacementMode m);  // "config", "auto"

}  // namespace strata
