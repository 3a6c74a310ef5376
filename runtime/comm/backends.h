// Constructors of the communicator backends and the factory that picks one from the config and
// the environment. Lives in strata_comm (LibTorch, NCCL); the interface stays in communicator.h.
#pragma once

#include <memory>
#include <string>

#include "runtime/comm/communicator.h"

namespace strata {

struct CommOptions {
  std::string backend = "auto";  // auto | single | gloo | nccl (StrataConfig::comm_backend)
  std::string device = "cpu";    // cpu | cuda: picks nccl over gloo for `auto` with > 1 rank
  double timeout_s = 300;        // StrataConfig::comm_timeout_s: store, rendezvous, every collective
  BucketSizes buckets;           // from ZeroConfig::{allgather,reduce}_bucket_size
  int cuda_device = -1;          // nccl: the GPU to use; -1 picks LOCAL_RANK
};

// auto = single when WORLD_SIZE is unset or 1; otherwise nccl when device == "cuda", else gloo.
// Reads the rank environment (ReadDistEnv). Errors name the offending option or variable.
StatusOr<std::unique_ptr<Communicator>> CreateCommunicator(const CommOptions& options);

// Connects to (rank 0: serves) the c10d TCPStore at MASTER_ADDR:MASTER_PORT. Rank 0 waits for all
// ranks to connect; every rank gives up with DEADLINE_EXCEEDED/UNAVAILABLE after `timeout_s`.
StatusOr<std::shared_ptr<RendezvousStore>> ConnectTcpStore(const DistEnv& env, double timeout_s);

// Whether this build has c10d Gloo (its headers were there at configure time); without it the
// two functions below return UNIMPLEMENTED.
bool GlooAvailable();

// c10d ProcessGroupGloo over a TCPStore; host buffers. The Gloo device binds to 127.0.0.1 when
// MASTER_ADDR is a loopback address, to GLOO_SOCKET_IFNAME when set, else to this host's name.
StatusOr<std::unique_ptr<Communicator>> CreateGlooCommunicator(const DistEnv& env,
                                                               double timeout_s);

// NCCL on a private stream of `cuda_device`; device buffers. The ncclUniqueId travels through
// `store`. UNIMPLEMENTED in builds without CUDA; FAILED_PRECONDITION without a usable GPU.
StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(
    const DistEnv& env, std::shared_ptr<RendezvousStore> store, double timeout_s, int cuda_device);

// An in-process store for a single rank (tests of nccl with world size 1).
std::shared_ptr<RendezvousStore> CreateInProcessStore(double timeout_s);

// The notes of ranks that gave up (Note [giving up] in communicator.cc), for the backends'
// AbortImpl and PeerAbortNotes. Publishing writes rank `rank`'s note and waits until the store
// has it; store errors are dropped (the note is a courtesy: closing the connections is what
// releases the peers). Reading returns every other rank's note, "; "-joined, "" when none or
// when the store cannot be read.
void PublishAbortNote(RendezvousStore& store, int rank, const std::string& note);
std::string ReadAbortNotes(RendezvousStore& store, int rank, int world_size);

}  // namespace strata
