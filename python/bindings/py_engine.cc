#include "python/bindings/py_engine.h"

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>

#include <nlohmann/json.hpp>
#include <torch/csrc/Exceptions.h>

#include "runtime/base/device.h"
#include "runtime/comm/backends.h"
#include "runtime/engine/comm_memory.h"
#include "runtime/engine/compute_dtype.h"
#include "runtime/engine/engine_test_hooks.h"
#include "runtime/state/lr_schedule.h"
#include "tiers/hbm/device_factory.h"

namespace strata::python {
namespace py = pybind11;

void ThrowIfError(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}

namespace {
template <class T>
T ValueOrThrow(StatusOr<T> v) {
  ThrowIfError(v.status());
  return std::move(*v);
}

// Note [the caller's own exception]
// A Python hook or custom Function that raises inside engine.backward() ends autograd with
// LibTorch's python_error, which carries the Python exception. Its text alone would reach the
// caller as a StrataError: a KeyboardInterrupt (Ctrl-C in a hook) would stop being one, and a
// script's own exception type would be lost. So that exception is raised again as itself, as
// plain loss.backward() gives it; the engine has already ended the micro-step's backward as it
// does for any failure there. LibTorch's own refusals (a graph used twice) stay Strata's error.
void RethrowCallersError(std::exception_ptr p) {
  if (!p) return;
  try {
    std::rethrow_exception(p);
  } catch (python_error& e) {
    e.restore();
    throw py::error_already_set();
  } catch (...) {
  }
}

// The process's ranks are joined once, by the first engine, and every later engine of the process
// reuses that communicator (as torch.distributed's default group): a second rendezvous on the same
// MASTER_PORT would race with the first store's teardown. It lives until the process exits and is
// never destroyed, so no engine outlives it and interpreter shutdown does not wait on Gloo.
Communicator* ProcessCommunicator(const CommOptions& co) {
  static std::mutex mu;
  static Communicator* comm = nullptr;
  std::lock_guard<std::mutex> l(mu);
  if (!comm) comm = ValueOrThrow(CreateCommunicator(co)).release();
  ThrowIfError(comm->SetBucketSizes(co.buckets));
  return comm;
}
}  // namespace

namespace {
std::atomic<int64_t> g_fail_start_after{-1};
}  // namespace

void FailNextStartAfterChunks(int64_t chunks) {
  g_fail_start_after.store(chunks < 1 ? -1 : chunks);
}

PyEngine::PyEngine(py::handle model, const std::vector<py::handle>& units,
                   const std::string& config_json, const std::string& source,
                   const AutoHints& hints, const Groups& groups, bool client_optimizer) {
  config_ = ValueOrThrow(Config::FromJsonText(config_json, source));
  CommOptions co;
  co.backend = config_.strata.comm_backend;
  co.device =
      config_.strata.NamesCuda() || (config_.strata.device == "auto" && CudaDeviceCount() > 0)
          ? "cuda"
          : "cpu";
  co.cuda_device = config_.strata.CudaIndex();  // cuda:N: NCCL on that GPU, not LOCAL_RANK's
  co.timeout_s = config_.strata.comm_timeout_s;
  co.buckets = BucketSizes::FromConfig(config_.zero_optimization.allgather_bucket_size,
                                       config_.zero_optimization.reduce_bucket_size);
  {
    py::gil_scoped_release nogil;  // the first rendezvous waits for the other ranks
    comm_ = ProcessCommunicator(co);
  }
  AutoContext ctx;
  ctx.world_size = comm_->world_size();
  ctx.lr = hints.lr;
  ctx.weight_decay = hints.weight_decay;
  ctx.micro_batch = hints.micro_batch;
  ctx.native_bf16 = DeviceHasNativeBf16(co.device == "cuda" ? DeviceKind::kCuda : DeviceKind::kCpu);
  ThrowIfError(config_.ResolveAuto(ctx));
  device_ = ValueOrThrow(CreateDevice(config_.strata.device, config_.strata.device_memory_budget));
  mirror_ = MirrorModule(model);
  EngineOptions eo;
  for (py::handle u : units) {
    auto it = mirror_.by_python.find(u.ptr());
    if (it == mirror_.by_python.end())
      ThrowIfError(InvalidArgument("a unit is not a submodule of the model"));
    eo.units.push_back(it->second);
  }
  for (const auto& [params, h] : groups) {
    if (h.size() != 7)
      ThrowIfError(InvalidArgument("a parameter group needs (lr, beta1, beta2, eps, weight_decay, "
                                   "momentum, dampening)"));
    eo.param_groups.push_back({GroupHyperparameters{h[0], h[1], h[2], h[3], h[4], h[5], h[6]}, params});
  }
  eo.client_optimizer = client_optimizer;
  // fp16 on the cpu device: initialize pushes python/strata/cpu_half.py's mode before the first
  // forward, so every operator on the model's fp16 tensors runs in fp32.
  eo.fp16_ops_in_fp32 = true;
  eo.device_owner = device_;
  if (const int64_t after = g_fail_start_after.exchange(-1); after >= 1) {
    auto hooks = std::make_shared<EngineTestHooks>();
    hooks->initial_chunk_hook = [after, written = std::make_shared<int64_t>(0)](int64_t chunk) {
      if (++*written == after)
        throw std::runtime_error(
            StrCat("injected start fault after ", after, " chunk(s), the last chunk ", chunk));
    };
    eo.test_hooks = std::move(hooks);
  }
  py::gil_scoped_release nogil;  // partitioning writes the shards to their tiers (and rank 0's broadcast)
  engine_ = ValueOrThrow(Engine::Create(mirror_.root, config_, comm_, device_.get(), eo));
}

PyEngine::~PyEngine() { engine_.reset(); }  // no Call can be in flight: each holds this object

// Note [closing during a call]
// engine.close() or destroy() from a hook that autograd runs inside engine.backward(), or from
// another thread while a call has released the GIL, would free the engine under the call's
// frames: a segfault at every stage. Each such call is a Call, counted with the GIL held, and a
// close meets the count first: it is refused with what to do instead. The call itself then
// goes on (a hook's error ends the backward as any error there does).
void PyEngine::CheckClosable() const {
  if (calls_ > 0)
    ThrowIfError(FailedPrecondition(
        "engine.close() or destroy() while a call into the engine runs (from a hook inside "
        "engine.backward() or step(), or from another thread): end the engine after that call "
        "returns"));
}

void PyEngine::BeginClose() {
  CheckClosable();
  closing_ = true;
}

void PyEngine::Close() {
  CheckClosable();
  closing_ = true;
  engine_.reset();
}

PyEngine::Call::Call(PyEngine& owner) : owner_(owner) {
  owner_.engine();  // throws when closed
  if (owner_.closing_) ThrowIfError(FailedPrecondition("the engine is being closed"));
  ++owner_.calls_;
}

Engine& PyEngine::engine() {
  if (!engine_) ThrowIfError(FailedPrecondition("the engine was closed"));
  return *engine_;
}

void PyEngine::BeginUnit(int64_t unit, bool checkpointed) {
  const Call call(*this);
  Engine& e = call.engine();
  py::gil_scoped_release nogil;
  e.BeginUnit(unit, checkpointed);
}

void PyEngine::EndUnit(int64_t unit, const std::vector<torch::Tensor>& outputs) {
  const Call call(*this);
  Engine& e = call.engine();
  py::gil_scoped_release nogil;
  e.EndUnit(unit, outputs);
}

void PyEngine::Backward(const torch::Tensor& loss) {
  const Call call(*this);
  Engine& e = call.engine();
  Status s;
  {
    // Autograd calls back into Python (a checkpointed function's recomputation, Python hooks):
    // those take the GIL themselves.
    py::gil_scoped_release nogil;
    s = e.Backward(loss);
  }
  if (!s.ok()) RethrowCallersError(e.TakeAutogradException());
  ThrowIfError(s);
}

StepReport PyEngine::Step() {
  const Call call(*this);
  Engine& e = call.engine();
  StatusOr<StepReport> r = FailedPrecondition("");
  {
    py::gil_scoped_release nogil;
    r = e.Step();
  }
  return ValueOrThrow(std::move(r));
}

std::pair<bool, PyEngine::ClientPairs> PyEngine::BeginClientStep() {
  const Call call(*this);
  Engine& e = call.engine();
  StatusOr<Engine::ClientStep> r = FailedPrecondition("");
  {
    py::gil_scoped_release nogil;
    r = e.BeginClientStep();
  }
  Engine::ClientStep step = ValueOrThrow(std::move(r));
  return {step.skipped, std::move(step.groups)};
}

StepReport PyEngine::FinishClientStep(bool apply) {
  const Call call(*this);
  Engine& e = call.engine();
  StatusOr<StepReport> r = FailedPrecondition("");
  {
    py::gil_scoped_release nogil;
    r = e.FinishClientStep(apply);
  }
  return ValueOrThrow(std::move(r));
}

std::vector<std::vector<int64_t>> PyEngine::ClientSegments() { return engine().ClientSegments(); }

void PyEngine::SaveCheckpoint(const std::string& dir, const std::string& extra_json,
                              const std::string& client_file, bool with_frozen) {
  const Call call(*this);
  Engine& e = call.engine();
  nlohmann::json extra = nlohmann::json::parse(extra_json);
  py::gil_scoped_release nogil;
  ThrowIfError(e.SaveCheckpoint(dir, extra, client_file, with_frozen));
}

py::bytes PyEngine::ReadClientFile(const std::string& dir) {
  const Call call(*this);
  Engine& e = call.engine();
  StatusOr<std::string> r = FailedPrecondition("");
  {
    py::gil_scoped_release nogil;
    r = e.ReadClientFile(dir);
  }
  return py::bytes(ValueOrThrow(std::move(r)));
}

std::vector<double> PyEngine::AllReduceScalars(std::vector<double> values, const std::string& op) {
  ReduceOp which;
  if (op == "sum")
    which = ReduceOp::kSum;
  else if (op == "max")
    which = ReduceOp::kMax;
  else if (op == "min")
    which = ReduceOp::kMin;
  else
    ThrowIfError(InvalidArgument(StrCat("all_reduce_scalars(op=", op, "): 'sum', 'max' or 'min'")));
  const Call call(*this);
  call.engine();  // a live engine: its communicator and device
  Status s;
  {
    py::gil_scoped_release nogil;
    s = strata::AllReduceScalars(*comm_, *device_, values.data(),
                                 static_cast<int64_t>(values.size()), which);
  }
  ThrowIfError(s);
  return values;
}

std::string PyEngine::LoadCheckpoint(const std::string& dir, const std::string& parts) {
  Engine::LoadParts which;
  if (parts == "all")
    which = Engine::LoadParts::kAll;
  else if (parts == "weights")
    which = Engine::LoadParts::kWeights;
  else if (parts == "weights_and_counters")
    which = Engine::LoadParts::kWeightsAndCounters;
  else
    ThrowIfError(InvalidArgument(
        StrCat("load_checkpoint(parts=", parts, "): 'all', 'weights' or 'weights_and_counters'")));
  const Call call(*this);
  Engine& e = call.engine();
  StatusOr<nlohmann::json> extra = FailedPrecondition("");
  {
    py::gil_scoped_release nogil;
    extra = e.LoadCheckpoint(dir, which);
  }
  return ValueOrThrow(std::move(extra)).dump();
}

int64_t PyEngine::StashActivations(const std::vector<torch::Tensor>& tensors) {
  const Call call(*this);
  Engine& e = call.engine();
  py::gil_scoped_release nogil;
  return ValueOrThrow(e.StashActivations(tensors));
}

std::vector<torch::Tensor> PyEngine::RestoreActivations(int64_t handle) {
  const Call call(*this);
  Engine& e = call.engine();
  py::gil_scoped_release nogil;
  return ValueOrThrow(e.RestoreActivations(handle));
}

std::vector<torch::Tensor> PyEngine::MasterParams() {
  const Call call(*this);
  Engine& e = call.engine();
  py::gil_scoped_release nogil;
  return ValueOrThrow(e.GatherMasterParams());
}

int PyEngine::rank() const { return comm_->rank(); }
int PyEngine::world_size() const { return comm_->world_size(); }
double PyEngine::LearningRateAt(int64_t step) const { return LearningRate(config_, step); }

}  // namespace strata::python
