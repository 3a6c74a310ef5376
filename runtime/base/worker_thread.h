// WorkerThread<Job>: one thread that runs queued jobs in order, the queue loop every lane of the
// engine shares (optimizer, reduce, publish, gather).
//
// Owns: the thread, the queue and the stop flag, guarded by `mu`, which is also the lock of the
// room that owns the worker: the room's own bookkeeping is GUARDED_BY(worker_.mu), so taking a
// job off the queue and recording that it runs are one critical section.
// Hooks, all on the worker's thread: `take` runs with `mu` held as a job leaves the queue, `work`
// without it, `finish` with it held again (then every waiter on `cv` is woken), and `after`
// without it, last. A room's hook that touches guarded state starts with `mu.AssertHeld()`.
// `wrap` runs the whole loop (a room sets the thread's device around it).
// Thread rules: Push and Stop from any thread but the worker's; Stop runs what is queued, then
// joins, and is idempotent. The destructor stops.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <utility>

#include "runtime/base/mutex.h"

namespace strata {

template <class Job>
class WorkerThread {
 public:
  struct Hooks {
    std::function<void(Job&)> take;    // REQUIRES(mu): the job left the queue
    std::function<void(Job&)> work;    // EXCLUDES(mu)
    std::function<void(Job&)> finish;  // REQUIRES(mu)
    std::function<void(Job&)> after;   // EXCLUDES(mu); may be empty
  };

  WorkerThread() = default;
  ~WorkerThread() { Stop(); }
  WorkerThread(const WorkerThread&) = delete;
  WorkerThread& operator=(const WorkerThread&) = delete;

  void Start(Hooks hooks, std::function<void(const std::function<void()>& loop)> wrap = nullptr) {
    hooks_ = std::move(hooks);
    thread_ = std::thread([this, wrap = std::move(wrap)] {
      if (wrap) wrap([this] { Loop(); });
      else Loop();
    });
  }

  void Stop() EXCLUDES(mu) {
    {
      MutexLock l(&mu);
      stop_ = true;
    }
    cv.SignalAll();
    if (thread_.joinable()) thread_.join();
  }

  void Push(Job job) EXCLUDES(mu) {
    {
      MutexLock l(&mu);
      queue_.push_back(std::move(job));
    }
    cv.SignalAll();
  }

  // The queue, for a room that reorders it or waits for it to empty.
  std::deque<Job>& queue() REQUIRES(mu) { return queue_; }

  Mutex mu;
  CondVar cv;  // signalled after each push, each finished job and Stop

 private:
  void Loop() EXCLUDES(mu) {
    mu.Lock();
    for (;;) {
      while (!stop_ && queue_.empty()) cv.Wait(&mu);
      if (queue_.empty()) break;  // stopping, and everything queued has run
      Job job = std::move(queue_.front());
      queue_.pop_front();
      hooks_.take(job);
      mu.Unlock();
      hooks_.work(job);
      mu.Lock();
      hooks_.finish(job);
      cv.SignalAll();
      if (hooks_.after) {
        mu.Unlock();
        hooks_.after(job);
        mu.Lock();
      }
    }
    mu.Unlock();
  }

  Hooks hooks_;  // set before the thread starts, read only by it
  std::deque<Job> queue_ GUARDED_BY(mu);
  bool stop_ GUARDED_BY(mu) = false;
  std::thread thread_;
};

}  // namespace strata
