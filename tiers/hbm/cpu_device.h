// The CPU device: host memory standing for HBM, with in-order worker streams.
//
// It is first-class, not a mock: CPU-only machines train on it, and every pipeline, partitioner
// and tier test runs on it. Allocations are 64-byte aligned host memory counted against a
// capacity. Each stream owns one worker thread that runs enqueued copies, fills and callbacks in
// order; copies check that device-side ranges lie inside a live allocation of this device, so a
// wrong offset is an error here, as it would be a fault on a GPU.
#pragma once

#include <cstdint>
#include <memory>

#include "runtime/device.h"

namespace strata {

constexpr uint64_t kCpuDeviceDefaultCapacity = uint64_t{4} << 30;

std::unique_ptr<Device> MakeCpuDevice(uint64_t capacity = kCpuDeviceDefaultCapacity);

}  // namespace strata
