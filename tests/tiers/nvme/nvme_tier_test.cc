// NvmeTier honours the Tier contract: budgets, whole-region async I/O, stats, checksums.
#include "tiers/nvme/nvme_tier.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "tests/test_util.h"

namespace strata::nvme {
namespace {

using strata::testing::TempDir;

NvmeTierOptions Options(const std::string& dir, uint64_t capacity) {
  NvmeTierOptions o;
  o.paths = {dir};
  o.capacity = capacity;
  o.aio.block_size = 128 * 1024;
  return o;
}

TEST(NvmeTierTest, BudgetIsEnforcedAndReturned) {
  TempDir t;
  ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(Options(t.path(), 1 << 20)));
  EXPECT_EQ(tier->name(), "nvme");
  EXPECT_EQ(tier->capacity(), 1u << 20);
  EXPECT_EQ(tier->alignment(), 4096u);
  ASSERT_OK_AND_ASSIGN(TierRegion a, tier->Allocate(600 << 10));
  EXPECT_EQ(a.size, 600u << 10);
  auto over = tier->Allocate(600 << 10);
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("strata.nvme_capacity"), std::string::npos);
  ASSERT_OK(tier->Free(a));
  ASSERT_OK_AND_ASSIGN(TierRegion b, tier->Allocate(600 << 10));
  EXPECT_EQ(tier->stats().bytes_allocated, 600u << 10);
  EXPECT_EQ(tier->stats().peak_bytes_allocated, 600u << 10);
  ASSERT_OK(tier->Free(b));
  EXPECT_EQ(tier->stats().bytes_allocated, 0u);
  // The tier's swap file and index go with it: nothing reopens them.
  EXPECT_FALSE(std::filesystem::is_empty(t.path()));
  tier.reset();
  EXPECT_TRUE(std::filesystem::is_empty(t.path()));
  TempDir u;
  ASSERT_OK_AND_ASSIGN(auto whole, NvmeTier::Create(Options(u.path(), 0)));
  EXPECT_GT(whole->capacity(), 1u << 20);  // the free space of the file system
}

TEST(NvmeTierTest, AsyncRegionsRoundTripWithStats) {
  TempDir t;
  ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(Options(t.path(), 8 << 20)));
  constexpr int kN = 16;
  std::vector<TierRegion> regions;
  std::vector<char*> src, dst;
  std::mt19937 rng(1);
  uint64_t total = 0;
  for (int i = 0; i < kN; ++i) {
    const uint64_t n = 4096 * (1 + i) + (i % 3 == 0 ? 0 : 123);
    ASSERT_OK_AND_ASSIGN(TierRegion r, tier->Allocate(n));
    regions.push_back(r);
    void* p = nullptr;
    void* q = nullptr;
    ASSERT_EQ(posix_memalign(&p, 4096, n + 4096), 0);
    ASSERT_EQ(posix_memalign(&q, 4096, n + 4096), 0);
    for (uint64_t k = 0; k < n; ++k) static_cast<char*>(p)[k] = static_cast<char>(rng());
    src.push_back(static_cast<char*>(p));
    dst.push_back(static_cast<char*>(q));
    total += n;
  }
  std::atomic<int> ok{0};
  for (int i = 0; i < kN; ++i) tier->WriteAsync(regions[i], src[i], [&](Status s) { if (s.ok()) ok++; });
  while (ok.load() < kN) std::this_thread::yield();
  for (int i = 0; i < kN; ++i) ASSERT_OK(tier->Read(regions[i], dst[i]));
  for (int i = 0; i < kN; ++i) EXPECT_EQ(std::memcmp(src[i], dst[i], regions[i].size), 0) << i;
  TierStats st = tier->stats();
  EXPECT_EQ(st.writes, uint64_t{kN});
  EXPECT_EQ(st.reads, uint64_t{kN});
  EXPECT_EQ(st.bytes_written, total);
  EXPECT_EQ(st.bytes_read, total);
  EXPECT_EQ(st.errors, 0u);
  EXPECT_GT(st.busy_seconds, 0.0);
  for (int i = 0; i < kN; ++i) {
    std::free(src[i]);
    std::free(dst[i]);
  }
}

TEST(NvmeTierTest, FaultsAndCorruptionAreErrorsCounted) {
  TempDir t;
  std::atomic<bool> fail{false};
  auto o = Options(t.path(), 1 << 20);
  o.fault_hook = [&](const IoAttempt&, int64_t res) -> int64_t { return fail ? -EIO : res; };
  ASSERT_OK_AND_ASSIGN(auto tier, NvmeTier::Create(o));
  ASSERT_OK_AND_ASSIGN(TierRegion r, tier->Allocate(8192));
  std::vector<char> buf(8192, 'x');
  fail = true;
  EXPECT_EQ(tier->Write(r, buf.data()).code(), StatusCode::kIoError);
  fail = false;
  ASSERT_OK(tier->Write(r, buf.data()));
  ASSERT_OK_AND_ASSIGN(auto ext, tier->store().Locate(r.id));
  {
    FILE* f = std::fopen(ext[0].path.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, static_cast<long>(ext[0].file_offset + 100), SEEK_SET);
    std::fputc('y', f);
    std::fclose(f);
  }
  Status s = tier->Read(r, buf.data());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_EQ(tier->stats().errors, 2u);
}

TEST(NvmeTierTest, OptionsComeFromTheConfig) {
  Config c;
  c.zero_optimization.offload_param.nvme_path = {"/a", "/b"};
  c.zero_optimization.offload_optimizer.nvme_path = {"/b", "/c"};
  c.strata.nvme_capacity = 1 << 30;
  c.strata.checksums = ChecksumKind::kNone;
  c.aio.block_size = 8 << 20;
  c.aio.queue_depth = 64;
  NvmeTierOptions o = NvmeTierOptionsFromConfig(c, 3);
  EXPECT_EQ(o.paths, (std::vector<std::string>{"/a", "/b", "/c"}));
  EXPECT_EQ(o.rank, 3u);
  EXPECT_EQ(o.capacity, 1u << 30);
  EXPECT_EQ(o.checksums, ChecksumKind::kNone);
  EXPECT_EQ(o.aio.block_size, 8 << 20);
  EXPECT_EQ(o.aio.queue_depth, 64);
}

}  // namespace
}  // namespace strata::nvme
