// CPU SGD: torch.optim.SGD's update on raw fp32 pointers, vectorized per ISA.
//
// Per element i, in fp32 arithmetic, with g = grad[i] * grad_scale:
//   g   += weight_decay * p                           (when weight_decay != 0: L2, as torch)
//   with momentum != 0:
//     buf  = first ? g : momentum * buf + (1 - dampening) * g   (torch starts buf at g)
//     g    = nesterov ? g + momentum * buf : buf
//   p   -= lr * g
// and, when param16 is set, param16[i] = round-to-nearest-even(p) in bf16/fp16.
//
// The loop is one source compiled once per ISA (sgd_kernel_body.inc), chosen by cpuid as the
// Adam kernels are; each case (momentum, nesterov, first step, decay) has its own loop, so none
// branches per element. -ffp-contract=off keeps multiply and add unfused, as torch's CPU ops.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/blockwise.h"
#include "optim/cpu_adam.h"
#include "optim/dtype.h"
#include "optim/elementwise_rules.h"
#include "runtime/base/status.h"

namespace strata::optim {

struct SgdParams {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  bool first = true;  // the first update: the momentum buffer starts at the gradient
};

struct SgdBuffers {
  float* master = nullptr;        // fp32 parameters, updated in place
  const float* grad = nullptr;    // fp32 gradients, read only
  float* momentum = nullptr;      // fp32 momentum buffer; may be null when momentum == 0
  void* param16 = nullptr;        // optional 16-bit copy of the new values
  DType param16_dtype = DType::kBFloat16;
  size_t n = 0;
};

using SgdOptions = ElementwiseOptions;

// The argument checks SgdStep runs first (the rules listed below), for callers that run the
// update elsewhere (kernels::SgdStep on a GPU).
Status CheckSgdArguments(const SgdParams& params, const SgdBuffers& bufs, float grad_scale);

// One update of `bufs`. INVALID_ARGUMENT, nothing written: null buffers with n > 0, lr,
// momentum, dampening or weight_decay negative or not finite, nesterov without momentum or
// with dampening (torch's rule), a param16 dtype other than bf16/fp16, grad_scale not finite or
// negative, an isa this CPU cannot run. Returns the ISA that ran. Blocks until done.
StatusOr<Isa> SgdStep(const SgdParams& params, const SgdBuffers& bufs, float grad_scale,
                      const SgdOptions& options = {});

// The same update, one element at a time in plain C++: the reference the tests compare with.
void SgdReference(const SgdParams& params, const SgdBuffers& bufs, float grad_scale);

namespace internal {
// One block of the update, [0, n) of the given pointers, for each ISA (sgd_kernel_*.cc).
SgdConsts MakeSgdConsts(const SgdParams& params, float grad_scale);
void SgdBlockScalar(const SgdConsts& c, float* p, const float* g, float* buf, size_t n);
void SgdBlockAvx2(const SgdConsts& c, float* p, const float* g, float* buf, size_t n);
void SgdBlockAvx512(const SgdConsts& c, float* p, const float* g, float* buf, size_t n);
}  // namespace internal

}  // namespace strata::optim
