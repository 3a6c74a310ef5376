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

void OptimizerLane::Start() {
  WorkerThread<Job>::Hooks hooks;
  hooks.take = [this](Job& j) {
    worker_.mu.AssertHeld();
    Take(j);
  };
  hooks.work = [this](Job& j) { Work(j); };
  hooks.finish = [this](Job& j) {
    worker_.mu.AssertHeld();
    Finish(j);
  };
  // The current device is per thread: the GPU Adam's kernels go to the engine's device.
  worker_.Start(std::move(hooks), [this](const std::function<void()>& loop) {
    c10::DeviceGuard on_device(TorchDevice(*device_));
    loop();
  });
}

void OptimizerLane::Stop() { worker_.Stop(); }

void OptimizerLane::Take(Job& j) {
  ++busy_;
  j.failed = !error_.ok();
}

void OptimizerLane::Work(Job& j) {
  if (j.failed) return;
  if (delay_hook_) delay_hook_(j.c);
  LaneTimer t(&j.dt, trace_, Lane::kOptimizer, "adam", inputs_.step, j.c);
  j.s = update_(j.c, inputs_, &j.publish, &j.not_busy_s);
}

void OptimizerLane::Finish(Job& j) {
  // A wait for a staging slot is a wait for the copy lane, not optimizer work.
  busy_s_ += std::max(0.0, j.dt - j.not_busy_s);
  if (!j.s.ok() && error_.ok()) error_ = j.s;
  if (j.publish) {
    // The publish lane finishes the chunk; submitted here, with this update's time already
    // counted, so that an idle lane means its step's figures are complete.
    STRATA_DCHECK(publish_ != nullptr, "chunk ", j.c, ": an update left a copy but no publish lane");
    publish_->Submit(*j.publish);
  } else {
    pending_[j.c] = 0;
    --busy_;
  }
}

void OptimizerLane::SetStepInputs(StepInputs in) {
  MutexLock l(&worker_.mu);
  STRATA_DCHECK(Idle(), "step inputs changed while updates of step ", inputs_.step, " are pending");
  inputs_ = std::move(in);
}

void OptimizerLane::Enqueue(int64_t c) {
  {
    MutexLock l(&worker_.mu);
    pending_[c] = 1;
    Job job;
    job.c = c;
    worker_.queue().push_back(std::move(job));
  }
  worker_.cv.SignalAll();
}

bool OptimizerLane::Pending(int64_t c) const {
  MutexLock l(&worker_.mu);
  return pending_[c] != 0;
}

void OptimizerLane::WaitIdle() {
  MutexLock l(&worker_.mu);
  while (!Idle()) worker_.cv.Wait(&worker_.mu);
}

Status OptimizerLane::Drain() {
  MutexLock l(&worker_.mu);
  while (!Idle()) worker_.cv.Wait(&worker_.mu);
  return std::exchange(error_, Status::Ok());
}

Status OptimizerLane::WaitUpdated(int64_t c, double* waited, int64_t trace_step) {
  MutexLock l(&worker_.mu);
  if (!pending_[c]) return error_;
  Promote(c);
  const LaneClock::time_point t0 = LaneClock::now();
  while (pending_[c]) worker_.cv.Wait(&worker_.mu);
  const LaneClock::time_point t1 = LaneClock::now();
  *waited += std::chrono::duration<double>(t1 - t0).count();
  if (trace_step >= 0) trace_->Add(Lane::kWait, "wait for update", t0, t1, trace_step, c);
  return error_;
}

void OptimizerLane::Promote(int64_t c) {
  auto& q = worker_.queue();
  auto it = std::find_if(q.begin(), q.end(), [c](const Job& j) { return j.c == c; });
  if (it != q.end() && it != q.begin()) {
    Job job = std::move(*it);
    q.erase(it);
    q.push_front(std::move(job));
  }
}

// The block is released (by the engine's `done`) before this: a reader that waits for the update
// then finds the new values in the block (Note [pipelined publish]).
void OptimizerLane::Finished(int64_t c, Status s) {
  {
    MutexLock l(&worker_.mu);
    if (!s.ok() && error_.ok()) error_ = s.WithContext(StrCat("publishing chunk ", c, "'s new values"));
    pending_[c] = 0;
    --busy_;
  }
  worker_.cv.SignalAll();
}

double OptimizerLane::busy_seconds() const {
  MutexLock l(&worker_.mu);
  return busy_s_;
}

void OptimizerLane::ResetStats() {
  MutexLock l(&worker_.mu);
  busy_s_ = 0;
}

}  // namespace strata
