#include "runtime/engine/compute_fence.h"

#include <thread>
#include <type_traits>
#include <utility>

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace strata {

namespace {

c10::Device TorchDevice(const Device& device) {
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device.index()));
}

}  // namespace

ComputeFence ComputeFence::Mark(const Device& device) {
  ComputeFence f;
  if (device.kind() != DeviceKind::kCuda) return f;
  const c10::Device d = TorchDevice(device);
  const c10::Stream current = c10::impl::getDeviceGuardImpl(d.type())->getStream(d);
  f.event_.emplace(d.type());
  f.event_->record(current);
  return f;
}

bool ComputeFence::Done() const { return !event_ || event_->query(); }

void ComputeFence::Wait() const {
  // c10::Event has no blocking wait in every LibTorch this builds against; a fence is waited
  // for rarely and briefly (the tail of the compute already queued).
  while (!Done()) std::this_thread::yield();
}

namespace {

// c10::Stream::native_handle exists in recent LibTorch 2.x only (2.11 has it, 2.6 does not).
template <typename S, typename = void>
struct HasNativeHandle : std::false_type {};
template <typename S>
struct HasNativeHandle<S, std::void_t<decltype(std::declval<const S&>().native_handle())>>
    : std::true_type {};

template <typename S>
void* NativeHandle(const S& s) {
  if constexpr (HasNativeHandle<S>::value) return s.native_handle();
  else return nullptr;
}

}  // namespace

Status ComputeWaitFor(Device& device, Event& event) {
  if (device.kind() != DeviceKind::kCuda) return device.OrderForeignStream(nullptr, event);
  const c10::Device d = TorchDevice(device);
  const c10::Stream current = c10::impl::getDeviceGuardImpl(d.type())->getStream(d);
  if constexpr (HasNativeHandle<c10::Stream>::value) {
    return device.OrderForeignStream(NativeHandle(current), event);
  } else {
    // Without native_handle only the default stream (id 0: the legacy stream, handle null) can
    // be named.
    if (current.id() == 0) return device.OrderForeignStream(nullptr, event);
    return event.Synchronize();
  }
}

SideStream::SideStream(const Device& device) {
  if (device.kind() != DeviceKind::kCuda) return;
  const c10::Device d = TorchDevice(device);
  const auto* impl = c10::impl::getDeviceGuardImpl(d.type());
  // A pool stream when its cudaStream_t can be named; otherwise the default stream, whose handle
  // is null (what the kernels take for it), so Synchronize waits for the work they enqueued.
  stream_.emplace(HasNativeHandle<c10::Stream>::value ? impl->getStreamFromGlobalPool(d)
                                                      : impl->getDefaultStream(d));
}

void* SideStream::handle() const { return stream_ ? NativeHandle(*stream_) : nullptr; }

void SideStream::Synchronize() const {
  if (stream_) stream_->synchronize();
}

}  // namespace strata
