// The optimizer lane (optimizer_lane.h): its thread, queue and order. What a chunk's update does
// is chunk_update.cc; Step, which queues a step's updates, is engine_step.cc.
#include "runtime/engine/optimizer_lane.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include <c10/core/DeviceGuard.h>

#include "runtime/base/check.h"
#include "runtime/engine/engine.h"

namespace strata {

// Note [deferred optimizer]
// Without a global condition (gradient clipping, fp16 overflow) a chunk's update starts as soon
// as its gradient is reduced, during backward. With one, no update may start before every
// gradient is in: the reductions compute each chunk's share of the norm and its overflow flag as
// they land, and Step combines them. Under stage 3 Step then queues every update in the order the
// next forward gathers the chunks (UpdateOrder), refills the chunks that stay gathered between
// steps (the root's own, persistent ones: queued first, so that wait is short) and returns. The
// next forward waits only for the chunk it is about to gather (WaitChunkUpdated, which also
// moves that chunk to the head of the queue), so the updates, their NVMe reads and write-backs
// run beside it. Nothing else can see the values in between: a stage-3 parameter outside its
// unit has no storage. The updates take the same inputs (gradient, clip factor, lr, step) as a
// step that waited, so the values are bit-identical. Everything else that reads the states
// finishes the updates first: checkpoints, GatherMasterParams, the next Step, and the reduction
// of a chunk's next gradient. Below stage 3 the parameters are plain views of the working copy
// that a caller may read right after Step, so Step waits for the updates there.
OptimizerLane::OptimizerLane(int64_t num_chunks, Device* device, LaneTrace* trace,
                             PublishLane* publish, Update update,
                             std::function<void(int64_t)> delay_hook)
    : device_(device), trace_(trace), publish_(publish), update_(std::move(update)),
      delay_hook_(std::move(delay_hook)), pending_(static_cast<size_t>(num_chunks), 0) {}

OptimizerLane::~OptimizerLane() { Stop(); }

void OptimizerLane::Start() { thread_ = std::thread([this] { Run(); }); }

void OptimizerLane::Stop() { StopLaneThread(mu_, cv_, &stop_, thread_); }

void OptimizerLane::Run() {
  // The current device is per thread: the GPU Adam's kernels go to the engine's device.
  c10::DeviceGuard on_device(TorchDevice(*device_));
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    const int64_t c = queue_.front();
    queue_.pop_front();
    ++busy_;
    const bool failed = !error_.ok();  // the step's later updates are dropped
    l.unlock();
    double dt = 0, not_busy_s = 0;
    Status s;
    std::optional<PublishLane::Copy> publish;
    if (!failed) {
      if (delay_hook_) delay_hook_(c);
      LaneTimer t(&dt, trace_, Lane::kOptimizer, "adam", inputs_.step, c);
      s = update_(c, inputs_, &publish, &not_busy_s);
    }
    l.lock();
    // A wait for a staging slot is a wait for the copy lane, not optimizer work.
    busy_s_ += std::max(0.0, dt - not_busy_s);
    if (!s.ok() && error_.ok()) error_ = s;
    if (publish) {
      // The publish lane finishes the chunk; submitted here, with this update's time already
      // counted, so that an idle lane means its step's figures are complete.
      STRATA_DCHECK(publish_ != nullptr, "chunk ", c, ": an update left a copy but no publish lane");
      publish_->Submit(*publish);
    } else {
      pending_[c] = 0;
      --busy_;
    }
    cv_.notify_all();
  }
}

void OptimizerLane::SetStepInputs(StepInputs in) {
  std::lock_guard<std::mutex> l(mu_);
  STRATA_DCHECK(queue_.empty() && busy_ == 0,
               "step inputs changed while updates of step ", inputs_.step, " are pending");
  inputs_ = std::move(in);
}

void OptimizerLane::Enqueue(int64_t c) {
  {
    std::lock_guard<std::mutex> l(mu_);
    pending_[c] = 1;
    queue_.push_back(c);
  }
  cv_.notify_all();
}

bool OptimizerLane::Pending(int64_t c) const {
  std::lock_guard<std::mutex> l(mu_);
  return pending_[c] != 0;
}

void OptimizerLane::WaitIdle() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return queue_.empty() && busy_ == 0; });
}

Status OptimizerLane::Drain() {
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return queue_.empty() && busy_ == 0; });
  return std::exchange(error_, Status::Ok());
}

Status OptimizerLane::WaitUpdated(int64_t c, double* waited, int64_t trace_step) {
  std::unique_lock<std::mutex> l(mu_);
  if (!pending_[c]) return error_;
  Promote(c);
  const LaneClock::time_point t0 = LaneClock::now();
  cv_.wait(l, [&] { return !pending_[c]; });
  const LaneClock::time_point t1 = LaneClock::now();
  *waited += std::chrono::duration<double>(t1 - t0).count();
  if (trace_step >= 0) trace_->Add(Lane::kWait, "wait for update", t0, t1, trace_step, c);
  return error_;
}

void OptimizerLane::Promote(int64_t c) {
  auto it = std::find(queue_.begin(), queue_.end(), c);
  if (it != queue_.end() && it != queue_.begin()) {
    queue_.erase(it);
    queue_.push_front(c);
  }
}

// The block is released (by the engine's `done`) before this: a reader that waits for the update
// then finds the new values in the block (Note [pipelined publish]).
void OptimizerLane::Finished(int64_t c, Status s) {
  std::lock_guard<std::mutex> l(mu_);
  if (!s.ok() && error_.ok()) error_ = s.WithContext(StrCat("publishing chunk ", c, "'s new values"));
  pending_[c] = 0;
  --busy_;
  cv_.notify_all();
}

double OptimizerLane::busy_seconds() const {
  std::lock_guard<std::mutex> l(mu_);
  return busy_s_;
}

void OptimizerLane::ResetStats() {
  std::lock_guard<std::mutex> l(mu_);
  busy_s_ = 0;
}

}  // namespace strata
