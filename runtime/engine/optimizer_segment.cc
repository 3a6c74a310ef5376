#include "runtime/engine/optimizer_segment.h"

namespace strata {

Segment MakeSegment(const OptimizerConfig& oc, const GroupHyperparameters& gh, int64_t step) {
  const OptimizerType type = oc.type;
  Segment sg;
  sg.ap.lr = gh.lr;
  sg.ap.beta1 = gh.beta1;
  sg.ap.beta2 = gh.beta2;
  sg.ap.eps = gh.eps;
  sg.ap.weight_decay = gh.weight_decay;
  sg.ap.adamw = type == OptimizerType::kAdamW;
  sg.ap.bias_correction = oc.bias_correction;
  sg.ap.step = step;
  sg.sp.lr = gh.lr;
  sg.sp.momentum = gh.momentum;
  sg.sp.dampening = gh.dampening;
  sg.sp.weight_decay = gh.weight_decay;
  sg.sp.nesterov = oc.nesterov;
  sg.sp.first = step == 1;
  sg.gp.lr = gh.lr;
  sg.gp.lr_decay = oc.lr_decay;
  sg.gp.eps = gh.eps;
  sg.gp.weight_decay = gh.weight_decay;
  sg.gp.step = step;
  sg.lp.lr = gh.lr;
  sg.lp.beta1 = gh.beta1;
  sg.lp.beta2 = gh.beta2;
  sg.lp.weight_decay = gh.weight_decay;
  return sg;
}

}  // namespace strata
