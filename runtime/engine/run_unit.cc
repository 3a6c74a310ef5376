#include "runtime/engine/run_unit.h"

#include <atomic>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include <ATen/CPUGeneratorImpl.h>

#include "runtime/engine/engine.h"

namespace strata::unit_detail {
namespace {

std::shared_mutex& Mu() {
  static std::shared_mutex mu;
  return mu;
}
// Module -> the engine managing it as a unit. Engines register at Create and leave when they
// are destroyed; a module can belong to one live engine at a time.
std::unordered_map<const torch::nn::Module*, UnitRef>& Registry() {
  static std::unordered_map<const torch::nn::Module*, UnitRef> r;
  return r;
}

}  // namespace

UnitRef FindUnit(const torch::nn::Module& module) {
  std::shared_lock<std::shared_mutex> l(Mu());
  auto it = Registry().find(&module);
  return it == Registry().end() ? UnitRef{} : it->second;
}

Status Register(const torch::nn::Module* module, Engine* engine, int64_t unit) {
  std::unique_lock<std::shared_mutex> l(Mu());
  auto [it, inserted] = Registry().emplace(module, UnitRef{engine, unit});
  if (!inserted && it->second.engine != engine)
    return FailedPrecondition(StrCat("module ", module->name(),
                                     " is already trained by another live engine; destroy that "
                                     "engine first or build a second model"));
  it->second = UnitRef{engine, unit};
  return Status::Ok();
}

void UnregisterEngine(const Engine* engine) {
  std::unique_lock<std::shared_mutex> l(Mu());
  for (auto it = Registry().begin(); it != Registry().end();) {
    if (it->second.engine == engine) it = Registry().erase(it);
    else ++it;
  }
}

void Begin(const UnitRef& ref, bool checkpointed) { ref.engine->BeginUnit(ref.unit, checkpointed); }
void End(const UnitRef& ref, const std::vector<torch::Tensor>& outputs) {
  ref.engine->EndUnit(ref.unit, outputs);
}

}  // namespace strata::unit_detail

namespace strata {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What one checkpointed run needs again in backward. Held by the autograd node (through the id
// in its saved data) and dropped when its backward has run.
struct CheckpointState {
  std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)> fn;
  unit_detail::UnitRef ref;
  bool to_host = false;
  torch::Tensor rng_state;
  int64_t handle = 0;  // cpu_checkpointing: the inputs, in the engine's activation stash
  std::vector<bool> requires_grad;
};

std::mutex& StatesMu() {
  static std::mutex mu;
  return mu;
}
std::unordered_map<int64_t, std::shared_ptr<CheckpointState>>& States() {
  static std::unordered_map<int64_t, std::shared_ptr<CheckpointState>> m;
  return m;
}

std::shared_ptr<CheckpointState> TakeState(int64_t id, bool erase) {
  std::lock_guard<std::mutex> l(StatesMu());
  auto it = States().find(id);
  if (it == States().end()) return nullptr;
  auto st = it->second;
  if (erase) States().erase(it);
  return st;
}

std::vector<torch::Tensor> RunIn(CheckpointState& st, const std::vector<torch::Tensor>& inputs,
                                 bool checkpointed) {
  unit_detail::UnitScope scope(st.ref, checkpointed);
  std::vector<torch::Tensor> out = st.fn(inputs);
  scope.Done({});  // no output hooks: backward recomputes this run instead
  return out;
}

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, int64_t id) {
    auto st = TakeState(id, false);
    ctx->saved_data["id"] = id;
    st->rng_state = at::detail::getDefaultCPUGenerator().get_state();
    std::vector<torch::Tensor> in(inputs.begin(), inputs.end());
    for (const auto& t : in) st->requires_grad.push_back(t.requires_grad());
    variable_list out;
    {
      torch::NoGradGuard ng;
      out = RunIn(*st, in, /*checkpointed=*/true);
    }
    if (st->to_host) {
      std::vector<torch::Tensor> detached;
      for (const auto& t : in) detached.push_back(t.detach());
      auto handle = st->ref.engine->StashActivations(detached);
      if (!handle.ok()) throw std::runtime_error(handle.status().ToString());
      st->handle = *handle;
    } else {
      ctx->save_for_backward(in);
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t id = ctx->saved_data["id"].toInt();
    auto st = TakeState(id, true);
    TORCH_CHECK(st, "checkpointed unit ", id, " is backpropagated twice (retain_graph is not supported "
                "with CheckpointUnit)");
    std::vector<torch::Tensor> saved;
    if (st->to_host) {
      auto back = st->ref.engine->RestoreActivations(st->handle);
      if (!back.ok()) throw std::runtime_error(back.status().ToString());
      saved = std::move(*back);
    } else {
      saved = ctx->get_saved_variables();
    }
    std::vector<torch::Tensor> detached;
    for (size_t i = 0; i < saved.size(); ++i) {
      torch::Tensor d = saved[i].detach();
      d.requires_grad_(st->requires_grad[i]);
      detached.push_back(d);
    }
    // Replay the forward's random numbers, then give the caller's generator back its state.
    auto gen = at::detail::getDefaultCPUGenerator();
    torch::Tensor now = gen.get_state();
    gen.set_state(st->rng_state);
    std::vector<torch::Tensor> out;
    try {
      torch::AutoGradMode enable(true);
      out = RunIn(*st, detached, /*checkpointed=*/false);
    } catch (...) {
      gen.set_state(now);
      throw;
    }
    gen.set_state(now);
    std::vector<torch::Tensor> outs, gs;
    for (size_t i = 0; i < out.size() && i < grads.size(); ++i) {
      if (!out[i].requires_grad() || !grads[i].defined()) continue;
      outs.push_back(out[i]);
      gs.push_back(grads[i]);
    }
    if (!outs.empty()) torch::autograd::backward(outs, gs);
    variable_list result;
    for (auto& d : detached) result.push_back(d.requires_grad() ? d.grad() : torch::Tensor());
    result.push_back(torch::Tensor());  // the id
    return result;
  }
};

std::atomic<int64_t> next_checkpoint_id{1};

}  // namespace

std::vector<torch::Tensor> CheckpointUnit(
    const torch::nn::Module& unit,
    std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)> fn,
    const std::vector<torch::Tensor>& inputs) {
  auto st = std::make_shared<CheckpointState>();
  st->fn = std::move(fn);
  st->ref = unit_detail::FindUnit(unit);
  if (!torch::GradMode::is_enabled()) return RunIn(*st, inputs, false);
  st->to_host = st->ref.engine && st->ref.engine->cpu_checkpointing();
  const int64_t id = next_checkpoint_id.fetch_add(1);
  {
    std::lock_guard<std::mutex> l(StatesMu());
    States().emplace(id, st);
  }
  try {
    return CheckpointFunction::apply(at::TensorList(inputs), id);
  } catch (...) {
    TakeState(id, true);
    throw;
  }
}

}  // namespace strata
