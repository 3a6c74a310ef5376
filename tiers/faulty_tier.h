// FaultyTier: wraps any Tier and injects the failures storage really produces, so that every
// layer above a tier is tested against them without editing the tier itself.
//
// Faults are rules: an operation kind, a fault, how many matching operations to let pass first
// (`skip`), how many to fault after that (`count`, kForever for no end) and a probability drawn
// from a seeded generator (deterministic per seed). Faults:
// - kNoSpace:        Allocate or write fails with RESOURCE_EXHAUSTED (ENOSPC); nothing is written.
// - kIoError:        the operation fails with IO_ERROR (EIO). A write may have changed part of the
//                    region first (as a failed device write may); a read leaves dst undefined.
// - kShortTransfer:  only the first half of the bytes are transferred and the operation reports
//                    OUT_OF_RANGE ("short read/write: N of M bytes").
// - kCorrupt:        a read succeeds but one byte of the delivered data is flipped: the device
//                    lies, and only a checksum above the tier can notice.
// - kLatency:        the operation is delayed by `latency` and then forwarded unchanged.
// Thread-safe like the tier it wraps.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "tiers/tier.h"

namespace strata {

enum class FaultOp { kAllocate, kRead, kWrite };
enum class FaultKind { kNoSpace, kIoError, kShortTransfer, kCorrupt, kLatency };

struct FaultRule {
  static constexpr uint64_t kForever = std::numeric_limits<uint64_t>::max();
  FaultOp op = FaultOp::kWrite;
  FaultKind kind = FaultKind::kIoError;
  uint64_t skip = 0;
  uint64_t count = 1;
  double probability = 1.0;
  std::chrono::microseconds latency{0};
};

class FaultyTier final : public Tier {
 public:
  // `inner` must outlive this wrapper.
  explicit FaultyTier(Tier* inner, uint64_t seed = 1);

  void AddRule(const FaultRule& rule);
  void ClearRules();
  // COUNT: faults injected so far.
  uint64_t injected() const { return injected_.load(); }

  std::string_view name() const override { return name_; }
  uint64_t capacity() const override { return inner_->capacity(); }
  uint64_t alignment() const override { return inner_->alignment(); }
  StatusOr<TierRegion> Allocate(uint64_t bytes) override;
  Status Free(const TierRegion& region) override { return inner_->Free(region); }
  void WriteAsync(const TierRegion& region, const void* src, IoCallback done) override;
  void ReadAsync(const TierRegion& region, void* dst, IoCallback done) override;
  TierStats stats() const override { return inner_->stats(); }

 private:
  struct ActiveRule {
    FaultRule rule;
    uint64_t seen = 0;
    uint64_t fired = 0;
  };
  // Picks the fault for one operation, if any; advances rule counters.
  bool Pick(FaultOp op, FaultRule* out);

  Tier* inner_;
  std::string name_;
  std::mutex mu_;
  std::mt19937_64 rng_;               // GUARDED_BY(mu_)
  std::vector<ActiveRule> rules_;     // GUARDED_BY(mu_)
  std::atomic<uint64_t> injected_{0};
};

}  // namespace strata
