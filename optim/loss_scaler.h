// Loss scaling for fp16 training, with DeepSpeed's semantics so a ds_config's "fp16" block
// behaves the same here.
//
// Static (fp16.loss_scale > 0): the scale never changes; an overflowing step is still skipped
// (as DeepSpeed's ZeRO optimizers do).
// Dynamic (fp16.loss_scale == 0): the scale starts at 2^initial_scale_power. After each step the
// engine calls Update(overflow):
//   overflow: if the hysteresis budget is down to 1 (or hysteresis == 1), the scale halves,
//             clamped at min_loss_scale; otherwise the budget drops by one and the scale stays.
//             The step is skipped either way.
//   no overflow: when loss_scale_window steps have passed since the last overflow (or since
//             the start), the scale doubles. The hysteresis budget is restored at that point
//             (or after every good step with consecutive_hysteresis).
// An overflow while the scale already sits at min_loss_scale is an error when
// fail_at_min_scale is set (DeepSpeed raises there): training cannot make progress.
//
// Thread safety: none; one scaler per engine, driven by the step loop.
#pragma once

#include <cstdint>

#include "runtime/base/config.h"
#include "runtime/base/status.h"

namespace strata::optim {

struct LossScalerOptions {
  double loss_scale = 0.0;          // 0: dynamic; > 0: static scale
  int64_t initial_scale_power = 16;  // dynamic: first scale is 2^this
  int64_t loss_scale_window = 1000;  // good steps between doublings
  int64_t hysteresis = 2;            // overflows tolerated before the scale halves
  double min_loss_scale = 1.0;
  bool consecutive_hysteresis = false;  // restore hysteresis after every good step
  bool fail_at_min_scale = true;        // overflow at min_loss_scale returns an error
};

class DynamicLossScaler {
 public:
  // Validates: loss_scale >= 0 and finite, initial_scale_power in 0..127 (2^128 overflows fp32),
  // loss_scale_window >= 1, hysteresis >= 1, min_loss_scale > 0. INVALID_ARGUMENT otherwise,
  // naming the fp16.* key.
  static StatusOr<DynamicLossScaler> Create(const LossScalerOptions& options);
  // From the parsed "fp16" block (consecutive_hysteresis false, fail_at_min_scale true).
  static StatusOr<DynamicLossScaler> FromConfig(const Fp16Config& fp16);

  bool dynamic() const { return options_.loss_scale == 0.0; }
  // The factor the loss is multiplied by before backward.
  double scale() const { return scale_; }
  // 1 / scale(): what gradients are multiplied by (AdamStep's grad_scale, times clip_coef).
  double inv_scale() const { return 1.0 / scale_; }
  // Overflows still tolerated before the next one halves the scale.
  int64_t hysteresis_left() const { return hysteresis_left_; }
  // Steps seen by Update, skipped ones included.
  int64_t iteration() const { return iter_; }

  // What a checkpoint keeps so that a resumed run scales as the uninterrupted one would: the
  // scale, the hysteresis budget, the step count and the last overflow's step.
  struct State {
    double scale = 1.0;
    int64_t hysteresis_left = 1;
    int64_t iteration = 0;
    int64_t last_overflow_iteration = -1;
  };
  State state() const { return {scale_, hysteresis_left_, iter_, last_overflow_iter_}; }
  // Takes a saved state. A static scaler keeps its configured scale and takes the counts only;
  // a budget above this config's fp16.hysteresis is capped at it. INVALID_ARGUMENT, leaving the
  // scaler as it was, when the state could not have come from a scaler (a scale that is not
  // finite and positive, a budget below 1, an iteration below 0, a last overflow outside
  // -1..iteration-1).
  Status Restore(const State& saved);

  // Records the outcome of one step (overflow = inf/NaN found in the scaled grads, i.e. the
  // step was skipped) and adjusts the scale. Returns FAILED_PRECONDITION when an overflow
  // happens at min_loss_scale and fail_at_min_scale is set; the scaler's state is still updated.
  Status Update(bool overflow);

 private:
  explicit DynamicLossScaler(const LossScalerOptions& options);

  LossScalerOptions options_;
  double scale_ = 1.0;
  int64_t hysteresis_left_ = 1;
  int64_t iter_ = 0;
  int64_t last_overflow_iter_ = -1;
};

}  // namespace strata::optim
