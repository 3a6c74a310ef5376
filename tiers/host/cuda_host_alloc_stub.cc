// Stands in for cuda_host_alloc.cc in builds without CUDA: the pool then always takes the mmap
// path.
#include "tiers/host/cuda_host_alloc.h"

namespace strata::host_internal {

bool CudaHostAllocAvailable() { return false; }

StatusOr<void*> CudaHostAlloc(uint64_t) {
  return Unimplemented("this build of Strata has no CUDA support: cudaHostAlloc is unavailable");
}

void CudaHostFree(void*) {}

}  // namespace strata::host_internal
