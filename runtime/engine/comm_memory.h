// OnCommMemory: a collective on a host tensor's bytes wherever the communicator reaches them: in
// place for a host-memory one (Gloo, single), through a device copy for NCCL, which takes device
// buffers only; the result is written back into `host`. `collective` gets the address to pass
// the communicator. Caller's thread; it orders itself among the rank's collectives.
#pragma once

#include <functional>

#include <torch/torch.h>

#include "runtime/base/device.h"
#include "runtime/base/status.h"
#include "runtime/comm/communicator.h"

namespace strata {

Status OnCommMemory(Communicator& comm, Device& device, torch::Tensor& host,
                    const std::function<Status(void*)>& collective);

// The `n` host doubles at `values`, reduced in place over the ranks by `op` through
// OnCommMemory: the one-number agreements (a norm, a flag, a loss) each rank makes in step.
// A world of one leaves them as they are.
Status AllReduceScalars(Communicator& comm, Device& device, double* values, int64_t n, ReduceOp op);

}  // namespace strata
