// Internal to optim/: the per-ISA kernels behind AdamStep and UnscaleCheckNorm.
//
// Each ISA lives in its own translation unit compiled with that ISA's flags
// (optim/CMakeLists.txt); only cpu_adam.cc, compiled for baseline x86-64, calls into them and
// only after checking the CPU supports them. Kernels work on [begin, end) of the buffers and are
// called concurrently on disjoint ranges.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "optim/dtype.h"

namespace strata::optim {
struct AdamParams;
enum class Isa : uint8_t;
}  // namespace strata::optim

namespace strata::optim::internal {

// Scalar constants of one step, rounded to float once (see cpu_adam.h).
struct AdamConsts {
  float grad_scale;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float neg_step_size;    // -lr / bc1
  float inv_sqrt_bc2;     // 1 / sqrt(bc2)
  float l2;               // Adam: weight_decay; AdamW: 0
  float decay;            // AdamW: 1 - lr * weight_decay; Adam: 1
  bool has_l2;
  bool has_decay;
};

// The constants of one step for `p`, computed in double and rounded to float once (the CUDA
// kernels in kernels/ use the same function, so CPU and GPU start from identical constants).
AdamConsts MakeAdamConsts(const strata::optim::AdamParams& p, float grad_scale);

struct AdamKernelArgs {
  AdamConsts c;
  float* master;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  void* param16;  // null: no 16-bit copy
};

// Which 16-bit copy of the parameters a kernel writes.
enum class P16 : int { kNone = 0, kBf16 = 1, kFp16 = 2 };

using AdamKernelFn = void (*)(const AdamKernelArgs& args, size_t begin, size_t end);

struct GradPartial {
  double sum_sq = 0.0;
  bool nonfinite = false;
};
using GradStatsFn = GradPartial (*)(const void* grad, float scale, size_t begin, size_t end);

// The per-element update. Every vector kernel performs exactly this sequence of IEEE
// operations lane by lane, which is why the paths agree bit for bit; change one, change all.
inline void AdamElement(const AdamConsts& c, float& p, float graw, float& m, float& v) {
  float g = graw * c.grad_scale;
  if (c.has_l2) g = std::fma(c.l2, p, g);
  if (c.has_decay) p = p * c.decay;
  m = std::fma(c.beta1, m, c.one_minus_beta1 * g);
  v = std::fma(c.beta2, v, c.one_minus_beta2 * (g * g));
  const float denom = std::fma(std::sqrt(v), c.inv_sqrt_bc2, c.eps);
  p = std::fma(c.neg_step_size, m / denom, p);
}

// Kernel lookup per ISA; null when the dtype combination has no kernel (cpu_adam.cc validates
// dtypes first, so null there is a bug). state_dtype is fp32 or bf16.
AdamKernelFn GetAdamKernelScalar(DType grad, DType state, P16 p16);
AdamKernelFn GetAdamKernelAvx2(DType grad, DType state, P16 p16);
// prefetch: software prefetch of the read streams (Note [prefetch] in adam_kernel_avx512.cc).
AdamKernelFn GetAdamKernelAvx512(DType grad, DType state, P16 p16, bool bf16_insn, bool prefetch);

// The kernel of a resolved ISA (never kAuto): one of the three lookups above.
AdamKernelFn PickAdamKernel(Isa isa, DType grad, DType state, P16 p16, bool prefetch);

GradStatsFn GetGradStatsScalar(DType grad);
GradStatsFn GetGradStatsAvx2(DType grad);
GradStatsFn GetGradStatsAvx512(DType grad);

}  // namespace strata::optim::internal
