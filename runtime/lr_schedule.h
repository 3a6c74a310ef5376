// Learning-rate schedules of the config's "scheduler" block, as DeepSpeed defines them.
//   WarmupLR:       linear from warmup_min_lr to warmup_max_lr over warmup_num_steps, then flat.
//   WarmupDecayLR:  WarmupLR, then linear decay to 0 at total_num_steps.
//   WarmupCosineLR: WarmupLR, then cosine decay to 0 at total_num_steps.
// With no scheduler the optimizer's lr is used for every step.
#pragma once

#include <cstdint>

#include "runtime/config.h"

namespace strata {

// The lr for optimizer step `step` (1-based: the first update is step 1).
double LearningRate(const Config& config, int64_t step);

}  // namespace strata
