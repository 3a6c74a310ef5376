// CPU Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023; DeepSpeed's CPU
// Lion implements the same rule) on raw fp32 pointers, vectorized per ISA.
//
// Per element i, in fp32 arithmetic, with g = grad[i] * grad_scale and m the momentum:
//   c  = beta1 * m + (1 - beta1) * g
//   p  = p * (1 - lr * weight_decay)             (decoupled decay; skipped when it is 0)
//   p -= lr * sign(c)                             (sign(0) = 0)
//   m  = beta2 * m + (1 - beta2) * g
// and, when param16 is set, param16[i] = round-to-nearest-even(p) in bf16/fp16. The constants
// (1 - beta, 1 - lr * wd) are computed in double and rounded to fp32 once. The momentum starts
// at zero: the engine keeps it in exp_avg.
//
// One loop source compiled once per ISA (lion_kernel_body.inc), chosen by cpuid; every ISA equals
// LionReference bit for bit (-ffp-contract=off).
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/blockwise.h"
#include "optim/dtype.h"
#include "optim/elementwise_rules.h"
#include "runtime/base/status.h"

namespace strata::optim {

struct LionParams {  // DeepSpeed's defaults
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double weight_decay = 0.0;
};

struct LionBuffers {
  float* master = nullptr;      // fp32 parameters, updated in place
  const float* grad = nullptr;  // fp32 gradients, read only
  float* exp_avg = nullptr;     // fp32 momentum
  void* param16 = nullptr;      // optional 16-bit copy of the new values
  DType param16_dtype = DType::kBFloat16;
  size_t n = 0;
};

// The argument checks LionStep runs first (the rules listed below), for callers that run the
// update elsewhere (kernels::LionStep on a GPU).
Status CheckLionArguments(const LionParams& params, const LionBuffers& bufs, float grad_scale);

// One update of `bufs`. INVALID_ARGUMENT, nothing written: null buffers with n > 0; lr or
// weight_decay negative or not finite; a beta outside [0, 1); a param16 dtype other than
// bf16/fp16; grad_scale not finite or negative; an isa this CPU cannot run. Returns the ISA
// that ran. Blocks until done.
StatusOr<Isa> LionStep(const LionParams& params, const LionBuffers& bufs, float grad_scale,
                       const ElementwiseOptions& options = {});

// The same update one element at a time in plain C++: the reference the tests compare with.
void LionReference(const LionParams& params, const LionBuffers& bufs, float grad_scale);

namespace internal {
LionConsts MakeLionConsts(const LionParams& params, float grad_scale);
void LionBlockScalar(const LionConsts& c, float* p, const float* g, float* m, size_t n);
void LionBlockAvx2(const LionConsts& c, float* p, const float* g, float* m, size_t n);
void LionBlockAvx512(const LionConsts& c, float* p, const float* g, float* m, size_t n);
}  // namespace internal

}  // namespace strata::optim
