// Gather lane: stage 3's shards read and copied into their chunks ahead of use.
#include "runtime/engine_impl.h"

namespace strata {

using namespace engine_detail;

namespace {

// Compute thread: waits on `cv` (with `l` held) until `done`, counting the wait as a compute
// stall and tracing it as `what`.
template <typename Done>
void StallUntil(std::unique_lock<std::mutex>& l, std::condition_variable& cv, Done done,
                double* stall_s, LaneTrace* trace, const char* what, int64_t step, int64_t c) {
  if (done()) return;
  const Clock::time_point t0 = Clock::now();
  cv.wait(l, done);
  const Clock::time_point t1 = Clock::now();
  *stall_s += std::chrono::duration<double>(t1 - t0).count();
  trace->Add(Lane::kWait, what, t0, t1, step, c);
}

}  // namespace

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

void Engine::Impl::StartGatherLane() {
  gather_thread_ = std::thread([this] {
    std::unique_lock<std::mutex> l(gather_mu_);
    for (;;) {
      gather_cv_.wait(l, [&] { return gather_stop_ || !gather_queue_.empty(); });
      if (gather_queue_.empty()) return;
      const int64_t c = gather_queue_.front();
      gather_queue_.pop_front();
      l.unlock();
      const ChunkInfo& ci = partitioner_->chunks()[c];
      const size_t esize = optim::DTypeSize(compute_dtype_);
      char* dst = static_cast<char*>(chunks_[c].buffer) +
                  partitioner_->ShardOffset(c, shard_rank()) * esize;
      const size_t bytes = ci.shard_numel * esize;
      const BlockKey key{c, StateKind::kParam16};
      const CopyKind kind = param_placement_ == Placement::kDevice ? CopyKind::kDeviceToDevice
                                                                   : CopyKind::kHostToDevice;
      double read_s = 0, copy_s = 0;
      Status s;
      void* src = nullptr;
      if (comm_->world_size() > 1) {
        // Chosen whatever the update's state (see above): its values come after the update.
        double wait_s = 0;  // waiting, not busy: traced, not counted
        LaneTimer t(&wait_s, &lane_trace_, Lane::kCopy, "wait for update (ahead)", -1, c);
        std::unique_lock<std::mutex> o(opt_mu_);
        if (update_pending_[c]) PromoteUpdate(c);
        opt_cv_.wait(o, [&] { return update_pending_[c] == 0; });
      }
      {
        LaneTimer t(&read_s, &lane_trace_, Lane::kCopy, "shard read (ahead)", -1, c);
        auto got = store_->Acquire(key, Access::kRead);
        if (got.ok()) src = *got;
        else s = got.status();
      }
      Status r;  // the block's release, once the copy has read it
      {
        LaneTimer t(&copy_s, &lane_trace_, Lane::kCopy, "shard to device (ahead)", -1, c);
        bool recorded = false;
        if (s.ok()) {
          s = gather_stream_->MemcpyAsync(dst, src, bytes, kind);
          if (s.ok()) s = gather_stream_->Record(*fill_events_[c]);
          recorded = s.ok();
        }
        // Compute may go on now: it orders itself after the event (FinishFill).
        l.lock();
        fill_status_[c] = s.ok() ? s : s.WithContext(StrCat("gathering chunk ", c, " ahead"));
        fill_enqueued_[c] = 1;
        gather_cv_.notify_all();
        l.unlock();
        if (src != nullptr) {
          Status w = recorded ? fill_events_[c]->Synchronize() : gather_stream_->Synchronize();
          r = store_->Release(key, false);
          if (!w.ok()) r = w;
        }
      }
      l.lock();
      gather_read_s_ += read_s;
      gather_copy_s_ += copy_s;
      if (s.ok() && r.ok() && kind == CopyKind::kHostToDevice) gather_h2d_ += bytes;
      if (!r.ok()) {
        r = r.WithContext(StrCat("gathering chunk ", c, " ahead"));
        if (fill_taken_[c]) {
          if (gather_error_.ok()) gather_error_ = r;  // FinishUpdates reports it
        } else if (fill_status_[c].ok()) {
          fill_status_[c] = r;  // SettleFill reports it
        } else {
          STRATA_LOG(WARN) << r;  // second to the copy's own error, which is reported
        }
      }
      fill_landed_[c] = 1;
      gather_cv_.notify_all();
    }
  });
}

void Engine::Impl::StopGatherLane() {
  {
    std::lock_guard<std::mutex> l(gather_mu_);
    gather_stop_ = true;
  }
  gather_cv_.notify_all();
  if (gather_thread_.joinable()) gather_thread_.join();
}

void Engine::Impl::PrefetchGathers(const std::vector<int64_t>& next) {
  if (!gather_stream_) return;
  const bool ranks = comm_->world_size() > 1;
  const int64_t max_live = config_.zero_optimization.stage3_max_live_parameters;
  std::vector<int64_t> chosen;
  int64_t live = live_elems_;  // with the chunks chosen so far
  for (int64_t c : next) {
    if (chunks_[c].gathered) continue;
    const int64_t numel = partitioner_->chunks()[c].numel;
    if (live + numel > max_live) continue;
    if (!ranks) {
      std::lock_guard<std::mutex> l(opt_mu_);
      if (update_pending_[c]) continue;
    }
    chosen.push_back(c);
    live += numel;
  }
  if (chosen.empty()) return;
  // Install what fits; with several ranks, keep only what every rank installed.
  std::vector<double> failed(chosen.size(), 0.0);
  for (size_t i = 0; i < chosen.size(); ++i)
    if (!InstallChunk(chosen[i]).ok()) failed[i] = 1;
  if (ranks) {
    {
      std::unique_lock<std::mutex> l(reduce_mu_);
      WaitReduceLaneIdle(l);
    }
    torch::Tensor flags = torch::tensor(failed, torch::kFloat64);
    Status s;
    {
      LaneTimer t(&comm_s_, &lane_trace_, Lane::kComm, "agree on gathers ahead", trace_step());
      s = OnCommMemory(flags, [&](void* p) {
        return comm_->AllReduce(p, static_cast<size_t>(flags.numel()), strata::DType::kF64,
                                ReduceOp::kMax);
      });
    }
    // Without an agreement nothing is gathered ahead; the failure shows at the next collective.
    const double* f = flags.data_ptr<double>();
    for (size_t i = 0; i < chosen.size(); ++i) {
      const bool installed = failed[i] == 0;
      failed[i] = s.ok() ? f[i] : 1;
      if (installed && failed[i] != 0) DropChunk(chosen[i]);
    }
  }
  for (size_t i = 0; i < chosen.size(); ++i) {
    if (failed[i] != 0) continue;  // no device room now: gathered when used
    const int64_t c = chosen[i];
    chunks_[c].filling = true;
    {
      std::lock_guard<std::mutex> l(gather_mu_);
      fill_enqueued_[c] = 0;
      fill_landed_[c] = 0;
      fill_taken_[c] = 0;
      fill_status_[c] = Status::Ok();
      gather_queue_.push_back(c);
    }
    gather_cv_.notify_all();
    if (!ranks) continue;
    chunks_[c].ahead_all_gather = true;
    ReduceJob job;
    job.c = c;
    job.all_gather = true;
    job.step = trace_step();
    {
      std::lock_guard<std::mutex> l(reduce_mu_);
      ahead_done_[c] = 0;
      ahead_status_[c] = Status::Ok();
      reduce_queue_.push_back(std::move(job));
    }
    reduce_cv_.notify_all();
  }
}

Status Engine::Impl::AllGatherAhead(int64_t c, int64_t step) {
  c10::DeviceGuard on_device(TorchDevice(*device_));
  Status s;
  {
    std::unique_lock<std::mutex> l(gather_mu_);
    gather_cv_.wait(l, [&] { return fill_landed_[c] != 0; });
    s = fill_status_[c];
  }
  // Delay injection here, after the copy landed, when compute may already be waiting to read.
  if (reduce_delay_hook_) reduce_delay_hook_(c);
  double comm_s = 0;
  Status g;
  {
    LaneTimer t(&comm_s, &lane_trace_, Lane::kComm, "all-gather (ahead)", step, c);
    g = AllGatherShards(c);
  }
  std::lock_guard<std::mutex> l(reduce_mu_);
  reduce_comm_s_ += comm_s;
  return s.ok() ? g : s;
}

Status Engine::Impl::WaitAllGatherAhead(int64_t c) {
  std::unique_lock<std::mutex> l(reduce_mu_);
  StallUntil(l, reduce_cv_, [&] { return ahead_done_[c] != 0; }, &stall_s_, &lane_trace_,
             "all-gather ahead", trace_step(), c);
  return ahead_status_[c];
}

Status Engine::Impl::FinishFill(int64_t c) {
  ChunkState& cs = chunks_[c];
  // With several ranks an all-gather follows, and collectives run from the host: the shard must
  // be in place, not just ordered. With one rank only compute reads the chunk.
  const bool ordered_only = comm_->world_size() == 1;
  Status s;
  {
    std::unique_lock<std::mutex> l(gather_mu_);
    StallUntil(l, gather_cv_, [&] { return fill_enqueued_[c] != 0; }, &stall_s_, &lane_trace_,
               "shard ahead", trace_step(), c);
    s = fill_status_[c];
    if (s.ok() && ordered_only) fill_taken_[c] = 1;
  }
  if (!ordered_only || !s.ok()) {
    // Waits for the copy (and the all-gather issued ahead); a failed copy's status carries
    // "gathering chunk c ahead".
    const bool all_gathered = cs.ahead_all_gather;
    STRATA_RETURN_IF_ERROR(SettleFill(c));
    // Several ranks always all-gather ahead today (PrefetchGathers); kept for a chunk queued
    // without it. (With one rank AllGatherChunk does nothing.)
    return all_gathered ? Status::Ok() : AllGatherChunk(c);
  }
  cs.filling = false;
  // On a GPU this thread goes on while the copy runs. Waits that cost nothing are not traced.
  const Clock::time_point t0 = Clock::now();
  Status w = ComputeWaitFor(*device_, *fill_events_[c]);
  const Clock::time_point t1 = Clock::now();
  stall_s_ += std::chrono::duration<double>(t1 - t0).count();
  if (t1 - t0 > std::chrono::microseconds(20))
    lane_trace_.Add(Lane::kWait, "shard ahead (copy)", t0, t1, trace_step(), c);
  return w;
}

void Engine::Impl::WaitFillLanded(int64_t c) {
  std::unique_lock<std::mutex> l(gather_mu_);
  gather_cv_.wait(l, [&] { return fill_landed_[c] != 0; });
}

Status Engine::Impl::SettleFill(int64_t c) {
  ChunkState& cs = chunks_[c];
  // After FinishFill the lane may still hold the block (a GPU's copy in flight): wait anyway.
  WaitFillLanded(c);
  if (!cs.filling) return Status::Ok();
  Status s;
  {
    std::lock_guard<std::mutex> l(gather_mu_);
    s = fill_status_[c];
  }
  cs.filling = false;
  if (cs.ahead_all_gather) {
    cs.ahead_all_gather = false;
    Status g = WaitAllGatherAhead(c);
    if (s.ok()) s = g;
  }
  return s;
}

void Engine::Impl::FinishAllFills() {
  for (size_t c = 0; c < chunks_.size(); ++c) WaitFillLanded(static_cast<int64_t>(c));
}

Status Engine::Impl::TakeGatherError() {
  std::lock_guard<std::mutex> l(gather_mu_);
  return std::exchange(gather_error_, Status::Ok());
}

}  // namespace strata
