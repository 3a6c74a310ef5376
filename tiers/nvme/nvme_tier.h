// NvmeTier: the Tier interface (tiers/tier.h) over a SwapStore.
//
// Regions are swap blocks; capacity() is the configured byte budget, and Allocate() charges
// each region its size rounded up to 4 KiB. Buffers passed to I/O should be 4 KiB-aligned
// (alignment() says so): aligned buffers go straight to the device with O_DIRECT, others take a
// bounce copy. Thread safety and failure behaviour are Tier's; in addition every read verifies
// the block's crc32c (when checksums are on) and fails with DATA_LOSS instead of returning
// corrupted bytes. The store's index is saved when the tier is destroyed.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/base/config.h"
#include "runtime/base/mutex.h"
#include "tiers/nvme/swap_store.h"
#include "tiers/tier.h"

namespace strata::nvme {

struct NvmeTierOptions {
  std::vector<std::string> paths;
  uint32_t rank = 0;
  uint64_t capacity = 0;  // bytes; 0: what the file systems have free at creation
  uint64_t needed_bytes = 0;  // SwapStoreOptions::needed_bytes: checked against free space at Create
  std::map<uint64_t, uint64_t> needed_free_on_device;  // SwapStoreOptions' and its why
  std::string needed_free_why;
  std::string shrink_hint;  // SwapStoreOptions::shrink_hint
  AioConfig aio;
  ChecksumKind checksums = ChecksumKind::kCrc32c;
  bool force_fallback = false;
  // SwapStoreOptions::remove_on_close: the engine's tier is scratch; strata-swapbench tiers
  // --keep leaves its files.
  bool remove_on_close = true;
  IoFaultHook fault_hook;  // test-only
};

// The NVMe tier of `config` for `rank`: the directories of offload_param.nvme_path and
// offload_optimizer.nvme_path (each once, in that order), strata.nvme_capacity, the aio block
// and strata.checksums.
NvmeTierOptions NvmeTierOptionsFromConfig(const Config& config, uint32_t rank);

class NvmeTier final : public Tier {
 public:
  // Starts with an empty swap store (any earlier index for this rank is discarded) and, unless
  // options.remove_on_close is false, removes its files when destroyed.
  static StatusOr<std::unique_ptr<NvmeTier>> Create(const NvmeTierOptions& options);
  ~NvmeTier() override;

  std::string_view name() const override { return "nvme"; }
  uint64_t capacity() const override { return capacity_; }
  uint64_t alignment() const override { return kSwapAlignment; }

  StatusOr<TierRegion> Allocate(uint64_t bytes) override;
  Status Free(const TierRegion& region) override;
  void WriteAsync(const TierRegion& region, const void* src, IoCallback done) override;
  void ReadAsync(const TierRegion& region, void* dst, IoCallback done) override;
  TierStats stats() const override;

  SwapStore& store() { return *store_; }

  // Called with each busy interval (from the first I/O in flight to the moment none is), on the
  // thread that completed the last I/O; it must be quick and must not call back into the tier.
  // Null stops the calls.
  using BusyObserver = std::function<void(std::chrono::steady_clock::time_point begin,
                                          std::chrono::steady_clock::time_point end)>;
  void SetBusyObserver(BusyObserver observer);

 private:
  NvmeTier() = default;
  IoDone Track(bool read, uint64_t bytes, IoCallback done);

  std::unique_ptr<SwapStore> store_;
  uint64_t capacity_ = 0;

  mutable Mutex mu_;
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
  TierStats stats_ GUARDED_BY(mu_);
  uint64_t inflight_ GUARDED_BY(mu_) = 0;
  std::chrono::steady_clock::time_point busy_since_ GUARDED_BY(mu_);
  std::shared_ptr<const BusyObserver> observer_ GUARDED_BY(mu_);
};

}  // namespace strata::nvme
