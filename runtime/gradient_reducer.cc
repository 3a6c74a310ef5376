// Gradient reducer: hooks on gradient accumulation, per-chunk reduction, Backward.
#include "kernels/kernels.h"
#include "runtime/engine_impl.h"

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
  // Stages 0 and 1 keep the chunk's whole gradient on every rank: the next micro-steps add into
  // it, and it is reduced once, at the accumulation boundary (all-reduce). Stages 2 and 3 shard
  // it: each micro-step reduce-scatters and accumulates only this rank's shard.
  const bool full = full_gradients();
  if (full && !last_micro_step()) return Status::Ok();
  float* data = cs.grad_full.data_ptr<float>();
  const int64_t off = partitioner_->ShardOffset(c, shard_rank());
  if (comm_->world_size() > 1) {
    // The gradient was accumulated by compute, which may still be queued on a GPU; the
    // collective runs on its own stream (Note [ordered frees] explains the fences).
    ComputeFence::Mark(*device_).Wait();
    LaneTimer t(&comm_s_, &lane_trace_, Lane::kComm, full ? "all-reduce" : "reduce-scatter",
                trace_step(), c);
    if (full) {
      STRATA_RETURN_IF_ERROR(comm_->AllReduce(data, ci.numel, strata::DType::kF32, ReduceOp::kAvg));
    } else {
      STRATA_RETURN_IF_ERROR(comm_->ReduceScatter(data, data + off, ci.shard_numel,
                                                  strata::DType::kF32, ReduceOp::kAvg));
    }
  }
  torch::Tensor shard = cs.grad_full.narrow(0, off, ci.shard_numel);
  // The whole gradient already holds every micro-step: it replaces the shard's contents.
  const bool first_micro = full || micro_step_ % config_.gradient_accumulation_steps == 0;
  BlockKey key{c, StateKind::kGrad};
  // The previous step's deferred update of this chunk reads the block this overwrites.
  STRATA_RETURN_IF_ERROR(WaitChunkUpdated(c));
  void* dst = nullptr;
  {
    LaneTimer t(&stall_s_, &lane_trace_, Lane::kWait, "gradient block", trace_step(), c);
    STRATA_ASSIGN_OR_RETURN(dst, store_->Acquire(key, first_micro ? Access::kWrite : Access::kReadWrite));
  }
  // A device-placed gradient block is reached at the device's compute address (Note [device
  // blocks]); a host block comes back unchanged.
  dst = device_->ComputeAddress(dst);
  {
    LaneTimer t(&copy_s_, &lane_trace_, Lane::kCopy, "gradient to host", trace_step(), c);
    torch::NoGradGuard ng;
    torch::Tensor host = torch::from_blob(
        dst, {ci.shard_numel},
        optim_placement_ == Placement::kDevice ? DeviceOptions(torch::kFloat32)
                                               : torch::TensorOptions().dtype(torch::kFloat32));
    if (first_micro) host.copy_(shard);
    else host.add_(shard.to(host.device()));
    if (device_->kind() != DeviceKind::kCpu && optim_placement_ != Placement::kDevice)
      bytes_d2h_ += ci.shard_numel * 4;
    // Into device memory the copy is queued compute: the optimizer lane reads the block only
    // after it has run. (A copy to host memory has finished when copy_ returns.)
    if (gpu_optimizer()) ComputeFence::Mark(*device_).Wait();
  }
  cs.grad_full = torch::Tensor();
  if (last_micro_step() && !immediate_optimizer()) {
    // This chunk's part of the step's global norm and overflow check, while the shard is hot
    // (Note [deferred optimizer]).
    const double inv = scaler_ ? scaler_->inv_scale() : 1.0;
    auto st = gpu_optimizer()
                  ? kernels::UnscaleCheckNorm(kernels::Backend::kCuda, dst, optim::DType::kFloat32,
                                              ci.shard_numel, static_cast<float>(inv),
                                              side_stream_->handle())
                  : optim::UnscaleCheckNorm(dst, optim::DType::kFloat32, ci.shard_numel,
                                            static_cast<float>(inv));
    if (!st.ok()) {
      store_->Release(key, true).IgnoreError();
      return st.status().WithContext(StrCat("norm of chunk ", c, "'s gradient"));
    }
    chunk_sum_sq_[c] = st->sum_sq;
    chunk_nonfinite_[c] = st->found_nonfinite ? 1 : 0;
    if (defer_updates()) PrefetchStatesForUpdates();
  }
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
  // The forward (and the loss), however it was driven.
  lane_trace_.Add(Lane::kCompute, "forward", forward_start_, Clock::now(), trace_step());
  compute_s_ += Since(forward_start_);
  waits_in_compute_s_ += WaitsSoFar() - waits_at_forward_start_;
  const double waits_at_backward = WaitsSoFar();
  if (last_micro_step() && immediate_optimizer()) {
    // Updates start during this backward: fix their step-wide inputs now.
    opt_step_ = global_step_ + 1;
    opt_lr_ = LearningRate(config_, opt_step_);
    opt_grad_scale_ = 1.0f;
  }
  if (last_micro_step() && defer_updates()) {
    state_prefetch_order_ = UpdateOrder(trace_);
    state_prefetch_next_ = 0;
    state_prefetch_bytes_ = 0;
  }
  double scale = scaler_ ? scaler_->scale() : 1.0;
  torch::Tensor scaled = loss * (scale / static_cast<double>(config_.gradient_accumulation_steps));
  backward_cursor_ = trace_.size();
  in_backward_ = true;
  Status result;
  try {
    LaneTimer t(&compute_s_, &lane_trace_, Lane::kCompute, "backward", trace_step());
    scaled.backward();
  } catch (const std::exception& e) {
    result = backward_error_.ok() ? Internal(StrCat("backward failed: ", e.what())) : backward_error_;
  }
  in_backward_ = false;
  waits_in_compute_s_ += WaitsSoFar() - waits_at_backward;
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
  last_trace_after_.assign(last_trace_.size(), 0);
  for (size_t k = last_trace_.size(); k-- > 1;)
    last_trace_after_[k - 1] = last_trace_after_[k] + 2 * units_[last_trace_[k]].elems;
  micro_open_ = false;
  STRATA_RETURN_IF_ERROR(result);
  for (size_t c = 0; c < chunks_.size(); ++c)
    if (chunks_[c].pending != 0)
      return Internal(StrCat("chunk ", c, " still waits for ", chunks_[c].pending,
                             " parameter(s) after backward"));
  ++micro_step_;
  return Status::Ok();
}

}  // namespace strata
