// The Adagrad and Lion loops compiled for avx512 (see elementwise_kernel_body.inc and
// optim/CMakeLists.txt).
#include "optim/cpu_adagrad.h"
#include "optim/cpu_lion.h"

namespace strata::optim::internal {

#define ISA_SUFFIX Avx512
#include "optim/elementwise_kernel_body.inc"
#undef ISA_SUFFIX

}  // namespace strata::optim::internal
