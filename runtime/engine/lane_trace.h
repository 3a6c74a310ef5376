// LaneTrace: the engine's lanes as spans on a timeline, written as Chrome trace-event JSON
// (chrome://tracing, ui.perfetto.dev): one track per lane, one complete event ("ph":"X") per
// span of work or waiting.
//
// Contract:
// - Add records only while the trace is armed; disarmed, it costs one relaxed atomic load.
// - Spans are kept in memory until Clear; a run traces a few steps, not a whole training.
// - Thread-safe: lanes record from their own threads.
// Beside it, what every lane shares: LaneTimer (busy time and a span), TimedWait (a waiter's
// blocked time), StopLaneThread (ending a lane's thread).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/status.h"

namespace strata {

// Compute: forward and backward spans. Wait: the compute thread blocked on data (a shard read,
// an optimizer update it needs). The rest are the lanes of StepReport.
enum class Lane { kCompute, kWait, kCopy, kComm, kNvme, kOptimizer };
inline constexpr int kNumLanes = 6;
const char* LaneName(Lane lane);

class LaneTrace {
 public:
  using Clock = std::chrono::steady_clock;

  void Arm(bool on) { armed_.store(on, std::memory_order_relaxed); }
  bool armed() const { return armed_.load(std::memory_order_relaxed); }

  // `step`: the optimizer step the work is for (< 0: not known, e.g. tier I/O). `chunk` < 0: the
  // span concerns no single chunk.
  void Add(Lane lane, const char* name, Clock::time_point begin, Clock::time_point end,
           int64_t step, int64_t chunk = -1);

  // {"traceEvents": [...], "displayTimeUnit": "ms"}; times in microseconds from the first span.
  nlohmann::json ToJson() const;
  size_t size() const;
  void Clear();

 private:
  struct Span {
    Lane lane;
    const char* name;  // a string literal
    Clock::time_point begin, end;
    int64_t step, chunk;
  };
  std::atomic<bool> armed_{false};
  mutable std::mutex mu_;
  std::vector<Span> spans_;  // GUARDED_BY(mu_)
};

using LaneClock = LaneTrace::Clock;

// Adds the seconds from its construction to its destruction to *sum and, when `trace` is given,
// records that span (recorded only while the trace is armed).
class LaneTimer {
 public:
  explicit LaneTimer(double* sum) : sum_(sum), t0_(LaneClock::now()) {}
  LaneTimer(double* sum, LaneTrace* trace, Lane lane, const char* name, int64_t step,
            int64_t chunk = -1)
      : sum_(sum), t0_(LaneClock::now()), trace_(trace), lane_(lane), name_(name), step_(step),
        chunk_(chunk) {}
  ~LaneTimer() {
    const LaneClock::time_point t1 = LaneClock::now();
    *sum_ += std::chrono::duration<double>(t1 - t0_).count();
    if (trace_) trace_->Add(lane_, name_, t0_, t1, step_, chunk_);
  }
  LaneTimer(const LaneTimer&) = delete;
  LaneTimer& operator=(const LaneTimer&) = delete;

 private:
  double* sum_;
  LaneClock::time_point t0_;
  LaneTrace* trace_ = nullptr;
  Lane lane_ = Lane::kCompute;
  const char* name_ = "";
  int64_t step_ = 0, chunk_ = -1;
};

// Waits on `cv` (with `held` locked) until `done()`. A wait that happened is added to *waited and
// traced as `what` on the wait track: how a lane's waiter (usually the compute thread) accounts
// for being blocked on that lane.
template <typename Done>
void TimedWait(std::unique_lock<std::mutex>& held, std::condition_variable& cv, Done done,
               double* waited, LaneTrace* trace, const char* what, int64_t step,
               int64_t chunk = -1) {
  if (done()) return;
  const LaneClock::time_point t0 = LaneClock::now();
  cv.wait(held, done);
  const LaneClock::time_point t1 = LaneClock::now();
  *waited += std::chrono::duration<double>(t1 - t0).count();
  trace->Add(Lane::kWait, what, t0, t1, step, chunk);
}

// How a lane ends its thread: sets *stop under `mu` (the lane's loop returns once its queue is
// empty and *stop is set), wakes the loop and joins it. Idempotent.
inline void StopLaneThread(std::mutex& mu, std::condition_variable& cv, bool* stop,
                           std::thread& thread) {
  {
    std::lock_guard<std::mutex> l(mu);
    *stop = true;
  }
  cv.notify_all();
  if (thread.joinable()) thread.join();
}

}  // namespace strata
