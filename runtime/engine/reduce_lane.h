// ReduceLane: a thread that runs each complete chunk gradient's reduction (the collective across
// ranks, the shard's hand-off into its gradient block, its share of the norm) while backward
// goes on, and, with several ranks, the all-gathers of chunks gathered ahead, all in one queue so
// that every rank issues its collectives in the same order (Note [reduce lane] in
// gradient_reducer.cc).
//
// Owns: the thread, its queue, whether a job runs, the first error of the micro-step's jobs,
// the all-gathers ahead's results per chunk, each chunk's norm part and overflow flag from its
// last reduction, the chunks whose update may be queued, and the lane's counters. Borrows: the
// trace. What a job does is the engine's (`Reduce`, `AllGather`): the lane knows the job's chunk
// and kind only.
//
// Thread rules. The lane's thread runs the jobs; everything else is the compute thread's,
// except WaitQuiet (any thread). grad_stats(c) is read after WaitIdle: nothing reads what a job
// writes before the drain at the end of Backward.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <torch/torch.h>

#include "runtime/base/status.h"
#include "runtime/base/thread_annotations.h"
#include "runtime/base/worker_thread.h"
#include "runtime/engine/compute_fence.h"
#include "runtime/engine/lane_trace.h"

namespace strata {

struct ReduceJob {
  int64_t c = 0;
  torch::Tensor grad_full;   // the chunk's whole gradient; the lane owns it from here
  ComputeFence fence;        // the compute that wrote grad_full
  bool first_micro = false;  // the shard replaces the block's contents (else adds to them)
  bool last_micro = false;
  int64_t step = 0;          // for the lane trace
  // Not a reduction: the chunk's all-gather after its copy gathered ahead lands (Note
  // [prefetched gathers]); grad_full and fence are unused.
  bool all_gather = false;
};

// What one reduction reports besides the block it wrote.
struct ReduceOutcome {
  double comm_s = 0, copy_s = 0;  // its collective's and hand-off's seconds
  uint64_t bytes_d2h = 0;         // bytes it moved from a GPU to host memory
  bool scanned = false;           // the last micro-step's: sum_sq and nonfinite are set
  double sum_sq = 0;              // squared norm of the unscaled gradient shard
  bool nonfinite = false;
  bool update_ready = false;      // the chunk's update may be queued (immediate optimizer)
};

class ReduceLane {
 public:
  // A reduction; `on_lane` says which thread runs it (waits count differently).
  using Reduce = std::function<Status(ReduceJob& job, bool on_lane, ReduceOutcome* out)>;
  // Chunk c's all-gather once its copy gathered ahead has landed; adds its seconds to *comm_s.
  using AllGather = std::function<Status(int64_t c, int64_t step, double* comm_s)>;
  struct GradStats {
    double sum_sq = 0;
    bool nonfinite = false;
  };
  struct Stats {
    double comm_s = 0, copy_s = 0;
    uint64_t bytes_d2h = 0;
  };

  // `threaded`: reductions run on the lane; otherwise Submit runs them on its caller's thread
  // (all-gathers ahead always go to the lane). `delay_hook` (tests) runs before each reduction on
  // the lane.
  ReduceLane(int64_t num_chunks, bool threaded, LaneTrace* trace, Reduce reduce,
             AllGather all_gather, std::function<void(int64_t)> delay_hook);
  ~ReduceLane();  // Stop()
  ReduceLane(const ReduceLane&) = delete;
  ReduceLane& operator=(const ReduceLane&) = delete;

  void Start();
  // Runs what is queued, then joins the thread. Idempotent.
  void Stop();

  // A chunk's complete gradient. Threaded: waits until the lane is idle (one job at a time: the
  // lane holds at most one chunk's gradient beyond what compute accumulates, a bound the memory
  // model counts on, tools/planner/memory_model.cc), counting the wait in *stall_s, and queues
  // the job. Otherwise runs it here and returns its status; its times go to *here for the
  // caller's own counters, and an update it made ready is the caller's to queue.
  Status Submit(ReduceJob job, ReduceOutcome* here, double* stall_s, int64_t trace_step)
      EXCLUDES(worker_.mu);
  // Queues chunk c's all-gather ahead behind the jobs already queued.
  void QueueAllGather(int64_t c, int64_t step) EXCLUDES(worker_.mu);
  // Waits for chunk c's all-gather ahead (counted in *stall_s) and returns its status.
  Status WaitAllGather(int64_t c, double* stall_s, int64_t trace_step) EXCLUDES(worker_.mu);

  // Waits until nothing is queued or running, counting the wait in *stall_s.
  void WaitIdle(double* stall_s, int64_t trace_step) EXCLUDES(worker_.mu);
  // The same wait, uncounted (outside a micro-step: Step, checkpoints, master values).
  void WaitQuiet() EXCLUDES(worker_.mu);
  // Returns and clears the first failure since the last call. After WaitIdle.
  Status TakeError() EXCLUDES(worker_.mu);
  // Chunks whose reduction on the lane made their update ready, oldest first; cleared.
  std::vector<int64_t> TakeUpdateReady() EXCLUDES(worker_.mu);

  GradStats grad_stats(int64_t c) const { return grad_stats_[c]; }
  // SUM since ResetStats of the jobs run on the lane. Exact once the lane is idle.
  Stats stats() const EXCLUDES(worker_.mu);
  void ResetStats() EXCLUDES(worker_.mu);

 private:
  // A job as the worker carries it from take to finish.
  struct Queued {
    ReduceJob job;
    bool failed = false;  // the micro-step already failed: later reductions are dropped
    Status s;
    ReduceOutcome out;
  };
  void Take(Queued& q) REQUIRES(worker_.mu);
  void Work(Queued& q) EXCLUDES(worker_.mu);
  void Finish(Queued& q) REQUIRES(worker_.mu);
  bool Idle() REQUIRES(worker_.mu) { return worker_.queue().empty() && !busy_; }
  // Takes a reduction's outcome into the per-chunk results (either thread).
  void Record(const ReduceJob& job, const ReduceOutcome& out);

  LaneTrace* trace_;
  const bool threaded_;
  Reduce reduce_;
  AllGather all_gather_;
  std::function<void(int64_t)> delay_hook_;
  // Written by the job's thread, read after the drain (see the thread rules).
  std::vector<GradStats> grad_stats_;

  bool busy_ GUARDED_BY(worker_.mu) = false;
  Status error_ GUARDED_BY(worker_.mu);
  Stats stats_ GUARDED_BY(worker_.mu);
  std::vector<int64_t> update_ready_ GUARDED_BY(worker_.mu);
  std::vector<uint8_t> ahead_done_ GUARDED_BY(worker_.mu);   // per chunk
  std::vector<Status> ahead_status_ GUARDED_BY(worker_.mu);  // per chunk
  // Last: stopped (its thread joined) before the members its hooks use go.
  mutable WorkerThread<Queued> worker_;
};

}  // namespace strata
