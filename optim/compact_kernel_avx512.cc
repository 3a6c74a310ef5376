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

// The bucket of each lane (compact_kernels.h, BucketOf) with integer operations.
inline __m512i Buckets(__m512i bits) {
  const __m512i sign = _mm512_srli_epi32(bits, 31);
  __m512i e = _mm512_and_si512(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(0xff));
  __m512i mant = _mm512_and_si512(_mm512_srli_epi32(bits, 23 - kBucketMantissaBits),
                                  _mm512_set1_epi32((1 << kBucketMantissaBits) - 1));
  const __mmask16 tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(kBucketMinExponent));
  e = _mm512_max_epu32(e, _mm512_set1_epi32(kBucketMinExponent - 1));
  mant = _mm512_maskz_mov_epi32(static_cast<__mmask16>(~tiny), mant);
  const __m512i row = _mm512_add_epi32(_mm512_mullo_epi32(sign, _mm512_set1_epi32(128 - kBucketMinExponent + 1)),
                                       _mm512_sub_epi32(e, _mm512_set1_epi32(kBucketMinExponent - 1)));
  return _mm512_add_epi32(_mm512_slli_epi32(row, kBucketMantissaBits), mant);
}

void Quantize(const float* x, size_t n, float scale, const float*, const uint32_t* buckets,
              uint8_t* codes) {
  static_assert(kBucketProbes == 1, "the bucket entry holds one midpoint");
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i low16 = _mm512_set1_epi32(0xffff);
  for (size_t i = 0; i < n; i += kW) {
    const __mmask16 k = Tail(n - i);
    const __m512i bits = _mm512_castps_si512(_mm512_div_ps(_mm512_maskz_loadu_ps(k, x + i), vscale));
    // One gather: the count below the bucket and the threshold of its midpoint (BucketCode).
    // Only a NaN quotient (a NaN or infinite moment) has a bucket past the table: clamped to the
    // last one, it gets code 0, the scalar search's for NaN (Note [fast 8-bit codes]).
    const __m512i bucket = _mm512_min_epu32(Buckets(bits), _mm512_set1_epi32(kBucketCount - 1));
    const __m512i entry = _mm512_i32gather_epi32(bucket, buckets, 4);
    const __m512i low = _mm512_xor_si512(_mm512_and_si512(bits, low16),
                                         _mm512_and_si512(_mm512_srai_epi32(bits, 31), low16));
    const __mmask16 above = _mm512_cmpgt_epu32_mask(low, _mm512_srli_epi32(entry, 8));
    const __m512i c0 = _mm512_and_si512(entry, _mm512_set1_epi32(0xff));
    const __m512i idx = _mm512_mask_add_epi32(c0, above, c0, _mm512_set1_epi32(1));
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
    // max(|x|, m) takes m when |x| is NaN: NaNs are skipped, as std::fmax does in the scalar path.
    m = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(Tail(n - i), x + i)), m);
  return _mm512_reduce_max_ps(m);
}

void WidenBf16(const uint16_t* h, float* out, size_t n) {
  for (size_t i = 0; i < n; i += kW) {
    const __mmask16 k = Tail(n - i);
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, h + i));
    _mm512_mask_storeu_ps(out + i, k, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
}

// FloatToBf16 (dtype.h) lane by lane, as the AVX2 path.
void NarrowBf16(const float* x, uint16_t* out, size_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  for (size_t i = 0; i < n; i += kW) {
    const __mmask16 k = Tail(n - i);
    const __m512i u = _mm512_castps_si512(_mm512_maskz_loadu_ps(k, x + i));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16(out + i, k, _mm512_cvtepi32_epi16(r));
  }
}

}  // namespace

CompactKernels CompactKernelsAvx512() {
  return {&RoundSr, &Quantize, &Dequantize, &Absmax, &WidenBf16, &NarrowBf16};
}

}  // namespace strata::optim::internal
