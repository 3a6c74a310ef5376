// Making a Device from its spec. The factory lives with the devices it makes (the CPU device
// and the CUDA one), above the Device interface of runtime/base.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "runtime/base/device.h"

namespace strata {

// Number of usable CUDA devices. Never throws and never fails: any driver or runtime error (no
// driver, no GPU, a CPU-only build) reads as 0.
int CudaDeviceCount();

// Creates a device from a spec: "cpu", "cuda", "cuda:N" or "auto" (CUDA when a GPU is present,
// else the CPU device). "cuda" and "auto" take GPU LOCAL_RANK when the launcher set it, else GPU
// 0. `capacity` bounds allocations in bytes; 0 means the CPU device's default (4 GiB) or the
// whole GPU.
StatusOr<std::unique_ptr<Device>> CreateDevice(const std::string& spec, uint64_t capacity = 0);

// The specs CreateDevice accepts on this machine, e.g. {"cpu"} or {"cpu", "cuda:0"}.
std::vector<std::string> AvailableDevices();

}  // namespace strata
