// Engine: the facade, construction (units, partitioning, tiers) and reports (engine_impl.h maps
// the rooms).
#include "runtime/engine/engine_impl.h"

#include <unordered_set>

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

namespace {

// The tensor's storage has memory for all its elements (a chunk not reached by a setup that
// failed has sizes without memory).
bool HoldsItsElements(const torch::Tensor& t) {
  if (!t.has_storage() || t.storage().data() == nullptr) return false;
  return t.storage().nbytes() >= static_cast<size_t>(t.storage_offset() + t.numel()) * t.element_size();
}

}  // namespace

Engine::Impl::~Impl() {
  alive_.reset();  // graphs kept past the engine stop reaching it (EndUnit's hooks)
  // The lanes in the order ~Impl's members note: each may still hand work to the next.
  if (reducer_) reducer_->Stop();
  if (opt_lane_) opt_lane_->Stop();
  if (PublishLane* p = updater_ ? updater_->publish_lane() : nullptr) p->Stop();
  if (materializer_) materializer_->StopLane();
  if (nvme_) nvme_->SetBusyObserver(nullptr);  // the trace dies before the tier
  if (owner_) unit_detail::UnregisterEngine(owner_);
  for (auto& p : params_)
    if (p.acc) p.acc->post_hooks().clear();
  if (!started_) AbandonStart();
  // Stage 3's parameters are left with 0 elements, marked with how the engine ended.
  if (materializer_) materializer_->Close();
  GiveChunkViewsTheirOwnMemory();
}

std::string Engine::Impl::AbandonStart() {
  if (abandoned_) return "";
  abandoned_ = true;
  const bool took_any = rollback_.took_any();
  const int64_t chunks = rollback_.chunks_taken();
  try {
    const StartRollback::Outcome undone = rollback_.Undo();
    if (materializer_) materializer_->Close(/*start_failed=*/true);
    GiveChunkViewsTheirOwnMemory();
    // A parameter whose values went with the start and that views no chunk (its staged values
    // were read and given back, but its chunk never shown) is marked as a chunk's would be, so
    // that the next start refuses it instead of training 0 elements. Below stage 3 one that was
    // shown now holds the working copy's values, not its own: lost all the same.
    for (const torch::Tensor& p : undone.lost)
      if (ChunkMaterializer::ClosedChunkOf(p) == ChunkMaterializer::ClosedChunk::kNone &&
          p.numel() == 0)
        ChunkMaterializer::MarkStartFailed(p);
    if (!took_any) return "";
    if (undone.lost.empty())
      return StrCat("the model is as the start found it (", undone.restored,
                    " parameters and buffers, ", chunks,
                    " chunk(s) of them written, have their own values back)",
                    // Several ranks restart together (Note [a start that fails on one rank]).
                    comm_->world_size() > 1 ? "" : ": start it again once the cause is fixed");
    const std::string others =
        undone.restored > 0 ? StrCat(" (", undone.restored, " others have theirs back)") : "";
    return StrCat("the values of ", undone.lost.size(), " parameters went with the start", others,
                  ": their zero::Init staging space was given back as the start read it, which "
                  "its NVMe tier counted on (the disk could not hold the state beside the whole "
                  "file, or several ranks share it); build the model again (under zero.Init "
                  "where it was) before starting an engine on it");
  } catch (const std::exception& e) {
    // Memory for a stage 0-2 copy, or for a marked storage, ran out: what was given back stays so.
    return StrCat("giving the model back failed part-way (", e.what(), "): build it again");
  }
}

// Stages 0-2: the parameters are views of chunks the device allocated, and the model outlives
// the engine (and maybe the device): give them their own copy of the working values. Only
// parameters over a chunk's storage: stage 3's have 0 elements, and after a setup that failed
// before its chunks (the plan, and so the stage, may not even be known) the others still have
// the model's own memory -- for a Python zero.Init build, a mapping of the staging file, which
// a copy would pull into DRAM whole while it punched the file, so that a retry (more disk
// freed, another config) would start from a model larger than memory held in memory.
void Engine::Impl::GiveChunkViewsTheirOwnMemory() {
  std::unordered_set<const c10::StorageImpl*> chunk_storage;
  for (size_t c = 0; c < chunks_.size(); ++c)
    if (chunks_[static_cast<int64_t>(c)].full.defined() &&
        chunks_[static_cast<int64_t>(c)].full.has_storage())
      chunk_storage.insert(chunks_[static_cast<int64_t>(c)].full.storage().unsafeGetStorageImpl());
  if (chunk_storage.empty()) return;
  torch::NoGradGuard ng;
  for (auto& p : params_)
    if (p.tensor.defined() && p.tensor.numel() > 0 && HoldsItsElements(p.tensor) &&
        chunk_storage.count(p.tensor.storage().unsafeGetStorageImpl()))
      p.tensor.set_data(p.tensor.detach().clone());
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
  // The view is at the compute address; the deleter frees what Allocate returned, and holds the
  // device where the caller shares it: a chunk's parameter views may live on in an autograd
  // graph after the engine, and the device, have otherwise ended.
  return torch::from_blob(
      device_->ComputeAddress(p), {numel},
      [dev, p, keep = device_owner_](void*) {
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

uint64_t Engine::Impl::model_state_bytes() const {
  // Per chunk, its parameters' elements in each kind it stores: the working copy, the gradient,
  // the master unless it is the working shard (Note [shared master]), the moments kept.
  uint64_t bytes = 0;
  for (size_t ch = 0; ch < partitioner_->chunks().size(); ++ch) {
    const int64_t c = static_cast<int64_t>(ch);
    int64_t n = 0;
    for (int64_t pid : partitioner_->chunks()[ch].params) n += partitioner_->location(pid).numel;
    bytes += plan_.BlockBytes(StateKind::kParam16, n) + plan_.BlockBytes(StateKind::kGrad, n);
    if (plan_.Stored(c, StateKind::kMaster32)) bytes += plan_.BlockBytes(StateKind::kMaster32, n);
    for (StateKind k : {StateKind::kExpAvg, StateKind::kExpAvgSq})
      if (plan_.HoldsState(k)) bytes += plan_.BlockBytes(k, n);
  }
  return bytes;
}

nlohmann::json Engine::Impl::Describe() const {
  return {{"stage", config_.zero_optimization.stage},
          {"world_size", comm_->world_size()},
          {"parameters", num_params()},
          {"chunks", chunks_.size()},
          {"chunk_size", config_.strata.chunk_size},
          {"dtype", optim::DTypeName(plan_.compute_dtype())},
          {"optimizer_state_dtype", optim::MomentFormatName(plan_.moment_format())},
          {"master_format", optim::MasterFormatName(plan_.master_format())},
          {"param_placement", PlacementName(plan_.param_section())},
          {"optimizer_placement", PlacementName(plan_.optim_section())},
          {"placement", plan_.placement().ToJson()},
          {"optimizer_overlap", plan_.OptimizerOverlapName()},
          {"master_storage", plan_.MasterStorageName()},
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
  if (!comm->failure().ok())
    return FailedPrecondition(
        StrCat("Engine::Create: the ranks' communicator failed earlier, so no engine can start on "
               "it; restart every rank of the job; its first error: ",
               comm->failure().ToString()));
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
  Status s;
  try {
    s = raw->Init(engine.get(), options);
  } catch (const std::exception& e) {
    // LibTorch's own errors (a device out of memory in a buffer's move) end the start as any
    // other failure does, so that the model is given back here and not in a destructor.
    const std::string what = e.what();
    s = Status(what.find("out of memory") != std::string::npos ? StatusCode::kResourceExhausted
                                                               : StatusCode::kInternal,
               StrCat("engine start: ", what.substr(0, what.find('\n'))));
  }
  if (!s.ok()) {
    // Note [a start that fails on one rank]
    // The other ranks may be waiting in a broadcast of the start that this one will never join
    // (its disk, its device or its host memory failed, not theirs). Giving up the collectives
    // releases them at once with this error, where they would otherwise wait out
    // strata.comm_timeout_s and then report only a timeout (Note [giving up] in
    // runtime/comm/communicator.cc). The communicator cannot serve another start after that,
    // nor could it: this rank has issued fewer collectives than the others.
    std::string given_up;
    if (comm->world_size() > 1) {
      comm->Abort(s);
      given_up = comm->peer_gave_up() ? "; restart every rank once that rank's cause is fixed"
                                      : "; this rank gave up the job's collectives, and the other "
                                        "ranks' starts fail naming this error: restart every rank";
    }
    const std::string outcome = raw->AbandonStart();
    return Status(s.code(), StrCat(s.message(), outcome.empty() ? "" : "; ", outcome, given_up),
                  s.sys_errno());
  }
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
std::exception_ptr Engine::TakeAutogradException() { return impl_->TakeAutogradException(); }
StatusOr<StepReport> Engine::Step() { return impl_->Step(); }
StatusOr<std::vector<torch::Tensor>> Engine::GatherMasterParams() {
  return impl_->GatherMasterParams();
}
StatusOr<std::vector<Engine::Residency>> Engine::ParamResidency(
    const std::vector<torch::Tensor>& params) const {
  return impl_->ParamResidency(params);
}
StatusOr<std::vector<torch::Tensor>> Engine::GatherParamState(
    StateKind kind, const std::vector<torch::Tensor>& params) {
  return impl_->GatherParamState(kind, params);
}
StatusOr<std::vector<torch::Tensor>> Engine::LocalParamState(
    StateKind kind, const std::vector<torch::Tensor>& params) {
  return impl_->LocalParamState(kind, params);
}
Status Engine::WriteParamState(StateKind kind, const std::vector<torch::Tensor>& params,
                               const std::vector<torch::Tensor>& values) {
  return impl_->WriteParamState(kind, params, values);
}
Status Engine::SaveCheckpoint(const std::string& dir, const nlohmann::json& extra,
                              const std::string& client_file, bool with_frozen) {
  return impl_->Save(dir, extra, client_file, with_frozen);
}
StatusOr<nlohmann::json> Engine::LoadCheckpoint(const std::string& dir, LoadParts parts) {
  return impl_->Load(dir, parts);
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
double Engine::loss_scale() const { return impl_->loss_scale(); }
int64_t Engine::num_parameters() const { return impl_->num_params(); }
uint64_t Engine::model_state_bytes() const { return impl_->model_state_bytes(); }
void Engine::SetTracing(bool on) { impl_->SetTracing(on); }
nlohmann::json Engine::TraceJson() const { return impl_->TraceJson(); }
nlohmann::json Engine::Describe() const { return impl_->Describe(); }

}  // namespace strata
