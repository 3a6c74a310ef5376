// Built when LibTorch lacks Gloo headers (libgloo-dev missing): gloo is unavailable, and says so.
#include "runtime/comm/backends.h"

namespace strata {

namespace {
constexpr const char* kNoGloo =
    "this build has no c10d Gloo (install libgloo-dev and reconfigure) ";
}

bool GlooAvailable() { return false; }

StatusOr<std::shared_ptr<RendezvousStore>> ConnectTcpStore(const DistEnv&, double) {
  return Unimplemented(StrCat("TCPStore rendezvous: ", kNoGloo));
}

StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(const DistEnv&, double) {
  return Unimplemented(StrCat("strata.comm_backend=gloo: ", kNoGloo));
}

}  // namespace strata
