// PublishLane (publish_lane.h): pinned staging slots, their copies to the device, and the thread
// that finishes each copy.
#include "runtime/engine/publish_lane.h"

#include <c10/core/DeviceGuard.h>

#include <chrono>

#include "runtime/engine/engine.h"

namespace strata {

// Note [pipelined publish]
// A host optimizer (offload_optimizer cpu or nvme) whose parameters live in device memory writes
// each chunk's new values to a pinned staging slot; a copy on the publish stream takes them to
// the device. Waiting for that copy before the next chunk's update would add it to the
// optimizer lane: on a GPU a shard's copy over PCIe is a fifth to a quarter of its CPU Adam. So
// the lane starts the copy, records the slot's event and goes on with the next chunk in the
// other slot, and the publish lane (a thread of its own) waits for the event; its `done` (the engine) releases
// the param16 block and only then marks the chunk updated: nothing can read the chunk's new values
// before they have landed, and no slot is written while its copy still reads it. Two slots are
// enough: the copy is shorter than the next update, so the lane rarely waits for a slot.

PublishLane::PublishLane(Device* device, Stream* stream, LaneTrace* trace, Done done)
    : device_(device), stream_(stream), trace_(trace), done_(std::move(done)) {}

PublishLane::~PublishLane() { Stop(); }

Status PublishLane::Reserve(size_t slot_bytes) {
  for (int slot = 0; slot < 2; ++slot) {
    STRATA_RETURN_IF_ERROR(staging_[slot].Reserve(slot_bytes).WithContext("the optimizer's staging buffer"));
    STRATA_ASSIGN_OR_RETURN(events_[slot], device_->CreateEvent());
  }
  return Status::Ok();
}

void PublishLane::Start() {
  thread_ = std::thread([this] { Run(); });
}

void PublishLane::Stop() { StopLaneThread(mu_, cv_, &stop_, thread_); }

void PublishLane::Run() {
  // The current device is per thread: the event waits go to the engine's device (a rank's GPU
  // other than the first would otherwise get a context on GPU 0).
  c10::DeviceGuard on_device(TorchDevice(*device_));
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    const Copy copy = queue_.front();
    queue_.pop_front();
    l.unlock();
    const LaneTrace::Clock::time_point t0 = LaneTrace::Clock::now();
    Status s = events_[copy.slot]->Synchronize();
    const LaneTrace::Clock::time_point t1 = LaneTrace::Clock::now();
    trace_->Add(Lane::kCopy, "publish", t0, t1, copy.step, copy.chunk);
    l.lock();
    copy_s_ += std::chrono::duration<double>(t1 - t0).count();
    if (s.ok() && device_->kind() != DeviceKind::kCpu) bytes_to_device_ += copy.bytes;
    slot_busy_[copy.slot] = false;
    cv_.notify_all();
    l.unlock();
    // Outside the lock: `done` takes the engine's; the optimizer lane may be waiting here for a
    // slot while holding nothing else.
    done_(copy, std::move(s));
    l.lock();
  }
}

int PublishLane::AcquireSlot(int64_t step, double* waited) {
  const int slot = next_slot_;
  next_slot_ ^= 1;
  std::unique_lock<std::mutex> l(mu_);
  if (slot_busy_[slot]) {
    const LaneTrace::Clock::time_point t0 = LaneTrace::Clock::now();
    cv_.wait(l, [&] { return !slot_busy_[slot]; });
    const LaneTrace::Clock::time_point t1 = LaneTrace::Clock::now();
    *waited += std::chrono::duration<double>(t1 - t0).count();
    // Inside the update's own span on the optimizer track, so the trace shows what it waited for.
    trace_->Add(Lane::kOptimizer, "wait for staging slot", t0, t1, step, -1);
  }
  slot_busy_[slot] = true;
  return slot;
}

void PublishLane::FreeSlot(int slot) {
  {
    std::lock_guard<std::mutex> l(mu_);
    slot_busy_[slot] = false;
  }
  cv_.notify_all();
}

Status PublishLane::StartCopy(const Copy& copy, void* dst) {
  Status s = stream_->MemcpyAsync(dst, staging_[copy.slot].data(), copy.bytes, CopyKind::kHostToDevice);
  if (s.ok()) s = stream_->Record(*events_[copy.slot]);
  if (!s.ok()) {
    // Whatever was queued reads the slot: let it finish before the slot is reused.
    stream_->Synchronize().IgnoreError();
    FreeSlot(copy.slot);
  }
  return s;
}

void PublishLane::Submit(const Copy& copy) {
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(copy);
  }
  cv_.notify_all();
}

double PublishLane::copy_seconds() const {
  std::lock_guard<std::mutex> l(mu_);
  return copy_s_;
}

uint64_t PublishLane::bytes_to_device() const {
  std::lock_guard<std::mutex> l(mu_);
  return bytes_to_device_;
}

void PublishLane::ResetStats() {
  std::lock_guard<std::mutex> l(mu_);
  copy_s_ = 0;
  bytes_to_device_ = 0;
}

}  // namespace strata
