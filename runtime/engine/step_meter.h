// StepMeter: what one reporting window of the engine measured on the compute thread, and the
// lane trace every lane records into.
//
// Owns: the window's start; the compute thread's busy seconds (forward and backward spans), the
// seconds it spent copying, in collectives and stalled (waiting for data or a deferred update),
// the part of those waits inside the compute spans, and the bytes it moved host<->device; the
// block store's counters when the window opened; the trace. The lanes keep their own counters
// (their headers); Step adds them into the report.
// Thread rules: the counters are the compute thread's (the activation stash, called on it,
// adds to them too); LaneTimer takes their addresses. The trace is thread-safe.
#pragma once

#include <chrono>
#include <cstdint>

#include "runtime/engine/engine.h"
#include "runtime/engine/lane_trace.h"
#include "runtime/state/block_store.h"

namespace strata {

class StepMeter {
 public:
  using Clock = std::chrono::steady_clock;

  // A new window starts now: the counters restart from zero (the store's from `store_now`).
  void OpenWindow(const BlockStoreStats& store_now);
  bool window_open() const { return window_open_; }
  // The micro-step's first training gather: Backward adds the span from here as forward
  // compute, whoever drove the forward. Gathers inside it are subtracted again as waits.
  void BeginForward();
  // Backward begins: the forward's span (since BeginForward) is compute.
  void EndForward(int64_t trace_step);
  // Copy, collective and stall seconds so far (what the compute spans subtract).
  double WaitsSoFar() const { return copy_s + comm_s + stall_s; }
  // The window's own fields of `rep` (the lanes' figures are added by the caller first into
  // copy_s, comm_s, bytes_h2d and bytes_d2h): times, bytes, the store's NVMe figures.
  void Fill(StepReport* rep, const BlockStoreStats& store_now) const;

  LaneTrace trace;
  double compute_s = 0, copy_s = 0, comm_s = 0, stall_s = 0;
  double update_wait_s = 0;  // of stall_s: compute waiting for a deferred update
  // Of the copy, comm and stall time, the part spent inside the compute spans (forward,
  // Backward): compute is those spans less this. Waits in Step (the deferred norm scan,
  // refreshing persistent chunks, sharing updated shards) happen outside them.
  double waits_in_compute_s = 0;
  uint64_t bytes_h2d = 0, bytes_d2h = 0;

 private:
  bool window_open_ = false;
  Clock::time_point step_start_;
  Clock::time_point forward_start_;
  double waits_at_forward_start_ = 0;
  BlockStoreStats store_at_start_;
};

}  // namespace strata
