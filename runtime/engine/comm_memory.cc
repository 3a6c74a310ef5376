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

Status AllReduceScalars(Communicator& comm, Device& device, double* values, int64_t n,
                        ReduceOp op) {
  if (comm.world_size() == 1 || n == 0) return Status::Ok();
  torch::Tensor t = torch::from_blob(values, {n}, torch::kFloat64);  // a view: results land there
  return OnCommMemory(comm, device, t, [&](void* p) {
    return comm.AllReduce(static_cast<double*>(p), n, strata::DType::kF64, op);
  });
}

}  // namespace strata
