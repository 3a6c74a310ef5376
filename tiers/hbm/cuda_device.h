// The CUDA device. Built when CUDA is on (cuda_device.cc); a stub (cuda_device_stub.cc) stands in
// otherwise so callers never need #ifdefs.
#pragma once

#include <cstdint>
#include <memory>

#include "runtime/base/device.h"

namespace strata {

// Usable GPUs; 0 on any error, and in builds without CUDA. Never throws.
int CudaDeviceCountImpl();

// Creates device `index`. `capacity` 0 means the GPU's free memory at creation. UNIMPLEMENTED in
// builds without CUDA; UNAVAILABLE when no such GPU exists.
StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int index, uint64_t capacity);

}  // namespace strata
