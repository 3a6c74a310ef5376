// Device, Stream, Event: where compute runs and how work on it is ordered.
//
// Two implementations: the CPU device (tiers/hbm/cpu_device.cc, always built; host memory with a
// configurable capacity that stands for HBM, streams that are in-order worker threads) and the
// CUDA device (tiers/hbm/cuda_device.cc, built when CUDA is on, chosen at run time only when a
// GPU is present). Pipeline, partitioner and tier code is written against these interfaces only.
//
// Ordering contract (the same as CUDA's):
// - Work enqueued on one stream runs in order; work on different streams may overlap.
// - Stream::Record(e) captures all work enqueued on that stream so far; e completes when that
//   work has finished. Re-recording an event moves it to the newer point.
// - Stream::Wait(e) makes work enqueued later on that stream wait for e's captured work. It never
//   blocks the calling thread.
// - An event that was never recorded is complete.
// - Compute that LibTorch enqueues is ordered after an event by Device::OrderForeignStream.
// Thread-safety: Device, Stream and Event methods may be called from any thread. A Stream or Event
// must outlive the work that refers to it; destroying a stream drains it first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/base/status.h"

namespace strata {

enum class DeviceKind { kCpu, kCuda };
enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice, kHostToHost };
enum class StreamPriority { kNormal, kHigh };

inline const char* DeviceKindName(DeviceKind kind) {
  return kind == DeviceKind::kCpu ? "cpu" : "cuda";
}

class Event {
 public:
  virtual ~Event() = default;
  // True when the captured work has finished (or the event was never recorded). Never blocks.
  virtual bool Query() = 0;
  // Blocks the calling thread until the captured work has finished.
  virtual Status Synchronize() = 0;
};

class Stream {
 public:
  virtual ~Stream() = default;

  // Enqueues a copy of `bytes` bytes. Device-side pointers must lie inside one allocation of this
  // stream's device (INVALID_ARGUMENT otherwise, checked where the device can tell); host-side
  // pointers are plain host memory. Returns once enqueued.
  virtual Status MemcpyAsync(void* dst, const void* src, size_t bytes, CopyKind kind) = 0;
  // Enqueues a byte fill of device memory.
  virtual Status MemsetAsync(void* dst, int value, size_t bytes) = 0;
  // Enqueues a host callback that runs in stream order. It must not enqueue work on, or wait for,
  // this same stream.
  virtual Status LaunchHostFunc(std::function<void()> fn) = 0;
  // Enqueues device compute in stream order: `kernel` is called with the stream's native handle
  // (kernels::StreamHandle) and runs kernels/kernels.h calls for this device's backend on it.
  // - CUDA: called at once on the calling thread with the cudaStream_t; it launches
  //   asynchronous kernels, and its status (a launch error) is returned here.
  // - CPU device: its kernels run in the thread that calls them, so the stream's worker calls
  //   `kernel` (handle null) in order with the stream's copies. The caller goes on at once, as on
  //   a GPU, so a missing wait for the result fails on CPU too; a failed status is returned by the
  //   stream's next Synchronize, as a GPU reports a fault during execution.
  // `kernel` must own what it captures (it may run after the caller's frame is gone) and must
  // not enqueue work on, or wait for, this same stream.
  virtual Status LaunchKernel(std::function<Status(void* native_stream)> kernel) = 0;

  virtual Status Record(Event& event) = 0;
  virtual Status Wait(Event& event) = 0;
  // Blocks until all work enqueued so far has finished. Returns (once) the first failure of a
  // kernel launched since the last Synchronize.
  virtual Status Synchronize() = 0;
  // True when no enqueued work is pending. Never blocks.
  virtual bool Query() = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual DeviceKind kind() const = 0;
  virtual int index() const = 0;
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H100 ...)"

  // Device-memory accounting. Allocate never lets allocated() exceed capacity(): a request that
  // does not fit is RESOURCE_EXHAUSTED naming the sizes, never a crash.
  virtual uint64_t capacity() const = 0;
  virtual uint64_t allocated() const = 0;
  virtual uint64_t peak_allocated() const = 0;
  // Returns memory aligned to at least 256 bytes. Allocate(0) returns a unique non-null pointer.
  virtual StatusOr<void*> Allocate(size_t bytes) = 0;
  // Frees a pointer from Allocate; INVALID_ARGUMENT for anything else. The caller guarantees no
  // enqueued work still uses it.
  virtual Status Free(void* ptr) = 0;
  // The address at which compute on this device (LibTorch tensor views, kernels) reaches the
  // device memory at `ptr`, a pointer into one of its allocations. On a GPU that is `ptr`
  // itself. The strict CPU device hands out addresses the host cannot dereference and returns
  // here the readable alias of the same bytes; any other pointer comes back unchanged. Host code
  // never dereferences device memory through anything else.
  virtual void* ComputeAddress(void* ptr) const { return ptr; }

  virtual StatusOr<std::unique_ptr<Stream>> CreateStream(
      StreamPriority priority = StreamPriority::kNormal) = 0;
  virtual StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  // Blocks until all work on all of this device's streams has finished. A kernel failure stays
  // with its stream, for that stream's Synchronize.
  virtual Status Synchronize() = 0;
  // Makes the work enqueued later on `native_stream` wait for `event`, where `native_stream` is
  // a stream of this device that Strata did not create: LibTorch's current stream, on CUDA its
  // cudaStream_t (nullptr: the legacy default stream). On a GPU this never blocks the caller.
  // The CPU device has no such streams (LibTorch's CPU ops run on the thread that calls them),
  // so there it blocks the caller until `event` has completed, and ignores `native_stream`.
  virtual Status OrderForeignStream(void* native_stream, Event& event) = 0;
};

}  // namespace strata
