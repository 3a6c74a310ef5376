#include "optim/cpu_sgd.h"

#include <algorithm>
#include <cmath>

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

namespace strata::optim {
namespace {

constexpr size_t kDefaultGrain = size_t{64} << 10;

Status Validate(const SgdParams& p, const SgdBuffers& b, float grad_scale) {
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

internal::SgdConsts ConstsOf(const SgdParams& p, float grad_scale) {
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

void Store16(const float* src, void* dst, DType dtype, size_t n) {
  auto* d = static_cast<uint16_t*>(dst);
  if (dtype == DType::kBFloat16) {
    for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
  }
}

}  // namespace

StatusOr<Isa> SgdStep(const SgdParams& params, const SgdBuffers& bufs, float grad_scale,
                      const SgdOptions& options) {
  STRATA_RETURN_IF_ERROR(Validate(params, bufs, grad_scale));
  Isa isa = options.isa == Isa::kAuto ? ResolveAutoIsa() : options.isa;
  if (!IsaSupported(isa))
    return InvalidArgument(StrCat("isa=", IsaName(isa), ": this CPU does not support it"));
  if (bufs.n == 0) return isa;
  auto* block = isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16 ? internal::SgdBlockAvx512
                : isa == Isa::kAvx2                            ? internal::SgdBlockAvx2
                                                               : internal::SgdBlockScalar;
  const internal::SgdConsts c = ConstsOf(params, grad_scale);
  const size_t n = bufs.n;
  const size_t grain = options.grain == 0 ? kDefaultGrain : options.grain;
  auto body = [&](size_t begin, size_t end) {
    block(c, bufs.master + begin, bufs.grad + begin,
          bufs.momentum != nullptr ? bufs.momentum + begin : nullptr, end - begin);
    if (bufs.param16 != nullptr) {
      Store16(bufs.master + begin, static_cast<uint16_t*>(bufs.param16) + begin,
              bufs.param16_dtype, end - begin);
    }
  };
  const size_t blocks = (n + grain - 1) / grain;
  if (blocks <= 1) {
    body(0, n);
  } else {
    auto run = [&] {
      tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 1),
                        [&](const tbb::blocked_range<size_t>& r) {
                          body(r.begin() * grain, std::min(n, r.end() * grain));
                        },
                        tbb::static_partitioner());
    };
    if (options.arena != nullptr) {
      options.arena->execute(run);
    } else {
      run();
    }
  }
  return isa;
}

void SgdReference(const SgdParams& params, const SgdBuffers& bufs, float grad_scale) {
  const float lr = static_cast<float>(params.lr), mom = static_cast<float>(params.momentum);
  const float omd = static_cast<float>(1.0 - params.dampening);
  const float wd = static_cast<float>(params.weight_decay);
  for (size_t i = 0; i < bufs.n; ++i) {
    float g = bufs.grad[i] * grad_scale;
    if (params.weight_decay != 0) g = g + wd * bufs.master[i];  // torch adds no decay term at 0
    if (params.momentum != 0) {
      const float b = params.first ? g : mom * bufs.momentum[i] + omd * g;
      bufs.momentum[i] = b;
      g = params.nesterov ? g + mom * b : b;
    }
    bufs.master[i] = bufs.master[i] - lr * g;
    if (bufs.param16 != nullptr) {
      auto* d = static_cast<uint16_t*>(bufs.param16);
      d[i] = bufs.param16_dtype == DType::kBFloat16 ? FloatToBf16(bufs.master[i])
                                                    : FloatToHalf(bufs.master[i]);
    }
  }
}

}  // namespace strata::optim
