#include "runtime/run_unit.h"

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include "runtime/engine.h"

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

void Begin(const UnitRef& ref) { ref.engine->BeginUnit(ref.unit); }
void End(const UnitRef& ref, const std::vector<torch::Tensor>& outputs) {
  ref.engine->EndUnit(ref.unit, outputs);
}

}  // namespace strata::unit_detail
