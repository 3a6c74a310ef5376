// Engine: the facade, construction (units, partitioning, tiers) and reports (engine_impl.h maps
// the rooms).
#include "runtime/engine_impl.h"

namespace strata {

using namespace engine_detail;

nlohmann::json StepReport::ToJson() const {
  return {{"step", step},
          {"skipped", skipped},
          {"lr", lr},
          {"loss_scale", loss_scale},
          {"grad_norm", grad_norm},
          {"step_time_s", step_time_s},
          {"compute_s", compute_s},
          {"copy_s", copy_s},
          {"comm_s", comm_s},
          {"nvme_s", nvme_s},
          {"optimizer_s", optimizer_s},
          {"stall_s", stall_s},
          {"update_wait_s", update_wait_s},
          {"lane_sum_s", lane_sum_s},
          {"longest_lane_s", longest_lane_s},
          {"overlap", std::isnan(overlap) ? nlohmann::json(nullptr) : nlohmann::json(overlap)},
          {"compute_idle_share", compute_idle_share},
          {"bytes_host_to_device", bytes_host_to_device},
          {"bytes_device_to_host", bytes_device_to_host},
          {"bytes_nvme_to_host", bytes_nvme_to_host},
          {"bytes_host_to_nvme", bytes_host_to_nvme},
          {"peak_device_bytes", peak_device_bytes},
          {"peak_host_bytes", peak_host_bytes},
          {"bytes_activations_stashed", bytes_activations_stashed}};
}

void StepReport::FillOverlap() {
  const double lanes[] = {compute_s, copy_s, comm_s, nvme_s, optimizer_s};
  lane_sum_s = 0;
  longest_lane_s = 0;
  for (double t : lanes) {
    lane_sum_s += t;
    longest_lane_s = std::max(longest_lane_s, t);
  }
  const double hideable = lane_sum_s - longest_lane_s;
  // Below a millisecond of work off the longest lane there is nothing to overlap.
  overlap = hideable > 1e-3 ? std::clamp((lane_sum_s - step_time_s) / hideable, 0.0, 1.0)
                            : std::numeric_limits<double>::quiet_NaN();
  compute_idle_share = step_time_s > 0 ? std::clamp(1.0 - compute_s / step_time_s, 0.0, 1.0) : 0;
}

Engine::Impl::~Impl() {
  StopReduceLane();  // first: its jobs may queue updates
  StopOptimizerLane();
  StopPublishLane();  // after: the optimizer lane's last update may start a publish
  StopGatherLane();
  if (nvme_) nvme_->SetBusyObserver(nullptr);  // the trace dies before the tier
  if (owner_) unit_detail::UnregisterEngine(owner_);
  for (auto& p : params_)
    if (p.acc) p.acc->post_hooks().clear();
  for (size_t c = 0; c < chunks_.size(); ++c) FreeChunkMemory(static_cast<int64_t>(c));
  ReapFrees(/*wait=*/true);
  // Stages 0-2: the parameters are views of chunks the device allocated, and the model outlives
  // the engine (and maybe the device): give them their own copy of the working values.
  if (!stage3()) {
    torch::NoGradGuard ng;
    for (auto& p : params_)
      if (p.tensor.defined() && p.tensor.numel() > 0) p.tensor.set_data(p.tensor.detach().clone());
  }
}

torch::Device TorchDevice(const Device& device) {
  return device.kind() == DeviceKind::kCuda
             ? torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(device.index()))
             : torch::Device(torch::kCPU);
}

torch::TensorOptions Engine::Impl::DeviceOptions(torch::Dtype dtype) const {
  return torch::TensorOptions().dtype(dtype).device(TorchDevice(*device_));
}

StatusOr<torch::Tensor> Engine::Impl::DeviceTensor(int64_t numel, torch::Dtype dtype) {
  const size_t bytes = static_cast<size_t>(numel) * torch::elementSize(dtype);
  STRATA_ASSIGN_OR_RETURN(void* p, device_->Allocate(bytes));
  Device* dev = device_;
  // The view is at the compute address; the deleter frees what Allocate returned.
  return torch::from_blob(
      device_->ComputeAddress(p), {numel},
      [dev, p](void*) {
        ComputeFence::Mark(*dev).Wait();  // Note [ordered frees]
        dev->Free(p).IgnoreError();
      },
      DeviceOptions(dtype));
}

// Note [device blocks]
// A block placed on the device is device memory: on a GPU the host cannot touch it, and the
// strict CPU device (tests) makes a host access crash the same way. Host code therefore reads
// and writes such a block only through the copy stream (ReadBlockBytes / WriteBlockBytes), and
// compute on it (LibTorch views, the CPU Adam on the CPU device) goes through
// Device::ComputeAddress.
Status Engine::Impl::ReadBlockBytes(void* dst, const void* block, size_t bytes, Placement where) {
  if (where != Placement::kDevice) {
    std::memcpy(dst, block, bytes);
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(copy_stream_->MemcpyAsync(dst, block, bytes, CopyKind::kDeviceToHost));
  return copy_stream_->Synchronize();
}

Status Engine::Impl::WriteBlockBytes(void* block, const void* src, size_t bytes, Placement where) {
  if (where != Placement::kDevice) {
    if (src != nullptr) std::memcpy(block, src, bytes);
    else std::memset(block, 0, bytes);
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(src != nullptr
                             ? copy_stream_->MemcpyAsync(block, src, bytes, CopyKind::kHostToDevice)
                             : copy_stream_->MemsetAsync(block, 0, bytes));
  return copy_stream_->Synchronize();
}

Status Engine::Impl::OnCommMemory(torch::Tensor& host,
                                  const std::function<Status(void*)>& collective) {
  if (comm_->memory_kind() == MemoryKind::kHost) return collective(host.data_ptr());
  torch::Tensor staged = host.to(TorchDevice(*device_));
  ComputeFence::Mark(*device_).Wait();  // the collective's stream does not wait for the copy
  STRATA_RETURN_IF_ERROR(collective(staged.data_ptr()));
  host.copy_(staged);
  return Status::Ok();
}

namespace {

bool IsContainer(const torch::nn::Module& m) {
  return dynamic_cast<const torch::nn::SequentialImpl*>(&m) ||
         dynamic_cast<const torch::nn::ModuleListImpl*>(&m) ||
         dynamic_cast<const torch::nn::ModuleDictImpl*>(&m);
}

bool HoldsTrainable(const torch::nn::Module& m) {
  for (const auto& p : m.parameters(/*recurse=*/true))
    if (p.requires_grad()) return true;
  return false;
}

// Children of `m` that hold trainable parameters, looking through containers.
void DefaultUnits(const std::string& prefix, const torch::nn::Module& m,
                  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>* out) {
  for (const auto& child : m.named_children()) {
    const std::string name = prefix.empty() ? child.key() : prefix + "." + child.key();
    if (!HoldsTrainable(*child.value())) continue;
    if (IsContainer(*child.value())) DefaultUnits(name, *child.value(), out);
    else out->push_back({name, child.value()});
  }
}

}  // namespace

Status Engine::Impl::DiscoverUnits(const EngineOptions& options) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> found;
  if (options.units.empty()) {
    DefaultUnits("", *model_, &found);
  } else {
    // Names for the units the caller chose: their path under the root.
    std::map<const torch::nn::Module*, std::string> names;
    for (const auto& item : model_->named_modules("", /*include_self=*/false))
      names.emplace(item.value().get(), item.key());
    for (const auto& u : options.units) {
      if (!u) return InvalidArgument("EngineOptions::units holds a null module");
      auto it = names.find(u.get());
      if (it == names.end())
        return InvalidArgument(StrCat("EngineOptions::units names a module (", u->name(),
                                      ") that is not part of the model"));
      found.push_back({it->second, u});
    }
  }
  // Parameters are registered unit by unit, each once (a tied parameter belongs to the first
  // unit holding it and is shared by the others).
  PartitionerOptions po;
  po.chunk_size = config_.strata.chunk_size;
  po.world_size = shard_world();
  po.element_size = static_cast<int>(optim::DTypeSize(compute_dtype_));
  STRATA_ASSIGN_OR_RETURN(Partitioner part, Partitioner::Create(po));
  std::map<const c10::TensorImpl*, int64_t> seen;
  auto add_unit = [&](const std::string& name, std::shared_ptr<torch::nn::Module> module,
                      const std::vector<std::pair<std::string, torch::Tensor>>& named,
                      bool always_live) -> Status {
    UnitInfo info;
    info.name = name;
    info.module = std::move(module);
    info.always_live = always_live;
    const int64_t u = static_cast<int64_t>(units_.size());
    for (const auto& [pname, p] : named) {
      if (!p.requires_grad()) continue;
      auto it = seen.find(p.unsafeGetTensorImpl());
      int64_t id;
      if (it != seen.end()) {
        id = it->second;
        if (std::find(info.params.begin(), info.params.end(), id) != info.params.end()) continue;
      } else {
        const std::string full_name = name.empty() ? pname : name + "." + pname;
        // A stage-3 engine leaves its parameters as views of storage it frees; reading one would
        // touch freed memory, so a model whose engine was closed is refused here. (A parameter
        // staged by zero::Init has no memory either, by design: its values are in the file.)
        if (p.numel() > 0 && (!p.has_storage() || p.data_ptr() == nullptr) && !zero::IsStaged(p))
          return FailedPrecondition(StrCat(
              "parameter '", full_name, "' has no memory: the model belongs to a ZeRO-3 engine "
              "that was closed; call engine.destroy() (it gives the model its weights back) "
              "instead of close(), or load a checkpoint into a new model"));
        STRATA_ASSIGN_OR_RETURN(id, part.AddParam(full_name, p.numel()));
        STRATA_DCHECK(id == static_cast<int64_t>(params_.size()));
        params_.push_back({p, p.sizes().vec(), {}, nullptr});
        seen.emplace(p.unsafeGetTensorImpl(), id);
      }
      params_[id].units.push_back(u);
      info.params.push_back(id);
    }
    units_.push_back(std::move(info));
    return Status::Ok();
  };
  {
    std::vector<std::pair<std::string, torch::Tensor>> own;
    for (const auto& item : model_->named_parameters(/*recurse=*/false)) own.push_back({item.key(), item.value()});
    if (!own.empty()) STRATA_RETURN_IF_ERROR(add_unit("", model_, own, /*always_live=*/true));
  }
  std::set<const torch::nn::Module*> unit_modules;
  for (auto& [name, module] : found) {
    if (!unit_modules.insert(module.get()).second)
      return InvalidArgument(StrCat("unit '", name, "' is listed twice"));
    std::vector<std::pair<std::string, torch::Tensor>> named;
    for (const auto& item : module->named_parameters(/*recurse=*/true)) named.push_back({item.key(), item.value()});
    STRATA_RETURN_IF_ERROR(add_unit(name, module, named, false));
  }
  // Trainable parameters outside every unit would never be gathered.
  for (const auto& item : model_->named_parameters(/*recurse=*/true)) {
    if (item.value().requires_grad() && !seen.count(item.value().unsafeGetTensorImpl()))
      return InvalidArgument(StrCat("parameter '", item.key(),
                                    "' is in no unit; add the module holding it to "
                                    "EngineOptions::units (or leave units empty for the default)"));
  }
  if (params_.empty()) return InvalidArgument("the model has no trainable parameters");
  STRATA_RETURN_IF_ERROR(part.Finalize());
  partitioner_.emplace(std::move(part));
  const auto& chunk_infos = partitioner_->chunks();
  chunks_.resize(chunk_infos.size());
  chunk_ready_.assign(chunk_infos.size(), false);
  chunk_sum_sq_.assign(chunk_infos.size(), 0.0);
  chunk_nonfinite_.assign(chunk_infos.size(), 0);
  update_pending_.assign(chunk_infos.size(), 0);
  fill_enqueued_.assign(chunk_infos.size(), 1);
  fill_taken_.assign(chunk_infos.size(), 0);
  fill_landed_.assign(chunk_infos.size(), 1);
  fill_status_.assign(chunk_infos.size(), Status::Ok());
  ahead_done_.assign(chunk_infos.size(), 1);
  ahead_status_.assign(chunk_infos.size(), Status::Ok());
  for (size_t u = 0; u < units_.size(); ++u) {
    UnitInfo& info = units_[u];
    for (int64_t pid : info.params) {
      const int64_t c = partitioner_->location(pid).chunk;
      if (std::find(info.chunks.begin(), info.chunks.end(), c) == info.chunks.end()) {
        info.chunks.push_back(c);
        chunks_[c].units.push_back(static_cast<int64_t>(u));
      }
    }
    for (int64_t c : info.chunks) info.elems += chunk_infos[c].numel;
  }
  // Buffers, each once.
  std::set<const c10::TensorImpl*> seen_buffers;
  for (const auto& item : model_->named_buffers(/*recurse=*/true))
    if (seen_buffers.insert(item.value().unsafeGetTensorImpl()).second)
      buffers_.push_back({item.key(), item.value()});
  return Status::Ok();
}

Status Engine::Impl::Init(Engine* owner, const EngineOptions& options) {
  owner_ = owner;
  optimizer_delay_hook_ = options.optimizer_delay_hook;
  reduce_delay_hook_ = options.reduce_delay_hook;
  loss_scaling_ = config_.fp16.enabled || options.loss_scaling;
  const auto& z = config_.zero_optimization;
  const ComputeDtypeChoice dtype_choice =
      ChooseComputeDtype(config_, device_->kind(), DeviceHasNativeBf16(device_->kind()));
  compute_dtype_ = dtype_choice.dtype;
  if (dtype_choice.slow_bf16) {
    static std::once_flag warned;  // once per process, however many engines it builds
    std::call_once(warned, [] {
      STRATA_LOG(WARN) << SlowBf16Warning(MeasureCpuMatmulGflops(torch::kBFloat16),
                                          MeasureCpuMatmulGflops(torch::kFloat32));
    });
  }
  state_dtype_ = config_.strata.optimizer_state_dtype == StateDtype::kBf16 ? optim::DType::kBFloat16
                                                                            : optim::DType::kFloat32;
  auto placement = [](OffloadDevice d) {
    return d == OffloadDevice::kNone  ? Placement::kDevice
           : d == OffloadDevice::kCpu ? Placement::kHost
                                      : Placement::kNvme;
  };
  param_placement_ = placement(z.offload_param.device);
  optim_placement_ = placement(z.offload_optimizer.device);
  if (device_optimizer() && param_placement_ != Placement::kDevice)
    return InvalidArgument(StrCat(
        "offload_param.device offloads the parameters but offload_optimizer.device=none keeps the "
        "optimizer on the device (", device_->name(), "); offload the optimizer too "
        "(offload_optimizer.device: cpu or nvme), as DeepSpeed requires"));
  if (device_->kind() == DeviceKind::kCuda && !torch::cuda::is_available())
    return FailedPrecondition(StrCat(
        "the device is ", device_->name(), " but this LibTorch has no CUDA (or sees no GPU); "
        "build Strata against a CUDA LibTorch (pip torch: see the README) or use --device cpu"));
  if (comm_->world_size() > 1 && comm_->memory_kind() == MemoryKind::kHost &&
      device_->kind() != DeviceKind::kCpu)
    return FailedPrecondition(StrCat("communicator ", comm_->backend(),
                                     " moves host memory but the device is ", device_->name(),
                                     "; use the nccl backend with CUDA"));
  if (config_.fp16.enabled && device_->kind() == DeviceKind::kCpu)
    return InvalidArgument(
        "fp16.enabled=true on the cpu device: LibTorch has no fp16 CPU kernels for LayerNorm and "
        "matmul; use bf16.enabled=true instead (same memory, no loss scaling needed), or run on a "
        "GPU");
  if (loss_scaling_) {
    STRATA_ASSIGN_OR_RETURN(auto s, optim::DynamicLossScaler::FromConfig(config_.fp16));
    scaler_.emplace(std::move(s));
  }

  STRATA_ASSIGN_OR_RETURN(copy_stream_, device_->CreateStream(StreamPriority::kHigh));
  STRATA_ASSIGN_OR_RETURN(publish_stream_, device_->CreateStream());
  side_stream_ = std::make_unique<SideStream>(*device_);
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
      immediate_optimizer() || defer_updates(), &why);
  arena_ = std::make_unique<tbb::task_arena>(arena_threads);
  if (comm_->rank() == 0)
    STRATA_LOG(INFO) << "optimizer lane: " << arena_threads << " thread(s) (" << why
                     << "); LibTorch compute: " << compute_threads << " thread(s)";

  STRATA_RETURN_IF_ERROR(DiscoverUnits(options));
  STRATA_ASSIGN_OR_RETURN(plan_, partitioner_->PlanFor(z.stage, shard_rank(),
                                                       static_cast<int>(optim::DTypeSize(state_dtype_))));
  const auto& chunk_infos = partitioner_->chunks();
  // NVMe tier for whatever is placed there.
  if (param_placement_ == Placement::kNvme || optim_placement_ == Placement::kNvme) {
    std::vector<std::string> paths = options.nvme_path;
    if (paths.empty())
      paths = optim_placement_ == Placement::kNvme ? z.offload_optimizer.nvme_path
                                                   : z.offload_param.nvme_path;
    if (paths.empty())
      return InvalidArgument(
          "NVMe offload is configured but no nvme_path is set; set "
          "zero_optimization.offload_optimizer.nvme_path (or pass --nvme-path)");
    nvme::NvmeTierOptions o;
    o.paths = paths;
    o.rank = static_cast<uint32_t>(comm_->rank());
    // Without a configured capacity, reserve what this rank's NVMe-placed shards need.
    uint64_t need = 0;
    const uint64_t ssize = optim::DTypeSize(state_dtype_);
    for (const ChunkInfo& ci : partitioner_->chunks()) {
      auto round = [](uint64_t b) { return (b + 4095) / 4096 * 4096; };
      const uint64_t n = static_cast<uint64_t>(ci.shard_numel);
      if (optim_placement_ == Placement::kNvme)  // grad, master (unless shared), two moments
        need += round(n * 4) * (master_is_param() ? 1 : 2) + round(n * ssize) * 2;
      if (param_placement_ == Placement::kNvme && z.stage == 3)
        need += round(n * optim::DTypeSize(compute_dtype_));
    }
    // cpu_checkpointing puts saved inputs in NVMe-backed slots too: leave them an eighth more
    // (a block's input is B·T·d elements against its 12·d² weights).
    if (config_.activation_checkpointing.cpu_checkpointing) need += std::max<uint64_t>(need / 8, 64ull << 20);
    o.capacity = config_.strata.nvme_capacity ? config_.strata.nvme_capacity : need;
    // A disk too small for the state is refused now, naming the path and the bytes, not at the
    // first Allocate that meets ENOSPC (Note [preallocation] grows the files on demand).
    o.needed_bytes = std::min(need, o.capacity);
    o.aio = config_.aio;
    o.checksums = config_.strata.checksums;
    o.force_fallback = options.force_fallback_io;
    o.fault_hook = options.nvme_fault_hook;
    STRATA_ASSIGN_OR_RETURN(auto tier, nvme::NvmeTier::Create(o));
    nvme_ = std::move(tier);
    nvme_->SetBusyObserver([this](Clock::time_point b, Clock::time_point e) {
      lane_trace_.Add(Lane::kNvme, "nvme busy", b, e, /*step=*/-1);
    });
  }
  {
    // Host budget: the pinned pool the tier manager places host and NVMe blocks in. Unset, it is
    // sized to hold every host-placed block plus a working set of NVMe blocks; the pool rounds
    // blocks to power-of-two classes, so the sizes here do too.
    auto cls = [](uint64_t b) {
      uint64_t c = 4096;
      while (c < b) c <<= 1;
      return c;
    };
    uint64_t host_only = 0, nvme_total = 0, largest = 0;
    const uint64_t ssize = optim::DTypeSize(state_dtype_);
    for (const ChunkInfo& ci : partitioner_->chunks()) {
      const uint64_t n = static_cast<uint64_t>(ci.shard_numel);
      std::vector<std::pair<uint64_t, Placement>> blocks = {
          {n * 4, optim_placement_}, {n * ssize, optim_placement_}, {n * ssize, optim_placement_},
          {n * 4, optim_placement_}};
      if (z.stage == 3) blocks.push_back({n * optim::DTypeSize(compute_dtype_), param_placement_});
      for (auto [bytes, where] : blocks) {
        if (where == Placement::kHost) host_only += cls(bytes);
        if (where == Placement::kNvme) nvme_total += cls(bytes), largest = std::max(largest, cls(bytes));
      }
    }
    // The optimizer lane pins five blocks of a chunk while the compute lane pins two more.
    const uint64_t working = std::min(nvme_total, std::max<uint64_t>(16 * largest, 512ull << 20));
    uint64_t budget = config_.strata.host_memory_budget;
    if (budget == 0 && host_only + nvme_total > 0) budget = host_only + working;
    if (budget > 0 && budget < host_only + std::min(nvme_total, 8 * largest))
      return InvalidArgument(StrCat(
          "strata.host_memory_budget=", FormatBytes(budget), " cannot hold the ",
          FormatBytes(host_only), " of host-offloaded state plus a working set of ",
          FormatBytes(std::min(nvme_total, 8 * largest)),
          " of NVMe blocks; raise it, offload more to NVMe, or lower strata.chunk_size"));
    if (host_only + nvme_total == 0) budget = 0;
    // State that must live in host memory and cannot fit there is named here, in the config's
    // terms, before the pool tries to lock it (Note [locking past the host's memory]).
    if (const HostMemory mem = ReadHostMemory(); mem.available_bytes > 0 && host_only > mem.available_bytes)
      return ResourceExhausted(StrCat(
          "the host-offloaded state of this rank is ", FormatBytes(host_only), " but this host has ",
          FormatBytes(mem.available_bytes), " available (of ", FormatBytes(mem.total_bytes),
          "); set offload_optimizer.device (and offload_param.device) to nvme, use more ranks, or "
          "set strata.optimizer_state_dtype to bf16"));
    TierManagerOptions tmo = TierManagerOptions::FromConfig(config_.strata, budget);
    tmo.host_budget = budget;
    // DeepSpeed's offload pin_memory: false in a section that offloads keeps the host pool
    // pageable (slower transfers, no locked memory).
    const bool unpinned = (z.offload_param.device != OffloadDevice::kNone && !z.offload_param.pin_memory) ||
                          (z.offload_optimizer.device != OffloadDevice::kNone && !z.offload_optimizer.pin_memory);
    if (unpinned) {
      tmo.pool.force_pageable = true;
      STRATA_LOG(INFO) << "host pool: pin_memory=false in the offload config; the pool stays pageable";
    }
    STRATA_ASSIGN_OR_RETURN(store_, MakeTieredBlockStore(device_, nvme_.get(), tmo));
    if (options.wrap_store) store_ = options.wrap_store(std::move(store_));
    host_budget_ = budget;
  }

  persistent_.assign(chunk_infos.size(), false);
  for (size_t c = 0; c < chunk_infos.size(); ++c)
    persistent_[c] = chunk_infos[c].used_numel < z.stage3_param_persistence_threshold;

  // Buffers live on the engine's device and start from rank 0's values too.
  for (auto& [name, b] : buffers_) {
    torch::NoGradGuard ng;
    const torch::Device dev = DeviceOptions(b.scalar_type()).device();
    if (b.device() != dev) b.set_data(b.to(dev));
    if (comm_->world_size() > 1 && b.numel() > 0) {
      torch::Tensor t = b.contiguous();
      ComputeFence::Mark(*device_).Wait();  // the move above and contiguous() are queued compute
      STRATA_RETURN_IF_ERROR(comm_->Broadcast(t.data_ptr(), static_cast<int64_t>(t.nbytes()),
                                              strata::DType::kU8, 0)
                                 .WithContext(StrCat("broadcasting buffer ", name)));
      if (!t.is_same(b)) b.copy_(t);
    }
  }

  // Register every block and write its initial contents, chunk by chunk, so that at most one
  // chunk's full fp32 values exist at a time besides the model.
  const int stage = z.stage;
  const size_t esize = optim::DTypeSize(compute_dtype_);
  const size_t ssize = optim::DTypeSize(state_dtype_);
  const torch::Dtype tdtype = TorchDtype(compute_dtype_);
  for (size_t c = 0; c < chunk_infos.size(); ++c) {
    const ChunkInfo& ci = chunk_infos[c];
    const int64_t n = ci.shard_numel;
    const int64_t c64 = static_cast<int64_t>(c);
    // The chunk's initial fp32 values: from the parameters, or from zero::Init's staging file
    // for a model built there (it has shapes but no memory).
    torch::Tensor full32 = torch::zeros({ci.numel}, torch::kFloat32);
    for (int64_t pid : ci.params) {
      const ParamLocation& loc = partitioner_->location(pid);
      torch::Tensor dst = full32.narrow(0, loc.offset, loc.numel);
      STRATA_ASSIGN_OR_RETURN(bool staged, zero::ReadStaged(params_[pid].tensor, dst.data_ptr<float>()));
      if (!staged) dst.copy_(params_[pid].tensor.detach().reshape({-1}).to(torch::kFloat32));
    }
    // Every rank starts from rank 0's initial values.
    if (comm_->world_size() > 1)
      STRATA_RETURN_IF_ERROR(
          OnCommMemory(full32, [&](void* p) {
            return comm_->Broadcast(p, ci.numel, strata::DType::kF32, 0);
          }).WithContext(StrCat("broadcasting chunk ", c, "'s initial values")));
    torch::Tensor shard32 =
        full32.narrow(0, partitioner_->ShardOffset(c64, shard_rank()), n).contiguous();
    auto put = [&](StateKind kind, uint64_t bytes, Placement where, const void* src) -> Status {
      BlockKey key{c64, kind};
      STRATA_RETURN_IF_ERROR(store_->Register(key, bytes, where));
      STRATA_ASSIGN_OR_RETURN(void* dst, store_->Acquire(key, Access::kWrite));
      Status written = WriteBlockBytes(dst, src, bytes, where);
      Status released = store_->Release(key, /*dirty=*/true);
      return written.ok() ? released : written;
    };
    if (!master_is_param())
      STRATA_RETURN_IF_ERROR(put(StateKind::kMaster32, n * 4, optim_placement_, shard32.data_ptr()));
    STRATA_RETURN_IF_ERROR(put(StateKind::kExpAvg, n * ssize, optim_placement_, nullptr));
    STRATA_RETURN_IF_ERROR(put(StateKind::kExpAvgSq, n * ssize, optim_placement_, nullptr));
    STRATA_RETURN_IF_ERROR(put(StateKind::kGrad, n * 4, optim_placement_, nullptr));
    torch::Tensor work = full32.to(tdtype);
    torch::NoGradGuard ng;
    if (stage == 3) {
      torch::Tensor shard16 =
          work.narrow(0, partitioner_->ShardOffset(c64, shard_rank()), n).contiguous();
      STRATA_RETURN_IF_ERROR(put(StateKind::kParam16, n * esize, param_placement_, shard16.data_ptr()));
      // The parameters become views of the chunk's storage for good; its memory comes and goes.
      ChunkState& cs = chunks_[c];
      const torch::Device dev = DeviceOptions(tdtype).device();
      cs.storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, dev),
                                /*allocator=*/nullptr, /*resizable=*/false);
      STRATA_RETURN_IF_ERROR(InstallChunk(c64));
      cs.full = torch::empty({0}, DeviceOptions(tdtype)).set_(cs.storage, 0, {ci.numel}, {1});
      for (int64_t pid : ci.params) {
        const ParamLocation& loc = partitioner_->location(pid);
        params_[pid].tensor.set_data(cs.full.narrow(0, loc.offset, loc.numel).view(params_[pid].shape));
      }
      DropChunk(c64);
    } else {
      // Stages 0-2 keep the whole working copy on the device for the whole run.
      STRATA_ASSIGN_OR_RETURN(chunks_[c].full, DeviceTensor(ci.numel, tdtype));
      chunks_[c].full.copy_(work);
      for (int64_t pid : ci.params) {
        const ParamLocation& loc = partitioner_->location(pid);
        params_[pid].tensor.set_data(
            chunks_[c].full.narrow(0, loc.offset, loc.numel).view(params_[pid].shape));
      }
    }
  }
  // The root's own parameters stay gathered; gradients are taken as they arrive; the model's
  // forward finds its units through RunUnit.
  for (size_t u = 0; u < units_.size(); ++u)
    if (units_[u].always_live) STRATA_RETURN_IF_ERROR(GatherUnit(static_cast<int64_t>(u)));
  STRATA_RETURN_IF_ERROR(HookGradients());
  for (size_t u = 0; u < units_.size(); ++u)
    if (!units_[u].always_live)
      STRATA_RETURN_IF_ERROR(unit_detail::Register(units_[u].module.get(), owner_, static_cast<int64_t>(u)));
  // A host optimizer's new values for device-resident parameters go through the staging buffer
  // (AdamChunk). Sized once, here: growing it later would free and allocate page-locked memory,
  // which on a GPU waits for the device.
  if (staged_publish()) {
    int64_t most = 0;
    for (const ChunkInfo& ci : chunk_infos) most = std::max(most, ci.shard_numel);
    for (int slot = 0; slot < 2; ++slot) {
      STRATA_RETURN_IF_ERROR(publish_staging_[slot].Reserve(most * optim::DTypeSize(compute_dtype_))
                                 .WithContext("the optimizer's staging buffer"));
      STRATA_ASSIGN_OR_RETURN(publish_events_[slot], device_->CreateEvent());
    }
    StartPublishLane();
  }
  StartOptimizerLane();
  StartReduceLane();
  if (stage3()) {
    STRATA_ASSIGN_OR_RETURN(gather_stream_, device_->CreateStream(StreamPriority::kHigh));
    fill_events_.resize(chunk_infos.size());
    for (auto& event : fill_events_) {
      STRATA_ASSIGN_OR_RETURN(event, device_->CreateEvent());
    }
    StartGatherLane();
  }
  STRATA_LOG(INFO) << "engine stage=" << stage << " world=" << comm_->world_size()
                   << " params=" << partitioner_->param_numel() << " units=" << units_.size()
                   << " chunks=" << chunk_infos.size()
                   << " param_placement=" << PlacementName(param_placement_)
                   << " optimizer_placement=" << PlacementName(optim_placement_)
                   << " dtype=" << optim::DTypeName(compute_dtype_)
                   << " optimizer_overlap=" << OptimizerOverlapName()
                   << " master=" << (master_is_param() ? "param16" : "master32");
  return Status::Ok();
}

StatusOr<std::vector<torch::Tensor>> Engine::Impl::GatherMasterParams() {
  QuietLanes();
  std::vector<torch::Tensor> out;
  out.reserve(params_.size());
  for (auto& p : params_) out.push_back(torch::zeros(p.shape, torch::kFloat32));
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const ChunkInfo& ci = partitioner_->chunks()[c];
    const int64_t c64 = static_cast<int64_t>(c);
    torch::Tensor full = torch::zeros({ci.numel}, torch::kFloat32);
    float* shard = full.data_ptr<float>() + partitioner_->ShardOffset(c64, shard_rank());
    STRATA_ASSIGN_OR_RETURN(void* m, store_->Acquire(MasterKey(c64), Access::kRead));
    Status read = ReadBlockBytes(shard, m, ci.shard_numel * 4, optim_placement_);
    STRATA_RETURN_IF_ERROR(store_->Release(MasterKey(c64), false));
    STRATA_RETURN_IF_ERROR(read);
    if (shard_world() > 1) {
      const int64_t off = partitioner_->ShardOffset(c64, shard_rank());
      STRATA_RETURN_IF_ERROR(OnCommMemory(full, [&](void* p) {
        return comm_->AllGather(static_cast<float*>(p) + off, p, ci.shard_numel,
                                strata::DType::kF32);
      }));
    }
    for (int64_t pid : ci.params) {
      const ParamLocation& loc = partitioner_->location(pid);
      out[pid].copy_(full.narrow(0, loc.offset, loc.numel).view(params_[pid].shape));
    }
  }
  return out;
}

uint64_t Engine::Impl::model_state_bytes() const {
  const uint64_t n = static_cast<uint64_t>(num_params());
  const uint64_t work = optim::DTypeSize(compute_dtype_);
  const uint64_t state = optim::DTypeSize(state_dtype_);
  // working copy + fp32 grad + fp32 master + two moments
  return n * (work + 4 + 4 + 2 * state);
}

nlohmann::json Engine::Impl::PlanJson() const {
  nlohmann::json j = nlohmann::json::object();
  for (int k = 0; k < kNumStateKinds; ++k)
    j[StateKindName(static_cast<StateKind>(k))] = {{"sharded", plan_.sharded[k]}, {"bytes", plan_.bytes[k]}};
  return j;
}

nlohmann::json Engine::Impl::Describe() const {
  return {{"stage", config_.zero_optimization.stage},
          {"world_size", comm_->world_size()},
          {"parameters", num_params()},
          {"chunks", chunks_.size()},
          {"chunk_size", config_.strata.chunk_size},
          {"dtype", optim::DTypeName(compute_dtype_)},
          {"optimizer_state_dtype", optim::DTypeName(state_dtype_)},
          {"param_placement", PlacementName(param_placement_)},
          {"optimizer_placement", PlacementName(optim_placement_)},
          {"optimizer_overlap", OptimizerOverlapName()},
          {"master_storage", master_is_param() ? "param16 (shared)" : "master32"},
          {"model_state_bytes", model_state_bytes()},
          {"host_budget", host_budget_},
          {"tier_manager", store_->StatsJson()},
          {"plan", PlanJson()},
          {"device", device_->name()},
          {"torch_device", TorchDevice(*device_).str()}};
}

// ---------------------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

StatusOr<std::unique_ptr<Engine>> Engine::Create(torch::nn::AnyModule model, const Config& config,
                                                 Communicator* comm, Device* device,
                                                 const EngineOptions& options) {
  if (model.is_empty()) return InvalidArgument("Engine::Create: the model is null");
  STRATA_ASSIGN_OR_RETURN(auto engine, Create(model.ptr(), config, comm, device, options));
  engine->impl_->any_ = std::move(model);
  return engine;
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(std::shared_ptr<torch::nn::Module> model,
                                                 const Config& config, Communicator* comm,
                                                 Device* device, const EngineOptions& options) {
  if (!model) return InvalidArgument("Engine::Create: the model is null");
  if (!comm || !device) return InvalidArgument("Engine::Create: communicator and device are required");
  // "auto" values not resolved by the caller (strata-train resolves them from its flags) are
  // resolved here from what the engine knows: the world size and the device.
  Config resolved = config;
  if (resolved.auto_resolved.empty()) {
    AutoContext ctx;
    ctx.world_size = comm->world_size();
    ctx.native_bf16 = DeviceHasNativeBf16(device->kind());
    STRATA_RETURN_IF_ERROR(resolved.ResolveAuto(ctx));
    for (const std::string& line : resolved.auto_resolved) STRATA_LOG(INFO) << "config: " << line;
  }
  auto impl = std::make_unique<Impl>(std::move(model), resolved, comm, device);
  Impl* raw = impl.get();
  std::unique_ptr<Engine> engine(new Engine(std::move(impl)));
  STRATA_RETURN_IF_ERROR(raw->Init(engine.get(), options));
  return engine;
}

torch::Tensor Engine::Forward(const torch::Tensor& input) { return impl_->Forward(input); }
void Engine::BeginUnit(int64_t unit, bool checkpointed) { impl_->BeginUnit(unit, checkpointed); }
void Engine::EndUnit(int64_t unit, const std::vector<torch::Tensor>& outputs) {
  impl_->EndUnit(unit, outputs);
}
int64_t Engine::num_units() const { return impl_->num_units(); }
bool Engine::cpu_checkpointing() const { return impl_->cpu_checkpointing(); }
StatusOr<int64_t> Engine::StashActivations(const std::vector<torch::Tensor>& tensors) {
  return impl_->StashActivations(tensors);
}
StatusOr<std::vector<torch::Tensor>> Engine::RestoreActivations(int64_t handle) {
  return impl_->RestoreActivations(handle);
}
std::string Engine::unit_name(int64_t unit) const { return impl_->unit_name(unit); }
uint64_t Engine::device_bytes_in_use() const { return impl_->device_bytes(); }
Status Engine::Backward(const torch::Tensor& loss) { return impl_->Backward(loss); }
StatusOr<StepReport> Engine::Step() { return impl_->Step(); }
StatusOr<std::vector<torch::Tensor>> Engine::GatherMasterParams() {
  return impl_->GatherMasterParams();
}
Status Engine::SaveCheckpoint(const std::string& dir, const nlohmann::json& extra) {
  return impl_->Save(dir, extra);
}
StatusOr<nlohmann::json> Engine::LoadCheckpoint(const std::string& dir, bool weights_only) {
  return impl_->Load(dir, weights_only);
}


int64_t Engine::global_step() const { return impl_->global_step_; }
int64_t Engine::micro_step() const { return impl_->micro_step_; }
int64_t Engine::num_parameters() const { return impl_->num_params(); }
uint64_t Engine::model_state_bytes() const { return impl_->model_state_bytes(); }
void Engine::SetTracing(bool on) { impl_->SetTracing(on); }
nlohmann::json Engine::TraceJson() const { return impl_->TraceJson(); }
nlohmann::json Engine::Describe() const { return impl_->Describe(); }

}  // namespace strata
