// ClientStepSession: one step of a client optimizer (EngineOptions::client_optimizer), from
// BeginClientStep to FinishClientStep: whether one is open, whether the step was skipped (a
// non-finite gradient) and its norm, the blocks lent to the caller (acquired until the session
// closes) and each chunk's master view that FinishClientStep copies to the working copy.
//
// Owns: those. Borrows: the block store and the device (for the views' compute addresses), both
// outliving it. Thread rules: the engine's caller thread only.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "runtime/base/device.h"
#include "runtime/base/status.h"
#include "runtime/state/block_store.h"

namespace strata {

class ClientStepSession {
 public:
  ClientStepSession(BlockStore* store, Device* device, torch::TensorOptions fp32_on_device)
      : store_(store), device_(device), fp32_(fp32_on_device) {}

  bool open() const { return open_; }
  bool skipped() const { return skipped_; }
  double norm() const { return norm_; }

  // A session starts with the step's global gradient norm and overflow flag, for `chunks`.
  void Open(double norm, bool skipped, size_t chunks);
  // Acquires `key` for the caller's optimizer and returns its `numel` fp32 elements as a device
  // tensor (at the device's compute address, Note [device blocks]); held until Close.
  StatusOr<torch::Tensor> Lend(const BlockKey& key, int64_t numel);
  // Chunk c's master view, which FinishClientStep copies to the working copy.
  void SetMaster(size_t c, torch::Tensor master) { masters_[c] = std::move(master); }
  const torch::Tensor& master(size_t c) const { return masters_[c]; }
  // Releases every lent block (as written) and ends the session; the first release error.
  Status Close();

 private:
  BlockStore* store_;
  Device* device_;
  torch::TensorOptions fp32_;
  bool open_ = false, skipped_ = false;
  double norm_ = 0;
  std::vector<BlockKey> held_;
  std::vector<torch::Tensor> masters_;
};

}  // namespace strata
