// ActivationStash: checkpointed units' saved inputs kept in the tier manager
// (activation_checkpointing.cpu_checkpointing), so that a full host budget evicts them to NVMe
// and the tier manager's trace prefetches them back in the order backward wants them.
//
// Slot k is the k-th checkpoint of a micro-step: one block per slot, registered the first time
// the slot is used (again only when it grows), reused step after step. Without room in the host
// tier the inputs wait as plain host tensors instead, announced once.
//
// Ownership and threads: the stash owns its handles, slots and counters. It is used from the
// thread that runs forward and backward (the engine's caller) only, and touches the block store
// through Acquire/Release like any other lane.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include <torch/torch.h>

#include "runtime/base/status.h"
#include "runtime/state/block_store.h"

namespace strata {

class ActivationStash {
 public:
  // What the stash adds to the engine's step report, owned by the engine (its step counters).
  struct Counters {
    double* copy_s;        // copying into or out of the slots
    double* stall_s;       // waiting for a slot's block to come back
    uint64_t* bytes_d2h;   // device tensors stashed
    uint64_t* bytes_h2d;   // restored onto the device
  };

  // `store` outlives the stash; `nvme_backed`: register slots with NVMe behind them.
  ActivationStash(BlockStore* store, bool nvme_backed, Counters counters)
      : store_(store), nvme_backed_(nvme_backed), counters_(counters) {}

  // Copies `tensors` into the next slot of this micro-step and returns a handle for Restore.
  StatusOr<int64_t> Stash(const std::vector<torch::Tensor>& tensors);
  // The stashed tensors, on the devices they came from; consumes the handle.
  StatusOr<std::vector<torch::Tensor>> Restore(int64_t handle);
  // A new micro-step: its first checkpoint takes slot 0 again.
  void BeginMicroStep() { next_slot_ = 0; }
  // Bytes stashed since the last call (the step report's), reset to zero.
  uint64_t TakeBytesStashed() {
    const uint64_t b = bytes_stashed_;
    bytes_stashed_ = 0;
    return b;
  }

 private:
  // Per handle: the tensors' layout in their slot's block, or (slot -1) the host copies.
  struct Stashed {
    int64_t slot = -1;
    std::vector<std::vector<int64_t>> sizes;
    std::vector<torch::ScalarType> dtypes;
    std::vector<torch::Device> devices;
    std::vector<uint64_t> offsets;
    std::vector<torch::Tensor> host;
  };

  BlockStore* const store_;
  const bool nvme_backed_;
  const Counters counters_;
  std::map<int64_t, Stashed> stashed_;
  std::vector<uint64_t> slot_bytes_;  // per slot: the bytes its block was registered with
  int64_t next_slot_ = 0;
  int64_t next_handle_ = 1;
  bool fallback_logged_ = false;
  uint64_t bytes_stashed_ = 0;
};

}  // namespace strata
