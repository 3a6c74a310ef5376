// Cost model and placement search for strata-tune.
//
// Lanes of one optimizer step (per rank), following what runtime/engine/engine.cc does today:
// - main thread: compute (FLOPs / measured FLOP rate), and — serially, because the engine's
//   gathers and gradient hand-offs block the compute thread — stage-3 parameter fetches (NVMe
//   read + host->device copy, twice per micro-step: forward and backward) and gradient shards
//   (device->host copy; NVMe write, plus a read when accumulating);
// - optimizer lane: Adam elements / measured Adam throughput, plus its NVMe state traffic (read
//   master/m/v/grad, write master/m/v, and param16 for stage 3 NVMe params) and the copy of new
//   working values to the device;
// - the NVMe and copy lanes are shared: the step can be no shorter than their total busy time;
// - with more than one rank, collectives (ring algorithms, at the measured bus bandwidth) block
//   the main thread too: per micro-step a reduce-scatter of the fp32 gradients and, under stage
//   3, an all-gather of the parameters in forward and again in backward; below stage 3 one
//   all-gather of the updated parameters ends the step.
// Step time = max(main, start of the lane + lane, NVMe busy, copy busy) when the optimizer
// overlaps backward (the lane starts once backward of the last micro-step begins), and
// main + gradient-norm scan + lane when it is deferred (clipping or fp16).
// Thread-safety: plain functions on values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "runtime/base/config.h"
#include "runtime/base/status.h"
#include "runtime/state/state_layout.h"
#include "tools/planner/memory_model.h"
#include "tools/planner/model_spec.h"
#include "tools/planner/profile.h"

namespace strata::planner {

struct StepPrediction {
  double step_s = 0;
  // Busy seconds per lane.
  double compute_s = 0;
  double copy_s = 0;
  double nvme_s = 0;
  double optimizer_s = 0;  // Adam arithmetic only
  double comm_s = 0;       // collectives (0 with one rank)
  double main_s = 0;       // main thread: compute + its serial I/O
  double lane_s = 0;       // optimizer lane: Adam + its serial I/O
  // SUM: bytes per step.
  uint64_t bytes_nvme_read = 0;
  uint64_t bytes_nvme_write = 0;
  uint64_t bytes_copy = 0;
  uint64_t bytes_comm = 0;  // bytes each rank sends (ring: (W-1)/W of each full buffer)
  double flops = 0;
  // What the prediction had to assume (a layout's rate missing from the profile).
  std::vector<std::string> notes;
  nlohmann::json ToJson() const;
};

// Rates the model uses; FromProfile fills them and says what it had to assume.
struct Rates {
  double gflops = 0;          // compute
  double copy_gbps = 0;       // host<->device
  double dram_gbps = 0;       // host memory streaming (gradient-norm scan, device-to-device on cpu)
  double adam_gelems = 0;     // CPU Adam elements per second / 1e9 (fp32 states)
  std::map<std::string, double> adam_layout_gelems;  // other state layouts, by StateLayout::Name()
  // The threads those rates ran on (0: not recorded), the machine's physical cores, and each
  // layout's rate on one thread ("fp32" too); from the profile. The optimizer lane runs on the
  // threads the engine gives it (ChooseOptimizerThreads: fewer where updates overlap compute),
  // and its rate is scaled to them (Note [optimizer lane threads] in cost_model.cc).
  int adam_threads = 0;
  int physical_cores = 0;
  std::map<std::string, double> adam_one_thread;
  // LibTorch's compute threads on the CPU device (torch::get_num_threads() where the run will
  // train; 0: unknown, and the lane is taken at the profile's threads). A GPU's compute takes one.
  int cpu_compute_threads = 0;
  double nvme_read_gbps = 0;  // at the chosen aio setting
  double nvme_write_gbps = 0;
  double comm_busbw_gbps = 0; // collectives' bus bandwidth (bytes each rank moves / time); world > 1
  std::vector<std::string> assumptions;
};

// Fills Rates from a profile for `device` ("cpu"/"cuda"). The compute rate is
// `gflops_override` when > 0, else the profile's figure for the working dtype (`fp32`: the fp32
// figure when measured), which must have been measured on `device`; a figure the profile lacks
// fails naming the section.
// `override_source` names where an override came from in the assumption line.
StatusOr<Rates> RatesFromProfile(const HardwareProfile& profile, const std::string& device,
                                 double gflops_override, bool fp32 = false,
                                 const std::string& override_source = "--gflops");

// Sets rates->nvme_read_gbps / nvme_write_gbps from the profile at `aio`'s setting where it was
// measured, else at the best measured read point (said in rates->assumptions); leaves them 0
// when the profile has no NVMe points (the prediction then has no NVMe lane, also said).
void SetNvmeRates(const HardwareProfile& profile, const AioConfig& aio, Rates* rates);

// What stage 3's deferred updates add to a step: `lane_s` of updates run over the chunks in
// `order_numel`'s order (their shard elements) beside the next step's first forward
// (`forward_s`), which waits for each chunk's update before gathering it; in [0, lane_s]
// (Note [deferred updates in the step] in cost_model.cc).
double DeferredUpdatesAdd(const std::vector<int64_t>& order_numel, double lane_s, double forward_s);

// Predicts one step of a GPT model on each of `world_size` ranks (the model must carry its
// ModelConfig: FLOPs need shapes; `memory` must be estimated for the same world size). With more
// than one rank rates.comm_busbw_gbps must be set.
StatusOr<StepPrediction> PredictStep(const Config& config, const ModelSpec& model,
                                     const MemoryEstimate& memory, const Rates& rates,
                                     const std::string& device, int world_size = 1);

struct TuneOptions {
  int world_size = 1;
  std::string device = "cpu";
  // bytes; 0: config's strata.device_memory_budget, then 4 GiB (cpu) or the profile's
  // device_memory (cuda)
  uint64_t device_budget = 0;
  uint64_t host_budget = 0;    // bytes; 0: config's strata.host_memory_budget, then half of RAM
  uint64_t nvme_budget = 0;    // bytes; 0: config's strata.nvme_capacity, then unlimited
  bool nvme_allowed = true;    // false when no nvme_path is known
  double gflops_override = 0;
  std::string gflops_source = "--gflops";  // what set gflops_override, for the assumption line
  double comm_gbps_override = 0;  // bus bandwidth for world_size > 1; 0: the profile's "comm"
  // Which placement modes to search (Note [tuning auto placement] in cost_model.cc): the
  // sections' devices as written (strata.placement config), the per-chunk fill (auto), or both.
  bool try_config = true, try_auto = true;
  // The free disk at the NVMe path (0: unknown): auto candidates with no nvme_budget fill it (else
  // NVMe is unlimited there), and a candidate with NVMe whose start needs more disk
  // (init_disk_need_bytes, or its NVMe state) is infeasible.
  uint64_t disk_free = 0;
  // LibTorch's compute threads where the run will train (Rates::cpu_compute_threads; 0: unknown).
  int cpu_compute_threads = 0;
  // Optimizer-state layouts to search (runtime/state/state_layout.h); empty: the config's own,
  // left as written. Any other changes the optimizer's numerics (README, "Compact layouts").
  std::vector<StateLayout> layouts;
};

// The config's optimizer-state layout (bf16.bf16_master_weights_and_grads,
// strata.optimizer_state_dtype).
StateLayout ConfigLayout(const Config& config);
// Why `layout` cannot run under `config` (a bf16 master without bf16 compute, moments for SGD
// without momentum, a client optimizer's states), or "".
std::string LayoutRefusal(const StateLayout& layout, const Config& config);
// The six layouts, largest first (fp32 ... int8+bf16_master).
std::vector<StateLayout> AllLayouts();
// Bytes per parameter of a layout's master and moments (the gradient and working copy aside).
double LayoutStateBytes(const StateLayout& layout);

struct Candidate {
  // kConfig: each state kind in its section's device. kAuto: the sections' devices are floors
  // and the placement plan fills device, host and NVMe per chunk under the budgets.
  PlacementMode mode = PlacementMode::kConfig;
  OffloadDevice param = OffloadDevice::kNone;      // stage 3 only
  OffloadDevice optimizer = OffloadDevice::kCpu;
  bool uses_nvme = false;                          // NVMe may be used (a section's device is nvme)
  NvmePoint aio;                                   // meaningful when uses_nvme
  // The optimizer-state layout, when the search covered a list of them (TuneOptions::layouts);
  // otherwise the config's own, which is left as written.
  bool layout_searched = false;
  StateLayout layout;
  bool planned = true;  // false: the placement plan refused it (why_not says why; no figures)
  // kAuto with a host budget given: the pool the plan was made with (the budget less the memory
  // the run needs beside it), which strata.host_memory_budget must say for the engine to make the
  // same plan; 0 without one (the engine sizes its pool to the plan).
  uint64_t host_pool = 0;
  MemoryEstimate memory;
  StepPrediction prediction;
  bool feasible = false;
  std::string why_not;                             // when !feasible: the budget it breaks
  // "param=cpu optimizer=nvme aio=8MiBxQD32x1"; "auto param>=nvme optimizer>=nvme ..." for kAuto;
  // "... [int8+bf16_master]" when layouts were searched.
  std::string Describe() const;
};

struct TuneResult {
  std::vector<Candidate> candidates;  // feasible ones first, each group by predicted step time
  uint64_t device_budget = 0, host_budget = 0, nvme_budget = 0;  // as applied (0: unlimited)
  std::vector<std::string> assumptions;
};

// Enumerates placements (offload_param x offload_optimizer devices as written, the per-chunk
// auto fill over the lowest floors, and for NVMe every measured aio setting), estimates memory
// and step time for each, and ranks them. A placement the plan refuses is an infeasible
// candidate, not an error. Fails when the model is not a GPT or the profile lacks a figure every
// candidate needs.
StatusOr<TuneResult> Tune(const Config& config, const ModelSpec& model, const HardwareProfile& profile,
                          const TuneOptions& options);

// Applies a candidate to a config JSON in place, touching only the keys it decides:
// zero_optimization.offload_param.device / offload_optimizer.device (+ nvme_path when NVMe is
// chosen and none is set), strata.placement ("auto" for an auto candidate; "config" where the
// input names a mode and the candidate is not auto), an auto candidate's strata.device_reserve
// (the compute room its plan left), a searched layout's bf16.bf16_master_weights_and_grads and
// strata.optimizer_state_dtype (bf16_optimizer_states dropped: the dtype says it) and, with
// NVMe, aio.block_size / queue_depth / intra_op_parallelism.
void ApplyCandidate(const Candidate& c, const std::string& nvme_path, nlohmann::json* config);
// The same keys on a parsed Config (what --verify runs and what Tune estimates).
void ApplyCandidate(const Candidate& c, Config* config);

const char* OffloadName(OffloadDevice d);  // "none", "cpu", "nvme"

}  // namespace strata::planner
