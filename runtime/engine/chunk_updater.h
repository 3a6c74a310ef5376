// ChunkUpdater: one chunk's update, the optimizer lane's unit of work, for every optimizer the
// engine runs (Adam/AdamW, SGD, Adagrad, Lion). It acquires the chunk's states from the block
// store, runs the optimizer over this rank's shard as runs of one parameter group
// (param_groups.h), on the device's stream when the states live there or in the optimizer's arena
// on the host otherwise, and writes the new working values to their home or to a staging slot
// whose copy to the device it starts (Note [pipelined publish] in publish_lane.cc).
//
// Owns: the publish lane (when the plan stages new values). Borrows (all outlive it): the config's
// optimizer section, the plan, the block store, the device, the partitioner, the parameter
// groups, the streams and arena, the chunk table (stages 0-2: the working copy a device
// optimizer writes and PublishParams fills), the lane trace.
// Thread rules: Update runs on the optimizer lane's thread, one chunk at a time; PublishParams on
// the caller's thread while the lanes are idle (a checkpoint load, written parameters); the
// publish lane calls `finished` on its own thread once a chunk's new values landed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "runtime/base/config.h"
#include "runtime/base/device.h"
#include "runtime/base/status.h"
#include "runtime/engine/chunk_table.h"
#include "runtime/engine/engine_state.h"
#include "runtime/engine/lane_trace.h"
#include "kernels/kernels.h"
#include "runtime/engine/optimizer_lane.h"
#include "runtime/engine/publish_lane.h"
#include "runtime/state/block_store.h"
#include "runtime/state/partitioner.h"
#include "runtime/state/step_plan.h"

namespace strata::kernels {
enum class Backend : uint8_t;  // kernels/kernels.h
}  // namespace strata::kernels

namespace strata {

class ChunkUpdater {
 public:
  struct Parts {
    const OptimizerConfig* optimizer = nullptr;
    const StepPlan* plan = nullptr;
    BlockStore* store = nullptr;
    Device* device = nullptr;
    const Partitioner* partitioner = nullptr;
    const GroupLayout* groups = nullptr;
    EngineStreams* streams = nullptr;
    ChunkTable* chunks = nullptr;
    LaneTrace* trace = nullptr;
    // A chunk's update is over (its new values landed, or failed to): the optimizer lane's
    // Finished. Called on the publish lane's thread.
    std::function<void(int64_t chunk, Status s)> finished;
    uint64_t rounding_seed = 0;  // Note [stochastic rounding] (optim/compact_formats.h)
  };
  // Makes the publish lane, with slots for the largest shard, when the plan stages new values.
  static StatusOr<std::unique_ptr<ChunkUpdater>> Create(Parts parts);

  // The optimizer lane's Update: chunk c's update with the step's inputs. Leaves *publish set
  // when the new values' copy to the device is in flight (the lane submits it to publish_lane());
  // adds a wait for a staging slot to *slot_wait_s.
  Status Update(int64_t c, const OptimizerLane::StepInputs& in,
                std::optional<PublishLane::Copy>* publish, double* slot_wait_s);
  // Copies a shard of working values (in `dtype`) to where the device reads chunk c's, and waits.
  Status PublishParams(int64_t c, const void* shard_values, optim::DType dtype);
  // Null unless the plan stages new values.
  PublishLane* publish_lane() { return publish_.get(); }

 private:
  // What an update holds from its acquire to its release.
  struct Held {
    BlockKey keys[4];            // master, exp_avg, exp_avg_sq, grad
    void* ptrs[4] = {};          // at their compute addresses; null for a state not kept
    std::vector<BlockKey> held;  // acquired, to release
    void* out = nullptr;         // where the new working values go
    bool param_block_held = false;
    int slot = -1;               // the staging slot taken
  };
  explicit ChunkUpdater(Parts parts) : p_(std::move(parts)) {}
  // Stages 0-2: this rank's shard of chunk c in the replicated working copy (device memory, at
  // its compute address), in the compute dtype.
  void* WorkingShard(int64_t c) const;
  // Chunk c's states pinned for the update; the master, moments and gradient in ptrs[0..3].
  Status AcquireStates(int64_t c, Held* held);
  // Where the new working values go: their home, or a staging slot.
  Status ChooseOutput(int64_t c, int64_t step, Held* held, double* slot_wait_s);
  Status RunOnDevice(const OptimizerLane::StepInputs& in, const Held& held, int64_t n);
  Status RunOnHost(const OptimizerLane::StepInputs& in, const Held& held, int64_t n);
  // Note [compact layouts] (step_plan.h): the compact step (kernels::CompactAdamStep or
  // CompactElementwiseStep) over the shard on `backend`, one run per parameter piece, each
  // drawing its rounding bits at the parameter's model-wide index. kCpu runs in the caller's
  // arena and has finished on return; kCuda is queued on `native` (a cudaStream_t).
  Status RunCompact(const OptimizerLane::StepInputs& in, const Held& held, int64_t n,
                    kernels::Backend backend, void* native);
  // Whether the new working values must be copied from the master to `out` after a compact
  // step: the master is not the working shard, and is in the working dtype (a bf16 master;
  // fp32 compute). An fp32 master under 16-bit compute writes `out` itself (param16).
  bool CompactCopiesMaster(const Held& held) const;
  // Releases what the update held (written when `updated`) and starts the slot's copy.
  Status Finish(int64_t c, int64_t step, Status s, Held* held, std::optional<PublishLane::Copy>* publish);
  Status StartPublish(int64_t c, int slot, int64_t step, PublishLane::Copy* copy);
  // The publish lane's `done`: a chunk's new values have landed (or failed to).
  void OnPublished(const PublishLane::Copy& copy, Status s);

  Parts p_;
  std::unique_ptr<PublishLane> publish_;
  // The compact layouts' rounding: each parameter's first element's index in the whole model
  // (registration order), and the run's seed (model.seed).
  std::vector<uint64_t> model_offset_;
  uint64_t rounding_seed_ = 0;
};

}  // namespace strata
