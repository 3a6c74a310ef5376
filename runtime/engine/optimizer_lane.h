// OptimizerLane: a thread that runs chunk updates in the order they were queued (Note [deferred
// optimizer] in optimizer_lane.cc), with a waiter able to pull one chunk's update to the front.
//
// Owns: the thread, its queue, which chunks have an update pending (queued, running, or its new
// values still on their way to the device through the publish lane), the first error of the
// step's updates, the lane's busy seconds, and the step's inputs every update of that step reads
// (StepInputs). Borrows: the device (the thread's current device), the trace and, when new values
// are staged, the publish lane; all must outlive the lane. What an update does is the engine's
// (`Update`): the lane knows chunks only by index.
//
// Thread rules. The lane's thread runs `Update`. Finished is the publish lane's `done`. Every
// other member is for the engine's threads (compute, the gather and reduce lanes): SetStepInputs
// only while no update is pending (checked), so an update never sees two steps' inputs.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "runtime/base/device.h"
#include "runtime/base/status.h"
#include "runtime/base/thread_annotations.h"
#include "runtime/base/worker_thread.h"
#include "runtime/engine/lane_trace.h"
#include "runtime/engine/publish_lane.h"
#include "runtime/state/param_groups.h"

namespace strata {

class OptimizerLane {
 public:
  // What one step's updates share, fixed before the first of them is queued.
  struct StepInputs {
    int64_t step = 0;        // the optimizer step the updates make (1 for the first)
    // The step the optimizer's bias corrections take: `step` less where its states started
    // (StepState::moments_from).
    int64_t optimizer_step = 0;
    float grad_scale = 1;    // the clip factor times the loss scale's inverse
    double lr = 0;           // group 0's lr, the step report's
    std::vector<GroupHyperparameters> groups;  // each parameter group's, lr included
  };
  // One chunk's update, on the lane's thread. Leaves *publish set when the new values' copy to
  // the device is still in flight (the lane submits it to the publish lane, and the chunk stays
  // pending until Finished). Adds to *not_busy_s the seconds it spent waiting for another lane
  // (a staging slot), which do not count as optimizer work.
  using Update = std::function<Status(int64_t chunk, const StepInputs& in,
                                      std::optional<PublishLane::Copy>* publish,
                                      double* not_busy_s)>;

  // `delay_hook` (tests: EngineOptions::optimizer_delay_hook) runs before each update, untimed.
  OptimizerLane(int64_t num_chunks, Device* device, LaneTrace* trace, PublishLane* publish,
                Update update, std::function<void(int64_t)> delay_hook);
  ~OptimizerLane();  // Stop()
  OptimizerLane(const OptimizerLane&) = delete;
  OptimizerLane& operator=(const OptimizerLane&) = delete;

  void Start();
  // Runs what is queued, then joins the thread. Idempotent.
  void Stop();

  void SetStepInputs(StepInputs in) EXCLUDES(worker_.mu);
  // The current step's inputs. Read by updates, and by the engine between steps.
  const StepInputs& inputs() const { return inputs_; }

  // Queues chunk c's update (the caller has started reading its states).
  void Enqueue(int64_t c) EXCLUDES(worker_.mu);
  bool Pending(int64_t c) const EXCLUDES(worker_.mu);
  // Blocks until chunk c's update (if pending) has finished, moving it to the head of the queue
  // first: someone waits for it, and the order of updates changes no value (each reads only its
  // own chunk's state). Adds the wait to *waited and, when `trace_step` >= 0, traces it on the
  // wait track (compute's). Returns the lane's error, without clearing it.
  Status WaitUpdated(int64_t c, double* waited, int64_t trace_step) EXCLUDES(worker_.mu);
  // Blocks until nothing is queued, running or publishing.
  void WaitIdle() EXCLUDES(worker_.mu);
  // WaitIdle, then returns and clears the first error of the updates since the last Drain.
  Status Drain() EXCLUDES(worker_.mu);

  // The publish lane's `done`: chunk c's new values landed (or failed to with `s`).
  void Finished(int64_t c, Status s) EXCLUDES(worker_.mu);

  // SUM since ResetStats: seconds the lane spent in updates (less their waits for other lanes).
  // Exact once the lane is idle.
  double busy_seconds() const EXCLUDES(worker_.mu);
  void ResetStats() EXCLUDES(worker_.mu);

 private:
  // One queued update as the worker carries it from take to finish.
  struct Job {
    int64_t c = -1;
    bool failed = false;  // the step already failed: its later updates are dropped
    Status s;
    std::optional<PublishLane::Copy> publish;
    double dt = 0, not_busy_s = 0;
  };
  void Take(Job& job) REQUIRES(worker_.mu);
  void Work(Job& job) EXCLUDES(worker_.mu);
  void Finish(Job& job) REQUIRES(worker_.mu);
  void Promote(int64_t c) REQUIRES(worker_.mu);
  bool Idle() REQUIRES(worker_.mu) { return worker_.queue().empty() && busy_ == 0; }

  Device* device_;
  LaneTrace* trace_;
  PublishLane* publish_;  // null: new values are written in place
  Update update_;
  std::function<void(int64_t)> delay_hook_;
  StepInputs inputs_;  // written while idle (SetStepInputs), read by updates

  std::vector<uint8_t> pending_ GUARDED_BY(worker_.mu);  // per chunk: queued, running or publishing
  int busy_ GUARDED_BY(worker_.mu) = 0;                   // updates running or publishing
  Status error_ GUARDED_BY(worker_.mu);
  double busy_s_ GUARDED_BY(worker_.mu) = 0;
  // Last: stopped (its thread joined) before the members its hooks use go.
  mutable WorkerThread<Job> worker_;
};

}  // namespace strata
