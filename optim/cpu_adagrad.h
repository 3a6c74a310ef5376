// CPU Adagrad: torch.optim.Adagrad's update (DeepSpeed's CPU Adagrad is the same rule without
// lr_decay) on raw fp32 pointers, vectorized per ISA.
//
// Per element i at step t (1-based), in fp32 arithmetic, with g = grad[i] * grad_scale:
//   g    += weight_decay * p                     (when weight_decay != 0: L2, as torch)
//   clr   = lr / (1 + (t - 1) * lr_decay)         (in double, then rounded to fp32 once)
//   sum  += g * g
//   p    -= clr * (g / (sqrt(sum) + eps))
// and, when param16 is set, param16[i] = round-to-nearest-even(p) in bf16/fp16. The sum starts
// at zero (torch's initial_accumulator_value = 0): the engine keeps it in exp_avg_sq.
//
// One loop source compiled once per ISA (adagrad_kernel_body.inc), chosen by cpuid; sqrt and
// division are correctly rounded in every ISA and -ffp-contract=off keeps multiply and add
// unfused, so every ISA equals AdagradReference bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/blockwise.h"
#include "optim/cpu_adam.h"
#include "optim/dtype.h"
#include "optim/elementwise_rules.h"
#include "runtime/base/status.h"

namespace strata::optim {

struct AdagradParams {
  double lr = 1e-2;
  double lr_decay = 0.0;
  double eps = 1e-10;
  double weight_decay = 0.0;
  int64_t step = 1;  // 1 for the first update
};

struct AdagradBuffers {
  float* master = nullptr;      // fp32 parameters, updated in place
  const float* grad = nullptr;  // fp32 gradients, read only
  float* sum = nullptr;         // fp32 running sum of squared gradients
  void* param16 = nullptr;      // optional 16-bit copy of the new values
  DType param16_dtype = DType::kBFloat16;
  size_t n = 0;
};

// The argument checks AdagradStep runs first (the rules listed below), for callers that run the
// update elsewhere (kernels::AdagradStep on a GPU).
Status CheckAdagradArguments(const AdagradParams& params, const AdagradBuffers& bufs, float grad_scale);

// One update of `bufs`. INVALID_ARGUMENT, nothing written: null buffers with n > 0; lr,
// lr_decay or weight_decay negative or not finite; eps not finite or <= 0; step < 1; a param16
// dtype other than bf16/fp16; grad_scale not finite or negative; an isa this CPU cannot run.
// Returns the ISA that ran. Blocks until done.
StatusOr<Isa> AdagradStep(const AdagradParams& params, const AdagradBuffers& bufs,
                          float grad_scale, const ElementwiseOptions& options = {});

// The same update one element at a time in plain C++: the reference the tests compare with.
void AdagradReference(const AdagradParams& params, const AdagradBuffers& bufs, float grad_scale);

namespace internal {
AdagradConsts MakeAdagradConsts(const AdagradParams& params, float grad_scale);
void AdagradBlockScalar(const AdagradConsts& c, float* p, const float* g, float* sum, size_t n);
void AdagradBlockAvx2(const AdagradConsts& c, float* p, const float* g, float* sum, size_t n);
void AdagradBlockAvx512(const AdagradConsts& c, float* p, const float* g, float* sum, size_t n);
}  // namespace internal

}  // namespace strata::optim
