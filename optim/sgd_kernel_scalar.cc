// SGD's update loop compiled for scalar (see sgd_kernel_body.inc and optim/CMakeLists.txt).
#include "optim/cpu_sgd.h"

namespace strata::optim::internal {

#define SGD_BLOCK_NAME SgdBlockScalar
#include "optim/sgd_kernel_body.inc"
#undef SGD_BLOCK_NAME

}  // namespace strata::optim::internal
