// LaneTrace: the engine's lanes as spans on a timeline, written as Chrome trace-event JSON
// (chrome://tracing, ui.perfetto.dev): one track per lane, one complete event ("ph":"X") per
// span of work or waiting.
//
// Contract:
// - Add records only while the trace is armed; disarmed, it costs one relaxed atomic load.
// - Spans are kept in memory until Clear; a run traces a few steps, not a whole training.
// - Thread-safe: lanes record from their own threads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/status.h"

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

}  // namespace strata
