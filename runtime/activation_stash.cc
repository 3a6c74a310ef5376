// Activation stash: checkpointed units' saved inputs in the tier manager (cpu_checkpointing).
#include "runtime/engine_impl.h"

namespace strata {

using namespace engine_detail;

namespace {

// Activation slots use their own chunk numbers, far above any model chunk.
constexpr int64_t kFirstActivationChunk = int64_t{1} << 30;
constexpr uint64_t kAlign = 64;

}  // namespace

StatusOr<int64_t> Engine::Impl::StashActivations(const std::vector<torch::Tensor>& tensors) {
  Stashed st;
  uint64_t bytes = 0;
  for (const auto& t : tensors) {
    st.sizes.push_back(t.sizes().vec());
    st.dtypes.push_back(t.scalar_type());
    st.devices.push_back(t.device());
    st.offsets.push_back(bytes);
    bytes += (t.nbytes() + kAlign - 1) / kAlign * kAlign;
  }
  const int64_t handle = next_handle_++;
  const int64_t slot = next_slot_++;
  // The slot's block: registered the first time the slot is used, again only if it grew (rare:
  // the tier manager then records a new trace). NVMe-backed when there is an NVMe tier, so a
  // full host budget evicts saved inputs there.
  BlockKey key{kFirstActivationChunk + slot, StateKind::kActivation};
  Status s;
  if (static_cast<size_t>(slot) >= slot_bytes_.size()) slot_bytes_.resize(slot + 1, 0);
  if (slot_bytes_[slot] < bytes) {
    if (slot_bytes_[slot] > 0) s = store_->Unregister(key);
    if (s.ok()) s = store_->Register(key, bytes, nvme_ ? Placement::kNvme : Placement::kHost);
    slot_bytes_[slot] = s.ok() ? bytes : 0;
  }
  if (s.ok()) {
    auto dst = store_->Acquire(key, Access::kWrite);
    if (dst.ok()) {
      LaneTimer t(&copy_s_);
      torch::NoGradGuard ng;
      for (size_t i = 0; i < tensors.size(); ++i) {
        torch::Tensor view = torch::from_blob(static_cast<char*>(*dst) + st.offsets[i], st.sizes[i],
                                              torch::TensorOptions().dtype(st.dtypes[i]));
        view.copy_(tensors[i]);
        if (!tensors[i].device().is_cpu()) bytes_d2h_ += tensors[i].nbytes();
      }
      STRATA_RETURN_IF_ERROR(store_->Release(key, /*dirty=*/true));
      st.slot = slot;
      bytes_stashed_ += bytes;
      stashed_.emplace(handle, std::move(st));
      return handle;
    }
    s = dst.status();
  }
  // No room in the host tier (or none at all): keep plain host copies, and say so once.
  if (!stash_fallback_logged_) {
    stash_fallback_logged_ = true;
    STRATA_LOG(INFO) << "cpu_checkpointing: saved inputs stay in plain host memory, not the tier "
                        "manager (" << s.ToString() << ")";
  }
  torch::NoGradGuard ng;
  for (const auto& t : tensors) st.host.push_back(t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
  stashed_.emplace(handle, std::move(st));
  return handle;
}

StatusOr<std::vector<torch::Tensor>> Engine::Impl::RestoreActivations(int64_t handle) {
  auto it = stashed_.find(handle);
  if (it == stashed_.end())
    return NotFound(StrCat("activation stash handle ", handle, " is unknown or already restored"));
  Stashed st = std::move(it->second);
  stashed_.erase(it);
  std::vector<torch::Tensor> out;
  torch::NoGradGuard ng;
  if (st.slot < 0) {
    for (size_t i = 0; i < st.host.size(); ++i) out.push_back(st.host[i].to(st.devices[i]));
    return out;
  }
  // Backward restores in reverse order: hint the slot before this one.
  if (st.slot > 0) store_->Prefetch({kFirstActivationChunk + st.slot - 1, StateKind::kActivation});
  BlockKey key{kFirstActivationChunk + st.slot, StateKind::kActivation};
  auto t0 = Clock::now();
  STRATA_ASSIGN_OR_RETURN(void* src, store_->Acquire(key, Access::kRead));
  stall_s_ += Since(t0);
  {
    LaneTimer t(&copy_s_);
    for (size_t i = 0; i < st.sizes.size(); ++i) {
      torch::Tensor view = torch::from_blob(static_cast<char*>(src) + st.offsets[i], st.sizes[i],
                                            torch::TensorOptions().dtype(st.dtypes[i]));
      out.push_back(view.to(st.devices[i], /*non_blocking=*/false, /*copy=*/true));
      if (!st.devices[i].is_cpu()) bytes_h2d_ += out.back().nbytes();
    }
  }
  STRATA_RETURN_IF_ERROR(store_->Release(key, false));
  return out;
}

}  // namespace strata
