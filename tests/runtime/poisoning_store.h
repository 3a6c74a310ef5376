// PoisoningStore: a test-only BlockStore wrapper that makes a host or NVMe block's bytes
// unusable outside its Acquire..Release window.
//
// A real store hands out its own buffer, and the bytes usually stay there after Release until
// the block is evicted, so code that keeps reading (or lets a queued copy read) a block after
// releasing it passes every test and corrupts training only under memory pressure. Here each
// host or NVMe block is handed out as a private copy: the first pin copies the inner store's
// bytes in (kWrite: fills it with 0xFF instead, since the caller promised to overwrite every
// byte), a release after a write pin copies them back, and the last release fills the copy with
// 0xFF, NaN as floats. A read after release, or of bytes a kWrite holder left unwritten, then
// turns the run's numbers into NaN; a write after release is lost at the next pin.
//
// What it does not check: device-placed blocks pass through unchanged (they stay allocated after
// Release, so a late read of one goes unseen), and on a GPU a copy from this pageable memory is
// staged before cudaMemcpyAsync returns, so a late release cannot show there. It is meant for
// the CPU device. Pins count as in the tier manager: nested pins share one copy. The copies live
// outside the host budget for the whole run.
#pragma once

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>

#include "tests/runtime/forwarding_store.h"

namespace strata::testing {

class PoisoningStore final : public ForwardingStore {
 public:
  explicit PoisoningStore(std::unique_ptr<BlockStore> inner) : ForwardingStore(std::move(inner)) {}

  Status Register(const BlockKey& key, uint64_t bytes, Placement placement) override {
    STRATA_RETURN_IF_ERROR(inner().Register(key, bytes, placement));
    if (placement == Placement::kDevice) return Status::Ok();
    auto b = std::make_shared<Block>(bytes);
    if (b->copy == nullptr) return ResourceExhausted("poisoning store: no memory for a copy");
    std::lock_guard<std::mutex> l(mu_);
    blocks_[key] = std::move(b);
    return Status::Ok();
  }

  StatusOr<void*> Acquire(const BlockKey& key, Access access) override {
    std::shared_ptr<Block> b = Find(key);
    if (!b) return inner().Acquire(key, access);  // a device block
    // The block's own lock spans the inner pin too, so a nested pin never sees a copy that is
    // not filled yet.
    std::lock_guard<std::mutex> l(b->mu);
    STRATA_ASSIGN_OR_RETURN(void* real, inner().Acquire(key, access));
    if (b->pins++ == 0) {
      b->real = real;
      b->wrote = false;
      if (access == Access::kWrite) std::memset(b->copy, 0xFF, b->bytes);
      else std::memcpy(b->copy, real, b->bytes);
    }
    if (access != Access::kRead) b->wrote = true;
    return b->copy;
  }

  Status Release(const BlockKey& key, bool dirty) override {
    std::shared_ptr<Block> b = Find(key);
    if (!b) return inner().Release(key, dirty);
    std::lock_guard<std::mutex> l(b->mu);
    // The inner buffer is still pinned here: what was written goes back before the inner store
    // may write it out or evict it.
    if (b->pins > 0 && b->wrote) std::memcpy(b->real, b->copy, b->bytes);
    STRATA_RETURN_IF_ERROR(inner().Release(key, dirty));
    if (b->pins > 0 && --b->pins == 0) std::memset(b->copy, 0xFF, b->bytes);
    return Status::Ok();
  }

  Status Unregister(const BlockKey& key) override {
    STRATA_RETURN_IF_ERROR(inner().Unregister(key));
    std::lock_guard<std::mutex> l(mu_);
    blocks_.erase(key);
    return Status::Ok();
  }

 private:
  struct Block {
    explicit Block(uint64_t n)
        : copy(std::aligned_alloc(4096, (n + 4095) / 4096 * 4096 + 4096)), bytes(n) {
      if (copy != nullptr) std::memset(copy, 0xFF, bytes);
    }
    ~Block() { std::free(copy); }
    std::mutex mu;
    void* copy;
    const uint64_t bytes;
    void* real = nullptr;  // GUARDED_BY(mu): the inner store's buffer while pinned
    int pins = 0;          // GUARDED_BY(mu)
    bool wrote = false;    // GUARDED_BY(mu): a write pin was taken since the first pin
  };

  std::shared_ptr<Block> Find(const BlockKey& key) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = blocks_.find(key);
    return it == blocks_.end() ? nullptr : it->second;
  }

  std::mutex mu_;
  std::map<BlockKey, std::shared_ptr<Block>> blocks_;  // GUARDED_BY(mu_)
};

}  // namespace strata::testing
