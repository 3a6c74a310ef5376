// DeepSpeed's offload_states / reload_states: the device-resident blocks of the chosen states
// move to host memory between steps, freeing their device memory for something else (an
// evaluation, a second model, an inference engine), and come back bit for bit.
//
// A parked block is unregistered from the block store (which frees its device memory) and its
// bytes wait in a host buffer; reloading registers it again with the same placement and writes
// them back. Only device-placed blocks move: host- and NVMe-placed states are already off the
// device. The engine does not train while states are parked (OpenMicroStep and Step refuse),
// because every lane assumes its blocks are registered.
#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

StatusOr<uint64_t> Engine::Impl::OffloadStates(const std::vector<StateKind>& kinds) {
  if (!plan_.stage3())
    return FailedPrecondition(StrCat("offload_states needs ZeRO stage 3 (this engine runs stage ",
                                     config_.zero_optimization.stage, "), as in DeepSpeed"));
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps("offload_states"));
  STRATA_RETURN_IF_ERROR(FinishUpdates());
  uint64_t moved = 0;
  for (StateKind kind : kinds) {
    if (!plan_.HoldsState(kind)) continue;
    for (size_t c = 0; c < chunks_.size(); ++c) {
      const BlockKey key{static_cast<int64_t>(c), kind};
      // A shared master is the param16 block; host- and NVMe-homed blocks are off the device.
      if (!plan_.Stored(key.chunk, kind) || plan_.PlacementOf(key.chunk, kind) != Placement::kDevice) continue;
      if (std::any_of(parked_.begin(), parked_.end(), [&](const ParkedBlock& p) { return p.key == key; }))
        continue;  // offloaded already (DeepSpeed allows a second call)
      const uint64_t n = static_cast<uint64_t>(partitioner_->chunks()[c].shard_numel);
      const uint64_t bytes = plan_.BlockBytes(kind, static_cast<int64_t>(n));
      ParkedBlock p{key, std::vector<uint8_t>(bytes)};
      STRATA_ASSIGN_OR_RETURN(void* block, store_->Acquire(key, Access::kRead));
      Status s = ReadBlockBytes(p.bytes.data(), block, bytes, Placement::kDevice);
      Status r = store_->Release(key, false);
      if (s.ok()) s = r;
      if (s.ok()) s = store_->Unregister(key);  // frees the device memory
      if (!s.ok()) return s.WithContext(StrCat("offloading ", BlockName(key), " to host memory"));
      parked_.push_back(std::move(p));
      moved += bytes;
    }
  }
  return moved;
}

StatusOr<uint64_t> Engine::Impl::ReloadStates() {
  uint64_t moved = 0;
  while (!parked_.empty()) {
    ParkedBlock& p = parked_.back();
    const uint64_t bytes = p.bytes.size();
    Status s = store_->Register(p.key, bytes, Placement::kDevice);
    if (!s.ok()) {
      return s.WithContext(StrCat("reloading ", BlockName(p.key), " (", FormatBytes(bytes),
                                  ") to the device; the other parked states stay on the host, "
                                  "free device memory and call reload_states again"));
    }
    auto block = store_->Acquire(p.key, Access::kWrite);
    s = block.status();
    if (s.ok()) s = WriteBlockBytes(*block, p.bytes.data(), bytes, Placement::kDevice);
    if (block.ok()) {
      Status r = store_->Release(p.key, true);
      if (s.ok()) s = r;
    }
    if (!s.ok()) {
      // Keep the host copy: the block is registered but not written, so unregister it again.
      store_->Unregister(p.key).IgnoreError();
      return s.WithContext(StrCat("reloading ", BlockName(p.key), " to the device"));
    }
    moved += bytes;
    parked_.pop_back();
  }
  return moved;
}

Status Engine::Impl::CheckStatesResident(const char* what) const {
  if (parked_.empty()) return Status::Ok();
  uint64_t bytes = 0;
  for (const ParkedBlock& p : parked_) bytes += p.bytes.size();
  return FailedPrecondition(StrCat(what, " while ", parked_.size(), " state blocks (",
                                   FormatBytes(bytes), ") are offloaded to host memory: call "
                                   "reload_states() first"));
}

// A parameter-state read or write needs its block on the device. Where the master is the
// working shard (Note [shared master]), offloading lp_params took the master along.
Status Engine::Impl::CheckBlockResident(const BlockKey& key, StateKind wanted) const {
  for (const ParkedBlock& p : parked_)
    if (p.key == key)
      return FailedPrecondition(StrCat(
          "chunk ", key.chunk, "'s ", StateKindName(wanted), " is offloaded to host memory (",
          key.kind == wanted ? "" : StrCat("it is the ", StateKindName(key.kind), " block, "),
          "moved by offload_states): call reload_states() first"));
  return Status::Ok();
}

}  // namespace strata
