#include "runtime/lr_schedule.h"

#include <algorithm>
#include <cmath>

namespace strata {

double LearningRate(const Config& config, int64_t step) {
  const SchedulerConfig& s = config.scheduler;
  if (s.type == SchedulerType::kNone) return config.optimizer.lr;
  // DeepSpeed counts scheduler iterations from 0 at the first step.
  const double it = static_cast<double>(std::max<int64_t>(step - 1, 0));
  const double warm = static_cast<double>(s.warmup_num_steps);
  if (it < warm) {
    // DeepSpeed's WarmupLR: gamma = it / warm (linear) or log(it + 1) / log(warm) (log, with
    // warm at least 2 so the log is defined).
    const double gamma = s.warmup_type == WarmupType::kLinear
                             ? it / warm
                             : std::log(it + 1.0) / std::log(std::max(2.0, warm));
    return s.warmup_min_lr + (s.warmup_max_lr - s.warmup_min_lr) * gamma;
  }
  if (s.type == SchedulerType::kWarmupLR) return s.warmup_max_lr;
  const double total = static_cast<double>(s.total_num_steps);
  const double span = std::max(1.0, total - warm);
  const double frac = std::clamp((it - warm) / span, 0.0, 1.0);
  if (s.type == SchedulerType::kWarmupDecayLR) return s.warmup_max_lr * (1.0 - frac);
  return s.warmup_max_lr * 0.5 * (1.0 + std::cos(M_PI * frac));
}

}  // namespace strata
