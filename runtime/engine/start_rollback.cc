#include "runtime/engine/start_rollback.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

namespace strata {

void StartRollback::CountsOnStagedSpace(uint64_t file_system) {
  counted_file_systems_.insert(file_system);
}

zero::AfterRead StartRollback::TakeParameter(const torch::Tensor& param) {
  const std::optional<zero::StagedSpace> space = zero::StagedDiskSpace(param);
  if (space && counted_file_systems_.count(space->file_system)) {
    // Holding the space would take it from the NVMe blocks that count on it.
    lost_.push_back(param);
    return zero::AfterRead::kGiveBack;
  }
  const bool staged = zero::IsStaged(param);
  Taken t{param, param.variable_data(), staged};
  if (space && !space->given_back_on_read) {
    t.mapping = param.storage().data();
    t.mapping_bytes = space->bytes;
  }
  taken_.push_back(std::move(t));
  return staged ? zero::AfterRead::kKeep : zero::AfterRead::kGiveBack;
}

void StartRollback::Take(const torch::Tensor& t) {
  taken_.push_back({t, t.variable_data(), false});
}

void StartRollback::ChunkTaken() {
  ++chunks_taken_;
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (; paged_out_ < taken_.size(); ++paged_out_) {
    const Taken& t = taken_[paged_out_];
    if (!t.mapping) continue;
    // The whole pages inside the parameter's range: a shared file mapping's pages go back to the
    // page cache, written back if dirty, and are read from the file again on the next access.
    const uintptr_t from = reinterpret_cast<uintptr_t>(t.mapping);
    const uintptr_t begin = (from + page - 1) / page * page;
    const uintptr_t end = (from + t.data.nbytes()) / page * page;
    if (end > begin)
      ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);  // best effort
  }
}

uint64_t StartRollback::Commit() {
  if (done_) return 0;
  done_ = true;
  for (const Taken& t : taken_)
    if (t.staged) zero::GiveBackStaged(t.tensor);
  std::vector<std::pair<const void*, uint64_t>> mappings;
  for (const Taken& t : taken_)
    if (t.mapping) mappings.emplace_back(t.mapping, t.mapping_bytes);
  taken_.clear();  // the model's own memory, and StageMapped's mappings, go here
  lost_.clear();
  uint64_t held = 0;
  for (const auto& [data, bytes] : mappings)
    if (zero::StagedMappingLive(data)) held += bytes;
  return held;
}

StartRollback::Outcome StartRollback::Undo() {
  Outcome out;
  if (done_) return out;
  done_ = true;
  torch::NoGradGuard ng;
  std::set<const c10::TensorImpl*> restored;
  for (auto it = taken_.rbegin(); it != taken_.rend(); ++it) {
    try {
      it->tensor.set_data(it->data);
      restored.insert(it->tensor.unsafeGetTensorImpl());
    } catch (const std::exception&) {
      // Never expected (the data was the tensor's own); the others are given back all the same.
    }
  }
  out.restored = static_cast<int64_t>(restored.size());
  // A parameter given up keeps its values while it is still staged (its read failed before it
  // began) or still views its StageMapped mapping (its chunk was never shown); otherwise they
  // went with the start.
  for (const torch::Tensor& p : lost_)
    if (!zero::IsStaged(p) && !zero::StagedDiskSpace(p)) out.lost.push_back(p);
  taken_.clear();
  lost_.clear();
  return out;
}

}  // namespace strata
