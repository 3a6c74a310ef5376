#include "optim/cpu_lion.h"

#include <cmath>

namespace strata::optim {

Status CheckLionArguments(const LionParams& p, const LionBuffers& b, float grad_scale) {
  auto bad = [](const char* what, double v, const char* rule) {
    return InvalidArgument(StrCat("Lion ", what, "=", v, ": ", rule));
  };
  if (!std::isfinite(p.lr) || p.lr < 0) return bad("lr", p.lr, "must be finite and >= 0");
  if (!(p.beta1 >= 0 && p.beta1 < 1)) return bad("beta1", p.beta1, "must be in [0, 1), e.g. 0.9");
  if (!(p.beta2 >= 0 && p.beta2 < 1)) return bad("beta2", p.beta2, "must be in [0, 1), e.g. 0.99");
  if (!std::isfinite(p.weight_decay) || p.weight_decay < 0)
    return bad("weight_decay", p.weight_decay, "must be finite and >= 0");
  if (!std::isfinite(grad_scale) || grad_scale < 0)
    return bad("grad_scale", grad_scale, "must be finite and >= 0");
  if (b.n > 0 && (b.master == nullptr || b.grad == nullptr || b.exp_avg == nullptr))
    return InvalidArgument("Lion: null master, grad or exp_avg buffer");
  if (b.param16 != nullptr && b.param16_dtype != DType::kBFloat16 && b.param16_dtype != DType::kFloat16)
    return InvalidArgument("Lion: param16 must be bf16 or fp16");
  return Status::Ok();
}

internal::LionConsts internal::MakeLionConsts(const LionParams& p, float grad_scale) {
  internal::LionConsts c;
  c.lr = static_cast<float>(p.lr);
  c.beta1 = static_cast<float>(p.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  c.beta2 = static_cast<float>(p.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  c.decay_factor = static_cast<float>(1.0 - p.lr * p.weight_decay);
  c.grad_scale = grad_scale;
  c.has_decay = p.weight_decay != 0;
  return c;
}

StatusOr<Isa> LionStep(const LionParams& params, const LionBuffers& bufs, float grad_scale,
                       const ElementwiseOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckLionArguments(params, bufs, grad_scale));
  STRATA_ASSIGN_OR_RETURN(const Isa isa, internal::ChooseIsa(options.isa, "Lion"));
  auto* block = internal::PickBlock(isa, &internal::LionBlockScalar, &internal::LionBlockAvx2,
                                    &internal::LionBlockAvx512);
  const internal::LionConsts c = internal::MakeLionConsts(params, grad_scale);
  internal::ForEachBlock(bufs.n, options.grain, options.arena, [&](size_t begin, size_t end) {
    block(c, bufs.master + begin, bufs.grad + begin, bufs.exp_avg + begin, end - begin);
    if (bufs.param16 != nullptr) {
      internal::StoreParam16(bufs.master + begin, static_cast<uint16_t*>(bufs.param16) + begin,
                             bufs.param16_dtype, end - begin);
    }
  });
  return isa;
}

void LionReference(const LionParams& params, const LionBuffers& bufs, float grad_scale) {
  // Written out from the formula in cpu_lion.h, not through LionElement.
  const float lr = static_cast<float>(params.lr);
  const float b1 = static_cast<float>(params.beta1), omb1 = static_cast<float>(1.0 - params.beta1);
  const float b2 = static_cast<float>(params.beta2), omb2 = static_cast<float>(1.0 - params.beta2);
  const float keep = static_cast<float>(1.0 - params.lr * params.weight_decay);
  for (size_t i = 0; i < bufs.n; ++i) {
    const float g = bufs.grad[i] * grad_scale;
    const float c = b1 * bufs.exp_avg[i] + omb1 * g;
    if (params.weight_decay != 0) bufs.master[i] = bufs.master[i] * keep;
    const float sign = c > 0 ? 1.0f : c < 0 ? -1.0f : 0.0f;
    bufs.master[i] = bufs.master[i] - lr * sign;
    bufs.exp_avg[i] = b2 * bufs.exp_avg[i] + omb2 * g;
    if (bufs.param16 != nullptr) {
      internal::StoreParam16(&bufs.master[i], static_cast<uint16_t*>(bufs.param16) + i,
                             bufs.param16_dtype, 1);
    }
  }
}

}  // namespace strata::optim
