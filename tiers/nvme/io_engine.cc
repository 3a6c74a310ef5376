#include "tiers/nvme/io_engine.h"

#include <algorithm>
#include <cerrno>
#include <utility>

#include "runtime/base/check.h"
#include "runtime/base/logging.h"
#include "tiers/nvme/thread_pool_engine.h"
#include "tiers/nvme/uring_engine.h"

namespace strata::nvme {

namespace {
constexpr uint64_t kDirectAlignment = 4096;  // O_DIRECT offset and length granularity
constexpr int kMaxShortRetries = 1000;       // retries of a piece that moves less than a block
// How often one piece may be retried after -EAGAIN / -EINTR before the request fails, and the
// backoff before each -EAGAIN retry (doubling from the first to the cap): a device that keeps
// refusing is reported after about 1.2 s (25 ms for the doublings, then 56 x 20 ms) rather than
// spun on, and a transient refusal costs 100 us.
constexpr int kMaxEagainRetries = 64;
constexpr auto kEagainFirstBackoff = std::chrono::microseconds(100);
constexpr auto kEagainMaxBackoff = std::chrono::milliseconds(20);

std::chrono::microseconds EagainBackoff(int retry) {
  const auto d = kEagainFirstBackoff * (int64_t{1} << std::min(retry, 20));
  return std::min<std::chrono::microseconds>(d, kEagainMaxBackoff);
}
}  // namespace

struct IoEngine::Join {
  IoDone done;
  std::atomic<int> left;
  Mutex mu;
  Status first_error GUARDED_BY(mu);
  IoOp op;
  uint64_t length;
};

Status ValidateAioConfig(const AioConfig& aio) {
  STRATA_CHECK(aio.block_size >= 4096 && aio.block_size % 4096 == 0 && aio.block_size <= (1ll << 30),
               "aio.block_size=", aio.block_size,
               ": must be a multiple of 4096 between 4096 and 1073741824 (O_DIRECT transfers are "
               "4 KiB-aligned); 1048576 is DeepSpeed's default");
  STRATA_CHECK(aio.queue_depth >= 1 && aio.queue_depth <= 4096, "aio.queue_depth=", aio.queue_depth,
               ": must be 1..4096");
  STRATA_CHECK(aio.intra_op_parallelism >= 1 && aio.intra_op_parallelism <= 64,
               "aio.intra_op_parallelism=", aio.intra_op_parallelism, ": must be 1..64");
  return Status::Ok();
}

StatusOr<std::unique_ptr<IoEngine>> IoEngine::Create(const IoEngineOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateAioConfig(options.aio));
  if (options.aio.use_gds) {
    STRATA_LOG_ONCE(WARN) << "aio.use_gds=true: GPUDirect Storage is not supported; using host I/O";
  }
  std::string reason = options.fallback_reason;
  if (!options.force_fallback) {
    auto uring = UringEngine::Create(options);
    if (uring.ok()) return std::unique_ptr<IoEngine>(std::move(uring).value());
    reason = StrCat("io_uring could not be set up (", uring.status().ToString(), ")");
  } else if (reason.empty()) {
    reason = "forced by option";
  }
  STRATA_LOG_ONCE(WARN) << "nvme engine=fallback reason=\"" << reason
                        << "\": using pread/pwrite worker threads, expect lower throughput";
  STRATA_ASSIGN_OR_RETURN(auto pool, ThreadPoolEngine::Create(options, reason));
  return std::unique_ptr<IoEngine>(std::move(pool));
}

IoEngine::IoEngine(IoEngineOptions options) : options_(std::move(options)) {}

const std::string& IoEngine::path_of(int file) const {
  static const std::string kUnknown = "<unknown file>";
  if (file < 0 || static_cast<size_t>(file) >= files_.size()) return kUnknown;
  return files_[file].path;
}

int IoEngine::BufferIndex(const void* buf, uint64_t len) const {
  if (!fixed_buffers_.load(std::memory_order_relaxed)) return -1;
  auto p = reinterpret_cast<uintptr_t>(buf);
  for (size_t i = 0; i < registered_.size(); ++i) {
    auto b = reinterpret_cast<uintptr_t>(registered_[i].iov_base);
    if (p >= b && p + len <= b + registered_[i].iov_len) return static_cast<int>(i);
  }
  return -1;
}

void IoEngine::Submit(IoRequest request) {
  const uint64_t bs = static_cast<uint64_t>(options_.aio.block_size);
  {
    MutexLock lock(&drain_mu_);
    ++outstanding_;
  }
  if (request.file < 0 || static_cast<size_t>(request.file) >= files_.size() ||
      (request.length > 0 && request.buf == nullptr)) {
    errors_.fetch_add(1, std::memory_order_relaxed);
    IoDone done = std::move(request.done);
    done(InvalidArgument(StrCat("I/O request names file ", request.file, " of ", files_.size(),
                                " registered, buffer ", request.buf, ", length ", request.length)));
    RequestFinished();
    return;
  }
  uint64_t n = request.length == 0 ? 0 : (request.length + bs - 1) / bs;
  auto* join = new Join;
  join->done = std::move(request.done);
  join->left.store(static_cast<int>(n), std::memory_order_relaxed);
  join->op = request.op;
  join->length = request.length;
  if (n == 0) {
    requests_.fetch_add(1, std::memory_order_relaxed);
    IoDone done = std::move(join->done);
    delete join;
    done(Status::Ok());
    RequestFinished();
    return;
  }
  std::vector<PiecePtr> pieces;
  pieces.reserve(n);
  auto* base = static_cast<char*>(request.buf);
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t off = i * bs;
    uint64_t len = std::min(bs, request.length - off);
    auto p = std::make_unique<Piece>();
    p->op = request.op;
    p->file = request.file;
    p->buf = base + off;
    p->offset = request.offset + off;
    p->remaining = len;
    p->buf_index = BufferIndex(p->buf, len);
    p->join = join;
    pieces.push_back(std::move(p));
  }
  Enqueue(std::move(pieces));
}

bool IoEngine::OnResult(PiecePtr& p, int64_t result) {
  if (options_.fault_hook) {
    IoAttempt a{p->op, p->file, path_of(p->file), p->offset, p->remaining, p->attempt};
    result = options_.fault_hook(a, result);
  }
  ++p->attempt;
  const char* verb = p->op == IoOp::kRead ? "read" : "write";
  if (result == -EAGAIN || result == -EINTR) {
    retries_eagain_.fetch_add(1, std::memory_order_relaxed);
    if (++p->eagain > kMaxEagainRetries) {
      Status refused = Unavailable(StrCat(verb, " of ", p->remaining, " bytes at offset ", p->offset,
                                          " in ", path_of(p->file), " still refused (EAGAIN) after ",
                                          kMaxEagainRetries, " retries; the device is overloaded"));
      FinishPiece(std::move(p), std::move(refused));
      return true;
    }
    // An interrupted call goes again at once; a refusal waits, longer each time.
    p->retry_at = result == -EINTR ? std::chrono::steady_clock::time_point{}
                                   : std::chrono::steady_clock::now() + EagainBackoff(p->eagain - 1);
    return false;
  }
  p->retry_at = {};
  if (result < 0) {
    FinishPiece(std::move(p), ErrnoToStatus(static_cast<int>(-result),
                                 StrCat(verb, " of ", p->remaining, " bytes at offset ", p->offset,
                                        " in ", path_of(p->file))));
    return true;
  }
  if (result == 0) {
    if (p->op == IoOp::kRead) {
      FinishPiece(std::move(p), OutOfRange(StrCat("short file: ", path_of(p->file), " ends before offset ",
                                       p->offset, " (", p->remaining,
                                       " more bytes expected); the file was truncated or is not "
                                       "the one the index describes")));
    } else {
      FinishPiece(std::move(p), IoError(StrCat("write at offset ", p->offset, " in ", path_of(p->file),
                                    " transferred 0 of ", p->remaining, " bytes")));
    }
    return true;
  }
  auto done = static_cast<uint64_t>(result);
  if (done > p->remaining) {
    FinishPiece(std::move(p), Internal(StrCat(verb, " in ", path_of(p->file), " reported ", done,
                                   " bytes for a request of ", p->remaining)));
    return true;
  }
  // O_DIRECT needs the retry of the rest to start on a 4 KiB boundary: a device that stopped
  // mid-block makes us transfer that block again from its start (rereading or rewriting bytes
  // that are already right) instead of issuing an unaligned request the kernel would refuse.
  if (done < p->remaining && done % kDirectAlignment != 0) {
    done -= done % kDirectAlignment;
    if (done == 0 && ++p->stalls > kMaxShortRetries) {
      FinishPiece(std::move(p), IoError(StrCat(verb, " at offset ", p->offset, " in ", path_of(p->file),
                                    " keeps transferring less than one ", kDirectAlignment,
                                    "-byte block; the device is failing")));
      return true;
    }
  }
  (p->op == IoOp::kRead ? bytes_read_ : bytes_written_).fetch_add(done, std::memory_order_relaxed);
  p->buf += done;
  p->offset += done;
  p->remaining -= done;
  if (p->remaining > 0) {
    retries_short_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  FinishPiece(std::move(p), Status::Ok());
  return true;
}

void IoEngine::FinishPiece(PiecePtr p, Status status) {
  pieces_.fetch_add(1, std::memory_order_relaxed);
  Join* j = p->join;
  p.reset();
  if (!status.ok()) {
    MutexLock lock(&j->mu);
    if (j->first_error.ok()) j->first_error = std::move(status);
  }
  if (j->left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  Status result;
  {
    MutexLock lock(&j->mu);
    result = std::move(j->first_error);
  }
  IoDone done = std::move(j->done);
  delete j;
  requests_.fetch_add(1, std::memory_order_relaxed);
  if (!result.ok()) errors_.fetch_add(1, std::memory_order_relaxed);
  done(std::move(result));
  RequestFinished();
}

void IoEngine::RequestFinished() {
  MutexLock lock(&drain_mu_);
  if (--outstanding_ == 0) drain_cv_.SignalAll();
}

void IoEngine::Drain() {
  MutexLock lock(&drain_mu_);
  while (outstanding_ != 0) drain_cv_.Wait(&drain_mu_);
}

IoEngineStats IoEngine::stats() const {
  IoEngineStats s;
  s.requests = requests_.load();
  s.pieces = pieces_.load();
  s.bytes_read = bytes_read_.load();
  s.bytes_written = bytes_written_.load();
  s.errors = errors_.load();
  s.retries_eagain = retries_eagain_.load();
  s.retries_short = retries_short_.load();
  s.broken_rings = broken_rings_.load();
  s.fixed_buffers = fixed_buffers_.load();
  s.fixed_files = fixed_files_.load();
  return s;
}

}  // namespace strata::nvme
