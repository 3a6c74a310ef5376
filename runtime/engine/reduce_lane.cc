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

void ReduceLane::Start() { thread_ = std::thread([this] { Run(); }); }

void ReduceLane::Stop() { StopLaneThread(mu_, cv_, &stop_, thread_); }

void ReduceLane::Run() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    ReduceJob job = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    const bool failed = !error_.ok();  // later jobs of a failed step are dropped
    l.unlock();
    Status s;
    ReduceOutcome out;
    // LibTorch throws; an exception must become the step's error, not end the process.
    try {
      if (job.all_gather) {
        // Run even when this rank's copy failed: the other ranks are in this collective. (After
        // a failed reduction, skipped below, the ranks' collectives no longer pair up and the
        // step fails on the communicator's timeout.)
        s = all_gather_(job.c, job.step, &out.comm_s);
      } else {
        if (!failed && delay_hook_) delay_hook_(job.c);
        if (!failed) s = reduce_(job, /*on_lane=*/true, &out);
        job.grad_full = torch::Tensor();  // the chunk's gradient buffer returns to the allocator
      }
    } catch (const std::exception& e) {
      s = Internal(StrCat(job.all_gather ? "all-gathering chunk " : "reducing chunk ", job.c,
                          job.all_gather ? " ahead: " : "'s gradient: ", e.what()));
    }
    if (!job.all_gather) Record(job, out);
    l.lock();
    stats_.comm_s += out.comm_s;
    stats_.copy_s += out.copy_s;
    stats_.bytes_d2h += out.bytes_d2h;
    if (job.all_gather) {
      // Its own result, reported when compute reaches the chunk (FinishFill).
      ahead_status_[job.c] = s;
      ahead_done_[job.c] = 1;
      s = Status::Ok();
    } else if (out.update_ready) {
      update_ready_.push_back(job.c);
    }
    if (!s.ok() && error_.ok()) error_ = s;
    busy_ = false;
    cv_.notify_all();
  }
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
    std::unique_lock<std::mutex> l(mu_);
    TimedWait(l, cv_, [&] { return queue_.empty() && !busy_; }, stall_s, trace_,
              "wait for reductions", trace_step);
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
  return Status::Ok();
}

void ReduceLane::QueueAllGather(int64_t c, int64_t step) {
  ReduceJob job;
  job.c = c;
  job.all_gather = true;
  job.step = step;
  {
    std::lock_guard<std::mutex> l(mu_);
    ahead_done_[c] = 0;
    ahead_status_[c] = Status::Ok();
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
}

Status ReduceLane::WaitAllGather(int64_t c, double* stall_s, int64_t trace_step) {
  std::unique_lock<std::mutex> l(mu_);
  TimedWait(l, cv_, [&] { return ahead_done_[c] != 0; }, stall_s, trace_, "all-gather ahead",
            trace_step, c);
  return ahead_status_[c];
}

void ReduceLane::WaitIdle(double* stall_s, int64_t trace_step) {
  std::unique_lock<std::mutex> l(mu_);
  TimedWait(l, cv_, [&] { return queue_.empty() && !busy_; }, stall_s, trace_,
            "wait for reductions", trace_step);
}

void ReduceLane::WaitQuiet() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return queue_.empty() && !busy_; });
}

Status ReduceLane::TakeError() {
  std::lock_guard<std::mutex> l(mu_);
  return std::exchange(error_, Status::Ok());
}

std::vector<int64_t> ReduceLane::TakeUpdateReady() {
  std::lock_guard<std::mutex> l(mu_);
  return std::exchange(update_ready_, {});
}

ReduceLane::Stats ReduceLane::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  return stats_;
}

void ReduceLane::ResetStats() {
  std::lock_guard<std::mutex> l(mu_);
  stats_ = Stats();
}

}  // namespace strata
