// GradientReducer (gradient_reducer.h): a chunk's complete gradient reduced across ranks, handed
// into its shard's gradient block and scanned for the global norm, on the reduce lane.
#include "runtime/engine/gradient_reducer.h"

#include <c10/core/DeviceGuard.h>
#include <c10/core/StreamGuard.h>

#include "kernels/kernels.h"
#include "optim/cpu_adam.h"
#include "runtime/engine/compute_dtype.h"
#include "runtime/engine/engine.h"

namespace strata {

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
GradientReducer::GradientReducer(Parts parts) : p_(std::move(parts)) {
  const bool threaded = p_.comm->world_size() > 1 || p_.device->kind() != DeviceKind::kCpu ||
                        static_cast<bool>(p_.delay_hook);
  lane_ = std::make_unique<ReduceLane>(
      static_cast<int64_t>(p_.partitioner->chunks().size()), threaded, p_.trace,
      [this](ReduceJob& job, bool on_lane, ReduceOutcome* out) { return ReduceShard(job, on_lane, out); },
      p_.all_gather_ahead, p_.delay_hook);
}

Status GradientReducer::Reduce(int64_t c, torch::Tensor grad_full, ComputeFence fence,
                               bool first_micro, bool last_micro, int64_t step, StepMeter* meter) {
  ReduceJob job;
  job.c = c;
  job.grad_full = std::move(grad_full);
  job.fence = std::move(fence);
  job.first_micro = first_micro;
  job.last_micro = last_micro;
  job.step = step;
  ReduceOutcome here;
  Status s = lane_->Submit(std::move(job), &here, &meter->stall_s, step);
  // Run here (no lane): its collective and hand-off are the compute thread's waits.
  meter->comm_s += here.comm_s;
  meter->copy_s += here.copy_s;
  meter->bytes_d2h += here.bytes_d2h;
  if (here.update_ready) p_.queue_update(c);
  STRATA_RETURN_IF_ERROR(s);
  QueueReadyUpdates();
  return Status::Ok();
}

void GradientReducer::QueueReadyUpdates() {
  for (int64_t c : lane_->TakeUpdateReady()) p_.queue_update(c);
}

Status GradientReducer::Drain(StepMeter* meter, int64_t trace_step) {
  lane_->WaitIdle(&meter->stall_s, trace_step);
  Status s = lane_->TakeError();
  QueueReadyUpdates();
  return s;
}

void GradientReducer::BeginStatePrefetch(std::vector<int64_t> order) {
  prefetch_order_ = std::move(order);
  prefetch_next_ = 0;
  prefetch_bytes_ = 0;
}

// Deferred updates: while the last micro-step's backward runs (the NVMe lane has room then),
// starts reading the optimizer states of the first updates, one chunk per reduced chunk, up to
// half the host budget.
void GradientReducer::PrefetchStates() {
  const StepPlan& plan = *p_.plan;
  if (!plan.placement().AnyOptimIn(Placement::kNvme)) return;
  if (prefetch_next_ < prefetch_order_.size()) {
    const int64_t c = prefetch_order_[prefetch_next_];
    const uint64_t bytes = 3ull * p_.partitioner->chunks()[c].shard_numel * 4;
    if (prefetch_bytes_ + bytes <= plan.host_budget() / 2) {
      ++prefetch_next_;
      prefetch_bytes_ += bytes;
    }
  }
  // A prefetch that found no room without waiting only started a write-back: ask again for the
  // earlier chunks too (a no-op for blocks already read or on their way).
  for (size_t i = 0; i < prefetch_next_; ++i) {
    const int64_t c = prefetch_order_[i];
    if (plan.PlacementOf(c, StateKind::kMaster32) != Placement::kNvme) continue;
    p_.store->Prefetch(plan.MasterKey(c));
    for (StateKind k : {StateKind::kExpAvg, StateKind::kExpAvgSq})
      if (plan.HoldsState(k)) p_.store->Prefetch({c, k});
  }
}

Status GradientReducer::ReduceShard(ReduceJob& job, bool on_lane, ReduceOutcome* out) {
  torch::NoGradGuard ng;  // thread-local: this lane's own
  // So is the current device: on a rank's GPU other than the first, kernels this lane launches
  // and LibTorch's ops must go to the engine's device.
  c10::DeviceGuard on_device(TorchDevice(*p_.device));
  // On a GPU the lane's LibTorch ops (the hand-off copy) go to the side stream, where the norm
  // scan follows them, not to the default stream, which would serialize with compute.
  std::optional<c10::StreamGuard> on_stream;
  if (on_lane && p_.streams->side && p_.streams->side->stream()) on_stream.emplace(*p_.streams->side->stream());
  const int64_t c = job.c;
  const ChunkInfo& ci = p_.partitioner->chunks()[c];
  const bool full = p_.plan->full_gradients();
  // This job's time goes to *out, however it ends; whoever ran it adds it to its counters.
  job.fence.Wait();
  float* data = job.grad_full.data_ptr<float>();
  const int64_t off = p_.partitioner->ShardOffset(c, p_.plan->shard_rank());
  if (p_.comm->world_size() > 1) {
    LaneTimer t(&out->comm_s, p_.trace, Lane::kComm, full ? "all-reduce" : "reduce-scatter",
                job.step, c);
    if (full) {
      STRATA_RETURN_IF_ERROR(p_.comm->AllReduce(data, ci.numel, strata::DType::kF32, ReduceOp::kAvg));
    } else {
      STRATA_RETURN_IF_ERROR(p_.comm->ReduceScatter(data, data + off, ci.shard_numel,
                                                  strata::DType::kF32, ReduceOp::kAvg));
    }
  }
  torch::Tensor shard = job.grad_full.narrow(0, off, ci.shard_numel);
  return HandOff(job, shard, on_lane, out);
}

// The shard into its gradient block (replacing or adding to it) and, on the last micro-step, its
// part of the global norm and overflow check.
Status GradientReducer::HandOff(ReduceJob& job, const torch::Tensor& shard, bool on_lane,
                                ReduceOutcome* out) {
  const int64_t c = job.c;
  const ChunkInfo& ci = p_.partitioner->chunks()[c];
  BlockKey key{c, StateKind::kGrad};
  void* dst = nullptr;
  {
    LaneTimer t(&out->copy_s, p_.trace, Lane::kCopy, "gradient block", job.step, c);
    // The previous step's deferred update of this chunk reads the block this overwrites.
    // On the lane the wait is part of this span; on the compute thread it is compute's stall.
    double update_wait_s = 0;
    STRATA_RETURN_IF_ERROR(p_.wait_updated(c, on_lane ? &update_wait_s : nullptr));
    STRATA_ASSIGN_OR_RETURN(dst, p_.store->Acquire(key, job.first_micro ? Access::kWrite : Access::kReadWrite));
  }
  // A device-placed gradient block is reached at the device's compute address (Note [device
  // blocks]); a host block comes back unchanged.
  dst = p_.device->ComputeAddress(dst);
  {
    LaneTimer t(&out->copy_s, p_.trace, Lane::kCopy, "gradient to host", job.step, c);
    // The block's dtype is the plan's (bf16 under bf16_master_weights_and_grads: the fp32
    // shard rounds to nearest into it, and later micro-steps add to it in bf16).
    const torch::Dtype gdtype = TorchDtype(p_.plan->grad_dtype());
    torch::Tensor host = torch::from_blob(
        dst, {ci.shard_numel},
        p_.plan->DeviceOptimizer(c)
            ? torch::TensorOptions().dtype(gdtype).device(TorchDevice(*p_.device))
            : torch::TensorOptions().dtype(gdtype));
    if (job.first_micro && shard.device() != host.device() && shard.scalar_type() != gdtype) {
      // Round on the device, then copy the narrow values: LibTorch's blocking copy_ across
      // devices with a dtype change stages the fp32 shard in a pageable host temporary and
      // converts it on one CPU thread, which made the copy lane of a 6.45B bf16-gradient run on
      // the H100 24 s a step. The device's cast rounds to nearest even like the host's, so the
      // block's bits are the same; the device temporary is one shard of the narrow dtype.
      host.copy_(shard.to(gdtype));
    } else if (job.first_micro) {
      host.copy_(shard);
    } else {
      host.add_(shard.to(host.device()));
    }
    if (p_.device->kind() != DeviceKind::kCpu && !p_.plan->DeviceOptimizer(c))
      out->bytes_d2h += ci.shard_numel * optim::DTypeSize(p_.plan->grad_dtype());
    // Into device memory the copy is queued work: the optimizer lane reads the block only after
    // it has run. (A copy to host memory has finished when copy_ returns.)
    if (p_.plan->GpuOptimizer(c)) ComputeFence::Mark(*p_.device).Wait();
  }
  if (job.last_micro) {
    // This chunk's part of the step's global norm and overflow check, while the shard is hot
    // (Note [deferred optimizer]). Updates that start in backward need neither, but the norm is
    // reported (engine.get_global_grad_norm) whatever the mode.
    const double inv = *p_.scaler ? (*p_.scaler)->inv_scale() : 1.0;
    auto st = p_.plan->GpuOptimizer(c)
                  ? kernels::UnscaleCheckNorm(kernels::Backend::kCuda, dst, p_.plan->grad_dtype(),
                                              ci.shard_numel, static_cast<float>(inv),
                                              p_.streams->side->handle())
                  : optim::UnscaleCheckNorm(dst, p_.plan->grad_dtype(), ci.shard_numel,
                                            static_cast<float>(inv));
    if (!st.ok()) {
      p_.store->Release(key, true).IgnoreError();
      return st.status().WithContext(StrCat("norm of chunk ", c, "'s gradient"));
    }
    out->scanned = true;
    out->sum_sq = st->sum_sq;
    out->nonfinite = st->found_nonfinite;
    if (p_.plan->defer_updates()) PrefetchStates();
  }
  STRATA_RETURN_IF_ERROR(p_.store->Release(key, true));
  // The update is queued by the compute thread (Reduce, QueueReadyUpdates):
  // EnqueueOptimizer waits for a copy gathered ahead, which FinishFill may have left in flight.
  out->update_ready = job.last_micro && p_.plan->immediate_optimizer();
  return Status::Ok();
}

}  // namespace strata
