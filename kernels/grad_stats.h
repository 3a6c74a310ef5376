// The running totals of the fused gradient pass (kernels/kernels.h: AccumulateGradStats).
// Kept free of CUDA and TBB headers so the CUDA sources can include it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::kernels {

// Upper bound on the blocks (of kGradStatsThreads lanes each) one AccumulateGradStats call
// splits its shard into; each block leaves one partial sum in the accumulator's workspace.
inline constexpr int kGradStatsMaxBlocks = 1024;

// Lives in the backend's memory: host memory for Backend::kCpu, device memory for
// Backend::kCuda (cudaMalloc'd by the caller, sizeof(GradStatsAccumulator) bytes). Plain data:
// zero it with ResetGradStats (or a memset) before the first shard of a step.
struct GradStatsAccumulator {
  // SUM: of x*x over every shard accumulated since the last reset, x = grad * scale, in double.
  // Meaningless (may be inf or NaN) once found_nonfinite is set.
  double sum_sq;
  // FLAG: nonzero once some x was inf or NaN.
  uint32_t found_nonfinite;
  uint32_t reserved;
  // Workspace for the per-block partial sums of the call in flight; not a result.
  double partial[kGradStatsMaxBlocks];
};

}  // namespace strata::kernels
