#include "tiers/host/pinned_pool.h"

#include <hwloc.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>

#include "runtime/base/check.h"
#include "runtime/base/host_info.h"
#include "runtime/base/logging.h"
#include "runtime/base/units.h"
#include "tiers/host/cuda_host_alloc.h"

namespace strata {

// Note [pinned fallback]
// Pinned memory is what lets an NVMe read (O_DIRECT, registered buffer) or a host->device copy
// run without a staging copy, so the pool tries hard to get it, in this order:
//   1. cudaHostAlloc when a GPU is present: the CUDA driver then knows the pages are locked and
//      DMA engines use them directly (mlock'd memory would still be staged by the driver).
//   2. mmap + mlock: locked pages for io_uring (and for the CPU device, which copies with
//      memcpy). Locking is done in segments so that a limit met half-way keeps what was locked:
//      a non-root user with RLIMIT_MEMLOCK = 8 MiB gets (up to) 8 MiB pinned, the rest pageable.
//   3. Pageable memory: everything still works; transfers are slower (the kernel pins pages per
//      request, CUDA stages through its own buffers). One warning says so and how to fix it.
// Pinning failure is never an error: a training run that cannot lock memory must still run.
// The arena is reserved whole at Create rather than grown on demand: io_uring can only register
// buffers while no I/O is in flight, and a pool that grew later could not be registered.

// Note [block colouring]
// A buddy allocator puts every block of a class at an offset that is a multiple of the class, so
// the four to five equal-sized blocks one Adam call streams over (master, exp_avg, exp_avg_sq,
// grad, param16 of one chunk) all start at the same address modulo a large power of two. Streams
// placed that way collide in the memory system: measured with an Adam-shaped loop over four
// 256 MiB fp32 arrays on an AMD EPYC (Zen 3 and Zen 4), 0.26-0.53 G elements/s with the arrays
// exactly 256 MiB apart against 1.8-2.1 with any page-multiple stagger between them. The pool
// therefore shifts each colour_granule (1 MiB) of buddy space by one more colour_step (4 KiB):
// the address of buddy offset `off` is off + (off / granule) * step. Because the shift grows with
// the offset, a block never reaches into the next one and buddy merging is unchanged; blocks of
// one class S >= granule then differ modulo S by multiples of (S / granule) * step. The cost is
// 1/256 of the arena in extra mapping, pinned like the rest.

// Note [resident region]
// Most of a large run's host memory is state placed there for the whole run: a chunk's shard of
// the working copy, its gradient and its moments, registered once at start. In the buddy arena
// each takes a power-of-two class, which for the shapes of GPT layers wastes a third to a half:
// a 6144-wide model's 302 MB fc shard takes 512 MiB, and a 20B plan on the H100 machine asked
// for an 83 GiB pool to hold 51 GiB of state. So the planners size a resident region for those
// blocks (StepPlan::host_only_bytes, the sum of PoolResidentBytes) and they take exactly that.
// First fit with merging is enough there: the blocks arrive once, in order, and leave together;
// the blocks that come and go (NVMe blocks cached on the host, activations stashed per step) keep
// the buddy arena, whose merging is what guarantees that evicting frees room of the right size.
// The resident region sits after the arena and its colour shifts, so buddy addresses are as they
// were without one.

namespace {

constexpr uint64_t kHugePage = 2_MiB;
constexpr uint64_t kLockSegment = 64_MiB;
constexpr uint64_t kMaxIoRange = 1_GiB;  // io_uring's limit for one registered buffer

bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

uint64_t RoundUpPow2(uint64_t v) {
  uint64_t p = 1;
  while (p < v) p <<= 1;
  return p;
}

uint64_t FloorPow2(uint64_t v) {
  uint64_t p = 1;
  while ((p << 1) != 0 && (p << 1) <= v) p <<= 1;
  return p;
}

// Binds [p, p+len) to one NUMA node when the machine has several. Returns the node, or -1 when
// nothing was bound (one node, or hwloc could not tell). An explicit node that does not exist is
// an error; a binding the OS refuses is a warning.
StatusOr<int> BindToNode(void* p, uint64_t len, int requested) {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return -1;
  struct Closer {
    hwloc_topology_t t;
    ~Closer() { hwloc_topology_destroy(t); }
  } closer{topo};
  if (hwloc_topology_load(topo) != 0) return -1;
  const int nodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  if (requested >= 0 && hwloc_get_numanode_obj_by_os_index(topo, static_cast<unsigned>(requested)) == nullptr)
    return InvalidArgument(StrCat("host pool numa_node=", requested, ": this machine has ", nodes,
                                  " NUMA node(s); use -1 (automatic) or an existing node"));
  if (nodes <= 1) return -1;
  int node = requested;
  if (node < 0) {
    // The node of the CPU this thread last ran on: the engine creates its pools from the thread
    // that drives the device, which is bound near it.
    hwloc_bitmap_t cpus = hwloc_bitmap_alloc();
    hwloc_bitmap_t mems = hwloc_bitmap_alloc();
    if (hwloc_get_last_cpu_location(topo, cpus, HWLOC_CPUBIND_THREAD) == 0) {
      hwloc_cpuset_to_nodeset(topo, cpus, mems);
      node = hwloc_bitmap_first(mems);
    }
    hwloc_bitmap_free(cpus);
    hwloc_bitmap_free(mems);
    if (node < 0) return -1;
  }
  hwloc_obj_t obj = hwloc_get_numanode_obj_by_os_index(topo, static_cast<unsigned>(node));
  if (obj == nullptr) return -1;
  if (hwloc_set_area_membind(topo, p, len, obj->nodeset, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) != 0) {
    STRATA_LOG(WARN) << "host pool: binding " << FormatBytes(len) << " to NUMA node " << node
                     << " failed (" << std::strerror(errno) << "); memory follows first touch";
    return -1;
  }
  return node;
}

}  // namespace

std::string_view PinnedBackingName(PinnedBacking b) {
  switch (b) {
    case PinnedBacking::kCudaHost: return "cuda_host";
    case PinnedBacking::kMlock: return "mlock";
    case PinnedBacking::kPageable: return "pageable";
  }
  return "?";
}

StatusOr<std::unique_ptr<PinnedPool>> PinnedPool::Create(const PinnedPoolOptions& options) {
  STRATA_CHECK(IsPowerOfTwo(options.min_block) && options.min_block >= 4096,
               "host pool min_block=", options.min_block, ": must be a power of two >= 4096");
  STRATA_CHECK(options.colour_step % 4096 == 0, "host pool colour_step=", options.colour_step,
               ": must be a multiple of 4096 (O_DIRECT needs page-aligned blocks); 0 turns it off");
  STRATA_CHECK(IsPowerOfTwo(options.colour_granule) && options.colour_granule >= options.min_block,
               "host pool colour_granule=", options.colour_granule,
               ": must be a power of two >= min_block (", options.min_block, ")");
  STRATA_CHECK(options.budget >= options.min_block, "host pool budget=", options.budget,
               " bytes: must be at least min_block (", options.min_block,
               "); set strata.host_memory_budget to a size such as \"8GiB\"");
  std::unique_ptr<PinnedPool> pool(new PinnedPool(options));
  STRATA_RETURN_IF_ERROR(pool->Reserve());
  pool->InitFreeLists();
  return pool;
}

Status PinnedPool::Reserve() {
  resident_bytes_ = std::min(options_.budget / 4096 * 4096, (options_.resident_bytes + 4095) / 4096 * 4096);
  arena_bytes_ = (options_.budget - resident_bytes_) / options_.min_block * options_.min_block;
  colour_bytes_ = ColourOf(arena_bytes_);
  extent_bytes_ = arena_bytes_ + colour_bytes_ + resident_bytes_;
  // Note [locking past the host's memory]: locked pages cannot be swapped or reclaimed. An arena
  // larger than what the kernel has available is not a slow path but a kill: cudaHostAlloc or
  // mlock (as root, uncapped) takes the pages and the OOM killer ends the process, or another.
  // So a budget past MemAvailable is refused here, before a byte is locked.
  if (!options_.force_pageable) {
    const HostMemory mem = ReadHostMemory();
    if (mem.available_bytes > 0 && extent_bytes_ > mem.available_bytes)
      return ResourceExhausted(StrCat(
          "host pool: strata.host_memory_budget=", FormatBytes(options_.budget), " would lock ",
          FormatBytes(extent_bytes_), " but this host has ", FormatBytes(mem.available_bytes),
          " available (of ", FormatBytes(mem.total_bytes),
          "); locked memory cannot be swapped. Lower strata.host_memory_budget, offload more to "
          "nvme, or set pin_memory: false in the offload section"));
  }
  if (!options_.force_pageable && options_.allow_cuda && host_internal::CudaHostAllocAvailable()) {
    StatusOr<void*> p = host_internal::CudaHostAlloc(extent_bytes_);
    if (p.ok()) {
      base_ = static_cast<char*>(*p);
      backing_ = PinnedBacking::kCudaHost;
      pinned_bytes_ = extent_bytes_;
      return Status::Ok();
    }
    STRATA_LOG(WARN) << "host pool: " << p.status().ToString()
                     << "; falling back to mmap + mlock (see Note [pinned fallback])";
  }
  return ReserveMmap();
}

Status PinnedPool::ReserveMmap() {
  // Over-map by one huge page and trim so the arena starts 2 MiB-aligned: THP can then back it
  // from the first byte.
  const uint64_t span = extent_bytes_ + kHugePage;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED)
    return ErrnoToStatus(errno, StrCat("host pool: mapping ", FormatBytes(extent_bytes_),
                                       "; lower strata.host_memory_budget"));
  auto addr = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (addr + kHugePage - 1) & ~(kHugePage - 1);
  if (aligned > addr) munmap(raw, aligned - addr);
  const uintptr_t end = aligned + extent_bytes_;
  if (addr + span > end) munmap(reinterpret_cast<void*>(end), addr + span - end);
  base_ = reinterpret_cast<char*>(aligned);
  map_bytes_ = extent_bytes_;

  if (options_.huge_pages) huge_pages_ = madvise(base_, extent_bytes_, MADV_HUGEPAGE) == 0;
  STRATA_ASSIGN_OR_RETURN(numa_node_, BindToNode(base_, extent_bytes_, options_.numa_node));

  backing_ = PinnedBacking::kPageable;
  if (options_.force_pageable) {
    STRATA_LOG(INFO) << "host pool: pinning disabled by option; arena=" << FormatBytes(arena_bytes_)
                     << " stays pageable";
    return Status::Ok();
  }
  // Lock in segments, halving the segment on failure, so that a limit met part-way still pins
  // as much as it allows (down to one huge page of granularity).
  int err = 0;
  uint64_t segment = kLockSegment;
  for (uint64_t off = 0; off < extent_bytes_;) {
    const uint64_t len = std::min(segment, extent_bytes_ - off);
    if (mlock(base_ + off, len) == 0) {
      pinned_bytes_ += len;
      off += len;
      continue;
    }
    err = errno;
    if (segment <= kHugePage) break;
    segment /= 2;
  }
  if (pinned_bytes_ > 0) backing_ = PinnedBacking::kMlock;
  if (pinned_bytes_ < extent_bytes_) {
    struct rlimit rl {};
    getrlimit(RLIMIT_MEMLOCK, &rl);
    const bool unlimited = rl.rlim_cur == RLIM_INFINITY;
    STRATA_LOG(WARN) << "host pool: mlock failed after " << FormatBytes(pinned_bytes_) << " of "
                     << FormatBytes(extent_bytes_) << " (" << std::strerror(err) << ", RLIMIT_MEMLOCK="
                     << (unlimited ? std::string("unlimited") : FormatBytes(rl.rlim_cur))
                     << "); the rest is pageable and transfers into it are slower. Raise the limit "
                        "(ulimit -l, or LimitMEMLOCK= in a systemd unit) or lower "
                        "strata.host_memory_budget. See Note [pinned fallback].";
  }
  return Status::Ok();
}

void PinnedPool::InitFreeLists() {
  max_class_ = arena_bytes_ == 0 ? 0 : FloorPow2(arena_bytes_);
  int orders = 0;
  while ((options_.min_block << orders) <= max_class_) ++orders;
  free_.assign(static_cast<size_t>(orders), {});
  // Cut the arena into the largest aligned power-of-two blocks, biggest first: each block's
  // offset is then a multiple of its size, which is what buddy arithmetic needs.
  uint64_t off = 0;
  while (off < arena_bytes_) {
    const uint64_t size = FloorPow2(arena_bytes_ - off);
    free_[static_cast<size_t>(OrderOf(size))].insert(off);
    off += size;
  }
  if (resident_bytes_ > 0) resident_free_[arena_bytes_ + colour_bytes_] = resident_bytes_;
  stats_.resident_bytes = resident_bytes_;
  stats_.backing = std::string(PinnedBackingName(backing_));
  stats_.budget = options_.budget;
  stats_.arena_bytes = arena_bytes_;
  stats_.colour_bytes = colour_bytes_;
  stats_.pinned_bytes = pinned_bytes_;
  stats_.pageable_bytes = extent_bytes_ - pinned_bytes_;
  stats_.huge_pages = huge_pages_;
  stats_.numa_node = numa_node_;
}

PinnedPool::~PinnedPool() {
  if (base_ == nullptr) return;
  if (backing_ == PinnedBacking::kCudaHost) {
    host_internal::CudaHostFree(base_);
  } else {
    // munmap unlocks as it unmaps.
    munmap(base_, map_bytes_);
  }
}

int PinnedPool::OrderOf(uint64_t class_bytes) const {
  int k = 0;
  while ((options_.min_block << k) < class_bytes) ++k;
  return k;
}

uint64_t PinnedPool::ClassBytes(uint64_t bytes) const {
  return std::max(options_.min_block, RoundUpPow2(bytes));
}

StatusOr<PinnedBlock> PinnedPool::Allocate(uint64_t bytes) {
  STRATA_CHECK(bytes > 0, "host pool: cannot allocate 0 bytes");
  const uint64_t cls = ClassBytes(bytes);
  if (cls > max_class_)
    return InvalidArgument(StrCat("host pool: a block of ", FormatBytes(bytes), " needs a ",
                                  FormatBytes(cls), " slot but the largest the ", FormatBytes(arena_bytes_),
                                  " arena can hold is ", FormatBytes(max_class_),
                                  "; raise strata.host_memory_budget or lower strata.chunk_size"));
  const int want = OrderOf(cls);
  std::lock_guard<std::mutex> lock(mu_);
  int k = want;
  while (k < static_cast<int>(free_.size()) && free_[static_cast<size_t>(k)].empty()) ++k;
  if (k >= static_cast<int>(free_.size())) {
    ++stats_.failed_allocations;
    return ResourceExhausted(StrCat("host pool: no free ", FormatBytes(cls), " block (",
                                    FormatBytes(stats_.bytes_in_use), " of ", FormatBytes(arena_bytes_),
                                    " in use)"));
  }
  auto it = free_[static_cast<size_t>(k)].begin();
  const uint64_t off = *it;
  free_[static_cast<size_t>(k)].erase(it);
  // Split down to the wanted order; the upper halves go back as free buddies.
  while (k > want) {
    --k;
    free_[static_cast<size_t>(k)].insert(off + (options_.min_block << k));
  }
  const uint64_t addr = off + ColourOf(off);
  live_[addr] = {off, want};
  requested_[addr] = bytes;
  stats_.bytes_in_use += cls;
  stats_.bytes_requested += bytes;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  ++stats_.live_allocations;
  ++stats_.allocations;
  return PinnedBlock{base_ + addr, bytes, cls};
}

StatusOr<PinnedBlock> PinnedPool::AllocateResident(uint64_t bytes) {
  STRATA_CHECK(bytes > 0, "host pool: cannot allocate 0 bytes");
  const uint64_t need = PoolResidentBytes(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = resident_free_.begin(); it != resident_free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t addr = it->first;
    const uint64_t rest = it->second - need;
    resident_free_.erase(it);
    if (rest > 0) resident_free_[addr + need] = rest;
    resident_live_[addr] = need;
    stats_.resident_in_use += need;
    ++stats_.live_allocations;
    ++stats_.allocations;
    return PinnedBlock{base_ + addr, bytes, need};
  }
  return ResourceExhausted(StrCat("host pool: no free ", FormatBytes(need), " range in the resident region (",
                                  FormatBytes(stats_.resident_in_use), " of ", FormatBytes(resident_bytes_),
                                  " in use)"));
}

bool PinnedPool::IsResident(const PinnedBlock& block) const {
  const auto addr = static_cast<uint64_t>(static_cast<char*>(block.ptr) - base_);
  return resident_bytes_ > 0 && addr >= arena_bytes_ + colour_bytes_;
}

void PinnedPool::Free(const PinnedBlock& block) {
  STRATA_DCHECK(Contains(block.ptr, block.class_bytes), "freeing memory that is not the pool's");
  const uint64_t addr = static_cast<uint64_t>(static_cast<char*>(block.ptr) - base_);
  std::lock_guard<std::mutex> lock(mu_);
  if (IsResident(block)) {
    auto it = resident_live_.find(addr);
    STRATA_DCHECK(it != resident_live_.end(), "host pool: double free or foreign block at offset ", addr);
    uint64_t start = addr, len = it->second;
    resident_live_.erase(it);
    stats_.resident_in_use -= len;
    --stats_.live_allocations;
    // Merge with the free ranges on either side.
    auto next = resident_free_.lower_bound(start);
    if (next != resident_free_.end() && next->first == start + len) {
      len += next->second;
      next = resident_free_.erase(next);
    }
    if (next != resident_free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        start = prev->first;
        len += prev->second;
        resident_free_.erase(prev);
      }
    }
    resident_free_[start] = len;
    return;
  }
  auto it = live_.find(addr);
  STRATA_DCHECK(it != live_.end(), "host pool: double free or foreign block at offset ", addr);
  uint64_t off = it->second.first;
  int k = it->second.second;
  live_.erase(it);
  auto rq = requested_.find(addr);
  stats_.bytes_requested -= rq->second;
  requested_.erase(rq);
  stats_.bytes_in_use -= options_.min_block << k;
  --stats_.live_allocations;
  // Merge with the buddy while it is free.
  while (k + 1 < static_cast<int>(free_.size())) {
    const uint64_t size = options_.min_block << k;
    const uint64_t buddy = off ^ size;
    auto& fl = free_[static_cast<size_t>(k)];
    auto b = fl.find(buddy);
    if (b == fl.end()) break;
    fl.erase(b);
    off = std::min(off, buddy);
    ++k;
  }
  free_[static_cast<size_t>(k)].insert(off);
}

std::vector<iovec> PinnedPool::IoRanges() const {
  std::vector<iovec> out;
  for (uint64_t off = 0; off < extent_bytes_; off += kMaxIoRange)
    out.push_back(iovec{base_ + off, static_cast<size_t>(std::min(kMaxIoRange, extent_bytes_ - off))});
  return out;
}

bool PinnedPool::Contains(const void* p, uint64_t len) const {
  auto a = reinterpret_cast<uintptr_t>(p);
  auto b = reinterpret_cast<uintptr_t>(base_);
  return a >= b && a + len <= b + extent_bytes_;
}

PinnedPoolStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PinnedPoolStats s = stats_;
  s.largest_free_block = 0;
  for (size_t k = free_.size(); k-- > 0;) {
    if (!free_[k].empty()) {
      s.largest_free_block = options_.min_block << k;
      break;
    }
  }
  return s;
}

}  // namespace strata
