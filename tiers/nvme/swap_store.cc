#include "tiers/nvme/swap_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <set>

#include "runtime/base/check.h"
#include "runtime/base/host_info.h"
#include "runtime/base/logging.h"
#include "runtime/base/units.h"
#include "tiers/nvme/crc32c.h"

namespace strata::nvme {

// Note [swap durability]
// O_DIRECT completions mean the bytes left the page cache for the device, but the file system
// may still hold the metadata that makes them reachable (fallocate leaves "unwritten" extents
// that the first write converts) and the device may hold them in a volatile cache. So a write is
// reported complete when its bytes are in the file, and SaveIndex() -- the only point from which
// another process can find a block -- fdatasyncs every swap file before it replaces the index.
// Where O_DIRECT is refused (tmpfs), files are opened O_DSYNC so that a completed pwrite is
// equally complete.

namespace {

struct FreeDeleter {
  void operator()(char* p) const { std::free(p); }
};
using AlignedBuf = std::unique_ptr<char, FreeDeleter>;

AlignedBuf AllocAligned(uint64_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kSwapAlignment, std::max<uint64_t>(bytes, kSwapAlignment)) != 0) return nullptr;
  return AlignedBuf(static_cast<char*>(p));
}

uint64_t RoundUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

constexpr uint64_t kInitialPreallocation = 64ull << 20;  // per file; Note [preallocation]

std::string SwapFileName(const std::string& dir, uint32_t rank) {
  return StrCat(dir, dir.empty() || dir.back() == '/' ? "" : "/", "strata-rank", rank, ".swap");
}

Status CheckDirectory(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    int err = errno;
    if (err == ENOENT)
      return NotFound(StrCat("nvme path ", dir, " does not exist: create it (mkdir -p ", dir,
                             ") or set nvme_path to an existing directory on the NVMe device"));
    return ErrnoToStatus(err, StrCat("nvme path ", dir));
  }
  if (!S_ISDIR(st.st_mode))
    return InvalidArgument(StrCat("nvme path ", dir, " is not a directory: nvme_path must name "
                                  "directories in which swap files can be created"));
  return Status::Ok();
}

}  // namespace

struct SwapStore::Op {
  IoOp op;
  uint64_t key = 0;
  uint64_t length = 0;   // block bytes
  uint64_t body = 0;     // bytes moved straight from/to the user's buffer
  char* user = nullptr;
  AlignedBuf bounce;     // whole block, when the user's buffer is not aligned
  AlignedBuf tail;       // the last partial 4 KiB, when it is
  uint32_t crc = 0;      // write: computed before; read: expected
  bool verify = false;
  std::string files;     // for messages
  IoDone done;
  std::atomic<int> left{0};
  Mutex mu;
  Status first_error GUARDED_BY(mu);
};

namespace {

// Open's phases, in order: the paths and aio settings checked; the index read back (none for a
// new store; kCreate removes an old one); the free space a new store needs checked; an index
// checked against the paths and block size given now; the capacity chosen.
Status CheckPaths(const SwapStoreOptions& options) {
  STRATA_CHECK(!options.paths.empty(),
               "no nvme path given: set offload_param.nvme_path / offload_optimizer.nvme_path to "
               "one or more directories on NVMe devices");
  STRATA_CHECK(options.paths.size() <= 64, "nvme_path has ", options.paths.size(),
               " directories: at most 64 can be striped");
  STRATA_RETURN_IF_ERROR(ValidateAioConfig(options.aio));
  // By the directory itself: "/nvme", "/nvme/", "x/../nvme" and a symlink to it are one, and
  // its files would collide (each path gets the same rank's file name).
  std::map<std::pair<dev_t, ino_t>, std::string> seen;
  for (const auto& p : options.paths) {
    STRATA_RETURN_IF_ERROR(CheckDirectory(p));
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) return ErrnoToStatus(errno, StrCat("stat nvme path ", p));
    const auto [it, fresh] = seen.emplace(std::make_pair(st.st_dev, st.st_ino), p);
    STRATA_CHECK(fresh, "nvme path ", p,
                 (it->second == p ? " is listed twice"
                                  : StrCat(" is the directory ", it->second, " names too")),
                 ": each striped directory must be distinct");
  }
  return Status::Ok();
}

StatusOr<std::optional<SwapIndex>> ReadIndex(const SwapStoreOptions& options,
                                             const std::string& index_path) {
  if (options.mode == SwapOpenMode::kCreate) {
    if (unlink(index_path.c_str()) != 0 && errno != ENOENT)
      return ErrnoToStatus(errno, StrCat("removing the old swap index ", index_path));
    return std::optional<SwapIndex>();
  }
  auto bytes = ReadWholeFile(index_path);
  if (bytes.ok()) {
    STRATA_ASSIGN_OR_RETURN(SwapIndex parsed, ParseSwapIndex(*bytes, index_path));
    return std::optional<SwapIndex>(std::move(parsed));
  }
  if (bytes.status().code() != StatusCode::kNotFound || options.mode == SwapOpenMode::kOpenExisting) {
    return bytes.status().WithContext(
        options.mode == SwapOpenMode::kOpenExisting
            ? "reopening the swap store needs its index (was the store closed or SaveIndex()ed?)"
            : "reading the swap index");
  }
  return std::optional<SwapIndex>();
}

Status CheckFreeSpace(const SwapStoreOptions& options, uint64_t stripe_unit) {
  // Every path holds the same share of the striped space; the paths on one file system draw on
  // its free space together.
  const uint64_t n = options.paths.size();
  const uint64_t stripes = (options.needed_bytes + stripe_unit - 1) / stripe_unit;
  const uint64_t share = (stripes + n - 1) / n * stripe_unit;
  for (const FileSystemPaths& d : GroupByFileSystem(options.paths)) {
    struct statvfs vfs;
    if (!d.known) {
      struct stat st;
      const int err = stat(d.paths.front().c_str(), &st) == 0 ? ENOENT : errno;  // gone and back: say so
      return ErrnoToStatus(err, StrCat("stat ", d.paths.front()));
    }
    if (statvfs(d.paths.front().c_str(), &vfs) != 0) return ErrnoToStatus(errno, StrCat("statvfs ", d.paths.front()));
    uint64_t free_bytes = FreeDiskBytes(d.paths.front());  // a ramfs: the host's memory
    for (const auto& p : d.paths) {
      struct stat old_file;
      if (stat(SwapFileName(p, options.rank).c_str(), &old_file) == 0)
        free_bytes += static_cast<uint64_t>(old_file.st_blocks) * 512;  // truncated below
    }
    const uint64_t shares = share * d.paths.size();
    const auto credit = options.needed_free_on_device.find(d.device);
    const bool given_back = credit != options.needed_free_on_device.end() && credit->second < shares;
    const uint64_t need = given_back ? credit->second : shares;
    if (free_bytes >= need) continue;
    std::string where = StrCat("nvme path ", d.paths.front(), " has");
    if (d.paths.size() > 1) {
      where = "nvme paths ";
      for (size_t i = 0; i < d.paths.size(); ++i) where += StrCat(i ? ", " : "", d.paths[i]);
      where += " (one file system) have";
    }
    return ResourceExhausted(StrCat(
        where, " ", FormatBytes(free_bytes), " free but rank ", options.rank,
        "'s NVMe-placed state needs ", FormatBytes(need), " there (",
        d.paths.size() > 1 ? StrCat(d.paths.size(), " shares of ", FormatBytes(share), " of ")
                           : std::string(),
        FormatBytes(options.needed_bytes), " ",
        given_back ? StrCat("less ", FormatBytes(shares - need), " in space ",
                            options.needed_free_why, ", ")
                   : std::string(),
        "in whole aio.block_size stripes of ", FormatBytes(stripe_unit), " over ", n, " path",
        n > 1 ? "s" : "", "); free space there, add an nvme_path on another disk, ",
        options.shrink_hint.empty() ? std::string()
                                    : StrCat("shrink the state (", options.shrink_hint, "), "),
        "or offload less to nvme"));
  }
  return Status::Ok();
}

Status CheckIndexFits(const SwapIndex& index, const SwapStoreOptions& options,
                      const std::string& index_path, uint64_t stripe_unit) {
  std::vector<std::string> expected;
  for (const auto& p : options.paths) expected.push_back(SwapFileName(p, options.rank));
  if (index.files != expected || index.rank != options.rank)
    return FailedPrecondition(StrCat("swap index ", index_path, " describes rank ", index.rank,
                                     " with files [", index.files.front(), ", ...] (",
                                     index.files.size(), "), not the nvme paths given now; reopen "
                                     "with the same nvme_path list and rank"));
  if (index.stripe_unit != stripe_unit)
    return FailedPrecondition(StrCat("swap index ", index_path, " was written with aio.block_size=",
                                     index.stripe_unit, " (the stripe unit) but aio.block_size=",
                                     stripe_unit, " now; reopen with the same block size"));
  return Status::Ok();
}

// A new store's capacity: options.capacity rounded to whole stripes over every path, or with
// strata.nvme_capacity=0 what the file systems have free now (the smallest, times the number of
// paths, since every path holds the same share).
StatusOr<uint64_t> NewCapacity(const SwapStoreOptions& options, uint64_t stripe_unit) {
  const uint64_t n = options.paths.size();
  if (options.capacity > 0) return RoundUp(options.capacity, stripe_unit * n);
  uint64_t min_free = UINT64_MAX;
  for (const auto& p : options.paths) {
    struct statvfs vfs;
    if (statvfs(p.c_str(), &vfs) != 0) return ErrnoToStatus(errno, StrCat("statvfs ", p));
    min_free = std::min<uint64_t>(min_free, FreeDiskBytes(p));
  }
  const uint64_t capacity = min_free / stripe_unit * stripe_unit * n;
  if (capacity == 0)
    return ResourceExhausted(StrCat("nvme path ", options.paths[0], " has less than one aio.block_size (",
                                    stripe_unit, " bytes) free; free space or set another nvme_path"));
  return capacity;
}

}  // namespace

StatusOr<std::unique_ptr<SwapStore>> SwapStore::Open(const SwapStoreOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckPaths(options));
  std::unique_ptr<SwapStore> s(new SwapStore);
  s->rank_ = options.rank;
  s->stripe_unit_ = static_cast<uint64_t>(options.aio.block_size);
  s->checksums_ = options.checksums;
  const uint64_t n = options.paths.size();
  const std::string& first = options.paths[0];
  s->index_path_ = StrCat(first, first.back() == '/' ? "" : "/", "strata-rank", options.rank, ".index");
  s->remove_on_close_ = options.remove_on_close;

  STRATA_ASSIGN_OR_RETURN(std::optional<SwapIndex> index, ReadIndex(options, s->index_path_));
  if (index) {
    STRATA_RETURN_IF_ERROR(CheckIndexFits(*index, options, s->index_path_, s->stripe_unit_));
    s->capacity_ = index->capacity;
    s->checksums_ = index->checksums;
  } else {
    if (options.needed_bytes > 0) STRATA_RETURN_IF_ERROR(CheckFreeSpace(options, s->stripe_unit_));
    STRATA_ASSIGN_OR_RETURN(s->capacity_, NewCapacity(options, s->stripe_unit_));
  }
  STRATA_RETURN_IF_ERROR(s->OpenFiles(options, !index.has_value(), s->capacity_ / n));
  STRATA_RETURN_IF_ERROR(s->StartEngine(options));
  {
    MutexLock lock(&s->mu_);
    s->free_[0] = s->capacity_;
  }
  if (index) STRATA_RETURN_IF_ERROR(s->LoadIndex(*index));
  s->opened_ = true;
  size_t blocks;
  {
    MutexLock lock(&s->mu_);
    blocks = s->blocks_.size();
  }
  STRATA_LOG(INFO) << "nvme swap store rank=" << s->rank_ << " paths=" << n
                   << " capacity=" << s->capacity_ << " stripe_unit=" << s->stripe_unit_
                   << " engine=" << s->engine_->name() << " direct_io=" << s->direct_
                   << " blocks=" << blocks;
  return s;
}

Status SwapStore::StartEngine(const SwapStoreOptions& options) {
  IoEngineOptions eo;
  eo.aio = options.aio;
  eo.fault_hook = options.fault_hook;
  eo.submit_fault_hook = options.submit_fault_hook;
  eo.force_fallback = options.force_fallback || !direct_;
  if (!direct_) {
    eo.fallback_reason = "a swap directory does not support O_DIRECT (tmpfs?); buffered I/O with O_DSYNC";
  } else if (options.force_fallback) {
    eo.fallback_reason = "forced by option";
  }
  STRATA_ASSIGN_OR_RETURN(engine_, IoEngine::Create(eo));
  std::vector<IoFile> io_files;
  for (const auto& f : files_) io_files.push_back({f.fd, f.path});
  return engine_->SetFiles(std::move(io_files));
}

namespace {

// An exclusive lock on the swap file `fd`. A process that died holding it releases it only when
// the kernel tears down its io_uring (registered files keep the file open), which happens
// asynchronously after exit. A restart right after a crash must not fail on that: this waits up
// to 3 s for the lock.
Status LockSwapFile(int fd, const std::string& path) {
  int lock_rc = -1;
  for (int attempt = 0; attempt < 150; ++attempt) {
    lock_rc = flock(fd, LOCK_EX | LOCK_NB);
    if (lock_rc == 0 || errno != EWOULDBLOCK) break;
    usleep(20000);
  }
  if (lock_rc == 0) return Status::Ok();
  const int err = errno;
  if (err == EWOULDBLOCK)
    return FailedPrecondition(StrCat("swap file ", path,
                                     " is in use (locked by another engine or "
                                     "process); give each rank and job its own rank or path"));
  return ErrnoToStatus(err, StrCat("locking swap file ", path));
}

}  // namespace

Status SwapStore::OpenFiles(const SwapStoreOptions& options, bool create, uint64_t per_file) {
  bool all_direct = true;
  for (const auto& dir : options.paths) {
    File f;
    f.path = SwapFileName(dir, options.rank);
    int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0);
    auto do_open = [&](int fl) {
      return options.open_file ? options.open_file(f.path, fl, 0600) : open(f.path.c_str(), fl, 0600);
    };
    // Note [removed while locking]: a file whose last name went while this waited for its lock
    // is opened again by name.
    for (int opened = 1;; ++opened) {
      f.fd = do_open(flags | O_DIRECT);
      if (f.fd < 0 && errno == EINVAL) {
        // The file system refuses O_DIRECT (tmpfs before Linux 6.6): Note [swap durability].
        all_direct = false;
        f.fd = do_open(flags | O_DSYNC);
      }
      if (f.fd < 0) {
        int err = errno;
        if (err == ENOENT && !create)
          return NotFound(StrCat("swap file ", f.path, " named by index ", index_path_,
                                 " is missing; the swap store cannot be reopened (delete the index "
                                 "to start empty)"));
        return ErrnoToStatus(err, StrCat(create ? "creating" : "opening", " swap file ", f.path));
      }
      files_.push_back(f);  // closed by the destructor from here on
      STRATA_RETURN_IF_ERROR(LockSwapFile(f.fd, f.path));
      struct stat st;
      if (fstat(f.fd, &st) != 0) return ErrnoToStatus(errno, StrCat("stat swap file ", f.path));
      if (st.st_nlink > 0) break;
      if (opened == 3)
        return Unavailable(StrCat("swap file ", f.path, " was removed each time it was locked (",
                                  opened, " times): another process keeps recreating and removing "
                                  "it; give each job its own path"));
      close(f.fd);
      files_.pop_back();
    }
    if (create) {
      if (ftruncate(f.fd, 0) != 0) return ErrnoToStatus(errno, StrCat("truncating swap file ", f.path));
      files_.back().size = 0;
    } else {
      struct stat st;
      if (fstat(f.fd, &st) != 0) return ErrnoToStatus(errno, StrCat("stat swap file ", f.path));
      files_.back().size = static_cast<uint64_t>(st.st_size) / stripe_unit_ * stripe_unit_;
    }
  }
  direct_ = all_direct;
  if (create) {
    uint64_t initial = std::min(per_file, kInitialPreallocation);
    // Space the caller gives back comes later: the first preallocation takes no more than the
    // growth it asked to have free now, on any file system where it asked (each path's part).
    for (const auto& [dev, bytes] : options.needed_free_on_device)
      initial = std::min(initial, RoundUp((bytes + options.paths.size() - 1) / options.paths.size(), stripe_unit_));
    STRATA_RETURN_IF_ERROR(Preallocate(initial, initial));
  }
  return Status::Ok();
}

// Note [removed while locking]
// A scratch store (remove_on_close) unlinks its files while it still holds their locks, so that
// no store that locks one afterwards finds it about to lose its name. A store opening the same
// path meanwhile may hold a descriptor of the old file, and get its lock once the closing store
// lets go: it would then run on a file with no name, which nobody else can see or lock, while a
// third store made a fresh one under the path. So a locked file with no links left is dropped
// and the path opened again (created again, for kCreate; for a reopen it is then missing).

// Note [preallocation]
// Swap files are preallocated with fallocate so that a write never meets ENOSPC and the
// extents are laid out once. The whole capacity is not reserved up front -- it may be "all the
// free space" (strata.nvme_capacity=0) or a generous cap -- but before any block is handed out
// its extent lies inside preallocated space: Open() reserves min(capacity, 64 MiB) per file and
// Allocate() grows the files (doubling, capped at capacity) when a block would reach past them.
// A file system that cannot hold the growth fails that Allocate with RESOURCE_EXHAUSTED.
Status SwapStore::Preallocate(uint64_t wanted, uint64_t needed) {
  for (auto& f : files_) {
    if (f.size >= needed) continue;
    uint64_t target = std::max(wanted, needed);
    int rc = fallocate(f.fd, 0, 0, static_cast<off_t>(target));
    if (rc != 0 && errno == ENOSPC && target > needed) {
      target = needed;  // the doubling did not fit; the block itself may
      rc = fallocate(f.fd, 0, 0, static_cast<off_t>(target));
    }
    if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) {
      STRATA_LOG_ONCE(WARN) << "nvme fallocate unsupported on " << f.path
                            << "; the swap file is sparse and writes may meet ENOSPC";
      rc = ftruncate(f.fd, static_cast<off_t>(target));
    }
    if (rc != 0)
      return ErrnoToStatus(errno, StrCat("preallocating ", FormatBytes(target), " for swap file ", f.path,
                                         " (lower strata.nvme_capacity or free space on that device)"));
    f.size = target;
  }
  return Status::Ok();
}

uint64_t SwapStore::PerFileBytesFor(uint64_t logical_end) const {
  const uint64_t n = files_.size();
  const uint64_t stripes = (logical_end + stripe_unit_ - 1) / stripe_unit_;
  return (stripes + n - 1) / n * stripe_unit_;
}

Status SwapStore::LoadIndex(const SwapIndex& index) {
  MutexLock lock(&mu_);
  for (const auto& b : index.blocks) {
    const uint64_t len = RoundUp(b.length, kSwapAlignment);
    auto it = free_.upper_bound(b.offset);
    STRATA_DCHECK(it != free_.begin(), "free map has no extent before ", b.offset);
    --it;
    const uint64_t fo = it->first, fl = it->second;
    if (b.offset + len > fo + fl)
      return DataLoss(StrCat("swap index ", index_path_, ": block ", b.key, " overlaps another block"));
    free_.erase(it);
    if (b.offset > fo) free_[fo] = b.offset - fo;
    if (fo + fl > b.offset + len) free_[b.offset + len] = fo + fl - (b.offset + len);
    blocks_[b.key] = Block{b.offset, b.length, b.crc, b.written};
    bytes_allocated_ += len;
    const uint64_t need = PerFileBytesFor(b.offset + len);
    for (const auto& f : files_) {
      if (f.size < need)
        return DataLoss(StrCat("swap file ", f.path, " is ", f.size, " bytes but block ", b.key, " of index ",
                               index_path_, " needs ", need, ": the file was truncated and its blocks "
                               "are lost; delete the index to start empty"));
    }
  }
  return Status::Ok();
}

SwapStore::~SwapStore() {
  Status s = Close();
  if (!s.ok()) STRATA_LOG(ERROR) << "closing nvme swap store: " << s;
}

Status SwapStore::Close() {
  {
    MutexLock lock(&mu_);
    if (closed_) return Status::Ok();
  }
  if (engine_) engine_->Drain();  // outside mu_: completions take it
  MutexLock lock(&mu_);
  Status result;
  // A store whose Open failed half-way must not overwrite the index it could not load. A
  // directory removed while the store was open (a temporary nvme_path cleaned up before the
  // engine) took the swap files with it: there is no index left to keep, which is no error.
  std::error_code gone;
  const auto dir = std::filesystem::path(index_path_).parent_path();
  if (opened_ && !dir.empty() && !std::filesystem::exists(dir, gone)) {
    STRATA_LOG(INFO) << "nvme swap store: " << dir.string() << " was removed; no index written";
  } else if (opened_ && !remove_on_close_) {
    result = SaveIndexLocked();
  }
  closed_ = true;
  if (engine_) {
    engine_name_ = std::string(engine_->name());
    fallback_reason_ = engine_->fallback_reason();
    closed_io_ = engine_->stats();
    // Drained above, so no callback is running and none can start: joining the engine's
    // threads under mu_ cannot deadlock, and stats() never sees a half-destroyed engine.
    engine_.reset();
  }
  // Removed while still locked: a store opening the same path waits on the lock, and must not
  // get it for a file whose name is about to go. Only a store that opened (and so locked) its
  // files removes them: one whose Open failed may have met another process's.
  if (opened_ && remove_on_close_) {
    for (const auto& f : files_)
      if (f.fd >= 0 && ::unlink(f.path.c_str()) != 0 && errno != ENOENT && result.ok())
        result = ErrnoToStatus(errno, StrCat("removing swap file ", f.path));
    if (::unlink(index_path_.c_str()) != 0 && errno != ENOENT && result.ok())
      result = ErrnoToStatus(errno, StrCat("removing swap index ", index_path_));
  }
  for (auto& f : files_) {
    // Unlock explicitly: io_uring tears a ring down asynchronously and its registered-file
    // references would keep the lock alive for a moment after close(), failing a prompt reopen.
    if (f.fd >= 0) flock(f.fd, LOCK_UN);
    if (f.fd >= 0 && close(f.fd) != 0 && result.ok())
      result = ErrnoToStatus(errno, StrCat("closing swap file ", f.path));
    f.fd = -1;
  }
  return result;
}

Status SwapStore::Allocate(uint64_t key, uint64_t bytes) {
  STRATA_CHECK(bytes > 0, "swap block ", key, ": cannot allocate 0 bytes");
  MutexLock lock(&mu_);
  if (closed_) return FailedPrecondition("swap store is closed");
  if (blocks_.count(key)) return Status(StatusCode::kAlreadyExists, StrCat("swap block ", key, " already exists"));
  const uint64_t len = RoundUp(bytes, kSwapAlignment);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < len) continue;
    const uint64_t off = it->first, rest = it->second - len;
    const uint64_t need = PerFileBytesFor(off + len);
    if (need > files_.front().size || need > files_.back().size) {
      const uint64_t per_file = capacity_ / files_.size();
      Status grown = Preallocate(std::min(per_file, std::max(need, 2 * files_.front().size)), need);
      if (!grown.ok()) return grown.WithContext(StrCat("allocating swap block ", key, " of ", FormatBytes(bytes)));
    }
    free_.erase(it);
    if (rest > 0) free_[off + len] = rest;
    blocks_[key] = Block{off, bytes, 0, false};
    bytes_allocated_ += len;
    return Status::Ok();
  }
  return ResourceExhausted(StrCat("swap store has no free extent of ", FormatBytes(len), " for block ",
                                  key, " (", FormatBytes(capacity_ - bytes_allocated_), " of ",
                                  FormatBytes(capacity_), " free); raise strata.nvme_capacity"));
}

Status SwapStore::Free(uint64_t key) {
  MutexLock lock(&mu_);
  if (closed_) return FailedPrecondition("swap store is closed");
  auto it = blocks_.find(key);
  if (it == blocks_.end()) return NotFound(StrCat("swap block ", key, " does not exist"));
  uint64_t off = it->second.offset, len = RoundUp(it->second.length, kSwapAlignment);
  blocks_.erase(it);
  bytes_allocated_ -= len;
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + len) {
    len += next->second;
    free_.erase(next);
  }
  auto prev = free_.lower_bound(off);
  if (prev != free_.begin()) {
    --prev;
    if (prev->first + prev->second == off) {
      prev->second += len;
      return Status::Ok();
    }
  }
  free_[off] = len;
  return Status::Ok();
}

std::vector<SwapStore::Segment> SwapStore::MapExtent(uint64_t logical, uint64_t length) const {
  std::vector<Segment> segs;
  const uint64_t n = files_.size(), su = stripe_unit_;
  uint64_t pos = 0;
  while (pos < length) {
    const uint64_t l = logical + pos;
    const uint64_t stripe = l / su;
    const uint64_t within = l % su;
    const int file = static_cast<int>(stripe % n);
    const uint64_t foff = (stripe / n) * su + within;
    const uint64_t len = std::min(su - within, length - pos);
    if (!segs.empty() && segs.back().file == file &&
        segs.back().file_offset + segs.back().length == foff) {
      segs.back().length += len;  // one path: the whole block is one contiguous request
    } else {
      segs.push_back(Segment{file, foff, pos, len});
    }
    pos += len;
  }
  return segs;
}

std::string SwapStore::FilesOf(const std::vector<Segment>& segs) const {
  std::set<int> used;
  for (const auto& s : segs) used.insert(s.file);
  std::string out;
  for (int f : used) out += (out.empty() ? "" : ", ") + files_[f].path;
  if (!segs.empty()) out += StrCat(" (first extent at file offset ", segs.front().file_offset, ")");
  return out;
}

void SwapStore::WriteAsync(uint64_t key, const void* src, IoDone done) {
  Block block;
  {
    MutexLock lock(&mu_);
    if (closed_) return done(FailedPrecondition(StrCat("write of swap block ", key, ": store is closed")));
    auto it = blocks_.find(key);
    if (it == blocks_.end()) return done(NotFound(StrCat("write of swap block ", key, ": no such block")));
    it->second.written = false;  // until this write completes
    block = it->second;
  }
  auto op = std::make_shared<Op>();
  op->op = IoOp::kWrite;
  op->key = key;
  op->length = block.length;
  op->done = std::move(done);
  op->user = static_cast<char*>(const_cast<void*>(src));
  if (checksums_ == ChecksumKind::kCrc32c) op->crc = Crc32c(src, block.length);
  const uint64_t rounded = RoundUp(block.length, kSwapAlignment);
  if (reinterpret_cast<uintptr_t>(src) % kSwapAlignment != 0) {
    op->bounce = AllocAligned(rounded);
    if (!op->bounce) return op->done(ResourceExhausted(StrCat("bounce buffer of ", rounded, " bytes")));
    std::memcpy(op->bounce.get(), src, block.length);
    std::memset(op->bounce.get() + block.length, 0, rounded - block.length);
    op->body = 0;
  } else {
    op->body = block.length / kSwapAlignment * kSwapAlignment;
    if (op->body < block.length) {
      op->tail = AllocAligned(kSwapAlignment);
      if (!op->tail) return op->done(ResourceExhausted("tail bounce buffer of 4096 bytes"));
      std::memset(op->tail.get(), 0, kSwapAlignment);
      std::memcpy(op->tail.get(), op->user + op->body, block.length - op->body);
    }
  }
  char* user = op->user;  // read before `op` is moved from
  Issue(IoOp::kWrite, key, block, user, std::move(op));
}

void SwapStore::ReadAsync(uint64_t key, void* dst, IoDone done) {
  Block block;
  {
    MutexLock lock(&mu_);
    if (closed_) return done(FailedPrecondition(StrCat("read of swap block ", key, ": store is closed")));
    auto it = blocks_.find(key);
    if (it == blocks_.end()) return done(NotFound(StrCat("read of swap block ", key, ": no such block")));
    if (!it->second.written)
      return done(FailedPrecondition(StrCat("read of swap block ", key, ": the block was allocated "
                                            "but never completely written")));
    block = it->second;
  }
  auto op = std::make_shared<Op>();
  op->op = IoOp::kRead;
  op->key = key;
  op->length = block.length;
  op->done = std::move(done);
  op->user = static_cast<char*>(dst);
  op->crc = block.crc;
  op->verify = checksums_ == ChecksumKind::kCrc32c;
  const uint64_t rounded = RoundUp(block.length, kSwapAlignment);
  if (reinterpret_cast<uintptr_t>(dst) % kSwapAlignment != 0) {
    op->bounce = AllocAligned(rounded);
    if (!op->bounce) return op->done(ResourceExhausted(StrCat("bounce buffer of ", rounded, " bytes")));
    op->body = 0;
  } else {
    op->body = block.length / kSwapAlignment * kSwapAlignment;
    if (op->body < block.length) {
      op->tail = AllocAligned(kSwapAlignment);
      if (!op->tail) return op->done(ResourceExhausted("tail bounce buffer of 4096 bytes"));
    }
  }
  char* user = op->user;  // read before `op` is moved from
  Issue(IoOp::kRead, key, block, user, std::move(op));
}

void SwapStore::Issue(IoOp kind, uint64_t key, const Block& block, char* user, std::shared_ptr<Op> op) {
  const uint64_t rounded = RoundUp(block.length, kSwapAlignment);
  std::vector<Segment> segs = MapExtent(block.offset, rounded);
  op->files = FilesOf(segs);
  // Split segments where the source switches from the user's buffer to the tail bounce.
  struct Piece {
    int file;
    uint64_t foff;
    char* buf;
    uint64_t len;
  };
  std::vector<Piece> pieces;
  for (const auto& s : segs) {
    uint64_t pos = s.logical, end = s.logical + s.length;
    while (pos < end) {
      char* buf;
      uint64_t len;
      if (op->bounce) {
        buf = op->bounce.get() + pos;
        len = end - pos;
      } else if (pos < op->body) {
        buf = user + pos;
        len = std::min(end, op->body) - pos;
      } else {
        buf = op->tail.get() + (pos - op->body);
        len = end - pos;
      }
      pieces.push_back(Piece{s.file, s.file_offset + (pos - s.logical), buf, len});
      pos += len;
    }
  }
  op->left.store(static_cast<int>(pieces.size()));
  (void)key;
  for (const auto& p : pieces) {
    IoRequest r;
    r.op = kind;
    r.file = p.file;
    r.buf = p.buf;
    r.length = p.len;
    r.offset = p.foff;
    r.done = [this, op](Status s) {
      if (!s.ok()) {
        MutexLock lock(&op->mu);
        if (op->first_error.ok()) op->first_error = std::move(s);
      }
      if (op->left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      if (op->op == IoOp::kRead) {
        FinishRead(op);
      } else {
        FinishWrite(op);
      }
    };
    engine_->Submit(std::move(r));
  }
}

void SwapStore::FinishWrite(const std::shared_ptr<Op>& op) {
  Status s;
  {
    MutexLock lock(&op->mu);
    s = std::move(op->first_error);
  }
  if (s.ok()) {
    MutexLock lock(&mu_);
    auto it = blocks_.find(op->key);
    if (it != blocks_.end()) {
      it->second.crc = op->crc;
      it->second.written = true;
    }
  } else {
    s = s.WithContext(StrCat("writing swap block ", op->key, " (", op->length, " bytes) to ", op->files));
  }
  IoDone done = std::move(op->done);
  op->bounce.reset();
  op->tail.reset();
  done(std::move(s));
}

void SwapStore::FinishRead(const std::shared_ptr<Op>& op) {
  Status s;
  {
    MutexLock lock(&op->mu);
    s = std::move(op->first_error);
  }
  if (s.ok()) {
    if (op->bounce) {
      std::memcpy(op->user, op->bounce.get(), op->length);
    } else if (op->tail) {
      std::memcpy(op->user + op->body, op->tail.get(), op->length - op->body);
    }
    if (op->verify) {
      const uint32_t got = Crc32c(op->user, op->length);
      if (got != op->crc) {
        checksum_failures_.fetch_add(1, std::memory_order_relaxed);
        s = DataLoss(StrCat("swap block ", op->key, " (", op->length, " bytes) in ", op->files,
                            " failed its crc32c check (stored 0x", std::hex, op->crc, ", read 0x", got,
                            std::dec, "): the swap file is corrupted on disk and the block's contents "
                            "are lost; restore from the last checkpoint and check the device"));
      }
    }
  } else {
    s = s.WithContext(StrCat("reading swap block ", op->key, " (", op->length, " bytes) from ", op->files));
  }
  IoDone done = std::move(op->done);
  op->bounce.reset();
  op->tail.reset();
  done(std::move(s));
}

Status SwapStore::Write(uint64_t key, const void* src) {
  std::promise<Status> p;
  auto f = p.get_future();
  WriteAsync(key, src, [&p](Status s) { p.set_value(std::move(s)); });
  return f.get();
}

Status SwapStore::Read(uint64_t key, void* dst) {
  std::promise<Status> p;
  auto f = p.get_future();
  ReadAsync(key, dst, [&p](Status s) { p.set_value(std::move(s)); });
  return f.get();
}

Status SwapStore::SaveIndex() {
  MutexLock lock(&mu_);
  if (closed_) return FailedPrecondition("swap store is closed");
  return SaveIndexLocked();
}

Status SwapStore::SaveIndexLocked() {
  for (const auto& f : files_) {
    if (fdatasync(f.fd) != 0) return ErrnoToStatus(errno, StrCat("fdatasync swap file ", f.path));
  }
  SwapIndex idx;
  idx.rank = rank_;
  idx.checksums = checksums_;
  idx.stripe_unit = stripe_unit_;
  idx.capacity = capacity_;
  for (const auto& f : files_) idx.files.push_back(f.path);
  for (const auto& [key, b] : blocks_) idx.blocks.push_back({key, b.offset, b.length, b.crc, b.written});
  std::sort(idx.blocks.begin(), idx.blocks.end(), [](auto& a, auto& b) { return a.key < b.key; });
  return WriteFileAtomically(index_path_, SerializeSwapIndex(idx));
}

Status SwapStore::RegisterBuffers(const std::vector<iovec>& ranges) {
  MutexLock lock(&mu_);
  if (!engine_) return FailedPrecondition("swap store is closed");
  return engine_->RegisterBuffers(ranges);
}

StatusOr<SwapBlockRecord> SwapStore::Lookup(uint64_t key) const {
  MutexLock lock(&mu_);
  auto it = blocks_.find(key);
  if (it == blocks_.end()) return NotFound(StrCat("swap block ", key, " does not exist"));
  return SwapBlockRecord{key, it->second.offset, it->second.length, it->second.crc, it->second.written};
}

StatusOr<std::vector<SwapExtent>> SwapStore::Locate(uint64_t key) const {
  STRATA_ASSIGN_OR_RETURN(SwapBlockRecord r, Lookup(key));
  std::vector<SwapExtent> out;
  for (const auto& s : MapExtent(r.offset, RoundUp(r.length, kSwapAlignment)))
    out.push_back({files_[s.file].path, s.file_offset, s.length});
  return out;
}

std::vector<uint64_t> SwapStore::Keys() const {
  MutexLock lock(&mu_);
  std::vector<uint64_t> keys;
  for (const auto& kv : blocks_) keys.push_back(kv.first);
  std::sort(keys.begin(), keys.end());
  return keys;
}

SwapStoreStats SwapStore::stats() const {
  SwapStoreStats s;
  MutexLock lock(&mu_);
  if (engine_) {
    s.engine = std::string(engine_->name());
    s.fallback_reason = engine_->fallback_reason();
    s.io = engine_->stats();
  } else {
    s.engine = engine_name_;
    s.fallback_reason = fallback_reason_;
    s.io = closed_io_;
  }
  s.direct_io = direct_;
  s.capacity = capacity_;
  s.checksum_failures = checksum_failures_.load();
  s.blocks = blocks_.size();
  s.bytes_allocated = bytes_allocated_;
  return s;
}

}  // namespace strata::nvme
