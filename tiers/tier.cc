#include "tiers/tier.h"

#include <future>

namespace strata {

Status Tier::Write(const TierRegion& region, const void* src) {
  std::promise<Status> p;
  auto f = p.get_future();
  WriteAsync(region, src, [&p](Status s) { p.set_value(std::move(s)); });
  return f.get();
}

Status Tier::Read(const TierRegion& region, void* dst) {
  std::promise<Status> p;
  auto f = p.get_future();
  ReadAsync(region, dst, [&p](Status s) { p.set_value(std::move(s)); });
  return f.get();
}

}  // namespace strata
