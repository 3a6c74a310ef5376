#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "runtime/base/check.h"

namespace strata::optim {

StatusOr<DynamicLossScaler> DynamicLossScaler::Create(const LossScalerOptions& o) {
  STRATA_CHECK(std::isfinite(o.loss_scale) && o.loss_scale >= 0, "fp16.loss_scale=", o.loss_scale,
               ": must be 0 (dynamic) or a positive static scale such as 1024");
  STRATA_CHECK(o.initial_scale_power >= 0 && o.initial_scale_power <= 127,
               "fp16.initial_scale_power=", o.initial_scale_power,
               ": must be in 0..127 (the first scale is 2^power; DeepSpeed's default is 16)");
  STRATA_CHECK(o.loss_scale_window >= 1, "fp16.loss_scale_window=", o.loss_scale_window,
               ": must be >= 1 (default 1000)");
  STRATA_CHECK(o.hysteresis >= 1, "fp16.hysteresis=", o.hysteresis, ": must be >= 1 (default 2)");
  STRATA_CHECK(std::isfinite(o.min_loss_scale) && o.min_loss_scale > 0, "fp16.min_loss_scale=",
               o.min_loss_scale, ": must be finite and > 0 (default 1)");
  return DynamicLossScaler(o);
}

StatusOr<DynamicLossScaler> DynamicLossScaler::FromConfig(const Fp16Config& fp16) {
  LossScalerOptions o;
  o.loss_scale = fp16.loss_scale;
  o.initial_scale_power = fp16.initial_scale_power;
  o.loss_scale_window = fp16.loss_scale_window;
  o.hysteresis = fp16.hysteresis;
  // DeepSpeed reads min_loss_scale 0 as "no floor"; the smallest normal double is the same in
  // practice and keeps the scaler's own check (> 0) meaningful.
  o.min_loss_scale = fp16.min_loss_scale > 0 ? fp16.min_loss_scale : std::numeric_limits<double>::min();
  return Create(o);
}

DynamicLossScaler::DynamicLossScaler(const LossScalerOptions& options)
    : options_(options),
      scale_(options.loss_scale > 0 ? options.loss_scale
                                    : std::ldexp(1.0, static_cast<int>(options.initial_scale_power))),
      hysteresis_left_(options.hysteresis) {}

Status DynamicLossScaler::Restore(const State& saved) {
  if (!(std::isfinite(saved.scale) && saved.scale > 0) || saved.hysteresis_left < 1 ||
      saved.iteration < 0 || saved.last_overflow_iteration < -1 ||
      saved.last_overflow_iteration >= saved.iteration)
    return InvalidArgument(StrCat("loss-scaler state (scale ", saved.scale, ", hysteresis left ",
                                  saved.hysteresis_left, ", iteration ", saved.iteration,
                                  ", last overflow at ", saved.last_overflow_iteration,
                                  ") is not one a scaler can be in"));
  if (dynamic()) scale_ = saved.scale;
  // A config whose fp16.hysteresis was lowered since the save caps the budget.
  hysteresis_left_ = std::min(saved.hysteresis_left, options_.hysteresis);
  iter_ = saved.iteration;
  last_overflow_iter_ = saved.last_overflow_iteration;
  return Status::Ok();
}

Status DynamicLossScaler::Update(bool overflow) {
  Status status;
  if (!dynamic()) {
    ++iter_;
    return status;
  }
  if (overflow) {
    if (options_.hysteresis == 1 || hysteresis_left_ == 1) {
      if (scale_ <= options_.min_loss_scale && options_.fail_at_min_scale) {
        status = FailedPrecondition(StrCat(
            "fp16 overflow at the minimum loss scale (fp16.min_loss_scale=", options_.min_loss_scale,
            ") at iteration ", iter_,
            ": gradients are inf/NaN even unscaled; lower the learning rate, check the data, or "
            "train in bf16"));
      }
      scale_ = std::max(scale_ / 2.0, options_.min_loss_scale);
    } else {
      --hysteresis_left_;
    }
    last_overflow_iter_ = iter_;
  } else {
    if (options_.consecutive_hysteresis) hysteresis_left_ = options_.hysteresis;
    if ((iter_ - last_overflow_iter_) % options_.loss_scale_window == 0) {
      if (!options_.consecutive_hysteresis) hysteresis_left_ = options_.hysteresis;
      scale_ *= 2.0;
    }
  }
  ++iter_;
  return status;
}

}  // namespace strata::optim
