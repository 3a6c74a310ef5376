// cudaHostAlloc behind a CUDA-free interface: cuda_host_alloc.cc in builds with CUDA,
// cuda_host_alloc_stub.cc otherwise, so the pinned pool never needs an #ifdef.
#pragma once

#include <cstdint>

#include "runtime/base/status.h"

namespace strata::host_internal {

// True when this build has CUDA and at least one GPU is usable. Never throws.
bool CudaHostAllocAvailable();
// Page-locked, portable (visible to every CUDA context) host memory of `bytes`.
StatusOr<void*> CudaHostAlloc(uint64_t bytes);
// Frees memory from CudaHostAlloc; a failure is logged, it cannot be acted on.
void CudaHostFree(void* p);

}  // namespace strata::host_internal
