// PublishLane: a host optimizer's new values for device-resident parameters, taken to the device
// from pinned staging slots while the optimizer lane goes on with the next chunk
// (Note [pipelined publish] in publish_lane.cc).
//
// Owns: the two staging slots (pinned, sized once by Reserve), their events, the lane's thread,
// its queue of copies in flight and its counters. Borrows: the device (the thread's current
// device, the events) and the stream the copies go on; both must outlive the lane.
//
// Thread rules. AcquireSlot, StartCopy, FreeSlot and Submit are the optimizer lane's: one thread
// calls them. Reserve and Start come before that thread runs, Stop after it stopped. Stats and
// ResetStats are for a caller that knows the lane is idle (every submitted copy done). `done`
// runs on the lane's thread, outside the lane's lock, once per submitted copy, after its event
// completed (or failed) and its slot is free again.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "runtime/base/device.h"
#include "runtime/base/status.h"
#include "runtime/base/thread_annotations.h"
#include "runtime/base/worker_thread.h"
#include "runtime/engine/lane_trace.h"
#include "tiers/host/staging_buffer.h"

namespace strata {

class PublishLane {
 public:
  // One chunk's copy of new values, queued on the stream and not yet known to have landed.
  struct Copy {
    int64_t chunk = -1;
    int slot = 0;
    bool held = false;  // the caller pinned the destination block; `done` releases it
    int64_t step = 0;
    size_t bytes = 0;
  };
  using Done = std::function<void(const Copy& copy, Status status)>;

  PublishLane(Device* device, Stream* stream, LaneTrace* trace, Done done);
  ~PublishLane();  // Stop()
  PublishLane(const PublishLane&) = delete;
  PublishLane& operator=(const PublishLane&) = delete;

  // Sizes both slots to `slot_bytes` (pinned; never grown later: freeing page-locked memory
  // waits for the device) and makes their events.
  Status Reserve(size_t slot_bytes);
  void Start();
  // Finishes the copies already submitted, then joins the thread. Idempotent.
  void Stop();

  // A free slot, waiting for one while both copies are in flight; the wait's seconds are added
  // to *waited and traced on the optimizer track (the waiter's), labelled with `step`.
  int AcquireSlot(int64_t step, double* waited) EXCLUDES(worker_.mu);
  void* SlotData(int slot) { return staging_[slot].data(); }
  // Gives back a slot that no copy was started from (the update failed).
  void FreeSlot(int slot) EXCLUDES(worker_.mu);
  // Queues the copy of `bytes` from `slot` to device memory `dst` and records the slot's event.
  // On failure nothing of it is in flight (the stream was drained) and the slot is free again.
  Status StartCopy(const Copy& copy, void* dst) EXCLUDES(worker_.mu);
  // Hands a started copy to the lane's thread, which waits for it and then calls `done`.
  void Submit(const Copy& copy) EXCLUDES(worker_.mu);

  // COUNT/SUM since ResetStats: seconds the copies took to land, and bytes they moved to a GPU
  // (the CPU device's copies move nothing across a bus).
  double copy_seconds() const EXCLUDES(worker_.mu);
  uint64_t bytes_to_device() const EXCLUDES(worker_.mu);
  void ResetStats() EXCLUDES(worker_.mu);

 private:
  // A submitted copy as the worker carries it: the copy, and how waiting for it went.
  struct InFlight {
    Copy copy;
    Status s;
    LaneTrace::Clock::time_point t0, t1;
  };
  void Work(InFlight& f) EXCLUDES(worker_.mu);
  void Finish(InFlight& f) REQUIRES(worker_.mu);

  Device* device_;
  Stream* stream_;
  LaneTrace* trace_;
  Done done_;
  StagingBuffer staging_[2];
  std::unique_ptr<Event> events_[2];
  int next_slot_ = 0;  // the optimizer lane's own

  bool slot_busy_[2] GUARDED_BY(worker_.mu) = {false, false};
  double copy_s_ GUARDED_BY(worker_.mu) = 0;
  uint64_t bytes_to_device_ GUARDED_BY(worker_.mu) = 0;
  // Last: stopped (its thread joined) before the members its hooks use go. Its queue holds the
  // submitted copies, oldest first.
  mutable WorkerThread<InFlight> worker_;
};

}  // namespace strata
