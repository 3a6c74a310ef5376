#include "tools/planner/memory_model.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "runtime/base/host_info.h"
#include "runtime/base/units.h"
#include "runtime/state/partitioner.h"
#include "runtime/state/start_disk.h"
#include "runtime/state/step_plan.h"
#include "tiers/host/pinned_pool.h"

namespace strata::planner {

const char* MemTierName(MemTier t) {
  switch (t) {
    case MemTier::kHbm: return "hbm";
    case MemTier::kHostPinned: return "host_pinned";
    case MemTier::kHostPageable: return "host_pageable";
    case MemTier::kNvme: return "nvme";
  }
  return "?";
}

namespace {

uint64_t Round(uint64_t bytes, uint64_t to) { return (std::max<uint64_t>(bytes, 1) + to - 1) / to * to; }

}  // namespace

// Note [host pool]
// Host- and NVMe-placed blocks live in one pinned pool owned by the tier manager
// (tiers/host/pinned_pool.h): a host-placed block takes its size in whole pages plus one or two
// (the resident region), an NVMe block a power-of-two class of at least 4 KiB while it is cached on the
// host (the arena); the pool is reserved and locked whole at start, sized strata.host_memory_budget or, when that is 0, every
// host-placed block plus a working set of NVMe blocks (all of them up to max(16 largest, 512 MiB));
// NVMe blocks stay cached in it after use until evicted, so the resident peak is the host blocks
// plus as many NVMe blocks as fit.
//
// Note [device replay]
// The device peak is not a sum: stage-3 chunk buffers and fp32 gradient buffers come and go as
// units run. Replaying the engine's order gives the peak it will see:
//   forward, for each unit b:  gather(b); release(b) (kept by the reuse distance, Note
//     [stage-3 live set] in runtime/engine/unit_coordinator.cc)
//   backward, for each unit b from the last: gather(b), then its parameters' gradients arrive
//     (see the replay below); units are freed as they complete, and a chunk's complete
//     gradient buffer goes to the reduce lane, which frees it once reduced: at the latest when
//     the next chunk completes, since the lane takes one at a time. The replay frees it there,
//     an upper bound that a lane keeping up with compute undercuts by one chunk's gradient.
// gather/release keep a live count per chunk (a chunk shared by two units is freed when both
// released it). Allocations are rounded the way the device allocator rounds them.
StatusOr<MemoryEstimate> EstimateMemory(const Config& config, const ModelSpec& model,
                                        const EstimateOptions& options) {
  if (model.params.empty()) return InvalidArgument("the model has no parameters to estimate");
  if (options.world_size < 1)
    return InvalidArgument(StrCat("--world-size=", options.world_size, ": must be >= 1"));
  const auto& z = config.zero_optimization;
  if (z.stage < 0 || z.stage > 3)
    return InvalidArgument(StrCat("zero_optimization.stage=", z.stage, ": must be 0..3"));

  MemoryEstimate est;
  est.stage = z.stage;
  est.world_size = options.world_size;
  est.device =
      options.device.empty() ? (config.strata.NamesCuda() ? "cuda" : "cpu") : options.device;
  if (est.device != "cpu" && est.device != "cuda")
    return InvalidArgument(StrCat("--device=", est.device, ": must be cpu or cuda"));
  const bool cpu_device = est.device == "cpu";
  const uint64_t dev_round = cpu_device ? 64 : 256;
  const uint64_t esize = (config.bf16.enabled || config.fp16.enabled) ? 2 : 4;
  const uint64_t ssize = config.strata.optimizer_state_dtype == StateDtype::kBf16 ? 2 : 4;
  const int shard_world = z.stage == 0 ? 1 : options.world_size;

  STRATA_ASSIGN_OR_RETURN(Partitioner part,
                          Partitioner::Create(StepPlan::ChunkLayout(config, shard_world, static_cast<int>(esize))));
  for (const auto& p : model.params) STRATA_RETURN_IF_ERROR(part.AddParam(p.name, p.numel).status());
  STRATA_RETURN_IF_ERROR(part.Finalize());
  const auto& chunks = part.chunks();
  est.chunks = static_cast<int64_t>(chunks.size());
  est.param_numel = part.param_numel();
  est.padded_numel = part.total_numel();
  est.shard_numel = part.shard_numel_per_rank();

  // Unit <-> chunk maps, as Engine::Impl::DiscoverUnits builds them (a tied parameter's chunk
  // belongs to every unit sharing it).
  std::vector<std::vector<int64_t>> block_chunks(static_cast<size_t>(model.num_blocks));
  std::vector<int> block_params(static_cast<size_t>(model.num_blocks), 0);
  std::vector<int> chunk_params(chunks.size(), 0);
  for (size_t pid = 0; pid < model.params.size(); ++pid) {
    const int64_t c = part.location(static_cast<int64_t>(pid)).chunk;
    ++chunk_params[static_cast<size_t>(c)];
    std::vector<int64_t> holders = {model.params[pid].block};
    holders.insert(holders.end(), model.params[pid].also_in.begin(), model.params[pid].also_in.end());
    for (int64_t b : holders) {
      auto& bc = block_chunks[static_cast<size_t>(b)];
      if (std::find(bc.begin(), bc.end(), c) == bc.end()) bc.push_back(c);
      ++block_params[static_cast<size_t>(b)];
    }
  }

  // The deferred updates' order (UpdateOrder): chunks kept gathered between steps (under stage
  // 3 the small ones, below the persistence threshold) first, then the rest as forward first
  // gathers them, block by block.
  {
    std::vector<bool> placed(chunks.size(), false);
    const auto place = [&](size_t c) {
      if (placed[c]) return;
      placed[c] = true;
      est.update_order_shard_numel.push_back(chunks[c].shard_numel);
    };
    if (z.stage == 3)
      for (size_t c = 0; c < chunks.size(); ++c)
        if (chunks[c].used_numel < z.stage3_param_persistence_threshold) place(c);
    for (const auto& bc : block_chunks)
      for (int64_t c : bc) place(static_cast<size_t>(c));
    for (size_t c = 0; c < chunks.size(); ++c) place(c);
  }

  // Resident per-state bytes, as registered (device allocations rounded).
  struct StateSum {
    MemTier tier;
    uint64_t bytes = 0;
  };
  std::map<std::pair<std::string, MemTier>, StateSum> states;
  uint64_t nvme_classes = 0, largest_class = 0;
  auto add_state = [&](const std::string& name, MemTier tier, uint64_t raw) {
    auto& s = states.try_emplace({name, tier}, StateSum{tier, 0}).first->second;
    s.bytes += tier == MemTier::kHbm        ? Round(raw, dev_round)
               : tier == MemTier::kHostPinned ? PoolResidentBytes(raw)
                                              : raw;
    if (tier == MemTier::kNvme) {
      nvme_classes += PoolClassBytes(raw);
      largest_class = std::max(largest_class, PoolClassBytes(raw));
    }
  };
  // The moments the optimizer keeps, as the engine decides (Note [states the optimizer uses] in
  // runtime/engine/engine_init.cc): SGD only with momentum, Adagrad only its sum, Lion only exp_avg.
  const OptimizerType ot = config.optimizer.type;
  const bool keeps_exp_avg =
      ot != OptimizerType::kAdagrad && (ot != OptimizerType::kSGD || config.optimizer.momentum != 0);
  const bool keeps_exp_avg_sq = ot != OptimizerType::kSGD && ot != OptimizerType::kLion;
  // Block sizes and what is stored at all come from the engine's own plan (BlockBytes, the master
  // shared with the working shard, the moments kept), so the estimate follows its layouts.
  StepPlan::Inputs pin;
  pin.config = &config;
  pin.device_kind = cpu_device ? DeviceKind::kCpu : DeviceKind::kCuda;
  pin.device_name = est.device;
  pin.compute_dtype = esize == 4 ? optim::DType::kFloat32
                      : config.fp16.enabled ? optim::DType::kFloat16 : optim::DType::kBFloat16;
  pin.world_size = shard_world;
  pin.comm_moves_host_memory = cpu_device;
  pin.sgd_momentum = config.optimizer.momentum != 0;
  pin.fp16_ops_in_fp32 = true;  // the Python front end runs fp16 on the CPU device
  pin.partitioner = &part;
  pin.nvme_path_given = !z.offload_optimizer.nvme_path.empty() || !z.offload_param.nvme_path.empty() ||
                        options.assume_nvme_path;
  pin.device_capacity = options.device_capacity ? options.device_capacity
                        : config.strata.device_memory_budget ? config.strata.device_memory_budget
                                                             : (cpu_device ? 4ull << 30 : 0);
  pin.host_available = options.host_available;
  pin.host_capacity = options.host_capacity;
  // disk_free is what the striped tier can fill over all its paths (StripedFreeDisk), as the
  // engine budgets it; the count only words the refusals alike.
  pin.disk_free = options.disk_free;
  pin.device_flag = options.device_flag;
  pin.host_flag = options.host_flag;
  pin.disk_flag = options.disk_flag;
  pin.nvme_paths = static_cast<int>(std::max<size_t>(z.NvmeTierPaths().size(), 1));
  STRATA_ASSIGN_OR_RETURN(const StepPlan plan, StepPlan::Make(pin));
  est.placement = plan.placement().ToJson();
  est.state_layout = plan.StateLayoutName();
  est.device_reserve = config.strata.device_reserve;
  est.placement_lines = plan.placement().Lines();
  auto tier_of = [&](int64_t c, StateKind k) {
    const Placement p = plan.PlacementOf(c, k);
    return p == Placement::kDevice ? MemTier::kHbm : p == Placement::kHost ? MemTier::kHostPinned : MemTier::kNvme;
  };

  uint64_t max_shard = 0, state_bytes = 0;
  for (size_t ch = 0; ch < chunks.size(); ++ch) {
    const ChunkInfo& ci = chunks[ch];
    const int64_t c = static_cast<int64_t>(ch);
    const int64_t n = ci.shard_numel;
    max_shard = std::max(max_shard, static_cast<uint64_t>(n));
    const MemTier optim_tier = tier_of(c, StateKind::kGrad);
    const MemTier param_tier = z.stage == 3 ? tier_of(c, StateKind::kParam16) : MemTier::kHbm;
    const uint64_t master = plan.Stored(c, StateKind::kMaster32) ? plan.BlockBytes(StateKind::kMaster32, n) : 0;
    const uint64_t m = keeps_exp_avg ? plan.BlockBytes(StateKind::kExpAvg, n) : 0;
    const uint64_t v = keeps_exp_avg_sq ? plan.BlockBytes(StateKind::kExpAvgSq, n) : 0;
    const uint64_t grad = plan.BlockBytes(StateKind::kGrad, n);
    const uint64_t work = z.stage == 3 ? plan.BlockBytes(StateKind::kParam16, n)
                                       : plan.BlockBytes(StateKind::kParam16, ci.numel);
    if (master) add_state("master32", optim_tier, master);
    if (keeps_exp_avg) add_state("exp_avg", optim_tier, m);
    if (keeps_exp_avg_sq) add_state("exp_avg_sq", optim_tier, v);
    add_state("grad", optim_tier, grad);
    add_state("param16", param_tier, work);
    state_bytes += master + m + v + grad + plan.BlockBytes(StateKind::kParam16, n);
  }
  // Every tier summed, per parameter of the model (the working copy counted once per rank's
  // shard, as ZeRO-3 stores it; below stage 3 each rank keeps the whole copy on the device).
  est.bytes_per_param = static_cast<double>(state_bytes) * shard_world / static_cast<double>(part.param_numel());
  const char* dtype_name = esize == 2 ? (config.fp16.enabled ? "fp16" : "bf16") : "fp32";
  const char* sdtype_name = plan.moment_format() == optim::MomentFormat::kInt8 ? "8-bit blockwise"
                            : ssize == 2                                        ? "bf16"
                                                                                : "fp32";
  const char* master_name = plan.master_dtype() == optim::DType::kFloat32 ? "fp32" : "bf16";
  uint64_t device_resident = 0, host_resident = 0;
  for (const auto& [key, s] : states) {
    const std::string& name = key.first;
    MemoryItem it;
    it.what = name;
    it.tier = s.tier;
    it.bytes = s.bytes;
    if (name == "param16")
      it.note = z.stage == 3 ? StrCat("this rank's shard of the ", dtype_name, " working copy")
                             : StrCat("full ", dtype_name, " working copy of every chunk (stage ",
                                      z.stage, " keeps it on the device)");
    else if (name == "master32" || name == "grad")
      it.note = StrCat(name == "grad" ? optim::DTypeName(plan.grad_dtype()) : master_name, " shard",
                       shard_world > 1 ? " (1/world of each chunk)" : "");
    else
      it.note = StrCat(sdtype_name, " Adam moment shard");
    if (s.tier == MemTier::kHbm) {
      it.measured_by = "peak_device_bytes";
      device_resident += s.bytes;
    } else if (s.tier == MemTier::kHostPinned) {
      it.measured_by = "peak_host_bytes";
      it.note += " (pinned pool, its resident region)";
      host_resident += s.bytes;
    } else {
      it.note += "; cached in the pinned pool while in use";
    }
    est.items.push_back(it);
  }

  // Device transients: replay (Note [device replay]).
  uint64_t cur = device_resident, peak = device_resident;
  std::vector<int> live(chunks.size(), 0), pending(chunks.size(), 0);
  std::vector<bool> grad_buf(chunks.size(), false);
  uint64_t gather_peak = 0, gather_cur = 0, gradbuf_cur = 0, gradbuf_at_peak = 0, gather_at_peak = 0;
  int64_t in_lane = -1;       // the chunk whose gradient buffer the reduce lane holds
  uint64_t in_lane_bytes = 0;
  uint64_t peak_min = device_resident;  // the peak of cur - in_lane_bytes
  // Stages 0 and 1 keep every chunk's whole fp32 gradient from the first micro-step to the
  // accumulation boundary (runtime/engine/gradient_reducer.cc): with accumulation, a micro-step before
  // the last starts with all of them allocated and frees none. That micro-step is the one
  // replayed: it is the peak.
  const bool keep_grads = z.stage <= 1 && config.gradient_accumulation_steps > 1;
  if (keep_grads) {
    for (size_t c = 0; c < chunks.size(); ++c) {
      const uint64_t bytes = Round(static_cast<uint64_t>(chunks[c].numel) * 4, dev_round);
      grad_buf[c] = true;
      cur += bytes;
      gradbuf_cur += bytes;
    }
    peak = std::max(peak, cur);
    peak_min = std::max(peak_min, cur);
  }
  auto note_peak = [&] {
    peak_min = std::max(peak_min, cur - in_lane_bytes);
    if (cur > peak) {
      peak = cur;
      gather_at_peak = gather_cur;
      gradbuf_at_peak = gradbuf_cur;
    }
    gather_peak = std::max(gather_peak, gather_cur);
  };
  // The engine's stage-3 live set (Note [stage-3 live set] in runtime/engine/unit_coordinator.cc): a chunk stays
  // gathered after its block when persistent or reused within stage3_max_reuse_distance, within
  // stage3_max_live_parameters; gathering past that cap drops chunks nobody holds.
  std::vector<bool> gathered(chunks.size(), false);
  int64_t live_elems = 0;
  std::vector<int64_t> block_elems(block_chunks.size(), 0);
  for (size_t b = 0; b < block_chunks.size(); ++b)
    for (int64_t c : block_chunks[b]) block_elems[b] += chunks[static_cast<size_t>(c)].numel;
  auto chunk_bytes = [&](size_t c) {
    return Round(static_cast<uint64_t>(chunks[c].numel) * esize, dev_round);
  };
  auto drop = [&](size_t c) {
    if (!gathered[c]) return;
    gathered[c] = false;
    live_elems -= chunks[c].numel;
    cur -= chunk_bytes(c);
    gather_cur -= chunk_bytes(c);
  };
  auto gather = [&](int64_t b) {
    if (z.stage != 3) return;
    for (int64_t c64 : block_chunks[static_cast<size_t>(b)]) {
      const size_t c = static_cast<size_t>(c64);
      ++live[c];
      if (gathered[c]) continue;
      for (size_t k = 0; k < chunks.size() && live_elems + chunks[c].numel > z.stage3_max_live_parameters; ++k)
        if (live[k] == 0) drop(k);
      gathered[c] = true;
      live_elems += chunks[c].numel;
      cur += chunk_bytes(c);
      gather_cur += chunk_bytes(c);
      note_peak();
    }
  };
  // Gathering ahead (Note [prefetched gathers] in runtime/engine/gather_lane.cc): while a unit runs, the
  // chunks of the unit after it in forward (before it in backward) are gathered too, when the cap
  // leaves room, without a holder. The replay is of a step after the first (the engine follows
  // the previous step's trace) with no update pending, so this is an upper bound.
  auto gather_ahead = [&](int64_t b) {
    if (z.stage != 3 || z.stage3_prefetch_bucket_size <= 0 || b < 0 || b >= model.num_blocks) return;
    for (int64_t c64 : block_chunks[static_cast<size_t>(b)]) {
      const size_t c = static_cast<size_t>(c64);
      if (gathered[c] || live_elems + chunks[c].numel > z.stage3_max_live_parameters) continue;
      gathered[c] = true;
      live_elems += chunks[c].numel;
      cur += chunk_bytes(c);
      gather_cur += chunk_bytes(c);
      note_peak();
    }
  };
  auto release_dist = [&](int64_t b, bool forward) {
    if (z.stage != 3) return;
    int64_t distance = std::numeric_limits<int64_t>::max();
    if (forward) {
      distance = 0;
      for (size_t k = static_cast<size_t>(b) + 1; k < block_elems.size(); ++k) distance += 2 * block_elems[k];
    }
    for (int64_t c64 : block_chunks[static_cast<size_t>(b)]) {
      const size_t c = static_cast<size_t>(c64);
      if (--live[c] > 0) continue;
      if (chunks[c].used_numel < z.stage3_param_persistence_threshold) continue;
      if (distance <= z.stage3_max_reuse_distance && live_elems <= z.stage3_max_live_parameters) continue;
      drop(c);
    }
  };
  auto release = [&](int64_t b) { release_dist(b, false); };
  // Backward (Note [backward by gradients] in runtime/engine/gradient_reducer.cc): a unit is gathered when
  // backward reaches it; each parameter's gradient, as it arrives (a unit's in reverse order, a
  // tied one with its owner), lands in its chunk's fp32 buffer, which is reduced and freed when
  // the chunk's last parameter is in; a unit is released when its last parameter is in.
  std::vector<int> unit_pending(block_params.begin(), block_params.end());
  std::vector<bool> held(block_chunks.size(), false);
  auto free_in_lane = [&] {
    if (in_lane < 0) return;
    grad_buf[static_cast<size_t>(in_lane)] = false;
    cur -= in_lane_bytes;
    gradbuf_cur -= in_lane_bytes;
    in_lane = -1;
    in_lane_bytes = 0;
  };
  auto arrive = [&](size_t pid) {
    const size_t c = static_cast<size_t>(part.location(static_cast<int64_t>(pid)).chunk);
    const uint64_t bytes = Round(static_cast<uint64_t>(chunks[c].numel) * 4, dev_round);
    if (!grad_buf[c]) {
      grad_buf[c] = true;
      cur += bytes;
      gradbuf_cur += bytes;
      note_peak();
    }
    std::vector<int64_t> holders = {model.params[pid].block};
    holders.insert(holders.end(), model.params[pid].also_in.begin(), model.params[pid].also_in.end());
    for (int64_t b : holders) {
      if (--unit_pending[static_cast<size_t>(b)] == 0 && held[static_cast<size_t>(b)]) {
        held[static_cast<size_t>(b)] = false;
        release(b);
      }
    }
    if (--pending[c] == 0 && !keep_grads) {
      // The complete buffer goes to the reduce lane, which holds one at a time: the previous
      // one is freed by now at the latest (Note [reduce lane] in runtime/engine/gradient_reducer.cc).
      free_in_lane();
      in_lane = static_cast<int64_t>(c);
      in_lane_bytes = bytes;
    }
  };
  const int64_t nb = model.num_blocks;
  for (size_t c = 0; c < chunks.size(); ++c) pending[c] = chunk_params[c];
  for (int64_t b = 0; b < nb; ++b) {
    gather(b);
    gather_ahead(b + 1);
    release_dist(b, true);
  }
  std::vector<int64_t> order = model.gradient_order;
  if (order.empty())
    for (size_t pid = model.params.size(); pid-- > 0;) order.push_back(static_cast<int64_t>(pid));
  // Each block's gradients in the order they arrive, found once: a scan of every parameter per
  // block made a model given as --params 1e9 --largest-layer 1000 (10^6 blocks) quadratic.
  std::vector<std::vector<size_t>> arrivals(static_cast<size_t>(nb));
  for (int64_t pid : order) {
    const int64_t b = model.params[static_cast<size_t>(pid)].block;
    if (b >= 0 && b < nb) arrivals[static_cast<size_t>(b)].push_back(static_cast<size_t>(pid));
  }
  for (int64_t b = nb - 1; b >= 0; --b) {
    if (unit_pending[static_cast<size_t>(b)] > 0) {
      gather(b);
      held[static_cast<size_t>(b)] = true;
      gather_ahead(b - 1);
    }
    for (size_t pid : arrivals[static_cast<size_t>(b)]) arrive(pid);
  }
  if (z.stage == 3) {
    MemoryItem it{"param16 gather buffers", MemTier::kHbm, gather_at_peak, "peak_device_bytes", true,
                  StrCat("full chunks of the live block(s) at the device peak (largest during the "
                         "step: ", FormatBytes(gather_peak), ")")};
    est.items.push_back(it);
  }
  est.items.push_back({"grad fp32 chunk buffers", MemTier::kHbm, gradbuf_at_peak, "peak_device_bytes",
                       true, keep_grads ? "every chunk's whole fp32 gradient, accumulated until the step "
                                          "(stages 0-1 keep full gradients)"
                                        : "full-chunk fp32 gradients of the block in backward, and the one the reduce "
                                          "lane is reducing"});
  est.engine_device_peak_bytes = peak;
  est.engine_device_peak_min_bytes = peak_min;

  // Host memory of the block store: one pinned pool (Note [host pool] above EstimateMemory).
  const uint64_t working = std::min(nvme_classes, std::max<uint64_t>(16 * largest_class, 512ull << 20));
  uint64_t pool = config.strata.host_memory_budget;
  if (pool == 0 && host_resident + nvme_classes > 0) pool = host_resident + working;
  if (host_resident + nvme_classes == 0) pool = 0;
  pool = pool / 4096 * 4096;
  est.host_min_bytes = host_resident + std::min(nvme_classes, 8 * largest_class);
  if (pool > 0 && pool < est.host_min_bytes)
    est.notes.push_back(StrCat("strata.host_memory_budget=", FormatBytes(pool), " is below the ",
                               FormatBytes(est.host_min_bytes), " the engine requires (host-offloaded "
                               "states plus 8 NVMe blocks): Engine::Create will refuse it"));
  const uint64_t cached = pool > host_resident ? std::min(nvme_classes, pool - host_resident) : 0;
  if (nvme_classes > 0)
    est.items.push_back({"NVMe blocks cached on the host", MemTier::kHostPinned, cached, "peak_host_bytes", true,
                         StrCat("the tier manager keeps NVMe-placed blocks in the pool up to its budget (",
                                FormatBytes(nvme_classes), " would cache all; an upper bound)")});
  if (pool > host_resident + cached)
    est.items.push_back({"pinned pool headroom", MemTier::kHostPinned, pool - host_resident - cached, "", false,
                         "reserved and locked at start, unused by blocks"});
  est.engine_host_peak_bytes = host_resident + cached;
  est.host_pool_bytes = pool;

  // Host memory outside the block store.
  uint64_t host_other = 0;
  if (!cpu_device && plan.any_staged_publish()) {
    host_other = max_shard * esize;
    est.items.push_back({"optimizer output staging", MemTier::kHostPageable, host_other, "", true,
                         "new working values copied to the device by the optimizer lane"});
  }
  uint64_t init_bytes = static_cast<uint64_t>(est.param_numel) * 4;
  uint64_t max_chunk = 0;
  for (const ChunkInfo& ci : chunks) max_chunk = std::max<uint64_t>(max_chunk, ci.numel);
  init_bytes += max_chunk * (4 + esize) + max_shard * (4 + esize);

  // Activations and LibTorch's own gradients (not seen by the engine's counters).
  uint64_t torch_dev = 0;
  const uint64_t block_grads = static_cast<uint64_t>(model.largest_block_numel()) * esize;
  est.items.push_back({"parameter .grad of one block", MemTier::kHbm, block_grads, "", true,
                       "LibTorch's gradients of the block in backward, before the engine takes them"});
  torch_dev += block_grads;
  if (model.gpt) {
    const bool on_host = config.activation_checkpointing.cpu_checkpointing;
    ActivationEstimate a = GptActivations(*model.gpt, config.train_micro_batch_size_per_gpu,
                                          static_cast<int>(esize), on_host);
    est.activation_bytes = a.saved_bytes;
    std::string how =
        a.checkpointed
            ? StrCat("checkpointed: ", model.gpt->n_layers, " block inputs (", FormatBytes(a.kept_inputs_bytes),
                     on_host ? ", stashed on the host by cpu_checkpointing, not counted here" : "",
                     "), one block recomputed in backward (", FormatBytes(a.per_block_bytes), "), ")
            : StrCat(FormatBytes(a.per_block_bytes), " per block, ");
    est.items.push_back({"activations saved for backward", MemTier::kHbm, a.saved_bytes, "", true,
                         StrCat("one micro-batch of ", config.train_micro_batch_size_per_gpu,
                                " x ", model.gpt->seq_len, " tokens (", how, FormatBytes(a.head_bytes),
                                " head + loss)")});
    torch_dev += a.saved_bytes;
  } else {
    est.notes.push_back("activations: unknown for a model given by --params; add them (or pass --config "
                        "with a \"model\" section)");
  }

  est.hbm_bytes = est.engine_device_peak_bytes + torch_dev;
  // The engine's own allocations are what its device budget bounds (LibTorch's activations are
  // outside it): above it the first step fails, or the start refuses the run when not even the
  // largest unit fits (Note [a unit that cannot fit] in runtime/engine/engine_init.cc). The lower
  // of the two peak figures, so that no run that fits is warned about.
  if (pin.device_capacity > 0 && est.engine_device_peak_min_bytes > pin.device_capacity)
    est.notes.push_back(
        StrCat("the engine's device peak in a step, at least ",
               FormatBytes(est.engine_device_peak_min_bytes), " (peak_device_bytes), is above the ",
               FormatBytes(pin.device_capacity), " it may use (",
               !options.device_flag.empty() ? options.device_flag
               : options.device_capacity    ? std::string("--hbm")
                                            : std::string("strata.device_memory_budget"),
               config.strata.device_memory_budget || options.device_capacity
                   ? ""
                   : ", the CPU device's default",
               "): the first step would fail for want of device memory; raise it, "
               "offload more state to the host "
               "or NVMe, or lower strata.chunk_size"));
  est.host_pageable_bytes = host_other;
  est.host_pinned_bytes = pool;
  // The plan's own sum (each NVMe-homed block rounded to 4 KiB), which the swap store reserves.
  const uint64_t nvme_need = plan.nvme_bytes();
  est.nvme_bytes = nvme_need;
  if (nvme_need > 0 && config.strata.nvme_capacity > 0 && config.strata.nvme_capacity < nvme_need)
    est.notes.push_back(StrCat("strata.nvme_capacity=", config.strata.nvme_capacity, " is below the ",
                               FormatBytes(nvme_need), " the NVMe-placed shards need: raise it or set 0"));
  // Note [init disk peak]: strata-train builds a stage-3 model with NVMe parameter offload under
  // zero::Init (tools/train/main.cc): the model goes to a staging file in the NVMe directory
  // first, all but its generated weights (ParamSpec::generated, drawn as the engine reads them),
  // then Engine::Create fills chunk by chunk, reading the chunk's parameters back (punching them
  // out of the file as it reads them) and writing its NVMe-placed blocks. A Python script's
  // strata.zero.Init (python/strata/zero.py) stages every parameter, in the same dtype by default,
  // whatever the stage and offload: in the NVMe directory when the config names one, else in the
  // temporary directory (/var/tmp where /tmp is tmpfs), which the estimate takes to be the same
  // disk; its parameters' space comes back once the engine has written their chunk's blocks.
  // The disk holds the unread rest of the file beside the blocks written so far, in whole
  // aio.block_size stripes of the swap file; its peak is at the start or after some chunk. The
  // file's alignment padding (under 4 KiB a parameter) is left out, which errs high: the engine
  // gets it back too. Only rank 0 stages (the others build shapes and take rank 0's values by
  // broadcast), so this is rank 0's peak.
  // The engine's NVMe tier opens before the file is read and asks for that growth free beside
  // the file (Note [start's disk] in runtime/engine/engine_init.cc), so the peak is the start's
  // need (where the disk has room for the whole file beside the whole state, the engine keeps the
  // file until the start is through instead: runtime/engine/start_rollback.h); with several nvme
  // paths (a share of the stripes on each) that of the staging file's file system, which holds the
  // swap files of the paths on it.
  const bool python = options.build == EstimateOptions::Build::kPythonZeroInit;
  const bool staged = python || (z.stage == 3 && z.offload_param.device == OffloadDevice::kNvme &&
                                 (!z.offload_param.nvme_path.empty() || options.assume_nvme_path));
  if (staged) {
    const uint64_t stage_esize =
        python && options.init_element_bytes ? static_cast<uint64_t>(options.init_element_bytes)
        : config.bf16.enabled && config.bf16.bf16_master_weights_and_grads ? 2
                                                                            : 4;
    // strata-train's space comes back as it is read (punched); Python's once the chunk's blocks
    // are written (the mappings go with the parameters).
    std::vector<ChunkStaging> chunk_staged(chunks.size());
    uint64_t generated = 0;
    for (size_t ch = 0; ch < chunks.size(); ++ch) {
      uint64_t& staged_here = python ? chunk_staged[ch].after_blocks : chunk_staged[ch].on_read;
      for (int64_t pid : chunks[ch].params) {
        const ParamSpec& ps = model.params[static_cast<size_t>(pid)];
        (ps.generated && !python ? generated : staged_here) += static_cast<uint64_t>(ps.numel) * stage_esize;
      }
      est.staged_bytes += staged_here;
    }
    const std::vector<std::string>& tier_paths = z.NvmeTierPaths();
    const size_t nvme_paths = std::max<size_t>(tier_paths.size(), 1);
    // Over several paths the staging file lies on the first one's file system (the staging
    // directory is the first nvme path), and so do the swap files of the other paths there, where
    // they exist on this machine; a path that does not exist here counts as a file system of its own.
    const size_t paths_here = nvme_paths == 1 ? 1 : GroupByFileSystem(tier_paths).front().paths.size();
    est.init_disk_peak_bytes =
        est.staged_bytes + StartDiskGrowth(plan, chunks, chunk_staged, static_cast<uint64_t>(config.aio.block_size),
                                           nvme_need, nvme_paths, paths_here);
    est.init_disk_need_bytes = est.init_disk_peak_bytes;
    est.notes.push_back(StrCat(
        "engine init reads the model from ", python ? "strata.zero.Init" : "zero::Init",
        "'s staging file (", FormatBytes(est.staged_bytes),
        stage_esize == 4                       ? " of fp32"
        : python && options.init_element_bytes ? " of 16-bit values"
                                               : " of bf16",
        python && z.offload_param.nvme_path.empty() && z.offload_optimizer.nvme_path.empty()
            ? " in the temporary directory"
            : " in the NVMe directory",
        generated > 0 ? StrCat("; the ", FormatBytes(generated),
                               " of large matrices are drawn as it reads them")
                      : std::string(),
        nvme_need > 0
            ? StrCat(") while it writes the NVMe blocks: it needs ",
                     FormatBytes(est.init_disk_peak_bytes), " of disk during the start",
                     nvme_paths == 1
                         ? std::string()
                         : StrCat(" on the file system of ", tier_paths.front(), " (", paths_here,
                                  " of the ", nvme_paths, " nvme paths' swap files there)"),
                     ", giving the file's space back as it goes where the disk cannot hold the "
                     "file beside the state (where it can, it keeps the file until the start is "
                     "through, so that a failed start loses nothing)")
            : std::string("), punching out what it has read"),
        options.world_size > 1 ? " (on rank 0; the other ranks stage nothing)" : ""));
  } else {
    est.notes.push_back(StrCat("engine init (Engine::Create) also holds the model's fp32 parameters plus one "
                               "chunk's fp32 and working copies: about ", FormatBytes(init_bytes),
                               " of pageable host memory, freed before training"));
  }
  if (pool > 0)
    est.notes.push_back(StrCat("host_pinned is the tier manager's pool, reserved and locked whole at start: ",
                               FormatBytes(pool), config.strata.host_memory_budget
                                                      ? " (strata.host_memory_budget)"
                                                      : " (host-offloaded states + an NVMe working set)",
                               "; where mlock is refused it stays pageable (logged once)"));
  if (cpu_device)
    est.notes.push_back("device=cpu: 'hbm' is host DRAM bounded by strata.device_memory_budget");
  if (z.stage < 3 && z.offload_param.device != OffloadDevice::kNone)
    est.notes.push_back(StrCat("offload_param applies to stage 3 only; stage ", z.stage,
                               " keeps the working copy on the device"));
  return est;
}

uint64_t DeviceBudgetPeak(const MemoryEstimate& est) {
  return est.device == "cpu" ? est.engine_device_peak_bytes : est.hbm_bytes;
}

uint64_t HostTorchBytes(const MemoryEstimate& est) {
  return est.device == "cpu" ? est.hbm_bytes - est.engine_device_peak_bytes : 0;
}

StatusOr<MemoryEstimate> EstimateAutoReserve(const Config& config, const ModelSpec& model,
                                             const EstimateOptions& options) {
  if (config.strata.placement != PlacementMode::kAuto || config.strata.device_reserve != 0)
    return EstimateMemory(config, model, options);
  Config c = config;
  STRATA_ASSIGN_OR_RETURN(MemoryEstimate est, EstimateMemory(c, model, options));
  const uint64_t budget = c.strata.device_memory_budget ? c.strata.device_memory_budget : options.device_capacity;
  for (int round = 0; round < 4; ++round) {
    const uint64_t states = est.placement["device"].value("total", uint64_t{0});
    const uint64_t peak = DeviceBudgetPeak(est);
    const uint64_t transient = peak > states ? peak - states : 0;
    // At most the whole device: then no state is homed there and the peak is the step's own.
    const uint64_t reserve = budget ? std::min(transient + transient / 20, budget) : transient + transient / 20;
    if (reserve == c.strata.device_reserve) break;
    c.strata.device_reserve = reserve;
    auto next = EstimateMemory(c, model, options);
    if (!next.ok()) break;  // keep the last plan that placed everything
    est = *next;
    est.device_reserve = reserve;
    if (round > 0 && (!budget || DeviceBudgetPeak(est) <= budget)) break;
  }
  if (est.device_reserve)
    est.notes.push_back(StrCat("strata.placement auto: set strata.device_reserve to ", est.device_reserve,
                               " (", FormatBytes(est.device_reserve), ", the replay's compute working set) "
                               "for the engine to run this plan; its default keeps a quarter of the device"));
  return est;
}

nlohmann::json MemoryEstimate::ToJson() const {
  nlohmann::json items_j = nlohmann::json::array();
  nlohmann::json per_state = nlohmann::json::object();
  for (const auto& it : items) {
    items_j.push_back({{"what", it.what},
                       {"tier", MemTierName(it.tier)},
                       {"bytes", it.bytes},
                       {"measured_by", it.measured_by},
                       {"transient", it.transient},
                       {"note", it.note}});
    if (it.what == "param16" || it.what == "grad" || it.what == "master32" || it.what == "exp_avg" ||
        it.what == "exp_avg_sq")
      per_state[it.what] = {{"tier", MemTierName(it.tier)}, {"bytes", it.bytes}};
  }
  return {{"hbm_bytes", hbm_bytes},
          {"host_pinned_bytes", host_pinned_bytes},
          {"host_pageable_bytes", host_pageable_bytes},
          {"nvme_bytes", nvme_bytes},
          {"init_disk_peak_bytes", init_disk_peak_bytes},
          {"init_disk_need_bytes", init_disk_need_bytes},
          {"staged_bytes", staged_bytes},
          {"engine_device_peak_bytes", engine_device_peak_bytes},
          {"engine_device_peak_min_bytes", engine_device_peak_min_bytes},
          {"engine_host_peak_bytes", engine_host_peak_bytes},
          {"activation_bytes", activation_bytes},
          {"host_pool_bytes", host_pool_bytes},
          {"host_min_bytes", host_min_bytes},
          {"stage", stage},
          {"world_size", world_size},
          {"device", device},
          {"chunks", chunks},
          {"param_numel", param_numel},
          {"bytes_per_param", bytes_per_param},
          {"padded_numel", padded_numel},
          {"shard_numel", shard_numel},
          {"per_state", per_state},
          {"breakdown", items_j},
          {"placement", placement},
          {"device_reserve", device_reserve},
          {"notes", notes}};
}

std::string MemoryEstimate::ToTable() const {
  std::ostringstream o;
  char line[512];
  o << "stage " << stage << ", world size " << world_size << ", device " << device << ": "
    << param_numel << " parameters in " << chunks << " chunks (" << padded_numel
    << " elements with padding, " << shard_numel << " per rank); model state "
    << [&] {
         char b[32];
         std::snprintf(b, sizeof b, "%.2f", bytes_per_param);
         return std::string(b);
       }()
    << " bytes per parameter over all tiers and ranks\n";
  o << "placement plan (as the engine logs it at start):\n";
  for (const auto& l : placement_lines) o << "  " << l << "\n";
  o << "\n";
  std::snprintf(line, sizeof line, "%-32s %-14s %12s  %-18s %s\n", "what", "tier", "bytes",
                "engine counter", "note");
  o << line;
  for (const auto& it : items) {
    std::snprintf(line, sizeof line, "%-32s %-14s %12s  %-18s %s%s\n", it.what.c_str(),
                  MemTierName(it.tier), FormatBytes(it.bytes).c_str(),
                  it.measured_by.empty() ? "-" : it.measured_by.c_str(),
                  it.transient ? "[peak] " : "", it.note.c_str());
    o << line;
  }
  o << "\nper rank at the step's peak:\n";
  auto row = [&](const char* name, uint64_t b, const char* extra) {
    std::snprintf(line, sizeof line, "  %-14s %12s  (%llu B)%s\n", name, FormatBytes(b).c_str(),
                  static_cast<unsigned long long>(b), extra);
    o << line;
  };
  row("hbm", hbm_bytes, activation_bytes ? "  incl. activations" : "");
  row("host_pinned", host_pinned_bytes, "");
  row("host_pageable", host_pageable_bytes, "");
  row("nvme", nvme_bytes, "");
  o << "engine counters after a step should read: peak_device_bytes ~ "
    << FormatBytes(engine_device_peak_bytes) << ", peak_host_bytes ~ "
    << FormatBytes(engine_host_peak_bytes) << "\n";
  for (const auto& n : notes) o << "note: " << n << "\n";
  return o.str();
}

}  // namespace strata::planner
