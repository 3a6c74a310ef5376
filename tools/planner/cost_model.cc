#include "tools/planner/cost_model.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "runtime/base/host_info.h"
#include "runtime/base/units.h"
#include "runtime/state/placement_plan.h"

namespace strata::planner {

const char* OffloadName(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone: return "none";
    case OffloadDevice::kCpu: return "cpu";
    case OffloadDevice::kNvme: return "nvme";
  }
  return "?";
}

nlohmann::json StepPrediction::ToJson() const {
  return {{"step_s", step_s},       {"compute_s", compute_s},
          {"copy_s", copy_s},       {"nvme_s", nvme_s},
          {"optimizer_s", optimizer_s}, {"comm_s", comm_s}, {"main_s", main_s},
          {"lane_s", lane_s},       {"bytes_nvme_read", bytes_nvme_read},
          {"bytes_nvme_write", bytes_nvme_write}, {"bytes_copy", bytes_copy},
          {"bytes_comm", bytes_comm}, {"flops", flops}, {"notes", notes}};
}

StatusOr<Rates> RatesFromProfile(const HardwareProfile& p, const std::string& device,
                                 double gflops_override, bool fp32,
                                 const std::string& override_source) {
  Rates r;
  r.gflops = gflops_override > 0                       ? gflops_override
             : fp32 && p.compute_fp32_gflops > 0 ? p.compute_fp32_gflops
                                                 : p.compute_gflops;
  if (r.gflops <= 0)
    return InvalidArgument("the profile has no compute figure (compute.gflops) and --gflops was not given; "
                           "rerun `strata-swapbench profile` or pass --gflops");
  // A CPU's matmul rate for a GPU's step (or the reverse) is off by orders of magnitude.
  if (gflops_override <= 0 && p.compute_device != device)
    return InvalidArgument(StrCat("the profile's compute rate (", r.gflops, " GFLOP/s) was measured on the ",
                                  p.compute_device, ", and this prediction is for the ", device,
                                  ": profile on the machine that trains (`strata-swapbench profile`; on a GPU "
                                  "it needs a LibTorch with CUDA), or pass --gflops"));
  if (gflops_override > 0)
    r.assumptions.push_back(StrCat("compute rate ", gflops_override, " GFLOP/s (", override_source, ")"));
  if (p.dram_gbps <= 0)
    return InvalidArgument("the profile has no dram.copy_gbps; rerun `strata-swapbench profile`");
  r.dram_gbps = p.dram_gbps;
  if (p.adam_gelems_per_s <= 0)
    return InvalidArgument("the profile has no adam.gelems_per_s; rerun `strata-swapbench profile`");
  r.adam_gelems = p.adam_gelems_per_s;
  r.adam_layout_gelems = p.adam_layout_gelems_per_s;
  r.adam_threads = p.adam_threads;
  r.physical_cores = p.physical_cores;
  r.adam_one_thread = p.adam_one_thread_gelems_per_s;
  const double h2d = p.CopyGbps(device, "h2d"), d2h = p.CopyGbps(device, "d2h");
  if (h2d > 0 && d2h > 0) {
    r.copy_gbps = std::min(h2d, d2h);
  } else if (device == "cpu") {
    r.copy_gbps = p.dram_gbps;
    r.assumptions.push_back("no cpu-device copy figure in the profile: copies at the DRAM figure");
  } else {
    return InvalidArgument(StrCat("the profile has no ", device, " copy figures (copies[]); profile on "
                                  "the machine with the ", device, " device"));
  }
  return r;
}

void SetNvmeRates(const HardwareProfile& profile, const AioConfig& aio, Rates* rates) {
  auto read = profile.NvmeGbps(false, aio.block_size, aio.queue_depth, aio.intra_op_parallelism);
  auto write = profile.NvmeGbps(true, aio.block_size, aio.queue_depth, aio.intra_op_parallelism);
  if (read.ok() && write.ok()) {
    rates->nvme_read_gbps = *read;
    rates->nvme_write_gbps = *write;
    return;
  }
  auto best = profile.BestAio();
  if (!best.ok()) {
    rates->assumptions.push_back("the profile has no NVMe points: the prediction has no NVMe lane "
                                 "(profile with --path on the NVMe drive)");
    return;
  }
  rates->nvme_read_gbps = read.ok() ? *read : best->gbps;
  auto best_write = profile.NvmeGbps(true, best->block_size, best->queue_depth, best->parallelism);
  rates->nvme_write_gbps = write.ok() ? *write : best_write.ok() ? *best_write : best->gbps;
  rates->assumptions.push_back(StrCat("NVMe at the profile's best point (", FormatBytes(static_cast<uint64_t>(best->block_size)),
                                      " x QD", best->queue_depth, " x", best->parallelism,
                                      "): the config's aio setting was not measured"));
}

namespace {

// Note [optimizer lane threads]
// The profile times each layout's CPU Adam on every thread the machine gives a process, and on
// one. The engine's optimizer lane gets ChooseOptimizerThreads' count: every physical core when
// its updates run alone in Step, the cores LibTorch's compute leaves (at least one) when they
// overlap compute, or strata.optimizer_threads. On 2 cores with one compute thread that is one
// thread, and an 8-bit layout, arithmetic-bound, updates at half the profile's rate. The rate on
// t threads is taken as the one-thread rate times t, capped at the all-thread figure (which a
// memory-bound layout reaches with fewer threads); without the one-thread figure (older
// profiles), the all-thread rate times t over the profile's threads. Never above the profile's
// figure: more threads than it ran on are not extrapolated.
double LaneAdamRate(const Rates& r, const std::string& layout, double all_threads, bool cuda, int64_t configured,
                    bool beside_compute, std::vector<std::string>* notes) {
  const int compute = cuda ? 1 : r.cpu_compute_threads;
  if (r.adam_threads <= 0 || r.physical_cores <= 0 || (configured <= 0 && compute <= 0)) return all_threads;
  const int lane = ChooseOptimizerThreads(r.physical_cores, compute, static_cast<int>(configured), beside_compute);
  if (lane >= r.adam_threads) return all_threads;
  const auto one = r.adam_one_thread.find(layout);
  if (one != r.adam_one_thread.end() && one->second > 0)
    return std::min(all_threads, one->second * lane);
  notes->push_back(StrCat("the optimizer lane runs on ", lane, " of the profile's ", r.adam_threads,
                          " threads; the profile has no one-thread CPU Adam figure (rerun `strata-swapbench "
                          "profile`), so its rate is scaled by ", lane, "/", r.adam_threads));
  return all_threads * lane / r.adam_threads;
}

}  // namespace

// Note [deferred updates in the step]
// Step queues stage 3's deferred updates and returns; the next step's first forward waits for
// each chunk's update just before it gathers that chunk (Note [deferred optimizer]). The lane and
// that forward are then a two-stage pipeline over the chunks in one order: the forward finishes
// chunk k at the latest of (the lane's end of chunk k) + its own work on k, over every k. With
// each lane's time spread over the chunks by their elements (shares s_k, running sums S_k), the
// forward ends after max over k of (L * S_k + F * (1 - S_(k-1))), that is F plus
// max_k(L * S_k - F * S_(k-1)): what the updates add to the step. Uniform chunks give L - F (+ F/n)
// when the lane is the longer, L/n when the forward is; a first chunk holding most of the model
// (a large tied embedding, which the forward needs first) hides almost nothing.
double DeferredUpdatesAdd(const std::vector<int64_t>& order_numel, double lane_s, double forward_s) {
  double total = 0;
  for (int64_t n : order_numel) total += static_cast<double>(n);
  if (total <= 0) return std::max(0.0, lane_s - forward_s);
  double added = 0, before = 0;
  for (int64_t n : order_numel) {
    const double through = before + static_cast<double>(n) / total;
    added = std::max(added, lane_s * through - forward_s * before);
    before = through;
  }
  return std::clamp(added, 0.0, lane_s);
}

StatusOr<StepPrediction> PredictStep(const Config& config, const ModelSpec& model,
                                     const MemoryEstimate& mem, const Rates& r,
                                     const std::string& device, int world_size) {
  if (!model.gpt)
    return InvalidArgument("step-time prediction needs the model's shapes: pass a config with a \"model\" "
                           "section");
  const auto& z = config.zero_optimization;
  const double S = static_cast<double>(mem.shard_numel);
  const double e = (config.bf16.enabled || config.fp16.enabled) ? 2 : 4;
  const int acc = static_cast<int>(std::max<int64_t>(1, config.gradient_accumulation_steps));
  const bool cuda = device == "cuda";
  const bool immediate = config.strata.overlap_optimizer && config.gradient_clipping == 0 &&
                         !config.fp16.enabled;
  // Bytes of one state kind in one tier, from the placement plan the estimate carries.
  auto tier_bytes = [&](const char* tier, const char* kind) {
    if (!mem.placement.is_object() || !mem.placement.contains(tier)) return 0.0;
    return static_cast<double>(mem.placement[tier].value(kind, uint64_t{0}));
  };
  // The gradient block's bytes per element: 4, or 2 under a bf16 master (its grads are bf16).
  const double grad_all = tier_bytes("device", "grad") + tier_bytes("host", "grad") + tier_bytes("nvme", "grad");
  const double g = S > 0 && grad_all > 0 ? grad_all / S : 4;
  // Elements of this rank's shards per tier: working shards (param16, stage 3) and optimizer
  // groups (counted by their gradient).
  const double Pd = z.stage == 3 ? tier_bytes("device", "param16") / e : 0;
  const double Ph = z.stage == 3 ? tier_bytes("host", "param16") / e : 0;
  const double Pn = z.stage == 3 ? tier_bytes("nvme", "param16") / e : 0;
  const double Od = tier_bytes("device", "grad") / g, Oh = tier_bytes("host", "grad") / g;
  const double On = tier_bytes("nvme", "grad") / g;
  const double Ooff = Oh + On;
  // An NVMe-homed group's update reads its gradient and states and writes the states back: the
  // master (none where it is the working shard), the moments in their format.
  const double nvme_states = tier_bytes("nvme", "master32") + tier_bytes("nvme", "exp_avg") +
                             tier_bytes("nvme", "exp_avg_sq");

  StepPrediction p;
  auto copy_t = [&](double bytes) { return bytes / (r.copy_gbps * 1e9); };
  auto d2d_t = [&](double bytes) { return cuda ? 0.0 : bytes / (r.dram_gbps * 1e9); };
  auto rd_t = [&](double bytes) { return r.nvme_read_gbps > 0 ? bytes / (r.nvme_read_gbps * 1e9) : 0; };
  auto wr_t = [&](double bytes) { return r.nvme_write_gbps > 0 ? bytes / (r.nvme_write_gbps * 1e9) : 0; };
  double copy_bytes = 0, nvme_r = 0, nvme_w = 0;

  const double flops_micro =
      GptFlopsPerMicroBatch(*model.gpt, config.train_micro_batch_size_per_gpu);
  const double compute_micro = flops_micro / (r.gflops * 1e9);
  // Main thread, per micro-step: parameter fetches (forward + backward) and gradient hand-off.
  double param_io = 0, grad_io = 0, grad_io_first = 0;
  if (z.stage == 3) {
    param_io = d2d_t(2 * Pd * e) + copy_t(2 * (Ph + Pn) * e) + rd_t(2 * Pn * e);
    copy_bytes += acc * 2 * (Ph + Pn) * e;
    nvme_r += acc * 2 * Pn * e;
  }
  grad_io = grad_io_first = d2d_t(Od * g) + copy_t(Ooff * g) + wr_t(On * g);
  grad_io += rd_t(On * g);  // accumulating micro-steps read the shard back
  copy_bytes += acc * Ooff * g;
  nvme_w += acc * On * g;
  nvme_r += (acc - 1) * On * g;
  // Collectives: ring all-gather / reduce-scatter move (W-1) shards per rank.
  const double W = static_cast<double>(std::max(1, world_size));
  if (W > 1 && r.comm_busbw_gbps <= 0)
    return InvalidArgument(StrCat("a step on ", world_size, " ranks needs the collectives' bus bandwidth (Rates::comm_busbw_gbps)"));
  auto comm_t = [&](double bytes) { return W > 1 ? bytes / (r.comm_busbw_gbps * 1e9) : 0.0; };
  const double rs_bytes = W > 1 ? (W - 1) * S * 4 : 0;                     // gradients, fp32
  const double ag_bytes = W > 1 ? (W - 1) * S * e : 0;                     // working parameters
  const double comm_micro = rs_bytes + (z.stage == 3 ? 2 * ag_bytes : 0);  // forward + backward gathers
  const double comm_tail = z.stage == 3 ? 0 : ag_bytes;                    // updated parameters
  param_io += comm_t(z.stage == 3 ? 2 * ag_bytes : 0);
  grad_io += comm_t(rs_bytes);
  grad_io_first += comm_t(rs_bytes);
  p.comm_s = comm_t(acc * comm_micro + comm_tail);
  p.bytes_comm = static_cast<uint64_t>(acc * comm_micro + comm_tail);

  const double main_first = compute_micro + param_io + grad_io_first;
  const double main_next = compute_micro + param_io + grad_io;
  p.main_s = main_first + (acc - 1) * main_next;
  const double last_micro_forward = compute_micro / 3 + param_io / 2;
  const double before_last = acc > 1 ? main_first + (acc - 2) * main_next : 0;

  // Optimizer lane: the host optimizer's groups; a GPU updates its own groups in far less time
  // than the lane (HBM-bound), while the CPU device's optimizer shares the host's cores.
  // The host optimizer's rate in this run's state layout; a profile without that layout's
  // figure (older profiles) leaves the fp32 rate, which the compact layouts do not reach.
  double adam = r.adam_gelems;
  const std::string layout = mem.state_layout.empty() ? "fp32" : mem.state_layout;
  if (layout != "fp32") {
    const auto it = r.adam_layout_gelems.find(layout);
    if (it != r.adam_layout_gelems.end() && it->second > 0) adam = it->second;
    else p.notes.push_back(StrCat("the profile has no CPU Adam figure for the ", layout,
                                  " optimizer states (rerun `strata-swapbench profile`): the optimizer "
                                  "lane uses the fp32 rate, faster than that layout's"));
  }
  // Updates beside compute: during backward (immediate), or after Step beside the next forward
  // (stage 3's deferred updates), as StepPlan decides.
  const bool deferred = config.strata.overlap_optimizer && !immediate && z.stage == 3;
  const bool beside_compute = immediate || deferred;
  adam = LaneAdamRate(r, layout, adam, cuda, config.strata.optimizer_threads, beside_compute, &p.notes);
  p.optimizer_s = (cuda ? Ooff : S) / (adam * 1e9);
  double lane_io = rd_t(On * g + nvme_states) + wr_t(nvme_states);
  nvme_r += On * g + nvme_states;
  nvme_w += nvme_states;
  lane_io += wr_t(Pn * e);
  nvme_w += Pn * e;
  // A host optimizer publishes new values to device-resident working copies: one copy from its
  // staging buffer per shard, over PCIe on a GPU and a memcpy on the CPU device.
  const double staged = z.stage == 3 ? std::max(0.0, Pd - Od) : Ooff;
  if (cuda) {
    lane_io += copy_t(staged * e);
    copy_bytes += staged * e;
  } else {
    lane_io += d2d_t(staged * e);
  }
  p.lane_s = p.optimizer_s + lane_io;

  p.compute_s = acc * compute_micro;
  p.flops = acc * flops_micro;
  p.bytes_nvme_read = static_cast<uint64_t>(nvme_r);
  p.bytes_nvme_write = static_cast<uint64_t>(nvme_w);
  p.bytes_copy = static_cast<uint64_t>(copy_bytes);
  p.nvme_s = rd_t(nvme_r) + wr_t(nvme_w);
  p.copy_s = copy_t(copy_bytes);
  // The global norm adds no pass over the gradients: each chunk's part is summed while its
  // reduced gradient is hot, in backward (Note [deferred optimizer] in optimizer_lane.cc).
  if (immediate) {
    p.step_s = std::max(p.main_s, before_last + last_micro_forward + p.lane_s);
  } else if (deferred) {
    p.step_s = p.main_s + DeferredUpdatesAdd(mem.update_order_shard_numel, p.lane_s,
                                             compute_micro / 3 + param_io / 2);
  } else {
    p.step_s = p.main_s + p.lane_s;  // Step waits for the updates
  }
  p.step_s += comm_t(comm_tail);  // Step shares the updated shards after the optimizer
  p.step_s = std::max({p.step_s, p.nvme_s, p.copy_s});
  return p;
}

std::string Candidate::Describe() const {
  const bool automatic = mode == PlacementMode::kAuto;
  const char* rel = automatic ? ">=" : "=";
  std::string s = StrCat(automatic ? "auto " : "", "param", rel, OffloadName(param), " optimizer", rel,
                         OffloadName(optimizer));
  if (uses_nvme && aio.block_size > 0)
    s += StrCat(" aio=", FormatBytes(static_cast<uint64_t>(aio.block_size)), "xQD", aio.queue_depth, "x",
                aio.parallelism);
  if (layout_searched) s += StrCat(" [", layout.Name(), "]");
  return s;
}

StateLayout ConfigLayout(const Config& config) {
  StateLayout l;
  l.bf16_master = config.bf16.enabled && config.bf16.bf16_master_weights_and_grads;
  l.moments = StateLayout::MomentsOf(config.strata.optimizer_state_dtype);
  return l;
}

std::string LayoutRefusal(const StateLayout& layout, const Config& config) {
  if (layout == StateLayout{}) return "";
  if (config.zero_allow_untested_optimizer)
    return "a client optimizer (zero_allow_untested_optimizer) keeps its own states";
  if (layout.bf16_master && !config.bf16.enabled)
    return "a bf16 master is the bf16 working copy: it needs bf16 compute (bf16.enabled)";
  if (layout.moments != optim::MomentFormat::kFp32 && config.optimizer.type == OptimizerType::kSGD &&
      config.optimizer.momentum == 0)
    return "SGD without momentum keeps no moments";
  return "";
}

std::vector<StateLayout> AllLayouts() {
  std::vector<StateLayout> out;
  for (bool master : {false, true})
    for (auto m : {optim::MomentFormat::kFp32, optim::MomentFormat::kBf16, optim::MomentFormat::kInt8})
      out.push_back(StateLayout{master, m});
  std::stable_sort(out.begin(), out.end(), [](const StateLayout& a, const StateLayout& b) {
    return LayoutStateBytes(a) > LayoutStateBytes(b);
  });
  return out;
}

double LayoutStateBytes(const StateLayout& layout) {
  constexpr int64_t kN = 1 << 20;
  return static_cast<double>(layout.Bytes(StateKind::kMaster32, kN) + layout.Bytes(StateKind::kExpAvg, kN) +
                             layout.Bytes(StateKind::kExpAvgSq, kN)) /
         kN;
}

namespace {

// The budgets the candidates must fit: the flags', else the config's, else the device's (4 GiB
// on the CPU device; on a GPU the free memory the profile measured, else unlimited), half the
// RAM, and unlimited NVMe.
void SetBudgets(const Config& config, const HardwareProfile& profile, const TuneOptions& o, TuneResult* res) {
  const bool cpu = o.device == "cpu";
  res->device_budget = o.device_budget ? o.device_budget
                       : config.strata.device_memory_budget ? config.strata.device_memory_budget
                       : cpu ? (4ull << 30) : 0;
  if (res->device_budget == 0 && profile.device_capacity_bytes > 0) {
    res->device_budget = profile.device_capacity_bytes;
    res->assumptions.push_back(StrCat("device budget ", FormatBytes(res->device_budget), ": ",
                                      profile.device_name.empty() ? "the GPU" : profile.device_name,
                                      "'s free memory when profiled, as the engine takes it at start "
                                      "(--device-budget to change)"));
  }
  if (o.host_budget) {
    res->host_budget = o.host_budget;
  } else if (config.strata.host_memory_budget) {
    res->host_budget = config.strata.host_memory_budget;
  } else {
    res->host_budget = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                       static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) / 2;
  }
  res->nvme_budget = o.nvme_budget ? o.nvme_budget : config.strata.nvme_capacity;
}

// Why a placement does not fit the budgets, or "" when it does. The device budget bounds what
// the engine's does (DeviceBudgetPeak: on the CPU device LibTorch's activations are host
// memory, counted against the host budget), as strata-estimate --largest counts. A placement
// with NVMe also needs the disk its start grows to (the staging file and the NVMe blocks the
// start writes beside it, MemoryEstimate::init_disk_need_bytes; the state alone without a staging
// file) free at the NVMe path, which the engine checks there before it reads anything: `disk_free`
// (0: unknown, not checked).
std::string WhyNot(const MemoryEstimate& mem, const TuneResult& res, bool uses_nvme, uint64_t disk_free) {
  if (res.device_budget && DeviceBudgetPeak(mem) > res.device_budget)
    return StrCat("device ", FormatBytes(DeviceBudgetPeak(mem)), " > budget ", FormatBytes(res.device_budget));
  const uint64_t host = mem.host_min_bytes + mem.host_pageable_bytes + HostTorchBytes(mem);
  if (host > res.host_budget)
    return StrCat("host ", FormatBytes(host), " > budget ", FormatBytes(res.host_budget));
  if (res.nvme_budget && mem.nvme_bytes > res.nvme_budget)
    return StrCat("nvme ", FormatBytes(mem.nvme_bytes), " > budget ", FormatBytes(res.nvme_budget));
  const uint64_t disk = std::max(mem.init_disk_need_bytes, mem.nvme_bytes);
  if (uses_nvme && disk_free && disk > disk_free)
    return StrCat(mem.init_disk_need_bytes > mem.nvme_bytes ? "disk at start " : "nvme ", FormatBytes(disk),
                  " > free disk ", FormatBytes(disk_free));
  return "";
}

// An auto candidate's estimate, its tiers holding the tuner's budgets (Note [tuning auto
// placement]); sets them in *c, which then is the config the prediction reads. A host budget the
// user gave is the pool, as strata.host_memory_budget (which the written config then carries);
// half of RAM, assumed, is only the host tier's capacity, and the pool is sized to the plan's
// need, as the engine sizes it without a budget.
StatusOr<MemoryEstimate> EstimateAutoCandidate(const TuneResult& res, const TuneOptions& o,
                                               const ModelSpec& model, EstimateOptions eo, Config* c) {
  if (res.device_budget) c->strata.device_memory_budget = res.device_budget;
  if (res.nvme_budget) c->strata.nvme_capacity = res.nvme_budget;
  else eo.disk_free = o.disk_free ? o.disk_free : uint64_t{1} << 60;  // unknown: unlimited
  const bool host_given = o.host_budget || c->strata.host_memory_budget;
  auto estimate = [&](uint64_t host) {
    if (host_given) c->strata.host_memory_budget = host;
    else eo.host_capacity = host;
    return EstimateAutoReserve(*c, model, eo);
  };
  StatusOr<MemoryEstimate> mem = estimate(res.host_budget);
  // What the run needs beside the pool comes off the budget.
  const auto beside = [](const MemoryEstimate& m) { return m.host_pageable_bytes + HostTorchBytes(m); };
  uint64_t host = res.host_budget;
  if (mem.ok() && mem->host_min_bytes + beside(*mem) > res.host_budget && beside(*mem) < res.host_budget) {
    host = res.host_budget - beside(*mem);
    mem = estimate(host);
  }
  return mem;
}

// Feasible first; then faster; near-ties (1 %) go to less NVMe traffic, then less host memory.
void RankCandidates(std::vector<Candidate>* candidates) {
  std::stable_sort(candidates->begin(), candidates->end(), [](const Candidate& a, const Candidate& b) {
    if (a.feasible != b.feasible) return a.feasible;
    const double ta = a.prediction.step_s, tb = b.prediction.step_s;
    if (std::abs(ta - tb) > 0.01 * std::max(ta, tb)) return ta < tb;
    const uint64_t na = a.prediction.bytes_nvme_read + a.prediction.bytes_nvme_write;
    const uint64_t nb = b.prediction.bytes_nvme_read + b.prediction.bytes_nvme_write;
    if (na != nb) return na < nb;
    return a.memory.host_pageable_bytes < b.memory.host_pageable_bytes;
  });
}

}  // namespace

StatusOr<TuneResult> Tune(const Config& config, const ModelSpec& model, const HardwareProfile& profile,
                          const TuneOptions& o) {
  if (!model.gpt)
    return InvalidArgument("strata-tune needs the model's shapes: pass a config with a \"model\" section");
  STRATA_ASSIGN_OR_RETURN(Rates base, RatesFromProfile(profile, o.device, o.gflops_override,
                                                          !config.bf16.enabled && !config.fp16.enabled,
                                                          o.gflops_source));
  base.cpu_compute_threads = o.cpu_compute_threads;
  TuneResult res;
  res.assumptions = base.assumptions;
  if (o.world_size > 1) {
    if (o.comm_gbps_override > 0) {
      base.comm_busbw_gbps = o.comm_gbps_override;
      res.assumptions.push_back(StrCat("collectives at ", o.comm_gbps_override, " GB/s bus bandwidth (--comm-gbps)"));
    } else if (profile.comm_busbw_gbps > 0) {
      base.comm_busbw_gbps = profile.comm_busbw_gbps;
      res.assumptions.push_back(StrCat("collectives at ", profile.comm_busbw_gbps, " GB/s bus bandwidth (profile: ",
                                       profile.comm_backend, ", ", profile.comm_world_size, " ranks)"));
    } else {
      return InvalidArgument(StrCat(
          "--world-size ", o.world_size, " needs the collectives' bandwidth: run `strata-launch --nproc ",
          o.world_size, " -- strata-commbench --profile <profile.json>` to add it to the profile, or pass "
          "--comm-gbps <bus GB/s>"));
    }
  }
  const bool cpu = o.device == "cpu";
  SetBudgets(config, profile, o, &res);
  // aio settings to try: every measured read point (write figure at the same setting, or the
  // best write when that setting was not measured for writes).
  std::vector<NvmePoint> aios;
  double best_write = 0;
  for (const auto& p : profile.nvme)
    if (p.write) best_write = std::max(best_write, p.gbps);
  for (const auto& p : profile.nvme)
    if (!p.write) aios.push_back(p);
  const bool nvme_ok = o.nvme_allowed && !aios.empty();
  if (!o.nvme_allowed) res.assumptions.push_back("NVMe placements skipped: no nvme_path (pass --nvme-path)");
  else if (aios.empty()) res.assumptions.push_back("NVMe placements skipped: the profile has no NVMe points");

  const bool stage3 = config.zero_optimization.stage == 3;
  // (mode, param floor or device, optimizer floor or device) to try.
  std::vector<std::tuple<PlacementMode, OffloadDevice, OffloadDevice>> shapes;
  if (o.try_config) {
    std::vector<OffloadDevice> params = {OffloadDevice::kNone};
    if (stage3) params = {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme};
    std::vector<OffloadDevice> optims = {OffloadDevice::kCpu, OffloadDevice::kNvme};
    // Device-resident optimizer states only on the CPU device: the cost model has no rate for the
    // GPU Adam (adam_gelems is the CPU Adam's).
    if (cpu) optims.insert(optims.begin(), OffloadDevice::kNone);
    for (OffloadDevice pd : params)
      for (OffloadDevice od : optims)
        // The engine refuses offloaded parameters with the optimizer on the device.
        if (od != OffloadDevice::kNone || pd == OffloadDevice::kNone)
          shapes.emplace_back(PlacementMode::kConfig, pd, od);
  }
  // Note [tuning auto placement]
  // Under strata.placement auto the sections' devices are floors and the plan fills the tiers from
  // the top, so one candidate per set of floors covers every split of the chunks between tiers:
  // the lowest floors give the plan the most room, and a higher one only narrows it. Two are
  // tried: floors at the host (NVMe unused) and, where NVMe is allowed, floors at NVMe with each
  // measured aio setting. The tiers hold the tuner's budgets: the device budget (less the
  // replay's compute working set, EstimateAutoReserve), the host budget less the pageable memory
  // the run needs beside the pool, and the NVMe budget (else the free disk at the path, less the
  // 1 GiB the engine leaves). A GPU without a device budget (none given, none in the profile)
  // has no capacity to fill: auto is skipped there, and says so.
  const bool auto_ok = o.try_auto && (res.device_budget > 0 || cpu);
  if (o.try_auto && !auto_ok)
    res.assumptions.push_back("strata.placement auto skipped: it fills the device up to a budget; pass "
                              "--device-budget (the GPU's memory), or profile on the GPU machine, to try it");
  if (auto_ok) {
    const OffloadDevice host_floor = stage3 ? OffloadDevice::kCpu : OffloadDevice::kNone;
    shapes.emplace_back(PlacementMode::kAuto, host_floor, OffloadDevice::kCpu);
    if (nvme_ok)
      shapes.emplace_back(PlacementMode::kAuto, stage3 ? OffloadDevice::kNvme : OffloadDevice::kNone,
                          OffloadDevice::kNvme);
  }

  // The layouts: the config's as written, or each asked for that can run under it.
  std::vector<StateLayout> layouts = o.layouts;
  const bool searched = !layouts.empty();
  if (!searched) layouts.push_back(ConfigLayout(config));
  layouts.erase(std::remove_if(layouts.begin(), layouts.end(),
                               [&](const StateLayout& l) {
                                 const std::string why = searched ? LayoutRefusal(l, config) : "";
                                 if (!why.empty())
                                   res.assumptions.push_back(StrCat("layout ", l.Name(), " skipped: ", why));
                                 return !why.empty();
                               }),
                layouts.end());
  if (layouts.empty())
    return InvalidArgument(StrCat("no layout asked for can run under this config (",
                                  res.assumptions.back(), ")"));

  EstimateOptions eo;
  eo.world_size = o.world_size;
  eo.device = o.device;
  for (const StateLayout& layout : layouts) {
    for (const auto& [mode, pd, od] : shapes) {
      const bool nv = pd == OffloadDevice::kNvme || od == OffloadDevice::kNvme;
      if (nv && !nvme_ok) continue;
      Candidate shape;
      shape.mode = mode;
      shape.param = pd;
      shape.optimizer = od;
      shape.uses_nvme = nv;
      shape.layout_searched = searched;
      shape.layout = layout;
      Config c = config;
      ApplyCandidate(shape, &c);
      eo.assume_nvme_path = nv;  // the written config gets the path (ApplyCandidate's JSON form)
      std::vector<NvmePoint> settings = nv ? aios : std::vector<NvmePoint>{NvmePoint{}};
      for (const NvmePoint& a : settings) {
        Candidate cand = shape;
        Rates r = base;
        if (nv) {
          // The estimate per setting: the NVMe blocks and the start's disk are whole stripes of
          // aio.block_size.
          c.aio.block_size = a.block_size;
          c.aio.queue_depth = a.queue_depth;
          c.aio.intra_op_parallelism = a.parallelism;
        }
        StatusOr<MemoryEstimate> mem = mode == PlacementMode::kAuto ? EstimateAutoCandidate(res, o, model, eo, &c)
                                                                    : EstimateMemory(c, model, eo);
        if (!mem.ok()) {
          cand.planned = false;
          cand.why_not = std::string(mem.status().message());
          res.candidates.push_back(std::move(cand));
          continue;
        }
        if (mode == PlacementMode::kAuto) cand.host_pool = c.strata.host_memory_budget;  // 0: not given
        cand.aio = a;
        cand.memory = *mem;
        if (nv) {
          r.nvme_read_gbps = a.gbps;
          auto w = profile.NvmeGbps(true, a.block_size, a.queue_depth, a.parallelism);
          r.nvme_write_gbps = w.ok() ? *w : best_write;
          if (r.nvme_write_gbps <= 0) r.nvme_write_gbps = a.gbps;
        }
        STRATA_ASSIGN_OR_RETURN(cand.prediction, PredictStep(c, model, *mem, r, o.device, o.world_size));
        cand.why_not = WhyNot(*mem, res, nv, o.disk_free);
        cand.feasible = cand.why_not.empty();
        res.candidates.push_back(std::move(cand));
      }
    }
  }
  // One refusal for every shape is the input's fault, not a placement's: said as an error.
  const bool none_planned = std::none_of(res.candidates.begin(), res.candidates.end(),
                                         [](const Candidate& c) { return c.planned; });
  if (!res.candidates.empty() && none_planned &&
      std::all_of(res.candidates.begin(), res.candidates.end(),
                  [&](const Candidate& c) { return c.why_not == res.candidates.front().why_not; }))
    return InvalidArgument(res.candidates.front().why_not);
  RankCandidates(&res.candidates);
  return res;
}

void ApplyCandidate(const Candidate& c, const std::string& nvme_path, nlohmann::json* cfg) {
  nlohmann::json& z = (*cfg)["zero_optimization"];
  auto set = [&](const char* section, OffloadDevice d) {
    nlohmann::json& s = z[section];
    s["device"] = OffloadName(d);
    if (d == OffloadDevice::kNvme && (!s.contains("nvme_path") || s["nvme_path"].empty()) &&
        !nvme_path.empty())
      s["nvme_path"] = nvme_path;
  };
  if (z.value("stage", 0) == 3 || c.param != OffloadDevice::kNone) set("offload_param", c.param);
  set("offload_optimizer", c.optimizer);
  // The mode the candidate was predicted under; an input's "auto" would otherwise re-plan a
  // config candidate at start.
  const bool has_mode = cfg->contains("strata") && (*cfg)["strata"].is_object() &&
                        (*cfg)["strata"].contains("placement");
  if (c.mode == PlacementMode::kAuto || has_mode) (*cfg)["strata"]["placement"] = PlacementModeName(c.mode);
  // The compute room the plan left on the device (EstimateAutoReserve's replay), which the
  // engine alone would otherwise take as a quarter of the device.
  if (c.mode == PlacementMode::kAuto && c.memory.device_reserve)
    (*cfg)["strata"]["device_reserve"] = c.memory.device_reserve;
  if (c.layout_searched) {
    // DeepSpeed's section has two names; the config keeps the one it uses.
    const char* bf16 = cfg->contains("bfloat16") && !cfg->contains("bf16") ? "bfloat16" : "bf16";
    (*cfg)[bf16]["bf16_master_weights_and_grads"] = c.layout.bf16_master;
    (*cfg)[bf16].erase("bf16_optimizer_states");
    (*cfg)["strata"]["optimizer_state_dtype"] = optim::MomentFormatName(c.layout.moments);
  }
  if (c.uses_nvme) {
    nlohmann::json& a = (*cfg)["aio"];
    a["block_size"] = c.aio.block_size;
    a["queue_depth"] = c.aio.queue_depth;
    // DeepSpeed's old spelling would make the config carry two keys for one knob.
    a.erase("thread_count");
    a["intra_op_parallelism"] = c.aio.parallelism;
  }
}

void ApplyCandidate(const Candidate& c, Config* config) {
  auto& z = config->zero_optimization;
  z.offload_param.device = c.param;
  z.offload_optimizer.device = c.optimizer;
  config->strata.placement = c.mode;
  if (c.layout_searched) {
    config->bf16.bf16_master_weights_and_grads = c.layout.bf16_master;
    config->bf16.bf16_optimizer_states = false;
    config->strata.optimizer_state_dtype = c.layout.moments == optim::MomentFormat::kInt8   ? StateDtype::kInt8
                                           : c.layout.moments == optim::MomentFormat::kBf16 ? StateDtype::kBf16
                                                                                            : StateDtype::kFp32;
  }
  if (c.mode == PlacementMode::kAuto && c.memory.device_reserve)
    config->strata.device_reserve = c.memory.device_reserve;
  if (c.uses_nvme) {
    config->aio.block_size = c.aio.block_size;
    config->aio.queue_depth = c.aio.queue_depth;
    config->aio.intra_op_parallelism = c.aio.parallelism;
  }
}

}  // namespace strata::planner
