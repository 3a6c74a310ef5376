// MemoryTier behaviour and FaultyTier's injected faults.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "tiers/faulty_tier.h"
#include "tiers/memory_tier.h"

namespace strata {
namespace {

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 31);
  return v;
}

TEST(MemoryTier, BudgetHoldsAndRoundTrips) {
  MemoryTier tier("mem", 10000);
  ASSERT_OK_AND_ASSIGN(TierRegion a, tier.Allocate(6000));
  auto b = tier.Allocate(5000);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  ASSERT_OK_AND_ASSIGN(TierRegion c, tier.Allocate(4000));
  auto data = Pattern(6000, 1);
  ASSERT_OK(tier.Write(a, data.data()));
  std::vector<uint8_t> back(6000);
  ASSERT_OK(tier.Read(a, back.data()));
  EXPECT_EQ(back, data);
  TierStats st = tier.stats();
  EXPECT_EQ(st.bytes_written, 6000u);
  EXPECT_EQ(st.bytes_read, 6000u);
  EXPECT_EQ(st.bytes_allocated, 10000u);
  EXPECT_EQ(st.peak_bytes_allocated, 10000u);
  ASSERT_OK(tier.Free(a));
  ASSERT_OK(tier.Free(c));
  EXPECT_EQ(tier.stats().bytes_allocated, 0u);
  EXPECT_EQ(tier.Free(a).code(), StatusCode::kInvalidArgument);
}

TEST(MemoryTier, ManyConcurrentRequestsCompleteEachOnce) {
  MemoryTier tier("mem", 1 << 24);
  constexpr int kN = 64;
  std::vector<TierRegion> regions;
  std::vector<std::vector<uint8_t>> data;
  for (int i = 0; i < kN; ++i) {
    ASSERT_OK_AND_ASSIGN(TierRegion r, tier.Allocate(1000 + i * 37));
    regions.push_back(r);
    data.push_back(Pattern(r.size, static_cast<uint8_t>(i)));
  }
  std::atomic<int> done{0};
  std::promise<void> all;
  for (int i = 0; i < kN; ++i)
    tier.WriteAsync(regions[i], data[i].data(), [&](Status s) {
      EXPECT_TRUE(s.ok());
      if (++done == kN) all.set_value();
    });
  all.get_future().wait();
  for (int i = 0; i < kN; ++i) {
    std::vector<uint8_t> back(regions[i].size);
    ASSERT_OK(tier.Read(regions[i], back.data()));
    EXPECT_EQ(back, data[i]) << i;
  }
}

class FaultyTierTest : public ::testing::Test {
 protected:
  MemoryTier inner_{"mem", 1 << 20};
  FaultyTier tier_{&inner_, 7};
};

TEST_F(FaultyTierTest, NoSpaceOnAllocateAndWrite) {
  tier_.AddRule({FaultOp::kAllocate, FaultKind::kNoSpace, /*skip=*/1, /*count=*/1});
  ASSERT_OK_AND_ASSIGN(TierRegion r, tier_.Allocate(4096));  // skipped
  auto failed = tier_.Allocate(4096);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(failed.status().sys_errno(), ENOSPC);
  ASSERT_OK_AND_ASSIGN(TierRegion r2, tier_.Allocate(4096));  // count exhausted
  (void)r2;

  auto old = Pattern(4096, 3), fresh = Pattern(4096, 9);
  ASSERT_OK(tier_.Write(r, old.data()));
  tier_.AddRule({FaultOp::kWrite, FaultKind::kNoSpace});
  Status s = tier_.Write(r, fresh.data());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  std::vector<uint8_t> back(4096);
  ASSERT_OK(tier_.Read(r, back.data()));
  EXPECT_EQ(back, old) << "an ENOSPC write must not change the region";
  EXPECT_EQ(tier_.injected(), 2u);
}

TEST_F(FaultyTierTest, IoErrorAndShortTransfersNeverReportSuccess) {
  ASSERT_OK_AND_ASSIGN(TierRegion r, tier_.Allocate(1000));
  auto old = Pattern(1000, 1), fresh = Pattern(1000, 2);
  ASSERT_OK(tier_.Write(r, old.data()));

  tier_.AddRule({FaultOp::kWrite, FaultKind::kShortTransfer});
  Status s = tier_.Write(r, fresh.data());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("500 of 1000"), std::string::npos);
  std::vector<uint8_t> back(1000);
  ASSERT_OK(tier_.Read(r, back.data()));
  EXPECT_EQ(0, std::memcmp(back.data(), fresh.data(), 500)) << "the first half landed";
  EXPECT_EQ(0, std::memcmp(back.data() + 500, old.data() + 500, 500)) << "the rest did not";

  tier_.AddRule({FaultOp::kRead, FaultKind::kIoError});
  EXPECT_EQ(tier_.Read(r, back.data()).code(), StatusCode::kIoError);
  tier_.AddRule({FaultOp::kRead, FaultKind::kShortTransfer});
  EXPECT_EQ(tier_.Read(r, back.data()).code(), StatusCode::kOutOfRange);
  tier_.AddRule({FaultOp::kWrite, FaultKind::kIoError});
  Status w = tier_.Write(r, fresh.data());
  EXPECT_EQ(w.code(), StatusCode::kIoError);
  EXPECT_EQ(w.sys_errno(), EIO);
}

TEST_F(FaultyTierTest, CorruptReadFlipsExactlyOneByte) {
  ASSERT_OK_AND_ASSIGN(TierRegion r, tier_.Allocate(4096));
  auto data = Pattern(4096, 5);
  ASSERT_OK(tier_.Write(r, data.data()));
  tier_.AddRule({FaultOp::kRead, FaultKind::kCorrupt});
  std::vector<uint8_t> back(4096);
  ASSERT_OK(tier_.Read(r, back.data()));  // the device lies: only checksums can tell
  int diffs = 0;
  for (size_t i = 0; i < back.size(); ++i) diffs += back[i] != data[i];
  EXPECT_EQ(diffs, 1);
  ASSERT_OK(tier_.Read(r, back.data()));  // the rule fired once
  EXPECT_EQ(back, data);
}

TEST_F(FaultyTierTest, ProbabilisticFaultsAreDeterministicPerSeed) {
  auto run = [](uint64_t seed) {
    MemoryTier inner("mem", 1 << 20);
    FaultyTier t(&inner, seed);
    FaultRule rule{FaultOp::kWrite, FaultKind::kIoError, 0, FaultRule::kForever, 0.3};
    t.AddRule(rule);
    auto r = t.Allocate(64).value();
    std::vector<uint8_t> d(64);
    std::vector<bool> failed;
    for (int i = 0; i < 200; ++i) failed.push_back(!t.Write(r, d.data()).ok());
    return failed;
  };
  auto a = run(11), b = run(11);
  EXPECT_EQ(a, b);
  int n = static_cast<int>(std::count(a.begin(), a.end(), true));
  EXPECT_GT(n, 30);
  EXPECT_LT(n, 100);
}

TEST_F(FaultyTierTest, LatencyDelaysButSucceeds) {
  ASSERT_OK_AND_ASSIGN(TierRegion r, tier_.Allocate(16));
  tier_.AddRule({FaultOp::kWrite, FaultKind::kLatency, 0, 1, 1.0, std::chrono::milliseconds(30)});
  auto t0 = std::chrono::steady_clock::now();
  std::vector<uint8_t> d(16, 1);
  ASSERT_OK(tier_.Write(r, d.data()));
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(30));
}

}  // namespace
}  // namespace strata
