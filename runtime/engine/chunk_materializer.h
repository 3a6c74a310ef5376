// ChunkMaterializer: stage 3's chunks brought into device memory and out again. A chunk's memory
// is installed into the storage its parameters view, filled (this rank's shard from its tier,
// then the all-gather), held by the units that use it, and dropped or kept by the live-set rules
// (Note [stage-3 live set]); after a step the chunks that stay gathered are refilled. Chunks the
// next units need are gathered ahead on the gather lane (Note [prefetched gathers]).
//
// Owns: the gather lane (stage 3), and the chunk memory handed back while compute may still read
// it (Note [ordered frees]). Borrows (all outlive it): the config's zero_optimization knobs, the
// plan, the communicator, the device, the copy stream, the block store, the partitioner, the
// chunk table, the step meter and step state, the test hooks; after MakeLanes, the gradient
// reducer (whose lane runs the all-gathers ahead) and the optimizer lane (a chunk's pending
// update), and `wait_updated` (the compute thread's wait for one, counted as its stall).
// Thread rules: the compute thread's, but AllGatherAhead (the reduce lane's) and the frees,
// which the lanes' threads may reach through ReapFrees (guarded by frees_mu_).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/base/config.h"
#include "runtime/base/device.h"
#include "runtime/base/mutex.h"
#include "runtime/base/status.h"
#include "runtime/comm/communicator.h"
#include "runtime/engine/chunk_table.h"
#include "runtime/engine/compute_fence.h"
#include "runtime/engine/engine_state.h"
#include "runtime/engine/engine_test_hooks.h"
#include "runtime/engine/gather_lane.h"
#include "runtime/engine/gradient_reducer.h"
#include "runtime/engine/optimizer_lane.h"
#include "runtime/engine/step_meter.h"
#include "runtime/state/block_store.h"
#include "runtime/state/partitioner.h"
#include "runtime/state/step_plan.h"

namespace strata {

class ChunkMaterializer {
 public:
  struct Parts {
    const Config* config = nullptr;
    const StepPlan* plan = nullptr;
    Communicator* comm = nullptr;
    Device* device = nullptr;
    EngineStreams* streams = nullptr;
    BlockStore* store = nullptr;
    const Partitioner* partitioner = nullptr;
    ChunkTable* chunks = nullptr;
    StepMeter* meter = nullptr;
    const StepState* step = nullptr;
    const EngineTestHooks* hooks = nullptr;
    // The compute thread waits for chunk c's pending update (counted as its stall).
    std::function<Status(int64_t c)> wait_updated;
    // Gives chunk c's parameters their shapes over its memory (gathered) or 0 elements (dropped):
    // Note [released parameters].
    std::function<void(int64_t c, bool gathered)> show_params;
  };
  explicit ChunkMaterializer(Parts parts);
  ~ChunkMaterializer();  // Close(), if the engine did not

  // The lanes it works with, once made; at stage 3 its own gather lane too.
  Status MakeLanes(GradientReducer* reducer, OptimizerLane* opt_lane);
  void StartLane();
  void StopLane();

  // Installs memory in chunk c's storage (the device allocator's), and gives it back; the
  // chunk's parameters follow (show_params).
  Status InstallChunk(int64_t c);
  void FreeChunkMemory(int64_t c);
  // The engine ends: the lanes stop, every chunk's memory goes back to the device, and each
  // chunk's storage is marked, so that a parameter left viewing it can be told from one that
  // simply has 0 elements (ClosedChunkOf). `start_failed`: the engine's start failed part-way,
  // which the mark records too. Idempotent; show_params is not called after it.
  void Close(bool start_failed = false);
  // Whether `t` views the storage of a chunk whose engine was closed, and how it ended.
  enum class ClosedChunk { kNone, kClosed, kStartFailed };
  static ClosedChunk ClosedChunkOf(const torch::Tensor& t);
  // Leaves `param` with 0 elements over storage marked as a failed start's chunk (kStartFailed):
  // for a parameter whose values a failed start took without pointing it at a chunk.
  static void MarkStartFailed(const torch::Tensor& param);
  // Frees the pending chunk memory whose compute has finished; all of it when `wait`.
  void ReapFrees(bool wait) EXCLUDES(frees_mu_);
  // Holds chunk c, gathering it when it is not (stage 3).
  Status GatherChunk(int64_t c);
  // Drops a holder; the chunk stays gathered when it is persistent or will be reused within
  // stage3_max_reuse_distance elements (Note [stage-3 live set]).
  void ReleaseChunk(int64_t c, int64_t reuse_distance);
  void DropChunk(int64_t c);
  // After an optimizer step: chunks still held or persistent are refilled with the new values,
  // others dropped.
  Status RefreshChunks();
  // Installs each chunk of `next` and hands its shard's copy to the gather lane, when it is not
  // gathered and the live-parameter cap leaves room, and with one rank when no update of it is
  // pending; otherwise leaves it. With several ranks every rank makes the same choice (one
  // small all-reduce agrees on it) and the chosen chunks' all-gathers go to the reduce lane.
  void PrefetchGathers(const std::vector<int64_t>& next);
  // The reduce lane's: chunk c's all-gather once its copy gathered ahead has landed.
  Status AllGatherAhead(int64_t c, int64_t step, double* comm_s);
  // Waits until the gather lane is done with chunk c: its copy has landed and the lane has
  // released its param16 block. At once when no gather ahead of c is in flight.
  void WaitFillLanded(int64_t c);
  // Every prefetched copy landed.
  void FinishAllFills();
  // Returns and clears a block release the gather lane could not make after compute had already
  // taken the copy.
  Status TakeGatherError();
  GatherLane* gather_lane() { return gather_.get(); }

 private:
  int64_t trace_step() const { return step_->global_step + 1; }
  // FillChunk's two halves: this rank's shard into the chunk, then the all-gather.
  Status FillChunk(int64_t c);
  Status CopyShardIn(int64_t c);
  Status AllGatherChunk(int64_t c);
  // The all-gather itself: every rank's shard into the whole chunk (any thread; the caller
  // orders it among the rank's collectives).
  Status AllGatherShards(int64_t c);
  // Orders compute after a chunk gathered ahead: waits until the lane has enqueued its copy,
  // then makes compute wait for the copy's event (on a GPU, on the device), and with several
  // ranks waits for its all-gather.
  Status FinishFill(int64_t c);
  // For a caller about to drop or refill chunk c: waits for everything a gather ahead still has
  // in flight on it (the copy; with several ranks, the all-gather), clears the chunk's marks and
  // returns their status.
  Status SettleFill(int64_t c);
  torch::Device TorchDev() const;

  bool closed_ = false;  // Close ran (the caller's thread)
  // Borrowed (Parts), under the names the engine gives them.
  const Config& config_;
  const StepPlan& plan_;
  Communicator* comm_;
  Device* device_;
  EngineStreams& streams_;
  BlockStore* store_;
  const Partitioner* partitioner_;
  ChunkTable& chunks_;
  StepMeter& meter_;
  const StepState* step_;
  const EngineTestHooks& hooks_;
  std::function<Status(int64_t)> wait_updated_;
  std::function<void(int64_t, bool)> show_params_;
  GradientReducer* reducer_ = nullptr;
  OptimizerLane* opt_lane_ = nullptr;

  // Chunk memory handed back while compute may still read it (Note [ordered frees]).
  Mutex frees_mu_;
  std::vector<std::pair<void*, ComputeFence>> pending_frees_ GUARDED_BY(frees_mu_);
  std::unique_ptr<GatherLane> gather_;  // stage 3 only
};

}  // namespace strata
