// ComputeFence and SideStream: how the engine orders its own work against the stream LibTorch's
// compute runs on.
//
// LibTorch enqueues a CUDA op on the device's current stream and returns before it runs. Memory
// the engine hands back, a buffer a collective or a copy reads, or a parameter the optimizer
// rewrites may therefore still be in use by queued kernels. A ComputeFence marks "everything
// compute enqueued so far"; the engine frees, reads or overwrites such memory only once the fence
// is done. On the CPU device LibTorch's ops have finished when they return, so every fence is
// done at once and costs nothing.
//
// The types speak LibTorch's device-generic c10 API (no CUDA headers), so this file builds
// against any LibTorch, with or without CUDA.
#pragma once

#include <optional>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include "runtime/base/device.h"
#include "runtime/base/status.h"

namespace strata {

class ComputeFence {
 public:
  ComputeFence() = default;  // done
  // Marks the work enqueued so far on `device`'s current LibTorch stream.
  static ComputeFence Mark(const Device& device);
  // Never blocks.
  bool Done() const;
  // Blocks the calling thread until the marked work has finished.
  void Wait() const;

 private:
  std::optional<c10::Event> event_;
};

// Makes the compute LibTorch enqueues on `device`'s current stream from now on wait for `event`
// (work Strata enqueued on one of its own streams). Only the calling thread's current stream is
// ordered: compute that reads the result from another stream or thread needs its own wait. On a
// GPU the wait is on the device and the caller goes on at once, unless this LibTorch cannot name
// its current stream's cudaStream_t (a pool stream on 2.6 and older), where it blocks instead.
// On the CPU device, where LibTorch's ops run on the calling thread, it blocks until `event` has
// completed.
Status ComputeWaitFor(Device& device, Event& event);

// A LibTorch pool stream of a CUDA device for the engine's own kernels and LibTorch ops beside
// compute (gradient statistics, the reduce lane's hand-off), so they run beside it instead of
// behind it. A LibTorch whose c10::Stream
// cannot name its cudaStream_t (2.6 and older) gets the default stream instead: correct, but
// serialized with compute. On the CPU device there is none: handle() is null and Synchronize
// returns at once.
class SideStream {
 public:
  explicit SideStream(const Device& device);
  // The cudaStream_t, as kernels::StreamHandle.
  void* handle() const;
  // The stream, for a c10::StreamGuard that sends a thread's LibTorch ops to it; none on CPU.
  const std::optional<c10::Stream>& stream() const { return stream_; }
  void Synchronize() const;

 private:
  std::optional<c10::Stream> stream_;
};

}  // namespace strata
