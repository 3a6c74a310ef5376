// Parameter groups: torch.optim's param_groups inside the engine. Each group has its own
// hyperparameters (lr, betas, eps, weight_decay); each parameter belongs to one group. A chunk
// may hold parameters of several groups, so the optimizer runs each rank's shard of a chunk as
// segments, one Adam call per run of elements of one group: the update loop itself never asks
// which group an element is in.
//
// With one group (the default: the config's "optimizer" section for every parameter) every shard
// is one segment and the update is exactly the single-group update.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/base/status.h"
#include "runtime/state/partitioner.h"

namespace strata {

// One group's hyperparameters. lr is the group's own; a schedule or the caller may replace it
// at each step (Engine::SetGroupHyperparameters).
struct GroupHyperparameters {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;   // SGD only
  double dampening = 0.0;  // SGD only
};

// Refuses values torch.optim.Adam refuses (lr, eps, weight_decay < 0; betas outside [0, 1)) and
// anything not finite, naming the group and the value.
Status ValidateGroup(const GroupHyperparameters& g, int index);

// A run of elements of one group in a rank's shard of a chunk: [begin, begin + size) in the
// shard's own coordinates.
struct ShardSegment {
  int64_t begin = 0;
  int64_t size = 0;
  int group = 0;
};

// The segments of `rank`'s shard of `chunk`, covering the shard exactly, in order, adjacent
// segments of the same group merged. `group_of_param[p]` is parameter p's group. Elements that
// belong to no parameter (alignment gaps, the chunk's tail padding) join the segment before them
// (the first segment's group when the shard starts with them): they are zero and have zero
// gradients, so any group's update leaves them zero (decay of zero is zero).
std::vector<ShardSegment> ShardSegments(const Partitioner& part, int64_t chunk, int rank,
                                        const std::vector<int>& group_of_param);

}  // namespace strata
