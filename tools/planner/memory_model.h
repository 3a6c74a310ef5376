// Memory model: what strata::Engine (runtime/engine/engine.cc) allocates on each tier for a model under a
// config, per rank — modelled on the engine as it is, not on what DeepSpeed would allocate.
//
// What the engine does (and this model follows):
// - Parameters are packed by the real Partitioner (chunk padding and shard alignment included),
//   sharded over world_size ranks for stages 1-3 and not at all for stage 0.
// - Per chunk shard it registers master32 (fp32), grad (fp32), exp_avg and exp_avg_sq (state
//   dtype) at offload_optimizer.device's placement, and for stage 3 param16 at
//   offload_param.device's placement (device / host / nvme). Stages 0-2 keep the whole working
//   copy of every chunk on the device for the whole run.
// - Transients on the device: stage 3 gathers a full chunk buffer while a block that uses it is
//   live; every stage accumulates a block's gradients into an fp32 full-chunk buffer until the
//   chunk's last block finished backward. The peak is found by replaying the engine's
//   forward/backward order (Note [device replay] in memory_model.cc).
// - Host-placed blocks and the host copies of NVMe-placed blocks live in the tier manager's
//   pinned pool (host-placed blocks at their size, NVMe blocks in power-of-two classes),
//   reserved whole at start (Note [host pool] in
//   memory_model.cc).
// Activations (LibTorch's own allocations, outside the engine's device accounting) are added to
// the HBM total when the model is a GPT, and listed apart.
// Thread-safety: plain functions on values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/config.h"
#include "runtime/base/status.h"
#include "tools/planner/model_spec.h"

namespace strata::planner {

enum class MemTier { kHbm, kHostPinned, kHostPageable, kNvme };
const char* MemTierName(MemTier t);  // "hbm", "host_pinned", "host_pageable", "nvme"

struct MemoryItem {
  std::string what;      // "master32", "param16 gather buffers (peak)", ...
  MemTier tier = MemTier::kHbm;
  uint64_t bytes = 0;
  // Which StepReport field sees these bytes: "peak_device_bytes", "peak_host_bytes" or "" when
  // the engine does not account for them (LibTorch allocations, init-time copies).
  std::string measured_by;
  bool transient = false;  // a peak over the step, not a resident allocation
  std::string note;
};

struct EstimateOptions {
  int world_size = 1;
  // "cpu" or "cuda": sets the device allocator's rounding and whether host staging copies exist.
  // Empty: from config.strata.device ("auto" reads as cpu: no GPU is needed to estimate).
  std::string device;
  // strata.placement auto: what the tiers may hold (0: the config's budgets; the host and the
  // disk then count as empty). strata-estimate fills them from this machine or its flags.
  uint64_t device_capacity = 0;
  uint64_t host_available = 0;
  uint64_t host_capacity = 0;  // StepPlan::Inputs::host_capacity: a planned host tier, as is
  uint64_t disk_free = 0;
  bool assume_nvme_path = false;  // plan as if an nvme_path were set (--largest)
  // The flags that gave the budgets above, named in refusals (StepPlan::Inputs'); empty: the
  // config's keys and this machine's measures.
  std::string device_flag, host_flag, disk_flag;
  // How the model is built (Note [init disk peak] in memory_model.cc): strata-train's zero::Init
  // stages a stage-3 model with NVMe parameter offload, all but its generated weights; a Python
  // script's strata.zero.Init stages every parameter, whatever the stage and offload.
  enum class Build { kStrataTrain, kPythonZeroInit };
  Build build = Build::kStrataTrain;
  // kPythonZeroInit: the bytes of an element the script's zero.Init(dtype=...) stages, 4 (fp32)
  // or 2 (bf16, fp16); 0: zero.Init's default, 2 with a bf16 master and 4 otherwise (as
  // strata-train stages).
  int init_element_bytes = 0;
};

struct MemoryEstimate {
  // The optimizer-state layout (StateLayout::Name(): "fp32", "int8+bf16_master", ...), which
  // picks the optimizer lane's rate in the cost model.
  std::string state_layout = "fp32";
  // SUM: bytes per rank on each tier at the step's peak (resident + transient), activations
  // included in hbm when known.
  uint64_t hbm_bytes = 0;
  uint64_t host_pinned_bytes = 0;
  uint64_t host_pageable_bytes = 0;
  uint64_t nvme_bytes = 0;
  // What the engine's own counters should read after a step: StepReport.peak_device_bytes and
  // StepReport.peak_host_bytes.
  uint64_t engine_device_peak_bytes = 0;
  // The device peak when the reduce lane keeps up with compute (it frees each chunk's gradient
  // buffer before the next allocation); engine_device_peak_bytes assumes it lags by one chunk.
  // The engine's measured peak lies between the two.
  uint64_t engine_device_peak_min_bytes = 0;
  uint64_t engine_host_peak_bytes = 0;
  uint64_t activation_bytes = 0;  // 0 when the model is not a GPT
  // zero::Init (strata-train's stage 3 with offload_param nvme, or any Python build under
  // strata.zero.Init): the disk the start holds at its peak, the staging file (fp32, or bf16 for
  // a bf16 master) plus the NVMe blocks written while the engine reads the file back chunk by
  // chunk, giving its space back as it goes. That is the least it can start in; where the disk
  // has room for the whole file beside the whole state the engine keeps the file until the start
  // is through (runtime/engine/start_rollback.h). 0 without staging. Rank 0's: the other ranks
  // build shapes only (zero::StageMode::kShapesOnly) and write their own NVMe blocks.
  uint64_t init_disk_peak_bytes = 0;
  uint64_t staged_bytes = 0;  // the staging file when the model is built
  // The disk the start needs: its peak, since the NVMe tier asks for the growth beside the file
  // (Note [start's disk] in runtime/engine/engine_init.cc). Over several nvme paths, on the first
  // one's file system (the staging directory's), with the swap files of the paths that share it
  // on this machine. 0 without staging.
  uint64_t init_disk_need_bytes = 0;
  uint64_t host_pool_bytes = 0;   // the pinned pool the engine reserves (== host_pinned_bytes)
  // The least strata.host_memory_budget the engine accepts: host-placed blocks plus 8 NVMe blocks.
  uint64_t host_min_bytes = 0;
  // Packing.
  int64_t chunks = 0;
  int64_t param_numel = 0;
  int64_t padded_numel = 0;       // all chunks, padding included
  int64_t shard_numel = 0;        // this rank's elements over all chunks
  // This rank's shard elements chunk by chunk, in the order the next forward first gathers the
  // chunks (persistent ones first), which is the order stage 3's deferred updates run in
  // (Engine::Impl::UpdateOrder): what the step prediction pipelines them by.
  std::vector<int64_t> update_order_shard_numel;
  // Model state (working copy, gradient, master, moments) over every tier and rank, per
  // parameter: 18 for fp32 states with a 16-bit working copy; fewer with the compact layouts.
  double bytes_per_param = 0;
  int stage = 0;
  int world_size = 1;
  std::string device;
  std::vector<MemoryItem> items;
  std::vector<std::string> notes;
  // The engine's placement plan (runtime/state/placement_plan.h): bytes per tier and state, and
  // its lines as the engine logs them.
  nlohmann::json placement;
  std::vector<std::string> placement_lines;
  // strata.placement auto: the strata.device_reserve the plan was made with (EstimateAutoReserve
  // sets it from the replay; the engine runs the same plan when its config says the same).
  uint64_t device_reserve = 0;

  nlohmann::json ToJson() const;
  std::string ToTable() const;  // human-readable, one line per item plus per-tier totals
};

// Estimates for one rank. Fails on a config/model the engine would reject (an invalid chunk
// size, a model without parameters, world_size < 1).
StatusOr<MemoryEstimate> EstimateMemory(const Config& config, const ModelSpec& model,
                                        const EstimateOptions& options = {});

// EstimateMemory, and under strata.placement auto with no strata.device_reserve set, the reserve
// the step needs: what the replay keeps on the device beside the device-homed states (gathered
// chunks, gradient buffers, activations) plus 5 %, refined until it settles, so that the plan
// leaves the compute room. MemoryEstimate::device_reserve and a note give it for the config.
// The device peak a device budget bounds: on the CPU device the engine's own allocations
// (LibTorch's activations live in host memory there, outside the budget), on a GPU everything
// on it (hbm_bytes: activations included).
uint64_t DeviceBudgetPeak(const MemoryEstimate& est);
// What of hbm_bytes is host memory outside every budget: on the CPU device LibTorch's activations
// and block gradients (hbm_bytes less the engine's peak), on a GPU nothing.
uint64_t HostTorchBytes(const MemoryEstimate& est);

StatusOr<MemoryEstimate> EstimateAutoReserve(const Config& config, const ModelSpec& model,
                                             const EstimateOptions& options = {});

}  // namespace strata::planner
