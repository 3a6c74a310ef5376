#include "tiers/faulty_tier.h"

#include <cerrno>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace strata {

FaultyTier::FaultyTier(Tier* inner, uint64_t seed)
    : inner_(inner), name_(StrCat("faulty(", inner->name(), ")")), rng_(seed) {}

void FaultyTier::AddRule(const FaultRule& rule) {
  std::lock_guard<std::mutex> l(mu_);
  rules_.push_back(ActiveRule{rule});
}

void FaultyTier::ClearRules() {
  std::lock_guard<std::mutex> l(mu_);
  rules_.clear();
}

bool FaultyTier::Pick(FaultOp op, FaultRule* out) {
  std::lock_guard<std::mutex> l(mu_);
  for (auto& r : rules_) {
    if (r.rule.op != op) continue;
    if (r.seen++ < r.rule.skip) continue;
    if (r.rule.count != FaultRule::kForever && r.fired >= r.rule.count) continue;
    if (r.rule.probability < 1.0 &&
        std::uniform_real_distribution<double>(0, 1)(rng_) >= r.rule.probability)
      continue;
    ++r.fired;
    *out = r.rule;
    ++injected_;
    return true;
  }
  return false;
}

StatusOr<TierRegion> FaultyTier::Allocate(uint64_t bytes) {
  FaultRule f;
  if (Pick(FaultOp::kAllocate, &f)) {
    if (f.kind == FaultKind::kLatency) {
      std::this_thread::sleep_for(f.latency);
    } else {
      return ErrnoToStatus(f.kind == FaultKind::kNoSpace ? ENOSPC : EIO,
                           StrCat(name_, ": injected fault allocating ", bytes, " bytes"));
    }
  }
  return inner_->Allocate(bytes);
}

void FaultyTier::WriteAsync(const TierRegion& region, const void* src, IoCallback done) {
  FaultRule f;
  if (!Pick(FaultOp::kWrite, &f)) return inner_->WriteAsync(region, src, std::move(done));
  switch (f.kind) {
    case FaultKind::kLatency:
      std::this_thread::sleep_for(f.latency);
      return inner_->WriteAsync(region, src, std::move(done));
    case FaultKind::kNoSpace:
      return done(ErrnoToStatus(ENOSPC, StrCat(name_, ": injected fault writing region ", region.id)));
    case FaultKind::kIoError:
    case FaultKind::kShortTransfer: {
      // The device took only the first half: that much of the region changes, the rest keeps
      // whatever it held. Read-modify-write through the inner tier models it faithfully.
      auto merged = std::make_shared<std::vector<uint8_t>>(region.size);
      uint64_t half = region.size / 2;
      bool eio = f.kind == FaultKind::kIoError;
      inner_->ReadAsync(region, merged->data(), [this, region, src, merged, half, eio,
                                                 done = std::move(done)](Status rs) mutable {
        if (rs.ok()) std::memcpy(merged->data(), src, half);
        inner_->WriteAsync(region, merged->data(), [this, region, merged, half, eio,
                                                    done = std::move(done)](Status) {
          (void)merged;
          if (eio)
            done(ErrnoToStatus(EIO, StrCat(name_, ": injected fault writing region ", region.id)));
          else
            done(OutOfRange(StrCat(name_, ": short write of region ", region.id, ": ", half,
                                   " of ", region.size, " bytes (injected)")));
        });
      });
      return;
    }
    case FaultKind::kCorrupt:
      // A corrupting write is modelled on the read side; writes pass.
      return inner_->WriteAsync(region, src, std::move(done));
  }
}

void FaultyTier::ReadAsync(const TierRegion& region, void* dst, IoCallback done) {
  FaultRule f;
  if (!Pick(FaultOp::kRead, &f)) return inner_->ReadAsync(region, dst, std::move(done));
  switch (f.kind) {
    case FaultKind::kLatency:
      std::this_thread::sleep_for(f.latency);
      return inner_->ReadAsync(region, dst, std::move(done));
    case FaultKind::kNoSpace:
    case FaultKind::kIoError:
      return done(ErrnoToStatus(EIO, StrCat(name_, ": injected fault reading region ", region.id)));
    case FaultKind::kShortTransfer: {
      auto full = std::make_shared<std::vector<uint8_t>>(region.size);
      inner_->ReadAsync(region, full->data(), [this, region, dst, full,
                                               done = std::move(done)](Status s) {
        if (!s.ok()) return done(s);
        uint64_t half = region.size / 2;
        std::memcpy(dst, full->data(), half);
        done(OutOfRange(StrCat(name_, ": short read of region ", region.id, ": ", half, " of ",
                               region.size, " bytes (injected)")));
      });
      return;
    }
    case FaultKind::kCorrupt: {
      uint64_t pos;
      {
        std::lock_guard<std::mutex> l(mu_);
        pos = region.size ? rng_() % region.size : 0;
      }
      inner_->ReadAsync(region, dst, [region, dst, pos, done = std::move(done)](Status s) {
        if (s.ok() && region.size) static_cast<uint8_t*>(dst)[pos] ^= 0x5a;
        done(std::move(s));
      });
      return;
    }
  }
}

}  // namespace strata
