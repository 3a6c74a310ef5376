// PoisoningStore: a test-only BlockStore wrapper that makes a block's bytes unusable outside
// its Acquire..Release window, as the strict CPU device does for device memory.
//
// A real store hands out its own buffer, and the bytes usually stay there after Release until
// the block is evicted, so code that keeps reading (or lets a queued copy read) a block after
// releasing it passes every test and corrupts training only under memory pressure. Here each
// host or NVMe block is handed out as a private copy: the first pin copies the inner store's
// bytes in (kWrite: fills it with 0xFF instead, since the caller promised to overwrite every
// byte), a release that wrote copies them back, and the last release fills the copy with 0xFF,
// NaN as floats. A read after release, or of bytes a kWrite holder left unwritten, then turns
// the run's numbers into NaN. Device blocks pass through (the strict device already guards
// them). Pins count as in the tier manager: nested pins share one copy.
#pragma once

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "runtime/block_store.h"

namespace strata::testing {

class PoisoningStore final : public BlockStore {
 public:
  explicit PoisoningStore(std::unique_ptr<BlockStore> inner) : inner_(std::move(inner)) {}
  ~PoisoningStore() override {
    for (auto& [key, b] : blocks_) std::free(b.copy);
  }

  Status Register(const BlockKey& key, uint64_t bytes, Placement placement) override {
    STRATA_RETURN_IF_ERROR(inner_->Register(key, bytes, placement));
    if (placement == Placement::kDevice) return Status::Ok();
    void* copy = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096 + 4096);
    if (copy == nullptr) return ResourceExhausted("poisoning store: no memory for a copy");
    std::memset(copy, 0xFF, bytes);
    std::lock_guard<std::mutex> l(mu_);
    Block& b = blocks_[key];
    std::free(b.copy);
    b = Block{copy, bytes};
    return Status::Ok();
  }

  StatusOr<void*> Acquire(const BlockKey& key, Access access) override {
    STRATA_ASSIGN_OR_RETURN(void* real, inner_->Acquire(key, access));
    std::lock_guard<std::mutex> l(mu_);
    auto it = blocks_.find(key);
    if (it == blocks_.end()) return real;  // a device block
    Block& b = it->second;
    if (b.pins++ == 0) {
      b.real = real;
      b.wrote = false;
      if (access == Access::kWrite) std::memset(b.copy, 0xFF, b.bytes);
      else std::memcpy(b.copy, real, b.bytes);
    }
    if (access != Access::kRead) b.wrote = true;
    return b.copy;
  }

  Status Release(const BlockKey& key, bool dirty) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = blocks_.find(key);
      if (it != blocks_.end() && it->second.pins > 0) {
        Block& b = it->second;
        // The inner store's buffer is still pinned: the bytes written go back before it may be
        // written out or evicted.
        if (b.wrote) std::memcpy(b.real, b.copy, b.bytes);
        if (--b.pins == 0) std::memset(b.copy, 0xFF, b.bytes);
      }
    }
    return inner_->Release(key, dirty);
  }

  Status Unregister(const BlockKey& key) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = blocks_.find(key);
      if (it != blocks_.end() && it->second.pins == 0) {
        std::free(it->second.copy);
        blocks_.erase(it);
      }
    }
    return inner_->Unregister(key);
  }

  void Prefetch(const BlockKey& key) override { inner_->Prefetch(key); }
  void BeginIteration() override { inner_->BeginIteration(); }
  void EndIteration() override { inner_->EndIteration(); }
  Status Flush() override { return inner_->Flush(); }
  BlockStoreStats stats() const override { return inner_->stats(); }
  nlohmann::json StatsJson() const override { return inner_->StatsJson(); }

 private:
  struct Block {
    void* copy = nullptr;
    uint64_t bytes = 0;
    void* real = nullptr;  // the inner store's buffer while pinned
    int pins = 0;
    bool wrote = false;    // a write pin was taken since the first pin
  };
  std::unique_ptr<BlockStore> inner_;
  std::mutex mu_;
  std::map<BlockKey, Block> blocks_;  // GUARDED_BY(mu_)
};

}  // namespace strata::testing
