// Stands in for cuda_kernels.cu in builds without CUDA (STRATA_CUDA=OFF or no nvcc), so callers
// of Backend::kCuda need no #ifdefs: every entry point says what is missing and what to do.
#include "kernels/internal.h"

namespace strata::kernels {

bool CudaKernelsBuilt() { return false; }

namespace internal {
namespace {

Status NoCuda(const char* what) {
  return Unimplemented(StrCat("kernels: ", what,
                              " on Backend::kCuda: this build has no CUDA kernels (configured "
                              "with STRATA_CUDA=OFF or without nvcc); rebuild with the CUDA "
                              "toolkit on the PATH, or use Backend::kCpu"));
}

}  // namespace

Status CudaCastFp32To16(const float*, void*, DType, size_t, void*) {
  return NoCuda("CastFp32To16");
}
Status CudaCast16ToFp32(const void*, DType, float*, size_t, void*) {
  return NoCuda("Cast16ToFp32");
}
Status CudaResetGradStats(GradStatsAccumulator*, void*) { return NoCuda("ResetGradStats"); }
Status CudaAccumulateGradStats(const void*, DType, size_t, float, GradStatsAccumulator*, void*) {
  return NoCuda("AccumulateGradStats");
}
Status CudaReadGradStats(const GradStatsAccumulator*, double*, uint32_t*, void*) {
  return NoCuda("ReadGradStats");
}
Status CudaAllocAccumulator(GradStatsAccumulator**, void*) { return NoCuda("UnscaleCheckNorm"); }
Status CudaFreeAccumulator(GradStatsAccumulator*, void*) { return NoCuda("UnscaleCheckNorm"); }
Status CudaAdamStep(const AdamLaunch&, void*) { return NoCuda("AdamStep"); }
Status CudaElementwiseStep(const ElementwiseLaunch&, void*) {
  return NoCuda("SgdStep/AdagradStep/LionStep");
}
Status CudaCopySegments(const CopySegment*, size_t, void*) { return NoCuda("PackChunk/UnpackChunk"); }
Status CudaCompactStep(const CompactLaunch&, void*) { return NoCuda("CompactAdamStep/CompactElementwiseStep"); }

}  // namespace internal
}  // namespace strata::kernels
