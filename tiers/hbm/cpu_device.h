// The CPU device: host memory standing for HBM, with in-order worker streams.
//
// It is first-class, not a mock: CPU-only machines train on it, and every pipeline, partitioner
// and tier test runs on it. Allocations are 64-byte aligned host memory counted against a
// capacity (in kStrict mode, a memfd mapped twice: see CpuDeviceMemory). Each stream owns one worker thread that runs enqueued copies, fills and callbacks in
// order; copies check that device-side ranges lie inside a live allocation of this device, so a
// wrong offset is an error here, as it would be a fault on a GPU.
#pragma once

#include <cstdint>
#include <memory>

#include "runtime/base/device.h"

namespace strata {

constexpr uint64_t kCpuDeviceDefaultCapacity = uint64_t{4} << 30;

// How the CPU device's memory behaves towards the host.
// - kPlain: allocations are ordinary host memory; the host may read what it should not. Fast:
//   the default for training on CPU-only machines.
// - kStrict: the address Allocate returns cannot be dereferenced by the host (SIGSEGV), as a
//   GPU's memory cannot; only the device's copies and fills and its compute address
//   (Device::ComputeAddress) reach the bytes. The test suite runs in this mode so that a host
//   access to device memory fails on CPU as it would on a GPU (Note [strict device memory]).
enum class CpuDeviceMemory { kPlain, kStrict };

// kStrict when the environment sets STRATA_CPU_DEVICE=strict (ctest does for every test), else
// kPlain.
CpuDeviceMemory DefaultCpuDeviceMemory();

std::unique_ptr<Device> MakeCpuDevice(uint64_t capacity = kCpuDeviceDefaultCapacity,
                                      CpuDeviceMemory memory = DefaultCpuDeviceMemory());

}  // namespace strata
