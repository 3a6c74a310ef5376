#include "optim/cpu_sgd.h"

#include <cmath>

#include "optim/blockwise.h"

namespace strata::optim {

Status CheckSgdArguments(const SgdParams& p, const SgdBuffers& b, float grad_scale) {
  auto bad = [](const char* what, double v, const char* rule) {
    return InvalidArgument(StrCat("SGD ", what, "=", v, ": ", rule));
  };
  if (!std::isfinite(p.lr) || p.lr < 0) return bad("lr", p.lr, "must be finite and >= 0");
  if (!std::isfinite(p.momentum) || p.momentum < 0)
    return bad("momentum", p.momentum, "must be finite and >= 0");
  if (!std::isfinite(p.dampening) || p.dampening < 0)
    return bad("dampening", p.dampening, "must be finite and >= 0");
  if (!std::isfinite(p.weight_decay) || p.weight_decay < 0)
    return bad("weight_decay", p.weight_decay, "must be finite and >= 0");
  if (p.nesterov && (p.momentum <= 0 || p.dampening != 0))
    return InvalidArgument("SGD nesterov=true needs momentum > 0 and dampening = 0 (as torch.optim.SGD)");
  if (!std::isfinite(grad_scale) || grad_scale < 0)
    return bad("grad_scale", grad_scale, "must be finite and >= 0");
  if (b.n > 0 && (b.master == nullptr || b.grad == nullptr ||
                  (p.momentum != 0 && b.momentum == nullptr)))
    return InvalidArgument("SGD: null master, grad or (with momentum) momentum buffer");
  if (b.param16 != nullptr && b.param16_dtype != DType::kBFloat16 && b.param16_dtype != DType::kFloat16)
    return InvalidArgument("SGD: param16 must be bf16 or fp16");
  return Status::Ok();
}

internal::SgdConsts internal::MakeSgdConsts(const SgdParams& p, float grad_scale) {
  internal::SgdConsts c;
  c.lr = static_cast<float>(p.lr);
  c.momentum = static_cast<float>(p.momentum);
  c.one_minus_dampening = static_cast<float>(1.0 - p.dampening);
  c.weight_decay = static_cast<float>(p.weight_decay);
  c.grad_scale = grad_scale;
  c.has_momentum = p.momentum != 0;
  c.nesterov = p.nesterov;
  c.first = p.first;
  c.has_decay = p.weight_decay != 0;
  return c;
}

StatusOr<Isa> SgdStep(const SgdParams& params, const SgdBuffers& bufs, float grad_scale,
                      const SgdOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckSgdArguments(params, bufs, grad_scale));
  STRATA_ASSIGN_OR_RETURN(const Isa isa, internal::ChooseIsa(options.isa, "SGD"));
  auto* block = internal::PickBlock(isa, &internal::SgdBlockScalar, &internal::SgdBlockAvx2,
                                    &internal::SgdBlockAvx512);
  const internal::SgdConsts c = internal::MakeSgdConsts(params, grad_scale);
  internal::ForEachBlock(bufs.n, options.grain, options.arena, [&](size_t begin, size_t end) {
    block(c, bufs.master + begin, bufs.grad + begin,
          bufs.momentum != nullptr ? bufs.momentum + begin : nullptr, end - begin);
    if (bufs.param16 != nullptr) {
      internal::StoreParam16(bufs.master + begin, static_cast<uint16_t*>(bufs.param16) + begin,
                             bufs.param16_dtype, end - begin);
    }
  });
  return isa;
}

void SgdReference(const SgdParams& params, const SgdBuffers& bufs, float grad_scale) {
  const internal::SgdConsts c = internal::MakeSgdConsts(params, grad_scale);
  float unused = 0.0f;
  for (size_t i = 0; i < bufs.n; ++i) {
    internal::SgdElement(c, bufs.master[i], bufs.grad[i],
                         bufs.momentum != nullptr ? bufs.momentum[i] : unused);
    if (bufs.param16 != nullptr) {
      internal::StoreParam16(&bufs.master[i], static_cast<uint16_t*>(bufs.param16) + i,
                             bufs.param16_dtype, 1);
    }
  }
}

}  // namespace strata::optim
