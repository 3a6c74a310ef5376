// The Adam/AdamW update of one element on the GPU: optim::internal::AdamElement
// (optim/adam_kernels.h), operation for operation, with fmaf, correctly rounded sqrtf and '/'
// (the kernels/ CUDA target never uses --use_fast_math and is compiled with --fmad=false, so
// nvcc fuses nothing on its own). Both the fp32-state Adam kernel and the compact-layout kernel
// call it, so they cannot drift apart. Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include "optim/adam_kernels.h"

namespace strata::kernels::internal {

__device__ __forceinline__ void DevAdamElement(const optim::internal::AdamConsts& c, float& p,
                                               float graw, float& m, float& v) {
  float g = graw * c.grad_scale;
  if (c.has_l2) g = fmaf(c.l2, p, g);
  if (c.has_decay) p = p * c.decay;
  m = fmaf(c.beta1, m, c.one_minus_beta1 * g);
  v = fmaf(c.beta2, v, c.one_minus_beta2 * (g * g));
  const float denom = fmaf(sqrtf(v), c.inv_sqrt_bc2, c.eps);
  p = fmaf(c.neg_step_size, m / denom, p);
}

}  // namespace strata::kernels::internal
