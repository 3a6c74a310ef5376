// ForwardingStore: a test-only BlockStore that passes every call to the store it wraps, so that a
// wrapper (PoisoningStore; a store whose disk fills part-way, tests/faults/start_faults_test.cc)
// overrides only the calls it changes.
#pragma once

#include <memory>
#include <utility>

#include "runtime/state/block_store.h"

namespace strata::testing {

class ForwardingStore : public BlockStore {
 public:
  explicit ForwardingStore(std::unique_ptr<BlockStore> inner) : inner_(std::move(inner)) {}

  Status Register(const BlockKey& key, uint64_t bytes, Placement placement) override {
    return inner_->Register(key, bytes, placement);
  }
  StatusOr<void*> Acquire(const BlockKey& key, Access access) override { return inner_->Acquire(key, access); }
  Status Release(const BlockKey& key, bool dirty) override { return inner_->Release(key, dirty); }
  Status Unregister(const BlockKey& key) override { return inner_->Unregister(key); }
  void Prefetch(const BlockKey& key) override { inner_->Prefetch(key); }
  void BeginIteration() override { inner_->BeginIteration(); }
  void EndIteration() override { inner_->EndIteration(); }
  Status Flush() override { return inner_->Flush(); }
  BlockStoreStats stats() const override { return inner_->stats(); }
  nlohmann::json StatsJson() const override { return inner_->StatsJson(); }

 protected:
  BlockStore& inner() { return *inner_; }

 private:
  std::unique_ptr<BlockStore> inner_;
};

}  // namespace strata::testing
