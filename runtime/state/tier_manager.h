// TierManager: the one owner of placement for every block of training state between pinned host
// memory (a PinnedPool) and NVMe (any Tier: NvmeTier in production, MemoryTier/FaultyTier in
// tests). Device copies are the engine's: it allocates them from the Device, whose allocator
// enforces the device budget, and copies from/to the host pointers this class hands out.
//
// Blocks. A block is (chunk, state kind) with a fixed size, registered once. Its home is
// kHostOnly (lives in the pool for its whole life, never written to NVMe: offload to cpu) or
// kNvme (backed by an NVMe region reserved at Register; its host copy comes and goes). A block
// that was never written reads as zeros.
//
// Residency. Per tier a block is, on the host: absent, reading (NVMe -> host in flight),
// resident-clean (equal to its NVMe copy, or zeros if it has none), resident-dirty (newer than
// NVMe) or writing (host -> NVMe in flight; the host copy stays readable). On NVMe: absent (no
// valid copy: never written, or the last write-back failed), writing, or resident.
//
// Contract
// - Register(id, bytes, home) plans the block: it fails at once, naming the block and the knob
//   to change, when the block can never fit (its size class exceeds the host pool, host-only
//   blocks would leave no room for it, or the NVMe capacity is used up). Nothing fails later for
//   lack of capacity: requests wait instead (back-pressure). A host-only block takes exactly
//   PoolResidentBytes(bytes) of the resident region while it has room (options.resident_bytes),
//   else a size class of the arena.
// - Acquire(id, access) returns a host pointer to the block's bytes (>= bytes, 4 KiB-aligned,
//   in the pinned pool), pinned until the matching Release. Pins count: a block may be acquired
//   several times, by several threads. kRead/kReadWrite deliver the block's current contents
//   (waiting for that block's read only, never for unrelated I/O); kWrite skips the NVMe read:
//   the caller promises to overwrite every byte, and the block is dirty from that moment.
//   When the pool is full, Acquire evicts unpinned blocks (clean ones are dropped, dirty ones are
//   written back first) and otherwise waits until pins are released or I/O completes. It returns
//   - NOT_FOUND for an unregistered block;
//   - the NVMe tier's error (IO_ERROR, DATA_LOSS, OUT_OF_RANGE...) if reading the block failed:
//     the buffer is not handed out, and a later Acquire retries the read;
//   - the NVMe tier's error if a write-back this call waited on to make room failed: the victim
//     stays resident-dirty (no data is lost) and a later call retries;
//   - DEADLINE_EXCEEDED after options.acquire_timeout (when set) without room, naming what is
//     pinned. A thread that keeps blocks pinned while acquiring more can wait forever if the
//     pinned set plus the new block cannot fit: keep each thread's pinned set well under the
//     budget, or set acquire_timeout.
// - Release(id, dirty) drops one pin. dirty = true says the holder modified the bytes and needs
//   a pin taken with kWrite or kReadWrite (FAILED_PRECONDITION otherwise, and for a block that is
//   not pinned). A block is not written back while a write pin is held.
// - Prefetch(id) is a hint: start reading the block if it is absent and room can be made
//   without waiting. Errors are not reported (the Acquire that follows retries and reports).
// - BeginIteration()/EndIteration() bracket a training step. The first bracketed step records
//   the order of Acquire calls (the trace); later steps follow it: eviction by next use (Belady:
//   the unpinned block used furthest in the future goes first) when options.eviction is
//   kNextUse, LRU otherwise and before a trace exists; and automatic prefetch of the next
//   `prefetch_lookahead` trace entries, evicting only blocks whose next use is later than the
//   prefetched block's (LRU mode: the least recently used block outside the window). Accesses
//   that leave the trace are tolerated (the position resynchronizes; stats count deviations).
//   Each calling thread is a lane with its own position in the trace (see Note [lanes in the
//   trace]): threads that run at different speeds from one step to the next (compute, a gather
//   lane, an optimizer lane) do not drag one another's position, and "next use" is counted from
//   the position of the lane that will make that use.
// - Flush() writes back every dirty NVMe-backed block and waits for those writes (and for ones
//   already in flight); blocks stay resident-clean. It returns the first failure (others are
//   counted in stats), FAILED_PRECONDITION while a dirty block is pinned for writing. Use it
//   before a checkpoint. Dirty data that was never flushed is lost when the manager is destroyed.
// - Budgets hold at every moment, in-flight buffers included: host bytes are pool bytes (a block
//   being read or written occupies its pool block until the I/O completes), and NVMe regions are
//   reserved at Register within the NVMe tier's capacity.
// - Thread safety: every method may be called from any thread. Completions of the NVMe tier run
//   on its threads and take the manager's lock; the manager never calls the tier while holding it.
// - Destruction waits for in-flight I/O, then frees the NVMe regions. No block may be pinned.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "runtime/base/config.h"
#include "runtime/base/mutex.h"
#include "runtime/base/status.h"
#include "runtime/state/partitioner.h"
#include "tiers/host/pinned_pool.h"
#include "tiers/tier.h"

namespace strata {

namespace nvme {
class NvmeTier;
}

// StateKind and StateKindName come from runtime/state/partitioner.h: one vocabulary for every layer.

struct BlockId {
  uint32_t chunk = 0;
  StateKind kind = StateKind::kParam16;
  uint64_t key() const { return (static_cast<uint64_t>(chunk) << 8) | static_cast<uint64_t>(kind); }
  friend bool operator==(BlockId a, BlockId b) { return a.key() == b.key(); }
  friend bool operator!=(BlockId a, BlockId b) { return a.key() != b.key(); }
  friend bool operator<(BlockId a, BlockId b) { return a.key() < b.key(); }
};
std::string ToString(BlockId id);  // "chunk 3 master32"

enum class Access { kRead, kWrite, kReadWrite };
enum class BlockHome { kHostOnly, kNvme };
enum class HostResidency { kAbsent, kReading, kClean, kDirty, kWriting };
enum class NvmeResidency { kAbsent, kWriting, kResident };
std::string_view HostResidencyName(HostResidency r);
std::string_view NvmeResidencyName(NvmeResidency r);

// A snapshot of one block, for diagnostics and tests.
struct BlockInfo {
  BlockId id;
  uint64_t bytes = 0;
  BlockHome home = BlockHome::kNvme;
  HostResidency host = HostResidency::kAbsent;
  NvmeResidency nvme = NvmeResidency::kAbsent;
  int pins = 0;
  int write_pins = 0;
  TierRegion nvme_region;  // valid for kNvme blocks
};

struct TierManagerOptions {
  uint64_t host_budget = 0;  // bytes of the pinned pool (strata.host_memory_budget); > 0
  EvictionPolicy eviction = EvictionPolicy::kNextUse;
  int64_t prefetch_lookahead = 4;  // trace entries read ahead of use; 0 disables prefetch
  // 0: Acquire waits for room as long as it takes; otherwise DEADLINE_EXCEEDED after this long.
  std::chrono::milliseconds acquire_timeout{0};
  PinnedPoolOptions pool;  // its budget is replaced by host_budget
  // Bytes of host_budget set apart for host-only blocks at their exact size (the sum of
  // PoolResidentBytes over them: StepPlan::host_only_bytes); host-only blocks that do not fit
  // there take a class of the buddy arena. 0: every block takes a class.
  uint64_t resident_bytes = 0;

  // host_budget, eviction and prefetch_lookahead from the config; `resolved_host_budget` is used
  // when the config says 0 (the caller decides what "half of physical memory" is).
  static TierManagerOptions FromConfig(const StrataConfig& config, uint64_t resolved_host_budget);
};

struct TierManagerStats {
  // Tier pairs. SUM: bytes; COUNT: transfers completed OK.
  uint64_t bytes_nvme_to_host = 0;
  uint64_t bytes_host_to_nvme = 0;
  uint64_t reads_nvme_to_host = 0;
  uint64_t writes_host_to_nvme = 0;
  uint64_t bytes_zero_filled = 0;  // SUM: bytes materialized as zeros (never-written blocks)
  // Host tier. COUNT per Acquire: hit = resident (clean, dirty or writing) on arrival;
  // inflight = its read was already in flight (a late prefetch); miss = absent.
  uint64_t host_hits = 0;
  uint64_t host_inflight_hits = 0;
  uint64_t host_misses = 0;
  // NVMe tier. COUNT: misses that NVMe served (hits) vs. never-written blocks (misses).
  uint64_t nvme_hits = 0;
  uint64_t nvme_misses = 0;
  // Eviction and prefetch. COUNT.
  uint64_t evictions_clean = 0;       // dropped without writing
  uint64_t evictions_dirty = 0;       // written back, then dropped
  uint64_t prefetches_issued = 0;
  uint64_t prefetches_used = 0;       // acquired after (or while) being prefetched
  uint64_t prefetches_wasted = 0;     // dropped before any Acquire
  uint64_t read_errors = 0;
  uint64_t write_errors = 0;
  // Stalls. SUM: seconds Acquire and Flush callers spent waiting; COUNT: waits.
  double stall_seconds = 0;
  uint64_t stalls = 0;
  // Residency. GAUGE / MAX: pool bytes held by blocks (an arena block's class, a resident block's
  // PoolResidentBytes; in flight included), and bytes of valid NVMe copies.
  uint64_t host_bytes_resident = 0;
  uint64_t peak_host_bytes_resident = 0;
  uint64_t nvme_bytes_resident = 0;
  uint64_t peak_nvme_bytes_resident = 0;
  uint64_t host_budget = 0;      // bytes (the pool's arena and resident region)
  uint64_t nvme_capacity = 0;    // bytes (the NVMe tier's capacity; 0 without one)
  uint64_t nvme_bytes_reserved = 0;  // GAUGE: bytes of NVMe regions reserved by Register
  // Trace.
  uint64_t iterations = 0;        // COUNT: BeginIteration calls
  uint64_t trace_length = 0;      // entries recorded in the first iteration
  uint64_t trace_deviations = 0;  // COUNT: Acquires that did not match the trace
  uint64_t acquires = 0;          // COUNT

  // hits / acquires of NVMe-backed blocks (0 when there were none).
  double host_hit_rate() const;
};

class TierManager {
 public:
  // `nvme` may be null (then only kHostOnly blocks can be registered); it must outlive the
  // manager. Fails on bad options (naming them) or when the pool cannot be reserved.
  static StatusOr<std::unique_ptr<TierManager>> Create(const TierManagerOptions& options, Tier* nvme);
  ~TierManager();

  TierManager(const TierManager&) = delete;
  TierManager& operator=(const TierManager&) = delete;

  // Registers the pool's arena with the NVMe engine so transfers use fixed buffers (no bounce
  // copy, no per-request page pinning). Call before any I/O; a failure leaves I/O working without
  // registration and is returned for the caller to log.
  Status RegisterHostPoolWith(nvme::NvmeTier& tier) EXCLUDES(mu_);

  Status Register(BlockId id, uint64_t bytes, BlockHome home) EXCLUDES(mu_);
  // Forgets a block: frees its host copy and NVMe region. FAILED_PRECONDITION while pinned or in
  // flight.
  Status Unregister(BlockId id) EXCLUDES(mu_);

  StatusOr<void*> Acquire(BlockId id, Access access) EXCLUDES(mu_);
  Status Release(BlockId id, bool dirty) EXCLUDES(mu_);
  void Prefetch(BlockId id) EXCLUDES(mu_);

  Status BeginIteration() EXCLUDES(mu_);
  Status EndIteration() EXCLUDES(mu_);

  Status Flush() EXCLUDES(mu_);

  StatusOr<BlockInfo> Query(BlockId id) const EXCLUDES(mu_);
  TierManagerStats stats() const EXCLUDES(mu_);
  nlohmann::json StatsJson() const EXCLUDES(mu_);
  const PinnedPool& host_pool() const { return *pool_; }

 private:
  struct Block;
  struct IoAction;

  TierManager(const TierManagerOptions& options, Tier* nvme);

  // One thread's replay position in the trace (Note [lanes in the trace]).
  struct TraceLane {
    std::vector<uint64_t> positions;  // trace positions this lane recorded, ascending
    uint64_t next = 0;                // index into positions of the lane's next expected access
  };

  Block* Find(BlockId id) const REQUIRES(mu_);
  void RecordUse(Block* b) REQUIRES(mu_);
  // The calling thread's lane; while recording, a thread new to the trace gets one. -1 when the
  // thread recorded nothing.
  int LaneOfThisThread() REQUIRES(mu_);
  // Matches `b` against lane `lane`'s next `horizon` entries; advances the lane on a match.
  bool MatchInLane(size_t lane, const Block* b, uint64_t horizon) REQUIRES(mu_);
  // Where the lane stands in the trace: the earlier of its next expected access and frontier_
  // (Note [lanes in the trace]); >= the trace's length once the lane and the frontier are in
  // the next iteration, and always below twice that length. The lane has entries.
  uint64_t LanePosition(size_t lane) const REQUIRES(mu_);
  static constexpr size_t kMaxTraceLanes = 64;  // threads beyond this share the last lane
  using LaneArray = std::array<uint64_t, kMaxTraceLanes>;
  // (*at)[l] = lane l's position reduced below the trace's length, for each lane with entries.
  void LaneStarts(LaneArray* at) const REQUIRES(mu_);
  void ResetLanes(bool to_next_iteration) REQUIRES(mu_);
  // Trace entries until `b` is next used (by whichever lane uses it first, each use counted
  // from its lane's position, as LaneStarts gives them), or kNever.
  uint64_t NextUseFrom(const Block* b, const LaneArray& at) const REQUIRES(mu_);
  uint64_t NextUse(const Block* b) const REQUIRES(mu_);
  // The unpinned resident NVMe-backed block to evict next, or null. With `before` set, only
  // blocks whose next use is further away than `before` (a NextUse distance) qualify, and never
  // one inside the prefetch window.
  // Scans host_copies_ only: a pick is O(host copies), not O(registered blocks).
  Block* PickVictim(const uint64_t* before) const REQUIRES(mu_);
  // Keep host_copies_ equal to the NVMe-backed blocks whose host residency is not absent: List
  // when one leaves absent, Unlist when it returns there or is unregistered (both idempotent).
  void List(Block* b) REQUIRES(mu_);
  void Unlist(Block* b) REQUIRES(mu_);
  void Drop(Block* b) REQUIRES(mu_);
  void StartWriteBack(Block* b, bool evict, std::vector<IoAction>* io) REQUIRES(mu_);
  void StartRead(Block* b, const PinnedBlock& mem, bool prefetch, std::vector<IoAction>* io) REQUIRES(mu_);
  // Gets pool memory for `bytes`, evicting and waiting as needed. Releases mu_ while it waits.
  StatusOr<PinnedBlock> MakeRoom(uint64_t bytes, const std::string& for_what,
                                 std::chrono::steady_clock::time_point deadline) REQUIRES(mu_);
  // Tries to make room without waiting for a prefetch of `b` needed `pos` entries from now.
  bool TryPrefetch(Block* b, uint64_t pos, std::vector<IoAction>* io) REQUIRES(mu_);
  // Advances automatic prefetch from the trace.
  void Pump(std::vector<IoAction>* io) REQUIRES(mu_);
  void Issue(std::vector<IoAction>& io) EXCLUDES(mu_);
  void OnReadDone(Block* b, uint64_t gen, const Status& s) EXCLUDES(mu_);
  void OnWriteDone(Block* b, uint64_t gen, const Status& s) EXCLUDES(mu_);
  // Waits for a change (cv_) until `deadline`, counted as a stall; sets *timed_out past it.
  void Wait(std::chrono::steady_clock::time_point deadline, bool* timed_out) REQUIRES(mu_);
  void NoteHostBytes() REQUIRES(mu_);
  // Bytes of the pool's buddy arena held by blocks (the resident region's are not in it).
  uint64_t ArenaBytesInUse() const REQUIRES(mu_) { return stats_.host_bytes_resident - resident_region_bytes_; }
  std::string PinnedSummary() const REQUIRES(mu_);

  const TierManagerOptions options_;
  Tier* const nvme_;
  std::unique_ptr<PinnedPool> pool_;

  mutable Mutex mu_;
  CondVar cv_;  // any block state change, pin release or completion
  std::unordered_map<uint64_t, std::unique_ptr<Block>> blocks_ GUARDED_BY(mu_);
  // The NVMe-backed blocks with a host copy (reading, clean, dirty or writing), in no order:
  // the only ones PickVictim can choose. Block::listed is each one's index here.
  std::vector<Block*> host_copies_ GUARDED_BY(mu_);
  uint64_t host_only_class_bytes_ GUARDED_BY(mu_) = 0;  // host-only blocks in the buddy arena
  uint64_t resident_region_bytes_ GUARDED_BY(mu_) = 0;  // host-only blocks in the resident region
  uint64_t largest_nvme_class_ GUARDED_BY(mu_) = 0;
  uint64_t inflight_ GUARDED_BY(mu_) = 0;           // I/O issued or about to be
  uint64_t reclaiming_bytes_ GUARDED_BY(mu_) = 0;   // class bytes of write-backs that evict
  int space_waiters_ GUARDED_BY(mu_) = 0;
  uint64_t writes_inflight_ GUARDED_BY(mu_) = 0;    // write-backs issued, not completed
  uint64_t write_error_gen_ GUARDED_BY(mu_) = 0;    // bumps on every failed write-back
  Status last_write_error_ GUARDED_BY(mu_);
  uint64_t tick_ GUARDED_BY(mu_) = 0;               // LRU clock
  // Trace (see BeginIteration).
  bool in_iteration_ GUARDED_BY(mu_) = false;
  bool recording_ GUARDED_BY(mu_) = false;
  bool trace_ready_ GUARDED_BY(mu_) = false;
  std::vector<Block*> trace_ GUARDED_BY(mu_);
  std::vector<uint16_t> trace_lane_ GUARDED_BY(mu_);  // the lane of each trace entry
  std::vector<TraceLane> lanes_ GUARDED_BY(mu_);
  std::unordered_map<std::thread::id, uint16_t> thread_lane_ GUARDED_BY(mu_);
  // One past the furthest trace position any lane matched this iteration; the trace's length
  // once the iteration has ended.
  uint64_t frontier_ GUARDED_BY(mu_) = 0;
  TierManagerStats stats_ GUARDED_BY(mu_);
};

}  // namespace strata
