#include "tiers/nvme/thread_pool_engine.h"

#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <thread>

namespace strata::nvme {

ThreadPoolEngine::ThreadPoolEngine(const IoEngineOptions& options) : IoEngine(options) {}

StatusOr<std::unique_ptr<ThreadPoolEngine>> ThreadPoolEngine::Create(const IoEngineOptions& options,
                                                                     std::string reason) {
  STRATA_RETURN_IF_ERROR(ValidateAioConfig(options.aio));
  std::unique_ptr<ThreadPoolEngine> e(new ThreadPoolEngine(options));
  e->fallback_reason_ = std::move(reason);
  const int64_t n = 2 * options.aio.intra_op_parallelism;
  try {
    for (int64_t i = 0; i < n; ++i) e->threads_.emplace_back([p = e.get()] { p->Worker(); });
  } catch (const std::system_error& err) {
    return ResourceExhausted(StrCat("starting ", n, " I/O worker threads: ", err.what()));
  }
  return e;
}

ThreadPoolEngine::~ThreadPoolEngine() {
  Drain();
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  for (auto& t : threads_) t.join();
}

Status ThreadPoolEngine::SetFiles(std::vector<IoFile> files) {
  files_ = std::move(files);
  return Status::Ok();
}

void ThreadPoolEngine::Enqueue(std::vector<PiecePtr> pieces) {
  const size_t n = pieces.size();
  {
    MutexLock lock(&mu_);
    for (auto& p : pieces) queue_.push_back(std::move(p));
  }
  if (n == 1) {
    cv_.Signal();
  } else {
    cv_.SignalAll();
  }
}

void ThreadPoolEngine::Worker() {
  while (true) {
    PiecePtr p;
    {
      MutexLock lock(&mu_);
      while (!stopping_ && queue_.empty()) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping and drained
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    const int fd = files_[p->file].fd;
    while (true) {
      ssize_t r = p->op == IoOp::kRead ? pread(fd, p->buf, p->remaining, static_cast<off_t>(p->offset))
                                       : pwrite(fd, p->buf, p->remaining, static_cast<off_t>(p->offset));
      if (OnResult(p, r < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(r))) break;
      // The backoff after -EAGAIN: this worker holds the piece, so it waits here.
      std::this_thread::sleep_until(p->retry_at);
    }
  }
}

}  // namespace strata::nvme
