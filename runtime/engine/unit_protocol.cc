// The unit protocol on the engine's side: a micro-step opened by its first training forward,
// units begun and ended (gathered, traced, released), forward for a Sequential or a model given
// with its forward, and backward reaching a unit (the UnitCoordinator, unit_coordinator.h,
// keeps the units and their order).
#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

void Engine::Impl::OpenMicroStep() {
  if (Status whole = CheckStateWhole("a training forward"); !whole.ok()) Throw(whole);
  if (!step_.step_open) {
    step_.step_open = true;
    // The first step's window opens here; later ones opened when the previous Step returned.
    if (!meter_.window_open()) ResetLanes();
    if (!step_.iteration_open && !plan_.defer_updates()) {
      store_->BeginIteration();
      step_.iteration_open = true;
    }
  }
  step_.micro_open = true;
  meter_.BeginForward();
  units_.BeginMicroStep();
  stash_->BeginMicroStep();
  for (auto& p : params_) {
    p.plain_use = false;
    p.checkpointed_uses = 0;
    p.arrivals = 0;
    p.grad_in = false;
  }
  for (size_t c = 0; c < chunks_.size(); ++c)
    chunks_[c].pending = static_cast<int>(partitioner_->chunks()[c].params.size());
}

void Engine::Impl::BeginUnit(int64_t u, bool checkpointed) {
  if (u < 0 || u >= num_units()) Throw(InvalidArgument(StrCat("no unit ", u)));
  UnitCoordinator::Unit& unit = units_[u];
  if (unit.always_live && unit.forward_depth > 0) {
    // The root entered again from inside its own forward (Engine::Forward's scope, then the
    // model's RunUnit on itself): one scope, the outermost, speaks for it.
    ++unit.forward_depth;
    return;
  }
  if (unit.forward_depth > 0)
    Throw(FailedPrecondition(StrCat("unit '", unit.name, "' runs inside itself; units may nest only "
                                    "when they are different modules")));
  if (step_.in_backward) {
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
  if (training && !step_.micro_open) OpenMicroStep();
  // An evaluation forward or GatheredParameters reads the shards offload_states parked too.
  if (plan_.stage3() && !parked_.empty())
    for (int64_t c : unit.chunks)
      if (!chunks_.installed(c))
        if (Status r = CheckBlockResident({c, StateKind::kParam16}, StateKind::kParam16); !r.ok())
          Throw(r.WithContext(StrCat("gathering unit '", unit.name, "'")));
  Status s = GatherUnit(u);
  if (!s.ok()) Throw(s.WithContext(StrCat("gathering unit '", unit.name, "' for forward")));
  ++unit.forward_depth;
  unit.open_checkpointed = checkpointed;
  if (training) {
    PrefetchUnits(units_.RecordForward(u), +1);
    for (int64_t pid : unit.params) {
      if (checkpointed) ++params_[pid].checkpointed_uses;
      else params_[pid].plain_use = true;
    }
  }
}

void Engine::Impl::EndUnit(int64_t u, const std::vector<torch::Tensor>& outputs) {
  if (u < 0 || u >= num_units() || units_[u].forward_depth == 0)
    Throw(FailedPrecondition(StrCat("EndUnit(", u, ") without its BeginUnit")));
  UnitCoordinator::Unit& unit = units_[u];
  --unit.forward_depth;
  if (step_.in_backward) return;  // a recomputation: released when its gradients are in
  if (unit.always_live && unit.forward_depth > 0) return;  // an inner scope of the root
  const bool checkpointed = unit.open_checkpointed;
  unit.open_checkpointed = false;
  const bool training = torch::GradMode::is_enabled() || checkpointed;
  if (training && !checkpointed && plan_.stage3()) {
    for (const torch::Tensor& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      torch::Tensor t = out;  // register_hook is not const; the hook lands on the shared node
      t.register_hook([this, u, alive = std::weak_ptr<const bool>(alive_)](const torch::Tensor&) {
        if (alive.expired())
          Throw(
              FailedPrecondition("backward of a forward run by an engine that has since ended "
                                 "(closed, destroyed or replaced): its graph reaches parameters "
                                 "the engine no longer holds; run the forward again"));
        OnUnitBackwardReach(u);
      });
    }
  }
  ReleaseUnit(u, training ? units_.ForwardReuseDistance(units_.trace().size() - 1)
                          : UnitCoordinator::kNever);
}

torch::Tensor Engine::Impl::Forward(const torch::Tensor& input) {
  auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(model_.module.get());
  if (!seq && !model_.any)
    Throw(FailedPrecondition(
        "Engine::Forward needs a Sequential or a model given with its forward (AnyModule); call "
        "the model's own forward instead, which runs its units through strata::RunUnit"));
  // A training forward's compute is the micro-step's span up to Backward (StepMeter), not
  // timed here twice. The root is a unit when it holds parameters of its own (none: a null
  // scope), and its scope encloses the children's, as a Python forward hook on the root does.
  unit_detail::UnitScope root(unit_detail::FindUnit(*model_.module), /*checkpointed=*/false);
  torch::Tensor x = input;
  if (!seq) {
    x = model_.any->forward(input);
  } else {
    for (size_t k = 0; k < seq->size(); ++k) {
      // A child holding no trainable parameter is no unit: its scope does nothing.
      unit_detail::UnitScope scope(unit_detail::FindUnit(*seq->ptr(k)), /*checkpointed=*/false);
      x = (seq->begin() + static_cast<std::ptrdiff_t>(k))->forward(x);
      scope.Done({x});
    }
  }
  root.Done({x});
  return x;
}

void Engine::Impl::OnUnitBackwardReach(int64_t u) {
  if (!step_.in_backward)
    Throw(FailedPrecondition("backward reached a unit outside the engine's backward: call "
                             "engine.backward(loss) (Python) or Engine::Backward (C++) instead "
                             "of loss.backward()"));
  if (!step_.backward_error.ok()) return;
  UnitCoordinator::Unit& unit = units_[u];
  if (unit.backward_held || unit.grads_pending == 0) return;
  Status s = GatherUnit(u);
  if (!s.ok()) {
    step_.backward_error = s.WithContext(StrCat("gathering unit '", unit.name, "' for backward"));
    // Autograd cannot be cancelled from a hook without unwinding through it: throw, and
    // Backward turns the exception back into this Status.
    Throw(step_.backward_error);
  }
  unit.backward_held = true;
  // Prefetch the units that ran before this one.
  const int64_t before = units_.ReachedInBackward(u);
  if (before >= 0) PrefetchUnits(static_cast<size_t>(before), -1);
}

}  // namespace strata
