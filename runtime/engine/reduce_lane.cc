// The reduce lane (reduce_lane.h): its thread, queue and per-chunk results. What a reduction does
// is gradient_reducer.cc's ReduceShard; an all-gather ahead, gather_lane.cc's AllGatherAhead.
#include "runtime/engine/reduce_lane.h"

#include <exception>
#include <utility>

namespace strata {

ReduceLane::ReduceLane(int64_t num_chunks, bool threaded, LaneTrace* trace, Reduce reduce,
                       AllGather all_gather, std::function<void(int64_t)> delay_hook)
    : trace_(trace), threaded_(threaded), reduce_(std::move(reduce)),
      all_gather_(std::move(all_gather)), delay_hook_(std::move(delay_hook)),
      grad_stats_(static_cast<size_t>(num_chunks)),
      ahead_done_(static_cast<size_t>(num_chunks), 1),
      ahead_status_(static_cast<size_t>(num_chunks), Status::Ok()) {}

ReduceLane::~ReduceLane() { Stop(); }

void ReduceLane::Start() {
  WorkerThread<Queued>::Hooks hooks;
  hooks.take = [this](Queued& q) {
    worker_.mu.AssertHeld();
    Take(q);
  };
  hooks.work = [this](Queued& q) { Work(q); };
  hooks.finish = [this](Queued& q) {
    worker_.mu.AssertHeld();
    Finish(q);
  };
  worker_.Start(std::move(hooks));
}

void ReduceLane::Stop() { worker_.Stop(); }

void ReduceLane::Take(Queued& q) {
  busy_ = true;
  q.failed = !error_.ok();
}

void ReduceLane::Work(Queued& q) {
  ReduceJob& job = q.job;
  // LibTorch throws; an exception must become the step's error, not end the process.
  try {
    if (job.all_gather) {
      // Run even when this rank's copy failed: the other ranks are in this collective. (After
      // a failed reduction, skipped below, the ranks' collectives no longer pair up and the
      // step fails on the communicator's timeout.)
      q.s = all_gather_(job.c, job.step, &q.out.comm_s);
    } else {
      if (!q.failed && delay_hook_) delay_hook_(job.c);
      if (!q.failed) q.s = reduce_(job, /*on_lane=*/true, &q.out);
      job.grad_full = torch::Tensor();  // the chunk's gradient buffer returns to the allocator
    }
  } catch (const std::exception& e) {
    q.s = Internal(StrCat(job.all_gather ? "all-gathering chunk " : "reducing chunk ", job.c,
                          job.all_gather ? " ahead: " : "'s gradient: ", e.what()));
  }
  if (!job.all_gather) Record(job, q.out);
}

void ReduceLane::Finish(Queued& q) {
  stats_.comm_s += q.out.comm_s;
  stats_.copy_s += q.out.copy_s;
  stats_.bytes_d2h += q.out.bytes_d2h;
  Status s = std::move(q.s);
  if (q.job.all_gather) {
    // Its own result, reported when compute reaches the chunk (FinishFill).
    ahead_status_[q.job.c] = s;
    ahead_done_[q.job.c] = 1;
    s = Status::Ok();
  } else if (q.out.update_ready) {
    update_ready_.push_back(q.job.c);
  }
  if (!s.ok() && error_.ok()) error_ = s;
  busy_ = false;
}

void ReduceLane::Record(const ReduceJob& job, const ReduceOutcome& out) {
  if (out.scanned) grad_stats_[job.c] = {out.sum_sq, out.nonfinite};
}

Status ReduceLane::Submit(ReduceJob job, ReduceOutcome* here, double* stall_s,
                          int64_t trace_step) {
  if (!threaded_) {
    Status s = reduce_(job, /*on_lane=*/false, here);
    Record(job, *here);
    return s;
  }
  {
    MutexLock l(&worker_.mu);
    if (!Idle()) {
      LaneTimer t(stall_s, trace_, Lane::kWait, "wait for reductions", trace_step);
      while (!Idle()) worker_.cv.Wait(&worker_.mu);
    }
    Queued q;
    q.job = std::move(job);
    worker_.queue().push_back(std::move(q));
  }
  worker_.cv.SignalAll();
  return Status::Ok();
}

void ReduceLane::QueueAllGather(int64_t c, int64_t step) {
  ReduceJob job;
  job.c = c;
  job.all_gather = true;
  job.step = step;
  {
    MutexLock l(&worker_.mu);
    ahead_done_[c] = 0;
    ahead_status_[c] = Status::Ok();
    Queued q;
    q.job = std::move(job);
    worker_.queue().push_back(std::move(q));
  }
  worker_.cv.SignalAll();
}

Status ReduceLane::WaitAllGather(int64_t c, double* stall_s, int64_t trace_step) {
  MutexLock l(&worker_.mu);
  if (!ahead_done_[c]) {
    LaneTimer t(stall_s, trace_, Lane::kWait, "all-gather ahead", trace_step, c);
    while (!ahead_done_[c]) worker_.cv.Wait(&worker_.mu);
  }
  return ahead_status_[c];
}

void ReduceLane::WaitIdle(double* stall_s, int64_t trace_step) {
  MutexLock l(&worker_.mu);
  if (Idle()) return;
  LaneTimer t(stall_s, trace_, Lane::kWait, "wait for reductions", trace_step);
  while (!Idle()) worker_.cv.Wait(&worker_.mu);
}

void ReduceLane::WaitQuiet() {
  MutexLock l(&worker_.mu);
  while (!Idle()) worker_.cv.Wait(&worker_.mu);
}

Status ReduceLane::TakeError() {
  MutexLock l(&worker_.mu);
  return std::exchange(error_, Status::Ok());
}

std::vector<int64_t> ReduceLane::TakeUpdateReady() {
  MutexLock l(&worker_.mu);
  return std::exchange(update_ready_, {});
}

ReduceLane::Stats ReduceLane::stats() const {
  MutexLock l(&worker_.mu);
  return stats_;
}

void ReduceLane::ResetStats() {
  MutexLock l(&worker_.mu);
  stats_ = Stats();
}

}  // namespace strata
