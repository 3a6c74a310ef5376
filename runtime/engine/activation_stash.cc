// Activation stash: checkpointed units' saved inputs in the tier manager (cpu_checkpointing).
#include "runtime/engine/activation_stash.h"

#include <chrono>

#include "runtime/base/logging.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

// Adds the scope's duration to *sum.
class Timed {
 public:
  explicit Timed(double* sum) : sum_(sum), t0_(Clock::now()) {}
  ~Timed() { *sum_ += std::chrono::duration<double>(Clock::now() - t0_).count(); }

 private:
  double* sum_;
  Clock::time_point t0_;
};


// Activation slots use their own chunk numbers, far above any model chunk.
constexpr int64_t kFirstActivationChunk = int64_t{1} << 30;
constexpr uint64_t kAlign = 64;

}  // namespace

StatusOr<int64_t> ActivationStash::Stash(const std::vector<torch::Tensor>& tensors) {
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
    if (s.ok()) s = store_->Register(key, bytes, nvme_backed_ ? Placement::kNvme : Placement::kHost);
    slot_bytes_[slot] = s.ok() ? bytes : 0;
  }
  if (s.ok()) {
    auto dst = store_->Acquire(key, Access::kWrite);
    if (dst.ok()) {
      Timed t(counters_.copy_s);
      torch::NoGradGuard ng;
      for (size_t i = 0; i < tensors.size(); ++i) {
        torch::Tensor view = torch::from_blob(static_cast<char*>(*dst) + st.offsets[i], st.sizes[i],
                                              torch::TensorOptions().dtype(st.dtypes[i]));
        view.copy_(tensors[i]);
        if (!tensors[i].device().is_cpu()) *counters_.bytes_d2h += tensors[i].nbytes();
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
  if (!fallback_logged_) {
    fallback_logged_ = true;
    STRATA_LOG(INFO) << "cpu_checkpointing: saved inputs stay in plain host memory, not the tier "
                        "manager (" << s.ToString() << ")";
  }
  torch::NoGradGuard ng;
  for (const auto& t : tensors) st.host.push_back(t.detach().to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true));
  stashed_.emplace(handle, std::move(st));
  return handle;
}

StatusOr<std::vector<torch::Tensor>> ActivationStash::Restore(int64_t handle) {
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
  void* src;
  {
    Timed t(counters_.stall_s);
    STRATA_ASSIGN_OR_RETURN(src, store_->Acquire(key, Access::kRead));
  }
  {
    Timed t(counters_.copy_s);
    for (size_t i = 0; i < st.sizes.size(); ++i) {
      torch::Tensor view = torch::from_blob(static_cast<char*>(src) + st.offsets[i], st.sizes[i],
                                            torch::TensorOptions().dtype(st.dtypes[i]));
      out.push_back(view.to(st.devices[i], /*non_blocking=*/false, /*copy=*/true));
      if (!st.devices[i].is_cpu()) *counters_.bytes_h2d += out.back().nbytes();
    }
  }
  STRATA_RETURN_IF_ERROR(store_->Release(key, false));
  return out;
}

}  // namespace strata
