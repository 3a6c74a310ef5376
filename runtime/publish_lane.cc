// Publish lane: a host optimizer's new values for device-resident parameters, from pinned
// staging slots to the device, pipelined behind the optimizer lane (Note [pipelined publish]);
// and the synchronous publish a checkpoint load uses.
#include "runtime/engine_impl.h"

namespace strata {

using namespace engine_detail;

// Note [pipelined publish]
// A host optimizer (offload_optimizer cpu or nvme) whose parameters live in device memory writes
// each chunk's new values to a pinned staging slot; a copy on the publish stream takes them to
// the device. Waiting for that copy before the next chunk's update would add it to the
// optimizer lane: on a GPU a shard's copy over PCIe is a fifth to a quarter of its CPU Adam. So
// the lane starts the copy, records the slot's event and goes on with the next chunk in the
// other slot, and the publish lane (a thread of its own) waits for the event, releases the
// param16 block, and only then marks the chunk updated: nothing can read the chunk's new values
// before they have landed, and no slot is written while its copy still reads it. Two slots are
// enough: the copy is shorter than the next update, so the lane rarely waits for a slot.

void Engine::Impl::StartPublishLane() {
  publish_thread_ = std::thread([this] {
    // The current device is per thread: the event waits go to the engine's device (a rank's
    // GPU other than the first would otherwise get a context on GPU 0).
    c10::DeviceGuard on_device(TorchDevice(*device_));
    std::unique_lock<std::mutex> l(opt_mu_);
    for (;;) {
      opt_cv_.wait(l, [&] { return publish_stop_ || !publish_queue_.empty(); });
      if (publish_queue_.empty()) return;
      const PendingPublish p = publish_queue_.front();
      publish_queue_.pop_front();
      l.unlock();
      double dt = 0;
      Status s;
      {
        LaneTimer t(&dt, &lane_trace_, Lane::kCopy, "publish", p.step, p.c);
        s = publish_events_[p.slot]->Synchronize();
      }
      if (p.held) {
        Status r = store_->Release({p.c, StateKind::kParam16}, s.ok());
        if (s.ok()) s = r;
      }
      l.lock();
      publish_s_ += dt;
      if (s.ok() && device_->kind() != DeviceKind::kCpu) publish_h2d_ += p.bytes;
      if (!s.ok() && opt_error_.ok())
        opt_error_ = s.WithContext(StrCat("publishing chunk ", p.c, "'s new values"));
      publish_slot_busy_[p.slot] = false;
      update_pending_[p.c] = 0;
      --opt_busy_;
      opt_cv_.notify_all();
    }
  });
}

void Engine::Impl::StopPublishLane() {
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    publish_stop_ = true;
  }
  opt_cv_.notify_all();
  if (publish_thread_.joinable()) publish_thread_.join();
}

int Engine::Impl::TakePublishSlot() {
  const int slot = publish_next_slot_;
  publish_next_slot_ ^= 1;
  std::unique_lock<std::mutex> l(opt_mu_);
  if (publish_slot_busy_[slot]) {
    const Clock::time_point t0 = Clock::now();
    opt_cv_.wait(l, [&] { return !publish_slot_busy_[slot]; });
    const Clock::time_point t1 = Clock::now();
    opt_slot_wait_s_ += std::chrono::duration<double>(t1 - t0).count();
    // Inside the update's own span on the optimizer track, so the trace shows what it waited for.
    lane_trace_.Add(Lane::kOptimizer, "wait for staging slot", t0, t1, opt_step_, -1);
  }
  publish_slot_busy_[slot] = true;
  return slot;
}

void Engine::Impl::FreePublishSlot(int slot) {
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    publish_slot_busy_[slot] = false;
  }
  opt_cv_.notify_all();
}

// Starts the copy of chunk c's new values from staging slot `slot` to the device and describes
// it in *publish, for the optimizer lane to hand to the publish lane. On failure nothing is in
// flight and the slot is free again.
Status Engine::Impl::StartPublish(int64_t c, int slot, PendingPublish* publish) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t bytes = ci.shard_numel * optim::DTypeSize(compute_dtype_);
  void* dst;
  const bool held = stage3();
  if (held) {
    auto got = store_->Acquire({c, StateKind::kParam16}, Access::kWrite);
    if (!got.ok()) {
      FreePublishSlot(slot);
      return got.status();
    }
    dst = *got;
  } else {
    dst = WorkingShard(c);
  }
  Status s =
      publish_stream_->MemcpyAsync(dst, publish_staging_[slot].data(), bytes, CopyKind::kHostToDevice);
  if (s.ok()) s = publish_stream_->Record(*publish_events_[slot]);
  if (!s.ok()) {
    // Whatever was queued reads the slot and writes the block: let it finish first.
    publish_stream_->Synchronize().IgnoreError();
    if (held) store_->Release({c, StateKind::kParam16}, false).IgnoreError();
    FreePublishSlot(slot);
    return s;
  }
  *publish = {c, slot, held, static_cast<uint64_t>(opt_step_), bytes};
  return Status::Ok();
}

// Copies a shard of new working values from host memory to where the device reads it, and
// waits: a checkpoint load, while the optimizer lane is idle (updates publish through
// StartPublish).
Status Engine::Impl::PublishParams(int64_t c, const void* shard_values, optim::DType dtype) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t bytes = ci.shard_numel * optim::DTypeSize(dtype);
  void* dst;
  bool held = false;
  if (config_.zero_optimization.stage == 3) {
    STRATA_ASSIGN_OR_RETURN(dst, store_->Acquire({c, StateKind::kParam16}, Access::kWrite));
    held = true;
  } else {
    dst = WorkingShard(c);
  }
  if (held && param_placement_ != Placement::kDevice) {  // a host buffer: no device copy
    std::memcpy(dst, shard_values, bytes);
    return store_->Release({c, StateKind::kParam16}, true);
  }
  Status s = publish_stream_->MemcpyAsync(dst, shard_values, bytes, CopyKind::kHostToDevice);
  if (s.ok()) s = publish_stream_->Synchronize();
  if (held) {
    Status r = store_->Release({c, StateKind::kParam16}, true);
    if (s.ok()) s = r;
  }
  return s;
}

}  // namespace strata
