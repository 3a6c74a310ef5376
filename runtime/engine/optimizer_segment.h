// Segment: one run of one parameter group inside a chunk's shard, with each optimizer's view of
// its hyperparameters and buffers, as ChunkUpdater hands it to the optimizer kernels. Internal to
// runtime/engine.
#pragma once

#include <cstdint>

#include "optim/cpu_adagrad.h"
#include "optim/cpu_adam.h"
#include "optim/cpu_lion.h"
#include "optim/cpu_sgd.h"
#include "runtime/base/config.h"
#include "runtime/engine/engine_state.h"

namespace strata {

// One run of one parameter group inside a chunk, with each optimizer's view of its buffers.
struct Segment {
  optim::AdamParams ap;
  optim::AdamBuffers bufs;  // Adam's view; the element-wise optimizers take their states from it
  optim::SgdParams sp;
  optim::AdagradParams gp;
  optim::LionParams lp;
};

// Adam or AdamW (one kernel family); SGD, Adagrad and Lion are the element-wise ones.
inline bool IsAdam(OptimizerType t) { return t == OptimizerType::kAdam || t == OptimizerType::kAdamW; }

// Each optimizer's parameters for one segment of group hyperparameters `gh` at `step` (the buffers
// are left for the caller).
Segment MakeSegment(const OptimizerConfig& oc, const GroupHyperparameters& gh, int64_t step);

}  // namespace strata
