// Writing parameter values back into the partitions (Engine::WriteParameters): what a writable
// gather (GatheredParameters with a modifier rank) does on exit, between steps.
#include <unordered_map>

#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

Status Engine::Impl::WriteParameters(const std::vector<torch::Tensor>& tensors) {
  if (step_.step_open) return FailedPrecondition("WriteParameters during a step: write between steps");
  STRATA_RETURN_IF_ERROR(FinishUpdates());
  std::unordered_map<const c10::TensorImpl*, int64_t> id_of;
  for (size_t p = 0; p < params_.size(); ++p) id_of[params_[p].tensor.unsafeGetTensorImpl()] = p;
  // Each written parameter's full value in fp32 on the host, read through LibTorch (the device's
  // own compute reads a gathered parameter; the host never touches device memory directly).
  std::map<int64_t, std::vector<std::pair<int64_t, torch::Tensor>>> by_chunk;
  {
    torch::NoGradGuard ng;
    for (const torch::Tensor& t : tensors) {
      auto it = id_of.find(t.unsafeGetTensorImpl());
      if (it == id_of.end())
        return InvalidArgument(StrCat("a tensor of shape ", t.sizes(), " is not a parameter the "
                                      "engine trains: only those can be written back"));
      const int64_t pid = it->second;
      if (t.numel() != partitioner_->location(pid).numel || (t.numel() > 0 && !t.has_storage()) ||
          (t.numel() > 0 && t.data_ptr() == nullptr)) {
        return FailedPrecondition(StrCat("parameter '", partitioner_->param_name(pid),
                                         "' is not gathered: write it inside GatheredParameters"));
      }
      torch::Tensor host = t.detach().to(torch::kCPU, torch::kFloat32).contiguous().view({-1});
      by_chunk[partitioner_->location(pid).chunk].push_back({pid, host});
    }
  }
  const size_t esize = optim::DTypeSize(plan_.compute_dtype());
  for (auto& [c, written] : by_chunk) {
    const int64_t lo = partitioner_->ShardOffset(c, plan_.shard_rank());
    const int64_t n = partitioner_->chunks()[c].shard_numel;
    const BlockKey key = plan_.MasterKey(c);
    const Placement where = plan_.PlacementOf(key.kind);
    // The master shard, patched where a written parameter overlaps it. With a shared master
    // (fp32 compute) it is the working shard itself; otherwise the working copy is the master
    // rounded to the working precision, as after an update.
    std::vector<float> master(n);
    STRATA_ASSIGN_OR_RETURN(void* block, store_->Acquire(key, Access::kReadWrite));
    Status s = ReadBlockBytes(master.data(), block, n * 4, where);
    if (s.ok()) {
      for (const auto& [pid, value] : written) {
        const ParamLocation& loc = partitioner_->location(pid);
        const int64_t b = std::max(lo, loc.offset), e = std::min(lo + n, loc.offset + loc.numel);
        if (b < e)
          std::memcpy(master.data() + (b - lo), value.data_ptr<float>() + (b - loc.offset),
                      (e - b) * sizeof(float));
      }
      s = WriteBlockBytes(block, master.data(), n * 4, where);
    }
    Status r = store_->Release(key, s.ok());
    STRATA_RETURN_IF_ERROR(s.WithContext(StrCat("writing chunk ", c, "'s parameters")));
    STRATA_RETURN_IF_ERROR(r);
    if (plan_.master_is_param()) continue;
    std::vector<char> work(n * esize);
    if (plan_.compute_dtype() == optim::DType::kFloat32) {
      std::memcpy(work.data(), master.data(), n * 4);
    } else {
      auto* w16 = reinterpret_cast<uint16_t*>(work.data());
      for (int64_t i = 0; i < n; ++i)
        w16[i] = plan_.compute_dtype() == optim::DType::kBFloat16 ? optim::FloatToBf16(master[i])
                                                           : optim::FloatToHalf(master[i]);
    }
    STRATA_RETURN_IF_ERROR(updater_->PublishParams(c, work.data(), plan_.compute_dtype()));
  }
  // Every rank's shards to the others (replicated working copies), and what is gathered now
  // refreshed from them, as after an optimizer step.
  STRATA_RETURN_IF_ERROR(ShareUpdatedShards());
  return materializer_->RefreshChunks();
}

}  // namespace strata
