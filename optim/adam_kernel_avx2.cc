// AVX2 + FMA + F16C kernels. Compiled with those flags; called only when cpu_adam.cc has
// checked the CPU has them.
//
// The loop body mirrors AdamElement (adam_kernels.h) operation for operation; the tail (< 8
// elements) runs AdamElement itself with the scalar conversions, which give the same bits.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "optim/adam_kernels.h"

namespace strata::optim::internal {
namespace {

constexpr size_t kW = 8;

template <DType T>
inline __m256 Load(const void* base, size_t i) {
  if constexpr (T == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (T == DType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// fp32 -> bf16 with the same rule as FloatToBf16.
inline __m128i Bf16Bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i bias =
      _mm256_add_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan_bits = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, nan_bits, is_nan);
  // Every lane is <= 0xffff, so the saturating pack is exact; it packs within 128-bit halves,
  // and the permute gathers the two useful quarters.
  const __m256i packed = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

template <DType T, bool kStream = false>
inline void Store(void* base, size_t i, __m256 x) {
  if constexpr (T == DType::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, x);
  } else {
    __m128i h;
    if constexpr (T == DType::kBFloat16) {
      h = Bf16Bits(x);
    } else {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __m128i* p = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i);
    if constexpr (kStream) _mm_stream_si128(p, h);
    else _mm_storeu_si128(p, h);
  }
}

template <DType T>
inline float LoadOne(const void* base, size_t i) {
  if constexpr (T == DType::kFloat32) return static_cast<const float*>(base)[i];
  else if constexpr (T == DType::kBFloat16) return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
  else return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
}

template <DType T>
inline void StoreOne(void* base, size_t i, float x) {
  if constexpr (T == DType::kFloat32) static_cast<float*>(base)[i] = x;
  else if constexpr (T == DType::kBFloat16) static_cast<uint16_t*>(base)[i] = FloatToBf16(x);
  else static_cast<uint16_t*>(base)[i] = FloatToHalf(x);
}

struct VecConsts {
  explicit VecConsts(const AdamConsts& c)
      : grad_scale(_mm256_set1_ps(c.grad_scale)),
        beta1(_mm256_set1_ps(c.beta1)),
        one_minus_beta1(_mm256_set1_ps(c.one_minus_beta1)),
        beta2(_mm256_set1_ps(c.beta2)),
        one_minus_beta2(_mm256_set1_ps(c.one_minus_beta2)),
        eps(_mm256_set1_ps(c.eps)),
        neg_step_size(_mm256_set1_ps(c.neg_step_size)),
        inv_sqrt_bc2(_mm256_set1_ps(c.inv_sqrt_bc2)),
        l2(_mm256_set1_ps(c.l2)),
        decay(_mm256_set1_ps(c.decay)) {}
  __m256 grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, neg_step_size,
      inv_sqrt_bc2, l2, decay;
};

template <DType G, DType S, P16 P, bool kL2, bool kDecay, bool kStream>
void AdamLoop(const AdamKernelArgs& a, size_t begin, size_t end) {
  const VecConsts c(a.c);
  size_t i = begin;
  for (; i + kW <= end; i += kW) {
    __m256 p = Load<DType::kFloat32>(a.master, i);
    __m256 g = _mm256_mul_ps(Load<G>(a.grad, i), c.grad_scale);
    __m256 m = Load<S>(a.exp_avg, i);
    __m256 v = Load<S>(a.exp_avg_sq, i);
    if constexpr (kL2) g = _mm256_fmadd_ps(c.l2, p, g);
    if constexpr (kDecay) p = _mm256_mul_ps(p, c.decay);
    m = _mm256_fmadd_ps(c.beta1, m, _mm256_mul_ps(c.one_minus_beta1, g));
    v = _mm256_fmadd_ps(c.beta2, v, _mm256_mul_ps(c.one_minus_beta2, _mm256_mul_ps(g, g)));
    const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), c.inv_sqrt_bc2, c.eps);
    p = _mm256_fmadd_ps(c.neg_step_size, _mm256_div_ps(m, denom), p);
    Store<DType::kFloat32>(a.master, i, p);
    Store<S>(a.exp_avg, i, m);
    Store<S>(a.exp_avg_sq, i, v);
    if constexpr (P == P16::kBf16) Store<DType::kBFloat16, kStream>(a.param16, i, p);
    if constexpr (P == P16::kFp16) Store<DType::kFloat16, kStream>(a.param16, i, p);
  }
  if constexpr (kStream) _mm_sfence();
  for (; i < end; ++i) {
    float p = a.master[i];
    float m = LoadOne<S>(a.exp_avg, i);
    float v = LoadOne<S>(a.exp_avg_sq, i);
    AdamElement(a.c, p, LoadOne<G>(a.grad, i), m, v);
    a.master[i] = p;
    StoreOne<S>(a.exp_avg, i, m);
    StoreOne<S>(a.exp_avg_sq, i, v);
    if constexpr (P == P16::kBf16) StoreOne<DType::kBFloat16>(a.param16, i, p);
    if constexpr (P == P16::kFp16) StoreOne<DType::kFloat16>(a.param16, i, p);
  }
}

template <DType G, DType S, P16 P, bool kStream>
void AdamDecay(const AdamKernelArgs& a, size_t begin, size_t end) {
  if (a.c.has_l2) {
    AdamLoop<G, S, P, true, false, kStream>(a, begin, end);
  } else if (a.c.has_decay) {
    AdamLoop<G, S, P, false, true, kStream>(a, begin, end);
  } else {
    AdamLoop<G, S, P, false, false, kStream>(a, begin, end);
  }
}

// Streaming stores for the 16-bit copy when it is 16-byte aligned: see
// Note [streaming param16 stores] in adam_kernel_avx512.cc.
template <DType G, DType S, P16 P>
void Adam256(const AdamKernelArgs& a, size_t begin, size_t end) {
  if constexpr (P != P16::kNone) {
    const auto addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(a.param16) + begin);
    if (addr % 16 == 0) {
      AdamDecay<G, S, P, true>(a, begin, end);
      return;
    }
  }
  AdamDecay<G, S, P, false>(a, begin, end);
}

// Several interleaved streams keep more misses in flight: Note [interleaved scan] in
// adam_kernel_avx512.cc.
constexpr size_t kStreams = 4;

template <DType G>
inline void StatsVector(const void* grad, size_t i, __m256 scale, __m256d& s0, __m256d& s1,
                        __m256& poison) {
  const __m256 x = _mm256_mul_ps(Load<G>(grad, i), scale);
  poison = _mm256_fmadd_ps(x, _mm256_setzero_ps(), poison);  // NaN once any x is inf or NaN
  const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  s0 = _mm256_fmadd_pd(lo, lo, s0);
  s1 = _mm256_fmadd_pd(hi, hi, s1);
}

template <DType G>
GradPartial Stats256(const void* grad, float scale, size_t begin, size_t end) {
  const __m256 vscale = _mm256_set1_ps(scale);
  __m256d s0[kStreams], s1[kStreams];
  __m256 poison[kStreams];
  for (size_t k = 0; k < kStreams; ++k) {
    s0[k] = s1[k] = _mm256_setzero_pd();
    poison[k] = _mm256_setzero_ps();
  }
  const size_t part = (end - begin) / kStreams / kW * kW;
  for (size_t j = 0; j < part; j += kW) {
    for (size_t k = 0; k < kStreams; ++k) {
      StatsVector<G>(grad, begin + k * part + j, vscale, s0[k], s1[k], poison[k]);
    }
  }
  size_t i = begin + kStreams * part;
  for (; i + kW <= end; i += kW) StatsVector<G>(grad, i, vscale, s0[0], s1[0], poison[0]);
  __m256d sum = _mm256_setzero_pd();
  __m256 bad = _mm256_setzero_ps();
  for (size_t k = 0; k < kStreams; ++k) {
    sum = _mm256_add_pd(sum, _mm256_add_pd(s0[k], s1[k]));
    bad = _mm256_add_ps(bad, poison[k]);
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, sum);
  GradPartial r;
  r.sum_sq = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  r.nonfinite = _mm256_movemask_ps(_mm256_cmp_ps(bad, bad, _CMP_UNORD_Q)) != 0;
  for (; i < end; ++i) {
    const float x = LoadOne<G>(grad, i) * scale;
    if (!std::isfinite(x)) r.nonfinite = true;
    r.sum_sq += static_cast<double>(x) * x;
  }
  return r;
}

template <DType G, DType S>
AdamKernelFn PickP16(P16 p16) {
  switch (p16) {
    case P16::kNone: return &Adam256<G, S, P16::kNone>;
    case P16::kBf16: return &Adam256<G, S, P16::kBf16>;
    case P16::kFp16: return &Adam256<G, S, P16::kFp16>;
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

AdamKernelFn GetAdamKernelAvx2(DType grad, DType state, P16 p16) {
  switch (grad) {
    case DType::kFloat32: return PickState<DType::kFloat32>(state, p16);
    case DType::kBFloat16: return PickState<DType::kBFloat16>(state, p16);
    case DType::kFloat16: return PickState<DType::kFloat16>(state, p16);
  }
  return nullptr;
}

GradStatsFn GetGradStatsAvx2(DType grad) {
  switch (grad) {
    case DType::kFloat32: return &Stats256<DType::kFloat32>;
    case DType::kBFloat16: return &Stats256<DType::kBFloat16>;
    case DType::kFloat16: return &Stats256<DType::kFloat16>;
  }
  return nullptr;
}

}  // namespace strata::optim::internal
