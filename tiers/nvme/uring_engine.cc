#include "tiers/nvme/uring_engine.h"

#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <functional>
#include <future>
#include <chrono>
#include <deque>
#include <thread>

#include "runtime/base/check.h"
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

namespace {
constexpr uint64_t kWakeTag = 1;  // user_data of the eventfd poll; pieces are pointers, never 1
thread_local const void* tls_current_ring = nullptr;
}  // namespace

// Note [ring ownership]
// Each ring is created, used and torn down by its own thread. That lets the ring be set up with
// IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, so the kernel runs completion work
// only when that thread asks for events (no interrupts of a thread that is busy refilling the
// ring), which also means registrations must be made from that thread: Call() posts them there.
// Kernels without those flags (before 6.1) get a plain ring. STRATA_NVME_PLAIN_RING=1 forces a
// plain ring, for comparisons.
const bool kPlainRing = [] {
  const char* v = std::getenv("STRATA_NVME_PLAIN_RING");
  return v != nullptr && v[0] == '1';
}();

class UringEngine::Ring {
 public:
  Ring(UringEngine* engine, std::string label, unsigned queue_depth)
      : engine_(engine), label_(std::move(label)), qd_(queue_depth) {}

  ~Ring() {
    if (thread_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
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
  Status Call(std::function<Status(io_uring*)> fn) {
    if (tls_current_ring == this) return fn(&ring_);
    auto task = std::make_shared<Task>();
    task->fn = std::move(fn);
    auto f = task->result.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(task);
    }
    Wake();
    return f.get();
  }

  void Push(std::vector<Piece*>& pieces) {
    bool was_empty;
    {
      std::lock_guard<std::mutex> lock(mu_);
      was_empty = queue_.empty();
      queue_.insert(queue_.end(), pieces.begin(), pieces.end());
    }
    if (was_empty && tls_current_ring != this) Wake();
  }

 private:
  struct Task {
    std::function<Status(io_uring*)> fn;
    std::promise<Status> result;
  };

  void Wake() {
    uint64_t one = 1;
    // EAGAIN means the counter is already non-zero: a wake-up is pending anyway.
    ssize_t r = write(efd_, &one, sizeof one);
    (void)r;
  }

  void ArmWake() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    STRATA_DCHECK(sqe != nullptr, "no SQE for the wake-up poll");
    io_uring_prep_poll_add(sqe, efd_, POLLIN);
    io_uring_sqe_set_data64(sqe, kWakeTag);
  }

  void Prep(Piece* p) {
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

  void Loop(std::promise<Status>* ready) {
    tls_current_ring = this;
    {
      Status s = Setup();
      const bool ok = s.ok();
      ready->set_value(std::move(s));  // `ready` dies with Start()'s frame after this
      if (!ok) return;
    }
    const bool overlap = engine_->options_.aio.overlap_events;
    const bool single = engine_->options_.aio.single_submit;
    std::deque<Piece*> local;
    std::vector<std::shared_ptr<Task>> tasks;
    ArmWake();
    io_uring_cqe* cqes[64];
    while (true) {
      bool stop;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (Piece* p : queue_) local.push_back(p);
        queue_.clear();
        tasks.swap(tasks_);
        stop = stopping_;
      }
      for (auto& t : tasks) t->result.set_value(t->fn(&ring_));
      tasks.clear();
      if (overlap || inflight_ == 0) {
        while (inflight_ < qd_ && !local.empty()) {
          Prep(local.front());
          local.pop_front();
          ++inflight_;
          if (single) SubmitRetrying(0);
        }
      }
      if (stop && inflight_ == 0 && local.empty()) break;
      SubmitRetrying(1);
      unsigned n;
      while ((n = io_uring_peek_batch_cqe(&ring_, cqes, 64)) > 0) {
        for (unsigned i = 0; i < n; ++i) {
          uint64_t tag = io_uring_cqe_get_data64(cqes[i]);
          if (tag == kWakeTag) {
            uint64_t v;
            ssize_t r = read(efd_, &v, sizeof v);
            (void)r;
            ArmWake();
            continue;
          }
          auto* p = reinterpret_cast<Piece*>(tag);
          --inflight_;
          // Requeued pieces go first: they are the oldest work.
          if (!engine_->OnResult(p, cqes[i]->res)) local.push_front(p);
        }
        io_uring_cq_advance(&ring_, n);
      }
    }
    // The kernel finishes tearing a ring down asynchronously; dropping the registered files
    // first releases them (and their locks and mounts) before the engine is gone.
    if (engine_->fixed_files_.load()) io_uring_unregister_files(&ring_);
    io_uring_queue_exit(&ring_);
    tls_current_ring = nullptr;
  }

  void SubmitRetrying(unsigned wait_nr) {
    while (true) {
      int ret = wait_nr ? io_uring_submit_and_wait(&ring_, wait_nr) : io_uring_submit(&ring_);
      if (ret >= 0) return;
      if (ret == -EINTR) continue;
      if (ret == -EAGAIN || ret == -EBUSY) {
        // The kernel is short of resources for new SQEs; completions will free them.
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      STRATA_LOG(ERROR) << "nvme ring=" << label_ << " io_uring_enter failed: "
                        << ErrnoToStatus(-ret, "io_uring_enter") << "; retrying";
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  UringEngine* engine_;
  std::string label_;
  io_uring ring_{};
  unsigned setup_flags_ = 0;
  int efd_ = -1;
  unsigned qd_ = 1;
  unsigned inflight_ = 0;  // owned by the ring thread
  std::thread thread_;

  std::mutex mu_;
  std::vector<Piece*> queue_;                 // GUARDED_BY(mu_)
  std::vector<std::shared_ptr<Task>> tasks_;  // GUARDED_BY(mu_)
  bool stopping_ = false;                     // GUARDED_BY(mu_)
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

void UringEngine::Enqueue(std::vector<Piece*>& pieces) {
  auto& rings = pieces.front()->op == IoOp::kRead ? read_rings_ : write_rings_;
  auto& next = pieces.front()->op == IoOp::kRead ? next_read_ : next_write_;
  if (rings.size() == 1) {
    rings[0]->Push(pieces);
    return;
  }
  std::vector<std::vector<Piece*>> per(rings.size());
  for (Piece* p : pieces) per[next.fetch_add(1, std::memory_order_relaxed) % rings.size()].push_back(p);
  for (size_t i = 0; i < rings.size(); ++i)
    if (!per[i].empty()) rings[i]->Push(per[i]);
}

}  // namespace strata::nvme
