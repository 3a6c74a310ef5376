// UringEngine: the io_uring implementation of IoEngine (see io_engine.h for the contract).
//
// Each ring is owned by one thread that both submits and reaps, so the ring itself needs no lock;
// other threads hand pieces over through a mutex-guarded queue and wake the thread through an
// eventfd that the ring polls (Note [ring wake-up] in uring_engine.cc).
#pragma once

#include <memory>
#include <vector>

#include "tiers/nvme/io_engine.h"

namespace strata::nvme {

class UringEngine final : public IoEngine {
 public:
  // Fails (so the caller can fall back) when a ring or its thread cannot be created.
  static StatusOr<std::unique_ptr<UringEngine>> Create(const IoEngineOptions& options);
  ~UringEngine() override;

  std::string_view name() const override { return "io_uring"; }
  Status SetFiles(std::vector<IoFile> files) override;
  Status RegisterBuffers(const std::vector<iovec>& ranges) override;

 private:
  class Ring;
  explicit UringEngine(const IoEngineOptions& options);
  void Enqueue(std::vector<PiecePtr> pieces) override;

  std::vector<std::unique_ptr<Ring>> read_rings_;
  std::vector<std::unique_ptr<Ring>> write_rings_;
  std::atomic<uint64_t> next_read_{0}, next_write_{0};
};

}  // namespace strata::nvme
