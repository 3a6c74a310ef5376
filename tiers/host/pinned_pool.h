// PinnedPool: the host tier's memory — one mapping of page-locked DRAM holding a buddy arena
// carved into power-of-two size classes (blocks that come and go: NVMe blocks cached on the
// host), and optionally a resident region of exact-size blocks (state that lives on the host for
// the whole run), so that NVMe reads and host<->device copies land in pinned memory with no
// bounce copy.
//
// Backing (chosen once, at Create; see Note [pinned fallback] in pinned_pool.cc)
// - cudaHostAlloc (portable) when the build has CUDA and a GPU is present;
// - otherwise anonymous mmap, 2 MiB-aligned, madvise(MADV_HUGEPAGE) where the kernel offers
//   transparent huge pages, bound to one NUMA node through hwloc when the machine has several,
//   and mlock'd as far as RLIMIT_MEMLOCK allows;
// - whatever could not be pinned stays pageable, announced by exactly one warning per pool.
//   `force_pageable` skips pinning on purpose (tests, machines where locking memory is unwanted).
//
// Budget. The mapping is the budget: `resident_bytes` of it (rounded up to 4 KiB) is the resident
// region, the rest rounded down to min_block is the buddy arena. Both are reserved (and pinned)
// whole at Create: the pool never holds more host memory than its budget, and no later
// allocation can fail for lack of pinnable memory.
//
// Size classes. Allocate takes the smallest power of two >= max(bytes, min_block) from the arena
// (a buddy system); a block's offset in the buddy space is a multiple of its class. A class wastes
// up to half its block, which for long-lived state of awkward sizes is most of the cost: a 302 MB
// shard (a 6144 x 24576 bf16 weight) takes 512 MiB. AllocateResident therefore takes exactly
// PoolResidentBytes(bytes) from the resident region, first fit, freed ranges merged with their
// neighbours (Note [resident region] in pinned_pool.cc).
//
// Colouring (see Note [block colouring] in pinned_pool.cc). A block at buddy offset `off` lives at
// address base + off + (off / colour_granule) * colour_step: every colour_granule of buddy space
// is shifted by one more colour_step. The shift never decreases with the offset, so blocks never
// overlap and buddies still merge; blocks of one class placed side by side (a chunk's master,
// exp_avg, exp_avg_sq and grad) land at different addresses modulo their class instead of all at
// offset 0, which is what made streaming kernels over them run 3-4x slower. colour_step is a
// multiple of 4 KiB and the base is 2 MiB-aligned (mmap) or page-aligned (cudaHostAlloc), so every
// block stays 4 KiB-aligned, as O_DIRECT needs. The shifts add colour_bytes() =
// (arena / colour_granule) * colour_step to the mapping (1/256 of the arena by default), reserved
// and pinned like the rest; colour_step = 0 turns colouring off. Resident blocks get the same
// effect from a gap of a page or two after each one (PoolResidentBytes). Freed blocks merge with their free
// buddy at once, so fragmentation cannot accumulate: a run of frees always restores the largest
// blocks the live allocations allow. The price is internal waste for sizes that are not powers
// of two (at most half a block; stats().bytes_in_use counts class bytes, bytes_requested what
// was asked).
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/base/status.h"

namespace strata {

struct PinnedPoolOptions {
  uint64_t budget = 0;           // bytes of host memory the pool may hold; must be >= min_block
  uint64_t min_block = 4096;     // smallest size class; a power of two >= 4096
  bool allow_cuda = true;        // use cudaHostAlloc when the build has CUDA and a GPU is present
  bool force_pageable = false;   // do not pin at all (the pageable fallback, on purpose)
  bool huge_pages = true;        // madvise(MADV_HUGEPAGE) on the mmap path
  int numa_node = -1;            // -1: the node of the calling thread's CPU when there are several
  uint64_t colour_step = 4096;   // address shift added per colour_granule; multiple of 4096, 0 = off
  uint64_t colour_granule = 1 << 20;  // buddy bytes per colour step; a power of two >= min_block
  // Bytes of the budget set apart for AllocateResident (rounded up to 4 KiB; at most the budget).
  // 0: no resident region, everything comes from the buddy arena.
  uint64_t resident_bytes = 0;
};

// How the arena's memory is held.
// The pool bytes a block of `bytes` occupies: its power-of-two size class (at least the default
// min_block), as the planners that size the pool count it.
inline uint64_t PoolClassBytes(uint64_t bytes) {
  uint64_t c = 4096;
  while (c < bytes) c <<= 1;
  return c;
}

// The pool bytes a block of `bytes` occupies in the resident region: whole 4 KiB pages (O_DIRECT's
// alignment) and one or two more, so that the count is odd. Equal blocks allocated one after
// another then start 4 KiB x odd apart, so up to 16 of them fall at 16 different addresses modulo
// any power of two from 64 KiB up (Note [block colouring] in pinned_pool.cc).
inline uint64_t PoolResidentBytes(uint64_t bytes) {
  const uint64_t pages = (bytes + 4095) / 4096 + 1;
  return (pages % 2 == 1 ? pages : pages + 1) * 4096;
}

enum class PinnedBacking { kCudaHost, kMlock, kPageable };
std::string_view PinnedBackingName(PinnedBacking b);

struct PinnedPoolStats {
  std::string backing;               // "cuda_host", "mlock" or "pageable"
  uint64_t budget = 0;               // bytes, as configured
  uint64_t arena_bytes = 0;          // GAUGE: buddy bytes (budget rounded down to min_block)
  uint64_t colour_bytes = 0;         // GAUGE: bytes of colour shifts mapped beside the arena
  uint64_t pinned_bytes = 0;         // GAUGE: bytes of the mapping that are page-locked
  uint64_t pageable_bytes = 0;       // GAUGE: arena_bytes + colour_bytes - pinned_bytes
  bool huge_pages = false;           // MADV_HUGEPAGE accepted for the arena
  int numa_node = -1;                // node the arena is bound to, -1 when not bound
  uint64_t bytes_in_use = 0;         // GAUGE: class bytes of live allocations
  uint64_t bytes_requested = 0;      // GAUGE: bytes asked for by live arena blocks (Allocate)
  uint64_t peak_bytes_in_use = 0;    // MAX: highest bytes_in_use seen
  uint64_t live_allocations = 0;     // GAUGE: blocks handed out and not freed (both kinds)
  uint64_t allocations = 0;          // COUNT: successful Allocate and AllocateResident calls
  // COUNT: Allocate calls answered RESOURCE_EXHAUSTED (a full resident region is a routine
  // fallback to the arena, not counted).
  uint64_t failed_allocations = 0;
  uint64_t largest_free_block = 0;   // GAUGE: bytes of the largest block Allocate could return now
  uint64_t resident_bytes = 0;       // GAUGE: bytes of the resident region
  uint64_t resident_in_use = 0;      // GAUGE: bytes of it held by live AllocateResident blocks
};

// A block handed out by the pool.
struct PinnedBlock {
  void* ptr = nullptr;
  uint64_t size = 0;         // bytes requested
  uint64_t class_bytes = 0;  // bytes actually held (>= size): the size class, or PoolResidentBytes
};

class PinnedPool {
 public:
  // Reserves the arena. Fails with INVALID_ARGUMENT on a bad option (naming it) and with
  // RESOURCE_EXHAUSTED when not even pageable memory of that size can be mapped. Failure to pin
  // is not an error (see the header comment).
  static StatusOr<std::unique_ptr<PinnedPool>> Create(const PinnedPoolOptions& options);
  // Releases the arena. Live blocks become invalid; callers must have stopped using them.
  ~PinnedPool();

  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A block of at least `bytes` (> 0), never waiting: RESOURCE_EXHAUSTED when no free block of
  // the class exists right now (the caller frees or waits and retries), INVALID_ARGUMENT when the
  // class is larger than the arena could ever provide (see max_allocation()).
  StatusOr<PinnedBlock> Allocate(uint64_t bytes);
  // A block of exactly PoolResidentBytes(bytes) from the resident region, never waiting:
  // RESOURCE_EXHAUSTED when no free range of the region is that large (the caller may Allocate
  // from the arena instead; not counted in failed_allocations).
  StatusOr<PinnedBlock> AllocateResident(uint64_t bytes);
  // Returns a block from Allocate or AllocateResident. Freeing anything else is a bug and aborts.
  void Free(const PinnedBlock& block);
  // True for a block from AllocateResident.
  bool IsResident(const PinnedBlock& block) const;

  // The class bytes a request of `bytes` occupies.
  uint64_t ClassBytes(uint64_t bytes) const;
  // The largest class the arena can ever hold (with nothing else allocated).
  uint64_t max_allocation() const { return max_class_; }
  uint64_t arena_bytes() const { return arena_bytes_; }
  uint64_t resident_bytes() const { return resident_bytes_; }
  // Bytes the colour shifts add to the mapping (see Colouring above).
  uint64_t colour_bytes() const { return colour_bytes_; }
  // The address shift of the block at buddy offset `off`.
  uint64_t ColourOf(uint64_t off) const {
    return options_.colour_step == 0 ? 0 : off / options_.colour_granule * options_.colour_step;
  }
  PinnedBacking backing() const { return backing_; }

  // The mapping (arena, colour shifts and resident region) as ranges of at most 1 GiB (io_uring's limit per registered buffer), for
  // IoEngine::RegisterBuffers / SwapStore::RegisterBuffers.
  std::vector<iovec> IoRanges() const;
  // True when [p, p+len) lies inside the mapping.
  bool Contains(const void* p, uint64_t len) const;

  PinnedPoolStats stats() const;

 private:
  explicit PinnedPool(const PinnedPoolOptions& options) : options_(options) {}
  Status Reserve();
  Status ReserveMmap();
  void InitFreeLists();
  int OrderOf(uint64_t class_bytes) const;

  const PinnedPoolOptions options_;
  char* base_ = nullptr;
  uint64_t arena_bytes_ = 0;    // buddy space
  uint64_t colour_bytes_ = 0;   // extra bytes the colour shifts need after the buddy space
  uint64_t resident_bytes_ = 0;  // the resident region, after the arena and its colour shifts
  uint64_t extent_bytes_ = 0;   // arena_bytes_ + colour_bytes_ + resident_bytes_: what is reserved
  uint64_t map_bytes_ = 0;      // bytes mmap'd (== extent_bytes_ on the mmap path)
  uint64_t pinned_bytes_ = 0;
  uint64_t max_class_ = 0;
  PinnedBacking backing_ = PinnedBacking::kPageable;
  bool huge_pages_ = false;
  int numa_node_ = -1;

  mutable std::mutex mu_;
  // free_[k]: offsets of free blocks of min_block << k, ordered so the lowest address is reused
  // first (keeps live blocks packed at the start of the arena).
  std::vector<std::set<uint64_t>> free_;                // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, std::pair<uint64_t, int>> live_;  // GUARDED_BY(mu_): address offset -> (buddy offset, order)
  std::unordered_map<uint64_t, uint64_t> requested_;   // GUARDED_BY(mu_): address offset -> bytes
  // The resident region's free ranges (mapping offset -> bytes, neighbours merged) and live
  // blocks (mapping offset -> bytes held).
  std::map<uint64_t, uint64_t> resident_free_;          // GUARDED_BY(mu_)
  std::unordered_map<uint64_t, uint64_t> resident_live_;  // GUARDED_BY(mu_)
  PinnedPoolStats stats_;                               // GUARDED_BY(mu_)
};

}  // namespace strata
