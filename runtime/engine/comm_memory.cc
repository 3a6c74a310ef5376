#include "runtime/engine/comm_memory.h"

#include "runtime/engine/compute_fence.h"
#include "runtime/engine/engine.h"

namespace strata {

Status OnCommMemory(Communicator& comm, Device& device, torch::Tensor& host,
                    const std::function<Status(void*)>& collective) {
  if (comm.memory_kind() == MemoryKind::kHost) return collective(host.data_ptr());
  torch::Tensor staged = host.to(TorchDevice(device));
  ComputeFence::Mark(device).Wait();  // the collective's stream does not wait for the copy
  STRATA_RETURN_IF_ERROR(collective(staged.data_ptr()));
  host.copy_(staged);
  return Status::Ok();
}

}  // namespace strata
