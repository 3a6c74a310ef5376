// IoEngine: asynchronous file reads and writes with a completion per request.
//
// Two implementations sit behind this interface:
// - UringEngine (io_uring, the normal path): rings with a bounded number of requests in flight,
//   batched submission, registered files and buffers where they could be registered.
// - ThreadPoolEngine (pread/pwrite on worker threads): used only when io_uring cannot be set
//   up, when a directory does not support O_DIRECT (tmpfs), or when forced for tests. The choice
//   is made once by IoEngine::Create, logged once, and reported by name() / fallback_reason().
//
// How the `aio` config block drives an engine (see also Note [aio knobs] in uring_engine.cc):
// - block_size: a request longer than this is split into pieces of at most block_size bytes;
//   each piece is one kernel request. The request completes when all its pieces have.
// - queue_depth: pieces in flight per ring (io_uring) at any moment; more are queued in memory.
// - intra_op_parallelism: rings, each with its own completion thread, per direction (reads and
//   writes get separate rings so a burst of writes never sits in front of a read that is
//   waited on). The fallback uses 2 × intra_op_parallelism worker threads.
// - single_submit: submit each piece with its own system call instead of one call per batch.
// - overlap_events: true keeps the ring full: each completion is refilled at once. false works in
//   batches: up to queue_depth pieces are submitted, and the next batch goes only after all of
//   them completed (DeepSpeed's behaviour without overlap).
//
// Contract
// - Submit() never blocks on I/O and may be called from any thread, including from a completion
//   callback. `done` runs exactly once, on an engine thread (inline, before Submit returns, for a
//   request naming an unknown file), with OK only when every byte of the request was
//   transferred. Callbacks must be short and must not call Drain() or destroy the
//   engine.
// - Partial transfers are finished (the remainder is resubmitted); -EINTR is retried at once and
//   -EAGAIN after a backoff that doubles from 100 us to 20 ms, both together at most
//   kMaxEagainRetries (64) times per piece, so a piece the device keeps refusing fails with
//   UNAVAILABLE within about 1.2 s; any other error fails the request with a Status naming the
//   file, offset and length. A read that meets end of file fails with OUT_OF_RANGE ("short file").
// - io_uring_enter itself failing (Note [broken ring] in uring_engine.cc): EINTR is retried,
//   EAGAIN / EBUSY are retried after a backoff for at most about 2 s while nothing completes, any
//   other error after 5 tries with a backoff (31 ms). Then the ring is broken: its queued pieces
//   and those never handed to the kernel fail at once with that Status, those in flight as they
//   complete (or after 2 s more, once the ring is torn down), and every later request on that
//   ring fails at once. So Drain() returns within a stated bound whatever the kernel does.
// - SetFiles() and RegisterBuffers() must be called while no I/O is in flight (normally right
//   after Create). The engine does not own the file descriptors.
// - Buffers and lengths must satisfy O_DIRECT's alignment (4096) for files opened with it.
// - The destructor drains: every submitted request completes before it returns.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/base/config.h"
#include "runtime/base/mutex.h"
#include "runtime/base/status.h"

namespace strata::nvme {

enum class IoOp { kRead, kWrite };

using IoDone = std::function<void(Status)>;

struct IoFile {
  int fd = -1;
  std::string path;  // for messages
};

struct IoRequest {
  IoOp op = IoOp::kRead;
  int file = 0;          // index into the table given to SetFiles
  void* buf = nullptr;   // destination (read) or source (write)
  uint64_t length = 0;   // bytes
  uint64_t offset = 0;   // bytes from the start of the file
  IoDone done;
};

// What a fault hook sees for each kernel-level attempt of one piece.
struct IoAttempt {
  IoOp op;
  int file;
  const std::string& path;
  uint64_t offset;  // of this attempt
  uint64_t length;  // of this attempt
  int attempt;      // 0 for the first try of a piece
};

// Test-only: rewrites the result of an attempt (bytes transferred, or -errno) before the engine
// acts on it, so EIO, ENOSPC, EAGAIN and short transfers can be injected into the real
// completion path of either engine. Called on engine threads; must be thread-safe.
using IoFaultHook = std::function<int64_t(const IoAttempt&, int64_t result)>;
// Test-only: called before each io_uring_enter that submits (io_uring engine only) with the
// ring's label ("read0", "write1", ...); 0 lets the call go to the kernel, a negative errno makes
// it fail with that error without reaching the kernel (nothing is submitted).
using IoSubmitFaultHook = std::function<int(const std::string& ring)>;

struct IoEngineOptions {
  AioConfig aio;
  bool force_fallback = false;  // use the pread/pwrite engine even where io_uring works
  std::string fallback_reason;  // why the caller forces it (logged and reported)
  IoFaultHook fault_hook;
  IoSubmitFaultHook submit_fault_hook;
};

struct IoEngineStats {
  uint64_t requests = 0;        // COUNT: requests completed
  uint64_t pieces = 0;          // COUNT: kernel requests completed (after block_size splitting)
  uint64_t bytes_read = 0;      // SUM: bytes read
  uint64_t bytes_written = 0;   // SUM: bytes written
  uint64_t errors = 0;          // COUNT: requests completed with an error
  uint64_t retries_eagain = 0;  // COUNT: attempts retried after -EAGAIN / -EINTR
  uint64_t broken_rings = 0;    // COUNT: rings that gave up after io_uring_enter kept failing
  uint64_t retries_short = 0;   // COUNT: attempts resubmitted to finish a short transfer
  bool fixed_buffers = false;   // registered buffers in use
  bool fixed_files = false;     // registered files in use
};

// Validates an aio block: names the key, the value and the accepted range.
Status ValidateAioConfig(const AioConfig& aio);

class IoEngine {
 public:
  // io_uring when it can be set up and !force_fallback, else the thread-pool fallback (logged
  // once with the reason). Fails only on an invalid aio block or when no thread can start.
  static StatusOr<std::unique_ptr<IoEngine>> Create(const IoEngineOptions& options);

  virtual ~IoEngine() = default;

  virtual std::string_view name() const = 0;  // "io_uring" or "fallback"
  const std::string& fallback_reason() const { return fallback_reason_; }

  virtual Status SetFiles(std::vector<IoFile> files) = 0;
  // Registers [base, base+len) ranges; I/O whose buffer lies inside one uses the fixed-buffer
  // opcodes. The fallback accepts and ignores them. A failure (e.g. RLIMIT_MEMLOCK for a
  // non-root user) leaves the engine working without registered buffers.
  virtual Status RegisterBuffers(const std::vector<iovec>& ranges) = 0;

  void Submit(IoRequest request) EXCLUDES(drain_mu_);
  // Blocks until every request submitted so far has completed.
  void Drain() EXCLUDES(drain_mu_);

  IoEngineStats stats() const;
  const AioConfig& aio() const { return options_.aio; }

 protected:
  struct Join;
  // One kernel-level request: a slice of at most block_size bytes of an IoRequest. Owned through
  // PiecePtr by whoever holds it: the engine's queues, the kernel while in flight (its pointer is
  // the SQE's user data, taken back from the completion), OnResult and FinishPiece.
  struct Piece {
    IoOp op = IoOp::kRead;
    int file = 0;
    char* buf = nullptr;
    uint64_t offset = 0;
    uint64_t remaining = 0;  // bytes still to transfer
    int attempt = 0;         // kernel-level attempts so far (what the fault hook sees)
    int eagain = 0;          // attempts refused with -EAGAIN / -EINTR
    int stalls = 0;          // attempts that moved less than one O_DIRECT block
    int buf_index = -1;      // registered buffer holding buf, or -1
    // Not to be submitted before this time (the backoff after -EAGAIN); epoch: at once.
    std::chrono::steady_clock::time_point retry_at{};
    Join* join = nullptr;
  };
  using PiecePtr = std::unique_ptr<Piece>;

  explicit IoEngine(IoEngineOptions options);

  // Hands pieces to the implementation; called once per Submit with all its pieces.
  virtual void Enqueue(std::vector<PiecePtr> pieces) = 0;
  // Applies the fault hook and accounts `result`. Returns true when the piece is finished
  // (completed or failed; `piece` is then empty), false when it must be submitted again as is
  // (its offset/buf/remaining already advanced, retry_at set after -EAGAIN).
  bool OnResult(PiecePtr& piece, int64_t result);
  // Fails a piece that never reached the kernel or never will again (a broken ring).
  void FailPiece(PiecePtr piece, Status status) { FinishPiece(std::move(piece), std::move(status)); }
  void CountBrokenRing() { broken_rings_.fetch_add(1, std::memory_order_relaxed); }

  const std::string& path_of(int file) const;
  int BufferIndex(const void* buf, uint64_t len) const;

  IoEngineOptions options_;
  std::string fallback_reason_;
  std::vector<IoFile> files_;      // set before I/O, read-only afterwards
  std::vector<iovec> registered_;  // idem
  std::atomic<bool> fixed_buffers_{false};
  std::atomic<bool> fixed_files_{false};

 private:
  void FinishPiece(PiecePtr piece, Status status);
  // One request fewer outstanding; wakes Drain() at zero.
  void RequestFinished() EXCLUDES(drain_mu_);

  std::atomic<uint64_t> requests_{0}, pieces_{0}, bytes_read_{0}, bytes_written_{0}, errors_{0},
      retries_eagain_{0}, retries_short_{0}, broken_rings_{0};

  Mutex drain_mu_;
  CondVar drain_cv_;
  uint64_t outstanding_ GUARDED_BY(drain_mu_) = 0;  // requests submitted, not yet completed
};

}  // namespace strata::nvme
