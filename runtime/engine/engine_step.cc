// Step: the accumulation boundary. The global norm and overflow check, the step's updates queued
// on the optimizer lane in the order the next forward needs them, the working copy refreshed,
// and the step's report from every lane's counters.
#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

void Engine::Impl::EnqueueOptimizer(int64_t c) {
  materializer_->WaitFillLanded(c);  // a copy gathered ahead still reads the block the update writes
  // Start reading the chunk's states now; the lane picks it up in order.
  store_->Prefetch(plan_.MasterKey(c));
  for (StateKind k : {StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    if (plan_.HoldsState(k)) store_->Prefetch({c, k});
  }
  opt_lane_->Enqueue(c);
}

Status Engine::Impl::WaitChunkUpdated(int64_t c, double* waited) {
  if (waited != nullptr) return opt_lane_->WaitUpdated(c, waited, trace_step());
  double stalled = 0;
  Status s = opt_lane_->WaitUpdated(c, &stalled, trace_step());
  meter_.stall_s += stalled;
  meter_.update_wait_s += stalled;
  return s;
}

std::vector<int64_t> Engine::Impl::UpdateOrder(const std::vector<int64_t>& trace) const {
  return units_.ChunkOrder(trace, static_cast<int64_t>(chunks_.size()),
                           [&](int64_t c) { return plan_.stage3() && chunks_.persistent(c); });
}

// Stages 1-2: every rank updated its shard of the replicated working copy; share them.
Status Engine::Impl::ShareUpdatedShards() {
  if (plan_.stage3() || plan_.shard_world() < 2) return Status::Ok();
  const size_t esize = optim::DTypeSize(plan_.compute_dtype());
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const ChunkInfo& ci = partitioner_->chunks()[c];
    char* full = static_cast<char*>(chunks_[c].full.data_ptr());
    STRATA_RETURN_IF_ERROR(comm_->AllGather(
        full + partitioner_->ShardOffset(static_cast<int64_t>(c), plan_.shard_rank()) * esize, full,
        ci.shard_numel, CommDtype(plan_.compute_dtype())));
  }
  return Status::Ok();
}

void Engine::Impl::ResetLanes() {
  meter_.OpenWindow(store_->stats());
  stash_->TakeBytesStashed();  // the window starts from zero
  if (GatherLane* g = materializer_->gather_lane()) g->ResetStats();
  reducer_->ResetStats();
  opt_lane_->ResetStats();
  if (PublishLane* p = updater_->publish_lane()) p->ResetStats();
}

void Engine::Impl::FixStepInputs(int64_t step, float grad_scale) {
  OptimizerLane::StepInputs in;
  in.step = step;
  in.optimizer_step = step - step_.moments_from;
  in.grad_scale = grad_scale;
  if (groups_.override_hyper) {
    in.groups = *groups_.override_hyper;
    in.lr = in.groups.front().lr;  // the step report's lr: group 0's
  } else {
    // Each group's own lr, or the schedule's (WarmupCosineLR: its ratio of each group's own).
    const auto betas = ScheduledBetas(config_, step);  // OneCycle's cycled momentum
    in.groups = groups_.hyper;
    for (GroupHyperparameters& g : in.groups) {
      g.lr = GroupLearningRate(config_, step, g.lr);
      if (betas) std::tie(g.beta1, g.beta2) = *betas;
    }
    in.lr = in.groups.front().lr;  // the step report's lr: group 0's
  }
  opt_lane_->SetStepInputs(std::move(in));
}

// A forward with autograd on opens the step, whether or not a backward follows: an evaluation
// forward outside torch.no_grad() is the usual way to open one by surprise, and the message
// says so.
Status Engine::Impl::CheckBetweenSteps(const char* what) const {
  if (!step_.step_open) return Status::Ok();
  return FailedPrecondition(
      StrCat(what,
             " during a step: a training forward (autograd on) ran since the last "
             "Step(); finish it with backward and Step() first, and run forwards "
             "that only evaluate under torch.no_grad(), which opens no step"));
}

// Note [saving after forwards alone]
// A checkpoint holds the state the last Step left (masters, moments, working copy, counters),
// never gradients. Forwards change none of it: their only traces are gathered copies and
// deferred updates still queued, which the save waits for as it does between steps. So a save
// after an evaluation forward outside torch.no_grad() is taken, as DeepSpeed takes it, and the
// forward's graph stays usable for a backward afterwards. Once a backward has run, the step's
// gradients would be lost from the checkpoint: refused.
Status Engine::Impl::CheckNoBackwardSinceStep(const char* what) const {
  if (!step_.step_open) return Status::Ok();
  const int64_t done = step_.micro_step % config_.gradient_accumulation_steps;
  if (step_.in_backward)
    return FailedPrecondition(StrCat(what, " from inside backward: call it after Step() returns"));
  if (done == 0 && !step_.boundary_reached) return Status::Ok();
  return FailedPrecondition(StrCat(
      what, " during a step: backward ran since the last Step() (",
      step_.boundary_reached ? config_.gradient_accumulation_steps : done, " of ",
      config_.gradient_accumulation_steps,
      " micro-steps), and a checkpoint holds no gradients; finish the step with Step() first"));
}

Status Engine::Impl::CheckStepBoundary() const {
  STRATA_RETURN_IF_ERROR(CheckStateWhole("Step"));
  if (step_.micro_step == 0 || step_.micro_step % config_.gradient_accumulation_steps != 0)
    return FailedPrecondition(StrCat("Step after ", step_.micro_step % config_.gradient_accumulation_steps,
                                     " of ", config_.gradient_accumulation_steps,
                                     " micro-steps; run Forward/Backward until the accumulation "
                                     "boundary"));
  return Status::Ok();
}

// The squared norm and the overflow flag over every shard, from the per-chunk parts the
// reductions computed, summed in chunk order (then across ranks).
Status Engine::Impl::GlobalGradStats(double* norm, bool* nonfinite) {
  double sum_sq = 0;
  *nonfinite = false;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const ReduceLane::GradStats g = reducer_->grad_stats(static_cast<int64_t>(c));
    *nonfinite |= g.nonfinite;
    sum_sq += g.sum_sq;
  }
  if (comm_->world_size() > 1 && config_.zero_optimization.stage > 0) {
    LaneTimer t(&meter_.comm_s, &meter_.trace, Lane::kComm, "norm all-reduce", trace_step());
    // One sum for both: the ranks' flags add up to more than 0 when any of them is set.
    double v[2] = {sum_sq, *nonfinite ? 1.0 : 0.0};
    STRATA_RETURN_IF_ERROR(AllReduceScalars(*comm_, *device_, v, 2, ReduceOp::kSum));
    sum_sq = v[0];
    *nonfinite = v[1] > 0;
  }
  *norm = std::sqrt(sum_sq);
  return Status::Ok();
}

float Engine::Impl::GradScale(double norm) const {
  double clip = 1.0;
  if (config_.gradient_clipping > 0) clip = std::min(1.0, config_.gradient_clipping / (norm + 1e-6));
  const double inv = step_.scaler ? step_.scaler->inv_scale() : 1.0;
  return static_cast<float>(clip * inv);
}

StatusOr<StepReport> Engine::Impl::Step() {
  if (plan_.client_optimizer())
    return FailedPrecondition("Step: the engine was made for a client optimizer "
                              "(EngineOptions::client_optimizer); step with BeginClientStep, the "
                              "optimizer's update, then FinishClientStep");
  STRATA_RETURN_IF_ERROR(CheckStepBoundary());
  if (!groups_.override_hyper)
    STRATA_RETURN_IF_ERROR(CheckScheduledBetas(config_, step_.global_step + 1));
  StepReport rep;
  rep.loss_scale = step_.scaler ? step_.scaler->scale() : 1.0;
  bool overflow = false;
  // The previous step's updates (deferred ones, or those that started in backward) have all
  // been waited for by now (this step's forward and reductions needed them); a failure among
  // them surfaces here. Copies gathered ahead land before any update may write their blocks.
  STRATA_RETURN_IF_ERROR(FinishUpdates());
  // Global conditions first.
  double norm = 0;
  bool nonfinite = false;
  STRATA_RETURN_IF_ERROR(GlobalGradStats(&norm, &nonfinite));
  if (plan_.immediate_optimizer()) {
    rep.lr = opt_lane_->inputs().lr;
    // Reported only: nothing waits on it. Non-finite gradients (the updates already took them,
    // as a plain optimizer does) make the norm NaN, as torch's clip_grad_norm_ reports it.
    rep.grad_norm = nonfinite ? std::numeric_limits<double>::quiet_NaN() : norm;
  } else {
    overflow = nonfinite;
    rep.grad_norm = overflow ? 0.0 : norm;
    if (!overflow) {
      FixStepInputs(step_.global_step + 1, GradScale(norm));
      rep.lr = opt_lane_->inputs().lr;
      if (plan_.defer_updates()) {
        // The next iteration starts with these updates (see step_.iteration_open).
        if (step_.iteration_open) store_->EndIteration();
        store_->BeginIteration();
        step_.iteration_open = true;
      }
      for (int64_t c : UpdateOrder(units_.last_trace())) EnqueueOptimizer(c);
      if (!plan_.defer_updates()) STRATA_RETURN_IF_ERROR(DrainOptimizer());
    }
  }
  return CompleteStep(rep, overflow);
}

StatusOr<StepReport> Engine::Impl::CompleteStep(StepReport rep, bool overflow) {
  // An overflow at min_loss_scale is an error (DeepSpeed ends the run there), but the step is
  // still closed as the skipped step it is, so the engine stays usable: a script that catches it
  // may load a checkpoint (which an open step would refuse) or try the next step.
  const Status at_min_scale = step_.scaler ? step_.scaler->Update(overflow) : Status::Ok();
  if (!overflow) {
    ++step_.global_step;
    if (!plan_.stage3() && plan_.shard_world() > 1) {
      LaneTimer t(&meter_.comm_s, &meter_.trace, Lane::kComm, "share updated shards", step_.global_step);
      STRATA_RETURN_IF_ERROR(ShareUpdatedShards());
    }
  }
  if (!overflow) STRATA_RETURN_IF_ERROR(materializer_->RefreshChunks());  // the working copy changed
  if (step_.iteration_open && !(plan_.defer_updates() && !overflow)) {
    store_->EndIteration();
    step_.iteration_open = false;
  }

  rep.step = step_.global_step;
  rep.skipped = overflow;
  if (GatherLane* lane = materializer_->gather_lane()) {
    const GatherLane::Stats g = lane->stats();
    rep.copy_s += g.copy_s;
    meter_.bytes_h2d += g.bytes_h2d;
  }
  {
    const ReduceLane::Stats r = reducer_->stats();  // idle: Backward drained it
    rep.comm_s += r.comm_s;
    rep.copy_s += r.copy_s;
    meter_.bytes_d2h += r.bytes_d2h;
  }
  // Deferred updates may still run: what they did so far counts in this window.
  rep.optimizer_s = opt_lane_->busy_seconds();
  if (PublishLane* p = updater_->publish_lane()) {  // every copy waited for above has landed
    rep.copy_s += p->copy_seconds();
    meter_.bytes_h2d += p->bytes_to_device();
  }
  meter_.Fill(&rep, store_->stats());
  rep.peak_device_bytes = device_->peak_allocated();
  rep.bytes_activations_stashed = stash_->TakeBytesStashed();
  rep.FillOverlap();
  chunks_.CheckInvariants();
  step_.step_open = false;
  step_.boundary_reached = false;
  ResetLanes();  // the next window starts now: deferred updates run in it
  if (!at_min_scale.ok()) return at_min_scale;
  return rep;
}

}  // namespace strata
