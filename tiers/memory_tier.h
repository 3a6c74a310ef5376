// MemoryTier: a Tier backed by plain heap memory. Used for logic tests of anything written
// against Tier (tier manager, pipeline) and as the in-memory NVMe stand-in. I/O runs on its own
// worker thread so completions arrive asynchronously, as they do from real tiers.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tiers/tier.h"

namespace strata {

class MemoryTier final : public Tier {
 public:
  MemoryTier(std::string name, uint64_t capacity);
  ~MemoryTier() override;  // drains queued I/O

  std::string_view name() const override { return name_; }
  uint64_t capacity() const override { return capacity_; }

  StatusOr<TierRegion> Allocate(uint64_t bytes) override;
  Status Free(const TierRegion& region) override;
  void WriteAsync(const TierRegion& region, const void* src, IoCallback done) override;
  void ReadAsync(const TierRegion& region, void* dst, IoCallback done) override;
  TierStats stats() const override;

 private:
  void Submit(std::function<Status()> op, bool is_write, uint64_t bytes, IoCallback done);
  void Run();
  // Returns the storage of a live region whose size matches, or an error.
  StatusOr<std::vector<uint8_t>*> Find(const TierRegion& region);

  const std::string name_;
  const uint64_t capacity_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t next_id_ = 1;                                    // GUARDED_BY(mu_)
  std::map<uint64_t, std::vector<uint8_t>> regions_;        // GUARDED_BY(mu_)
  std::deque<std::function<void()>> queue_;                 // GUARDED_BY(mu_)
  bool stop_ = false;                                       // GUARDED_BY(mu_)
  TierStats stats_;                                         // GUARDED_BY(mu_)
  std::thread worker_;
};

}  // namespace strata
