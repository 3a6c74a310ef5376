#include "tiers/host/pinned_pool.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "runtime/base/host_info.h"
#include "runtime/base/units.h"
#include "tests/test_util.h"
#include "tiers/nvme/nvme_tier.h"

namespace strata {
namespace {

PinnedPoolOptions Pageable(uint64_t budget) {
  PinnedPoolOptions o;
  o.budget = budget;
  o.force_pageable = true;
  return o;
}

uint64_t Offset(const PinnedPool& pool, const void* p) {
  return static_cast<uint64_t>(static_cast<const char*>(p) - static_cast<const char*>(pool.IoRanges()[0].iov_base));
}

TEST(PinnedPoolTest, RejectsBadOptionsNamingThem) {
  auto s = PinnedPool::Create(Pageable(0));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("budget=0"), std::string::npos) << s.status();
  PinnedPoolOptions o = Pageable(1_MiB);
  o.min_block = 1000;
  s = PinnedPool::Create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("min_block=1000"), std::string::npos) << s.status();
  o = Pageable(1_MiB);
  o.numa_node = 4096;
  s = PinnedPool::Create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("numa_node=4096"), std::string::npos) << s.status();
}

TEST(PinnedPoolTest, BudgetIsNeverExceeded) {
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(Pageable(8_MiB)));
  EXPECT_EQ(pool->arena_bytes(), 8_MiB);
  EXPECT_EQ(pool->max_allocation(), 8_MiB);
  std::vector<PinnedBlock> blocks;
  for (int i = 0; i < 8; ++i) {
    ASSERT_OK_AND_ASSIGN(PinnedBlock b, pool->Allocate(1_MiB));
    EXPECT_EQ(b.class_bytes, 1_MiB);
    std::memset(b.ptr, i, b.size);  // the memory is usable
    blocks.push_back(b);
  }
  auto full = pool->Allocate(4096);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  PinnedPoolStats s = pool->stats();
  EXPECT_EQ(s.bytes_in_use, 8_MiB);
  EXPECT_EQ(s.peak_bytes_in_use, 8_MiB);
  EXPECT_EQ(s.live_allocations, 8u);
  EXPECT_EQ(s.failed_allocations, 1u);
  EXPECT_EQ(s.largest_free_block, 0u);
  // A class larger than the arena can ever hold is a different error: waiting would not help.
  auto never = pool->Allocate(9_MiB);
  ASSERT_FALSE(never.ok());
  EXPECT_EQ(never.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(never.status().message().find("host_memory_budget"), std::string::npos);
  for (auto& b : blocks) pool->Free(b);
  EXPECT_EQ(pool->stats().bytes_in_use, 0u);
  EXPECT_EQ(pool->stats().largest_free_block, 8_MiB);
}

TEST(PinnedPoolTest, SizeClassesAreAlignedPowersOfTwo) {
  PinnedPoolOptions o = Pageable(4_MiB);
  o.colour_step = 0;  // the buddy arithmetic itself: offsets are multiples of the class
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(o));
  EXPECT_EQ(pool->ClassBytes(1), 4096u);
  EXPECT_EQ(pool->ClassBytes(4096), 4096u);
  EXPECT_EQ(pool->ClassBytes(4097), 8192u);
  EXPECT_EQ(pool->ClassBytes(3_MiB), 4_MiB);
  std::mt19937_64 rng(3);
  std::vector<PinnedBlock> live;
  for (int i = 0; i < 40; ++i) {
    uint64_t n = 1 + rng() % 100000;
    ASSERT_OK_AND_ASSIGN(PinnedBlock b, pool->Allocate(n));
    EXPECT_EQ(b.size, n);
    EXPECT_EQ(b.class_bytes, pool->ClassBytes(n));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.ptr) % 4096, 0u);
    EXPECT_EQ(Offset(*pool, b.ptr) % b.class_bytes, 0u) << "a block is aligned to its class in the arena";
    live.push_back(b);
  }
  uint64_t req = 0;
  for (auto& b : live) req += b.size;
  EXPECT_EQ(pool->stats().bytes_requested, req);
  for (auto& b : live) pool->Free(b);
}

// Note [resident region]: blocks of the resident region take exactly PoolResidentBytes (whole
// pages and one or two more, an odd count), first fit; freed ranges merge with their neighbours,
// so freeing everything gives the whole region back as one range; the arena beside it is
// untouched.
TEST(PinnedPoolTest, ResidentBlocksTakeTheirSizeAndMerge) {
  EXPECT_EQ(PoolResidentBytes(1), 3 * 4096u);
  EXPECT_EQ(PoolResidentBytes(4096), 3 * 4096u);
  EXPECT_EQ(PoolResidentBytes(4097), 3 * 4096u);
  EXPECT_EQ(PoolResidentBytes(3 * 4096), 5 * 4096u);
  EXPECT_EQ(PoolResidentBytes(2_MiB), 2_MiB + 4096);
  // 302 bytes short of three quarters of a MiB: 193 pages (772 KiB) in the region, not a 1 MiB
  // class.
  const uint64_t odd = 768_KiB - 4096 - 302;
  const uint64_t held = PoolResidentBytes(odd);
  EXPECT_EQ(held, 193 * 4096u);
  PinnedPoolOptions o = Pageable(8_MiB);
  o.resident_bytes = 4 * held + 1;  // rounded up to a page
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(o));
  EXPECT_EQ(pool->resident_bytes(), 4 * held + 4096);
  EXPECT_EQ(pool->arena_bytes(), 8_MiB - 4 * held - 4096);
  EXPECT_EQ(pool->max_allocation(), 4_MiB);
  std::vector<PinnedBlock> res;
  for (int i = 0; i < 4; ++i) {
    ASSERT_OK_AND_ASSIGN(PinnedBlock b, pool->AllocateResident(odd));
    EXPECT_EQ(b.size, odd);
    EXPECT_EQ(b.class_bytes, held);
    EXPECT_TRUE(pool->IsResident(b));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.ptr) % 4096, 0u) << "O_DIRECT alignment";
    std::memset(b.ptr, 0xA0 + i, b.size);
    res.push_back(b);
  }
  // Side by side, an odd number of pages apart: all four at different addresses modulo 64 KiB
  // and modulo 1 MiB (Note [block colouring]).
  for (uint64_t m : {64_KiB, 1_MiB}) {
    std::set<uint64_t> residues;
    for (int i = 0; i < 4; ++i) residues.insert(Offset(*pool, res[i].ptr) % m);
    EXPECT_EQ(residues.size(), 4u) << "modulo " << m;
  }
  for (int i = 1; i < 4; ++i) EXPECT_EQ(Offset(*pool, res[i].ptr), Offset(*pool, res[i - 1].ptr) + held);
  // The region holds four; the fifth does not fit, and says so without touching the arena.
  auto full = pool->AllocateResident(odd);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("resident region"), std::string::npos) << full.status();
  // The arena is the rest of the mapping, and blocks there never overlap the region.
  ASSERT_OK_AND_ASSIGN(PinnedBlock a, pool->Allocate(4_MiB));
  EXPECT_FALSE(pool->IsResident(a));
  std::memset(a.ptr, 0x11, a.size);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(static_cast<uint8_t*>(res[i].ptr)[odd - 1], 0xA0 + i) << "an arena block overlapped block " << i;
  PinnedPoolStats st = pool->stats();
  EXPECT_EQ(st.resident_bytes, 4 * held + 4096);
  EXPECT_EQ(st.resident_in_use, 4 * held);
  EXPECT_EQ(st.bytes_in_use, 4_MiB);
  EXPECT_EQ(st.bytes_requested, 4_MiB) << "the arena's blocks only";
  EXPECT_EQ(st.failed_allocations, 0u) << "a full region is not a failed Allocate";
  EXPECT_EQ(st.live_allocations, 5u);
  // Free the middle two: one merged range of two blocks, which a block larger than either
  // then fits at the first one's address...
  pool->Free(res[1]);
  pool->Free(res[2]);
  ASSERT_OK_AND_ASSIGN(PinnedBlock big, pool->AllocateResident(2 * held - 3 * 4096));
  EXPECT_EQ(Offset(*pool, big.ptr), Offset(*pool, res[1].ptr)) << "first fit in the merged range";
  pool->Free(big);
  // ...and freeing everything gives back the whole region as one range.
  pool->Free(res[0]);
  pool->Free(res[3]);
  ASSERT_OK_AND_ASSIGN(PinnedBlock all, pool->AllocateResident(4 * held + 4096 - 2 * 4096));
  EXPECT_EQ(all.class_bytes, 4 * held + 4096);
  EXPECT_EQ(Offset(*pool, all.ptr), Offset(*pool, res[0].ptr));
  pool->Free(all);
  pool->Free(a);
  st = pool->stats();
  EXPECT_EQ(st.resident_in_use, 0u);
  EXPECT_EQ(st.bytes_in_use, 0u);
  EXPECT_EQ(st.bytes_requested, 0u);
  EXPECT_EQ(st.live_allocations, 0u);
  // A region that takes the whole budget leaves no arena: Allocate can never succeed there.
  o.resident_bytes = 8_MiB;
  ASSERT_OK_AND_ASSIGN(auto only, PinnedPool::Create(o));
  EXPECT_EQ(only->arena_bytes(), 0u);
  EXPECT_EQ(only->max_allocation(), 0u);
  EXPECT_EQ(only->Allocate(4096).status().code(), StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(PinnedBlock whole, only->AllocateResident(8_MiB - 2 * 4096));
  EXPECT_EQ(whole.class_bytes, 8_MiB - 4096) << "2047 pages: odd";
  EXPECT_EQ(only->AllocateResident(1).status().code(), StatusCode::kResourceExhausted);
  only->Free(whole);
}

// Note [block colouring]: the equal-sized blocks one Adam call streams over must not all sit at
// the same address modulo their class, and colouring must not cost O_DIRECT alignment or
// let blocks overlap.
std::vector<uint64_t> ResiduesOfChunkStates(const PinnedPoolOptions& o, uint64_t state_bytes, int states) {
  auto pool = PinnedPool::Create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  std::vector<PinnedBlock> blocks;
  std::vector<uint64_t> residues;
  for (int i = 0; i < states; ++i) {
    auto b = (*pool)->Allocate(state_bytes);
    EXPECT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->ptr) % 4096, 0u) << "O_DIRECT needs 4 KiB alignment";
    EXPECT_TRUE((*pool)->Contains(b->ptr, b->class_bytes));
    for (const PinnedBlock& prev : blocks) {
      const auto x = reinterpret_cast<uintptr_t>(b->ptr), y = reinterpret_cast<uintptr_t>(prev.ptr);
      EXPECT_TRUE(x >= y + prev.class_bytes || y >= x + b->class_bytes) << "blocks overlap";
    }
    residues.push_back(reinterpret_cast<uintptr_t>(b->ptr) % b->class_bytes);
    blocks.push_back(*b);
  }
  for (const PinnedBlock& b : blocks) (*pool)->Free(b);
  EXPECT_EQ((*pool)->stats().largest_free_block, (*pool)->max_allocation()) << "buddies merge again";
  return residues;
}

TEST(PinnedPoolTest, BlocksOfOneClassAreColouredApart) {
  // A chunk's five states (master, exp_avg, exp_avg_sq, grad, param16) of 32 MiB each.
  PinnedPoolOptions o = Pageable(1_GiB);
  std::vector<uint64_t> r = ResiduesOfChunkStates(o, 32_MiB, 5);
  std::sort(r.begin(), r.end());
  EXPECT_EQ(std::unique(r.begin(), r.end()), r.end()) << "two states share an address modulo 32 MiB";
  for (uint64_t x : r) EXPECT_EQ(x % o.colour_step, 0u);
  // Neighbours differ by (32 MiB / granule) * step = 128 KiB modulo the class.
  EXPECT_EQ(r[1] - r[0], 32 * o.colour_step);
  // Colouring off, the buddy system stacks every state at the same residue: the layout that
  // streamed 3-4x slower. This is what the check above would catch.
  o.colour_step = 0;
  std::vector<uint64_t> flat = ResiduesOfChunkStates(o, 32_MiB, 5);
  EXPECT_EQ(std::count(flat.begin(), flat.end(), flat[0]), 5);
}

TEST(PinnedPoolTest, ColourShiftsAreAccountedAndBounded) {
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(Pageable(256_MiB)));
  EXPECT_EQ(pool->arena_bytes(), 256_MiB);
  EXPECT_EQ(pool->colour_bytes(), 256 * 4_KiB) << "one 4 KiB step per MiB of arena";
  EXPECT_EQ(pool->stats().colour_bytes, pool->colour_bytes());
  uint64_t covered = 0;
  for (const iovec& r : pool->IoRanges()) covered += r.iov_len;
  EXPECT_EQ(covered, pool->arena_bytes() + pool->colour_bytes()) << "registered ranges cover the shifts";
  // The last block of the arena ends inside the mapping.
  ASSERT_OK_AND_ASSIGN(PinnedBlock a, pool->Allocate(128_MiB));
  ASSERT_OK_AND_ASSIGN(PinnedBlock b, pool->Allocate(128_MiB));
  EXPECT_TRUE(pool->Contains(b.ptr, b.class_bytes));
  std::memset(b.ptr, 1, b.class_bytes);  // every byte of the shifted block is mapped
  pool->Free(a);
  pool->Free(b);
  PinnedPoolOptions bad = Pageable(8_MiB);
  bad.colour_step = 1000;
  auto s = PinnedPool::Create(bad);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("colour_step=1000"), std::string::npos) << s.status();
}

TEST(PinnedPoolTest, FreedSlotsOfAClassAreReused) {
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(Pageable(4_MiB)));
  ASSERT_OK_AND_ASSIGN(PinnedBlock a, pool->Allocate(1_MiB));
  ASSERT_OK_AND_ASSIGN(PinnedBlock b, pool->Allocate(1_MiB));
  pool->Free(a);
  ASSERT_OK_AND_ASSIGN(PinnedBlock c, pool->Allocate(900_KiB));
  EXPECT_EQ(c.ptr, a.ptr) << "the lowest free slot of the class is handed out again";
  pool->Free(b);
  pool->Free(c);
  EXPECT_EQ(pool->stats().largest_free_block, 4_MiB);
}

TEST(PinnedPoolTest, NonPowerOfTwoArenaIsCutIntoAlignedBlocks) {
  // 6 MiB + 12 KiB: blocks of 4 MiB, 2 MiB, 8 KiB and 4 KiB.
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(Pageable(6_MiB + 12_KiB + 100)));
  EXPECT_EQ(pool->arena_bytes(), 6_MiB + 12_KiB) << "the arena is the budget rounded down";
  EXPECT_EQ(pool->max_allocation(), 4_MiB);
  ASSERT_OK_AND_ASSIGN(PinnedBlock big, pool->Allocate(4_MiB));
  ASSERT_OK_AND_ASSIGN(PinnedBlock mid, pool->Allocate(2_MiB));
  ASSERT_OK_AND_ASSIGN(PinnedBlock s1, pool->Allocate(8_KiB));
  ASSERT_OK_AND_ASSIGN(PinnedBlock s2, pool->Allocate(4_KiB));
  EXPECT_FALSE(pool->Allocate(4_KiB).ok());
  EXPECT_EQ(pool->stats().bytes_in_use, pool->arena_bytes());
  for (auto* b : {&s2, &big, &s1, &mid}) pool->Free(*b);
  EXPECT_EQ(pool->stats().largest_free_block, 4_MiB);
  ASSERT_OK_AND_ASSIGN(PinnedBlock again, pool->Allocate(4_MiB));
  pool->Free(again);
}

// Fragmentation cannot grow: after any sequence of allocations and frees, freeing everything
// gives back the largest block, and live blocks never overlap or leave the arena.
TEST(PinnedPoolTest, RandomAllocFreeAgainstReference) {
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(Pageable(16_MiB)));
  std::mt19937_64 rng(7);
  std::map<uintptr_t, PinnedBlock> live;  // reference: start address -> block
  uint64_t in_use = 0;
  for (int step = 0; step < 4000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t n = 1 + rng() % (2_MiB);
      auto r = pool->Allocate(n);
      if (!r.ok()) {
        ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
        continue;
      }
      PinnedBlock b = *r;
      auto p = reinterpret_cast<uintptr_t>(b.ptr);
      ASSERT_TRUE(pool->Contains(b.ptr, b.class_bytes));
      auto next = live.lower_bound(p);
      if (next != live.end()) {
        ASSERT_LE(p + b.class_bytes, next->first) << "overlaps the next block";
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second.class_bytes, p) << "overlaps the previous block";
      }
      live[p] = b;
      in_use += b.class_bytes;
    } else {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      in_use -= it->second.class_bytes;
      pool->Free(it->second);
      live.erase(it);
    }
    ASSERT_EQ(pool->stats().bytes_in_use, in_use);
    ASSERT_LE(in_use, pool->arena_bytes());
  }
  for (auto& [p, b] : live) pool->Free(b);
  PinnedPoolStats s = pool->stats();
  EXPECT_EQ(s.bytes_in_use, 0u);
  EXPECT_EQ(s.largest_free_block, 16_MiB);
  EXPECT_LE(s.peak_bytes_in_use, 16_MiB);
}

TEST(PinnedPoolTest, ConcurrentAllocFree) {
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(Pageable(8_MiB)));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t] {
      std::mt19937_64 rng(static_cast<uint64_t>(t));
      std::vector<PinnedBlock> mine;
      for (int i = 0; i < 2000; ++i) {
        if (mine.size() < 4 && rng() % 2 == 0) {
          auto r = pool->Allocate(1 + rng() % (512_KiB));
          if (r.ok()) {
            std::memset(r->ptr, t, r->size);
            mine.push_back(*r);
          }
        } else if (!mine.empty()) {
          for (uint64_t k = 0; k < mine.back().size; k += 4096)
            if (static_cast<char*>(mine.back().ptr)[k] != static_cast<char>(t)) std::abort();
          pool->Free(mine.back());
          mine.pop_back();
        }
      }
      for (auto& b : mine) pool->Free(b);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(pool->stats().bytes_in_use, 0u);
  EXPECT_EQ(pool->stats().largest_free_block, 8_MiB);
}

TEST(PinnedPoolTest, ForcedPageableFallback) {
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(Pageable(4_MiB)));
  PinnedPoolStats s = pool->stats();
  EXPECT_EQ(s.backing, "pageable");
  EXPECT_EQ(pool->backing(), PinnedBacking::kPageable);
  EXPECT_EQ(s.pinned_bytes, 0u);
  EXPECT_EQ(s.pageable_bytes, 4_MiB + s.colour_bytes);
  EXPECT_EQ(s.budget, 4_MiB);
}

// Locking more than the host has available would end in the OOM killer, not an error: such a
// budget is refused before anything is locked, naming the budget and the host's memory. The same
// budget kept pageable is only address space (MAP_NORESERVE) and stays allowed.
TEST(PinnedPoolTest, RefusesToLockPastTheHostsAvailableMemory) {
  const HostMemory mem = ReadHostMemory();
  ASSERT_GT(mem.available_bytes, 0u) << "no MemAvailable in /proc/meminfo";
  PinnedPoolOptions o;
  o.budget = (mem.available_bytes + 8_GiB) / 1_MiB * 1_MiB;
  auto s = PinnedPool::Create(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.status().message().find("strata.host_memory_budget="), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("available"), std::string::npos) << s.status();
  o.force_pageable = true;
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(o));
  EXPECT_EQ(pool->stats().pinned_bytes, 0u);
}

TEST(PinnedPoolTest, PinsWhatTheLimitAllows) {
  PinnedPoolOptions o;
  o.budget = 4_MiB;
  o.allow_cuda = false;  // the mmap + mlock path, also on a machine with a GPU
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(o));
  PinnedPoolStats s = pool->stats();
  EXPECT_EQ(s.pinned_bytes + s.pageable_bytes, s.arena_bytes + s.colour_bytes);
  struct rlimit rl {};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &rl), 0);
  if (geteuid() == 0 || rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= 8_MiB) {
    EXPECT_EQ(s.backing, "mlock");
    EXPECT_EQ(s.pinned_bytes, 4_MiB + s.colour_bytes);
  }
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string modes((std::istreambuf_iterator<char>(thp)), std::istreambuf_iterator<char>());
  if (modes.find("[always]") != std::string::npos || modes.find("[madvise]") != std::string::npos) {
    EXPECT_TRUE(s.huge_pages);
  }
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->IoRanges()[0].iov_base) % (2_MiB), 0u)
      << "the mmap arena starts on a huge-page boundary";
}

// The real fallback: an unprivileged process whose RLIMIT_MEMLOCK covers only part of the arena
// pins that part and keeps the rest pageable (one warning, no error). Runs in a child process.
[[noreturn]] void LimitedMemlockChild() {
  struct rlimit rl {};
  rl.rlim_cur = rl.rlim_max = 4_MiB;  // lowering needs no privilege
  if (setrlimit(RLIMIT_MEMLOCK, &rl) != 0) std::_Exit(10);
  if (geteuid() == 0 && setuid(65534) != 0) std::_Exit(11);  // drop CAP_IPC_LOCK
  PinnedPoolOptions o;
  o.budget = 6_MiB;
  o.allow_cuda = false;  // cudaHostAlloc ignores RLIMIT_MEMLOCK: this is the mlock path's test
  auto pool = PinnedPool::Create(o);
  if (!pool.ok()) std::_Exit(12);
  PinnedPoolStats s = (*pool)->stats();
  if (s.backing != "mlock") std::_Exit(13);
  if (s.pinned_bytes != 4_MiB || s.pageable_bytes != 2_MiB + s.colour_bytes) {
    std::fprintf(stderr, "pinned=%llu pageable=%llu\n", (unsigned long long)s.pinned_bytes,
                 (unsigned long long)s.pageable_bytes);
    std::_Exit(14);
  }
  if ((*pool)->Allocate(6_MiB).ok()) std::_Exit(15);  // not a power of two: 4 MiB is the max
  auto c = (*pool)->Allocate(4_MiB);
  if (!c.ok()) std::_Exit(16);
  std::memset(c->ptr, 1, c->size);
  std::_Exit(0);
}

// The sanitizer runtimes intercept mlock and make it a no-op that succeeds (they would
// otherwise lock their shadow memory), so RLIMIT_MEMLOCK cannot bite under them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kMlockIntercepted = true;
#else
constexpr bool kMlockIntercepted = false;
#endif

TEST(PinnedPoolDeathTest, LimitedMemlockPinsPartOfTheArena) {
  if (kMlockIntercepted) GTEST_SKIP() << "mlock is a no-op under ASan/TSan";
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  EXPECT_EXIT(LimitedMemlockChild(), ::testing::ExitedWithCode(0), "mlock failed after 4.00 MiB");
}

TEST(PinnedPoolDeathTest, FreeingForeignMemoryIsABug) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  EXPECT_DEATH(
      {
        auto pool = PinnedPool::Create(Pageable(1_MiB));
        static char other[8192];
        (*pool)->Free(PinnedBlock{other, 4096, 4096});
      },
      "not the pool's");
}

TEST(PinnedPoolTest, IoRangesCoverTheArena) {
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(Pageable(3_MiB)));
  auto r = pool->IoRanges();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].iov_len, 3_MiB + pool->colour_bytes());
  ASSERT_OK_AND_ASSIGN(PinnedBlock b, pool->Allocate(1_MiB));
  EXPECT_TRUE(pool->Contains(b.ptr, b.size));
  EXPECT_FALSE(pool->Contains(static_cast<char*>(r[0].iov_base) + 3_MiB + pool->colour_bytes(), 1));
  pool->Free(b);
}

// Registered with the io_uring engine, NVMe transfers go straight into the pool.
TEST(PinnedPoolTest, RegisteredWithNvmeTierForFixedBufferIo) {
  testing::TempDir dir;
  nvme::NvmeTierOptions no;
  no.paths = {dir.path()};
  no.capacity = 8_MiB;
  no.aio.block_size = 256 * 1024;
  ASSERT_OK_AND_ASSIGN(auto tier, nvme::NvmeTier::Create(no));
  PinnedPoolOptions o;
  o.budget = 4_MiB;
  ASSERT_OK_AND_ASSIGN(auto pool, PinnedPool::Create(o));
  Status reg = tier->store().RegisterBuffers(pool->IoRanges());
  const bool uring = tier->store().stats().engine == "io_uring";
  if (uring) ASSERT_OK(reg);
  ASSERT_OK_AND_ASSIGN(PinnedBlock src, pool->Allocate(1_MiB));
  ASSERT_OK_AND_ASSIGN(PinnedBlock dst, pool->Allocate(1_MiB));
  for (uint64_t i = 0; i < src.size; ++i) static_cast<uint8_t*>(src.ptr)[i] = static_cast<uint8_t>(i * 31 + 7);
  ASSERT_OK_AND_ASSIGN(TierRegion region, tier->Allocate(1_MiB));
  ASSERT_OK(tier->Write(region, src.ptr));
  ASSERT_OK(tier->Read(region, dst.ptr));
  EXPECT_EQ(std::memcmp(src.ptr, dst.ptr, src.size), 0);
  if (uring) {
    EXPECT_TRUE(tier->store().stats().io.fixed_buffers);
  }
  ASSERT_OK(tier->Free(region));
  pool->Free(src);
  pool->Free(dst);
}

}  // namespace
}  // namespace strata
