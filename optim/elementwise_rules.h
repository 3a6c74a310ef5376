// The per-element rules of the element-wise optimizers (SGD, Adagrad, Lion) and their per-step
// constants, shared by the CPU loops (optim/*_kernel_body.inc), the scalar references and the
// CUDA kernels (kernels/cuda_kernels.cu): one definition of each update, so the paths agree
// bit for bit as long as none of them fuses a multiply and an add (-ffp-contract=off on the CPU,
// --fmad=false on the GPU) and sqrt and division are correctly rounded (both are, by default).
// The operation order is torch.optim's (see cpu_sgd.h, cpu_adagrad.h, cpu_lion.h for the
// formulas). No LibTorch and no oneTBB here: nvcc includes this header.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__
#else
#define STRATA_HOST_DEVICE
#endif

namespace strata::optim::internal {

// Constants of one step, computed in double and rounded to float once (Make*Consts).
struct SgdConsts {
  float lr, momentum, one_minus_dampening, weight_decay, grad_scale;
  bool has_momentum, nesterov, first, has_decay;
};
struct AdagradConsts {
  float clr, eps, weight_decay, grad_scale;  // clr = lr / (1 + (step - 1) * lr_decay)
  bool has_decay;
};
struct LionConsts {
  float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay_factor, grad_scale;
  bool has_decay;  // decay_factor = 1 - lr * weight_decay
};

// SGD: buf is the momentum buffer (unused without momentum).
STRATA_HOST_DEVICE inline void SgdElement(const SgdConsts& c, float& p, float graw, float& buf) {
  float d = graw * c.grad_scale;
  if (c.has_decay) d = d + c.weight_decay * p;
  if (!c.has_momentum) {
    p = p - c.lr * d;
    return;
  }
  float b;
  if (c.first) {
    b = d;  // torch starts the buffer at the gradient
  } else if (c.one_minus_dampening != 1.0f) {
    b = c.momentum * buf + c.one_minus_dampening * d;
  } else {
    b = c.momentum * buf + d;
  }
  buf = b;
  p = c.nesterov ? p - c.lr * (d + c.momentum * b) : p - c.lr * b;
}

// Adagrad: sum is the running sum of squared gradients.
STRATA_HOST_DEVICE inline void AdagradElement(const AdagradConsts& c, float& p, float graw,
                                              float& sum) {
  float d = graw * c.grad_scale;
  if (c.has_decay) d = d + c.weight_decay * p;
  sum = sum + d * d;
  const float denom = sqrtf(sum) + c.eps;
  p = p - c.clr * (d / denom);
}

// Lion: m is the momentum. sign(0) = 0, as torch.sign.
STRATA_HOST_DEVICE inline void LionElement(const LionConsts& c, float& p, float graw, float& m) {
  const float d = graw * c.grad_scale;
  const float u = c.beta1 * m + c.one_minus_beta1 * d;
  if (c.has_decay) p = p * c.decay_factor;
  const float s = u > 0.0f ? 1.0f : (u < 0.0f ? -1.0f : 0.0f);
  p = p - c.lr * s;
  m = c.beta2 * m + c.one_minus_beta2 * d;
}

}  // namespace strata::optim::internal
