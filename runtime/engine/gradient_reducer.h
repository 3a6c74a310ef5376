// GradientReducer: what happens to a chunk's gradient once backward has all of it (Note [reduce
// lane] in gradient_reducer.cc): the collective across ranks (all-reduce at stages 0-1,
// reduce-scatter above), this rank's shard handed into its gradient block, accumulated over
// micro-steps, and on the last micro-step its share of the global norm and overflow check; and,
// for updates deferred past Step, their states read ahead while backward runs.
//
// Owns: the reduce lane (its thread runs the reductions and, with several ranks, the all-gathers
// of chunks gathered ahead, in one queue so every rank issues its collectives in one order), and
// the state read-ahead's order and progress. Borrows (all outlive it): the plan, the
// communicator, the device, the block store, the partitioner, the lane trace, the side stream,
// the loss scaler; and two of the engine's hooks: `wait_updated` (a chunk's pending update, before
// its gradient block is overwritten) and `queue_update` (a chunk whose update may start).
// Thread rules: Reduce, Drain, BeginStatePrefetch, WaitIdle and the stats are the compute
// thread's; WaitQuiet any thread's; the reductions run on the lane (or, unthreaded, inside
// Reduce) and read only what their job carries and the borrowed parts above.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include "optim/loss_scaler.h"
#include "runtime/base/device.h"
#include "runtime/base/status.h"
#include "runtime/comm/communicator.h"
#include "runtime/engine/compute_fence.h"
#include "runtime/engine/engine_state.h"
#include "runtime/engine/lane_trace.h"
#include "runtime/engine/reduce_lane.h"
#include "runtime/engine/step_meter.h"
#include "runtime/state/block_store.h"
#include "runtime/state/partitioner.h"
#include "runtime/state/step_plan.h"

namespace strata {

class GradientReducer {
 public:
  struct Parts {
    const StepPlan* plan = nullptr;
    Communicator* comm = nullptr;
    Device* device = nullptr;
    BlockStore* store = nullptr;
    const Partitioner* partitioner = nullptr;
    LaneTrace* trace = nullptr;
    const EngineStreams* streams = nullptr;
    const std::optional<optim::DynamicLossScaler>* scaler = nullptr;
    // Blocks until chunk c's pending update is done; counts the wait in *waited when given, else
    // as the compute thread's stall.
    std::function<Status(int64_t c, double* waited)> wait_updated;
    // Queues chunk c's update (compute thread).
    std::function<void(int64_t c)> queue_update;
    // Chunk c's all-gather after its copy gathered ahead landed (the chunk materializer's).
    ReduceLane::AllGather all_gather_ahead;
    std::function<void(int64_t)> delay_hook;  // EngineTestHooks::reduce_delay_hook
  };
  explicit GradientReducer(Parts parts);

  void Start() { lane_->Start(); }
  void Stop() { lane_->Stop(); }

  // Chunk c's complete gradient (`grad_full`, written by the compute before `fence`): reduced,
  // handed into its block and scanned, on the lane or here (then its times go to `meter`, and an
  // update it made ready is queued at once).
  Status Reduce(int64_t c, torch::Tensor grad_full, ComputeFence fence, bool first_micro,
                bool last_micro, int64_t step, StepMeter* meter);
  // Waits for every queued reduction (a stall on `meter`), queues the updates they made ready and
  // returns and clears the lane's first failure.
  Status Drain(StepMeter* meter, int64_t trace_step);
  // The same wait uncounted, the lane's errors left for Drain (outside a micro-step).
  void WaitQuiet() { lane_->WaitQuiet(); }
  void WaitIdle(StepMeter* meter, int64_t trace_step) { lane_->WaitIdle(&meter->stall_s, trace_step); }
  // The all-gathers of chunks gathered ahead go through the lane's queue (one order of
  // collectives on every rank).
  void QueueAllGather(int64_t c, int64_t step) { lane_->QueueAllGather(c, step); }
  Status WaitAllGather(int64_t c, double* stall_s, int64_t step) {
    return lane_->WaitAllGather(c, stall_s, step);
  }
  // Deferred updates: while the last micro-step's backward runs, their states are read ahead in
  // `order` (one chunk per reduced chunk, up to half the host budget).
  void BeginStatePrefetch(std::vector<int64_t> order);

  ReduceLane::GradStats grad_stats(int64_t c) const { return lane_->grad_stats(c); }
  ReduceLane::Stats stats() const { return lane_->stats(); }
  void ResetStats() { lane_->ResetStats(); }

 private:
  // A reduction's work, on the lane or on the compute thread (`on_lane`); its times go to *out.
  Status ReduceShard(ReduceJob& job, bool on_lane, ReduceOutcome* out);
  // The shard into its gradient block; its norm part on the last micro-step.
  Status HandOff(ReduceJob& job, const torch::Tensor& shard, bool on_lane, ReduceOutcome* out);
  void PrefetchStates();
  void QueueReadyUpdates();

  Parts p_;
  // The read-ahead of deferred updates' states: the order, how far it got, the bytes asked for.
  // Set by the compute thread while the lane is idle, advanced by the reductions.
  std::vector<int64_t> prefetch_order_;
  size_t prefetch_next_ = 0;
  uint64_t prefetch_bytes_ = 0;
  std::unique_ptr<ReduceLane> lane_;
};

}  // namespace strata
