// Learning-rate schedules of the config's "scheduler" block, as DeepSpeed defines them.
//   WarmupLR:       linear from warmup_min_lr to warmup_max_lr over warmup_num_steps, then flat.
//   WarmupDecayLR:  WarmupLR, then linear decay to 0 at total_num_steps.
//   WarmupCosineLR: WarmupLR, then cosine decay to 0 at total_num_steps.
//   OneCycle:       one cycle from cycle_min_lr up to cycle_max_lr (cycle_first_step_size steps)
//                   and back (cycle_second_step_size), in stairs when the stair counts are set,
//                   then cycle_min_lr / (1 + decay_lr_rate * k / decay_step_size) k steps after
//                   the cycle; with cycle_momentum, beta1 moves the other way between
//                   cycle_max_mom and cycle_min_mom and beta2 is 0.99, as DeepSpeed sets them.
//   LRRangeTest:    lr_range_test_min_lr * (1 + step_rate * k / step_size) after k steps (k /
//                   step_size floored with lr_range_test_staircase).
// With no scheduler the optimizer's lr is used for every step.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include "runtime/base/config.h"
#include "runtime/base/status.h"

namespace strata {

// The lr for optimizer step `step` (1-based: the first update is step 1) of a group whose own lr
// is the optimizer's (config.optimizer.lr).
double LearningRate(const Config& config, int64_t step);

// The lr for optimizer step `step` of a parameter group whose own lr is `group_lr`:
// WarmupCosineLR scales each group's own lr by its ratio, as DeepSpeed's does; every other
// schedule gives every group the same lr (LearningRate), and with none the group keeps its own.
double GroupLearningRate(const Config& config, int64_t step, double group_lr);

// The (beta1, beta2) a schedule sets for optimizer step `step`: OneCycle with cycle_momentum on
// an optimizer that has betas (Adam, AdamW, Lion; DeepSpeed skips the others with a warning).
// nullopt: the optimizer's own betas stand.
std::optional<std::pair<double, double>> ScheduledBetas(const Config& config, int64_t step);

// OK, or INVALID_ARGUMENT naming the schedule's keys, when ScheduledBetas for `step` takes
// betas[0] to 1 or past it: OneCycle's momentum decay (decay_mom_rate) grows beta1 after the
// cycle without bound, as DeepSpeed's does, and Adam's bias correction 1 - beta1^t then divides
// by zero or flips sign, so the weights would go NaN without a word.
Status CheckScheduledBetas(const Config& config, int64_t step);

}  // namespace strata
