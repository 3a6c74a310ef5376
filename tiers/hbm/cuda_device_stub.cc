// Stands in for cuda_device.cc in builds without CUDA.
#include "tiers/hbm/cuda_device.h"

namespace strata {

int CudaDeviceCountImpl() { return 0; }

StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int, uint64_t) {
  return Unimplemented(
      "this build of Strata has no CUDA support; rebuild with -DSTRATA_CUDA=ON on a machine with "
      "the CUDA toolkit, or use the cpu device");
}

}  // namespace strata
