// The CPU twins: the reference the CUDA kernels are tested against, and what Backend::kCpu runs.
// Conversions are optim/dtype.h's scalar ones, Adam is optim::AdamStep itself, and the gradient
// statistics follow the GPU's reduction layout exactly (Note [stats order] in internal.h).
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/internal.h"
#include "optim/cpu_adam.h"
#include "optim/dtype.h"

namespace strata::kernels::internal {
namespace {

inline float LoadGrad(const void* base, DType t, size_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return optim::Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFloat16: return optim::HalfToFloat(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

// The lanes of one block (Note [stats order]): lane t sums i = b*T + t + k*lanes for k = 0, 1,
// ... in order, then the lanes fold with the halving tree. Returns the block's partial sum.
template <DType G>
double StatsBlock(const void* grad, size_t n, float scale, int block, size_t lanes,
                  bool* nonfinite) {
  constexpr int T = kGradStatsThreads;
  double lane[T] = {};
  bool bad = false;
  for (size_t base = static_cast<size_t>(block) * T; base < n; base += lanes) {
    const size_t count = n - base < static_cast<size_t>(T) ? n - base : static_cast<size_t>(T);
    for (size_t t = 0; t < count; ++t) {
      const float x = LoadGrad(grad, G, base + t) * scale;
      bad = bad || !std::isfinite(x);
      lane[t] += static_cast<double>(x) * static_cast<double>(x);
    }
  }
  for (int w = T / 2; w > 0; w /= 2) {
    for (int t = 0; t < w; ++t) lane[t] += lane[t + w];
  }
  *nonfinite = bad;
  return lane[0];
}

template <DType G>
void AccumulateStats(const void* grad, size_t n, float scale, GradStatsAccumulator* acc) {
  constexpr int T = kGradStatsThreads;
  const int blocks = StatsBlocks(n);
  const size_t lanes = static_cast<size_t>(blocks) * T;
  bool block_bad[kGradStatsMaxBlocks] = {};
  // Blocks are independent (each owns its partial slot), so they run in parallel without
  // changing any sum.
  tbb::parallel_for(tbb::blocked_range<int>(0, blocks, 1), [&](const tbb::blocked_range<int>& r) {
    for (int b = r.begin(); b < r.end(); ++b) {
      acc->partial[b] = StatsBlock<G>(grad, n, scale, b, lanes, &block_bad[b]);
    }
  });
  // The final single-block pass.
  double lane[T] = {};
  for (int t = 0; t < T; ++t) {
    for (int b = t; b < blocks; b += T) lane[t] += acc->partial[b];
  }
  for (int w = T / 2; w > 0; w /= 2) {
    for (int t = 0; t < w; ++t) lane[t] += lane[t + w];
  }
  acc->sum_sq += lane[0];
  for (int b = 0; b < blocks; ++b) {
    if (block_bad[b]) acc->found_nonfinite = 1;
  }
}

}  // namespace

void CpuCastFp32To16(const float* src, void* dst, DType dst_dtype, size_t n) {
  auto* out = static_cast<uint16_t*>(dst);
  if (dst_dtype == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) out[i] = optim::FloatToBf16(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = optim::FloatToHalf(src[i]);
  }
}

void CpuCast16ToFp32(const void* src, DType src_dtype, float* dst, size_t n) {
  const auto* in = static_cast<const uint16_t*>(src);
  if (src_dtype == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) dst[i] = optim::Bf16ToFloat(in[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = optim::HalfToFloat(in[i]);
  }
}

void CpuAccumulateGradStats(const void* grad, DType grad_dtype, size_t n, float scale,
                            GradStatsAccumulator* acc) {
  switch (grad_dtype) {
    case DType::kFloat32: AccumulateStats<DType::kFloat32>(grad, n, scale, acc); break;
    case DType::kBFloat16: AccumulateStats<DType::kBFloat16>(grad, n, scale, acc); break;
    case DType::kFloat16: AccumulateStats<DType::kFloat16>(grad, n, scale, acc); break;
  }
}

Status CpuAdamStep(const optim::AdamParams& params, const optim::AdamBuffers& bufs,
                   float grad_scale, const GradStatsAccumulator* skip_if_nonfinite) {
  if (skip_if_nonfinite != nullptr && skip_if_nonfinite->found_nonfinite != 0) {
    return Status::Ok();
  }
  optim::AdamOptions options;
  options.grad_check = optim::GradCheck::kCallerChecked;
  return optim::AdamStep(params, bufs, grad_scale, options).status();
}

void CpuCopySegments(const CopySegment* segs, size_t count) {
  for (size_t k = 0; k < count; ++k) {
    if (segs[k].src == nullptr) {
      std::memset(segs[k].dst, 0, segs[k].bytes);
    } else {
      std::memcpy(segs[k].dst, segs[k].src, segs[k].bytes);
    }
  }
}

}  // namespace strata::kernels::internal
