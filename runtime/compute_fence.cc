#include "runtime/compute_fence.h"

#include <thread>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/version.h>

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

SideStream::SideStream(const Device& device) {
  if (device.kind() != DeviceKind::kCuda) return;
  const c10::Device d = TorchDevice(device);
  stream_.emplace(c10::impl::getDeviceGuardImpl(d.type())->getStreamFromGlobalPool(d));
}

void* SideStream::handle() const {
#if TORCH_VERSION_MAJOR >= 2
  return stream_ ? stream_->native_handle() : nullptr;
#else
  return nullptr;  // LibTorch 1.x: the legacy default stream, ordered with every other
#endif
}

void SideStream::Synchronize() const {
  if (stream_) stream_->synchronize();
}

}  // namespace strata
