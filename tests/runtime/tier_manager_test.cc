#include "runtime/state/tier_manager.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/units.h"
#include "tests/test_util.h"
#include "tiers/faulty_tier.h"
#include "tiers/memory_tier.h"
#include "tiers/nvme/nvme_tier.h"

namespace strata {
namespace {

using std::chrono::milliseconds;

BlockId B(uint32_t chunk, StateKind kind = StateKind::kParam16) { return BlockId{chunk, kind}; }

// Deterministic contents: byte i of version `v` of a block.
void Fill(void* p, uint64_t n, uint64_t v) {
  auto* b = static_cast<uint8_t*>(p);
  uint64_t x = v * 0x9E3779B97F4A7C15ull + 1;
  for (uint64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b[i] = static_cast<uint8_t>(x);
  }
}

std::vector<uint8_t> Bytes(uint64_t n, uint64_t v) {
  std::vector<uint8_t> out(n);
  Fill(out.data(), n, v);
  return out;
}

TierManagerOptions Opts(uint64_t host_budget, EvictionPolicy p = EvictionPolicy::kNextUse, int64_t lookahead = 0) {
  TierManagerOptions o;
  o.host_budget = host_budget;
  o.eviction = p;
  o.prefetch_lookahead = lookahead;
  o.pool.force_pageable = true;  // tests need no locked memory
  return o;
}

// Every read from `nvme` takes `latency` longer.
void SlowReads(FaultyTier& nvme, std::chrono::microseconds latency) {
  FaultRule slow;
  slow.op = FaultOp::kRead;
  slow.kind = FaultKind::kLatency;
  slow.count = FaultRule::kForever;
  slow.latency = latency;
  nvme.AddRule(slow);
}

// Acquire for writing, fill with version v, release dirty.
Status WriteVersion(TierManager& m, BlockId id, uint64_t bytes, uint64_t v) {
  STRATA_ASSIGN_OR_RETURN(void* p, m.Acquire(id, Access::kWrite));
  Fill(p, bytes, v);
  return m.Release(id, true);
}

// Acquire for reading and compare with `want`.
Status ReadAndCheck(TierManager& m, BlockId id, const std::vector<uint8_t>& want) {
  STRATA_ASSIGN_OR_RETURN(void* p, m.Acquire(id, Access::kRead));
  const bool same = std::memcmp(p, want.data(), want.size()) == 0;
  STRATA_RETURN_IF_ERROR(m.Release(id, false));
  if (!same) return DataLoss(StrCat(ToString(id), ": contents differ from the last write"));
  return Status::Ok();
}

TEST(TierManagerTest, WriteEvictReadBack) {
  MemoryTier nvme("nvme", 1_MiB);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(128_KiB), &nvme));
  for (uint32_t c = 0; c < 6; ++c) ASSERT_OK(m->Register(B(c), 64_KiB, BlockHome::kNvme));
  for (uint32_t c = 0; c < 6; ++c) ASSERT_OK(WriteVersion(*m, B(c), 64_KiB, c + 100));
  // Only two fit: the others were written back before their room was reused.
  EXPECT_GE(nvme.stats().writes, 4u);
  for (uint32_t c = 0; c < 6; ++c) ASSERT_OK(ReadAndCheck(*m, B(c), Bytes(64_KiB, c + 100)));
  TierManagerStats s = m->stats();
  EXPECT_LE(s.peak_host_bytes_resident, 128_KiB);
  EXPECT_GT(s.bytes_nvme_to_host, 0u);
  EXPECT_GT(s.evictions_dirty, 0u);
  EXPECT_EQ(s.host_budget, 128_KiB);
}

TEST(TierManagerTest, NeverWrittenBlocksReadAsZeros) {
  MemoryTier nvme("nvme", 1_MiB);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(64_KiB), &nvme));
  ASSERT_OK(m->Register(B(0), 10000, BlockHome::kNvme));
  ASSERT_OK_AND_ASSIGN(void* p, m->Acquire(B(0), Access::kRead));
  std::vector<uint8_t> zeros(10000, 0);
  EXPECT_EQ(std::memcmp(p, zeros.data(), zeros.size()), 0);
  ASSERT_OK(m->Release(B(0), false));
  EXPECT_EQ(m->stats().nvme_misses, 1u);
  EXPECT_EQ(m->stats().bytes_zero_filled, 10000u);
  EXPECT_EQ(nvme.stats().reads, 0u);
}

TEST(TierManagerTest, PlanErrorsAtRegister) {
  MemoryTier nvme("nvme", 256_KiB);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(96_KiB), &nvme));
  // 96 KiB arena: the largest slot is 64 KiB.
  Status big = m->Register(B(0), 65_KiB, BlockHome::kNvme);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(big.message().find("chunk 0 param16"), std::string::npos) << big;
  EXPECT_NE(big.message().find("strata.host_memory_budget"), std::string::npos) << big;
  Status zero = m->Register(B(1), 0, BlockHome::kNvme);
  EXPECT_EQ(zero.code(), StatusCode::kInvalidArgument);
  ASSERT_OK(m->Register(B(2), 64_KiB, BlockHome::kNvme));
  EXPECT_EQ(m->Register(B(2), 64_KiB, BlockHome::kNvme).code(), StatusCode::kAlreadyExists);
  // NVMe capacity is reserved at Register: the fifth 64 KiB block does not fit in 256 KiB.
  for (uint32_t c = 3; c < 6; ++c) ASSERT_OK(m->Register(B(c), 64_KiB, BlockHome::kNvme));
  Status full = m->Register(B(6), 64_KiB, BlockHome::kNvme);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("chunk 6"), std::string::npos) << full;
  // Host-only blocks may not starve the NVMe-backed ones of room.
  Status starve = m->Register(B(7, StateKind::kMaster32), 64_KiB, BlockHome::kHostOnly);
  EXPECT_EQ(starve.code(), StatusCode::kResourceExhausted) << starve;
  ASSERT_OK(m->Register(B(8, StateKind::kMaster32), 32_KiB, BlockHome::kHostOnly));
  // Without an NVMe tier only host-only blocks exist.
  ASSERT_OK_AND_ASSIGN(auto host_only, TierManager::Create(Opts(64_KiB), nullptr));
  EXPECT_EQ(host_only->Register(B(0), 4_KiB, BlockHome::kNvme).code(), StatusCode::kFailedPrecondition);
  ASSERT_OK(host_only->Register(B(0), 4_KiB, BlockHome::kHostOnly));
  ASSERT_OK(WriteVersion(*host_only, B(0), 4_KiB, 5));
  ASSERT_OK(ReadAndCheck(*host_only, B(0), Bytes(4_KiB, 5)));
  EXPECT_FALSE(TierManager::Create(Opts(0), &nvme).ok());
}

TEST(TierManagerTest, ReleaseMisuseIsAnError) {
  MemoryTier nvme("nvme", 1_MiB);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(64_KiB), &nvme));
  ASSERT_OK(m->Register(B(0), 4_KiB, BlockHome::kNvme));
  EXPECT_EQ(m->Release(B(0), false).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(m->Release(B(9), false).code(), StatusCode::kNotFound);
  EXPECT_EQ(m->Acquire(B(9), Access::kRead).status().code(), StatusCode::kNotFound);
  ASSERT_OK(m->Acquire(B(0), Access::kRead).status());
  Status s = m->Release(B(0), true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("kReadWrite"), std::string::npos) << s;
  ASSERT_OK(m->Release(B(0), false));
}

TEST(TierManagerTest, CleanBlocksAreDroppedWithoutWriting) {
  MemoryTier nvme("nvme", 1_MiB);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(64_KiB), &nvme));
  for (uint32_t c = 0; c < 4; ++c) ASSERT_OK(m->Register(B(c), 32_KiB, BlockHome::kNvme));
  for (uint32_t c = 0; c < 4; ++c) ASSERT_OK(WriteVersion(*m, B(c), 32_KiB, c));
  ASSERT_OK(m->Flush());
  const uint64_t writes = nvme.stats().writes;
  for (int round = 0; round < 3; ++round)
    for (uint32_t c = 0; c < 4; ++c) ASSERT_OK(ReadAndCheck(*m, B(c), Bytes(32_KiB, c)));
  EXPECT_EQ(nvme.stats().writes, writes) << "reading never writes back";
  EXPECT_GT(m->stats().evictions_clean, 0u);
}

TEST(TierManagerTest, FlushWritesEveryDirtyBlockAndKeepsThemResident) {
  MemoryTier nvme("nvme", 1_MiB);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(256_KiB), &nvme));
  for (uint32_t c = 0; c < 4; ++c) ASSERT_OK(m->Register(B(c), 40_KiB, BlockHome::kNvme));
  for (uint32_t c = 0; c < 4; ++c) ASSERT_OK(WriteVersion(*m, B(c), 40_KiB, c + 7));
  ASSERT_OK_AND_ASSIGN(void* p, m->Acquire(B(0), Access::kReadWrite));
  Fill(p, 40_KiB, 99);
  Status pinned = m->Flush();
  EXPECT_EQ(pinned.code(), StatusCode::kFailedPrecondition) << "a block pinned for writing cannot be flushed";
  ASSERT_OK(m->Release(B(0), true));
  ASSERT_OK(m->Flush());
  for (uint32_t c = 0; c < 4; ++c) {
    ASSERT_OK_AND_ASSIGN(BlockInfo info, m->Query(B(c)));
    EXPECT_EQ(info.host, HostResidency::kClean);
    EXPECT_EQ(info.nvme, NvmeResidency::kResident);
    std::vector<uint8_t> on_nvme(40_KiB);
    ASSERT_OK(nvme.Read(info.nvme_region, on_nvme.data()));
    EXPECT_EQ(on_nvme, Bytes(40_KiB, c == 0 ? 99 : c + 7)) << ToString(B(c));
  }
}

// A cyclic trace one block larger than the pool: LRU misses every time, next-use keeps all but
// one block.
TEST(TierManagerTest, NextUseBeatsLruOnACyclicTrace) {
  auto run = [](EvictionPolicy policy) -> TierManagerStats {
    MemoryTier nvme("nvme", 1_MiB);
    auto mo = TierManager::Create(Opts(192_KiB, policy, 0), &nvme);
    EXPECT_TRUE(mo.ok());
    auto& m = *mo;
    for (uint32_t c = 0; c < 4; ++c) EXPECT_OK(m->Register(B(c), 64_KiB, BlockHome::kNvme));
    for (uint32_t c = 0; c < 4; ++c) EXPECT_OK(WriteVersion(*m, B(c), 64_KiB, c));
    TierManagerStats before{};
    for (int it = 0; it < 6; ++it) {
      EXPECT_OK(m->BeginIteration());
      for (uint32_t c = 0; c < 4; ++c) EXPECT_OK(ReadAndCheck(*m, B(c), Bytes(64_KiB, c)));
      EXPECT_OK(m->EndIteration());
      if (it == 0) before = m->stats();
    }
    TierManagerStats after = m->stats();
    after.host_hits -= before.host_hits;
    after.host_misses -= before.host_misses;
    EXPECT_EQ(after.trace_length, 4u);
    EXPECT_EQ(after.trace_deviations, 0u);
    return after;
  };
  TierManagerStats lru = run(EvictionPolicy::kLru);
  TierManagerStats belady = run(EvictionPolicy::kNextUse);
  EXPECT_EQ(lru.host_hits, 0u) << "LRU on a cycle one larger than the cache never hits";
  EXPECT_GE(belady.host_hits, 8u) << "next use keeps two of the four blocks across the cycle";
  EXPECT_GT(belady.host_hits, lru.host_hits);
}

// A thread that runs one closure at a time, on request, and waits for it: keeps a thread identity
// across calls while the test fixes the exact order of every access.
class SerialThread {
 public:
  SerialThread() : t_([this] { Loop(); }) {}
  ~SerialThread() {
    Run(nullptr);
    t_.join();
  }
  // Runs `fn` on the thread and returns once it has finished (nullptr stops the thread).
  void Run(std::function<void()> fn) {
    std::unique_lock<std::mutex> l(mu_);
    job_ = std::move(fn);
    stop_ = !job_;
    pending_ = true;
    cv_.notify_all();
    cv_.wait(l, [&] { return !pending_; });
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return pending_; });
      if (stop_) {
        pending_ = false;
        cv_.notify_all();
        return;
      }
      job_();
      pending_ = false;
      cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::function<void()> job_;
  bool pending_ = false, stop_ = false;
  std::thread t_;  // last: starts once the members it uses exist
};

// The engine's deferred updates: an "optimizer" thread rewrites a chunk's parameter and state
// blocks, and a "compute" thread then reads the parameter. The trace is recorded with the two in
// lockstep; later iterations run the optimizer two chunks ahead. Each thread keeps its own place
// in the trace, so next use still sees the updated parameters as needed soonest and evicts the
// states (needed next iteration) instead: compute never misses. With one shared position the
// optimizer's accesses would drag it past compute's and the parameters would be evicted first.
TEST(TierManagerTest, LanesKeepTheirOwnPlaceInTheTrace) {
  constexpr uint32_t kChunks = 8;
  constexpr uint64_t kBytes = 64_KiB;
  MemoryTier nvme("nvme", 4_MiB);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(4 * kBytes), &nvme));
  auto P = [](uint32_t c) { return B(c, StateKind::kParam16); };
  auto S = [](uint32_t c) { return B(c, StateKind::kExpAvg); };
  std::map<uint64_t, uint64_t> version;  // block key -> the version its bytes hold
  for (uint32_t c = 0; c < kChunks; ++c) {
    for (BlockId id : {P(c), S(c)}) {
      ASSERT_OK(m->Register(id, kBytes, BlockHome::kNvme));
      ASSERT_OK(WriteVersion(*m, id, kBytes, 1));
      version[id.key()] = 1;
    }
  }
  ASSERT_OK(m->Flush());
  SerialThread optimizer, compute;
  auto update = [&](uint32_t c) {
    optimizer.Run([&] {
      for (BlockId id : {P(c), S(c)}) {
        auto p = m->Acquire(id, Access::kReadWrite);
        ASSERT_OK(p.status());
        ASSERT_EQ(std::memcmp(*p, Bytes(kBytes, version[id.key()]).data(), kBytes), 0) << ToString(id);
        Fill(*p, kBytes, ++version[id.key()]);
        ASSERT_OK(m->Release(id, true));
      }
    });
  };
  uint64_t compute_reads = 0, compute_misses = 0;
  auto use = [&](uint32_t c) {
    compute.Run([&] {
      const uint64_t misses = m->stats().host_misses + m->stats().host_inflight_hits;
      ASSERT_OK(ReadAndCheck(*m, P(c), Bytes(kBytes, version[P(c).key()])));
      ++compute_reads;
      compute_misses += m->stats().host_misses + m->stats().host_inflight_hits - misses;
    });
  };
  // Recorded: update c, use c.
  ASSERT_OK(m->BeginIteration());
  for (uint32_t c = 0; c < kChunks; ++c) {
    update(c);
    use(c);
  }
  ASSERT_OK(m->EndIteration());
  // Replayed with the optimizer two chunks ahead of compute.
  compute_reads = compute_misses = 0;
  for (int it = 0; it < 3; ++it) {
    ASSERT_OK(m->BeginIteration());
    for (uint32_t c = 0; c < kChunks + 2; ++c) {
      if (c < kChunks) update(c);
      if (c >= 2) use(c - 2);
    }
    ASSERT_OK(m->EndIteration());
  }
  EXPECT_EQ(compute_reads, 3u * kChunks);
  EXPECT_EQ(compute_misses, 0u) << "compute read a parameter the optimizer had just written, after it was evicted";
  // The state blocks made the room: each was written back and dropped between iterations.
  EXPECT_GT(m->stats().evictions_dirty, 0u);
}

// A lane that has finished its part of the iteration is not due "now": an "optimizer" thread
// updates four state blocks, then a "compute" thread reads eight parameters, through a pool of
// four blocks with reads 1 ms slow. Measured from each lane's own next entry, the finished
// optimizer's states and the compute lane's first parameters all look due at once (in the
// compute phase, and again at the iteration boundary, where both lanes' first entries sit at
// distance 0), so the window fetches blocks that are evicted again before use. Measured from
// the iteration's frontier, each block is read at most once per iteration.
TEST(TierManagerTest, AFinishedLaneWaitsForTheFrontier) {
  constexpr uint32_t kStates = 4, kParams = 8;
  constexpr uint64_t kBytes = 64_KiB;
  MemoryTier mem("nvme", 4_MiB);
  FaultyTier nvme(&mem, 1);
  SlowReads(nvme, std::chrono::microseconds(1000));
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(4 * kBytes, EvictionPolicy::kNextUse, 2), &nvme));
  auto P = [](uint32_t c) { return B(c, StateKind::kParam16); };
  auto S = [](uint32_t c) { return B(c, StateKind::kExpAvg); };
  std::map<uint64_t, uint64_t> version;
  for (uint32_t c = 0; c < kParams; ++c) {
    std::vector<BlockId> ids{P(c)};
    if (c < kStates) ids.push_back(S(c));
    for (BlockId id : ids) {
      ASSERT_OK(m->Register(id, kBytes, BlockHome::kNvme));
      ASSERT_OK(WriteVersion(*m, id, kBytes, 1));
      version[id.key()] = 1;
    }
  }
  ASSERT_OK(m->Flush());
  SerialThread optimizer, compute;
  uint64_t compute_misses = 0;
  auto iteration = [&] {
    optimizer.Run([&] {
      for (uint32_t c = 0; c < kStates; ++c) {
        auto p = m->Acquire(S(c), Access::kReadWrite);
        ASSERT_OK(p.status());
        ASSERT_EQ(std::memcmp(*p, Bytes(kBytes, version[S(c).key()]).data(), kBytes), 0);
        Fill(*p, kBytes, ++version[S(c).key()]);
        ASSERT_OK(m->Release(S(c), true));
      }
    });
    compute.Run([&] {
      for (uint32_t c = 0; c < kParams; ++c) {
        const uint64_t misses = m->stats().host_misses + m->stats().host_inflight_hits;
        ASSERT_OK(ReadAndCheck(*m, P(c), Bytes(kBytes, 1)));
        compute_misses += m->stats().host_misses + m->stats().host_inflight_hits - misses;
        std::this_thread::sleep_for(std::chrono::milliseconds(3));  // "compute"
      }
    });
  };
  ASSERT_OK(m->BeginIteration());
  iteration();
  ASSERT_OK(m->EndIteration());
  compute_misses = 0;
  const uint64_t reads_before = m->stats().reads_nvme_to_host;
  constexpr int kIterations = 3;
  for (int it = 0; it < kIterations; ++it) {
    ASSERT_OK(m->BeginIteration());
    iteration();
    ASSERT_OK(m->EndIteration());
  }
  // Prefetch kept the parameters ahead of compute (a slow machine may catch one late).
  EXPECT_LE(compute_misses, static_cast<uint64_t>(kIterations)) << m->StatsJson().dump(2);
  // No block read twice in an iteration: 34 reads here (two states stay resident across the
  // boundary); measured from each lane's own next entry, 37 where 36 would do.
  EXPECT_LE(m->stats().reads_nvme_to_host - reads_before, kIterations * (kParams + kStates))
      << m->StatsJson().dump(2);
}

TEST(TierManagerTest, TracePrefetchHidesReads) {
  MemoryTier mem("nvme", 4_MiB);
  FaultyTier nvme(&mem, 1);
  SlowReads(nvme, std::chrono::microseconds(2000));
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(256_KiB, EvictionPolicy::kNextUse, 3), &nvme));
  constexpr uint32_t kN = 12;
  for (uint32_t c = 0; c < kN; ++c) ASSERT_OK(m->Register(B(c), 32_KiB, BlockHome::kNvme));
  for (uint32_t c = 0; c < kN; ++c) ASSERT_OK(WriteVersion(*m, B(c), 32_KiB, c));
  ASSERT_OK(m->Flush());
  for (int it = 0; it < 4; ++it) {
    ASSERT_OK(m->BeginIteration());
    for (uint32_t c = 0; c < kN; ++c) {
      ASSERT_OK(ReadAndCheck(*m, B(c), Bytes(32_KiB, c)));
      std::this_thread::sleep_for(std::chrono::milliseconds(3));  // "compute"
    }
    ASSERT_OK(m->EndIteration());
  }
  TierManagerStats s = m->stats();
  EXPECT_GT(s.prefetches_issued, 0u);
  EXPECT_GT(s.prefetches_used, 0u);
  EXPECT_LE(s.peak_host_bytes_resident, 256_KiB);
  // After the first iteration almost every access finds its block resident.
  EXPECT_GE(s.host_hits, 2u * kN) << m->StatsJson().dump(2);
}

TEST(TierManagerTest, AcquireTimesOutWhenEverythingIsPinned) {
  MemoryTier nvme("nvme", 1_MiB);
  TierManagerOptions o = Opts(64_KiB);
  o.acquire_timeout = milliseconds(100);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(o, &nvme));
  ASSERT_OK(m->Register(B(0), 64_KiB, BlockHome::kNvme));
  ASSERT_OK(m->Register(B(1), 64_KiB, BlockHome::kNvme));
  ASSERT_OK(m->Acquire(B(0), Access::kWrite).status());
  auto r = m->Acquire(B(1), Access::kRead);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status().message().find("1 blocks pinned"), std::string::npos) << r.status();
  // Back-pressure, not failure: once the pin goes, the same request succeeds.
  ASSERT_OK(m->Release(B(0), true));
  ASSERT_OK(m->Acquire(B(1), Access::kRead).status());
  ASSERT_OK(m->Release(B(1), false));
}

TEST(TierManagerTest, FailedWriteBackKeepsTheBlockDirty) {
  MemoryTier mem("nvme", 1_MiB);
  FaultyTier nvme(&mem, 1);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(64_KiB), &nvme));
  ASSERT_OK(m->Register(B(0), 64_KiB, BlockHome::kNvme));
  ASSERT_OK(m->Register(B(1), 64_KiB, BlockHome::kNvme));
  ASSERT_OK(WriteVersion(*m, B(0), 64_KiB, 1));
  FaultRule eio;
  eio.op = FaultOp::kWrite;
  eio.kind = FaultKind::kIoError;
  eio.count = 1;
  nvme.AddRule(eio);
  auto r = m->Acquire(B(1), Access::kWrite);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIoError) << r.status();
  EXPECT_NE(r.status().message().find("chunk 0 param16"), std::string::npos) << r.status();
  ASSERT_OK_AND_ASSIGN(BlockInfo info, m->Query(B(0)));
  EXPECT_EQ(info.host, HostResidency::kDirty) << "no data is lost";
  EXPECT_EQ(info.nvme, NvmeResidency::kAbsent) << "the NVMe copy is undefined after a failed write";
  // The fault was transient: the next request retries the write-back and succeeds.
  ASSERT_OK(WriteVersion(*m, B(1), 64_KiB, 2));
  ASSERT_OK(ReadAndCheck(*m, B(0), Bytes(64_KiB, 1)));
  ASSERT_OK(ReadAndCheck(*m, B(1), Bytes(64_KiB, 2)));
  EXPECT_EQ(m->stats().write_errors, 1u);
}

TEST(TierManagerTest, FlushReportsNoSpaceAndRetries) {
  MemoryTier mem("nvme", 1_MiB);
  FaultyTier nvme(&mem, 1);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(128_KiB), &nvme));
  ASSERT_OK(m->Register(B(0), 16_KiB, BlockHome::kNvme));
  ASSERT_OK(m->Register(B(1), 16_KiB, BlockHome::kNvme));
  ASSERT_OK(WriteVersion(*m, B(0), 16_KiB, 3));
  ASSERT_OK(WriteVersion(*m, B(1), 16_KiB, 4));
  FaultRule nospace;
  nospace.op = FaultOp::kWrite;
  nospace.kind = FaultKind::kNoSpace;
  nospace.count = 2;
  nvme.AddRule(nospace);
  Status s = m->Flush();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("2 write-backs failed"), std::string::npos) << s;
  ASSERT_OK(m->Flush());
  for (uint32_t c = 0; c < 2; ++c) {
    ASSERT_OK_AND_ASSIGN(BlockInfo info, m->Query(B(c)));
    std::vector<uint8_t> on_nvme(16_KiB);
    ASSERT_OK(mem.Read(info.nvme_region, on_nvme.data()));
    EXPECT_EQ(on_nvme, Bytes(16_KiB, c + 3));
  }
}

TEST(TierManagerTest, FailedReadsAreNeverHandedOut) {
  MemoryTier mem("nvme", 1_MiB);
  FaultyTier nvme(&mem, 1);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(64_KiB), &nvme));
  ASSERT_OK(m->Register(B(0), 64_KiB, BlockHome::kNvme));
  ASSERT_OK(m->Register(B(1), 64_KiB, BlockHome::kNvme));
  ASSERT_OK(WriteVersion(*m, B(0), 64_KiB, 8));
  ASSERT_OK(WriteVersion(*m, B(1), 64_KiB, 9));  // evicts chunk 0 to NVMe
  for (FaultKind kind : {FaultKind::kIoError, FaultKind::kShortTransfer}) {
    FaultRule rule;
    rule.op = FaultOp::kRead;
    rule.kind = kind;
    nvme.AddRule(rule);
    auto r = m->Acquire(B(0), Access::kRead);
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.status().message().find("reading chunk 0 param16"), std::string::npos) << r.status();
    ASSERT_OK_AND_ASSIGN(BlockInfo info, m->Query(B(0)));
    EXPECT_EQ(info.host, HostResidency::kAbsent);
    EXPECT_EQ(info.pins, 0);
    nvme.ClearRules();
    ASSERT_OK(ReadAndCheck(*m, B(0), Bytes(64_KiB, 8)));
    ASSERT_OK(ReadAndCheck(*m, B(1), Bytes(64_KiB, 9)));  // pushes chunk 0 out again
  }
  EXPECT_EQ(m->stats().read_errors, 2u);
}

TEST(TierManagerTest, UnregisterFreesBothTiers) {
  MemoryTier nvme("nvme", 128_KiB);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(64_KiB), &nvme));
  ASSERT_OK(m->Register(B(0), 64_KiB, BlockHome::kNvme));
  ASSERT_OK(m->Register(B(1), 64_KiB, BlockHome::kNvme));
  EXPECT_FALSE(m->Register(B(2), 64_KiB, BlockHome::kNvme).ok());
  ASSERT_OK(m->Acquire(B(0), Access::kWrite).status());
  EXPECT_EQ(m->Unregister(B(0)).code(), StatusCode::kFailedPrecondition);
  ASSERT_OK(m->Release(B(0), true));
  ASSERT_OK(m->Unregister(B(0)));
  EXPECT_EQ(m->host_pool().stats().bytes_in_use, 0u);
  ASSERT_OK(m->Register(B(2), 64_KiB, BlockHome::kNvme));
}

// Note [resident region] in tiers/host/pinned_pool.cc: host-only blocks take their size in the
// resident region the options set apart, leaving the arena whole for NVMe blocks; once the region
// is full they take classes of the arena as before; unregistering gives the bytes back.
TEST(TierManagerTest, HostOnlyBlocksFillTheResidentRegionAtTheirSize) {
  MemoryTier nvme("nvme", 1_MiB);
  TierManagerOptions o = Opts(64_KiB + 2 * PoolResidentBytes(36_KiB));
  o.resident_bytes = 2 * PoolResidentBytes(36_KiB);  // two 36 KiB blocks: 88 KiB, not 128
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(o, &nvme));
  EXPECT_EQ(m->host_pool().arena_bytes(), 64_KiB);
  ASSERT_OK(m->Register(B(0, StateKind::kMaster32), 36_KiB, BlockHome::kHostOnly));
  ASSERT_OK(m->Register(B(1, StateKind::kMaster32), 36_KiB, BlockHome::kHostOnly));
  EXPECT_EQ(m->host_pool().stats().resident_in_use, 2 * PoolResidentBytes(36_KiB));
  EXPECT_EQ(m->host_pool().stats().bytes_in_use, 0u) << "the arena is untouched";
  // The whole arena is still there for a 64 KiB NVMe block, next to both host-only ones.
  ASSERT_OK(m->Register(B(2), 64_KiB, BlockHome::kNvme));
  ASSERT_OK(WriteVersion(*m, B(2), 64_KiB, 7));
  ASSERT_OK(WriteVersion(*m, B(0, StateKind::kMaster32), 36_KiB, 8));
  ASSERT_OK(WriteVersion(*m, B(1, StateKind::kMaster32), 36_KiB, 9));
  ASSERT_OK(ReadAndCheck(*m, B(2), Bytes(64_KiB, 7)));
  ASSERT_OK(ReadAndCheck(*m, B(0, StateKind::kMaster32), Bytes(36_KiB, 8)));
  ASSERT_OK(ReadAndCheck(*m, B(1, StateKind::kMaster32), Bytes(36_KiB, 9)));
  // The region is full: a third host-only block would take the arena's 64 KiB class, which the
  // NVMe block needs, and is refused as before.
  Status refused = m->Register(B(3, StateKind::kMaster32), 36_KiB, BlockHome::kHostOnly);
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("resident region"), std::string::npos) << refused;
  EXPECT_EQ(m->host_pool().stats().failed_allocations, 0u) << "falling back is routine";
  // Unregistering one gives its range back, and the next host-only block takes it.
  ASSERT_OK(m->Unregister(B(0, StateKind::kMaster32)));
  EXPECT_EQ(m->host_pool().stats().resident_in_use, PoolResidentBytes(36_KiB));
  ASSERT_OK(m->Register(B(3, StateKind::kMaster32), 30_KiB, BlockHome::kHostOnly));
  EXPECT_EQ(m->host_pool().stats().bytes_in_use, 64_KiB) << "only the NVMe block's class";
  EXPECT_EQ(m->stats().host_bytes_resident, 64_KiB + PoolResidentBytes(36_KiB) + PoolResidentBytes(30_KiB));
  const nlohmann::json pool = m->StatsJson()["host"]["pool"];
  EXPECT_EQ(pool["resident_bytes"].get<uint64_t>(), 2 * PoolResidentBytes(36_KiB));
  EXPECT_EQ(pool["resident_in_use"].get<uint64_t>(), PoolResidentBytes(36_KiB) + PoolResidentBytes(30_KiB));
  EXPECT_EQ(m->stats().host_budget, 64_KiB + 2 * PoolResidentBytes(36_KiB));
}

TEST(TierManagerTest, StatsJsonHasEveryTier) {
  MemoryTier nvme("nvme", 1_MiB);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(64_KiB), &nvme));
  ASSERT_OK(m->Register(B(0), 4_KiB, BlockHome::kNvme));
  ASSERT_OK(WriteVersion(*m, B(0), 4_KiB, 1));
  nlohmann::json j = m->StatsJson();
  for (const char* k : {"host", "nvme", "transfers", "eviction", "prefetch", "errors", "stall", "trace"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["host"]["pool"]["backing"], "pageable");
  EXPECT_EQ(j["host"]["misses"], 1);
  EXPECT_EQ(j["eviction"]["policy"], "next_use");
}

// The property test: random traces (with a repeating per-iteration skeleton so the trace paths
// run) against a reference map of block -> bytes, with and without injected faults. At every
// step: budgets hold (in-flight included), every successful read returns the last write, and
// every block without a host copy has its last write on NVMe.
struct PropertyCase {
  uint64_t seed;
  EvictionPolicy policy;
  int64_t lookahead;
  double fault_probability;
};

void PrintTo(const PropertyCase& c, std::ostream* os) {
  *os << "seed=" << c.seed << " policy=" << (c.policy == EvictionPolicy::kLru ? "lru" : "next_use")
      << " lookahead=" << c.lookahead << " faults=" << c.fault_probability;
}

class TierManagerPropertyTest : public ::testing::TestWithParam<PropertyCase> {};

TEST_P(TierManagerPropertyTest, RandomTracesMatchTheReference) {
  const PropertyCase pc = GetParam();
  std::mt19937_64 rng(pc.seed);
  constexpr uint32_t kChunks = 6;
  constexpr uint64_t kHostBudget = 160_KiB;
  MemoryTier mem("nvme", 4_MiB);
  FaultyTier nvme(&mem, pc.seed);
  if (pc.fault_probability > 0) {
    for (FaultOp op : {FaultOp::kRead, FaultOp::kWrite}) {
      for (FaultKind kind : {FaultKind::kIoError, FaultKind::kShortTransfer}) {
        FaultRule r;
        r.op = op;
        r.kind = kind;
        r.count = FaultRule::kForever;
        r.probability = pc.fault_probability;
        nvme.AddRule(r);
      }
    }
  }
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(kHostBudget, pc.policy, pc.lookahead), &nvme));
  std::vector<BlockId> ids;
  std::map<uint64_t, uint64_t> size;
  std::map<uint64_t, std::vector<uint8_t>> ref;  // the reference model: last written bytes
  for (uint32_t c = 0; c < kChunks; ++c) {
    for (StateKind k : {StateKind::kParam16, StateKind::kGrad, StateKind::kMaster32, StateKind::kExpAvg}) {
      BlockId id{c, k};
      const uint64_t n = (k == StateKind::kMaster32 || k == StateKind::kExpAvg) ? 20000 + 1000 * c : 9000 + 500 * c;
      ASSERT_OK(m->Register(id, n, BlockHome::kNvme));
      ids.push_back(id);
      size[id.key()] = n;
      ref[id.key()] = std::vector<uint8_t>(n, 0);
    }
  }
  BlockId host_only{99, StateKind::kExpAvgSq};
  ASSERT_OK(m->Register(host_only, 3000, BlockHome::kHostOnly));
  ref[host_only.key()] = std::vector<uint8_t>(3000, 0);
  size[host_only.key()] = 3000;
  ids.push_back(host_only);

  uint64_t version = 1;
  uint64_t errors = 0, reads_ok = 0;
  auto check_budgets = [&] {
    ASSERT_LE(m->host_pool().stats().bytes_in_use, kHostBudget);
    ASSERT_LE(m->stats().host_bytes_resident, kHostBudget);
    ASSERT_LE(mem.stats().bytes_allocated, mem.capacity());
  };
  // Dirty data reaches NVMe before its copy is dropped: an absent block's NVMe copy (or zeros,
  // if never written) is its last write.
  auto check_on_nvme = [&](BlockId id) {
    auto info = m->Query(id);
    ASSERT_TRUE(info.ok());
    if (info->host != HostResidency::kAbsent || info->home != BlockHome::kNvme) return;
    const auto& want = ref[id.key()];
    if (info->nvme == NvmeResidency::kAbsent) {
      ASSERT_TRUE(std::all_of(want.begin(), want.end(), [](uint8_t b) { return b == 0; }))
          << ToString(id) << " was dropped although its last write never reached NVMe";
      return;
    }
    std::vector<uint8_t> got(want.size());
    ASSERT_OK(mem.Read(info->nvme_region, got.data()));
    ASSERT_EQ(got, want) << ToString(id) << " was dropped before its last write reached NVMe";
  };
  // One access; failures must be NVMe errors (never a crash, never wrong data).
  auto access = [&](BlockId id, Access a) {
    const uint64_t n = size[id.key()];
    auto p = m->Acquire(id, a);
    if (!p.ok()) {
      const StatusCode c = p.status().code();
      ASSERT_TRUE(pc.fault_probability > 0 &&
                  (c == StatusCode::kIoError || c == StatusCode::kOutOfRange))
          << p.status();
      ++errors;
      return;
    }
    auto* bytes = static_cast<uint8_t*>(*p);
    if (a != Access::kWrite) {
      ASSERT_EQ(std::memcmp(bytes, ref[id.key()].data(), n), 0) << ToString(id) << " read a stale or corrupt copy";
      ++reads_ok;
    }
    if (a == Access::kRead || (a == Access::kReadWrite && rng() % 4 == 0)) {
      ASSERT_OK(m->Release(id, false));
    } else {
      ++version;
      Fill(bytes, n, version);
      ref[id.key()] = Bytes(n, version);
      ASSERT_OK(m->Release(id, true));
    }
  };

  // A per-iteration skeleton (forward over params, backward params+grads, optimizer) plus noise.
  std::vector<std::pair<BlockId, Access>> skeleton;
  for (uint32_t c = 0; c < kChunks; ++c) skeleton.push_back({BlockId{c, StateKind::kParam16}, Access::kRead});
  for (uint32_t c = kChunks; c-- > 0;) {
    skeleton.push_back({BlockId{c, StateKind::kParam16}, Access::kRead});
    skeleton.push_back({BlockId{c, StateKind::kGrad}, Access::kWrite});
  }
  for (uint32_t c = 0; c < kChunks; ++c) {
    skeleton.push_back({BlockId{c, StateKind::kGrad}, Access::kRead});
    skeleton.push_back({BlockId{c, StateKind::kMaster32}, Access::kReadWrite});
    skeleton.push_back({BlockId{c, StateKind::kExpAvg}, Access::kReadWrite});
    skeleton.push_back({BlockId{c, StateKind::kParam16}, Access::kWrite});
  }
  int steps = 0;
  for (int it = 0; it < 100 && steps < 3000; ++it) {
    ASSERT_OK(m->BeginIteration());
    for (auto& [id, a] : skeleton) {
      if (rng() % 8 == 0) {  // noise: a random access, a hint, a double pin or a flush
        BlockId r = ids[rng() % ids.size()];
        switch (rng() % 5) {
          case 0: access(r, Access::kRead); break;
          case 1: access(r, Access::kWrite); break;
          case 2: m->Prefetch(r); break;
          case 3: {
            BlockId o = ids[rng() % ids.size()];
            if (o == r) break;
            auto p1 = m->Acquire(r, Access::kRead);
            if (p1.ok()) {
              access(o, Access::kReadWrite);
              ASSERT_EQ(std::memcmp(*p1, ref[r.key()].data(), size[r.key()]), 0);
              ASSERT_OK(m->Release(r, false));
            } else {
              ++errors;
            }
            break;
          }
          case 4: {
            Status f = m->Flush();
            if (!f.ok()) {
              ASSERT_GT(pc.fault_probability, 0) << f;
              ++errors;
            }
            break;
          }
        }
        check_budgets();
        check_on_nvme(r);
      }
      access(id, a);
      check_budgets();
      check_on_nvme(id);
      check_on_nvme(ids[rng() % ids.size()]);
      if (HasFatalFailure()) return;
      ++steps;
    }
    ASSERT_OK(m->EndIteration());
  }
  EXPECT_GE(steps, 3000);
  // Flush everything (retrying past injected faults) and compare every block on NVMe.
  nvme.ClearRules();
  ASSERT_OK(m->Flush());
  for (BlockId id : ids) {
    auto info = m->Query(id);
    ASSERT_TRUE(info.ok());
    if (info->home != BlockHome::kNvme) continue;
    std::vector<uint8_t> got(size[id.key()]);
    if (info->nvme == NvmeResidency::kResident) {
      ASSERT_OK(mem.Read(info->nvme_region, got.data()));
      EXPECT_EQ(got, ref[id.key()]) << ToString(id);
    }
    ASSERT_OK(ReadAndCheck(*m, id, ref[id.key()]));
  }
  TierManagerStats s = m->stats();
  EXPECT_LE(s.peak_host_bytes_resident, kHostBudget);
  EXPECT_GT(s.trace_length, 0u);
  EXPECT_GT(reads_ok, 1000u);
  if (pc.fault_probability > 0) {
    EXPECT_GT(errors, 0u) << "faults were injected and reported";
  }
  if (pc.lookahead > 0) {
    EXPECT_GT(s.prefetches_issued, 0u);
  }
  EXPECT_GT(s.evictions_dirty + s.evictions_clean, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Seeds, TierManagerPropertyTest,
    ::testing::Values(PropertyCase{1, EvictionPolicy::kNextUse, 0, 0}, PropertyCase{2, EvictionPolicy::kNextUse, 4, 0},
                      PropertyCase{3, EvictionPolicy::kLru, 4, 0}, PropertyCase{4, EvictionPolicy::kNextUse, 8, 0},
                      PropertyCase{5, EvictionPolicy::kNextUse, 4, 0.03},
                      PropertyCase{6, EvictionPolicy::kLru, 2, 0.03}));

// Back-pressure: several threads acquire with a pool that fits three blocks. Nothing fails,
// nothing deadlocks (a watchdog fails the test instead of hanging), data stays right.
TEST(TierManagerTest, BackPressureWithManyThreadsNeverDeadlocks) {
  MemoryTier mem("nvme", 8_MiB);
  FaultyTier nvme(&mem, 5);
  FaultRule slow;
  slow.op = FaultOp::kWrite;
  slow.kind = FaultKind::kLatency;
  slow.count = FaultRule::kForever;
  slow.probability = 0.5;
  slow.latency = std::chrono::microseconds(300);
  nvme.AddRule(slow);
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(Opts(192_KiB, EvictionPolicy::kNextUse, 2), &nvme));
  constexpr int kThreads = 6;
  constexpr uint32_t kPerThread = 4;
  for (uint32_t c = 0; c < kThreads * kPerThread; ++c) ASSERT_OK(m->Register(B(c), 64_KiB, BlockHome::kNvme));
  std::atomic<int> bad{0};
  auto worker = [&](int t) {
    std::mt19937_64 rng(static_cast<uint64_t>(t) + 100);
    std::vector<uint64_t> versions(kPerThread, 0);
    for (int i = 0; i < 250; ++i) {
      const uint32_t k = static_cast<uint32_t>(rng() % kPerThread);
      const BlockId id = B(static_cast<uint32_t>(t) * kPerThread + k);
      if (rng() % 2 == 0) {
        auto p = m->Acquire(id, Access::kWrite);
        if (!p.ok()) {
          ++bad;
          continue;
        }
        versions[k] = static_cast<uint64_t>(t) * 1000000 + static_cast<uint64_t>(i) + 1;
        Fill(*p, 64_KiB, versions[k]);
        if (!m->Release(id, true).ok()) ++bad;
      } else {
        auto p = m->Acquire(id, Access::kRead);
        if (!p.ok()) {
          ++bad;
          continue;
        }
        std::vector<uint8_t> want = versions[k] == 0 ? std::vector<uint8_t>(64_KiB, 0) : Bytes(64_KiB, versions[k]);
        if (std::memcmp(*p, want.data(), want.size()) != 0) ++bad;
        if (!m->Release(id, false).ok()) ++bad;
      }
    }
  };
  auto done = std::async(std::launch::async, [&] {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
    for (auto& th : threads) th.join();
  });
  if (done.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    ADD_FAILURE() << "deadlock: workers did not finish within 30 s; " << m->StatsJson().dump();
    std::_Exit(1);
  }
  EXPECT_EQ(bad.load(), 0);
  TierManagerStats s = m->stats();
  EXPECT_LE(s.peak_host_bytes_resident, 192_KiB);
  EXPECT_GT(s.stalls, 0u) << "requests waited instead of failing";
}

// The same manager on the real NVMe tier: io_uring, O_DIRECT, crc32c, registered pool buffers.
TEST(TierManagerTest, RealNvmeTierRoundTripAndCorruptionIsDataLoss) {
  testing::TempDir dir;
  nvme::NvmeTierOptions no;
  no.paths = {dir.path()};
  no.capacity = 16_MiB;
  no.aio.block_size = 256 * 1024;
  ASSERT_OK_AND_ASSIGN(auto tier, nvme::NvmeTier::Create(no));
  TierManagerOptions o = Opts(1_MiB, EvictionPolicy::kNextUse, 0);
  o.pool.force_pageable = false;
  ASSERT_OK_AND_ASSIGN(auto m, TierManager::Create(o, tier.get()));
  Status reg = m->RegisterHostPoolWith(*tier);
  if (tier->store().stats().engine == "io_uring") ASSERT_OK(reg);
  constexpr uint32_t kN = 8;
  for (uint32_t c = 0; c < kN; ++c) ASSERT_OK(m->Register(B(c), 300_KiB + 123, BlockHome::kNvme));
  for (uint32_t c = 0; c < kN; ++c) ASSERT_OK(WriteVersion(*m, B(c), 300_KiB + 123, c + 1));
  for (int it = 0; it < 3; ++it) {
    ASSERT_OK(m->BeginIteration());
    for (uint32_t c = 0; c < kN; ++c) ASSERT_OK(ReadAndCheck(*m, B(c), Bytes(300_KiB + 123, c + 1)));
    ASSERT_OK(m->EndIteration());
  }
  ASSERT_OK(m->Flush());
  EXPECT_GT(m->stats().bytes_nvme_to_host, 0u);
  // Corrupt chunk 0 on disk, make sure it is not resident, and read it: DATA_LOSS, never bytes.
  for (uint32_t c = 1; c < kN; ++c) ASSERT_OK(ReadAndCheck(*m, B(c), Bytes(300_KiB + 123, c + 1)));
  ASSERT_OK_AND_ASSIGN(BlockInfo info, m->Query(B(0)));
  ASSERT_EQ(info.host, HostResidency::kAbsent);
  ASSERT_OK_AND_ASSIGN(auto extents, tier->store().Locate(info.nvme_region.id));
  ASSERT_FALSE(extents.empty());
  int fd = open(extents[0].path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const char junk[16] = "not the data!!!";
  ASSERT_EQ(pwrite(fd, junk, sizeof junk, static_cast<off_t>(extents[0].file_offset + 4096)), 16);
  close(fd);
  auto r = m->Acquire(B(0), Access::kRead);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
  // The block can still be overwritten (kWrite needs no read) and then reads back fine.
  ASSERT_OK(WriteVersion(*m, B(0), 300_KiB + 123, 77));
  ASSERT_OK(m->Flush());
  for (uint32_t c = 1; c < kN; ++c) ASSERT_OK(ReadAndCheck(*m, B(c), Bytes(300_KiB + 123, c + 1)));
  ASSERT_OK(ReadAndCheck(*m, B(0), Bytes(300_KiB + 123, 77)));
}

}  // namespace
}  // namespace strata
