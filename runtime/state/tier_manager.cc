#include "runtime/state/tier_manager.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <nlohmann/json.hpp>

#include "runtime/base/check.h"
#include "runtime/base/logging.h"
#include "runtime/base/units.h"
#include "tiers/nvme/nvme_tier.h"

namespace strata {

// Note [block state machine]
// Host residency moves only under mu_:
//   absent  --Acquire(read) / prefetch-->  reading  --read OK-->  clean
//   reading --read failed--> absent (the pool block is freed; the buffer is never handed out)
//   absent  --Acquire(kWrite)--> dirty          clean --Release(dirty)--> dirty
//   dirty   --write-back--> writing  --OK--> clean (then absent if it was evicted and unpinned)
//   writing --failed--> dirty (the NVMe copy is now undefined: nvme = absent)
//   clean   --evict--> absent (only unpinned; a clean block equals its NVMe copy, or zeros when
//                              NVMe holds none, so dropping it loses nothing)
// A block is written back only when no write pin is held, so the bytes that reach NVMe are the
// bytes the last writer released. Readers may hold pins during a write-back; writers wait for it.
// I/O is never started under mu_: state changes are made under the lock, the transfers they
// imply are collected as IoActions and issued after unlocking, because a tier may run the
// completion (which takes mu_) on the calling thread.

// Note [prefetch and eviction]
// With a trace, the prefetch window is the next `prefetch_lookahead` trace positions. Automatic
// prefetch fills the window in order; to make room it evicts only blocks outside the window
// whose next use is later than the prefetched block's (Belady's rule: never evict something
// needed sooner than what it makes room for). A dirty victim is written back with "evict when
// written" set, and the bytes it will free (reclaiming_bytes_) are promised to window entries in
// order, so several write-backs can be in flight for several entries without over-evicting.
// While an Acquire waits for room, automatic prefetch stands aside so it cannot take the room
// the waiting caller is making.

// Note [lanes in the trace]
// The engine acquires blocks from several threads at once: compute, the gather lane and the
// optimizer lane. Their interleaving differs from step to step (an optimizer lane that ran
// ahead of the forward in the recorded step may trail it in the next), so one shared position
// in the trace goes wrong: it jumps to whichever thread spoke last, next-use distances of the
// other threads' blocks come out wrong, and Belady evicts a block a moment before it is used
// (a freshly updated shard just before the forward gathers it). So each thread that recorded
// entries is a lane with its own position, advanced only by its own matches, and a block's
// next use is the nearest of its uses, each counted in trace entries from the position of the
// lane that recorded it. An access is matched first at the head of the caller's lane, then at
// the head of another lane (a shard the compute thread gathers itself, which the gather lane
// gathered in the recorded step), then a short way ahead in its own lane only: a guess must not
// move another lane's position. Threads that recorded nothing match a short way ahead in any
// lane. Prefetch fills, per lane, the entries within `prefetch_lookahead` of its position.
//
// A lane's own position says when its next entry is due only while the lane is busy. A lane
// that has not started yet (the gradient path, while the forward runs) or has finished its part
// of the iteration (the optimizer's updates, done early in the forward) would measure from its
// next entry and find it due "now": the optimizer's states for the next step would be read back
// and shielded from eviction through the whole forward and backward. So the iteration also has
// a frontier, one past the furthest entry any lane has matched, and a lane's position is the
// earlier of its own and the frontier: a lane behind the frontier is late and its entries are
// due now; a lane ahead of it waits for the others to reach its entries.

namespace {

constexpr uint64_t kMaxTraceLength = 1ull << 24;
constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();
constexpr size_t kNotListed = std::numeric_limits<size_t>::max();

using Clock = std::chrono::steady_clock;

}  // namespace

std::string ToString(BlockId id) { return StrCat("chunk ", id.chunk, " ", StateKindName(id.kind)); }

std::string_view HostResidencyName(HostResidency r) {
  switch (r) {
    case HostResidency::kAbsent: return "absent";
    case HostResidency::kReading: return "reading";
    case HostResidency::kClean: return "resident-clean";
    case HostResidency::kDirty: return "resident-dirty";
    case HostResidency::kWriting: return "writing";
  }
  return "?";
}

std::string_view NvmeResidencyName(NvmeResidency r) {
  switch (r) {
    case NvmeResidency::kAbsent: return "absent";
    case NvmeResidency::kWriting: return "writing";
    case NvmeResidency::kResident: return "resident";
  }
  return "?";
}

double TierManagerStats::host_hit_rate() const {
  const uint64_t n = host_hits + host_inflight_hits + host_misses;
  return n == 0 ? 0.0 : static_cast<double>(host_hits) / static_cast<double>(n);
}

TierManagerOptions TierManagerOptions::FromConfig(const StrataConfig& config, uint64_t resolved_host_budget) {
  TierManagerOptions o;
  o.host_budget = config.host_memory_budget != 0 ? config.host_memory_budget : resolved_host_budget;
  o.eviction = config.eviction;
  o.prefetch_lookahead = config.prefetch_lookahead;
  o.pool.colour_step = config.host_pool_colour_step;
  return o;
}

struct TierManager::Block {
  BlockId id;
  uint64_t bytes = 0;
  BlockHome home = BlockHome::kNvme;
  HostResidency host = HostResidency::kAbsent;
  NvmeResidency nvme = NvmeResidency::kAbsent;
  PinnedBlock mem;        // valid unless host == kAbsent
  TierRegion region;      // valid for kNvme blocks
  int pins = 0;
  int write_pins = 0;     // pins taken with kWrite/kReadWrite (see Release)
  uint64_t last_use = 0;  // LRU clock
  bool prefetched = false;         // read by prefetch, not yet acquired
  bool evict_after_write = false;  // drop when the write-back completes (if unpinned)
  uint64_t read_gen = 0, read_done_gen = 0;
  uint64_t read_failed_gen = 0;  // the last read that failed
  Status read_status;            // of the last read that failed
  uint64_t write_gen = 0, write_done_gen = 0;
  Status write_status;
  std::vector<uint64_t> uses;  // positions in the trace, ascending
  size_t listed = kNotListed;  // index in host_copies_ while an NVMe-backed host copy exists
};

struct TierManager::IoAction {
  bool write = false;
  Block* block = nullptr;
  void* buf = nullptr;
  TierRegion region;
  uint64_t gen = 0;
};

TierManager::TierManager(const TierManagerOptions& options, Tier* nvme) : options_(options), nvme_(nvme) {}

StatusOr<std::unique_ptr<TierManager>> TierManager::Create(const TierManagerOptions& options, Tier* nvme) {
  STRATA_CHECK(options.host_budget > 0,
               "tier manager host_budget=0: set strata.host_memory_budget (e.g. \"16GiB\")");
  STRATA_CHECK(options.prefetch_lookahead >= 0 && options.prefetch_lookahead <= (1 << 20),
               "strata.prefetch_lookahead=", options.prefetch_lookahead, ": must be 0..1048576");
  STRATA_CHECK(options.acquire_timeout.count() >= 0, "tier manager acquire_timeout must be >= 0");
  TierManagerOptions o = options;
  o.pool.budget = options.host_budget;
  o.pool.resident_bytes = options.resident_bytes;
  if (nvme != nullptr) {
    const uint64_t a = nvme->alignment();
    STRATA_CHECK(a != 0 && (a & (a - 1)) == 0, "nvme tier alignment ", a, " is not a power of two");
    o.pool.min_block = std::max(o.pool.min_block, a);
  }
  std::unique_ptr<TierManager> m(new TierManager(o, nvme));
  STRATA_ASSIGN_OR_RETURN(m->pool_, PinnedPool::Create(o.pool));
  {
    MutexLock l(&m->mu_);
    m->stats_.host_budget = m->pool_->arena_bytes() + m->pool_->resident_bytes();
  }
  return m;
}

TierManager::~TierManager() {
  MutexLock lk(&mu_);
  while (inflight_ != 0) cv_.Wait(&mu_);
  for (auto& [key, b] : blocks_) {
    STRATA_DCHECK(b->pins == 0, "tier manager destroyed while ", ToString(b->id), " is pinned");
    if (b->home == BlockHome::kNvme && nvme_ != nullptr) {
      Status s = nvme_->Free(b->region);
      if (!s.ok()) STRATA_LOG(WARN) << "tier manager: freeing " << ToString(b->id) << ": " << s.ToString();
    }
    if (b->host != HostResidency::kAbsent) pool_->Free(b->mem);
  }
}

Status TierManager::RegisterHostPoolWith(nvme::NvmeTier& tier) {
  return tier.store().RegisterBuffers(pool_->IoRanges());
}

TierManager::Block* TierManager::Find(BlockId id) const {
  auto it = blocks_.find(id.key());
  return it == blocks_.end() ? nullptr : it->second.get();
}

void TierManager::NoteHostBytes() {
  stats_.peak_host_bytes_resident = std::max(stats_.peak_host_bytes_resident, stats_.host_bytes_resident);
}

Status TierManager::Register(BlockId id, uint64_t bytes, BlockHome home) {
  MutexLock lk(&mu_);
  const std::string name = ToString(id);
  STRATA_CHECK(bytes > 0, "registering ", name, ": size 0; every block needs at least one byte");
  if (Find(id) != nullptr) return Status(StatusCode::kAlreadyExists, StrCat(name, " is already registered"));
  const uint64_t cls = pool_->ClassBytes(bytes);
  const uint64_t arena = pool_->arena_bytes();
  auto too_large = [&] {
    return InvalidArgument(StrCat(
        "registering ", name, " of ", FormatBytes(bytes), ": it needs a ", FormatBytes(cls),
        " slot in the pinned host pool, whose largest possible slot is ", FormatBytes(pool_->max_allocation()),
        " (strata.host_memory_budget=", FormatBytes(arena + pool_->resident_bytes()),
        pool_->resident_bytes() ? StrCat(", of which ", FormatBytes(pool_->resident_bytes()),
                                         " is the resident region for host-placed state")
                                : std::string(),
        "); raise strata.host_memory_budget to at least ", FormatBytes(pool_->resident_bytes() + cls),
        " (several times that for prefetch) or lower strata.chunk_size"));
  };
  auto b = std::make_unique<Block>();
  b->id = id;
  b->bytes = bytes;
  b->home = home;
  if (home == BlockHome::kNvme) {
    if (cls > pool_->max_allocation()) return too_large();
    if (nvme_ == nullptr)
      return FailedPrecondition(StrCat("registering ", name, " with an NVMe home, but this tier manager has no "
                                       "NVMe tier; register it host-only or configure offload to nvme"));
    if (host_only_class_bytes_ + cls > arena)
      return ResourceExhausted(StrCat(
          "registering ", name, ": host-only blocks hold ", FormatBytes(host_only_class_bytes_), " of the ",
          FormatBytes(arena), " host pool, so this ", FormatBytes(cls),
          " block could never be brought in; raise strata.host_memory_budget or offload more state to nvme"));
    StatusOr<TierRegion> region = nvme_->Allocate(bytes);
    if (!region.ok())
      return Status(region.status().code(),
                    StrCat("registering ", name, " (", FormatBytes(bytes), ") on NVMe with ",
                           FormatBytes(stats_.nvme_bytes_reserved), " already reserved: ",
                           region.status().message()));
    b->region = *region;
    stats_.nvme_bytes_reserved += bytes;
    largest_nvme_class_ = std::max(largest_nvme_class_, cls);
  } else {
    // Exactly its size in the resident region where the plan set room apart (Note [resident
    // region] in tiers/host/pinned_pool.cc); otherwise a class of the arena, as any block.
    StatusOr<PinnedBlock> mem = pool_->AllocateResident(bytes);
    const bool resident = mem.ok();
    if (resident) {
      stats_.host_bytes_resident += mem->class_bytes;
      resident_region_bytes_ += mem->class_bytes;
      NoteHostBytes();
    } else {
      if (cls > pool_->max_allocation()) return too_large();
      if (host_only_class_bytes_ + cls + largest_nvme_class_ > arena)
        return ResourceExhausted(StrCat(
            "registering host-only ", name, " (", FormatBytes(cls), "): with ", FormatBytes(host_only_class_bytes_),
            " of host-only blocks already there, the ", FormatBytes(arena),
            " host pool would have no room left for the largest NVMe-backed block (",
            FormatBytes(largest_nvme_class_), ")",
            pool_->resident_bytes() ? StrCat(", and its resident region has no free ", FormatBytes(PoolResidentBytes(bytes)),
                                             " range (", FormatBytes(resident_region_bytes_), " of ",
                                             FormatBytes(pool_->resident_bytes()), " in use)")
                                    : std::string(),
            "; raise strata.host_memory_budget"));
      mem = MakeRoom(bytes, name, Clock::time_point::max());
      if (!mem.ok()) return mem.status();
    }
    if (Find(id) != nullptr) {  // registered by another thread while we made room
      pool_->Free(*mem);
      stats_.host_bytes_resident -= mem->class_bytes;
      if (resident) resident_region_bytes_ -= mem->class_bytes;
      return Status(StatusCode::kAlreadyExists, StrCat(name, " is already registered"));
    }
    std::memset(mem->ptr, 0, bytes);
    b->mem = *mem;
    b->host = HostResidency::kClean;
    if (!resident) host_only_class_bytes_ += cls;
  }
  blocks_.emplace(id.key(), std::move(b));
  return Status::Ok();
}

Status TierManager::Unregister(BlockId id) {
  TierRegion region;
  bool free_region = false;
  {
    MutexLock lk(&mu_);
    Block* b = Find(id);
    if (b == nullptr) return NotFound(StrCat(ToString(id), " is not registered"));
    if (b->pins > 0 || b->host == HostResidency::kReading || b->host == HostResidency::kWriting)
      return FailedPrecondition(StrCat("unregistering ", ToString(id), ": it is pinned or has I/O in flight (",
                                       HostResidencyName(b->host), ", pins=", b->pins, ")"));
    if (b->host != HostResidency::kAbsent) {
      pool_->Free(b->mem);
      stats_.host_bytes_resident -= b->mem.class_bytes;
    }
    if (b->home == BlockHome::kHostOnly && pool_->IsResident(b->mem)) {
      resident_region_bytes_ -= b->mem.class_bytes;
    } else if (b->home == BlockHome::kHostOnly) {
      host_only_class_bytes_ -= pool_->ClassBytes(b->bytes);
    } else {
      if (b->nvme == NvmeResidency::kResident) stats_.nvme_bytes_resident -= b->bytes;
      stats_.nvme_bytes_reserved -= b->bytes;
      region = b->region;
      free_region = true;
      Unlist(b);
    }
    // The trace holds pointers to blocks: it is discarded, and the next bracketed iteration
    // records a new one.
    if (!trace_.empty()) {
      trace_.clear();
      trace_lane_.clear();
      lanes_.clear();
      thread_lane_.clear();
      for (auto& [k, x] : blocks_) x->uses.clear();
      trace_ready_ = false;
      recording_ = false;
    }
    blocks_.erase(id.key());
  }
  if (free_region) return nvme_->Free(region);
  return Status::Ok();
}

void TierManager::Wait(Clock::time_point deadline, bool* timed_out) {
  const auto t0 = Clock::now();
  if (deadline == Clock::time_point::max()) {
    cv_.Wait(&mu_);
  } else if (!cv_.WaitUntil(&mu_, deadline) && Clock::now() >= deadline) {
    *timed_out = true;
  }
  stats_.stall_seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  ++stats_.stalls;
}

std::string TierManager::PinnedSummary() const {
  // The arena's blocks only: the resident region's host-only blocks never need room made.
  uint64_t pinned = 0, pinned_bytes = 0, writing = 0, reading = 0;
  for (const auto& [k, b] : blocks_) {
    if (b->pins > 0 && b->host != HostResidency::kAbsent && !pool_->IsResident(b->mem)) {
      ++pinned;
      pinned_bytes += b->mem.class_bytes;
    }
    writing += b->host == HostResidency::kWriting;
    reading += b->host == HostResidency::kReading;
  }
  return StrCat(pinned, " blocks pinned holding ", FormatBytes(pinned_bytes), " of the host pool's ",
                FormatBytes(pool_->arena_bytes()), " arena, ", reading, " reads and ", writing,
                " write-backs in flight");
}

int TierManager::LaneOfThisThread() {
  const std::thread::id me = std::this_thread::get_id();
  auto it = thread_lane_.find(me);
  if (it != thread_lane_.end()) return it->second;
  if (!recording_) return -1;
  if (lanes_.size() < kMaxTraceLanes) lanes_.emplace_back();
  const auto lane = static_cast<uint16_t>(lanes_.size() - 1);
  thread_lane_.emplace(me, lane);
  return lane;
}

void TierManager::RecordUse(Block* b) {
  if (recording_) {
    if (trace_.size() >= kMaxTraceLength) {
      STRATA_LOG_ONCE(WARN) << "tier manager: the first iteration made more than " << kMaxTraceLength
                            << " accesses; the trace keeps the first ones only";
      return;
    }
    const int lane = LaneOfThisThread();
    b->uses.push_back(trace_.size());
    lanes_[lane].positions.push_back(trace_.size());
    trace_lane_.push_back(static_cast<uint16_t>(lane));
    trace_.push_back(b);
    return;
  }
  if (!trace_ready_) return;
  // Note [lanes in the trace]: heads first (the caller's lane, then the others), then a short way
  // ahead (threads may reorder a few accesses). No match leaves every position where it is.
  const int own = LaneOfThisThread();
  if (own >= 0 && MatchInLane(own, b, 1)) return;
  for (size_t l = 0; l < lanes_.size(); ++l)
    if (static_cast<int>(l) != own && MatchInLane(l, b, 1)) return;
  ++stats_.trace_deviations;
  const uint64_t horizon = 2 * static_cast<uint64_t>(options_.prefetch_lookahead) + 16;
  if (own >= 0) {
    // Never ahead in another lane: that would move its position on a guess.
    MatchInLane(own, b, horizon);
    return;
  }
  for (size_t l = 0; l < lanes_.size(); ++l)
    if (MatchInLane(l, b, horizon)) return;
}

bool TierManager::MatchInLane(size_t lane, const Block* b, uint64_t horizon) {
  TraceLane& ln = lanes_[lane];
  const uint64_t m = ln.positions.size();
  if (m == 0) return false;
  // A lane past its last entry is in the next iteration: it continues from its first.
  const bool wrapped = ln.next >= m;
  const uint64_t k = ln.next % m;
  const uint64_t end = std::min(m, k + horizon);
  for (uint64_t j = k; j < end; ++j) {
    if (trace_[ln.positions[j]] == b) {
      ln.next = j + 1;
      // Without a BeginIteration the first lane into the next iteration takes the frontier
      // with it (a frontier at or past the end is already there).
      const uint64_t n = trace_.size();
      if (wrapped && frontier_ >= n) frontier_ -= n;
      frontier_ = std::max(frontier_, ln.positions[j] + 1);
      return true;
    }
  }
  return false;
}

uint64_t TierManager::LanePosition(size_t lane) const {
  const TraceLane& ln = lanes_[lane];
  // Past its last entry a lane is at its first one of the next iteration.
  const uint64_t own =
      ln.next < ln.positions.size() ? ln.positions[ln.next] : trace_.size() + ln.positions.front();
  return std::min(own, frontier_);
}

void TierManager::LaneStarts(LaneArray* at) const {
  // LanePosition is below 2n: one subtraction reduces it.
  const uint64_t n = trace_.size();
  for (size_t l = 0; l < lanes_.size(); ++l) {
    if (lanes_[l].positions.empty()) continue;
    const uint64_t p = LanePosition(l);
    (*at)[l] = p >= n ? p - n : p;
  }
}

void TierManager::ResetLanes(bool to_next_iteration) {
  for (TraceLane& ln : lanes_) ln.next = to_next_iteration ? ln.positions.size() : 0;
  frontier_ = to_next_iteration ? trace_.size() : 0;
}

uint64_t TierManager::NextUseFrom(const Block* b, const LaneArray& at) const {
  if (!trace_ready_ || b->uses.empty()) return kNever;
  const uint64_t n = trace_.size();
  uint64_t best = kNever;
  for (uint64_t p : b->uses) {
    const uint64_t from = at[trace_lane_[p]];  // a lane with a use has entries
    best = std::min(best, p >= from ? p - from : p + n - from);
  }
  return best;
}

uint64_t TierManager::NextUse(const Block* b) const {
  if (!trace_ready_ || b->uses.empty()) return kNever;
  LaneArray at;
  LaneStarts(&at);
  return NextUseFrom(b, at);
}

void TierManager::List(Block* b) {
  if (b->listed != kNotListed) return;
  b->listed = host_copies_.size();
  host_copies_.push_back(b);
}

void TierManager::Unlist(Block* b) {
  if (b->listed == kNotListed) return;
  Block* last = host_copies_.back();
  host_copies_[b->listed] = last;
  last->listed = b->listed;
  host_copies_.pop_back();
  b->listed = kNotListed;
}

TierManager::Block* TierManager::PickVictim(const uint64_t* before) const {
  const bool belady = options_.eviction == EvictionPolicy::kNextUse && trace_ready_;
  // Blocks whose next use falls in the prefetch window are kept when `before` is set.
  const bool window = before != nullptr && trace_ready_ && options_.prefetch_lookahead > 0;
  // The lanes' positions once per pick, not once per use of every candidate: this loop runs for
  // almost every Acquire, under mu_, over every host copy.
  LaneArray at;
  if (belady || window) LaneStarts(&at);
  Block* best = nullptr;
  uint64_t best_nu = 0;
  for (Block* b : host_copies_) {
    STRATA_DCHECK(b->home == BlockHome::kNvme && b->host != HostResidency::kAbsent, ToString(b->id),
                  " is listed as a host copy in state ", HostResidencyName(b->host));
    if (b->pins > 0) continue;
    if (b->host != HostResidency::kClean && b->host != HostResidency::kDirty) continue;
    const uint64_t nu = belady || window ? NextUseFrom(b, at) : kNever;
    if (window && nu < static_cast<uint64_t>(options_.prefetch_lookahead)) continue;
    if (belady) {
      if (before != nullptr && nu <= *before) continue;
      // Farthest next use first; among equals a clean block (free to drop), then the older one.
      bool better;
      if (best == nullptr) {
        better = true;
      } else if (nu != best_nu) {
        better = nu > best_nu;
      } else if ((b->host == HostResidency::kClean) != (best->host == HostResidency::kClean)) {
        better = b->host == HostResidency::kClean;
      } else {
        better = b->last_use < best->last_use;
      }
      if (better) {
        best = b;
        best_nu = nu;
      }
    } else if (best == nullptr || b->last_use < best->last_use) {
      best = b;
    }
  }
  return best;
}

void TierManager::Drop(Block* b) {
  STRATA_DCHECK(b->pins == 0 && b->host == HostResidency::kClean, "dropping ", ToString(b->id), " in state ",
                HostResidencyName(b->host), " with ", b->pins, " pins");
  if (b->prefetched) ++stats_.prefetches_wasted;
  b->prefetched = false;
  pool_->Free(b->mem);
  stats_.host_bytes_resident -= b->mem.class_bytes;
  b->mem = PinnedBlock{};
  b->host = HostResidency::kAbsent;
  Unlist(b);
}

void TierManager::StartWriteBack(Block* b, bool evict, std::vector<IoAction>* io) {
  STRATA_DCHECK(b->host == HostResidency::kDirty && b->write_pins == 0 && b->home == BlockHome::kNvme,
                "write-back of ", ToString(b->id), " in state ", HostResidencyName(b->host));
  if (b->nvme == NvmeResidency::kResident) stats_.nvme_bytes_resident -= b->bytes;
  b->host = HostResidency::kWriting;
  b->nvme = NvmeResidency::kWriting;
  b->evict_after_write = evict;
  if (evict) reclaiming_bytes_ += b->mem.class_bytes;
  ++writes_inflight_;
  ++inflight_;
  io->push_back(IoAction{true, b, b->mem.ptr, b->region, ++b->write_gen});
}

void TierManager::StartRead(Block* b, const PinnedBlock& mem, bool prefetch, std::vector<IoAction>* io) {
  STRATA_DCHECK(b->host == HostResidency::kAbsent && b->nvme == NvmeResidency::kResident,
                "read of ", ToString(b->id), " in state ", HostResidencyName(b->host), "/",
                NvmeResidencyName(b->nvme));
  b->mem = mem;
  b->host = HostResidency::kReading;
  List(b);
  b->prefetched = prefetch;
  if (prefetch) ++stats_.prefetches_issued;
  ++inflight_;
  io->push_back(IoAction{false, b, mem.ptr, b->region, ++b->read_gen});
}

void TierManager::Issue(std::vector<IoAction>& io) {
  for (IoAction& a : io) {
    Block* b = a.block;
    const uint64_t gen = a.gen;
    if (a.write) {
      nvme_->WriteAsync(a.region, a.buf, [this, b, gen](Status s) { OnWriteDone(b, gen, s); });
    } else {
      nvme_->ReadAsync(a.region, a.buf, [this, b, gen](Status s) { OnReadDone(b, gen, s); });
    }
  }
  io.clear();
}

void TierManager::OnReadDone(Block* b, uint64_t gen, const Status& s) {
  std::vector<IoAction> io;
  {
    MutexLock lk(&mu_);
    --inflight_;
    b->read_done_gen = gen;
    if (s.ok()) {
      b->host = HostResidency::kClean;
      b->last_use = ++tick_;
      stats_.bytes_nvme_to_host += b->bytes;
      ++stats_.reads_nvme_to_host;
    } else {
      // Never hand out what a failed read left in the buffer.
      b->read_status = s.WithContext(StrCat("reading ", ToString(b->id), " from NVMe"));
      b->read_failed_gen = gen;
      ++stats_.read_errors;
      pool_->Free(b->mem);
      stats_.host_bytes_resident -= b->mem.class_bytes;
      b->mem = PinnedBlock{};
      b->host = HostResidency::kAbsent;
      Unlist(b);
      b->prefetched = false;
    }
    Pump(&io);
    cv_.SignalAll();
  }
  Issue(io);
}

void TierManager::OnWriteDone(Block* b, uint64_t gen, const Status& s) {
  std::vector<IoAction> io;
  {
    MutexLock lk(&mu_);
    --inflight_;
    --writes_inflight_;
    STRATA_DCHECK(b->host == HostResidency::kWriting, "write-back completion of ", ToString(b->id), " in state ",
                  HostResidencyName(b->host));
    const bool evict = b->evict_after_write;
    b->evict_after_write = false;
    if (evict) reclaiming_bytes_ -= b->mem.class_bytes;
    b->write_done_gen = gen;
    if (s.ok()) {
      b->write_status = Status::Ok();
      b->host = HostResidency::kClean;
      b->nvme = NvmeResidency::kResident;
      stats_.nvme_bytes_resident += b->bytes;
      stats_.peak_nvme_bytes_resident = std::max(stats_.peak_nvme_bytes_resident, stats_.nvme_bytes_resident);
      stats_.bytes_host_to_nvme += b->bytes;
      ++stats_.writes_host_to_nvme;
      if (evict && b->pins == 0) {
        Drop(b);
        ++stats_.evictions_dirty;
      }
    } else {
      // The host copy is the only good one now: keep it dirty so it is never dropped.
      b->write_status = s.WithContext(StrCat("writing back ", ToString(b->id), " to NVMe"));
      b->host = HostResidency::kDirty;
      b->nvme = NvmeResidency::kAbsent;
      ++stats_.write_errors;
      ++write_error_gen_;
      last_write_error_ = b->write_status;
      STRATA_LOG(WARN) << "tier manager: " << b->write_status.ToString()
                       << "; the block stays dirty in host memory and will be retried";
    }
    Pump(&io);
    cv_.SignalAll();
  }
  Issue(io);
}

StatusOr<PinnedBlock> TierManager::MakeRoom(uint64_t bytes, const std::string& for_what,
                                            Clock::time_point deadline) {
  const uint64_t need = pool_->ClassBytes(bytes);
  const uint64_t error_gen = write_error_gen_;
  ++space_waiters_;
  struct Leave {
    int* n;
    ~Leave() { --*n; }
  } leave{&space_waiters_};
  for (;;) {
    StatusOr<PinnedBlock> m = pool_->Allocate(bytes);
    if (m.ok()) {
      stats_.host_bytes_resident += m->class_bytes;
      NoteHostBytes();
      return m;
    }
    if (m.status().code() != StatusCode::kResourceExhausted) return m.status();
    if (write_error_gen_ != error_gen)
      return Status(last_write_error_.code(),
                    StrCat("making room for ", for_what, ": ", last_write_error_.message(),
                           " (the block stays dirty in host memory; a later call retries)"),
                    last_write_error_.sys_errno());
    // Write-backs already in flight may free enough: wait for them rather than evict more.
    const uint64_t free_bytes = pool_->arena_bytes() - ArenaBytesInUse();
    if (reclaiming_bytes_ == 0 || free_bytes + reclaiming_bytes_ < need) {
      if (Block* v = PickVictim(nullptr)) {
        if (v->host == HostResidency::kClean) {
          Drop(v);
          ++stats_.evictions_clean;
        } else {
          std::vector<IoAction> io;
          StartWriteBack(v, /*evict=*/true, &io);
          mu_.Unlock();
          Issue(io);
          mu_.Lock();
        }
        continue;
      }
    }
    bool timed_out = false;
    Wait(deadline, &timed_out);
    if (timed_out)
      return DeadlineExceeded(StrCat("no room for ", for_what, " (", FormatBytes(need), ") after ",
                                     options_.acquire_timeout.count(), " ms: ", PinnedSummary(),
                                     "; release blocks sooner or raise strata.host_memory_budget"));
  }
}

bool TierManager::TryPrefetch(Block* b, uint64_t pos, std::vector<IoAction>* io) {
  // Kept simple on purpose: a caller that wants several in flight calls Pump (see Note
  // [prefetch and eviction]); here one block gets room from free space or clean victims, or one
  // write-back is started for it.
  uint64_t pending = reclaiming_bytes_;
  const uint64_t need = pool_->ClassBytes(b->bytes);
  for (;;) {
    StatusOr<PinnedBlock> m = pool_->Allocate(b->bytes);
    if (m.ok()) {
      stats_.host_bytes_resident += m->class_bytes;
      NoteHostBytes();
      StartRead(b, *m, /*prefetch=*/true, io);
      return true;
    }
    if (m.status().code() != StatusCode::kResourceExhausted) return false;
    if (pending >= need) return false;
    Block* v = PickVictim(trace_ready_ ? &pos : nullptr);
    if (v == nullptr) return false;
    if (v->host == HostResidency::kClean) {
      Drop(v);
      ++stats_.evictions_clean;
      continue;
    }
    StartWriteBack(v, /*evict=*/true, io);
    return false;
  }
}

void TierManager::Pump(std::vector<IoAction>* io) {
  if (!trace_ready_ || options_.prefetch_lookahead == 0 || space_waiters_ > 0 || nvme_ == nullptr) return;
  const uint64_t n = trace_.size();
  const uint64_t window = std::min<uint64_t>(static_cast<uint64_t>(options_.prefetch_lookahead), n);
  // Bytes that write-backs in flight will free, not yet promised to a window entry.
  uint64_t pending = reclaiming_bytes_;
  // Starts the read of `b`, needed `dist` entries from now; false when nothing more can be done.
  auto serve = [&](Block* b, uint64_t dist) {
    mu_.AssertHeld();  // Pump's own lock: the lambda runs inside it
    if (b->home != BlockHome::kNvme || b->host != HostResidency::kAbsent) return true;
    if (b->nvme != NvmeResidency::kResident) return true;  // never written: Acquire zero-fills it
    // Note [no retry from a completion]: a block whose last read failed is read again only
    // when it is acquired, which reports the failure. Prefetched again here, from the failed
    // read's own completion, it failed again and again: the error was reported, then the
    // engine's teardown waited forever for I/O that never ended.
    if (b->read_failed_gen != 0 && b->read_failed_gen == b->read_done_gen) return true;
    const uint64_t need = pool_->ClassBytes(b->bytes);
    for (;;) {
      StatusOr<PinnedBlock> m = pool_->Allocate(b->bytes);
      if (m.ok()) {
        stats_.host_bytes_resident += m->class_bytes;
        NoteHostBytes();
        StartRead(b, *m, /*prefetch=*/true, io);
        return true;
      }
      if (m.status().code() != StatusCode::kResourceExhausted) return false;
      if (pending >= need) {  // covered by write-backs in flight; look further ahead
        pending -= need;
        return true;
      }
      Block* v = PickVictim(&dist);
      if (v == nullptr) return false;
      if (v->host == HostResidency::kClean) {
        Drop(v);
        ++stats_.evictions_clean;
        continue;
      }
      if (!v->write_status.ok()) return false;  // Note [no retry from a completion]
      pending += v->mem.class_bytes;
      StartWriteBack(v, /*evict=*/true, io);
    }
  };
  // Nearest first: distance i from every lane's position (Note [lanes in the trace]).
  for (uint64_t i = 0; i < window; ++i) {
    for (size_t l = 0; l < lanes_.size(); ++l) {
      if (lanes_[l].positions.empty()) continue;
      const uint64_t pos = (LanePosition(l) + i) % n;
      if (trace_lane_[pos] != l) continue;
      if (!serve(trace_[pos], i)) return;
    }
  }
  // Write-behind: when the window is served and no write-back is running, clean the block that
  // will be evicted next (if it is dirty) so that its eviction becomes a drop and the write
  // overlaps the reads instead of standing in front of them. Only under pressure: with room
  // to spare, nothing needs evicting soon. See Note [prefetch and eviction].
  if (writes_inflight_ == 0 && pool_->arena_bytes() - ArenaBytesInUse() < pool_->max_allocation()) {
    Block* v = PickVictim(&window);
    // A write-back that failed is retried only by an eviction that needs the room (Note [no
    // retry from a completion]).
    if (v != nullptr && v->host == HostResidency::kDirty && v->write_status.ok())
      StartWriteBack(v, /*evict=*/false, io);
  }
}

StatusOr<void*> TierManager::Acquire(BlockId id, Access access) {
  const auto deadline = options_.acquire_timeout.count() > 0 ? Clock::now() + options_.acquire_timeout
                                                             : Clock::time_point::max();
  const bool writes = access != Access::kRead;
  std::vector<IoAction> io;
  MutexLock lk(&mu_);
  Block* b = Find(id);
  if (b == nullptr) return NotFound(StrCat("acquiring ", ToString(id), ": not registered"));
  RecordUse(b);
  auto pin = [&]() -> void* {
    mu_.AssertHeld();  // Acquire's lock: the lambda runs inside it
    ++b->pins;
    if (writes) ++b->write_pins;
    if (access == Access::kWrite) b->host = HostResidency::kDirty;
    b->last_use = ++tick_;
    if (b->prefetched) {
      ++stats_.prefetches_used;
      b->prefetched = false;
    }
    return b->mem.ptr;
  };
  if (b->home == BlockHome::kHostOnly) return pin();
  ++stats_.acquires;
  bool counted = false;
  auto count = [&](uint64_t* counter) {
    if (!counted) ++*counter;
    counted = true;
  };
  bool timed_out = false;
  auto timeout = [&]() {
    mu_.AssertHeld();
    return DeadlineExceeded(StrCat("acquiring ", ToString(id), ": still waiting after ",
                                   options_.acquire_timeout.count(), " ms (", PinnedSummary(), ")"));
  };
  for (;;) {
    switch (b->host) {
      case HostResidency::kClean:
      case HostResidency::kDirty: {
        count(&stats_.host_hits);
        void* p = pin();
        Pump(&io);
        lk.Unlock();
        Issue(io);
        return p;
      }
      case HostResidency::kWriting: {
        count(&stats_.host_hits);
        if (!writes) {
          void* p = pin();
          Pump(&io);
          lk.Unlock();
          Issue(io);
          return p;
        }
        // Writers wait for the write-back (it must not see half-modified bytes); the pin keeps
        // the copy resident when the write completes.
        ++b->pins;
        while (b->host == HostResidency::kWriting && !timed_out) Wait(deadline, &timed_out);
        --b->pins;
        if (timed_out) return timeout();
        continue;
      }
      case HostResidency::kReading: {
        count(&stats_.host_inflight_hits);
        const uint64_t gen = b->read_gen;
        ++b->pins;
        while (b->read_done_gen < gen && !timed_out) Wait(deadline, &timed_out);
        --b->pins;
        if (timed_out) return timeout();
        if (b->read_failed_gen >= gen) return b->read_status;
        continue;
      }
      case HostResidency::kAbsent: {
        count(&stats_.host_misses);
        StatusOr<PinnedBlock> mem = MakeRoom(b->bytes, ToString(id), deadline);
        if (!mem.ok()) return mem.status();
        if (b->host != HostResidency::kAbsent) {  // another thread brought it in meanwhile
          pool_->Free(*mem);
          stats_.host_bytes_resident -= mem->class_bytes;
          continue;
        }
        if (access == Access::kWrite) {
          b->mem = *mem;
          List(b);
          void* p = pin();
          Pump(&io);
          lk.Unlock();
          Issue(io);
          return p;
        }
        if (b->nvme != NvmeResidency::kResident) {
          // Never written: zeros, filled outside the lock (others wait as for a read).
          STRATA_DCHECK(b->nvme == NvmeResidency::kAbsent, "absent block with an NVMe write in flight");
          ++stats_.nvme_misses;
          b->mem = *mem;
          b->host = HostResidency::kReading;
          List(b);
          const uint64_t gen = ++b->read_gen;
          ++b->pins;
          lk.Unlock();
          std::memset(mem->ptr, 0, b->bytes);
          lk.Lock();
          --b->pins;
          b->read_done_gen = gen;
          b->host = HostResidency::kClean;
          stats_.bytes_zero_filled += b->bytes;
          cv_.SignalAll();
          continue;
        }
        ++stats_.nvme_hits;
        StartRead(b, *mem, /*prefetch=*/false, &io);
        // Wait for this read (the completion may even run inside Issue) and judge it by its
        // generation: a failed read must be reported, not silently retried.
        const uint64_t gen = b->read_gen;
        ++b->pins;
        lk.Unlock();
        Issue(io);
        lk.Lock();
        while (b->read_done_gen < gen && !timed_out) Wait(deadline, &timed_out);
        --b->pins;
        if (timed_out) return timeout();
        if (b->read_failed_gen >= gen) return b->read_status;
        continue;
      }
    }
  }
}

Status TierManager::Release(BlockId id, bool dirty) {
  std::vector<IoAction> io;
  {
    MutexLock lk(&mu_);
    Block* b = Find(id);
    if (b == nullptr) return NotFound(StrCat("releasing ", ToString(id), ": not registered"));
    if (b->pins == 0) return FailedPrecondition(StrCat("releasing ", ToString(id), " without a matching Acquire"));
    if (dirty) {
      if (b->write_pins == 0)
        return FailedPrecondition(StrCat("releasing ", ToString(id), " as dirty, but it was acquired for reading; "
                                         "acquire it with Access::kWrite or kReadWrite to modify it"));
      STRATA_DCHECK(b->host == HostResidency::kClean || b->host == HostResidency::kDirty,
                    "write pin held on ", ToString(b->id), " in state ", HostResidencyName(b->host));
      --b->write_pins;
      --b->pins;
      b->host = HostResidency::kDirty;
    } else {
      // Pins are not tagged: a clean release ends a read pin when there is one, which can only
      // overstate the write pins still held (safe: it delays a write-back, never allows one early).
      --b->pins;
      b->write_pins = std::min(b->write_pins, b->pins);
    }
    b->last_use = ++tick_;
    Pump(&io);
    cv_.SignalAll();
  }
  Issue(io);
  return Status::Ok();
}

void TierManager::Prefetch(BlockId id) {
  std::vector<IoAction> io;
  {
    MutexLock lk(&mu_);
    Block* b = Find(id);
    if (b == nullptr || b->home != BlockHome::kNvme || b->host != HostResidency::kAbsent ||
        b->nvme != NvmeResidency::kResident || space_waiters_ > 0)
      return;
    const uint64_t pos = trace_ready_ ? NextUse(b) : kNever;
    if (TryPrefetch(b, pos == kNever ? 0 : pos, &io)) b->last_use = ++tick_;
  }
  Issue(io);
}

Status TierManager::BeginIteration() {
  std::vector<IoAction> io;
  {
    MutexLock lk(&mu_);
    if (in_iteration_) return FailedPrecondition("BeginIteration called twice without EndIteration");
    in_iteration_ = true;
    ++stats_.iterations;
    if (!trace_ready_) {
      recording_ = true;
      trace_.clear();
      trace_lane_.clear();
      lanes_.clear();
      thread_lane_.clear();
      for (auto& [k, b] : blocks_) b->uses.clear();
    }
    ResetLanes(/*to_next_iteration=*/false);
    Pump(&io);
  }
  Issue(io);
  return Status::Ok();
}

Status TierManager::EndIteration() {
  std::vector<IoAction> io;
  {
    MutexLock lk(&mu_);
    if (!in_iteration_) return FailedPrecondition("EndIteration called without BeginIteration");
    in_iteration_ = false;
    if (recording_) {
      recording_ = false;
      trace_ready_ = !trace_.empty();
      stats_.trace_length = trace_.size();
      ResetLanes(/*to_next_iteration=*/true);  // next uses now point into the next iteration
    } else if (trace_ready_) {
      // Entries left unmatched are not still to come: the frontier is at the next iteration,
      // which a lane wrapping before the next BeginIteration then takes it into.
      frontier_ = trace_.size();
    }
    Pump(&io);
  }
  Issue(io);
  return Status::Ok();
}

Status TierManager::Flush() {
  std::vector<IoAction> io;
  std::vector<std::pair<Block*, uint64_t>> targets;
  MutexLock lk(&mu_);
  for (auto& [k, b] : blocks_) {
    if (b->home == BlockHome::kNvme && b->host == HostResidency::kDirty && b->write_pins > 0)
      return FailedPrecondition(StrCat("Flush: ", ToString(b->id),
                                       " is pinned for writing; release it before flushing"));
  }
  for (auto& [k, up] : blocks_) {
    Block* b = up.get();
    if (b->home != BlockHome::kNvme) continue;
    if (b->host == HostResidency::kDirty) {
      StartWriteBack(b, /*evict=*/false, &io);
      targets.emplace_back(b, b->write_gen);
    } else if (b->host == HostResidency::kWriting) {
      targets.emplace_back(b, b->write_gen);
    }
  }
  lk.Unlock();
  Issue(io);
  lk.Lock();
  Status first;
  uint64_t failed = 0;
  bool timed_out = false;
  for (auto& [b, gen] : targets) {
    while (b->write_done_gen < gen) Wait(Clock::time_point::max(), &timed_out);
    // A later write-back of the same block may have completed since; judge the one we waited on
    // by the block's state: still dirty with a failed status means the data is not on NVMe.
    if (!b->write_status.ok() && b->host == HostResidency::kDirty) {
      ++failed;
      if (first.ok()) first = b->write_status;
    }
  }
  if (failed > 1) first = first.WithContext(StrCat("Flush: ", failed, " write-backs failed; first"));
  return first;
}

StatusOr<BlockInfo> TierManager::Query(BlockId id) const {
  MutexLock lk(&mu_);
  Block* b = Find(id);
  if (b == nullptr) return NotFound(StrCat(ToString(id), " is not registered"));
  BlockInfo info;
  info.id = b->id;
  info.bytes = b->bytes;
  info.home = b->home;
  info.host = b->host;
  info.nvme = b->nvme;
  info.pins = b->pins;
  info.write_pins = b->write_pins;
  info.nvme_region = b->region;
  return info;
}

TierManagerStats TierManager::stats() const {
  MutexLock lk(&mu_);
  TierManagerStats s = stats_;
  s.nvme_capacity = nvme_ != nullptr ? nvme_->capacity() : 0;
  return s;
}

nlohmann::json TierManager::StatsJson() const {
  const TierManagerStats s = stats();
  const PinnedPoolStats p = pool_->stats();
  nlohmann::json j;
  j["host"] = {{"budget_bytes", s.host_budget},
               {"resident_bytes", s.host_bytes_resident},
               {"peak_resident_bytes", s.peak_host_bytes_resident},
               {"hits", s.host_hits},
               {"inflight_hits", s.host_inflight_hits},
               {"misses", s.host_misses},
               {"hit_rate", s.host_hit_rate()},
               {"pool",
                {{"backing", p.backing},
                 {"arena_bytes", p.arena_bytes},
                 {"pinned_bytes", p.pinned_bytes},
                 {"pageable_bytes", p.pageable_bytes},
                 {"huge_pages", p.huge_pages},
                 {"numa_node", p.numa_node},
                 {"peak_bytes_in_use", p.peak_bytes_in_use},
                 {"bytes_requested", p.bytes_requested},
                 {"bytes_in_use", p.bytes_in_use},
                 {"resident_bytes", p.resident_bytes},
                 {"resident_in_use", p.resident_in_use}}}};
  j["nvme"] = {{"capacity_bytes", s.nvme_capacity},
               {"reserved_bytes", s.nvme_bytes_reserved},
               {"resident_bytes", s.nvme_bytes_resident},
               {"peak_resident_bytes", s.peak_nvme_bytes_resident},
               {"hits", s.nvme_hits},
               {"misses", s.nvme_misses}};
  j["transfers"] = {{"nvme_to_host", {{"bytes", s.bytes_nvme_to_host}, {"count", s.reads_nvme_to_host}}},
                    {"host_to_nvme", {{"bytes", s.bytes_host_to_nvme}, {"count", s.writes_host_to_nvme}}},
                    {"zero_fill", {{"bytes", s.bytes_zero_filled}}}};
  j["eviction"] = {{"policy", options_.eviction == EvictionPolicy::kNextUse ? "next_use" : "lru"},
                   {"clean", s.evictions_clean},
                   {"dirty", s.evictions_dirty}};
  j["prefetch"] = {{"lookahead", options_.prefetch_lookahead},
                   {"issued", s.prefetches_issued},
                   {"used", s.prefetches_used},
                   {"wasted", s.prefetches_wasted}};
  j["errors"] = {{"read", s.read_errors}, {"write", s.write_errors}};
  j["stall"] = {{"seconds", s.stall_seconds}, {"count", s.stalls}};
  j["trace"] = {{"iterations", s.iterations}, {"length", s.trace_length}, {"deviations", s.trace_deviations}};
  j["acquires"] = s.acquires;
  return j;
}

}  // namespace strata
