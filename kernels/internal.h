// Internal to kernels/: what kernels.cc (validation, dispatch) hands to the two backends.
// Arguments arriving here are already validated. Free of CUDA and TBB headers: the CUDA
// sources include it.
//
// Note [stats order]
// AccumulateGradStats must give a deterministic sum, and the CPU twin must give the very same
// double as the GPU so that a run on either device clips identically. Both therefore use one
// fixed reduction layout that depends only on n:
//   blocks = StatsBlocks(n), lanes = blocks * kGradStatsThreads.
//   Lane l (thread t of block b, l = b * kGradStatsThreads + t) sums x*x over i = l, l + lanes,
//   l + 2 * lanes, ... in that order, starting from 0.0.
//   Each block folds its lanes with a halving tree: for w = T/2, T/4, ..., 1: s[t] += s[t + w]
//   (t < w), leaving partial[b] = s[0].
//   One final block of T lanes sums partial[t], partial[t + T], ... in order, folds them with
//   the same tree, and adds the result to acc->sum_sq.
// x*x is exact in double (24-bit significands), so a fused multiply-add and a separate multiply
// and add round the same; only the order of additions matters, and it is fixed.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/grad_stats.h"
#include "optim/adam_kernels.h"
#include "optim/dtype.h"
#include "optim/elementwise_rules.h"
#include "runtime/base/status.h"

namespace strata::optim {
struct AdamParams;
struct AdamBuffers;
}  // namespace strata::optim

namespace strata::kernels {
// Declared in kernels.h too; repeated here for the CUDA source and its stub, which define it
// and do not include kernels.h (it pulls in TBB through optim/cpu_adam.h).
bool CudaKernelsBuilt();
}  // namespace strata::kernels

namespace strata::kernels::internal {

using optim::DType;

// ---- Reduction layout (Note [stats order]) ----
inline constexpr int kGradStatsThreads = 256;    // lanes per block; a power of two
inline constexpr size_t kGradStatsPerLane = 8;   // elements per lane before adding blocks

inline int StatsBlocks(size_t n) {
  const size_t per_block = kGradStatsThreads * kGradStatsPerLane;
  const size_t blocks = (n + per_block - 1) / per_block;
  if (blocks < 1) return 1;
  return blocks > static_cast<size_t>(kGradStatsMaxBlocks) ? kGradStatsMaxBlocks
                                                            : static_cast<int>(blocks);
}

// ---- Adam ----
// The scalar constants of one step: optim's, so the GPU kernel starts from exactly the values
// the CPU Adam uses (optim::internal::MakeAdamConsts).
using AdamConsts = optim::internal::AdamConsts;

struct AdamLaunch {
  AdamConsts c;
  float* master;
  const void* grad;
  DType grad_dtype;
  void* exp_avg;
  void* exp_avg_sq;
  DType state_dtype;
  void* param16;  // null: no 16-bit copy
  DType param16_dtype;
  size_t n;
  const GradStatsAccumulator* skip_if_nonfinite;  // null: never skip
};

// ---- SGD, Adagrad, Lion ----
// One element-wise update on fp32 buffers: `state` is SGD's momentum buffer (null without
// momentum), Adagrad's sum or Lion's exp_avg; param16 (null: none) gets the new values in
// param16_dtype. The constants are optim's (optim::internal::Make*Consts).
enum class ElementwiseRule : int { kSgd = 0, kAdagrad = 1, kLion = 2 };
struct ElementwiseLaunch {
  ElementwiseRule rule;
  optim::internal::SgdConsts sgd;
  optim::internal::AdagradConsts adagrad;
  optim::internal::LionConsts lion;
  float* master;
  const float* grad;
  float* state;
  void* param16;
  DType param16_dtype;
  size_t n;
};

// ---- Compact layouts (optim/compact_step.h) ----
// One update of a shard in a compact layout, as optim::CompactAdamStep / CompactElementwiseStep
// run it on the CPU: the shard in blocks of kCompactBlock elements (optim::kInt8Block, checked
// in kernels.cc), each block's runs updated with their own constants, every held state of a
// block with a run narrowed back into its format. The formats are optim's enums' values.
inline constexpr size_t kCompactBlock = 256;
enum class CompactRule : int { kAdam = 0, kSgd = 1, kAdagrad = 2, kLion = 3 };
struct CompactRun {
  uint64_t begin;       // first element of the run in the shard
  uint64_t size;
  uint64_t index_base;  // the model-wide index of element `begin` (the rounding bits' counter)
  AdamConsts adam;
  optim::internal::SgdConsts sgd;
  optim::internal::AdagradConsts adagrad;
  optim::internal::LionConsts lion;
};
struct CompactLaunch {
  CompactRule rule;
  int master_format;  // optim::MasterFormat: 0 fp32, 1 bf16 nearest, 2 bf16 stochastic
  int moment_format;  // optim::MomentFormat: 0 fp32, 1 bf16, 2 int8
  void* master;
  const void* grad;
  DType grad_dtype;
  void* exp_avg;      // null where the optimizer keeps no such state
  void* exp_avg_sq;
  void* param16;      // null: none (fp32 master only)
  DType param16_dtype;
  size_t n;
  size_t int8_scale_offset;  // optim::Int8ScaleOffset(n): where an 8-bit state's scales start
  uint32_t rounding_key;
  // Host memory, read before the launcher returns: the runs (sorted, disjoint), and for 8-bit
  // moments the dynamic maps and midpoints ([0] signed for exp_avg, [1] unsigned for exp_avg_sq)
  // with the code of zero of each.
  const CompactRun* runs;
  size_t num_runs;
  const float* maps[2];
  const float* mids[2];
  uint8_t zero_code[2];
  const GradStatsAccumulator* skip_if_nonfinite;  // null: never skip
};

// ---- Chunks ----
// One contiguous byte copy; src == nullptr means "fill with zero bytes". PackChunk and
// UnpackChunk are planned on the host (kernels.cc) into a list of these, then executed.
struct CopySegment {
  const void* src;
  void* dst;
  size_t bytes;
};

// ---- CPU twins (cpu_kernels.cc) ----
void CpuCastFp32To16(const float* src, void* dst, DType dst_dtype, size_t n);
void CpuCast16ToFp32(const void* src, DType src_dtype, float* dst, size_t n);
void CpuAccumulateGradStats(const void* grad, DType grad_dtype, size_t n, float scale,
                            GradStatsAccumulator* acc);
// optim::AdamStep (kCallerChecked) unless skip_if_nonfinite is set.
Status CpuAdamStep(const optim::AdamParams& params, const optim::AdamBuffers& bufs,
                   float grad_scale, const GradStatsAccumulator* skip_if_nonfinite);
void CpuCopySegments(const CopySegment* segs, size_t count);

// ---- CUDA (cuda_kernels.cu, or cuda_stub.cc: UNIMPLEMENTED) ----
// All asynchronous on `stream` (a cudaStream_t).
Status CudaCastFp32To16(const float* src, void* dst, DType dst_dtype, size_t n, void* stream);
Status CudaCast16ToFp32(const void* src, DType src_dtype, float* dst, size_t n, void* stream);
Status CudaResetGradStats(GradStatsAccumulator* acc, void* stream);
Status CudaAccumulateGradStats(const void* grad, DType grad_dtype, size_t n, float scale,
                               GradStatsAccumulator* acc, void* stream);
// Copies sum_sq and found_nonfinite to the host and synchronizes the stream.
Status CudaReadGradStats(const GradStatsAccumulator* acc, double* sum_sq, uint32_t* flag,
                         void* stream);
// Device scratch for the one-shot UnscaleCheckNorm (stream-ordered allocation).
Status CudaAllocAccumulator(GradStatsAccumulator** acc, void* stream);
Status CudaFreeAccumulator(GradStatsAccumulator* acc, void* stream);
Status CudaAdamStep(const AdamLaunch& launch, void* stream);
Status CudaElementwiseStep(const ElementwiseLaunch& launch, void* stream);
Status CudaCopySegments(const CopySegment* segs, size_t count, void* stream);
// cuda_compact_kernels.cu: copies the runs (and maps) into stream-ordered device memory, launches
// one kernel and frees the copy after it, all on `stream`.
Status CudaCompactStep(const CompactLaunch& launch, void* stream);

}  // namespace strata::kernels::internal
