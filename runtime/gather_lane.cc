// Gather lane: stage 3's shards read and copied into their chunks ahead of use.
#include "runtime/engine_impl.h"

namespace strata {

using namespace engine_detail;

// Note [prefetched gathers]
// When a unit begins (forward) or backward reaches it, the chunks of the unit after it in the
// trace are gathered ahead: the compute thread installs their memory (so the device budget and
// stage3_max_live_parameters are charged at once, and never exceeded) and hands each shard's copy
// to the gather lane. The lane acquires the shard from its tier (waiting for NVMe there, not on
// the compute thread), copies it into the chunk on its own stream, records the copy's completion
// and releases the block once it has landed. The compute thread, when it reaches the chunk,
// waits only for what has not landed yet and then runs the all-gather itself: collectives stay on
// one thread in the order chunks are used, which every rank shares. A chunk is never gathered
// ahead while its optimizer update is pending, and nothing frees, drops or updates a chunk whose
// copy is still in flight (DropChunk and Step wait for it first).

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
      {
        LaneTimer t(&read_s, &lane_trace_, Lane::kCopy, "shard read (ahead)", -1, c);
        auto got = store_->Acquire(key, Access::kRead);
        if (got.ok()) src = *got;
        else s = got.status();
      }
      if (s.ok()) {
        LaneTimer t(&copy_s, &lane_trace_, Lane::kCopy, "shard to device (ahead)", -1, c);
        s = gather_stream_->MemcpyAsync(dst, src, bytes, kind);
        if (s.ok()) s = gather_stream_->Synchronize();
        Status r = store_->Release(key, false);
        if (s.ok()) s = r;
      }
      l.lock();
      gather_read_s_ += read_s;
      gather_copy_s_ += copy_s;
      if (s.ok() && kind == CopyKind::kHostToDevice) gather_h2d_ += bytes;
      fill_status_[c] = s.ok() ? s : s.WithContext(StrCat("gathering chunk ", c, " ahead"));
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

void Engine::Impl::PrefetchGather(int64_t c) {
  ChunkState& cs = chunks_[c];
  if (cs.gathered || !gather_stream_) return;
  const ChunkInfo& ci = partitioner_->chunks()[c];
  if (live_elems_ + ci.numel > config_.zero_optimization.stage3_max_live_parameters) return;
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    if (update_pending_[c]) return;
  }
  if (!InstallChunk(c).ok()) return;  // no device room now: it is gathered when used
  cs.filling = true;
  {
    std::lock_guard<std::mutex> l(gather_mu_);
    fill_landed_[c] = 0;
    fill_status_[c] = Status::Ok();
    gather_queue_.push_back(c);
  }
  gather_cv_.notify_all();
}

Status Engine::Impl::FinishFill(int64_t c) {
  ChunkState& cs = chunks_[c];
  Status s;
  {
    std::unique_lock<std::mutex> l(gather_mu_);
    if (!fill_landed_[c]) {
      const Clock::time_point t0 = Clock::now();
      gather_cv_.wait(l, [&] { return fill_landed_[c] != 0; });
      const Clock::time_point t1 = Clock::now();
      stall_s_ += std::chrono::duration<double>(t1 - t0).count();
      lane_trace_.Add(Lane::kWait, "shard ahead", t0, t1, trace_step(), c);
    }
    s = fill_status_[c];
  }
  cs.filling = false;
  STRATA_RETURN_IF_ERROR(s);
  return AllGatherChunk(c);
}

void Engine::Impl::WaitFillLanded(int64_t c) {
  if (!chunks_[c].filling) return;
  std::unique_lock<std::mutex> l(gather_mu_);
  gather_cv_.wait(l, [&] { return fill_landed_[c] != 0; });
}

void Engine::Impl::FinishAllFills() {
  for (size_t c = 0; c < chunks_.size(); ++c) WaitFillLanded(static_cast<int64_t>(c));
}

}  // namespace strata
