// Gather lane: stage 3's shards read and copied into their chunks ahead of use. The lane itself
// (gather_lane.h), then the engine's side: choosing what to gather ahead and ordering compute
// after it.
#include "runtime/engine/gather_lane.h"

#include "runtime/base/logging.h"
#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

// Note [prefetched gathers]
// When a unit begins (forward) or backward reaches it, the chunks of the unit after it in the
// trace are gathered ahead: the compute thread installs their memory (so the device budget and
// stage3_max_live_parameters are charged at once, and never exceeded) and hands each shard's copy
// to the gather lane. The lane acquires the shard from its tier (waiting for NVMe there, not on
// the compute thread), enqueues the copy into the chunk on its own stream, records the chunk's
// event after it, and releases the block once the event has completed. With one rank the
// compute thread, when it reaches the chunk, waits only until the copy is enqueued and then
// orders LibTorch's compute after the event (ComputeWaitFor): on a GPU the wait is on the device
// and the thread goes on queuing kernels; on the CPU device it blocks until the copy has run, so
// delay injection on the stream catches a missing wait. Anything that frees, drops or updates a
// chunk waits for the lane to be done with it first (WaitFillLanded), as does anything that
// hands the chunk to a collective, which runs from the host (with several ranks, its all-gather).
//
// With one rank there is no all-gather, and a chunk whose optimizer update is pending is not
// gathered ahead (compute waits for the update when it reaches the chunk).
//
// With several ranks the all-gather is issued ahead too, on the reduce lane, which then runs
// every collective of the backward in one queue. The ranks must issue the same collectives in
// the same order, so the choice of what to gather ahead may depend only on what every rank
// shares (the trace, the chunks gathered, the live-parameter cap), not on timing or on a
// rank's own memory: a pending update makes the gather lane wait for it instead of skipping
// the chunk, and whether each rank could install the chunks is agreed by one small all-reduce
// before anything is queued (a rank that could not install one makes every rank leave it).
// That all-reduce is a collective on the compute thread, so it first waits for the reduce lane
// to go idle, as the compute thread's own all-gathers do. The lane queues each chosen chunk's
// all-gather behind the reductions already queued; it waits for the copy to land, then
// all-gathers (even when this rank's copy failed: the other ranks are in the collective, and
// the error is reported when compute reaches the chunk).

StatusOr<std::unique_ptr<GatherLane>> GatherLane::Create(
    Device* device, int64_t num_chunks, BlockStore* store, LaneTrace* trace, Target target,
    std::function<void(int64_t)> before_read) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream,
                          device->CreateStream(StreamPriority::kHigh));
  std::vector<std::unique_ptr<Event>> events(static_cast<size_t>(num_chunks));
  for (auto& event : events) {
    STRATA_ASSIGN_OR_RETURN(event, device->CreateEvent());
  }
  return std::unique_ptr<GatherLane>(new GatherLane(std::move(stream), std::move(events), store,
                                                    trace, std::move(target),
                                                    std::move(before_read)));
}

GatherLane::GatherLane(std::unique_ptr<Stream> stream, std::vector<std::unique_ptr<Event>> events,
                       BlockStore* store, LaneTrace* trace, Target target,
                       std::function<void(int64_t)> before_read)
    : stream_(std::move(stream)), events_(std::move(events)), store_(store), trace_(trace),
      target_(std::move(target)), before_read_(std::move(before_read)),
      enqueued_(events_.size(), 1), taken_(events_.size(), 0), landed_(events_.size(), 1),
      status_(events_.size(), Status::Ok()) {}

GatherLane::~GatherLane() { Stop(); }

void GatherLane::Start() {
  WorkerThread<Job>::Hooks hooks;
  hooks.take = [](Job&) {};
  hooks.work = [this](Job& j) { Work(j); };
  hooks.finish = [this](Job& j) {
    worker_.mu.AssertHeld();
    Finish(j);
  };
  worker_.Start(std::move(hooks));
}

void GatherLane::Stop() { worker_.Stop(); }

void GatherLane::Work(Job& j) {
  const int64_t c = j.c;
  if (before_read_) {
    double wait_s = 0;  // waiting, not busy: traced, not counted
    LaneTimer t(&wait_s, trace_, Lane::kCopy, "wait for update (ahead)", -1, c);
    before_read_(c);
  }
  j.to = target_(c);
  const BlockKey key{c, StateKind::kParam16};
  void* src = nullptr;
  {
    LaneTimer t(&j.read_s, trace_, Lane::kCopy, "shard read (ahead)", -1, c);
    auto got = store_->Acquire(key, Access::kRead);
    if (got.ok()) src = *got;
    else j.s = got.status();
  }
  LaneTimer t(&j.copy_s, trace_, Lane::kCopy, "shard to device (ahead)", -1, c);
  bool recorded = false;
  if (j.s.ok()) {
    j.s = stream_->MemcpyAsync(j.to.dst, src, j.to.bytes, j.to.kind);
    if (j.s.ok()) j.s = stream_->Record(*events_[c]);
    recorded = j.s.ok();
  }
  // Compute may go on now: it orders itself after the event (WaitEnqueued's `take`).
  {
    MutexLock l(&worker_.mu);
    status_[c] = j.s.ok() ? j.s : j.s.WithContext(StrCat("gathering chunk ", c, " ahead"));
    enqueued_[c] = 1;
  }
  worker_.cv.SignalAll();
  if (src != nullptr) {
    Status w = recorded ? events_[c]->Synchronize() : stream_->Synchronize();
    j.r = store_->Release(key, false);
    if (!w.ok()) j.r = w;
  }
}

void GatherLane::Finish(Job& j) {
  const int64_t c = j.c;
  stats_.read_s += j.read_s;
  stats_.copy_s += j.copy_s;
  if (j.s.ok() && j.r.ok() && j.to.kind == CopyKind::kHostToDevice) stats_.bytes_h2d += j.to.bytes;
  if (!j.r.ok()) {
    Status r = j.r.WithContext(StrCat("gathering chunk ", c, " ahead"));
    if (taken_[c]) {
      if (error_.ok()) error_ = r;  // the engine's FinishUpdates reports it
    } else if (status_[c].ok()) {
      status_[c] = r;  // the engine's SettleFill reports it
    } else {
      STRATA_LOG(WARN) << r;  // second to the copy's own error, which is reported
    }
  }
  landed_[c] = 1;
}

void GatherLane::Enqueue(int64_t c) {
  {
    MutexLock l(&worker_.mu);
    STRATA_DCHECK(landed_[c] != 0, "chunk ", c, " queued for a gather ahead while one is in flight");
    enqueued_[c] = 0;
    landed_[c] = 0;
    taken_[c] = 0;
    status_[c] = Status::Ok();
    Job job;
    job.c = c;
    worker_.queue().push_back(std::move(job));
  }
  worker_.cv.SignalAll();
}

Status GatherLane::WaitEnqueued(int64_t c, bool take, double* stall_s, int64_t trace_step) {
  MutexLock l(&worker_.mu);
  if (!enqueued_[c]) {
    LaneTimer t(stall_s, trace_, Lane::kWait, "shard ahead", trace_step, c);
    while (!enqueued_[c]) worker_.cv.Wait(&worker_.mu);
  }
  if (status_[c].ok() && take) taken_[c] = 1;
  return status_[c];
}

void GatherLane::WaitLanded(int64_t c) {
  MutexLock l(&worker_.mu);
  while (!landed_[c]) worker_.cv.Wait(&worker_.mu);
}

void GatherLane::WaitAllLanded() {
  size_t n;
  {
    MutexLock l(&worker_.mu);
    n = landed_.size();
  }
  for (size_t c = 0; c < n; ++c) WaitLanded(static_cast<int64_t>(c));
}

Status GatherLane::status(int64_t c) const {
  MutexLock l(&worker_.mu);
  return status_[c];
}

Status GatherLane::TakeError() {
  MutexLock l(&worker_.mu);
  return std::exchange(error_, Status::Ok());
}

GatherLane::Stats GatherLane::stats() const {
  MutexLock l(&worker_.mu);
  return stats_;
}

void GatherLane::ResetStats() {
  MutexLock l(&worker_.mu);
  stats_ = Stats();
}

}  // namespace strata
