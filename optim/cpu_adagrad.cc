#include "optim/cpu_adagrad.h"

#include <cmath>

namespace strata::optim {

Status CheckAdagradArguments(const AdagradParams& p, const AdagradBuffers& b, float grad_scale) {
  auto bad = [](const char* what, double v, const char* rule) {
    return InvalidArgument(StrCat("Adagrad ", what, "=", v, ": ", rule));
  };
  if (!std::isfinite(p.lr) || p.lr < 0) return bad("lr", p.lr, "must be finite and >= 0");
  if (!std::isfinite(p.lr_decay) || p.lr_decay < 0)
    return bad("lr_decay", p.lr_decay, "must be finite and >= 0");
  if (!std::isfinite(p.eps) || p.eps <= 0) return bad("eps", p.eps, "must be finite and > 0, e.g. 1e-10");
  if (!std::isfinite(p.weight_decay) || p.weight_decay < 0)
    return bad("weight_decay", p.weight_decay, "must be finite and >= 0");
  if (p.step < 1) return bad("step", static_cast<double>(p.step), "must be >= 1 (the first update is step 1)");
  if (!std::isfinite(grad_scale) || grad_scale < 0)
    return bad("grad_scale", grad_scale, "must be finite and >= 0");
  if (b.n > 0 && (b.master == nullptr || b.grad == nullptr || b.sum == nullptr))
    return InvalidArgument("Adagrad: null master, grad or sum buffer");
  if (b.param16 != nullptr && b.param16_dtype != DType::kBFloat16 && b.param16_dtype != DType::kFloat16)
    return InvalidArgument("Adagrad: param16 must be bf16 or fp16");
  return Status::Ok();
}

internal::AdagradConsts internal::MakeAdagradConsts(const AdagradParams& p, float grad_scale) {
  internal::AdagradConsts c;
  c.clr = static_cast<float>(p.lr / (1.0 + static_cast<double>(p.step - 1) * p.lr_decay));
  c.eps = static_cast<float>(p.eps);
  c.weight_decay = static_cast<float>(p.weight_decay);
  c.grad_scale = grad_scale;
  c.has_decay = p.weight_decay != 0;
  return c;
}

StatusOr<Isa> AdagradStep(const AdagradParams& params, const AdagradBuffers& bufs,
                          float grad_scale, const ElementwiseOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckAdagradArguments(params, bufs, grad_scale));
  STRATA_ASSIGN_OR_RETURN(const Isa isa, internal::ChooseIsa(options.isa, "Adagrad"));
  auto* block = internal::PickBlock(isa, &internal::AdagradBlockScalar,
                                    &internal::AdagradBlockAvx2, &internal::AdagradBlockAvx512);
  const internal::AdagradConsts c = internal::MakeAdagradConsts(params, grad_scale);
  internal::ForEachBlock(bufs.n, options.grain, options.arena, [&](size_t begin, size_t end) {
    block(c, bufs.master + begin, bufs.grad + begin, bufs.sum + begin, end - begin);
    if (bufs.param16 != nullptr) {
      internal::StoreParam16(bufs.master + begin, static_cast<uint16_t*>(bufs.param16) + begin,
                             bufs.param16_dtype, end - begin);
    }
  });
  return isa;
}

void AdagradReference(const AdagradParams& params, const AdagradBuffers& bufs, float grad_scale) {
  // Written out from the formula in cpu_adagrad.h, not through AdagradElement, so that the test
  // compares two codings of the rule.
  const float clr = static_cast<float>(params.lr /
                                       (1.0 + static_cast<double>(params.step - 1) * params.lr_decay));
  const float eps = static_cast<float>(params.eps), wd = static_cast<float>(params.weight_decay);
  for (size_t i = 0; i < bufs.n; ++i) {
    float g = bufs.grad[i] * grad_scale;
    if (params.weight_decay != 0) g = g + wd * bufs.master[i];
    bufs.sum[i] = bufs.sum[i] + g * g;
    const float std_dev = std::sqrt(bufs.sum[i]) + eps;
    bufs.master[i] = bufs.master[i] - clr * (g / std_dev);
    if (bufs.param16 != nullptr) {
      internal::StoreParam16(&bufs.master[i], static_cast<uint16_t*>(bufs.param16) + i,
                             bufs.param16_dtype, 1);
    }
  }
}

}  // namespace strata::optim
