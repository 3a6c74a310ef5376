#include "tiers/nvme/uring_engine.h"

#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <functional>
#include <future>
#include <thread>
#include <unordered_set>

#include "runtime/base/check.h"
#include "runtime/base/env_vars.h"
#include "runtime/base/logging.h"

namespace strata::nvme {

// Note [aio knobs]
// The loop below is where the aio block takes effect. Each pass: take every piece handed over
// since the last pass, prepare SQEs while fewer than queue_depth are in flight (with
// overlap_events=false only when none are), submit them with one io_uring_enter that also waits
// for one completion (single_submit=true submits each SQE on its own first), then reap every
// completion available with io_uring_peek_batch_cqe and finish or requeue each piece on its own.
// No pass ever waits for "all outstanding I/O": a completion is delivered as soon as it is reaped.
//
// Note [ring wake-up]
// The ring thread sleeps inside io_uring_enter waiting for a completion. A poll request on an
// eventfd is kept armed in the ring, so another thread that queues work while the ring might be
// asleep writes the eventfd and its completion wakes the thread; the thread re-arms the poll.
// Writers only signal when the queue was empty (the thread drains the whole queue each pass, so a
// non-empty queue means a pass is still coming), and a callback running on the ring's own thread
// never signals: its pieces are picked up by the next pass.

// Note [broken ring]
// io_uring_enter can fail as a call, not for a request: EINTR (a signal), EAGAIN or EBUSY (the
// kernel is short of request memory, or completions must be reaped first), or an error that will
// not go away (EFAULT, EBADF, the ring's own ENOMEM, a kernel bug). Submit retries the first at
// once; the second after reaping what completed, with a backoff, for at most kBusyBound while
// nothing completes; anything else kFatalTries times with a doubling backoff. Past that the ring
// is broken: every piece the kernel never saw (queued, waiting out an EAGAIN backoff, prepared
// in the submission queue but not consumed) fails at once with that error. Pieces in flight may
// still be moving bytes into or out of the caller's buffers, so they are reaped as they complete
// for kInFlightBound more; those still out then fail after the ring is torn down (closing a ring
// cancels its requests). Every later piece on a broken ring fails at once. Drain() thus returns
// within kBusyBound, or the fatal tries' backoff, plus kInFlightBound, whatever the kernel does.

namespace {
constexpr uint64_t kWakeTag = 1;  // user_data of the eventfd poll; pieces are pointers, never 1
thread_local const void* tls_current_ring = nullptr;
constexpr int kFatalTries = 5;  // backoff 1, 2, 4, 8, 16 ms: 31 ms in all
constexpr auto kBusyBound = std::chrono::seconds(2);
constexpr auto kInFlightBound = std::chrono::seconds(2);
constexpr auto kBusyMaxBackoff = std::chrono::milliseconds(10);
// While a piece waits out an EAGAIN backoff the ring does not sleep in the kernel: it looks for
// completions at least this often.
constexpr auto kBackoffPoll = std::chrono::microseconds(200);
}  // namespace

// Note [ring ownership]
// Each ring is created, used and torn down by its own thread. That lets the ring be set up with
// IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, so the kernel runs completion work
// only when that thread asks for events (no interrupts of a thread that is busy refilling the
// ring), which also means registrations must be made from that thread: Call() posts them there.
// Kernels without those flags (before 6.1) get a plain ring. STRATA_NVME_PLAIN_RING=1 forces a
// plain ring, for comparisons.
const bool kPlainRing = [] {
  const char* v = GetEnv(kEnvNvmePlainRing);
  return v != nullptr && v[0] == '1';
}();

class UringEngine::Ring {
 public:
  Ring(UringEngine* engine, std::string label, unsigned queue_depth)
      : engine_(engine), label_(std::move(label)), qd_(queue_depth) {}

  ~Ring() {
    if (thread_.joinable()) {
      {
        MutexLock lock(&mu_);
        stopping_ = true;
      }
      Wake();
      thread_.join();
    }
    if (efd_ >= 0) close(efd_);
  }

  // Starts the thread, which creates the ring; fails when the ring cannot be created.
  Status Start() {
    efd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (efd_ < 0) return ErrnoToStatus(errno, "eventfd for an io_uring ring");
    std::promise<Status> ready;
    auto f = ready.get_future();
    thread_ = std::thread([this, &ready] { Loop(&ready); });
    Status s = f.get();
    if (!s.ok()) thread_.join();
    return s;
  }

  unsigned setup_flags() const { return setup_flags_; }

  // Runs `fn` on the ring's thread (Note [ring ownership]) and returns its result.
  Status Call(std::function<Status(io_uring*)> fn) EXCLUDES(mu_) {
    if (tls_current_ring == this) return fn(&ring_);
    auto task = std::make_shared<Task>();
    task->fn = std::move(fn);
    auto f = task->result.get_future();
    {
      MutexLock lock(&mu_);
      tasks_.push_back(task);
    }
    Wake();
    return f.get();
  }

  void Push(std::vector<PiecePtr>& pieces) EXCLUDES(mu_) {
    bool was_empty;
    {
      MutexLock lock(&mu_);
      was_empty = queue_.empty();
      for (auto& p : pieces) queue_.push_back(std::move(p));
    }
    if (was_empty && tls_current_ring != this) Wake();
  }

 private:
  struct Task {
    std::function<Status(io_uring*)> fn;
    std::promise<Status> result;
  };
  using Clock = std::chrono::steady_clock;

  void Wake() {
    uint64_t one = 1;
    // EAGAIN means the counter is already non-zero: a wake-up is pending anyway.
    ssize_t r = write(efd_, &one, sizeof one);
    (void)r;
    idle_cv_.Signal();  // a broken ring's thread waits there instead
  }

  void ArmWake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    STRATA_DCHECK(sqe != nullptr, "no SQE for the wake-up poll");
    io_uring_prep_poll_add(sqe, efd_, POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
    sq_pending_.push_back(nullptr);
  }

  // The SQE carries the piece: its pointer is the user data until the completion takes it back.
  void Prep(PiecePtr owned) {
    Piece* p = owned.release();
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    STRATA_DCHECK(sqe != nullptr, "SQ full with ", inflight_, " in flight of ", qd_);
    const bool fixed_file = engine_->fixed_files_.load(std::memory_order_relaxed);
    int fd = fixed_file ? p->file : engine_->files_[p->file].fd;
    auto len = static_cast<unsigned>(p->remaining);
    if (p->op == IoOp::kRead) {
      if (p->buf_index >= 0) {
        io_uring_prep_read_fixed(sqe, fd, p->buf, len, p->offset, p->buf_index);
      } else {
        io_uring_prep_read(sqe, fd, p->buf, len, p->offset);
      }
    } else {
      if (p->buf_index >= 0) {
        io_uring_prep_write_fixed(sqe, fd, p->buf, len, p->offset, p->buf_index);
      } else {
        io_uring_prep_write(sqe, fd, p->buf, len, p->offset);
      }
    }
    if (fixed_file) io_uring_sqe_set_flags(sqe, IOSQE_FIXED_FILE);
    io_uring_sqe_set_data(sqe, p);
    sq_pending_.push_back(p);
    ++inflight_;
  }

  Status Setup() {
    io_uring_params params{};
    int ret = -EINVAL;
    if (!kPlainRing) {
      params.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
      ret = io_uring_queue_init_params(qd_ + 1, &ring_, &params);
    }
    if (ret == -EINVAL) {  // older kernel: a plain ring
      params = io_uring_params{};
      ret = io_uring_queue_init_params(qd_ + 1, &ring_, &params);
    }
    if (ret < 0) return ErrnoToStatus(-ret, StrCat("io_uring_queue_init(", qd_ + 1, ")"));
    setup_flags_ = params.flags;
    return Status::Ok();
  }

  void Loop(std::promise<Status>* ready) EXCLUDES(mu_) {
    tls_current_ring = this;
    {
      Status s = Setup();
      const bool ok = s.ok();
      ready->set_value(std::move(s));  // `ready` dies with Start()'s frame after this
      if (!ok) return;
    }
    const bool overlap = engine_->options_.aio.overlap_events;
    const bool single = engine_->options_.aio.single_submit;
    std::vector<std::shared_ptr<Task>> tasks;
    ArmWake();
    while (true) {
      bool stop;
      {
        MutexLock lock(&mu_);
        for (auto& p : queue_) local_.push_back(std::move(p));
        queue_.clear();
        tasks.swap(tasks_);
        stop = stopping_;
      }
      for (auto& t : tasks) t->result.set_value(t->fn(&ring_));
      tasks.clear();
      if (!broken_.ok()) {  // Note [broken ring]: nothing more goes to this ring's kernel side
        for (auto& p : local_) engine_->FailPiece(std::move(p), broken_);
        local_.clear();
        if (stop) break;
        WaitForWork();
        continue;
      }
      ReleaseBackedOff();
      Status s;
      if (overlap || inflight_ == 0) {
        while (s.ok() && inflight_ < qd_ && !local_.empty()) {
          Prep(std::move(local_.front()));
          local_.pop_front();
          if (single) s = Submit(/*wait=*/false);
        }
      }
      if (stop && inflight_ == 0 && local_.empty() && backed_off_.empty()) break;
      // A piece waiting out its backoff must not wait behind a sleep in the kernel.
      if (s.ok()) s = Submit(/*wait=*/backed_off_.empty());
      if (!s.ok()) {
        Break(std::move(s));
        continue;
      }
      if (Reap() == 0 && !backed_off_.empty())
        std::this_thread::sleep_until(std::min(NextRetry(), Clock::now() + kBackoffPoll));
    }
    // The kernel finishes tearing a ring down asynchronously; dropping the registered files
    // first releases them (and their locks and mounts) before the engine is gone.
    if (broken_.ok()) TearDown();
    tls_current_ring = nullptr;
  }

  void TearDown() {
    if (engine_->fixed_files_.load()) io_uring_unregister_files(&ring_);
    io_uring_queue_exit(&ring_);
  }

  // The pieces whose EAGAIN backoff is over go to the front of the line: they are the oldest.
  void ReleaseBackedOff() {
    if (backed_off_.empty()) return;
    const auto now = Clock::now();
    for (auto it = backed_off_.rbegin(); it != backed_off_.rend(); ++it)
      if (*it && (*it)->retry_at <= now) local_.push_front(std::move(*it));
    backed_off_.erase(std::remove(backed_off_.begin(), backed_off_.end(), nullptr), backed_off_.end());
  }

  Clock::time_point NextRetry() const {
    Clock::time_point t = Clock::time_point::max();
    for (const auto& p : backed_off_) t = std::min(t, p->retry_at);
    return t;
  }

  // The kernel consumed the first `n` prepared SQEs: their pieces are in flight.
  void Consumed(int n) {
    for (int i = 0; i < n && !sq_pending_.empty(); ++i) {
      if (sq_pending_.front() != nullptr) in_flight_.insert(sq_pending_.front());
      sq_pending_.pop_front();
    }
  }

  // Submits the prepared SQEs and, when `wait`, waits for a completion (Note [broken ring] for
  // what a failing call gets). Returns the error that broke the ring, else OK.
  Status Submit(bool wait) {
    int fatal = 0;
    Clock::time_point busy_since{};
    int busy = 0;
    while (true) {
      const auto& hook = engine_->options_.submit_fault_hook;
      int ret = hook ? hook(label_) : 0;
      if (ret == 0) ret = wait ? io_uring_submit_and_wait(&ring_, 1) : io_uring_submit(&ring_);
      if (ret >= 0) {
        Consumed(ret);
        return Status::Ok();
      }
      if (ret == -EINTR) continue;
      if (ret == -EAGAIN || ret == -EBUSY) {
        // Completions give the kernel its resources back: the caller reaps them, then comes back.
        if (io_uring_cq_ready(&ring_) > 0) return Status::Ok();
        const auto now = Clock::now();
        if (busy == 0) busy_since = now;
        if (now - busy_since > kBusyBound)
          return ErrnoToStatus(-ret, StrCat("io_uring_enter on nvme ring ", label_, " (busy for ",
                                            std::chrono::duration_cast<std::chrono::seconds>(kBusyBound).count(),
                                            " s with nothing completing)"));
        std::this_thread::sleep_for(std::min<std::chrono::microseconds>(
            std::chrono::microseconds(int64_t{100} << std::min(busy++, 10)), kBusyMaxBackoff));
        continue;
      }
      if (++fatal > kFatalTries)
        return ErrnoToStatus(-ret, StrCat("io_uring_enter on nvme ring ", label_, " (failed ",
                                          kFatalTries, " times in a row)"));
      STRATA_LOG(WARN) << "nvme ring=" << label_ << " io_uring_enter failed: "
                       << ErrnoToStatus(-ret, "io_uring_enter") << "; try " << fatal << " of "
                       << kFatalTries;
      std::this_thread::sleep_for(std::chrono::milliseconds(int64_t{1} << (fatal - 1)));
    }
  }

  // Handles every completion available; returns how many pieces completed.
  int Reap() {
    io_uring_cqe* cqes[64];
    int pieces = 0;
    unsigned n;
    while ((n = io_uring_peek_batch_cqe(&ring_, cqes, 64)) > 0) {
      for (unsigned i = 0; i < n; ++i) {
        const uint64_t tag = io_uring_cqe_get_data64(cqes[i]);
        if (tag == kWakeTag) {
          uint64_t v;
          ssize_t r = read(efd_, &v, sizeof v);
          (void)r;
          if (broken_.ok()) ArmWake();
          continue;
        }
        if (tag == LIBURING_UDATA_TIMEOUT) continue;  // liburing's own, on old kernels
        Piece* raw = reinterpret_cast<Piece*>(tag);
        in_flight_.erase(raw);
        PiecePtr p(raw);
        --inflight_;
        ++pieces;
        if (engine_->OnResult(p, cqes[i]->res)) continue;
        // Requeued pieces go first: they are the oldest work; a refused one waits its backoff.
        if (p->retry_at > Clock::now()) backed_off_.push_back(std::move(p));
        else local_.push_front(std::move(p));
      }
      io_uring_cq_advance(&ring_, n);
    }
    return pieces;
  }

  // Note [broken ring].
  void Break(Status s) {
    STRATA_LOG(ERROR) << "nvme ring=" << label_ << " broken: " << s
                      << "; its queued and unsubmitted requests fail";
    engine_->CountBrokenRing();
    broken_ = s.WithContext("nvme ring broken");
    for (auto& p : local_) engine_->FailPiece(std::move(p), broken_);
    local_.clear();
    for (auto& p : backed_off_) engine_->FailPiece(std::move(p), broken_);
    backed_off_.clear();
    for (Piece* p : sq_pending_) {  // prepared, never consumed: the kernel never saw them
      if (p == nullptr) continue;
      --inflight_;
      engine_->FailPiece(PiecePtr(p), broken_);
    }
    sq_pending_.clear();
    // In flight: the kernel may still be moving their bytes. Reap them as they complete, for a
    // while (asking for events does not submit anything).
    const auto until = Clock::now() + kInFlightBound;
    while (!in_flight_.empty() && Clock::now() < until) {
      io_uring_get_events(&ring_);
      if (Reap() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      // A piece that asked to go again (a short transfer, EAGAIN) cannot: the ring is broken.
      for (auto& p : local_) engine_->FailPiece(std::move(p), broken_);
      local_.clear();
      for (auto& p : backed_off_) engine_->FailPiece(std::move(p), broken_);
      backed_off_.clear();
    }
    // Closing the ring cancels what is left; only then do its buffers belong to the caller.
    TearDown();
    for (Piece* p : in_flight_) engine_->FailPiece(PiecePtr(p), broken_);
    in_flight_.clear();
    inflight_ = 0;
  }

  // A broken ring's thread: sleeps until a piece (to fail) or a task comes, or it must stop.
  void WaitForWork() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    if (!stopping_ && queue_.empty() && tasks_.empty())
      idle_cv_.WaitFor(&mu_, std::chrono::milliseconds(50));
  }

  UringEngine* engine_;
  std::string label_;
  io_uring ring_{};
  unsigned setup_flags_ = 0;
  int efd_ = -1;
  unsigned qd_ = 1;
  // The ring thread's own (Note [ring ownership]): pieces prepared or in the kernel, the pieces
  // queued for it and those waiting out an EAGAIN backoff, the SQEs prepared but not yet
  // consumed (in order; null for the wake-up poll), the pieces the kernel holds, and the error
  // that broke the ring.
  unsigned inflight_ = 0;
  std::deque<PiecePtr> local_;
  std::vector<PiecePtr> backed_off_;
  std::deque<Piece*> sq_pending_;
  std::unordered_set<Piece*> in_flight_;
  Status broken_;
  std::thread thread_;

  Mutex mu_;
  CondVar idle_cv_;  // a broken ring's thread waits on it
  std::vector<PiecePtr> queue_ GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Task>> tasks_ GUARDED_BY(mu_);
  bool stopping_ GUARDED_BY(mu_) = false;
};

UringEngine::UringEngine(const IoEngineOptions& options) : IoEngine(options) {}

StatusOr<std::unique_ptr<UringEngine>> UringEngine::Create(const IoEngineOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateAioConfig(options.aio));
  std::unique_ptr<UringEngine> e(new UringEngine(options));
  const auto qd = static_cast<unsigned>(options.aio.queue_depth);
  for (int64_t i = 0; i < options.aio.intra_op_parallelism; ++i) {
    e->read_rings_.push_back(std::make_unique<Ring>(e.get(), StrCat("read", i), qd));
    STRATA_RETURN_IF_ERROR(e->read_rings_.back()->Start());
    e->write_rings_.push_back(std::make_unique<Ring>(e.get(), StrCat("write", i), qd));
    STRATA_RETURN_IF_ERROR(e->write_rings_.back()->Start());
  }
  STRATA_LOG_ONCE(INFO) << "nvme engine=io_uring rings_per_direction=" << options.aio.intra_op_parallelism
                        << " queue_depth=" << qd << " defer_taskrun="
                        << ((e->read_rings_.front()->setup_flags() & IORING_SETUP_DEFER_TASKRUN) != 0);
  return e;
}

UringEngine::~UringEngine() {
  Drain();
  // Ring destructors stop and join their threads.
  read_rings_.clear();
  write_rings_.clear();
}

Status UringEngine::SetFiles(std::vector<IoFile> files) {
  files_ = std::move(files);
  std::vector<int> fds;
  for (const auto& f : files_) fds.push_back(f.fd);
  Status st;
  for (auto* rings : {&read_rings_, &write_rings_}) {
    for (auto& r : *rings) {
      st = r->Call([&fds](io_uring* ring) {
        int ret = io_uring_register_files(ring, fds.data(), static_cast<unsigned>(fds.size()));
        return ret < 0 ? ErrnoToStatus(-ret, "io_uring_register_files") : Status::Ok();
      });
      if (!st.ok()) break;
    }
    if (!st.ok()) break;
  }
  if (!st.ok()) {
    // Plain descriptors work everywhere; registration only saves a file lookup per request.
    STRATA_LOG_ONCE(INFO) << "nvme registered files unavailable, using plain descriptors: " << st;
    fixed_files_ = false;
    return Status::Ok();
  }
  fixed_files_ = !files_.empty();
  return Status::Ok();
}

Status UringEngine::RegisterBuffers(const std::vector<iovec>& ranges) {
  registered_ = ranges;
  for (auto* rings : {&read_rings_, &write_rings_}) {
    for (auto& r : *rings) {
      Status st = r->Call([&ranges](io_uring* ring) {
        int ret = io_uring_register_buffers(ring, ranges.data(), static_cast<unsigned>(ranges.size()));
        return ret < 0 ? ErrnoToStatus(-ret, "io_uring_register_buffers") : Status::Ok();
      });
      if (!st.ok()) {
        for (auto* rs : {&read_rings_, &write_rings_})
          for (auto& x : *rs) {
            x->Call([](io_uring* ring) {
                io_uring_unregister_buffers(ring);  // rings that never registered say ENXIO
                return Status::Ok();
              }).IgnoreError();
          }
        registered_.clear();
        fixed_buffers_ = false;
        return st.WithContext("registering buffers (I/O continues without them)");
      }
    }
  }
  fixed_buffers_ = !ranges.empty();
  return Status::Ok();
}

void UringEngine::Enqueue(std::vector<PiecePtr> pieces) {
  auto& rings = pieces.front()->op == IoOp::kRead ? read_rings_ : write_rings_;
  auto& next = pieces.front()->op == IoOp::kRead ? next_read_ : next_write_;
  if (rings.size() == 1) {
    rings[0]->Push(pieces);
    return;
  }
  std::vector<std::vector<PiecePtr>> per(rings.size());
  for (auto& p : pieces)
    per[next.fetch_add(1, std::memory_order_relaxed) % rings.size()].push_back(std::move(p));
  for (size_t i = 0; i < rings.size(); ++i)
    if (!per[i].empty()) rings[i]->Push(per[i]);
}

}  // namespace strata::nvme
