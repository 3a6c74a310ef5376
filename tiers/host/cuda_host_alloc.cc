// The CUDA side of the pinned pool (compiled only when the build has CUDA).
#include "tiers/host/cuda_host_alloc.h"

#include <cuda_runtime_api.h>

#include "runtime/base/logging.h"
#include "runtime/base/cuda_check.h"
#include "tiers/hbm/cuda_device.h"

namespace strata::host_internal {

bool CudaHostAllocAvailable() { return CudaDeviceCountImpl() > 0; }

StatusOr<void*> CudaHostAlloc(uint64_t bytes) {
  void* p = nullptr;
  // Portable: the engine may copy from any device context it creates later.
  STRATA_RETURN_IF_ERROR(CudaToStatus(cudaHostAlloc(&p, bytes, cudaHostAllocPortable),
                                      "cudaHostAlloc for the pinned host pool"));
  return p;
}

void CudaHostFree(void* p) {
  Status s = CudaToStatus(cudaFreeHost(p), "cudaFreeHost of the pinned host pool");
  if (!s.ok()) STRATA_LOG(WARN) << s.ToString();
}

}  // namespace strata::host_internal
