// Backward on the engine's side: the hooks that take each parameter's gradient as autograd
// delivers it, a chunk's complete gradient handed to the gradient reducer (gradient_reducer.h),
// and Backward itself.
#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

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
  // An AccumulateGrad node keeps the shape its parameter had when the node was made, and
  // autograd checks every gradient against it: a released stage-3 parameter (0 elements, Note
  // [released parameters]) gets its shape back for that moment, over a storage of its own
  // without memory (LibTorch makes no view beyond a storage's bytes). Nothing reads it.
  std::vector<int64_t> released;
  if (plan_.stage3())
    for (size_t c = 0; c < chunks_.size(); ++c)
      if (!chunks_.installed(static_cast<int64_t>(c))) released.push_back(static_cast<int64_t>(c));
  for (int64_t c : released) {
    for (int64_t pid : partitioner_->chunks()[c].params) {
      torch::Tensor shaped = torch::empty({0}, params_[pid].tensor.options());
      shaped.unsafeGetTensorImpl()->set_sizes_contiguous(params_[pid].shape);
      params_[pid].tensor.set_data(shaped);
    }
  }
  Status s;
  for (size_t pid = 0; pid < params_.size(); ++pid) {
    auto& p = params_[pid];
    p.acc = torch::autograd::impl::grad_accumulator(p.tensor);
    if (!p.acc) {
      s = Internal(StrCat("parameter ", pid, " has no gradient accumulator"));
      break;
    }
    const int64_t id = static_cast<int64_t>(pid);
    p.acc->add_post_hook(std::make_unique<GradArrived>([this, id] { OnParamGrad(id); }));
  }
  for (int64_t c : released) ShowChunkParams(c, /*gathered=*/false);
  return s;
}

void Engine::Impl::OnParamGrad(int64_t pid) {
  if (!step_.in_backward || !step_.backward_error.ok()) return;
  Status s = TakeParamGrad(pid, false);
  if (!s.ok()) {
    step_.backward_error = s;
    Throw(s);
  }
}

StatusOr<torch::Tensor> Engine::Impl::ChunkGradient(int64_t c) {
  const int64_t numel = partitioner_->chunks()[c].numel;
  StatusOr<torch::Tensor> g = DeviceTensor(numel, torch::kFloat32);
  if (!g.ok())
    return g.status().WithContext(
        StrCat("the fp32 gradient of chunk ", c, " (", FormatBytes(4 * numel), ")"));
  g->zero_();
  return g;
}

Status Engine::Impl::TakeParamGrad(int64_t pid, bool settle) {
  ParamInfo& p = params_[pid];
  if (p.grad_in) return Status::Ok();
  const ParamLocation& loc = partitioner_->location(pid);
  ChunkTable::Chunk& cs = chunks_[loc.chunk];
  {
    torch::NoGradGuard ng;
    torch::Tensor g = p.tensor.grad();
    if (g.defined()) {
      if (!cs.grad_full.defined()) {
        STRATA_ASSIGN_OR_RETURN(cs.grad_full, ChunkGradient(loc.chunk));
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
    UnitCoordinator::Unit& unit = units_[u];
    if (--unit.grads_pending == 0 && unit.backward_held) {
      unit.backward_held = false;
      // A chunk an earlier unit still needs in this backward may stay; otherwise the next use
      // is after the optimizer step, which changes the values: only persistent chunks survive.
      if (plan_.stage3())
        for (int64_t c : unit.chunks) materializer_->ReleaseChunk(c, units_.BackwardReuseDistance(c));
    }
  }
  if (--cs.pending == 0) STRATA_RETURN_IF_ERROR(ReduceChunk(loc.chunk));
  return Status::Ok();
}

Status Engine::Impl::DrainReductions() { return reducer_->Drain(&meter_, trace_step()); }

Status Engine::Impl::ReduceChunk(int64_t c) {
  ChunkTable::Chunk& cs = chunks_[c];
  if (!cs.grad_full.defined()) {  // no parameter of the chunk took part: a zero gradient
    STRATA_ASSIGN_OR_RETURN(cs.grad_full, ChunkGradient(c));
  }
  // Stages 0 and 1 keep the chunk's whole gradient on every rank: the next micro-steps add into
  // it, and it is reduced once, at the accumulation boundary (all-reduce). Stages 2 and 3 shard
  // it: each micro-step reduce-scatters and accumulates only this rank's shard.
  const bool full = plan_.full_gradients();
  if (full && !last_micro_step()) return Status::Ok();
  // The whole gradient already holds every micro-step: it replaces the shard's contents.
  torch::Tensor grad = std::move(cs.grad_full);
  cs.grad_full = torch::Tensor();
  return reducer_->Reduce(c, std::move(grad), ComputeFence::Mark(*device_),
                          full || step_.micro_step % config_.gradient_accumulation_steps == 0,
                          last_micro_step(), trace_step(), &meter_);
}

// Note [a forward no unit saw]
// A micro-step opens when the first unit of a training forward begins. A model whose parameters
// all belong to its root, called directly (`model->forward(x)`, F::linear on its own tensors),
// runs no unit: its parameters stay gathered, so its forward needs nothing from the engine, and
// Backward opens the micro-step itself when the loss has a graph. Only the forward's compute time
// goes unmeasured (it ran before the micro-step began).
Status Engine::Impl::Backward(const torch::Tensor& loss) {
  if (step_.boundary_reached)
    return FailedPrecondition(StrCat(
        "Backward after the last micro-step of step ", step_.global_step + 1, " (gradient_accumulation_steps=",
        config_.gradient_accumulation_steps, ") without Step: call step() first, or raise "
        "gradient_accumulation_steps to accumulate more micro-batches into one step"));
  if ((!step_.step_open || !step_.micro_open) && loss.defined() && loss.requires_grad() && !step_.in_backward) {
    STRATA_RETURN_IF_ERROR(CheckStateWhole("a training forward"));
    OpenMicroStep();
  }
  if (!step_.step_open || !step_.micro_open)
    return FailedPrecondition(
        "Backward called without a training forward in this micro-step: the loss has no "
        "graph (computed under torch::NoGradGuard or torch.no_grad, or detached)");
  // Updates that start in this backward take the schedule's betas: a schedule past what the
  // optimizer takes is refused before anything runs, as Step refuses it.
  if (last_micro_step() && plan_.immediate_optimizer() && !groups_.override_hyper)
    STRATA_RETURN_IF_ERROR(CheckScheduledBetas(config_, step_.global_step + 1));
  step_.backward_error = Status::Ok();
  step_.autograd_exception = nullptr;
  // The forward (and the loss), however it was driven.
  meter_.EndForward(trace_step());
  const double waits_at_backward = meter_.WaitsSoFar();
  if (last_micro_step() && plan_.immediate_optimizer()) {
    // Updates start during this backward: fix their step-wide inputs now.
    FixStepInputs(step_.global_step + 1, 1.0f);
  }
  if (last_micro_step() && plan_.defer_updates()) reducer_->BeginStatePrefetch(UpdateOrder(units_.trace()));
  double scale = step_.scaler ? step_.scaler->scale() : 1.0;
  // The scaled loss is fp32 whatever the loss's dtype (as DeepSpeed's loss scaler): an fp16 loss
  // times 2^15 would overflow in the product itself. The gradient reaching an fp16 loss is the
  // scale rounded to fp16, so 2^16 overflows there, and the first steps are skipped, as with
  // DeepSpeed's default initial_scale_power.
  const torch::Tensor wide =
      loss.scalar_type() == torch::kHalf || loss.scalar_type() == torch::kBFloat16 ? loss.to(torch::kFloat) : loss;
  torch::Tensor scaled = wide * (scale / static_cast<double>(config_.gradient_accumulation_steps));
  units_.BeginBackward();
  step_.in_backward = true;
  Status result;
  try {
    LaneTimer t(&meter_.compute_s, &meter_.trace, Lane::kCompute, "backward", trace_step());
    scaled.backward();
  } catch (const std::exception& e) {
    // The engine's hooks record their own failures in backward_error; anything else is
    // autograd's refusal of the caller's graph (a second backward through it, a saved tensor
    // modified in place), which is not an engine fault.
    result = step_.backward_error;
    if (result.ok()) {
      step_.autograd_exception = std::current_exception();
      const std::string what = e.what();
      // A Python exception without arguments (KeyboardInterrupt()) has no text of its own.
      result = FailedPrecondition(StrCat("backward failed in autograd: ",
                                         what.empty() ? "an exception without a message" : what));
    }
  }
  step_.in_backward = false;
  // Whatever leaves this function, the reduce lane is idle first (a throw below included).
  struct DrainOnExit {
    Engine::Impl* impl;
    bool done = false;
    ~DrainOnExit() {
      if (!done) impl->DrainReductions().IgnoreError();
    }
  } drain_on_exit{this};
  meter_.waits_in_compute_s += meter_.WaitsSoFar() - waits_at_backward;
  // Parameters that took no part in this backward: a zero gradient, their units released.
  for (size_t pid = 0; pid < params_.size() && result.ok(); ++pid)
    result = TakeParamGrad(static_cast<int64_t>(pid), /*settle=*/true);
  for (int64_t u = 0; u < units_.size(); ++u) {
    if (units_[u].backward_held) {
      units_[u].backward_held = false;
      ReleaseUnit(u, UnitCoordinator::kNever);
    }
  }
  // Every reduction of this micro-step has finished before Backward returns, failed or not: the
  // lane must not outlive the state it writes (Note [reduce lane]).
  {
    Status r = DrainReductions();
    drain_on_exit.done = true;
    if (result.ok()) result = r;
  }
  units_.EndMicroStep();
  step_.micro_open = false;
  STRATA_RETURN_IF_ERROR(result);
  for (size_t c = 0; c < chunks_.size(); ++c)
    if (chunks_[c].pending != 0)
      return Internal(StrCat("chunk ", c, " still waits for ", chunks_[c].pending,
                             " parameter(s) after backward"));
  ++step_.micro_step;
  step_.boundary_reached = step_.micro_step % config_.gradient_accumulation_steps == 0;
  return Status::Ok();
}

}  // namespace strata
