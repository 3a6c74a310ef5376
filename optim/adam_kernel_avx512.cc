// AVX-512 kernels (F, BW, VL, DQ; BF16 for the variant that uses vcvtneps2bf16). Compiled with
// those flags; called only when cpu_adam.cc has checked the CPU has them.
//
// The loop body mirrors AdamElement (adam_kernels.h) operation for operation; the tail uses
// masked loads and stores, so every element goes through the same vector code.
//
// GCC 12's AVX-512 intrinsics build their pass-through operand from _mm512_undefined_*(), a
// self-initialised variable that -Wuninitialized reports at every inlined use (a false
// positive); the pragmas keep the build -Wall -Wextra clean.
#if !defined(__clang__)  // clang neither warns there nor knows the second group
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

#include "optim/adam_kernels.h"

namespace strata::optim::internal {
namespace {

constexpr size_t kW = 16;

// Note [prefetch]
// Software prefetch of the four read streams 512 elements ahead (2 KB for fp32). It depends on
// the core, so the caller picks it (UseAvx512Prefetch in cpu_adam.cc):
//   - AMD Zen 5 (2 cores, AVX-512): the fp32 step went from 0.89-0.94 of the streaming roofline
//     to 0.99-1.08 with it (1 and 2 threads, three alternating runs each; distances 256, 1024 and
//     2048 were no better). The divide/sqrt chain keeps fewer loads in flight than the roofline
//     loop, and the hardware prefetchers stop at 4 KB page boundaries; the hints cover both.
//   - AMD Zen 4 (2 cores): it costs. Four interleaved rounds, n = 64M, 2 threads: 0.97-0.99 of
//     the roofline with it against 0.99-1.01 without while memory streamed ~2.1 G params/s, and
//     0.85 against 0.99 in the minutes it streamed ~3.6. The AVX2 kernel, which never
//     prefetched, read 0.98-1.00 in the same runs.
// Prefetching past the end of a buffer is harmless (prefetches never fault); the address is
// formed as an integer for that reason.
constexpr size_t kPrefetchElems = 512;

template <DType T>
inline void Prefetch(const void* base, size_t i) {
  constexpr size_t kSize = T == DType::kFloat32 ? 4 : 2;
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) +
                                             (i + kPrefetchElems) * kSize),
               _MM_HINT_T0);
}

template <DType T, bool kMask>
inline __m512 Load(const void* base, size_t i, __mmask16 k) {
  if constexpr (T == DType::kFloat32) {
    const float* p = static_cast<const float*>(base) + i;
    if constexpr (kMask) return _mm512_maskz_loadu_ps(k, p);
    else return _mm512_loadu_ps(p);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i;
    __m256i h;
    if constexpr (kMask) h = _mm256_maskz_loadu_epi16(k, p);
    else h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (T == DType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// fp32 -> bf16 with integer arithmetic; the same rule as FloatToBf16.
inline __m256i Bf16BitsInteger(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

template <bool kInsn>
inline __m256i Bf16Bits(__m512 x) {
  if constexpr (kInsn) {
    __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
    // vcvtneps2bf16 treats subnormal inputs as zero; FloatToBf16 rounds them. They are rare
    // (|x| < 1.2e-38), so the fix-up is a never-taken branch in practice.
    const __mmask16 sub = _mm512_fpclass_ps_mask(x, 0x20);
    if (__builtin_expect(sub != 0, 0)) r = _mm256_mask_blend_epi16(sub, r, Bf16BitsInteger(x));
    return r;
  } else {
    return Bf16BitsInteger(x);
  }
}

template <DType T, bool kMask, bool kInsn, bool kStream = false>
inline void Store(void* base, size_t i, __m512 x, __mmask16 k) {
  if constexpr (T == DType::kFloat32) {
    float* p = static_cast<float*>(base) + i;
    if constexpr (kMask) _mm512_mask_storeu_ps(p, k, x);
    else _mm512_storeu_ps(p, x);
  } else {
    __m256i h;
    if constexpr (T == DType::kBFloat16) {
      h = Bf16Bits<kInsn>(x);
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    uint16_t* p = static_cast<uint16_t*>(base) + i;
    if constexpr (kMask) _mm256_mask_storeu_epi16(p, k, h);
    else if constexpr (kStream) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), h);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
}

struct VecConsts {
  explicit VecConsts(const AdamConsts& c)
      : grad_scale(_mm512_set1_ps(c.grad_scale)),
        beta1(_mm512_set1_ps(c.beta1)),
        one_minus_beta1(_mm512_set1_ps(c.one_minus_beta1)),
        beta2(_mm512_set1_ps(c.beta2)),
        one_minus_beta2(_mm512_set1_ps(c.one_minus_beta2)),
        eps(_mm512_set1_ps(c.eps)),
        neg_step_size(_mm512_set1_ps(c.neg_step_size)),
        inv_sqrt_bc2(_mm512_set1_ps(c.inv_sqrt_bc2)),
        l2(_mm512_set1_ps(c.l2)),
        decay(_mm512_set1_ps(c.decay)) {}
  __m512 grad_scale, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, neg_step_size,
      inv_sqrt_bc2, l2, decay;
};

template <DType G, DType S, P16 P, bool kInsn, bool kMask, bool kL2, bool kDecay, bool kStream>
inline void AdamVector(const AdamKernelArgs& a, const VecConsts& c, size_t i, __mmask16 k) {
  __m512 p = Load<DType::kFloat32, kMask>(a.master, i, k);
  __m512 g = _mm512_mul_ps(Load<G, kMask>(a.grad, i, k), c.grad_scale);
  __m512 m = Load<S, kMask>(a.exp_avg, i, k);
  __m512 v = Load<S, kMask>(a.exp_avg_sq, i, k);
  if constexpr (kL2) g = _mm512_fmadd_ps(c.l2, p, g);
  if constexpr (kDecay) p = _mm512_mul_ps(p, c.decay);
  m = _mm512_fmadd_ps(c.beta1, m, _mm512_mul_ps(c.one_minus_beta1, g));
  v = _mm512_fmadd_ps(c.beta2, v, _mm512_mul_ps(c.one_minus_beta2, _mm512_mul_ps(g, g)));
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), c.inv_sqrt_bc2, c.eps);
  p = _mm512_fmadd_ps(c.neg_step_size, _mm512_div_ps(m, denom), p);
  Store<DType::kFloat32, kMask, kInsn>(a.master, i, p, k);
  Store<S, kMask, kInsn>(a.exp_avg, i, m, k);
  Store<S, kMask, kInsn>(a.exp_avg_sq, i, v, k);
  if constexpr (P == P16::kBf16) Store<DType::kBFloat16, kMask, kInsn, kStream>(a.param16, i, p, k);
  if constexpr (P == P16::kFp16) Store<DType::kFloat16, kMask, kInsn, kStream>(a.param16, i, p, k);
}

// Note [streaming param16 stores]
// The 16-bit parameter copy is written and never read here. An ordinary store first reads the
// line (read-for-ownership), so the copy would cost 4 bytes of traffic per element instead of 2:
// with fp32 states that is 32 instead of 30 bytes per element, ~7 % of the step. Non-temporal
// stores write whole lines without reading them; they need 32-byte alignment, so they are used
// when the 16-bit vector at `begin` is aligned (every full vector after it then is, as begin
// and the vector width are multiples of 16 elements), with an sfence before returning so the
// stores are visible to whoever synchronises with this task. The master and the moments are
// read before they are written, so their lines are already owned: streaming them saves no
// traffic, and measured it cost a lot (0.6-0.8 of the roofline instead of ~1.0, four
// alternating runs).
template <DType G, DType S, P16 P, bool kInsn, bool kPrefetch, bool kL2, bool kDecay, bool kStream>
void AdamLoop(const AdamKernelArgs& a, size_t begin, size_t end) {
  const VecConsts c(a.c);
  size_t i = begin;
  for (; i + kW <= end; i += kW) {
    if constexpr (kPrefetch) {  // Note [prefetch]
      Prefetch<DType::kFloat32>(a.master, i);
      Prefetch<G>(a.grad, i);
      Prefetch<S>(a.exp_avg, i);
      Prefetch<S>(a.exp_avg_sq, i);
    }
    AdamVector<G, S, P, kInsn, false, kL2, kDecay, kStream>(a, c, i, 0);
  }
  if (i < end) {
    const __mmask16 k = static_cast<__mmask16>((1u << (end - i)) - 1u);
    AdamVector<G, S, P, kInsn, true, kL2, kDecay, false>(a, c, i, k);
  }
  if constexpr (kStream) _mm_sfence();
}

template <DType G, DType S, P16 P, bool kInsn, bool kPrefetch, bool kStream>
void AdamDecay(const AdamKernelArgs& a, size_t begin, size_t end) {
  if (a.c.has_l2) {
    AdamLoop<G, S, P, kInsn, kPrefetch, true, false, kStream>(a, begin, end);
  } else if (a.c.has_decay) {
    AdamLoop<G, S, P, kInsn, kPrefetch, false, true, kStream>(a, begin, end);
  } else {
    AdamLoop<G, S, P, kInsn, kPrefetch, false, false, kStream>(a, begin, end);
  }
}

// The weight-decay flavour and the store kind are decided once per call, so the loop carries
// no branch for them.
template <DType G, DType S, P16 P, bool kInsn, bool kPrefetch>
void Adam512(const AdamKernelArgs& a, size_t begin, size_t end) {
  if constexpr (P != P16::kNone) {
    const auto addr = reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(a.param16) + begin);
    if (addr % 32 == 0) {  // Note [streaming param16 stores]
      AdamDecay<G, S, P, kInsn, kPrefetch, true>(a, begin, end);
      return;
    }
  }
  AdamDecay<G, S, P, kInsn, kPrefetch, false>(a, begin, end);
}

template <DType G, bool kMask>
inline void StatsVector(const void* grad, size_t i, __mmask16 k, __m512 scale, __m512d& s0,
                        __m512d& s1, __m512& poison) {
  const __m512 x = _mm512_mul_ps(Load<G, kMask>(grad, i, k), scale);
  // x * 0 is NaN exactly when x is inf or NaN, and NaN survives every later add: one FMA
  // tracks "some lane was non-finite" without a compare and branch per vector.
  poison = _mm512_fmadd_ps(x, _mm512_setzero_ps(), poison);
  const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d hi = _mm512_cvtps_pd(
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  s0 = _mm512_fmadd_pd(lo, lo, s0);
  s1 = _mm512_fmadd_pd(hi, hi, s1);
}

// Note [interleaved scan]
// A single sequential read stream per core is limited by how many cache misses the core keeps
// in flight: measured here, one thread scanning one fp32 buffer from DRAM reached ~7.5 GB/s
// while the Adam-shaped loop, with four read streams, moved ~23 GB/s. The scan therefore walks
// its range as kStreams interleaved sub-ranges, each with its own accumulators, so the
// prefetchers track several streams at once. The split depends only on (begin, end), so the
// sum stays deterministic.
constexpr size_t kStreams = 4;

template <DType G>
GradPartial Stats512(const void* grad, float scale, size_t begin, size_t end) {
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512d s0[kStreams], s1[kStreams];
  __m512 poison[kStreams];
  for (size_t k = 0; k < kStreams; ++k) {
    s0[k] = s1[k] = _mm512_setzero_pd();
    poison[k] = _mm512_setzero_ps();
  }
  const size_t part = (end - begin) / kStreams / kW * kW;
  for (size_t j = 0; j < part; j += kW) {
    for (size_t k = 0; k < kStreams; ++k) {
      StatsVector<G, false>(grad, begin + k * part + j, 0, vscale, s0[k], s1[k], poison[k]);
    }
  }
  size_t i = begin + kStreams * part;
  for (; i + kW <= end; i += kW) StatsVector<G, false>(grad, i, 0, vscale, s0[0], s1[0], poison[0]);
  if (i < end) {
    const __mmask16 k = static_cast<__mmask16>((1u << (end - i)) - 1u);
    StatsVector<G, true>(grad, i, k, vscale, s0[0], s1[0], poison[0]);
  }
  __m512d sum = _mm512_setzero_pd();
  __m512 bad = _mm512_setzero_ps();
  for (size_t k = 0; k < kStreams; ++k) {
    sum = _mm512_add_pd(sum, _mm512_add_pd(s0[k], s1[k]));
    bad = _mm512_add_ps(bad, poison[k]);
  }
  GradPartial r;
  r.sum_sq = _mm512_reduce_add_pd(sum);
  r.nonfinite = _mm512_cmp_ps_mask(bad, bad, _CMP_UNORD_Q) != 0;
  return r;
}

template <DType G, DType S, bool kInsn, bool kPrefetch>
AdamKernelFn PickP16(P16 p16) {
  switch (p16) {
    case P16::kNone: return &Adam512<G, S, P16::kNone, kInsn, kPrefetch>;
    case P16::kBf16: return &Adam512<G, S, P16::kBf16, kInsn, kPrefetch>;
    case P16::kFp16: return &Adam512<G, S, P16::kFp16, kInsn, kPrefetch>;
  }
  return nullptr;
}

template <DType G, bool kInsn, bool kPrefetch>
AdamKernelFn PickState(DType state, P16 p16) {
  if (state == DType::kFloat32) return PickP16<G, DType::kFloat32, kInsn, kPrefetch>(p16);
  if (state == DType::kBFloat16) return PickP16<G, DType::kBFloat16, kInsn, kPrefetch>(p16);
  return nullptr;
}

template <bool kInsn, bool kPrefetch>
AdamKernelFn PickGrad(DType grad, DType state, P16 p16) {
  switch (grad) {
    case DType::kFloat32: return PickState<DType::kFloat32, kInsn, kPrefetch>(state, p16);
    case DType::kBFloat16: return PickState<DType::kBFloat16, kInsn, kPrefetch>(state, p16);
    case DType::kFloat16: return PickState<DType::kFloat16, kInsn, kPrefetch>(state, p16);
  }
  return nullptr;
}

}  // namespace

AdamKernelFn GetAdamKernelAvx512(DType grad, DType state, P16 p16, bool bf16_insn, bool prefetch) {
  if (bf16_insn) {
    return prefetch ? PickGrad<true, true>(grad, state, p16) : PickGrad<true, false>(grad, state, p16);
  }
  return prefetch ? PickGrad<false, true>(grad, state, p16) : PickGrad<false, false>(grad, state, p16);
}

GradStatsFn GetGradStatsAvx512(DType grad) {
  switch (grad) {
    case DType::kFloat32: return &Stats512<DType::kFloat32>;
    case DType::kBFloat16: return &Stats512<DType::kBFloat16>;
    case DType::kFloat16: return &Stats512<DType::kFloat16>;
  }
  return nullptr;
}

}  // namespace strata::optim::internal
