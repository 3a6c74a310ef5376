#include "runtime/state/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace strata {
namespace {

// OneCycle's position in its cycle for batch index b (DeepSpeed's _get_scale_factor): 0 at
// cycle_min_lr, 1 at the peak, with its stairs.
double OneCycleScale(const SchedulerConfig& s, double b) {
  const double first = static_cast<double>(s.cycle_first_step_size);
  const double second = s.cycle_second_step_size > 0 ? static_cast<double>(s.cycle_second_step_size) : first;
  const double total = first + second;
  const double ratio = first / total;
  const double cycle = std::floor(1.0 + b / total);
  const double x = 1.0 + b / total - cycle;
  double scale;
  int64_t stairs;
  if (x <= ratio) {
    scale = x / ratio;
    stairs = s.cycle_first_stair_count;
  } else {
    scale = (x - 1.0) / (ratio - 1.0);
    stairs = s.cycle_second_stair_count >= 0 ? s.cycle_second_stair_count : s.cycle_first_stair_count;
  }
  if (stairs > 0) {
    // Quantized from the integer offset in the cycle, not from `scale`, so a boundary step lands
    // exactly on its stair.
    const double in_cycle = std::fmod(b, total);
    const double position = in_cycle <= first ? in_cycle * static_cast<double>(stairs) / first
                                              : (total - in_cycle) * static_cast<double>(stairs) / second;
    scale = std::floor(position) / static_cast<double>(stairs);
  }
  return scale;
}

double OneCycleTotal(const SchedulerConfig& s) {
  return static_cast<double>(s.cycle_first_step_size) +
         static_cast<double>(s.cycle_second_step_size > 0 ? s.cycle_second_step_size
                                                          : s.cycle_first_step_size);
}

}  // namespace

double LearningRate(const Config& config, int64_t step) {
  return GroupLearningRate(config, step, config.optimizer.lr);
}

double GroupLearningRate(const Config& config, int64_t step, double group_lr) {
  const SchedulerConfig& s = config.scheduler;
  if (s.type == SchedulerType::kNone) return group_lr;
  // LRRangeTest and OneCycle: DeepSpeed's classes write the lr of batch index 0 when built, so
  // step `step` runs with batch index step - 1.
  const double it = static_cast<double>(std::max<int64_t>(step - 1, 0));
  if (s.type == SchedulerType::kLRRangeTest) {
    const double interval = it / static_cast<double>(s.lr_range_test_step_size);
    return s.lr_range_test_min_lr *
           (1.0 + s.lr_range_test_step_rate * (s.lr_range_test_staircase ? std::floor(interval) : interval));
  }
  if (s.type == SchedulerType::kOneCycle) {
    // Step `step` runs with the lr DeepSpeed's scheduler set after last_batch_iteration = it - 1,
    // whose scale uses batch index it (the first step: cycle_min_lr).
    const double total = OneCycleTotal(s);
    if (it - 1.0 < total) {
      return s.cycle_min_lr + (s.cycle_max_lr - s.cycle_min_lr) * OneCycleScale(s, it);
    }
    if (s.decay_step_size == 0 || s.decay_lr_rate == 0) return s.cycle_min_lr;
    const double k = it - total;  // steps since the cycle ended
    return s.cycle_min_lr / (1.0 + s.decay_lr_rate * k / static_cast<double>(s.decay_step_size));
  }
  // Note [warmup schedules' first steps]: DeepSpeed's WarmupLR, WarmupDecayLR and
  // WarmupCosineLR write their lr for last_batch_iteration = -1 when they are built and step
  // after each optimizer step, so step `step` runs with last_batch_iteration = step - 2: the
  // first step at the start value (min lr; 0 for the cosine), the second at iteration 0, whose
  // warmup gamma is 0 too. Their warmup is at least 2 steps long.
  const int64_t last = step - 2;
  const double warm = static_cast<double>(std::max<int64_t>(2, s.warmup_num_steps));
  const double b = static_cast<double>(last);
  const double warmup_gamma = s.warmup_type == WarmupType::kLinear ? b / warm
                                                                    : std::log(b + 1.0) / std::log(warm);
  if (s.type == SchedulerType::kWarmupCosineLR) {
    if (last < 0) return 0.0;
    double ratio;
    if (b < warm) {
      ratio = s.warmup_min_ratio + (1.0 - s.warmup_min_ratio) * warmup_gamma;
    } else {
      // Past total_num_steps the ratio stays at cos_min_ratio (DeepSpeed 0.19 clamps the
      // cosine's progress to 1; earlier releases swung back up).
      const double total = std::max(1.0, static_cast<double>(s.total_num_steps) - warm);
      const double progress = std::min(1.0, (b - warm + 1.0) / total);
      const double cosine = (1.0 + std::cos(M_PI * progress)) / 2.0;
      ratio = std::max(0.0, s.cos_min_ratio + (1.0 - s.cos_min_ratio) * cosine);
    }
    return group_lr * ratio;
  }
  if (last < 0) return s.warmup_min_lr;
  double gamma;
  if (b < warm) {
    gamma = warmup_gamma;
  } else if (s.type == SchedulerType::kWarmupLR) {
    gamma = 1.0;
  } else {  // WarmupDecayLR: linear down to 0 at total_num_steps
    gamma = std::max(0.0, (static_cast<double>(s.total_num_steps) - b) /
                              std::max(1.0, static_cast<double>(s.total_num_steps) - warm));
  }
  return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
}

std::optional<std::pair<double, double>> ScheduledBetas(const Config& config, int64_t step) {
  const SchedulerConfig& s = config.scheduler;
  const OptimizerType t = config.optimizer.type;
  const bool has_betas =
      t == OptimizerType::kAdam || t == OptimizerType::kAdamW || t == OptimizerType::kLion;
  if (s.type != SchedulerType::kOneCycle || !s.cycle_momentum || !has_betas) return std::nullopt;
  constexpr double kBeta2 = 0.99;  // what DeepSpeed's OneCycle writes into betas[1]
  // The first step runs with what DeepSpeed's constructor writes: (cycle_min_mom, 0.99).
  if (step <= 1) return std::make_pair(s.cycle_min_mom, kBeta2);
  const double it = static_cast<double>(step - 1);
  const double total = OneCycleTotal(s);
  if (it - 1.0 < total) {
    return std::make_pair(s.cycle_max_mom - (s.cycle_max_mom - s.cycle_min_mom) * OneCycleScale(s, it),
                          kBeta2);
  }
  if (s.decay_step_size == 0 || s.decay_mom_rate == 0) return std::make_pair(s.cycle_max_mom, kBeta2);
  const double k = it - total;
  return std::make_pair(
      s.cycle_max_mom * (1.0 + s.decay_mom_rate * k / static_cast<double>(s.decay_step_size)), kBeta2);
}

Status CheckScheduledBetas(const Config& config, int64_t step) {
  const auto betas = ScheduledBetas(config, step);
  if (!betas || betas->first < 1.0) return Status::Ok();
  const SchedulerConfig& s = config.scheduler;
  return InvalidArgument(
      StrCat("scheduler OneCycle: its momentum decay (decay_mom_rate ", s.decay_mom_rate,
             " per decay_step_size ", s.decay_step_size,
             " steps after the cycle, from cycle_max_mom ", s.cycle_max_mom, ") takes betas[0] to ",
             betas->first, " at step ", step, ", and ", OptimizerTypeName(config.optimizer.type),
             " needs betas[0] below 1; lower scheduler.params.decay_mom_rate, or set "
             "scheduler.params.cycle_momentum to false"));
}

}  // namespace strata
