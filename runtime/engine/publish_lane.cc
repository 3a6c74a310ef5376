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
  WorkerThread<InFlight>::Hooks hooks;
  hooks.take = [](InFlight&) {};
  hooks.work = [this](InFlight& f) { Work(f); };
  hooks.finish = [this](InFlight& f) {
    worker_.mu.AssertHeld();
    Finish(f);
  };
  // Outside the lock: `done` takes the engine's; the optimizer lane may be waiting for a slot
  // while holding nothing else.
  hooks.after = [this](InFlight& f) { done_(f.copy, std::move(f.s)); };
  // The current device is per thread: the event waits go to the engine's device (a rank's GPU
  // other than the first would otherwise get a context on GPU 0).
  worker_.Start(std::move(hooks), [this](const std::function<void()>& loop) {
    c10::DeviceGuard on_device(TorchDevice(*device_));
    loop();
  });
}

void PublishLane::Stop() { worker_.Stop(); }

void PublishLane::Work(InFlight& f) {
  f.t0 = LaneTrace::Clock::now();
  f.s = events_[f.copy.slot]->Synchronize();
  f.t1 = LaneTrace::Clock::now();
  trace_->Add(Lane::kCopy, "publish", f.t0, f.t1, f.copy.step, f.copy.chunk);
}

void PublishLane::Finish(InFlight& f) {
  copy_s_ += std::chrono::duration<double>(f.t1 - f.t0).count();
  if (f.s.ok() && device_->kind() != DeviceKind::kCpu) bytes_to_device_ += f.copy.bytes;
  slot_busy_[f.copy.slot] = false;
}

int PublishLane::AcquireSlot(int64_t step, double* waited) {
  const int slot = next_slot_;
  next_slot_ ^= 1;
  MutexLock l(&worker_.mu);
  if (slot_busy_[slot]) {
    // Inside the update's own span on the optimizer track, so the trace shows what it waited for.
    LaneTimer t(waited, trace_, Lane::kOptimizer, "wait for staging slot", step, -1);
    while (slot_busy_[slot]) worker_.cv.Wait(&worker_.mu);
  }
  slot_busy_[slot] = true;
  return slot;
}

void PublishLane::FreeSlot(int slot) {
  {
    MutexLock l(&worker_.mu);
    slot_busy_[slot] = false;
  }
  worker_.cv.SignalAll();
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

void PublishLane::Submit(const Copy& copy) { worker_.Push(InFlight{copy, Status::Ok(), {}, {}}); }

double PublishLane::copy_seconds() const {
  MutexLock l(&worker_.mu);
  return copy_s_;
}

uint64_t PublishLane::bytes_to_device() const {
  MutexLock l(&worker_.mu);
  return bytes_to_device_;
}

void PublishLane::ResetStats() {
  MutexLock l(&worker_.mu);
  copy_s_ = 0;
  bytes_to_device_ = 0;
}

}  // namespace strata
