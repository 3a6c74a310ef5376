// The scalar kernels: the reference the vector paths are tested against, and the path for
// x86-64 CPUs without AVX2. Compiled for the baseline ISA.
#include <cmath>
#include <cstdint>

#include "optim/adam_kernels.h"

namespace strata::optim::internal {
namespace {

template <DType T>
inline float Load(const void* base, size_t i) {
  if constexpr (T == DType::kFloat32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == DType::kBFloat16) {
    return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
  } else {
    return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
  }
}

template <DType T>
inline void Store(void* base, size_t i, float x) {
  if constexpr (T == DType::kFloat32) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (T == DType::kBFloat16) {
    static_cast<uint16_t*>(base)[i] = FloatToBf16(x);
  } else {
    static_cast<uint16_t*>(base)[i] = FloatToHalf(x);
  }
}

template <DType G, DType S, P16 P>
void AdamScalar(const AdamKernelArgs& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float p = a.master[i];
    float m = Load<S>(a.exp_avg, i);
    float v = Load<S>(a.exp_avg_sq, i);
    AdamElement(a.c, p, Load<G>(a.grad, i), m, v);
    a.master[i] = p;
    Store<S>(a.exp_avg, i, m);
    Store<S>(a.exp_avg_sq, i, v);
    if constexpr (P == P16::kBf16) Store<DType::kBFloat16>(a.param16, i, p);
    if constexpr (P == P16::kFp16) Store<DType::kFloat16>(a.param16, i, p);
  }
}

template <DType G>
GradPartial GradStatsScalar(const void* grad, float scale, size_t begin, size_t end) {
  GradPartial r;
  for (size_t i = begin; i < end; ++i) {
    const float x = Load<G>(grad, i) * scale;
    if (!std::isfinite(x)) r.nonfinite = true;
    r.sum_sq += static_cast<double>(x) * x;
  }
  return r;
}

template <DType G, DType S>
AdamKernelFn PickP16(P16 p16) {
  switch (p16) {
    case P16::kNone: return &AdamScalar<G, S, P16::kNone>;
    case P16::kBf16: return &AdamScalar<G, S, P16::kBf16>;
    case P16::kFp16: return &AdamScalar<G, S, P16::kFp16>;
  }
  return nullptr;
}

template <DType G>
AdamKernelFn PickState(DType state, P16 p16) {
  if (state == DType::kFloat32) return PickP16<G, DType::kFloat32>(p16);
  if (state == DType::kBFloat16) return PickP16<G, DType::kBFloat16>(p16);
  return nullptr;
}

}  // namespace

AdamKernelFn GetAdamKernelScalar(DType grad, DType state, P16 p16) {
  switch (grad) {
    case DType::kFloat32: return PickState<DType::kFloat32>(state, p16);
    case DType::kBFloat16: return PickState<DType::kBFloat16>(state, p16);
    case DType::kFloat16: return PickState<DType::kFloat16>(state, p16);
  }
  return nullptr;
}

GradStatsFn GetGradStatsScalar(DType grad) {
  switch (grad) {
    case DType::kFloat32: return &GradStatsScalar<DType::kFloat32>;
    case DType::kBFloat16: return &GradStatsScalar<DType::kBFloat16>;
    case DType::kFloat16: return &GradStatsScalar<DType::kFloat16>;
  }
  return nullptr;
}

}  // namespace strata::optim::internal
