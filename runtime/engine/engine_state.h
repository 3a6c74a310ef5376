// The plain values Engine::Impl keeps between its rooms: the model it trains, its execution
// resources, where the training loop stands and the parameter groups. Aggregates, owned by
// Engine::Impl and read and written on the engine's caller thread (the lanes reach none of them
// but through the hooks Impl hands them).
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <tbb/task_arena.h>
#include <torch/torch.h>

#include "optim/loss_scaler.h"
#include "runtime/base/device.h"
#include "runtime/base/status.h"
#include "runtime/engine/compute_fence.h"
#include "runtime/state/param_groups.h"

namespace strata {

// The model the engine trains, and its forward when it came with one (Engine::Create's
// AnyModule overload).
struct EngineModel {
  std::shared_ptr<torch::nn::Module> module;
  std::optional<torch::nn::AnyModule> any;
};

// The engine's own execution resources, made once in Init.
struct EngineStreams {
  // The optimizer's threads. First, so it outlives any update still queued on a stream below (a
  // stream drains only when it is destroyed).
  std::unique_ptr<tbb::task_arena> arena;
  std::unique_ptr<Stream> copy;  // shards to and from the device
  // The optimizer's device work: the device-resident update (Stream::LaunchKernel) with its fp32
  // working copy, and the copies of a host optimizer's new values to the device.
  std::unique_ptr<Stream> publish;
  // CUDA: the gradient statistics' stream, and the reduce lane's LibTorch ops (compute_fence.h).
  std::unique_ptr<SideStream> side;
};

// Where the training loop stands.
struct StepState {
  int64_t global_step = 0;  // optimizer steps taken (skipped ones excluded)
  int64_t micro_step = 0;   // backward passes so far
  // The global step the optimizer's states started from: 0, or where a load left them fresh or
  // as they were, negative when they are older than the step count (Note [the optimizer's own
  // steps]). Bias corrections count from it.
  int64_t moments_from = 0;
  bool step_open = false;   // the step's first training forward ran; its Step has not
  bool micro_open = false;  // a training forward has begun and its Backward not yet run
  bool in_backward = false;
  // The last Backward ended an accumulation (micro_step a multiple of the accumulation steps)
  // and no Step has run since: the next Backward would begin the following step's updates over
  // those still pending, so it is refused until Step.
  bool boundary_reached = false;
  // A tier-manager iteration (BeginIteration) is open. It brackets what repeats each step: with
  // deferred updates that is from one Step's end to the next, so the trace the tier manager
  // records (the second step's) holds the updates interleaved with the forward.
  bool iteration_open = false;
  std::optional<optim::DynamicLossScaler> scaler;  // fp16, or EngineTestHooks::loss_scaling
  Status backward_error;  // what a hook met inside autograd, returned by Backward
  std::exception_ptr autograd_exception;  // Engine::TakeAutogradException
  // Note [a load cut short]: the checkpoint whose load failed after it had overwritten part of
  // the state; empty while the state is one run's. Training and saves refuse until a load
  // completes.
  std::string torn_by_load;
  bool load_wrote = false;  // the load under way has overwritten a block (WriteLoadedBlock)
};

// Parameter groups (param_groups.h), fixed at Init: each group's own hyperparameters, each
// parameter's group, and each chunk's shard as segments of one group; and the values the caller
// last set (SetGroupHyperparameters; nullopt: the groups' own, with the step's lr from the
// config's schedule).
struct GroupLayout {
  std::vector<GroupHyperparameters> hyper;
  std::vector<int> of_param;
  std::vector<std::vector<ShardSegment>> segments;
  std::optional<std::vector<GroupHyperparameters>> override_hyper;
};

}  // namespace strata
