// Built when CUDA is off: nccl is a capability this build lacks, and says so.
#include "runtime/comm/backends.h"

namespace strata {

StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const DistEnv&,
                                                               std::shared_ptr<RendezvousStore>,
                                                               double, int) {
  return Unimplemented(
      "strata.comm_backend=nccl: this build has no CUDA/NCCL (configured with STRATA_CUDA=OFF or "
      "without nvcc); rebuild with CUDA or use gloo");
}

}  // namespace strata
