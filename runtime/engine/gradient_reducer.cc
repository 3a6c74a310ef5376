// Gradient reducer: hooks on gradient accumulation, per-chunk reduction, Backward.
#include "kernels/kernels.h"
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
  for (size_t pid = 0; pid < params_.size(); ++pid) {
    auto& p = params_[pid];
    p.acc = torch::autograd::impl::grad_accumulator(p.tensor);
    if (!p.acc) return Internal(StrCat("parameter ", pid, " has no gradient accumulator"));
    const int64_t id = static_cast<int64_t>(pid);
    p.acc->add_post_hook(std::make_unique<GradArrived>([this, id] { OnParamGrad(id); }));
  }
  return Status::Ok();
}

void Engine::Impl::OnParamGrad(int64_t pid) {
  if (!step_.in_backward || !step_.backward_error.ok()) return;
  Status s = TakeParamGrad(pid, false);
  if (!s.ok()) {
    step_.backward_error = s;
    Throw(s);
  }
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
    UnitCoordinator::Unit& unit = units_[u];
    if (--unit.grads_pending == 0 && unit.backward_held) {
      unit.backward_held = false;
      // A chunk an earlier unit still needs in this backward may stay; otherwise the next use
      // is after the optimizer step, which changes the values: only persistent chunks survive.
      if (plan_.stage3())
        for (int64_t c : unit.chunks) ReleaseChunk(c, units_.BackwardReuseDistance(c));
    }
  }
  if (--cs.pending == 0) STRATA_RETURN_IF_ERROR(ReduceChunk(loc.chunk));
  return Status::Ok();
}

// Note [reduce lane]
// A chunk's gradient is complete mid-backward, when its last parameter's gradient arrives. What
// follows (the reduce-scatter or all-reduce across ranks, the shard's hand-off into its gradient
// block, which may wait for tier room or for the previous step's update of the chunk, and the
// shard's norm and overflow scan) needs nothing from the compute that continues, so it runs on
// the reduce lane, a thread of its own, while backward goes on with the next units. The compute
// thread gives the lane the chunk's gradient buffer and a fence on the compute that wrote it;
// the lane waits for the fence, so a GPU's queued kernels finish before a collective or a copy
// reads the buffer. Collectives must come in the same order on every rank: the lane runs jobs in
// the order compute completes chunks, and the compute thread drains the lane before it issues a
// collective of its own (a stage-3 all-gather in backward) and when Backward ends, so the
// collectives of a step keep one order. Nothing reads what the lane writes (gradient blocks,
// per-chunk norms, the chunks ready for the optimizer) before the drain at Backward's end.
// On the CPU device with one rank there is nothing to hide: no collective, and the hand-off
// and the scan are CPU work on the cores compute uses (on bench-nvme, 2 cores, the lane made
// the step 3 % slower). There the compute thread runs each job itself, unless a test's
// reduce_delay_hook asks for the lane.
bool Engine::Impl::UseReduceLane() const {
  return comm_->world_size() > 1 || device_->kind() != DeviceKind::kCpu || hooks_.reduce_delay_hook;
}

Status Engine::Impl::ReduceChunk(int64_t c) {
  ChunkTable::Chunk& cs = chunks_[c];
  const ChunkInfo& ci = partitioner_->chunks()[c];
  if (!cs.grad_full.defined()) {  // no parameter of the chunk took part: a zero gradient
    STRATA_ASSIGN_OR_RETURN(cs.grad_full, DeviceTensor(ci.numel, torch::kFloat32));
    cs.grad_full.zero_();
  }
  // Stages 0 and 1 keep the chunk's whole gradient on every rank: the next micro-steps add into
  // it, and it is reduced once, at the accumulation boundary (all-reduce). Stages 2 and 3 shard
  // it: each micro-step reduce-scatters and accumulates only this rank's shard.
  const bool full = plan_.full_gradients();
  if (full && !last_micro_step()) return Status::Ok();
  ReduceJob job;
  job.c = c;
  job.grad_full = std::move(cs.grad_full);
  cs.grad_full = torch::Tensor();
  job.fence = ComputeFence::Mark(*device_);
  // The whole gradient already holds every micro-step: it replaces the shard's contents.
  job.first_micro = full || step_.micro_step % config_.gradient_accumulation_steps == 0;
  job.last_micro = last_micro_step();
  job.step = trace_step();
  ReduceOutcome here;
  Status s = reduce_lane_->Submit(std::move(job), &here, &meter_.stall_s, trace_step());
  // Run here (no lane): its collective and hand-off are the compute thread's waits.
  meter_.comm_s += here.comm_s;
  meter_.copy_s += here.copy_s;
  meter_.bytes_d2h += here.bytes_d2h;
  if (here.update_ready) EnqueueOptimizer(c);
  STRATA_RETURN_IF_ERROR(s);
  EnqueueReducedUpdates();
  return Status::Ok();
}

void Engine::Impl::EnqueueReducedUpdates() {
  for (int64_t c : reduce_lane_->TakeUpdateReady()) EnqueueOptimizer(c);
}

Status Engine::Impl::DrainReductions() {
  reduce_lane_->WaitIdle(&meter_.stall_s, trace_step());
  Status s = reduce_lane_->TakeError();
  EnqueueReducedUpdates();
  return s;
}

Status Engine::Impl::ReduceShard(ReduceJob& job, bool on_lane, ReduceOutcome* out) {
  torch::NoGradGuard ng;  // thread-local: this lane's own
  // So is the current device: on a rank's GPU other than the first, kernels this lane launches
  // and LibTorch's ops must go to the engine's device.
  c10::DeviceGuard on_device(TorchDevice(*device_));
  // On a GPU the lane's LibTorch ops (the hand-off copy) go to the side stream, where the norm
  // scan follows them, not to the default stream, which would serialize with compute.
  std::optional<c10::StreamGuard> on_stream;
  if (on_lane && streams_.side && streams_.side->stream()) on_stream.emplace(*streams_.side->stream());
  const int64_t c = job.c;
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const bool full = plan_.full_gradients();
  // This job's time goes to *out, however it ends; whoever ran it adds it to its counters.
  job.fence.Wait();
  float* data = job.grad_full.data_ptr<float>();
  const int64_t off = partitioner_->ShardOffset(c, plan_.shard_rank());
  if (comm_->world_size() > 1) {
    LaneTimer t(&out->comm_s, &meter_.trace, Lane::kComm, full ? "all-reduce" : "reduce-scatter",
                job.step, c);
    if (full) {
      STRATA_RETURN_IF_ERROR(comm_->AllReduce(data, ci.numel, strata::DType::kF32, ReduceOp::kAvg));
    } else {
      STRATA_RETURN_IF_ERROR(comm_->ReduceScatter(data, data + off, ci.shard_numel,
                                                  strata::DType::kF32, ReduceOp::kAvg));
    }
  }
  torch::Tensor shard = job.grad_full.narrow(0, off, ci.shard_numel);
  BlockKey key{c, StateKind::kGrad};
  void* dst = nullptr;
  {
    LaneTimer t(&out->copy_s, &meter_.trace, Lane::kCopy, "gradient block", job.step, c);
    // The previous step's deferred update of this chunk reads the block this overwrites.
    // On the lane the wait is part of this span; on the compute thread it is compute's stall.
    double update_wait_s = 0;
    STRATA_RETURN_IF_ERROR(WaitChunkUpdated(c, on_lane ? &update_wait_s : nullptr));
    STRATA_ASSIGN_OR_RETURN(dst, store_->Acquire(key, job.first_micro ? Access::kWrite : Access::kReadWrite));
  }
  // A device-placed gradient block is reached at the device's compute address (Note [device
  // blocks]); a host block comes back unchanged.
  dst = device_->ComputeAddress(dst);
  {
    LaneTimer t(&out->copy_s, &meter_.trace, Lane::kCopy, "gradient to host", job.step, c);
    torch::Tensor host = torch::from_blob(
        dst, {ci.shard_numel},
        plan_.optim_placement() == Placement::kDevice ? DeviceOptions(torch::kFloat32)
                                               : torch::TensorOptions().dtype(torch::kFloat32));
    if (job.first_micro) host.copy_(shard);
    else host.add_(shard.to(host.device()));
    if (device_->kind() != DeviceKind::kCpu && plan_.optim_placement() != Placement::kDevice)
      out->bytes_d2h += ci.shard_numel * 4;
    // Into device memory the copy is queued work: the optimizer lane reads the block only after
    // it has run. (A copy to host memory has finished when copy_ returns.)
    if (plan_.gpu_optimizer()) ComputeFence::Mark(*device_).Wait();
  }
  if (job.last_micro) {
    // This chunk's part of the step's global norm and overflow check, while the shard is hot
    // (Note [deferred optimizer]). Updates that start in backward need neither, but the norm is
    // reported (engine.get_global_grad_norm) whatever the mode.
    const double inv = step_.scaler ? step_.scaler->inv_scale() : 1.0;
    auto st = plan_.gpu_optimizer()
                  ? kernels::UnscaleCheckNorm(kernels::Backend::kCuda, dst, optim::DType::kFloat32,
                                              ci.shard_numel, static_cast<float>(inv),
                                              streams_.side->handle())
                  : optim::UnscaleCheckNorm(dst, optim::DType::kFloat32, ci.shard_numel,
                                            static_cast<float>(inv));
    if (!st.ok()) {
      store_->Release(key, true).IgnoreError();
      return st.status().WithContext(StrCat("norm of chunk ", c, "'s gradient"));
    }
    out->scanned = true;
    out->sum_sq = st->sum_sq;
    out->nonfinite = st->found_nonfinite;
    if (plan_.defer_updates()) PrefetchStatesForUpdates();
  }
  STRATA_RETURN_IF_ERROR(store_->Release(key, true));
  // The update is queued by the compute thread (ReduceChunk, EnqueueReducedUpdates):
  // EnqueueOptimizer waits for a copy gathered ahead, which FinishFill may have left in flight.
  out->update_ready = job.last_micro && plan_.immediate_optimizer();
  return Status::Ok();
}

// Note [a forward no unit saw]
// A micro-step opens when the first unit of a training forward begins. A model whose parameters
// all belong to its root, called directly (`model->forward(x)`, F::linear on its own tensors),
// runs no unit: its parameters stay gathered, so its forward needs nothing from the engine, and
// Backward opens the micro-step itself when the loss has a graph. Only the forward's compute time
// goes unmeasured (it ran before the micro-step began).
Status Engine::Impl::Backward(const torch::Tensor& loss) {
  if ((!step_.step_open || !step_.micro_open) && loss.defined() && loss.requires_grad() && !step_.in_backward) {
    if (!parked_.empty()) return CheckStatesResident("a training forward");
    OpenMicroStep();
  }
  if (!step_.step_open || !step_.micro_open)
    return FailedPrecondition(
        "Backward called without a training forward in this micro-step: the loss has no "
        "graph (computed under torch::NoGradGuard or torch.no_grad, or detached)");
  step_.backward_error = Status::Ok();
  // The forward (and the loss), however it was driven.
  meter_.EndForward(trace_step());
  const double waits_at_backward = meter_.WaitsSoFar();
  if (last_micro_step() && plan_.immediate_optimizer()) {
    // Updates start during this backward: fix their step-wide inputs now.
    FixStepInputs(step_.global_step + 1, 1.0f);
  }
  if (last_micro_step() && plan_.defer_updates()) {
    state_prefetch_order_ = UpdateOrder(units_.trace());
    state_prefetch_next_ = 0;
    state_prefetch_bytes_ = 0;
  }
  double scale = step_.scaler ? step_.scaler->scale() : 1.0;
  torch::Tensor scaled = loss * (scale / static_cast<double>(config_.gradient_accumulation_steps));
  units_.BeginBackward();
  step_.in_backward = true;
  Status result;
  try {
    LaneTimer t(&meter_.compute_s, &meter_.trace, Lane::kCompute, "backward", trace_step());
    scaled.backward();
  } catch (const std::exception& e) {
    result = step_.backward_error.ok() ? Internal(StrCat("backward failed: ", e.what())) : step_.backward_error;
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
  return Status::Ok();
}

}  // namespace strata
