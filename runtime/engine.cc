#include "runtime/engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>

#include <tbb/task_arena.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "optim/cpu_adam.h"
#include "optim/loss_scaler.h"
#include "runtime/block_store.h"
#include "runtime/checkpoint.h"
#include "runtime/check.h"
#include "runtime/comm/communicator.h"
#include "runtime/compute_dtype.h"
#include "runtime/device.h"
#include "runtime/host_info.h"
#include "runtime/logging.h"
#include "runtime/lr_schedule.h"
#include "runtime/partitioner.h"
#include "runtime/run_unit.h"
#include "runtime/units.h"
#include "runtime/zero_init.h"
#include "tiers/nvme/crc32c.h"
#include "tiers/nvme/nvme_tier.h"

namespace strata {

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

[[noreturn]] void Throw(const Status& s) { throw std::runtime_error(s.ToString()); }

torch::Dtype TorchDtype(optim::DType d) {
  switch (d) {
    case optim::DType::kFloat32: return torch::kFloat32;
    case optim::DType::kBFloat16: return torch::kBFloat16;
    case optim::DType::kFloat16: return torch::kFloat16;
  }
  return torch::kFloat32;
}

strata::DType CommDtype(optim::DType d) {
  switch (d) {
    case optim::DType::kFloat32: return strata::DType::kF32;
    case optim::DType::kBFloat16: return strata::DType::kBF16;
    case optim::DType::kFloat16: return strata::DType::kF16;
  }
  return strata::DType::kF32;
}

// Adds a lane's busy time from the scope's start to its end.
class LaneTimer {
 public:
  explicit LaneTimer(double* sum) : sum_(sum), t0_(Clock::now()) {}
  ~LaneTimer() { *sum_ += Since(t0_); }

 private:
  double* sum_;
  Clock::time_point t0_;
};

}  // namespace

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
          {"overlap_efficiency", overlap_efficiency},
          {"bytes_host_to_device", bytes_host_to_device},
          {"bytes_device_to_host", bytes_device_to_host},
          {"bytes_nvme_to_host", bytes_nvme_to_host},
          {"bytes_host_to_nvme", bytes_host_to_nvme},
          {"peak_device_bytes", peak_device_bytes},
          {"peak_host_bytes", peak_host_bytes}};
}

class Engine::Impl {
 public:
  Impl(std::shared_ptr<torch::nn::Module> model, const Config& config, Communicator* comm,
       Device* device)
      : model_(std::move(model)), config_(config), comm_(comm), device_(device) {}
  ~Impl();

  Status Init(Engine* owner, const EngineOptions& options);
  torch::Tensor Forward(const torch::Tensor& input);
  void BeginUnit(int64_t u, bool checkpointed);
  void EndUnit(int64_t u, const std::vector<torch::Tensor>& outputs);
  Status Backward(const torch::Tensor& loss);
  StatusOr<StepReport> Step();
  StatusOr<std::vector<torch::Tensor>> GatherMasterParams();
  Status Save(const std::string& dir, const nlohmann::json& extra);
  StatusOr<nlohmann::json> Load(const std::string& dir);

  int64_t global_step_ = 0;
  int64_t micro_step_ = 0;
  nlohmann::json Describe() const;
  int64_t num_params() const { return partitioner_ ? partitioner_->param_numel() : 0; }
  uint64_t model_state_bytes() const;
  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  std::string unit_name(int64_t u) const {
    return u >= 0 && u < num_units() ? units_[u].name : std::string();
  }
  uint64_t device_bytes() const { return device_->allocated(); }
  bool cpu_checkpointing() const { return config_.activation_checkpointing.cpu_checkpointing; }

 private:
  struct ParamInfo {
    torch::Tensor tensor;
    std::vector<int64_t> shape;
    std::vector<int64_t> units;                 // every unit that holds it (tied: several)
    std::shared_ptr<torch::autograd::Node> acc;  // its AccumulateGrad node, kept alive for the hook
    // This micro-step (Note [backward by gradients]): whether a plain (not checkpointed) unit run
    // used it, how many checkpointed runs did, how many gradient deliveries came, and whether
    // its gradient is complete.
    bool plain_use = false;
    int checkpointed_uses = 0;
    int arrivals = 0;
    bool grad_in = false;
  };
  struct UnitInfo {
    std::string name;
    std::shared_ptr<torch::nn::Module> module;
    std::vector<int64_t> params;  // parameters it holds, tied ones included
    std::vector<int64_t> chunks;  // chunks those parameters live in
    int64_t elems = 0;            // full elements a gather of the unit brings in
    bool always_live = false;     // the root's own parameters: gathered for the engine's life
    int grads_pending = 0;        // parameters whose gradient has not arrived this micro-step
    bool backward_held = false;   // gathered for its backward
    int forward_depth = 0;        // open BeginUnit calls
    bool open_checkpointed = false;  // the open run is a checkpointed forward
  };
  struct ChunkState {
    std::vector<int64_t> units;
    // Stages 0-2: the working copy, owned. Stage 3: a view of `storage`, whose memory the engine
    // installs when gathering and removes when dropping (`gathered` says which).
    torch::Tensor full;
    c10::Storage storage;
    void* buffer = nullptr;
    bool gathered = false;
    int live = 0;             // holders of the gathered chunk (stage 3)
    torch::Tensor grad_full;  // fp32 gradient of the whole chunk for this micro-step
    int pending = 0;          // parameters whose gradient has not arrived this micro-step
  };

  // Device memory counted against the device budget, owned by the returned tensor: the memory
  // returns to the allocator when the last view of it dies.
  StatusOr<torch::Tensor> DeviceTensor(int64_t numel, torch::Dtype dtype);
  torch::TensorOptions DeviceOptions(torch::Dtype dtype) const;

  Status DiscoverUnits(const EngineOptions& options);
  Status HookGradients();
  // Stage 3: installs memory in a chunk's storage and fills it (shard from its tier, all-gather).
  Status InstallChunk(int64_t c);
  Status FillChunk(int64_t c);
  void FreeChunkMemory(int64_t c);
  Status GatherChunk(int64_t c);
  // Drops a holder; the chunk stays gathered when it is persistent or will be reused within
  // stage3_max_reuse_distance elements (Note [stage-3 live set]).
  void ReleaseChunk(int64_t c, int64_t reuse_distance);
  void DropChunk(int64_t c);
  // After an optimizer step: persistent chunks are refilled with the new values, others dropped.
  Status RefreshChunksAfterStep();
  Status GatherUnit(int64_t u);
  void ReleaseUnit(int64_t u, int64_t reuse_distance);
  int64_t ForwardReuseDistance(size_t trace_pos) const;
  void PrefetchUnits(size_t trace_pos, int direction);
  void OpenMicroStep();
  void OnUnitBackwardReach(int64_t u);
  void OnParamGrad(int64_t pid);
  // Takes a delivery of a parameter's gradient; `settle` completes it whatever came.
  Status TakeParamGrad(int64_t pid, bool settle);
  Status ReduceChunk(int64_t c);
  Status AdamChunk(int64_t c, float grad_scale, double lr, int64_t step);
  Status PublishParams(int64_t c, const void* shard_values, optim::DType dtype);

  // Optimizer lane: a thread that runs chunk updates in the order queued.
  void StartOptimizerLane();
  void StopOptimizerLane();
  void EnqueueOptimizer(int64_t c);
  Status DrainOptimizer();

  int shard_rank() const { return config_.zero_optimization.stage == 0 ? 0 : comm_->rank(); }
  int shard_world() const {
    return config_.zero_optimization.stage == 0 ? 1 : comm_->world_size();
  }
  bool stage3() const { return config_.zero_optimization.stage == 3; }
  bool immediate_optimizer() const {
    return config_.strata.overlap_optimizer && config_.gradient_clipping == 0 &&
           !config_.fp16.enabled;
  }
  bool last_micro_step() const {
    return (micro_step_ + 1) % config_.gradient_accumulation_steps == 0;
  }

  std::shared_ptr<torch::nn::Module> model_;
 public:
  std::optional<torch::nn::AnyModule> any_;  // set when the model came with a forward
 private:
  Engine* owner_ = nullptr;
  Config config_;
  Communicator* comm_;
  Device* device_;
  std::unique_ptr<Stream> copy_stream_;
  std::unique_ptr<nvme::NvmeTier> nvme_;
  std::unique_ptr<BlockStore> store_;
  std::optional<Partitioner> partitioner_;
  std::optional<optim::DynamicLossScaler> scaler_;
  std::unique_ptr<tbb::task_arena> arena_;
  uint64_t host_budget_ = 0;
  optim::DType compute_dtype_ = optim::DType::kFloat32;
  optim::DType state_dtype_ = optim::DType::kFloat32;
  Placement param_placement_ = Placement::kDevice;
  Placement optim_placement_ = Placement::kDevice;

  std::vector<ParamInfo> params_;
  std::vector<UnitInfo> units_;
  std::vector<std::pair<std::string, torch::Tensor>> buffers_;  // unique, in registration order
  std::vector<ChunkState> chunks_;
  std::vector<bool> chunk_ready_;  // grads complete for this step
  std::vector<bool> persistent_;   // chunks below stage3_param_persistence_threshold
  int64_t live_elems_ = 0;         // elements of gathered chunks (stage 3)

  // The order units ran in this micro-step's forward and in the previous one; prefetching and
  // the reuse distance follow the previous one (Note [stage-3 live set]).
  std::vector<int64_t> trace_, last_trace_;
  size_t backward_cursor_ = 0;  // position in trace_ backward has reached
  bool micro_open_ = false;     // a training forward has begun and its Backward not yet run
  bool in_backward_ = false;

  // Per-step lanes (main thread), reset when a step begins.
  bool step_open_ = false;
  Clock::time_point step_start_;
  double compute_s_ = 0, copy_s_ = 0, comm_s_ = 0, stall_s_ = 0;
  uint64_t bytes_h2d_ = 0, bytes_d2h_ = 0;
  BlockStoreStats store_at_step_start_;
  std::vector<int64_t> ready_order_;  // chunks in the order their grads completed
  Status backward_error_;

  // Optimizer lane state.
  std::thread opt_thread_;
  std::mutex opt_mu_;
  std::condition_variable opt_cv_;
  std::deque<int64_t> opt_queue_;  // GUARDED_BY(opt_mu_)
  int opt_busy_ = 0;               // GUARDED_BY(opt_mu_)
  bool opt_stop_ = false;          // GUARDED_BY(opt_mu_)
  Status opt_error_;               // GUARDED_BY(opt_mu_)
  double opt_s_ = 0;               // GUARDED_BY(opt_mu_)
  float opt_grad_scale_ = 1;       // set before enqueueing
  double opt_lr_ = 0;
  int64_t opt_step_ = 0;
};

Engine::Impl::~Impl() {
  StopOptimizerLane();
  if (owner_) unit_detail::UnregisterEngine(owner_);
  for (auto& p : params_)
    if (p.acc) p.acc->post_hooks().clear();
  for (size_t c = 0; c < chunks_.size(); ++c) FreeChunkMemory(static_cast<int64_t>(c));
  // Stages 0-2: the parameters are views of chunks the device allocated, and the model outlives
  // the engine (and maybe the device): give them their own copy of the working values.
  if (!stage3()) {
    torch::NoGradGuard ng;
    for (auto& p : params_)
      if (p.tensor.defined() && p.tensor.numel() > 0) p.tensor.set_data(p.tensor.detach().clone());
  }
}

torch::TensorOptions Engine::Impl::DeviceOptions(torch::Dtype dtype) const {
  torch::Device dev = device_->kind() == DeviceKind::kCuda
                          ? torch::Device(torch::kCUDA, static_cast<int16_t>(device_->index()))
                          : torch::Device(torch::kCPU);
  return torch::TensorOptions().dtype(dtype).device(dev);
}

StatusOr<torch::Tensor> Engine::Impl::DeviceTensor(int64_t numel, torch::Dtype dtype) {
  const size_t bytes = static_cast<size_t>(numel) * torch::elementSize(dtype);
  STRATA_ASSIGN_OR_RETURN(void* p, device_->Allocate(bytes));
  Device* dev = device_;
  return torch::from_blob(
      p, {numel}, [dev](void* ptr) { dev->Free(ptr).IgnoreError(); }, DeviceOptions(dtype));
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
        STRATA_ASSIGN_OR_RETURN(id, part.AddParam(name.empty() ? pname : name + "." + pname, p.numel()));
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

// Note [backward by gradients]
// A unit's backward is over when every parameter of it has its gradient: autograd runs a leaf's
// AccumulateGrad node once per backward, after every use of the leaf has contributed (its input
// buffer sums them), so a post hook on that node sees the whole gradient of a parameter used
// several times or shared between units. The hook moves .grad into the chunk's gradient buffer;
// the last parameter of a unit releases the unit, the last of a chunk reduces the chunk. Nothing
// depends on the order units run in, so residuals across units, units with several outputs and
// tied weights need no special case. Parameters that took no part in this backward are settled
// when Backward returns.
namespace {
class GradArrived : public torch::autograd::FunctionPostHook {
 public:
  explicit GradArrived(std::function<void()> fn) : fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    fn_();
    return outputs;
  }

 private:
  std::function<void()> fn_;
};
}  // namespace

Status Engine::Impl::HookGradients() {
  for (size_t pid = 0; pid < params_.size(); ++pid) {
    auto& p = params_[pid];
    p.acc = torch::autograd::impl::grad_accumulator(p.tensor);
    if (!p.acc) return Internal(StrCat("parameter ", pid, " has no gradient accumulator"));
    const int64_t id = static_cast<int64_t>(pid);
    p.acc->add_post_hook(std::make_unique<GradArrived>([this, id] { OnParamGrad(id); }));
  }
  return Status::Ok();
}

Status Engine::Impl::Init(Engine* owner, const EngineOptions& options) {
  owner_ = owner;
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
  if (optim_placement_ == Placement::kDevice && device_->kind() != DeviceKind::kCpu)
    return Unimplemented(
        "offload_optimizer.device=none on a CUDA device needs the GPU Adam, which this build does "
        "not run yet; set zero_optimization.offload_optimizer.device to cpu or nvme");
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
  if (config_.fp16.enabled) {
    STRATA_ASSIGN_OR_RETURN(auto s, optim::DynamicLossScaler::FromConfig(config_.fp16));
    scaler_.emplace(std::move(s));
  }

  STRATA_ASSIGN_OR_RETURN(copy_stream_, device_->CreateStream(StreamPriority::kHigh));
  // The optimizer's arena: one thread per physical core (hwloc), unless
  // strata.optimizer_threads says otherwise.
  const int configured = static_cast<int>(config_.strata.optimizer_threads);
  const int cores = PhysicalCoreCount();
  const int arena_threads = configured > 0 ? configured : std::max(1, cores);
  arena_ = std::make_unique<tbb::task_arena>(arena_threads);
  if (comm_->rank() == 0)
    STRATA_LOG(INFO) << "optimizer lane: " << arena_threads << " thread(s) ("
                     << (configured > 0 ? "strata.optimizer_threads" : "one per physical core")
                     << "; hwloc sees " << cores << " core(s)); LibTorch compute: "
                     << torch::get_num_threads() << " thread(s)";

  STRATA_RETURN_IF_ERROR(DiscoverUnits(options));
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
      if (optim_placement_ == Placement::kNvme)
        need += round(n * 4) * 2 + round(n * ssize) * 2;
      if (param_placement_ == Placement::kNvme && z.stage == 3)
        need += round(n * optim::DTypeSize(compute_dtype_));
    }
    o.capacity = config_.strata.nvme_capacity ? config_.strata.nvme_capacity : need;
    o.aio = config_.aio;
    o.checksums = config_.strata.checksums;
    o.force_fallback = options.force_fallback_io;
    o.fault_hook = options.nvme_fault_hook;
    STRATA_ASSIGN_OR_RETURN(auto tier, nvme::NvmeTier::Create(o));
    nvme_ = std::move(tier);
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
      STRATA_RETURN_IF_ERROR(comm_->Broadcast(full32.data_ptr(), ci.numel, strata::DType::kF32, 0)
                                 .WithContext(StrCat("broadcasting chunk ", c, "'s initial values")));
    torch::Tensor shard32 =
        full32.narrow(0, partitioner_->ShardOffset(c64, shard_rank()), n).contiguous();
    auto put = [&](StateKind kind, uint64_t bytes, Placement where, const void* src) -> Status {
      BlockKey key{c64, kind};
      STRATA_RETURN_IF_ERROR(store_->Register(key, bytes, where));
      STRATA_ASSIGN_OR_RETURN(void* dst, store_->Acquire(key, Access::kWrite));
      if (src) std::memcpy(dst, src, bytes);
      else std::memset(dst, 0, bytes);
      return store_->Release(key, /*dirty=*/true);
    };
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
  StartOptimizerLane();
  STRATA_LOG(INFO) << "engine stage=" << stage << " world=" << comm_->world_size()
                   << " params=" << partitioner_->param_numel() << " units=" << units_.size()
                   << " chunks=" << chunk_infos.size()
                   << " param_placement=" << PlacementName(param_placement_)
                   << " optimizer_placement=" << PlacementName(optim_placement_)
                   << " dtype=" << optim::DTypeName(compute_dtype_)
                   << " optimizer_overlap=" << (immediate_optimizer() ? "backward" : "deferred");
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Materialization (stage 3).

// Note [stage-3 live set]
// A gathered chunk stays on the device after its unit is done when it is small enough to
// persist (all of it below stage3_param_persistence_threshold elements: it then stays gathered
// across steps and is refilled after each update) or when it will be used again before
// stage3_max_reuse_distance more elements are gathered (the last units of forward are needed
// again at once by backward), as long as the gathered total stays within
// stage3_max_live_parameters; gathering a chunk that would exceed that cap first drops chunks
// nobody holds. The reuse distance and prefetching follow the order units ran in the previous
// forward (the trace); the first forward has none and keeps nothing it does not have to.
Status Engine::Impl::InstallChunk(int64_t c) {
  ChunkState& cs = chunks_[c];
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t bytes = static_cast<size_t>(ci.numel) * optim::DTypeSize(compute_dtype_);
  STRATA_ASSIGN_OR_RETURN(void* p, device_->Allocate(bytes));
  c10::StorageImpl* impl = cs.storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(p, DeviceOptions(torch::kFloat32).device()));
  impl->set_nbytes(bytes);
  cs.buffer = p;
  cs.gathered = true;
  live_elems_ += ci.numel;
  return Status::Ok();
}

void Engine::Impl::FreeChunkMemory(int64_t c) {
  ChunkState& cs = chunks_[c];
  if (!cs.buffer) return;
  // Leave the storage empty first: every view (the parameters, what autograd saved) now reads
  // as unallocated instead of pointing at freed memory.
  c10::StorageImpl* impl = cs.storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, DeviceOptions(torch::kFloat32).device()));
  impl->set_nbytes(0);
  device_->Free(cs.buffer).IgnoreError();
  cs.buffer = nullptr;
}

Status Engine::Impl::FillChunk(int64_t c) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t esize = optim::DTypeSize(compute_dtype_);
  char* base = static_cast<char*>(chunks_[c].buffer);
  char* dst = base + partitioner_->ShardOffset(c, shard_rank()) * esize;
  const size_t bytes = ci.shard_numel * esize;
  BlockKey key{c, StateKind::kParam16};
  auto t0 = Clock::now();
  STRATA_ASSIGN_OR_RETURN(void* src, store_->Acquire(key, Access::kRead));
  stall_s_ += Since(t0);
  {
    LaneTimer t(&copy_s_);
    CopyKind kind = param_placement_ == Placement::kDevice ? CopyKind::kDeviceToDevice
                                                           : CopyKind::kHostToDevice;
    Status s = copy_stream_->MemcpyAsync(dst, src, bytes, kind);
    if (s.ok()) s = copy_stream_->Synchronize();
    Status r = store_->Release(key, false);
    STRATA_RETURN_IF_ERROR(s);
    STRATA_RETURN_IF_ERROR(r);
    if (kind == CopyKind::kHostToDevice) bytes_h2d_ += bytes;
  }
  if (comm_->world_size() > 1) {
    LaneTimer t(&comm_s_);
    STRATA_RETURN_IF_ERROR(comm_->AllGather(dst, base, ci.shard_numel, CommDtype(compute_dtype_)));
  }
  return Status::Ok();
}

Status Engine::Impl::GatherChunk(int64_t c) {
  ChunkState& cs = chunks_[c];
  ++cs.live;
  if (cs.gathered) return Status::Ok();
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const int64_t max_live = config_.zero_optimization.stage3_max_live_parameters;
  for (size_t k = 0; k < chunks_.size() && live_elems_ + ci.numel > max_live; ++k)
    if (chunks_[k].live == 0 && chunks_[k].gathered) DropChunk(static_cast<int64_t>(k));
  Status s = InstallChunk(c);
  if (s.ok()) s = FillChunk(c);
  if (!s.ok()) {
    --cs.live;
    DropChunk(c);
  }
  return s;
}

void Engine::Impl::ReleaseChunk(int64_t c, int64_t reuse_distance) {
  ChunkState& cs = chunks_[c];
  STRATA_DCHECK(cs.live > 0, "chunk ", c, " released more often than gathered");
  if (--cs.live > 0) return;
  const auto& z = config_.zero_optimization;
  if (persistent_[c]) return;
  if (reuse_distance <= z.stage3_max_reuse_distance && live_elems_ <= z.stage3_max_live_parameters)
    return;
  DropChunk(c);
}

void Engine::Impl::DropChunk(int64_t c) {
  ChunkState& cs = chunks_[c];
  if (!cs.gathered) return;
  FreeChunkMemory(c);
  cs.gathered = false;
  live_elems_ -= partitioner_->chunks()[c].numel;
}

Status Engine::Impl::RefreshChunksAfterStep() {
  if (!stage3()) return Status::Ok();
  for (size_t c = 0; c < chunks_.size(); ++c) {
    ChunkState& cs = chunks_[c];
    if (!cs.gathered) continue;
    if (cs.live > 0 || persistent_[c]) {
      // Still held (the root's own parameters) or persistent: same memory, new values.
      STRATA_RETURN_IF_ERROR(FillChunk(static_cast<int64_t>(c)));
    } else {
      DropChunk(static_cast<int64_t>(c));
    }
  }
  return Status::Ok();
}

Status Engine::Impl::GatherUnit(int64_t u) {
  if (!stage3()) return Status::Ok();
  const auto& chunks = units_[u].chunks;
  for (size_t k = 0; k < chunks.size(); ++k) {
    Status s = GatherChunk(chunks[k]);
    if (!s.ok()) {
      for (size_t j = 0; j < k; ++j) ReleaseChunk(chunks[j], std::numeric_limits<int64_t>::max());
      return s;
    }
  }
  return Status::Ok();
}

void Engine::Impl::ReleaseUnit(int64_t u, int64_t reuse_distance) {
  if (!stage3()) return;
  for (int64_t c : units_[u].chunks) ReleaseChunk(c, reuse_distance);
}

// In forward, a unit at trace position i is next needed by its backward, after every later unit
// of the trace has been gathered twice (its forward and its backward).
int64_t Engine::Impl::ForwardReuseDistance(size_t pos) const {
  if (pos >= last_trace_.size() || pos >= trace_.size() || last_trace_[pos] != trace_[pos])
    return std::numeric_limits<int64_t>::max();
  int64_t d = 0;
  for (size_t k = pos + 1; k < last_trace_.size(); ++k) d += 2 * units_[last_trace_[k]].elems;
  return d;
}

// Hints the shards of the units after trace position `pos` (direction +1, forward) or before it
// (-1, backward) until stage3_prefetch_bucket_size elements are on their way.
void Engine::Impl::PrefetchUnits(size_t pos, int direction) {
  if (!stage3() || param_placement_ == Placement::kDevice) return;
  const std::vector<int64_t>& trace = direction > 0 ? last_trace_ : trace_;
  int64_t budget = config_.zero_optimization.stage3_prefetch_bucket_size;
  for (int64_t k = static_cast<int64_t>(pos) + direction;
       k >= 0 && k < static_cast<int64_t>(trace.size()) && budget > 0; k += direction) {
    for (int64_t c : units_[trace[k]].chunks) {
      if (chunks_[c].gathered) continue;
      store_->Prefetch({c, StateKind::kParam16});
      budget -= partitioner_->chunks()[c].shard_numel;
    }
  }
}

void Engine::Impl::OpenMicroStep() {
  if (!step_open_) {
    step_open_ = true;
    step_start_ = Clock::now();
    compute_s_ = copy_s_ = comm_s_ = stall_s_ = 0;
    bytes_h2d_ = bytes_d2h_ = 0;
    store_at_step_start_ = store_->stats();
    ready_order_.clear();
    {
      std::lock_guard<std::mutex> l(opt_mu_);
      opt_s_ = 0;
    }
    store_->BeginIteration();
  }
  micro_open_ = true;
  trace_.clear();
  for (auto& p : params_) {
    p.plain_use = false;
    p.checkpointed_uses = 0;
    p.arrivals = 0;
    p.grad_in = false;
  }
  for (auto& u : units_) {
    u.grads_pending = static_cast<int>(u.params.size());
    u.backward_held = false;
  }
  for (size_t c = 0; c < chunks_.size(); ++c)
    chunks_[c].pending = static_cast<int>(partitioner_->chunks()[c].params.size());
}

void Engine::Impl::BeginUnit(int64_t u, bool checkpointed) {
  if (u < 0 || u >= num_units()) Throw(InvalidArgument(StrCat("no unit ", u)));
  UnitInfo& unit = units_[u];
  if (unit.forward_depth > 0)
    Throw(FailedPrecondition(StrCat("unit '", unit.name, "' runs inside itself; units may nest only "
                                    "when they are different modules")));
  if (in_backward_) {
    // Backward recomputes a checkpointed unit: gather it and hold it until its gradients are in.
    if (!unit.backward_held && unit.grads_pending > 0) {
      Status s = GatherUnit(u);
      if (!s.ok()) Throw(s.WithContext(StrCat("gathering unit '", unit.name, "' to recompute it")));
      unit.backward_held = true;
    }
    ++unit.forward_depth;
    unit.open_checkpointed = false;
    return;
  }
  // Under torch::NoGradGuard (evaluation) nothing is recorded for backward and no step opens; a
  // checkpointed forward runs without grad but is training.
  const bool training = torch::GradMode::is_enabled() || checkpointed;
  if (training && !micro_open_) OpenMicroStep();
  Status s = GatherUnit(u);
  if (!s.ok()) Throw(s.WithContext(StrCat("gathering unit '", unit.name, "' for forward")));
  ++unit.forward_depth;
  unit.open_checkpointed = checkpointed;
  if (training) {
    trace_.push_back(u);
    PrefetchUnits(trace_.size() - 1, +1);
    for (int64_t pid : unit.params) {
      if (checkpointed) ++params_[pid].checkpointed_uses;
      else params_[pid].plain_use = true;
    }
  }
}

void Engine::Impl::EndUnit(int64_t u, const std::vector<torch::Tensor>& outputs) {
  if (u < 0 || u >= num_units() || units_[u].forward_depth == 0)
    Throw(FailedPrecondition(StrCat("EndUnit(", u, ") without its BeginUnit")));
  UnitInfo& unit = units_[u];
  --unit.forward_depth;
  if (in_backward_) return;  // a recomputation: released when its gradients are in
  const bool checkpointed = unit.open_checkpointed;
  unit.open_checkpointed = false;
  const bool training = torch::GradMode::is_enabled() || checkpointed;
  if (training && !checkpointed && stage3()) {
    for (const torch::Tensor& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      torch::Tensor t = out;  // register_hook is not const; the hook lands on the shared node
      t.register_hook([this, u](const torch::Tensor&) { OnUnitBackwardReach(u); });
    }
  }
  ReleaseUnit(u, training ? ForwardReuseDistance(trace_.size() - 1)
                          : std::numeric_limits<int64_t>::max());
}

torch::Tensor Engine::Impl::Forward(const torch::Tensor& input) {
  auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(model_.get());
  if (!seq && !any_)
    Throw(FailedPrecondition(
        "Engine::Forward needs a Sequential or a model given with its forward (AnyModule); call "
        "the model's own forward instead, which runs its units through strata::RunUnit"));
  LaneTimer t(&compute_s_);  // gathers inside are subtracted as copy, comm and stall time
  if (!seq) return any_->forward(input);
  torch::Tensor x = input;
  for (size_t k = 0; k < seq->size(); ++k) {
    const unit_detail::UnitRef ref = unit_detail::FindUnit(*seq->ptr(k));
    const bool unit = ref.engine == owner_;  // false: the child holds no trainable parameter
    if (unit) BeginUnit(ref.unit, false);
    try {
      x = (seq->begin() + static_cast<std::ptrdiff_t>(k))->forward(x);
    } catch (...) {
      if (unit) EndUnit(ref.unit, {});
      throw;
    }
    if (unit) EndUnit(ref.unit, {x});
  }
  return x;
}

void Engine::Impl::OnUnitBackwardReach(int64_t u) {
  if (!in_backward_)
    Throw(FailedPrecondition("backward reached a unit outside Engine::Backward: call "
                             "engine->Backward(loss) instead of loss.backward()"));
  if (!backward_error_.ok()) return;
  UnitInfo& unit = units_[u];
  if (unit.backward_held || unit.grads_pending == 0) return;
  Status s = GatherUnit(u);
  if (!s.ok()) {
    backward_error_ = s.WithContext(StrCat("gathering unit '", unit.name, "' for backward"));
    // Autograd cannot be cancelled from a hook without unwinding through it: throw, and
    // Backward turns the exception back into this Status.
    Throw(backward_error_);
  }
  unit.backward_held = true;
  // Prefetch the units that ran before this one.
  size_t pos = std::min(backward_cursor_, trace_.size());
  while (pos > 0 && trace_[pos - 1] != u) --pos;
  if (pos > 0) {
    backward_cursor_ = pos - 1;
    PrefetchUnits(pos - 1, -1);
  }
}

void Engine::Impl::OnParamGrad(int64_t pid) {
  if (!in_backward_ || !backward_error_.ok()) return;
  Status s = TakeParamGrad(pid, false);
  if (!s.ok()) {
    backward_error_ = s;
    Throw(s);
  }
}

Status Engine::Impl::TakeParamGrad(int64_t pid, bool settle) {
  ParamInfo& p = params_[pid];
  if (p.grad_in) return Status::Ok();
  const ParamLocation& loc = partitioner_->location(pid);
  ChunkState& cs = chunks_[loc.chunk];
  {
    torch::NoGradGuard ng;
    torch::Tensor g = p.tensor.grad();
    if (g.defined()) {
      if (!cs.grad_full.defined()) {
        STRATA_ASSIGN_OR_RETURN(cs.grad_full,
                                DeviceTensor(partitioner_->chunks()[loc.chunk].numel, torch::kFloat32));
        cs.grad_full.zero_();
      }
      cs.grad_full.narrow(0, loc.offset, loc.numel).add_(g.reshape({-1}).to(torch::kFloat32));
      p.tensor.mutable_grad() = torch::Tensor();
    }
  }
  // Plain uses deliver once (the main backward's AccumulateGrad sums them); each checkpointed run
  // delivers from its own recomputation's backward.
  ++p.arrivals;
  if (!settle && p.arrivals < p.checkpointed_uses + (p.plain_use ? 1 : 0)) return Status::Ok();
  p.grad_in = true;
  for (int64_t u : p.units) {
    UnitInfo& unit = units_[u];
    if (--unit.grads_pending == 0 && unit.backward_held) {
      unit.backward_held = false;
      // The next use is after the optimizer step, which changes the values: only persistent
      // chunks survive until then.
      ReleaseUnit(u, std::numeric_limits<int64_t>::max());
    }
  }
  if (--cs.pending == 0) STRATA_RETURN_IF_ERROR(ReduceChunk(loc.chunk));
  return Status::Ok();
}

Status Engine::Impl::ReduceChunk(int64_t c) {
  ChunkState& cs = chunks_[c];
  const ChunkInfo& ci = partitioner_->chunks()[c];
  if (!cs.grad_full.defined()) {  // no parameter of the chunk took part: a zero gradient
    STRATA_ASSIGN_OR_RETURN(cs.grad_full, DeviceTensor(ci.numel, torch::kFloat32));
    cs.grad_full.zero_();
  }
  float* full = cs.grad_full.data_ptr<float>();
  const int64_t off = partitioner_->ShardOffset(c, shard_rank());
  if (comm_->world_size() > 1) {
    LaneTimer t(&comm_s_);
    if (config_.zero_optimization.stage == 0) {
      STRATA_RETURN_IF_ERROR(comm_->AllReduce(full, ci.numel, strata::DType::kF32, ReduceOp::kAvg));
    } else {
      STRATA_RETURN_IF_ERROR(comm_->ReduceScatter(full, full + off, ci.shard_numel,
                                                  strata::DType::kF32, ReduceOp::kAvg));
    }
  }
  torch::Tensor shard = cs.grad_full.narrow(0, off, ci.shard_numel);
  const bool first_micro = micro_step_ % config_.gradient_accumulation_steps == 0;
  BlockKey key{c, StateKind::kGrad};
  auto t0 = Clock::now();
  STRATA_ASSIGN_OR_RETURN(void* dst, store_->Acquire(key, first_micro ? Access::kWrite : Access::kReadWrite));
  stall_s_ += Since(t0);
  {
    LaneTimer t(&copy_s_);
    torch::NoGradGuard ng;
    torch::Tensor host = torch::from_blob(
        dst, {ci.shard_numel},
        optim_placement_ == Placement::kDevice ? DeviceOptions(torch::kFloat32)
                                               : torch::TensorOptions().dtype(torch::kFloat32));
    if (first_micro) host.copy_(shard);
    else host.add_(shard.to(host.device()));
    if (device_->kind() != DeviceKind::kCpu) bytes_d2h_ += ci.shard_numel * 4;
  }
  cs.grad_full = torch::Tensor();
  STRATA_RETURN_IF_ERROR(store_->Release(key, true));
  if (last_micro_step()) {
    chunk_ready_[c] = true;
    ready_order_.push_back(c);
    if (immediate_optimizer()) EnqueueOptimizer(c);
  }
  return Status::Ok();
}

Status Engine::Impl::Backward(const torch::Tensor& loss) {
  if (!step_open_ || !micro_open_)
    return FailedPrecondition("Backward called without a training forward in this micro-step");
  backward_error_ = Status::Ok();
  if (last_micro_step() && immediate_optimizer()) {
    // Updates start during this backward: fix their step-wide inputs now.
    opt_step_ = global_step_ + 1;
    opt_lr_ = LearningRate(config_, opt_step_);
    opt_grad_scale_ = 1.0f;
  }
  double scale = scaler_ ? scaler_->scale() : 1.0;
  torch::Tensor scaled = loss * (scale / static_cast<double>(config_.gradient_accumulation_steps));
  backward_cursor_ = trace_.size();
  in_backward_ = true;
  Status result;
  try {
    LaneTimer t(&compute_s_);
    scaled.backward();
  } catch (const std::exception& e) {
    result = backward_error_.ok() ? Internal(StrCat("backward failed: ", e.what())) : backward_error_;
  }
  in_backward_ = false;
  // Parameters that took no part in this backward: a zero gradient, their units released.
  for (size_t pid = 0; pid < params_.size() && result.ok(); ++pid)
    result = TakeParamGrad(static_cast<int64_t>(pid), /*settle=*/true);
  for (size_t u = 0; u < units_.size(); ++u) {
    if (units_[u].backward_held) {
      units_[u].backward_held = false;
      ReleaseUnit(static_cast<int64_t>(u), std::numeric_limits<int64_t>::max());
    }
  }
  last_trace_ = trace_;
  micro_open_ = false;
  STRATA_RETURN_IF_ERROR(result);
  for (size_t c = 0; c < chunks_.size(); ++c)
    if (chunks_[c].pending != 0)
      return Internal(StrCat("chunk ", c, " still waits for ", chunks_[c].pending,
                             " parameter(s) after backward"));
  ++micro_step_;
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Optimizer.

void Engine::Impl::StartOptimizerLane() {
  opt_thread_ = std::thread([this] {
    std::unique_lock<std::mutex> l(opt_mu_);
    for (;;) {
      opt_cv_.wait(l, [&] { return opt_stop_ || !opt_queue_.empty(); });
      if (opt_queue_.empty()) return;
      int64_t c = opt_queue_.front();
      opt_queue_.pop_front();
      ++opt_busy_;
      bool failed = !opt_error_.ok();
      l.unlock();
      auto t0 = Clock::now();
      Status s = failed ? Status::Ok() : AdamChunk(c, opt_grad_scale_, opt_lr_, opt_step_);
      double dt = Since(t0);
      l.lock();
      opt_s_ += dt;
      if (!s.ok() && opt_error_.ok()) opt_error_ = s;
      --opt_busy_;
      opt_cv_.notify_all();
    }
  });
}

void Engine::Impl::StopOptimizerLane() {
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    opt_stop_ = true;
  }
  opt_cv_.notify_all();
  if (opt_thread_.joinable()) opt_thread_.join();
}

void Engine::Impl::EnqueueOptimizer(int64_t c) {
  // Start reading the chunk's states now; the lane picks it up in order.
  for (StateKind k : {StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq})
    store_->Prefetch({c, k});
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    opt_queue_.push_back(c);
  }
  opt_cv_.notify_all();
}

Status Engine::Impl::DrainOptimizer() {
  std::unique_lock<std::mutex> l(opt_mu_);
  opt_cv_.wait(l, [&] { return opt_queue_.empty() && opt_busy_ == 0; });
  Status s = opt_error_;
  opt_error_ = Status::Ok();
  return s;
}

Status Engine::Impl::AdamChunk(int64_t c, float grad_scale, double lr, int64_t step) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const int64_t n = ci.shard_numel;
  const auto& oc = config_.optimizer;
  BlockKey km{c, StateKind::kMaster32}, ka{c, StateKind::kExpAvg}, kv{c, StateKind::kExpAvgSq},
      kg{c, StateKind::kGrad};
  // A failed acquire (an I/O error reading a state back) releases what was already pinned: the
  // error must leave the tier manager consistent for the caller to report it and shut down.
  void* ptrs[4] = {};
  const std::pair<BlockKey, Access> wants[4] = {
      {km, Access::kReadWrite}, {ka, Access::kReadWrite}, {kv, Access::kReadWrite}, {kg, Access::kRead}};
  for (int i = 0; i < 4; ++i) {
    auto got = store_->Acquire(wants[i].first, wants[i].second);
    if (!got.ok()) {
      for (int j = 0; j < i; ++j) store_->Release(wants[j].first, false).IgnoreError();
      return got.status().WithContext(StrCat("optimizer step of chunk ", c));
    }
    ptrs[i] = *got;
  }
  void* master = ptrs[0];
  void* m = ptrs[1];
  void* v = ptrs[2];
  void* g = ptrs[3];
  // The new working copy goes straight into its home when the CPU can address it.
  const int stage = config_.zero_optimization.stage;
  const size_t esize = optim::DTypeSize(compute_dtype_);
  void* out = nullptr;
  BlockKey kp{c, StateKind::kParam16};
  std::vector<char> staging;
  bool param_block_held = false;
  if (stage == 3) {
    if (param_placement_ != Placement::kDevice || device_->kind() == DeviceKind::kCpu) {
      auto got = store_->Acquire(kp, Access::kWrite);
      if (!got.ok()) {
        for (const auto& w : wants) store_->Release(w.first, false).IgnoreError();
        return got.status().WithContext(StrCat("optimizer step of chunk ", c));
      }
      out = *got;
      param_block_held = true;
    }
  } else if (device_->kind() == DeviceKind::kCpu) {
    out = static_cast<char*>(chunks_[c].full.data_ptr()) +
          partitioner_->ShardOffset(c, shard_rank()) * esize;
  }
  if (!out) {
    staging.resize(n * esize);
    out = staging.data();
  }

  optim::AdamParams ap;
  ap.lr = lr;
  ap.beta1 = oc.beta1;
  ap.beta2 = oc.beta2;
  ap.eps = oc.eps;
  ap.weight_decay = oc.weight_decay;
  ap.adamw = oc.type == OptimizerType::kAdamW;
  ap.bias_correction = oc.bias_correction;
  ap.step = step;
  optim::AdamBuffers bufs;
  bufs.master = static_cast<float*>(master);
  bufs.grad = g;
  bufs.grad_dtype = optim::DType::kFloat32;
  bufs.exp_avg = m;
  bufs.exp_avg_sq = v;
  bufs.state_dtype = state_dtype_;
  bufs.n = static_cast<size_t>(n);
  if (compute_dtype_ != optim::DType::kFloat32) {
    bufs.param16 = out;
    bufs.param16_dtype = compute_dtype_;
  }
  optim::AdamOptions ao;
  ao.arena = arena_.get();
  ao.grad_check = optim::GradCheck::kCallerChecked;
  auto r = optim::AdamStep(ap, bufs, grad_scale, ao);
  if (r.ok() && compute_dtype_ == optim::DType::kFloat32) std::memcpy(out, master, n * 4);

  Status s = r.status();
  for (const BlockKey& k : {km, ka, kv}) {
    Status rs = store_->Release(k, r.ok());
    if (s.ok()) s = rs;
  }
  Status gs = store_->Release(kg, false);
  if (s.ok()) s = gs;
  if (param_block_held) {
    Status ps = store_->Release(kp, r.ok());
    if (s.ok()) s = ps;
  }
  if (!s.ok()) return s.WithContext(StrCat("optimizer step of chunk ", c));
  if (!staging.empty()) return PublishParams(c, staging.data(), compute_dtype_);
  return Status::Ok();
}

// Copies a shard of new working values from host memory to where the device reads it.
Status Engine::Impl::PublishParams(int64_t c, const void* shard_values, optim::DType dtype) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t bytes = ci.shard_numel * optim::DTypeSize(dtype);
  void* dst;
  bool held = false;
  if (config_.zero_optimization.stage == 3) {
    STRATA_ASSIGN_OR_RETURN(dst, store_->Acquire({c, StateKind::kParam16}, Access::kWrite));
    held = true;
  } else {
    dst = static_cast<char*>(chunks_[c].full.data_ptr()) +
          partitioner_->ShardOffset(c, shard_rank()) * optim::DTypeSize(dtype);
  }
  if (held && param_placement_ != Placement::kDevice) {  // a host buffer: no device copy
    std::memcpy(dst, shard_values, bytes);
    return store_->Release({c, StateKind::kParam16}, true);
  }
  // A dedicated stream: this runs on the optimizer lane, concurrently with compute.
  STRATA_ASSIGN_OR_RETURN(auto stream, device_->CreateStream());
  Status s = stream->MemcpyAsync(dst, shard_values, bytes, CopyKind::kHostToDevice);
  if (s.ok()) s = stream->Synchronize();
  if (held) {
    Status r = store_->Release({c, StateKind::kParam16}, true);
    if (s.ok()) s = r;
  }
  return s;
}

StatusOr<StepReport> Engine::Impl::Step() {
  if (micro_step_ == 0 || micro_step_ % config_.gradient_accumulation_steps != 0)
    return FailedPrecondition(StrCat("Step after ", micro_step_ % config_.gradient_accumulation_steps,
                                     " of ", config_.gradient_accumulation_steps,
                                     " micro-steps; run Forward/Backward until the accumulation "
                                     "boundary"));
  StepReport rep;
  rep.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  bool overflow = false;
  if (immediate_optimizer()) {
    STRATA_RETURN_IF_ERROR(DrainOptimizer());
    rep.lr = opt_lr_;
  } else {
    // Global conditions first: the squared norm and the overflow flag over every shard.
    double sum_sq = 0;
    bool nonfinite = false;
    const double inv = scaler_ ? scaler_->inv_scale() : 1.0;
    for (size_t c = 0; c < chunks_.size(); ++c) {
      const int64_t c64 = static_cast<int64_t>(c);
      auto t0 = Clock::now();
      STRATA_ASSIGN_OR_RETURN(void* g, store_->Acquire({c64, StateKind::kGrad}, Access::kRead));
      stall_s_ += Since(t0);
      auto st = optim::UnscaleCheckNorm(g, optim::DType::kFloat32,
                                        partitioner_->chunks()[c].shard_numel,
                                        static_cast<float>(inv));
      STRATA_RETURN_IF_ERROR(store_->Release({c64, StateKind::kGrad}, false));
      STRATA_RETURN_IF_ERROR(st.status());
      nonfinite |= st->found_nonfinite;
      sum_sq += st->sum_sq;
    }
    if (comm_->world_size() > 1 && config_.zero_optimization.stage > 0) {
      LaneTimer t(&comm_s_);
      double flags[2] = {sum_sq, nonfinite ? 1.0 : 0.0};
      STRATA_RETURN_IF_ERROR(comm_->AllReduce(&flags[0], 1, strata::DType::kF64, ReduceOp::kSum));
      STRATA_RETURN_IF_ERROR(comm_->AllReduce(&flags[1], 1, strata::DType::kF64, ReduceOp::kMax));
      sum_sq = flags[0];
      nonfinite = flags[1] > 0;
    }
    overflow = nonfinite;
    double norm = std::sqrt(sum_sq);
    rep.grad_norm = overflow ? 0.0 : norm;
    if (!overflow) {
      double clip = 1.0;
      if (config_.gradient_clipping > 0)
        clip = std::min(1.0, config_.gradient_clipping / (norm + 1e-6));
      opt_grad_scale_ = static_cast<float>(clip * inv);
      opt_step_ = global_step_ + 1;
      opt_lr_ = LearningRate(config_, opt_step_);
      rep.lr = opt_lr_;
      // Backward order is the order the states were last touched; update in it.
      for (int64_t c : ready_order_) EnqueueOptimizer(c);
      STRATA_RETURN_IF_ERROR(DrainOptimizer());
    }
  }
  if (scaler_) STRATA_RETURN_IF_ERROR(scaler_->Update(overflow));
  if (!overflow) {
    ++global_step_;
    // Stages 1-2: every rank updated its shard of the replicated working copy; share them.
    if (config_.zero_optimization.stage > 0 && config_.zero_optimization.stage < 3 &&
        comm_->world_size() > 1) {
      LaneTimer t(&comm_s_);
      const size_t esize = optim::DTypeSize(compute_dtype_);
      for (size_t c = 0; c < chunks_.size(); ++c) {
        const ChunkInfo& ci = partitioner_->chunks()[c];
        char* full = static_cast<char*>(chunks_[c].full.data_ptr());
        STRATA_RETURN_IF_ERROR(comm_->AllGather(
            full + partitioner_->ShardOffset(static_cast<int64_t>(c), shard_rank()) * esize, full,
            ci.shard_numel, CommDtype(compute_dtype_)));
      }
    }
  }
  std::fill(chunk_ready_.begin(), chunk_ready_.end(), false);
  if (!overflow) STRATA_RETURN_IF_ERROR(RefreshChunksAfterStep());  // the working copy changed
  store_->EndIteration();

  rep.step = global_step_;
  rep.skipped = overflow;
  rep.step_time_s = Since(step_start_);
  rep.compute_s = std::max(0.0, compute_s_ - stall_s_ - copy_s_ - comm_s_);
  rep.copy_s = copy_s_;
  rep.comm_s = comm_s_;
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    rep.optimizer_s = opt_s_;
  }
  BlockStoreStats now = store_->stats();
  rep.nvme_s = now.nvme_busy_s - store_at_step_start_.nvme_busy_s;
  rep.stall_s = stall_s_;  // the compute lane's waits; the optimizer lane's are in optimizer_s
  rep.bytes_host_to_device = bytes_h2d_;
  rep.bytes_device_to_host = bytes_d2h_;
  rep.bytes_nvme_to_host = now.bytes_nvme_to_host - store_at_step_start_.bytes_nvme_to_host;
  rep.bytes_host_to_nvme = now.bytes_host_to_nvme - store_at_step_start_.bytes_host_to_nvme;
  rep.peak_device_bytes = device_->peak_allocated();
  rep.peak_host_bytes = now.peak_bytes_host;
  double longest = std::max({rep.compute_s, rep.copy_s, rep.comm_s, rep.nvme_s, rep.optimizer_s});
  rep.overlap_efficiency = rep.step_time_s > 0 ? std::min(1.0, longest / rep.step_time_s) : 0;
  step_open_ = false;
  return rep;
}

StatusOr<std::vector<torch::Tensor>> Engine::Impl::GatherMasterParams() {
  std::vector<torch::Tensor> out;
  out.reserve(params_.size());
  for (auto& p : params_) out.push_back(torch::zeros(p.shape, torch::kFloat32));
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const ChunkInfo& ci = partitioner_->chunks()[c];
    const int64_t c64 = static_cast<int64_t>(c);
    torch::Tensor full = torch::zeros({ci.numel}, torch::kFloat32);
    float* shard = full.data_ptr<float>() + partitioner_->ShardOffset(c64, shard_rank());
    STRATA_ASSIGN_OR_RETURN(void* m, store_->Acquire({c64, StateKind::kMaster32}, Access::kRead));
    std::memcpy(shard, m, ci.shard_numel * 4);
    STRATA_RETURN_IF_ERROR(store_->Release({c64, StateKind::kMaster32}, false));
    if (shard_world() > 1)
      STRATA_RETURN_IF_ERROR(
          comm_->AllGather(shard, full.data_ptr(), ci.shard_numel, strata::DType::kF32));
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
          {"optimizer_overlap", immediate_optimizer() ? "backward" : "deferred"},
          {"model_state_bytes", model_state_bytes()},
          {"host_budget", host_budget_},
          {"tier_manager", store_->StatsJson()},
          {"device", device_->name()}};
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
StatusOr<nlohmann::json> Engine::LoadCheckpoint(const std::string& dir) { return impl_->Load(dir); }


// ---------------------------------------------------------------------------------------------
// Checkpoints (layout and publication rules: runtime/checkpoint.h).

namespace {

constexpr StateKind kSavedKinds[] = {StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq};

StatusOr<StateKind> KindFromName(const std::string& name) {
  for (StateKind k : kSavedKinds)
    if (name == StateKindName(k)) return k;
  return DataLoss(StrCat("unknown state '", name, "' in checkpoint manifest"));
}

Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, StrCat("write ", path));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

}  // namespace

Status Engine::Impl::Save(const std::string& root, const nlohmann::json& extra) {
  namespace fs = std::filesystem;
  if (step_open_)
    return FailedPrecondition("SaveCheckpoint during a step: save after Step() returns");
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return ErrnoToStatus(ec.value(), StrCat("create checkpoint directory ", root));
  const std::string name = checkpoint::StepDirName(global_step_);
  const fs::path final_dir = fs::path(root) / name;
  const fs::path tmp_dir = fs::path(root) / ("." + name + ".tmp");
  const int rank = comm_->rank();
  const std::string stem = checkpoint::RankFileStem(rank);
  if (fs::exists(final_dir / (stem + ".json"), ec)) {
    // This step is already saved (a periodic save followed by the final one).
    if (rank == 0) STRATA_RETURN_IF_ERROR(checkpoint::WriteFileAtomic((fs::path(root) / "latest").string(), name));
    return Status::Ok();
  }
  if (rank == 0) {  // leftovers of saves that crashed
    for (const auto& e : fs::directory_iterator(root, ec)) {
      const std::string n = e.path().filename().string();
      if (n.size() > 5 && n[0] == '.' && n.rfind(".tmp") == n.size() - 4 && e.path() != tmp_dir)
        fs::remove_all(e.path(), ec);
    }
  }
  fs::create_directories(tmp_dir, ec);
  if (ec) return ErrnoToStatus(ec.value(), StrCat("create ", tmp_dir.string()));

  checkpoint::Manifest m;
  m.rank = rank;
  m.world_size = comm_->world_size();
  m.stage = config_.zero_optimization.stage;
  m.dtype = optim::DTypeName(compute_dtype_);
  m.state_dtype = optim::DTypeName(state_dtype_);
  m.parameters = num_params();
  for (const ChunkInfo& ci : partitioner_->chunks()) m.shard_numel.push_back(ci.shard_numel);
  m.global_step = global_step_;
  m.micro_step = micro_step_;
  if (scaler_) m.scaler = {{"scale", scaler_->scale()}};
  m.extra = extra;

  // Stream every block from wherever it lives straight into the file: no state is staged whole.
  const std::string bin = (tmp_dir / (stem + ".bin")).string();
  int fd = ::open(bin.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("create ", bin));
  Status s;
  uint64_t offset = 0;
  for (size_t c = 0; c < chunks_.size() && s.ok(); ++c) {
    for (StateKind kind : kSavedKinds) {
      const int64_t c64 = static_cast<int64_t>(c);
      const uint64_t bytes = partitioner_->chunks()[c].shard_numel *
                             (kind == StateKind::kMaster32 ? 4 : optim::DTypeSize(state_dtype_));
      auto data = store_->Acquire({c64, kind}, Access::kRead);
      if (!data.ok()) {
        s = data.status();
        break;
      }
      s = WriteAll(fd, *data, bytes, bin);
      uint32_t crc = nvme::Crc32c(*data, bytes);
      Status r = store_->Release({c64, kind}, false);
      if (s.ok()) s = r;
      if (!s.ok()) break;
      m.blocks.push_back({c64, StateKindName(kind), offset, bytes, crc});
      offset += bytes;
    }
  }
  // Buffers after the blocks, each from a host copy.
  for (size_t i = 0; i < buffers_.size() && s.ok(); ++i) {
    const auto& [name, b] = buffers_[i];
    torch::Tensor host = b.detach().to(torch::kCPU).contiguous();
    const uint64_t bytes = host.nbytes();
    s = WriteAll(fd, host.data_ptr(), bytes, bin);
    m.buffers.push_back({name, std::string(c10::toString(host.scalar_type())), offset, bytes,
                         nvme::Crc32c(host.data_ptr(), bytes)});
    offset += bytes;
  }
  if (s.ok() && ::fsync(fd) != 0) s = ErrnoToStatus(errno, StrCat("fsync ", bin));
  ::close(fd);
  if (s.ok())
    s = checkpoint::WriteFileAtomic((tmp_dir / (stem + ".json")).string(),
                                    checkpoint::SerializeManifest(m));
  if (!s.ok()) return s.WithContext(StrCat("saving checkpoint ", final_dir.string()));
  if (comm_->world_size() > 1) STRATA_RETURN_IF_ERROR(comm_->Barrier());
  // Test hook: die where a crash hurts most, with every file written but nothing published.
  if (const char* crash = std::getenv("STRATA_TEST_CRASH_BEFORE_PUBLISH"); crash && *crash == '1')
    ::_exit(137);
  if (rank == 0) {
    STRATA_RETURN_IF_ERROR(checkpoint::FsyncDir(tmp_dir.string()));
    fs::rename(tmp_dir, final_dir, ec);
    if (ec) return ErrnoToStatus(ec.value(), StrCat("rename ", tmp_dir.string(), " to ", final_dir.string()));
    STRATA_RETURN_IF_ERROR(checkpoint::FsyncDir(root));
    STRATA_RETURN_IF_ERROR(checkpoint::WriteFileAtomic((fs::path(root) / "latest").string(), name));
  }
  if (comm_->world_size() > 1) STRATA_RETURN_IF_ERROR(comm_->Barrier());
  STRATA_LOG(INFO) << "checkpoint saved dir=" << final_dir.string() << " bytes=" << offset;
  return Status::Ok();
}

StatusOr<nlohmann::json> Engine::Impl::Load(const std::string& path) {
  namespace fs = std::filesystem;
  if (step_open_) return FailedPrecondition("LoadCheckpoint during a step");
  STRATA_ASSIGN_OR_RETURN(std::string dir, checkpoint::ResolveCheckpointDir(path));
  const std::string stem = checkpoint::RankFileStem(comm_->rank());
  const std::string mpath = (fs::path(dir) / (stem + ".json")).string();
  std::error_code ec;
  if (!fs::exists(mpath, ec)) {
    return NotFound(StrCat(dir, " has no ", stem, ".json: it was saved by fewer ranks than this run's ",
                           comm_->world_size(), "; resume with the world size it was saved with"));
  }
  STRATA_ASSIGN_OR_RETURN(std::string text, checkpoint::ReadFile(mpath));
  STRATA_ASSIGN_OR_RETURN(checkpoint::Manifest m, checkpoint::ParseManifest(text, mpath));
  auto mismatch = [&](const std::string& what, const std::string& saved, const std::string& now,
                      const std::string& fix) {
    return InvalidArgument(StrCat(dir, " was saved with ", what, "=", saved, " but this run has ",
                                  what, "=", now, "; ", fix));
  };
  if (m.world_size != comm_->world_size())
    return mismatch("world_size", std::to_string(m.world_size), std::to_string(comm_->world_size()),
                    "resume with the same number of ranks");
  if (m.stage != config_.zero_optimization.stage)
    return mismatch("zero_optimization.stage", std::to_string(m.stage),
                    std::to_string(config_.zero_optimization.stage), "use the config it was saved with");
  if (m.dtype != optim::DTypeName(compute_dtype_) || m.state_dtype != optim::DTypeName(state_dtype_))
    return mismatch("precision", m.dtype + "/" + m.state_dtype,
                    std::string(optim::DTypeName(compute_dtype_)) + "/" + optim::DTypeName(state_dtype_),
                    "use the bf16/fp16 and optimizer_state_dtype settings it was saved with");
  std::vector<int64_t> ours;
  for (const ChunkInfo& ci : partitioner_->chunks()) ours.push_back(ci.shard_numel);
  if (m.parameters != num_params() || m.shard_numel != ours)
    return mismatch("a model of parameters", std::to_string(m.parameters), std::to_string(num_params()),
                    "it belongs to another model (or chunk_size differs): use the same model and "
                    "strata.chunk_size");
  std::map<BlockKey, const checkpoint::BlockEntry*> entries;
  for (const auto& e : m.blocks) {
    STRATA_ASSIGN_OR_RETURN(StateKind k, KindFromName(e.state));
    entries[{e.chunk, k}] = &e;
  }
  const std::string bin = (fs::path(dir) / (stem + ".bin")).string();
  int fd = ::open(bin.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("open ", bin));
  Status s;
  // Buffers first, all read and checked before any state is overwritten: every one the model has
  // must be in the checkpoint, by name, with its size and type.
  std::vector<torch::Tensor> buffer_values;
  for (size_t i = 0; i < buffers_.size() && s.ok(); ++i) {
    const auto& [name, b] = buffers_[i];
    const checkpoint::BufferEntry* e = nullptr;
    for (const auto& be : m.buffers)
      if (be.name == name) e = &be;
    const std::string type(c10::toString(b.scalar_type()));
    if (!e || e->bytes != b.nbytes() || e->dtype != type) {
      s = DataLoss(StrCat(mpath, ": buffer '", name, "' (", type, ", ", b.nbytes(),
                          " bytes) is missing or differs; the checkpoint belongs to another model"));
      break;
    }
    torch::Tensor host = torch::empty(b.sizes(), torch::TensorOptions().dtype(b.scalar_type()));
    ssize_t got = ::pread(fd, host.data_ptr(), e->bytes, static_cast<off_t>(e->offset));
    if (got < 0 || static_cast<uint64_t>(got) != e->bytes) {
      s = DataLoss(StrCat(bin, " is truncated: buffer '", name, "' needs ", e->bytes, " bytes"));
      break;
    }
    if (nvme::Crc32c(host.data_ptr(), e->bytes) != e->crc32c) {
      s = DataLoss(StrCat(bin, ": buffer '", name, "' fails its crc32c check; the checkpoint is "
                          "corrupted: resume from an earlier one"));
      break;
    }
    buffer_values.push_back(host);
  }
  for (size_t c = 0; c < chunks_.size() && s.ok(); ++c) {
    for (StateKind kind : kSavedKinds) {
      const int64_t c64 = static_cast<int64_t>(c);
      auto it = entries.find({c64, kind});
      const uint64_t bytes = partitioner_->chunks()[c].shard_numel *
                             (kind == StateKind::kMaster32 ? 4 : optim::DTypeSize(state_dtype_));
      if (it == entries.end() || it->second->bytes != bytes) {
        s = DataLoss(StrCat(mpath, ": ", BlockName({c64, kind}), " is missing or has the wrong size"));
        break;
      }
      // Read into a scratch buffer first: a damaged file must not overwrite the live state.
      std::vector<char> buf(bytes);
      ssize_t got = ::pread(fd, buf.data(), bytes, static_cast<off_t>(it->second->offset));
      if (got < 0) {
        s = ErrnoToStatus(errno, StrCat("read ", bin));
        break;
      }
      if (static_cast<uint64_t>(got) != bytes) {
        s = DataLoss(StrCat(bin, " is truncated: ", BlockName({c64, kind}), " needs ", bytes,
                            " bytes at offset ", it->second->offset, ", got ", got));
        break;
      }
      if (nvme::Crc32c(buf.data(), bytes) != it->second->crc32c) {
        s = DataLoss(StrCat(bin, ": ", BlockName({c64, kind}),
                            " fails its crc32c check; the checkpoint is corrupted: resume from an "
                            "earlier one"));
        break;
      }
      auto dst = store_->Acquire({c64, kind}, Access::kWrite);
      if (!dst.ok()) {
        s = dst.status();
        break;
      }
      std::memcpy(*dst, buf.data(), bytes);
      s = store_->Release({c64, kind}, true);
    }
  }
  ::close(fd);
  STRATA_RETURN_IF_ERROR(s);
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < buffer_values.size(); ++i) buffers_[i].second.copy_(buffer_values[i]);
  }

  // The working copy is the master rounded to the working precision, exactly what Adam writes.
  const size_t esize = optim::DTypeSize(compute_dtype_);
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const int64_t c64 = static_cast<int64_t>(c);
    const int64_t n = partitioner_->chunks()[c].shard_numel;
    STRATA_ASSIGN_OR_RETURN(void* master, store_->Acquire({c64, StateKind::kMaster32}, Access::kRead));
    std::vector<char> work(n * esize);
    const float* mf = static_cast<const float*>(master);
    if (compute_dtype_ == optim::DType::kFloat32) {
      std::memcpy(work.data(), mf, n * 4);
    } else {
      auto* w16 = reinterpret_cast<uint16_t*>(work.data());
      for (int64_t i = 0; i < n; ++i)
        w16[i] = compute_dtype_ == optim::DType::kBFloat16 ? optim::FloatToBf16(mf[i])
                                                           : optim::FloatToHalf(mf[i]);
    }
    STRATA_RETURN_IF_ERROR(store_->Release({c64, StateKind::kMaster32}, false));
    STRATA_RETURN_IF_ERROR(PublishParams(c64, work.data(), compute_dtype_));
  }
  if (config_.zero_optimization.stage < 3 && shard_world() > 1) {
    for (size_t c = 0; c < chunks_.size(); ++c) {
      const ChunkInfo& ci = partitioner_->chunks()[c];
      char* full = static_cast<char*>(chunks_[c].full.data_ptr());
      STRATA_RETURN_IF_ERROR(comm_->AllGather(
          full + partitioner_->ShardOffset(static_cast<int64_t>(c), shard_rank()) * esize, full,
          ci.shard_numel, CommDtype(compute_dtype_)));
    }
  }
  STRATA_RETURN_IF_ERROR(RefreshChunksAfterStep());
  global_step_ = m.global_step;
  micro_step_ = m.micro_step;
  STRATA_LOG(INFO) << "checkpoint loaded dir=" << dir << " step=" << global_step_;
  return m.extra;
}
int64_t Engine::global_step() const { return impl_->global_step_; }
int64_t Engine::micro_step() const { return impl_->micro_step_; }
int64_t Engine::num_parameters() const { return impl_->num_params(); }
uint64_t Engine::model_state_bytes() const { return impl_->model_state_bytes(); }
nlohmann::json Engine::Describe() const { return impl_->Describe(); }

}  // namespace strata
