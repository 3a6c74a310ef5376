// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with the thread-safety
// annotations of runtime/base/thread_annotations.h, so that clang checks every GUARDED_BY.
//
//   Mutex mu_;
//   int n_ GUARDED_BY(mu_) = 0;
//   CondVar cv_;
//   void Add() EXCLUDES(mu_) { MutexLock l(&mu_); ++n_; cv_.SignalAll(); }
//   void WaitPositive() EXCLUDES(mu_) { MutexLock l(&mu_); while (n_ <= 0) cv_.Wait(&mu_); }
//
// Conditions are loops in the caller (as above), not predicates handed to the wait: the
// analysis checks the caller's body, where the lock is known to be held, and not a lambda's.
// Thread-safety: what std::mutex and std::condition_variable guarantee.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "runtime/base/thread_annotations.h"

namespace strata {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // Tells the analysis the lock is held where it cannot see it taken (a callback that its
  // caller runs under the lock). Checks nothing at run time.
  void AssertHeld() const ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for its scope. Unlock and Lock let a scope let go of it for a while (to start
// I/O, to wait for another thread); the destructor releases it only when held.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() {
    if (held_) mu_->Unlock();
  }
  void Unlock() RELEASE() {
    held_ = false;
    mu_->Unlock();
  }
  void Lock() ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
  bool held_ = true;
};

// Waits take the Mutex they wait with, so the analysis sees that very lock held.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases `mu` while waiting and holds it again on return; wake-ups may be spurious.
  void Wait(Mutex* mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> l(mu->mu_, std::adopt_lock);
    cv_.wait(l);
    l.release();
  }
  // False when the deadline passed (a spurious wake-up before it returns true).
  template <class Clock, class Duration>
  bool WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline) REQUIRES(mu) {
    std::unique_lock<std::mutex> l(mu->mu_, std::adopt_lock);
    const bool woke = cv_.wait_until(l, deadline) == std::cv_status::no_timeout;
    l.release();
    return woke;
  }
  template <class Rep, class Period>
  bool WaitFor(Mutex* mu, const std::chrono::duration<Rep, Period>& d) REQUIRES(mu) {
    return WaitUntil(mu, std::chrono::steady_clock::now() + d);
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace strata
