// Engine: the facade, construction (units, partitioning, tiers) and reports (engine_impl.h maps
// the rooms).
#include "runtime/engine/engine_impl.h"

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
  // The lanes in the order ~Impl's members note: each may still hand work to the next.
  if (reducer_) reducer_->Stop();
  if (opt_lane_) opt_lane_->Stop();
  if (PublishLane* p = updater_ ? updater_->publish_lane() : nullptr) p->Stop();
  if (materializer_) materializer_->StopLane();
  if (nvme_) nvme_->SetBusyObserver(nullptr);  // the trace dies before the tier
  if (owner_) unit_detail::UnregisterEngine(owner_);
  for (auto& p : params_)
    if (p.acc) p.acc->post_hooks().clear();
  if (materializer_) {
    for (size_t c = 0; c < chunks_.size(); ++c) materializer_->FreeChunkMemory(static_cast<int64_t>(c));
    materializer_->ReapFrees(/*wait=*/true);
  }
  // Stages 0-2: the parameters are views of chunks the device allocated, and the model outlives
  // the engine (and maybe the device): give them their own copy of the working values.
  if (!plan_.stage3()) {
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
  STRATA_RETURN_IF_ERROR(streams_.copy->MemcpyAsync(dst, block, bytes, CopyKind::kDeviceToHost));
  return streams_.copy->Synchronize();
}

Status Engine::Impl::WriteBlockBytes(void* block, const void* src, size_t bytes, Placement where) {
  if (where != Placement::kDevice) {
    if (src != nullptr) std::memcpy(block, src, bytes);
    else std::memset(block, 0, bytes);
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(src != nullptr
                             ? streams_.copy->MemcpyAsync(block, src, bytes, CopyKind::kHostToDevice)
                             : streams_.copy->MemsetAsync(block, 0, bytes));
  return streams_.copy->Synchronize();
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

Status Engine::Impl::DiscoverUnits(const EngineOptions& options, optim::DType compute_dtype) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> found;
  if (options.units.empty()) {
    DefaultUnits("", *model_.module, &found);
  } else {
    // Names for the units the caller chose: their path under the root.
    std::map<const torch::nn::Module*, std::string> names;
    for (const auto& item : model_.module->named_modules("", /*include_self=*/false))
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
  po.world_size = config_.zero_optimization.stage == 0 ? 1 : comm_->world_size();
  po.element_size = static_cast<int>(optim::DTypeSize(compute_dtype));
  STRATA_ASSIGN_OR_RETURN(Partitioner part, Partitioner::Create(po));
  std::map<const c10::TensorImpl*, int64_t> seen;
  auto add_unit = [&](const std::string& name, std::shared_ptr<torch::nn::Module> module,
                      const std::vector<std::pair<std::string, torch::Tensor>>& named,
                      bool always_live) -> Status {
    UnitCoordinator::Unit info;
    info.name = name;
    info.module = std::move(module);
    info.always_live = always_live;
    const int64_t u = units_.size();  // the index Add gives it
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
    units_.Add(std::move(info));
    return Status::Ok();
  };
  {
    std::vector<std::pair<std::string, torch::Tensor>> own;
    for (const auto& item : model_.module->named_parameters(/*recurse=*/false)) own.push_back({item.key(), item.value()});
    if (!own.empty()) STRATA_RETURN_IF_ERROR(add_unit("", model_.module, own, /*always_live=*/true));
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
  for (const auto& item : model_.module->named_parameters(/*recurse=*/true)) {
    if (item.value().requires_grad() && !seen.count(item.value().unsafeGetTensorImpl()))
      return InvalidArgument(StrCat("parameter '", item.key(),
                                    "' is in no unit; add the module holding it to "
                                    "EngineOptions::units (or leave units empty for the default)"));
  }
  if (params_.empty()) return InvalidArgument("the model has no trainable parameters");
  STRATA_RETURN_IF_ERROR(part.Finalize());
  partitioner_.emplace(std::move(part));
  const auto& chunk_infos = partitioner_->chunks();
  std::vector<int64_t> chunk_numel;
  for (const ChunkInfo& ci : chunk_infos) chunk_numel.push_back(ci.numel);
  chunks_ = ChunkTable(std::move(chunk_numel));
  for (int64_t u = 0; u < units_.size(); ++u) {
    UnitCoordinator::Unit& info = units_[u];
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
  for (const auto& item : model_.module->named_buffers(/*recurse=*/true))
    if (seen_buffers.insert(item.value().unsafeGetTensorImpl()).second)
      buffers_.push_back({item.key(), item.value()});
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
    float* shard = full.data_ptr<float>() + partitioner_->ShardOffset(c64, plan_.shard_rank());
    STRATA_ASSIGN_OR_RETURN(void* m, store_->Acquire(plan_.MasterKey(c64), Access::kRead));
    Status read = ReadBlockBytes(shard, m, ci.shard_numel * 4, plan_.optim_placement());
    STRATA_RETURN_IF_ERROR(store_->Release(plan_.MasterKey(c64), false));
    STRATA_RETURN_IF_ERROR(read);
    if (plan_.shard_world() > 1) {
      const int64_t off = partitioner_->ShardOffset(c64, plan_.shard_rank());
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
  const uint64_t work = optim::DTypeSize(plan_.compute_dtype());
  const uint64_t state = optim::DTypeSize(plan_.state_dtype());
  // working copy + fp32 grad + fp32 master + the moments the optimizer keeps
  const uint64_t moments = (plan_.HoldsState(StateKind::kExpAvg) ? 1 : 0) + (plan_.HoldsState(StateKind::kExpAvgSq) ? 1 : 0);
  return n * (work + 4 + 4 + moments * state);
}

nlohmann::json Engine::Impl::Describe() const {
  return {{"stage", config_.zero_optimization.stage},
          {"world_size", comm_->world_size()},
          {"parameters", num_params()},
          {"chunks", chunks_.size()},
          {"chunk_size", config_.strata.chunk_size},
          {"dtype", optim::DTypeName(plan_.compute_dtype())},
          {"optimizer_state_dtype", optim::DTypeName(plan_.state_dtype())},
          {"param_placement", PlacementName(plan_.param_placement())},
          {"optimizer_placement", PlacementName(plan_.optim_placement())},
          {"optimizer_overlap", plan_.OptimizerOverlapName()},
          {"master_storage", plan_.master_is_param() ? "param16 (shared)" : "master32"},
          {"model_state_bytes", model_state_bytes()},
          {"host_budget", plan_.host_budget()},
          {"tier_manager", store_->StatsJson()},
          {"plan", plan_.ToJson()},
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
  engine->impl_->SetForward(std::move(model));
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
uint64_t Engine::device_peak_bytes() const { return impl_->device_peak_bytes(); }
StatusOr<uint64_t> Engine::OffloadStates(const std::vector<StateKind>& kinds) {
  return impl_->OffloadStates(kinds);
}
StatusOr<uint64_t> Engine::ReloadStates() { return impl_->ReloadStates(); }
Status Engine::Backward(const torch::Tensor& loss) { return impl_->Backward(loss); }
StatusOr<StepReport> Engine::Step() { return impl_->Step(); }
StatusOr<std::vector<torch::Tensor>> Engine::GatherMasterParams() {
  return impl_->GatherMasterParams();
}
Status Engine::SaveCheckpoint(const std::string& dir, const nlohmann::json& extra,
                              const std::string& client_file) {
  return impl_->Save(dir, extra, client_file);
}
StatusOr<nlohmann::json> Engine::LoadCheckpoint(const std::string& dir, bool weights_only) {
  return impl_->Load(dir, weights_only);
}
StatusOr<std::string> Engine::ReadClientFile(const std::string& dir) {
  return impl_->ReadClientFile(dir);
}
StatusOr<Engine::ClientStep> Engine::BeginClientStep() { return impl_->BeginClientStep(); }
StatusOr<StepReport> Engine::FinishClientStep(bool apply) { return impl_->FinishClientStep(apply); }
std::vector<std::vector<int64_t>> Engine::ClientSegments() const {
  return impl_->ClientSegments();
}

int64_t Engine::global_step() const { return impl_->global_step(); }
Status Engine::SetGroupHyperparameters(const std::vector<GroupHyperparameters>& groups) {
  return impl_->SetGroupHyperparameters(groups);
}
int Engine::num_param_groups() const { return impl_->num_param_groups(); }
Status Engine::WriteParameters(const std::vector<torch::Tensor>& params) {
  return impl_->WriteParameters(params);
}
Status Engine::Impl::SetGroupHyperparameters(const std::vector<GroupHyperparameters>& groups) {
  if (groups.size() != groups_.hyper.size()) {
    return InvalidArgument(StrCat(groups.size(), " parameter groups given but the engine was "
                                  "built with ", groups_.hyper.size(), ": groups cannot be added or "
                                  "removed after the engine is made"));
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    STRATA_RETURN_IF_ERROR(ValidateGroup(groups[g], static_cast<int>(g)));
    if (groups[g].momentum != 0 && !plan_.HoldsState(StateKind::kExpAvg) && config_.optimizer.type == OptimizerType::kSGD)
      return InvalidArgument(StrCat(
          "parameter group ", g, ": momentum=", groups[g].momentum, " but every group had "
          "momentum 0 when the engine was made, so it keeps no momentum buffer; give the groups "
          "their momentum before initialize"));
  }
  groups_.override_hyper = groups;
  return Status::Ok();
}
int64_t Engine::micro_step() const { return impl_->micro_step(); }
int64_t Engine::num_parameters() const { return impl_->num_params(); }
uint64_t Engine::model_state_bytes() const { return impl_->model_state_bytes(); }
void Engine::SetTracing(bool on) { impl_->SetTracing(on); }
nlohmann::json Engine::TraceJson() const { return impl_->TraceJson(); }
nlohmann::json Engine::Describe() const { return impl_->Describe(); }

}  // namespace strata
