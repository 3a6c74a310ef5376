// AVX-512 paths of the compact-format block functions (compact_kernels.h): 16 lanes, the scalar
// reference's operations lane by lane; tails run masked.
#if !defined(__clang__)  // GCC 12's masked intrinsics: see adam_kernel_avx512.cc
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "optim/compact_formats.h"
#include "optim/compact_kernels.h"

namespace strata::optim::internal {
namespace {

constexpr size_t kW = 16;

inline __mmask16 Tail(size_t left) {
  return left >= kW ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

inline __m512i Hash32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x7feb352du)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

void RoundSr(const float* x, uint16_t* out, size_t n, uint32_t high, uint32_t lo) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i vhigh = _mm512_set1_epi32(static_cast<int>(high));
  const __m512i low16 = _mm512_set1_epi32(0xffff);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x40);
  for (size_t i = 0; i < n; i += kW) {
    const __mmask16 k = Tail(n - i);
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo + i)), iota);
    const __m512i bits = _mm512_and_si512(Hash32x16(_mm512_xor_si512(idx, vhigh)), low16);
    const __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(k, x + i));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bits), 16);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), quiet);
    _mm256_mask_storeu_epi16(out + i, k, _mm512_cvtepi32_epi16(r));
  }
}

void Quantize(const float* x, size_t n, float scale, const float* mids, uint8_t* codes) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (size_t i = 0; i < n; i += kW) {
    const __mmask16 k = Tail(n - i);
    const __m512 y = _mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), vscale);
    __m512i idx = _mm512_setzero_si512();
    for (int step = 128; step >= 1; step >>= 1) {
      const __m512i probe = _mm512_add_epi32(idx, _mm512_set1_epi32(step - 1));
      const __m512 mid = _mm512_i32gather_ps(probe, mids, 4);
      const __mmask16 below = _mm512_cmp_ps_mask(mid, y, _CMP_LT_OQ);
      idx = _mm512_mask_add_epi32(idx, below, idx, _mm512_set1_epi32(step));
    }
    _mm_mask_storeu_epi8(codes + i, k, _mm512_cvtepi32_epi8(idx));
  }
}

void Dequantize(const uint8_t* codes, float scale, size_t n, const float* map, float* out) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (size_t i = 0; i < n; i += kW) {
    const __mmask16 k = Tail(n - i);
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes + i));
    const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, idx, map, 4);
    _mm512_mask_storeu_ps(out + i, k, _mm512_mul_ps(v, vscale));
  }
}

float Absmax(const float* x, size_t n) {
  __m512 m = _mm512_setzero_ps();
  for (size_t i = 0; i < n; i += kW)
    m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(Tail(n - i), x + i)));
  return _mm512_reduce_max_ps(m);
}

}  // namespace

CompactKernels CompactKernelsAvx512() { return {&RoundSr, &Quantize, &Dequantize, &Absmax}; }

}  // namespace strata::optim::internal
