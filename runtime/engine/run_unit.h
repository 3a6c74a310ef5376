// RunUnit: how a model's own forward hands a unit (a submodule the engine manages) to the engine.
//
//   torch::Tensor GptImpl::forward(const torch::Tensor& tokens) {
//     torch::Tensor x = strata::RunUnit(*embed, [&] { return embed->forward(tokens); });
//     for (auto& b : blocks) x = strata::RunUnit(*b, [&] { return b->forward(x, mask); });
//     return strata::RunUnit(*head, [&] { return head->forward(x); });
//   }
//
// When an engine manages `unit` (Engine::Create registered it), RunUnit materializes the unit's
// parameters, runs `fn`, and releases them again, hooking every returned tensor that requires
// grad so that backward gathers the unit before it enters it. `fn` may return a Tensor, a
// std::vector<Tensor> or a std::tuple of Tensors (other members of a tuple are passed through).
// When no engine manages the module, RunUnit is exactly `fn()`: the same model trains with plain
// LibTorch, which is how the equivalence tests build their reference.
//
// Thread-safety: the registry is safe to read from any thread; a given engine is driven by one.
#pragma once

#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include "runtime/base/status.h"

namespace strata {

class Engine;

namespace unit_detail {

struct UnitRef {
  Engine* engine = nullptr;
  int64_t unit = -1;
};
// The engine managing `module` as a unit, if any.
UnitRef FindUnit(const torch::nn::Module& module);
// Fails when another engine already manages the module.
Status Register(const torch::nn::Module* module, Engine* engine, int64_t unit);
void UnregisterEngine(const Engine* engine);
void Begin(const UnitRef& ref, bool checkpointed = false);
void End(const UnitRef& ref, const std::vector<torch::Tensor>& outputs);

// Begins a unit on construction; Done(outputs) ends it, and leaving the scope without Done
// (an exception from the unit's forward) ends it with no outputs, so the gathered parameters are
// released whatever happens. A null ref does nothing.
class UnitScope {
 public:
  UnitScope(const UnitRef& ref, bool checkpointed) : ref_(ref) {
    if (ref_.engine) Begin(ref_, checkpointed);
  }
  void Done(const std::vector<torch::Tensor>& outputs) {
    UnitRef ref = ref_;
    ref_ = {};
    if (ref.engine) End(ref, outputs);
  }
  ~UnitScope() {
    if (!ref_.engine) return;
    try {
      End(ref_, {});
    } catch (...) {  // already unwinding the unit's own error
    }
  }
  UnitScope(const UnitScope&) = delete;
  UnitScope& operator=(const UnitScope&) = delete;

 private:
  UnitRef ref_;
};

inline void Collect(const torch::Tensor& t, std::vector<torch::Tensor>* out) { out->push_back(t); }
inline void Collect(const std::vector<torch::Tensor>& v, std::vector<torch::Tensor>* out) {
  out->insert(out->end(), v.begin(), v.end());
}
template <class T>
void Collect(const T&, std::vector<torch::Tensor>*) {}  // not a tensor: nothing to hook
template <class... Ts>
void Collect(const std::tuple<Ts...>& t, std::vector<torch::Tensor>* out) {
  std::apply([&](const auto&... e) { (Collect(e, out), ...); }, t);
}

}  // namespace unit_detail

template <class Fn>
auto RunUnit(const torch::nn::Module& unit, Fn&& fn) -> decltype(fn()) {
  const unit_detail::UnitRef ref = unit_detail::FindUnit(unit);
  if (!ref.engine) return fn();
  unit_detail::UnitScope scope(ref, /*checkpointed=*/false);
  auto out = fn();
  std::vector<torch::Tensor> outputs;
  unit_detail::Collect(out, &outputs);
  scope.Done(outputs);
  return out;
}

// Activation checkpointing of a unit: runs `fn(inputs)` without keeping its activations and,
// when backward reaches its outputs, runs it again (stage 3: gathering the unit's parameters
// again) and differentiates that. `inputs` are the tensors fn reads that may carry gradient;
// anything else fn captures must not change before backward. The CPU random-number state is
// replayed, so dropout draws the same mask twice. With the engine's
// activation_checkpointing.cpu_checkpointing the saved inputs wait in the engine's activation
// stash (host pool, NVMe behind it; Engine::StashActivations). Without an
// engine it checkpoints all the same (the tests' reference); under torch::NoGradGuard it is a
// plain call. Returns fn's outputs.
std::vector<torch::Tensor> CheckpointUnit(
    const torch::nn::Module& unit,
    std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)> fn,
    const std::vector<torch::Tensor>& inputs);

template <class Holder, class Fn,
          class = std::enable_if_t<!std::is_base_of_v<torch::nn::Module, std::decay_t<Holder>>>>
auto RunUnit(const Holder& holder, Fn&& fn) -> decltype(fn()) {
  return RunUnit(*holder, std::forward<Fn>(fn));
}

}  // namespace strata
