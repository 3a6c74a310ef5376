// LaneTrace: the engine's lanes as spans on a timeline, written as Chrome trace-event JSON
// (chrome://tracing, ui.perfetto.dev): one track per lane, one complete event ("ph":"X") per
// span of work or waiting.
//
// Contract:
// - Add records only while the trace is armed; disarmed, it costs one relaxed atomic load.
// - Spans are kept in memory until Clear; a run traces a few steps, not a whole training.
// - Thread-safe: lanes record from their own threads.
// Beside it, what every lane shares: LaneTimer (busy time and a span; a waiter's blocked time
// when its span is on the wait track). The lanes' queue loop is runtime/base/worker_thread.h.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/mutex.h"
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
           int64_t step, int64_t chunk = -1) EXCLUDES(mu_);

  // {"traceEvents": [...], "displayTimeUnit": "ms"}; times in microseconds from the first span.
  nlohmann::json ToJson() const EXCLUDES(mu_);
  size_t size() const EXCLUDES(mu_);
  void Clear() EXCLUDES(mu_);

 private:
  struct Span {
    Lane lane;
    const char* name;  // a string literal
    Clock::time_point begin, end;
    int64_t step, chunk;
  };
  std::atomic<bool> armed_{false};
  mutable Mutex mu_;
  std::vector<Span> spans_ GUARDED_BY(mu_);
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

}  // namespace strata
