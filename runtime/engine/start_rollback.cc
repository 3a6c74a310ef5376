#include "runtime/engine/start_rollback.h"

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
    it->tensor.set_data(it->data);
    restored.insert(it->tensor.unsafeGetTensorImpl());
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
