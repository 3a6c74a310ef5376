// SGD's update loop compiled for avx2 (see sgd_kernel_body.inc and optim/CMakeLists.txt).
#include "optim/cpu_sgd.h"

namespace strata::optim::internal {

#define SGD_BLOCK_NAME SgdBlockAvx2
#include "optim/sgd_kernel_body.inc"
#undef SGD_BLOCK_NAME

}  // namespace strata::optim::internal
