// GatherLane: stage 3's shards read from their tier and copied into their chunks ahead of use, on
// a thread and a stream of their own (Note [prefetched gathers] in gather_lane.cc).
//
// Owns: the thread, its queue, its stream, one event per chunk (recorded after the chunk's copy),
// each queued chunk's progress (enqueued: the copy is on the stream or failed; taken: compute went
// on without waiting for it to land; landed: done, the block released) and status, a release that
// failed after compute took the copy, and the lane's counters. Borrows: the block store and the
// trace. Where a shard goes is the engine's (`Target`), asked on the lane's thread after
// `before_read`, which may block (several ranks: until the chunk's pending update is done).
//
// Thread rules. The lane's thread runs the copies; every other member is the compute thread's,
// except WaitLanded, WaitAllLanded and status (any thread: the reduce lane waits for a copy to land
// before the chunk's all-gather).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "runtime/base/device.h"
#include "runtime/base/status.h"
#include "runtime/base/thread_annotations.h"
#include "runtime/base/worker_thread.h"
#include "runtime/engine/lane_trace.h"
#include "runtime/state/block_store.h"

namespace strata {

class GatherLane {
 public:
  // Where chunk c's shard of working values (its param16 block) is copied to.
  struct ShardCopy {
    void* dst = nullptr;
    size_t bytes = 0;
    CopyKind kind = CopyKind::kHostToDevice;
  };
  using Target = std::function<ShardCopy(int64_t c)>;

  // The stream and one event per chunk, made on `device`.
  static StatusOr<std::unique_ptr<GatherLane>> Create(Device* device, int64_t num_chunks,
                                                     BlockStore* store, LaneTrace* trace,
                                                     Target target,
                                                     std::function<void(int64_t)> before_read);
  ~GatherLane();  // Stop()
  GatherLane(const GatherLane&) = delete;
  GatherLane& operator=(const GatherLane&) = delete;

  void Start();
  // Runs what is queued, then joins the thread. Idempotent.
  void Stop();

  // Queues chunk c's copy; its memory is installed and no copy of it is in flight.
  void Enqueue(int64_t c) EXCLUDES(worker_.mu);
  // Waits until chunk c's copy is enqueued on the stream (or failed), counting the wait in
  // *stall_s, and returns its status. With `take` and success, the caller goes on without
  // waiting for the copy to land: it orders its own reads after event(c).
  Status WaitEnqueued(int64_t c, bool take, double* stall_s, int64_t trace_step)
      EXCLUDES(worker_.mu);
  // Recorded after chunk c's copy; valid once WaitEnqueued returned success.
  Event& event(int64_t c) { return *events_[c]; }
  // Waits until the lane is done with chunk c: the copy landed and the block is released (it
  // still writes the chunk's memory and reads the block until then). At once when nothing of c
  // is in flight.
  void WaitLanded(int64_t c) EXCLUDES(worker_.mu);
  void WaitAllLanded() EXCLUDES(worker_.mu);
  // Chunk c's copy's status (a failed release included when compute had not taken the copy).
  Status status(int64_t c) const EXCLUDES(worker_.mu);
  // Returns and clears a block release that failed after compute had taken the copy.
  Status TakeError() EXCLUDES(worker_.mu);

  struct Stats {
    double copy_s = 0, read_s = 0;  // seconds copying, and reading shards from their tier
    uint64_t bytes_h2d = 0;         // bytes copied from host memory to the device
  };
  // SUM since ResetStats. Exact once WaitAllLanded returned.
  Stats stats() const EXCLUDES(worker_.mu);
  void ResetStats() EXCLUDES(worker_.mu);

 private:
  GatherLane(std::unique_ptr<Stream> stream, std::vector<std::unique_ptr<Event>> events,
             BlockStore* store, LaneTrace* trace, Target target,
             std::function<void(int64_t)> before_read);
  // A queued copy as the worker carries it from take to finish.
  struct Job {
    int64_t c = -1;
    ShardCopy to;
    Status s;  // the read and the copy's start
    Status r;  // the block's release, once the copy has read it
    double read_s = 0, copy_s = 0;
  };
  void Work(Job& job) EXCLUDES(worker_.mu);
  void Finish(Job& job) REQUIRES(worker_.mu);

  std::unique_ptr<Stream> stream_;
  std::vector<std::unique_ptr<Event>> events_;  // per chunk; recorded by the lane
  BlockStore* store_;
  LaneTrace* trace_;
  Target target_;
  std::function<void(int64_t)> before_read_;

  // A queued copy is first enqueued (its event recorded, or it failed: status_), then landed
  // (done, and its block released). Compute waits for the first, anything that frees, refills or
  // updates the chunk for the second.
  std::vector<uint8_t> enqueued_ GUARDED_BY(worker_.mu);
  std::vector<uint8_t> taken_ GUARDED_BY(worker_.mu);  // compute went on without waiting to land
  std::vector<uint8_t> landed_ GUARDED_BY(worker_.mu);
  std::vector<Status> status_ GUARDED_BY(worker_.mu);
  Status error_ GUARDED_BY(worker_.mu);  // see TakeError
  Stats stats_ GUARDED_BY(worker_.mu);
  // Last: stopped (its thread joined) before the members its hooks use go.
  mutable WorkerThread<Job> worker_;
};

}  // namespace strata
