// SwapStore: blocks (chunk shards of any state) kept in preallocated per-rank swap files.
//
// Layout. One file per nvme path, `<path>/strata-rank<R>.swap`, preallocated with fallocate
// (Note [preallocation] in swap_store.cc: up to 64 MiB at open, grown by Allocate before any
// block reaches past it, never beyond the capacity). With several paths the files form one logical space striped RAID-0 style in units of
// aio.block_size: logical stripe s lives in file s % N at offset (s / N) × block_size, so one
// large block is read from every device at once. Blocks get 4 KiB-aligned logical extents from a
// first-fit allocator. The index (block key → extent, length, checksum) lives in memory and is
// persisted to `<paths[0]>/strata-rank<R>.index` by SaveIndex() and Close() (swap_index.h).
//
// Data safety (Note [swap durability] in swap_store.cc)
// - Every write carries a crc32c of the block (unless checksums are off); every read verifies it
//   and fails with DATA_LOSS naming the block and the file(s) instead of returning bad bytes.
// - A write completes OK only when every byte reached the file through O_DIRECT (or O_DSYNC on
//   the fallback); until then, and after a failed write, the block reads as "never written".
// - SaveIndex() fdatasyncs the swap files, then replaces the index atomically. Blocks written
//   after the last SaveIndex() are not known to a process that reopens the store.
// - ENOSPC, EIO, short files, missing directories and permission problems come back as Status
//   naming the path and what to do. The swap files are locked (flock) against a second process.
//
// Thread safety: every method may be called from any thread. I/O on one block must be serialized
// by the caller (one read or write at a time); I/O on different blocks runs concurrently.
// Completion callbacks run on engine threads and must not call Close() or destroy the store.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/base/config.h"
#include "runtime/base/mutex.h"
#include "runtime/base/status.h"
#include "tiers/nvme/io_engine.h"
#include "tiers/nvme/swap_index.h"

namespace strata::nvme {

enum class SwapOpenMode {
  kCreate,        // start empty: an existing index for this rank is discarded
  kOpenExisting,  // the index must exist (NOT_FOUND otherwise) and is validated
  kOpenOrCreate,  // reopen when an index exists, else start empty
};

struct SwapStoreOptions {
  std::vector<std::string> paths;  // directories; several are striped
  uint32_t rank = 0;
  // Bytes across all paths, rounded up to block_size × paths; 0 takes what the file systems
  // have free at open (strata.nvme_capacity=0). Ignored on reopen: the index's capacity wins.
  uint64_t capacity = 0;
  // Bytes the caller will certainly write (the engine's NVMe-placed state for this rank); 0: not
  // known. A store that starts empty is refused up front (RESOURCE_EXHAUSTED, naming the path,
  // its free space and the need) when a path cannot hold its stripe share of these bytes, rather
  // than failing an Allocate hours into a run. Paths on one file system are checked together,
  // against the sum of their shares. A swap file the store will truncate counts as free. Ranks
  // that share a file system each check only their own share.
  uint64_t needed_bytes = 0;
  // File systems (by st_dev) where the caller gives space back while it writes those bytes (the
  // engine's start punches zero::Init's staging file as it reads it): the most the disk's use
  // grows by there at any point, for every path on it, checked instead of their shares' sum when
  // it is below that sum. `needed_free_why` says where the rest comes from, in the refusal.
  std::map<uint64_t, uint64_t> needed_free_on_device;
  std::string needed_free_why;
  // How the caller's state could shrink, offered by the refusal (the engine's
  // StepPlan::ShrinkHint for its layout); empty: none is named.
  std::string shrink_hint;
  AioConfig aio;
  ChecksumKind checksums = ChecksumKind::kCrc32c;  // ignored on reopen: the index's kind wins
  SwapOpenMode mode = SwapOpenMode::kCreate;
  // A scratch store, whose contents nobody reopens (the engine's: it always starts empty and
  // keeps its state in checkpoints): Close writes no index and removes the swap files, so a
  // finished run leaves nothing on the disk. After a crash the files stay, and the next kCreate
  // store on the same paths takes them over.
  bool remove_on_close = false;
  bool force_fallback = false;     // pread/pwrite engine even where io_uring works (tests)
  IoFaultHook fault_hook;          // test-only, see io_engine.h
  IoSubmitFaultHook submit_fault_hook;  // test-only, see io_engine.h
  // Test-only: replaces open(2) for the swap files (returns an fd, or -1 with errno set), so a
  // file system that refuses O_DIRECT can be simulated on one that accepts it.
  std::function<int(const std::string& path, int flags, mode_t mode)> open_file;
};

// Where a block's bytes are: one entry per file extent, in block order.
struct SwapExtent {
  std::string path;
  uint64_t file_offset = 0;
  uint64_t length = 0;
};

struct SwapStoreStats {
  std::string engine;           // "io_uring" or "fallback"
  std::string fallback_reason;  // empty with io_uring
  bool direct_io = false;       // files opened with O_DIRECT
  IoEngineStats io;
  uint64_t blocks = 0;          // GAUGE: allocated blocks
  uint64_t bytes_allocated = 0; // GAUGE: bytes of logical space held by blocks (4 KiB-rounded)
  uint64_t capacity = 0;        // bytes of logical space
  uint64_t checksum_failures = 0;  // COUNT: reads that failed verification
};

class SwapStore {
 public:
  static StatusOr<std::unique_ptr<SwapStore>> Open(const SwapStoreOptions& options);
  // Closes (see Close) and logs a failure, which it cannot return.
  ~SwapStore();

  // Drains I/O, saves the index (or, with remove_on_close, removes the files and the index),
  // closes and unlocks the files. Idempotent; after it every other call fails with
  // FAILED_PRECONDITION.
  Status Close();

  // Reserves space for a block of `bytes` under the caller's `key`. ALREADY_EXISTS for a used
  // key, RESOURCE_EXHAUSTED when no free extent is large enough.
  Status Allocate(uint64_t key, uint64_t bytes);
  Status Free(uint64_t key);

  // Transfer the whole block (its allocated length). Buffers need not be aligned (unaligned ones
  // go through a bounce buffer; 4 KiB-aligned ones are used directly) and must stay valid until
  // `done` runs. Buffers backed by huge pages (the pinned pool's) are markedly faster: a 1 MiB
  // transfer from 4 KiB pages has 256 segments, more than a virtio disk takes in one request
  // (see Note [bench buffers] in tools/swapbench/nvme_cmd.cc).
  void WriteAsync(uint64_t key, const void* src, IoDone done);
  void ReadAsync(uint64_t key, void* dst, IoDone done);
  Status Write(uint64_t key, const void* src);
  Status Read(uint64_t key, void* dst);

  // Makes every completed write durable and persists the index atomically.
  Status SaveIndex();

  // Registers caller-owned buffers (the pinned pool) for fixed-buffer I/O; call with no I/O in
  // flight. A failure leaves I/O working without them.
  Status RegisterBuffers(const std::vector<iovec>& ranges);

  StatusOr<SwapBlockRecord> Lookup(uint64_t key) const;
  StatusOr<std::vector<SwapExtent>> Locate(uint64_t key) const;
  std::vector<uint64_t> Keys() const;
  SwapStoreStats stats() const;
  uint64_t capacity() const { return capacity_; }
  const std::string& index_path() const { return index_path_; }

 private:
  struct File {
    int fd = -1;
    std::string path;
    uint64_t size = 0;  // bytes preallocated (GUARDED_BY(mu_) after Open)
  };
  struct Block {
    uint64_t offset = 0;
    uint64_t length = 0;
    uint32_t crc = 0;
    bool written = false;
  };
  struct Segment {
    int file;
    uint64_t file_offset;
    uint64_t logical;  // offset within the block
    uint64_t length;
  };
  struct Op;

  SwapStore() = default;
  Status OpenFiles(const SwapStoreOptions& options, bool create, uint64_t per_file);
  // The I/O engine over the opened files (O_DIRECT unless a path refused it).
  Status StartEngine(const SwapStoreOptions& options);
  Status LoadIndex(const SwapIndex& index) EXCLUDES(mu_);
  Status Preallocate(uint64_t wanted, uint64_t needed);  // per file; Note [preallocation]
  uint64_t PerFileBytesFor(uint64_t logical_end) const;
  std::vector<Segment> MapExtent(uint64_t logical, uint64_t length) const;
  std::string FilesOf(const std::vector<Segment>& segs) const;
  void Issue(IoOp op, uint64_t key, const Block& block, char* buf, std::shared_ptr<Op> state);
  void FinishRead(const std::shared_ptr<Op>& op);
  void FinishWrite(const std::shared_ptr<Op>& op);
  Status SaveIndexLocked() REQUIRES(mu_);

  std::vector<File> files_;
  std::string index_path_;
  uint32_t rank_ = 0;
  uint64_t stripe_unit_ = 0;
  uint64_t capacity_ = 0;
  ChecksumKind checksums_ = ChecksumKind::kCrc32c;
  bool direct_ = false;
  bool opened_ = false;  // Open() completed; only then may Close() write the index
  bool remove_on_close_ = false;  // SwapStoreOptions::remove_on_close
  std::unique_ptr<IoEngine> engine_;  // reset by Close() under mu_
  std::atomic<uint64_t> checksum_failures_{0};

  mutable Mutex mu_;
  bool closed_ GUARDED_BY(mu_) = false;
  std::unordered_map<uint64_t, Block> blocks_ GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> free_ GUARDED_BY(mu_);  // offset → length, coalesced
  uint64_t bytes_allocated_ GUARDED_BY(mu_) = 0;
  // What stats() reports once Close() has destroyed the engine.
  std::string engine_name_ GUARDED_BY(mu_), fallback_reason_ GUARDED_BY(mu_);
  IoEngineStats closed_io_ GUARDED_BY(mu_);
};

}  // namespace strata::nvme
