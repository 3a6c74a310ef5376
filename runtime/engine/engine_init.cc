// Engine construction: Init and its named steps, from the config's precision and placement to
// the lanes' threads (engine_impl.h maps the rooms).
#include "runtime/engine/engine_impl.h"

#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace strata {

using namespace engine_detail;

// Init reads top to bottom; each step is one method below, run once, in this order. The
// engine's lanes start last, so no step races a lane thread.
Status Engine::Impl::Init(Engine* owner, const EngineOptions& options) {
  owner_ = owner;
  if (options.device_owner && options.device_owner.get() != device_)
    return InvalidArgument("EngineOptions::device_owner holds another device than the engine's");
  device_owner_ = options.device_owner;
  if (options.test_hooks) hooks_ = *options.test_hooks;
  // Each step's wall time, logged as one line at the end: a large model's start takes minutes,
  // and which step took them (pinning the host pool, reading staged parameters, writing the
  // first blocks) is what a slow start needs named.
  std::vector<std::pair<const char*, double>> took;
  const auto timed = [&took](const char* name, auto&& step) -> Status {
    const auto t0 = std::chrono::steady_clock::now();
    Status s = step();
    took.emplace_back(name, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    return s;
  };
  const ComputeDtypeChoice dtype = ChooseDtype();
  // Units and partitioner (engine.cc).
  STRATA_RETURN_IF_ERROR(timed("units", [&] { return DiscoverUnits(options, dtype.dtype); }));
  STRATA_RETURN_IF_ERROR(timed("groups", [&] { return GroupParameters(options); }));
  STRATA_RETURN_IF_ERROR(timed("plan", [&] { return MakePlan(options, dtype.dtype); }));
  STRATA_RETURN_IF_ERROR(timed("streams", [&] { return StartStreamsAndArena(); }));
  STRATA_RETURN_IF_ERROR(timed("nvme", [&] { return OpenNvmeTier(options); }));
  STRATA_RETURN_IF_ERROR(timed("host pool", [&] { return OpenBlockStore(); }));
  STRATA_RETURN_IF_ERROR(timed("buffers", [&] { return PlaceBuffers(); }));
  STRATA_RETURN_IF_ERROR(CheckUnitsFitDevice());
  STRATA_RETURN_IF_ERROR(timed("initial blocks", [&] { return WriteInitialBlocks(); }));
  STRATA_RETURN_IF_ERROR(timed("lanes", [&] { return MakeLanes(); }));
  STRATA_RETURN_IF_ERROR(timed("hooks", [&] { return HookModel(); }));
  StartLanes();
  started_ = true;
  // The model's own memory and zero::Init's staged space go now.
  if (const uint64_t held = rollback_.Commit(); held > 0)
    STRATA_LOG(WARN)
        << "engine start: " << FormatBytes(held) << " of zero::Init's staging file stays on disk: "
        << "another tensor still shares a staged parameter's memory (a .data or a view kept from "
        << "before initialize); the space comes back when that tensor goes";
  const auto secs_text = [](double secs) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.1f s", secs);
    return std::string(buf);
  };
  double total = 0;
  std::string steps;
  for (const auto& [name, secs] : took) {
    total += secs;
    if (secs >= 0.05) steps += StrCat(steps.empty() ? "" : ", ", name, " ", secs_text(secs));
  }
  STRATA_LOG(INFO) << "engine start: " << secs_text(total) << (steps.empty() ? "" : " (") << steps
                   << (steps.empty() ? "" : ")");
  const auto& chunk_infos = partitioner_->chunks();
  STRATA_LOG(INFO) << "engine stage=" << config_.zero_optimization.stage << " world=" << comm_->world_size()
                   << " params=" << partitioner_->param_numel() << " units=" << units_.size()
                   << " chunks=" << chunk_infos.size()
                   << " param_placement=" << PlacementName(plan_.param_section())
                   << " optimizer_placement=" << PlacementName(plan_.optim_section())
                   << " dtype=" << optim::DTypeName(plan_.compute_dtype())
                   << " optimizer_overlap=" << plan_.OptimizerOverlapName()
                   << " master=" << plan_.MasterStorageName();
  // The placement plan, one line per tier (how to read it: the README's "Placement").
  for (const std::string& line : plan_.placement().Lines())
    STRATA_LOG(INFO) << "placement (" << PlacementModeName(config_.strata.placement) << ") " << line;
  return Status::Ok();
}

// The compute dtype (the partitioner's element size needs it first), with the one-time warning
// where bf16 is slower than fp32 on this CPU.
ComputeDtypeChoice Engine::Impl::ChooseDtype() const {
  const ComputeDtypeChoice choice =
      ChooseComputeDtype(config_, device_->kind(), DeviceHasNativeBf16(device_->kind()));
  if (choice.slow_bf16) {
    static std::once_flag warned;  // once per process, however many engines it builds
    std::call_once(warned, [] {
      STRATA_LOG(WARN) << SlowBf16Warning(MeasureCpuMatmulGflops(torch::kBFloat16),
                                          MeasureCpuMatmulGflops(torch::kFloat32));
    });
  }
  return choice;
}

// The step's plan (runtime/state/step_plan.h): precision, placement, the states kept, the
// stage's sharding and the tiers' sizes, with what cannot run refused; and the loss scaler.
Status Engine::Impl::MakePlan(const EngineOptions& options, optim::DType compute_dtype) {
  StepPlan::Inputs in;
  in.config = &config_;
  in.device_kind = device_->kind();
  in.device_name = device_->name();
  in.device_usable = device_->kind() != DeviceKind::kCuda || torch::cuda::is_available();
  in.compute_dtype = compute_dtype;
  in.world_size = comm_->world_size();
  in.rank = comm_->rank();
  in.comm_moves_host_memory = comm_->memory_kind() == MemoryKind::kHost;
  in.comm_backend = comm_->backend();
  in.client_optimizer = options.client_optimizer;
  in.loss_scaling_option = hooks_.loss_scaling;
  in.fp16_ops_in_fp32 = options.fp16_ops_in_fp32;
  in.sgd_momentum = std::any_of(groups_.hyper.begin(), groups_.hyper.end(),
                                [](const GroupHyperparameters& g) { return g.momentum != 0; });
  in.partitioner = &*partitioner_;
  in.nvme_path_given = !NvmePaths(options).empty();
  if (config_.strata.placement == PlacementMode::kAuto) {
    // strata.placement auto fills the tiers under what this machine has now.
    in.device_capacity = device_->capacity() - std::min(device_->capacity(), device_->allocated());
    in.host_available = ReadHostMemory().available_bytes;
    if (in.nvme_path_given) {
      // A staging file on a path's file system comes back during the start (Note [start's
      // disk]), whose check then holds the plan to the disk's real peak.
      const std::vector<std::string> paths = NvmePaths(options);
      const StripedDisk disk = StripedFreeDisk(
          paths, [this](const std::string& p) { return TotalOf(StagedSpaceOn(p)); });
      in.disk_free = disk.free;
      in.disk_given_back = disk.given_back;
      in.nvme_paths = static_cast<int>(paths.size());
    }
  }
  STRATA_ASSIGN_OR_RETURN(plan_, StepPlan::Make(in));
  if (plan_.loss_scaling()) {
    STRATA_ASSIGN_OR_RETURN(auto s, optim::DynamicLossScaler::FromConfig(config_.fp16));
    step_.scaler.emplace(std::move(s));
  }
  return Status::Ok();
}

// The engine's own streams and the optimizer lane's thread arena.
Status Engine::Impl::StartStreamsAndArena() {
  STRATA_ASSIGN_OR_RETURN(streams_.copy, device_->CreateStream(StreamPriority::kHigh));
  STRATA_ASSIGN_OR_RETURN(streams_.publish, device_->CreateStream());
  streams_.side = std::make_unique<SideStream>(*device_);
  // The optimizer's arena. When updates overlap compute (during backward, or beside the next
  // forward) it gets the physical cores (hwloc) that LibTorch's intra-op threads leave, at least
  // one: more would oversubscribe the cores and slow compute by more than the updates gain
  // (measured on 2 cores: compute 9.5 s with one update thread, 10.9-12.1 s with two). When Step
  // waits for the updates they run alone and get every core. strata.optimizer_threads overrides.
  // On a GPU, compute needs one host thread (the one launching kernels); LibTorch's intra-op pool
  // sits idle, so the CPU Adam may take the other cores.
  const int compute_threads =
      device_->kind() == DeviceKind::kCuda ? 1 : torch::get_num_threads();
  std::string why;
  const int arena_threads = ChooseOptimizerThreads(
      PhysicalCoreCount(), compute_threads, static_cast<int>(config_.strata.optimizer_threads),
      plan_.immediate_optimizer() || plan_.defer_updates(), &why);
  streams_.arena = std::make_unique<tbb::task_arena>(arena_threads);
  if (comm_->rank() == 0)
    STRATA_LOG(INFO) << "optimizer lane: " << arena_threads << " thread(s) (" << why
                     << "); LibTorch compute: " << compute_threads << " thread(s)";
  return Status::Ok();
}

// Parameter groups: each parameter's group, and every chunk's shard cut into runs of one group
// for the optimizer (chunk_updater.h).
Status Engine::Impl::GroupParameters(const EngineOptions& options) {
  const auto& oc = config_.optimizer;
  groups_.of_param.assign(params_.size(), 0);
  groups_.hyper.clear();
  if (options.param_groups.empty()) {
    groups_.hyper.push_back({oc.lr, oc.beta1, oc.beta2, oc.eps, oc.weight_decay, oc.momentum, oc.dampening});
  } else {
    std::unordered_map<const c10::TensorImpl*, int64_t> id_of;
    for (size_t p = 0; p < params_.size(); ++p) id_of[params_[p].tensor.unsafeGetTensorImpl()] = p;
    std::vector<int> seen(params_.size(), -1);
    for (size_t g = 0; g < options.param_groups.size(); ++g) {
      const auto& pg = options.param_groups[g];
      STRATA_RETURN_IF_ERROR(ValidateGroup(pg.hyper, static_cast<int>(g)));
      groups_.hyper.push_back(pg.hyper);
      for (const torch::Tensor& t : pg.params) {
        auto it = id_of.find(t.unsafeGetTensorImpl());
        if (it == id_of.end()) {
          return InvalidArgument(StrCat("parameter group ", g, " holds a tensor of shape ",
                                        t.sizes(), " that is not a parameter of the model"));
        }
        if (seen[it->second] >= 0 && seen[it->second] != static_cast<int>(g)) {
          return InvalidArgument(StrCat("parameter '", partitioner_->param_name(it->second),
                                        "' is in parameter groups ", seen[it->second], " and ", g,
                                        ": each parameter belongs to one group"));
        }
        seen[it->second] = static_cast<int>(g);
        groups_.of_param[it->second] = static_cast<int>(g);
      }
    }
  }
  groups_.segments.clear();
  for (size_t c = 0; c < partitioner_->chunks().size(); ++c) {
    groups_.segments.push_back(ShardSegments(*partitioner_, static_cast<int64_t>(c),
                                            config_.zero_optimization.stage == 0 ? 0 : comm_->rank(),
                                            groups_.of_param));
  }
  return Status::Ok();
}

// Where NVMe-homed blocks go: the caller's paths, else the section that offloads to NVMe.
std::vector<std::string> Engine::Impl::NvmePaths(const EngineOptions& options) const {
  if (!options.nvme_path.empty()) return options.nvme_path;
  return config_.zero_optimization.NvmeTierPaths();
}

// The NVMe tier, when anything is placed there, sized to this rank's NVMe-placed shards.
Status Engine::Impl::OpenNvmeTier(const EngineOptions& options) {
  // NVMe tier for whatever is placed there.
  if (plan_.placement().Any(Placement::kNvme)) {
    std::vector<std::string> paths = NvmePaths(options);
    if (paths.empty())
      return InvalidArgument(
          "NVMe offload is configured but no nvme_path is set; set "
          "zero_optimization.offload_optimizer.nvme_path (or pass --nvme-path)");
    nvme::NvmeTierOptions o;
    o.paths = paths;
    o.rank = static_cast<uint32_t>(comm_->rank());
    // Without a configured capacity, reserve what this rank's NVMe-placed shards need.
    uint64_t need = plan_.nvme_bytes();
    // cpu_checkpointing puts saved inputs in NVMe-backed slots too: leave them an eighth more
    // (a block's input is B·T·d elements against its 12·d² weights).
    if (config_.activation_checkpointing.cpu_checkpointing) need += std::max<uint64_t>(need / 8, 64ull << 20);
    // The start registers every NVMe-placed block: a capacity below them would fail part-way
    // through it, after minutes of writing blocks, so it is refused before the first.
    if (config_.strata.nvme_capacity > 0 && config_.strata.nvme_capacity < plan_.nvme_bytes())
      return InvalidArgument(StrCat(
          "strata.nvme_capacity is ", FormatBytes(config_.strata.nvme_capacity), " (",
          config_.strata.nvme_capacity, " bytes) but rank ", comm_->rank(),
          "'s NVMe-placed state needs ", FormatBytes(plan_.nvme_bytes()), " (", plan_.nvme_bytes(),
          " bytes); raise it to at least that, or leave it unset "
          "for what the disk has free"));
    o.capacity = config_.strata.nvme_capacity ? config_.strata.nvme_capacity : need;
    // A disk too small for the state is refused now, naming the path and the bytes, not at the
    // first Allocate that meets ENOSPC (Note [preallocation] grows the files on demand).
    o.needed_bytes = std::min(need, o.capacity);
    o.shrink_hint = plan_.ShrinkHint();
    // Per file system of the paths where a staging file lies too. Where the disk holds the whole
    // state beside the whole file, nothing is counted on: the start keeps the file until it has
    // gone through, so that a failure gives the model back (start_rollback.h). Otherwise the start
    // gives the file's space back as it writes the blocks there (Note [start's disk]), and so it
    // does with several ranks, whose blocks may share the disk in amounts one rank cannot see.
    const uint64_t stripe = static_cast<uint64_t>(std::max<int64_t>(config_.aio.block_size, 1));
    for (const FileSystemPaths& fs : GroupByFileSystem(paths)) {
      if (!fs.known) continue;  // the store names a bad path
      const std::vector<ChunkStaging> staged = StagedSpaceOn(fs.paths.front());
      if (staged.empty()) continue;
      const uint64_t whole =
          StartDiskGrowth(plan_, partitioner_->chunks(), std::vector<ChunkStaging>(staged.size()),
                          stripe, o.needed_bytes, paths.size(), fs.paths.size());
      const uint64_t free_now = FreeDiskBytes(fs.paths.front());
      if (comm_->world_size() == 1 && free_now >= whole) continue;
      const uint64_t growth = StartDiskGrowth(plan_, partitioner_->chunks(), staged, stripe,
                                              o.needed_bytes, paths.size(), fs.paths.size());
      o.needed_free_on_device[fs.device] = growth;
      o.needed_free_why = "zero::Init's staging file gives back as the start reads it";
      nvme_counts_on_staging_ = true;
      rollback_.CountsOnStagedSpace(fs.device);
      const std::string why =
          comm_->world_size() > 1
              ? std::string("the ranks may share the disk")
              : StrCat("with ", FormatBytes(free_now), " free it cannot hold the state's ",
                       FormatBytes(whole), " beside the whole file");
      STRATA_LOG(INFO) << "nvme: the start reads " << FormatBytes(TotalOf(staged))
                       << " back from zero::Init's staging file on the file system of "
                       << fs.paths.front() << " as it writes the NVMe blocks, so "
                       << FormatBytes(growth) << " of the NVMe state's "
                       << FormatBytes(o.needed_bytes) << " must be free there now; " << why
                       << ", so a start that fails part-way loses the parameters it has read";
    }
    o.aio = config_.aio;
    o.checksums = config_.strata.checksums;
    o.force_fallback = hooks_.force_fallback_io;
    o.fault_hook = hooks_.nvme_fault_hook;
    STRATA_ASSIGN_OR_RETURN(auto tier, nvme::NvmeTier::Create(o));
    nvme_ = std::move(tier);
    nvme_->SetBusyObserver([this](Clock::time_point b, Clock::time_point e) {
      meter_.trace.Add(Lane::kNvme, "nvme busy", b, e, /*step=*/-1);
    });
  }
  return Status::Ok();
}

// Note [start's disk]
// A model built under zero::Init starts from its staging file, which WriteInitialBlocks reads
// back chunk by chunk while it registers (allocates) and writes the chunk's NVMe blocks. Each
// parameter's range of the file is punched once it is read: Partition's inside ReadStaged, before
// the chunk's blocks are allocated; StageMapped's (Python's) when the parameter's mapping goes,
// once the chunk's parameters point at the engine's memory, after its blocks. So on the file's
// file system the disk's use grows by at most
//   max over chunks c of (NVMe bytes allocated through c - staged space given back by then),
// and by the whole state less the whole file at the end, not by the whole state beside the whole
// file, which is what the NVMe tier asked for when it opened (before the file is read). Asking for
// the growth lets a disk hold a start whose real peak fits it. Over several nvme paths each swap
// file holds its share of the stripes, and the growth is that of the files on the staging file's
// file system; the store checks every file system for all the paths on it together. The swap
// files also hold their first preallocation from the start (Note [preallocation]); the store adds
// that itself.
std::vector<ChunkStaging> Engine::Impl::StagedSpaceOn(const std::string& nvme_path) const {
  std::vector<ChunkStaging> staged;
  struct stat st {};
  if (::stat(nvme_path.c_str(), &st) != 0) return staged;  // the store names a bad path
  const uint64_t disk = static_cast<uint64_t>(st.st_dev);
  const auto& chunk_infos = partitioner_->chunks();
  staged.resize(chunk_infos.size());
  bool any = false;
  for (size_t c = 0; c < chunk_infos.size(); ++c) {
    for (int64_t pid : chunk_infos[c].params) {
      const std::optional<zero::StagedSpace> space = zero::StagedDiskSpace(params_[pid].tensor);
      if (!space || space->file_system != disk) continue;
      (space->given_back_on_read ? staged[c].on_read : staged[c].after_blocks) += space->bytes;
      any = true;
    }
  }
  if (!any) staged.clear();
  return staged;
}

uint64_t Engine::Impl::TotalOf(const std::vector<ChunkStaging>& staged) {
  uint64_t total = 0;
  for (const ChunkStaging& s : staged) total += s.on_read + s.after_blocks;
  return total;
}

// Note [a unit that cannot fit]
// Stage 3 gathers a unit's chunks whole on the device, beside the device-placed state and the
// root's own chunks, which stay gathered for the engine's life; in the unit's backward, while its
// chunks are held, the first of its gradients to arrive takes its chunk's whole fp32 gradient
// buffer (at least the smallest of the unit's chunks). When even that much exceeds the device's
// capacity, the first forward would fail at that unit, after the start has written
// every block (minutes, for a large model). So the start refuses first, before any block is
// written, naming the unit. The figure is a floor, not an estimate: activations, gradients and
// gathers ahead need more, and a run above it may still fail in its first step (with the
// device's own error). Below it nothing could run, so nothing that would have run is refused.
Status Engine::Impl::CheckUnitsFitDevice() const {
  if (!plan_.stage3()) return Status::Ok();
  const auto& chunk_infos = partitioner_->chunks();
  const uint64_t esize = optim::DTypeSize(plan_.compute_dtype());
  std::vector<char> live(chunk_infos.size(), 0);  // the root's chunks: gathered for good
  for (int64_t u = 0; u < units_.size(); ++u)
    if (units_[u].always_live)
      for (int64_t c : units_[u].chunks) live[c] = 1;
  uint64_t live_bytes = 0;
  for (size_t c = 0; c < live.size(); ++c)
    if (live[c]) live_bytes += static_cast<uint64_t>(chunk_infos[c].numel) * esize;
  struct UnitNeed {
    int64_t unit = -1;
    uint64_t gathered = 0, grad = 0, params = 0;
    uint64_t total() const { return gathered + grad; }
  } worst;
  for (int64_t u = 0; u < units_.size(); ++u) {
    if (units_[u].always_live) continue;
    UnitNeed n;
    n.unit = u;
    for (int64_t c : units_[u].chunks) {  // each once (MapUnitsToChunks)
      const auto numel = static_cast<uint64_t>(chunk_infos[c].numel);
      if (!live[c]) n.gathered += numel * esize;
      n.grad = n.grad == 0 ? 4 * numel : std::min(n.grad, 4 * numel);
    }
    if (worst.unit >= 0 && n.total() <= worst.total()) continue;
    for (int64_t pid : units_[u].params)
      n.params += static_cast<uint64_t>(partitioner_->location(pid).numel) * esize;
    worst = n;
  }
  const uint64_t state = plan_.placement().TierBytes(Placement::kDevice);  // not yet allocated
  const uint64_t held = device_->allocated();
  const uint64_t need = held + state + live_bytes + worst.total();
  const uint64_t capacity = device_->capacity();
  if (need <= capacity) return Status::Ok();
  const std::string unit = worst.unit >= 0
                               ? StrCat("unit '", units_.name(worst.unit), "' (",
                                        FormatBytes(worst.gathered), " gathered, and at least ",
                                        FormatBytes(worst.grad), " for a chunk's fp32 gradient)")
                               : std::string("no other unit");
  return ResourceExhausted(StrCat(
      "stage 3 gathers each unit whole on the device: ", unit, " beside the device-placed state (",
      FormatBytes(state), "), the root's own parameters (", FormatBytes(live_bytes),
      ", gathered for good) and what the device holds already (", FormatBytes(held), ") needs ",
      FormatBytes(need), ", but ", device_->name(), " has ", FormatBytes(capacity),
      " for the engine (strata.device_memory_budget; unset: the whole device). Raise it to at "
      "least ",
      FormatBytes(need), " (more for activations, gradients and gathers ahead)",
      state > 0 ? ", place less state on the device (offload_param / offload_optimizer)" : "",
      // Chunks are gathered whole: a unit whose chunks hold more than its own parameters
      // shrinks with them.
      worst.gathered > worst.params + worst.params / 2
          ? StrCat(", or lower strata.chunk_size (the unit's own parameters take ",
                   FormatBytes(worst.params), ")")
          : std::string()));
}

// The host budget and the tiered block store over the device, the pinned pool and NVMe.
Status Engine::Impl::OpenBlockStore() {
  const auto& z = config_.zero_optimization;
  {
    // The pinned pool's budget is the plan's (unset in the config: every host-placed block and a
    // working set of NVMe blocks).
    const uint64_t budget = plan_.host_budget();
    const uint64_t host_only = plan_.host_only_bytes();
    // State that must live in host memory and cannot fit there is named here, in the config's
    // terms, before the pool tries to lock it (Note [locking past the host's memory]).
    if (const HostMemory mem = ReadHostMemory(); mem.available_bytes > 0 && host_only > mem.available_bytes)
      return ResourceExhausted(StrCat(
          "the host-offloaded state of this rank is ", FormatBytes(host_only),
          " but this host has ", FormatBytes(mem.available_bytes), " available (of ",
          FormatBytes(mem.total_bytes),
          "); set offload_optimizer.device (and offload_param.device) to nvme, use more ranks",
          plan_.ShrinkHint().empty() ? std::string()
                                     : StrCat(", or shrink the state: ", plan_.ShrinkHint())));
    TierManagerOptions tmo = TierManagerOptions::FromConfig(config_.strata, budget);
    tmo.host_budget = budget;
    tmo.resident_bytes = host_only;  // the host-placed blocks, each at its size
    // DeepSpeed's offload pin_memory: false in a section that offloads keeps the host pool
    // pageable (slower transfers, no locked memory).
    const bool unpinned = (z.offload_param.device != OffloadDevice::kNone && !z.offload_param.pin_memory) ||
                          (z.offload_optimizer.device != OffloadDevice::kNone && !z.offload_optimizer.pin_memory);
    if (unpinned) {
      tmo.pool.force_pageable = true;
      STRATA_LOG(INFO) << "host pool: pin_memory=false in the offload config; the pool stays pageable";
    }
    STRATA_ASSIGN_OR_RETURN(store_, MakeTieredBlockStore(device_, nvme_.get(), tmo));
    if (hooks_.wrap_store) store_ = hooks_.wrap_store(std::move(store_));
  }
  client_ = std::make_unique<ClientStepSession>(store_.get(), device_, DeviceOptions(torch::kFloat32));
  ChunkMaterializer::Parts mp;
  mp.config = &config_;
  mp.plan = &plan_;
  mp.comm = comm_;
  mp.device = device_;
  mp.streams = &streams_;
  mp.store = store_.get();
  mp.partitioner = &*partitioner_;
  mp.chunks = &chunks_;
  mp.meter = &meter_;
  mp.step = &step_;
  mp.hooks = &hooks_;
  mp.wait_updated = [this](int64_t c) { return WaitChunkUpdated(c); };
  mp.show_params = [this](int64_t c, bool gathered) { ShowChunkParams(c, gathered); };
  materializer_ = std::make_unique<ChunkMaterializer>(std::move(mp));
  stash_ = std::make_unique<ActivationStash>(
      store_.get(), nvme_ != nullptr,
      ActivationStash::Counters{&meter_.copy_s, &meter_.stall_s, &meter_.bytes_d2h, &meter_.bytes_h2d});
  return Status::Ok();
}

// The model wired to the engine: always-live units gathered, gradient hooks, unit hooks.
Status Engine::Impl::HookModel() {
  // The root's own parameters stay gathered; gradients are taken as they arrive; the model's
  // forward finds its units through RunUnit. The root's unit is registered too: its forward
  // (Engine::Forward, or RunUnit on the root) opens the micro-step of a model whose parameters
  // all belong to the root, which has no other unit to do it.
  for (int64_t u = 0; u < units_.size(); ++u)
    if (units_[u].always_live) STRATA_RETURN_IF_ERROR(GatherUnit(u));
  STRATA_RETURN_IF_ERROR(HookGradients());
  for (int64_t u = 0; u < units_.size(); ++u)
    STRATA_RETURN_IF_ERROR(unit_detail::Register(units_[u].module.get(), owner_, u));
  return Status::Ok();
}

// The lanes: publish (when staged), optimizer, reduce and, at stage 3, gather. Made before
// HookModel, which gathers the root's own parameters through them; their threads start last.
Status Engine::Impl::MakeLanes() {
  const auto& chunk_infos = partitioner_->chunks();
  // One chunk's update (chunk_updater.h), with the publish lane when new values are staged.
  ChunkUpdater::Parts up;
  up.optimizer = &config_.optimizer;
  up.plan = &plan_;
  up.store = store_.get();
  up.device = device_;
  up.partitioner = &*partitioner_;
  up.groups = &groups_;
  up.streams = &streams_;
  up.chunks = &chunks_;
  up.trace = &meter_.trace;
  up.finished = [this](int64_t c, Status s) { opt_lane_->Finished(c, std::move(s)); };
  up.rounding_seed = config_.model.seed;
  STRATA_ASSIGN_OR_RETURN(updater_, ChunkUpdater::Create(std::move(up)));
  const auto num_chunks = static_cast<int64_t>(chunk_infos.size());
  opt_lane_ = std::make_unique<OptimizerLane>(
      num_chunks, device_, &meter_.trace, updater_->publish_lane(),
      [this](int64_t c, const OptimizerLane::StepInputs& in,
             std::optional<PublishLane::Copy>* publish, double* slot_wait_s) {
        return updater_->Update(c, in, publish, slot_wait_s);
      },
      hooks_.optimizer_delay_hook);
  GradientReducer::Parts rp;
  rp.plan = &plan_;
  rp.comm = comm_;
  rp.device = device_;
  rp.store = store_.get();
  rp.partitioner = &*partitioner_;
  rp.trace = &meter_.trace;
  rp.streams = &streams_;
  rp.scaler = &step_.scaler;
  rp.wait_updated = [this](int64_t c, double* waited) { return WaitChunkUpdated(c, waited); };
  rp.queue_update = [this](int64_t c) { EnqueueOptimizer(c); };
  rp.all_gather_ahead = [this](int64_t c, int64_t step, double* comm_s) {
    return materializer_->AllGatherAhead(c, step, comm_s);
  };
  rp.delay_hook = hooks_.reduce_delay_hook;
  reducer_ = std::make_unique<GradientReducer>(std::move(rp));
  return materializer_->MakeLanes(reducer_.get(), opt_lane_.get());
}

void Engine::Impl::StartLanes() {
  if (PublishLane* p = updater_->publish_lane()) p->Start();
  opt_lane_->Start();
  reducer_->Start();
  materializer_->StartLane();
}

}  // namespace strata
