// AVX-512 paths of the compact-format block functions (compact_kernels.h): 16 lanes, the scalar
// reference's operations lane by lane.
//
// Note [unmasked main loops]
// Every loop runs its whole vectors with plain loads and stores and only the last, partial one
// masked (ForVectors). On AMD Zen 5 a masked store, and most of all a narrowing one (vpmovdw or
// vpmovdb straight to memory under a mask), cost several times the arithmetic around it: a
// 256-element block's bf16 widen and narrow took half the bf16-master step. The narrowing is done
// in a register and stored whole.
#if !defined(__clang__)  // GCC 12's masked intrinsics: see adam_kernel_avx512.cc
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <type_traits>

#include "optim/compact_formats.h"
#include "optim/compact_kernels.h"

namespace strata::optim::internal {
namespace {

constexpr size_t kW = 16;

inline __mmask16 Tail(size_t left) {
  return left >= kW ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1u);
}

// body(full, i, k) for each vector of [0, n): full is std::true_type (k all ones) for whole
// vectors, std::false_type with the tail's mask for the last partial one.
template <class Body>
inline void ForVectors(size_t n, const Body& body) {
  size_t i = 0;
  for (; i + kW <= n; i += kW) body(std::true_type{}, i, static_cast<__mmask16>(0xffff));
  if (i < n) body(std::false_type{}, i, Tail(n - i));
}

template <bool kFull>
inline __m512i LoadBits(const float* p, __mmask16 k) {
  return _mm512_castps_si512(kFull ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(k, p));
}
template <bool kFull>
inline void StoreFloats(float* p, __mmask16 k, __m512 v) {
  if constexpr (kFull) _mm512_storeu_ps(p, v);
  else _mm512_mask_storeu_ps(p, k, v);
}
// The low 16 bits of each lane, stored as 16 halves.
template <bool kFull>
inline void StoreLow16(uint16_t* p, __mmask16 k, __m512i r) {
  const __m256i h = _mm512_cvtepi32_epi16(r);
  if constexpr (kFull) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  else _mm256_mask_storeu_epi16(p, k, h);
}
// The low 8 bits of each lane, stored as 16 bytes.
template <bool kFull>
inline void StoreLow8(uint8_t* p, __mmask16 k, __m512i r) {
  const __m128i b = _mm512_cvtepi32_epi8(r);
  if constexpr (kFull) _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
  else _mm_mask_storeu_epi8(p, k, b);
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
  ForVectors(n, [&](auto full, size_t i, __mmask16 k) {
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(lo + i)), iota);
    const __m512i bits = _mm512_and_si512(Hash32x16(_mm512_xor_si512(idx, vhigh)), low16);
    const __m512i u = LoadBits<full>(x + i, k);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bits), 16);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), quiet);
    StoreLow16<full>(out + i, k, r);
  });
}

// Note [bucket index]
// A bucket is y's sign, exponent and top seven mantissa bits, which are y's upper 16 bits: with
// the sign dropped they count the rows from exponent 0, so subtracting the tiny row's start and
// clamping at 0 (every smaller exponent) gives the row and mantissa bucket at once, and the sign
// adds one half of the table. The tiny row's buckets all hold the same entry (BuildBuckets), so
// the clamp needs no mantissa cleared. Against the field-by-field form (shifts, masks, a compare,
// a multiply) the quantizer went from 0.525 to 0.455 ns per value here and from 0.67 to 0.50 on
// AVX2 (AMD Zen 5, one thread, L1-resident blocks, absmax included).
inline __m512i Buckets(__m512i bits) {
  const __m512i row_bits = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x7fff));
  const __m512i idx = _mm512_max_epi32(
      _mm512_sub_epi32(row_bits, _mm512_set1_epi32((kBucketMinExponent - 1) << kBucketMantissaBits)),
      _mm512_setzero_si512());
  return _mm512_mask_add_epi32(idx, _mm512_movepi32_mask(bits), idx,
                               _mm512_set1_epi32((128 - kBucketMinExponent + 1) << kBucketMantissaBits));
}

// Note [8-bit codes on AVX-512]
// One gather per 16 values from the bucket table (Note [fast 8-bit codes]). The gather is the
// largest cost of the 8-bit step, and the obvious replacement was measured and is not faster:
// the binary search with its probes held in registers (one vpermps per step up to 16 probes,
// vpermt2ps pairs and blends for the last three steps) took 0.63 ns per value on AMD Zen 5
// against the gather's 0.55 (one thread, L1-resident blocks), the 2-source permutes of the last
// steps costing as much as the gather they replace. Counting by arithmetic was measured too:
// inside a decade the midpoints are the edges of equal slices, so with the inner midpoints
// redefined as fmaf(j, step, lo) a code is the decade (six comparisons), trunc((a - lo) / step)
// and one correction each way by recomputed edges. It gave the binary search's codes on every
// test value but took 0.48 ns per value against the gather's 0.53 (AVX-512) and 0.96 against
// 0.67 (AVX2; absmax included, AMD Zen 5): the decade, the estimate and the corrections cost
// about a third each, so the gather was not the quantizer's only cost.
void Quantize(const float* x, size_t n, float scale, const CodeTables& t, uint8_t* codes) {
  static_assert(kBucketProbes == 1, "the bucket entry holds one midpoint");
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i low16 = _mm512_set1_epi32(0xffff);
  ForVectors(n, [&](auto full, size_t i, __mmask16 k) {
    const __m512i bits = _mm512_castps_si512(_mm512_div_ps(_mm512_castsi512_ps(LoadBits<full>(x + i, k)), vscale));
    // One gather: the count below the bucket and the threshold of its midpoint (BucketCode).
    // Only a NaN quotient (a NaN or infinite moment) has a bucket past the table: clamped to the
    // last one, it gets code 0, the scalar search's for NaN (Note [fast 8-bit codes]).
    const __m512i bucket = _mm512_min_epu32(Buckets(bits), _mm512_set1_epi32(kBucketCount - 1));
    const __m512i entry = _mm512_i32gather_epi32(bucket, t.buckets, 4);
    const __m512i low = _mm512_xor_si512(_mm512_and_si512(bits, low16),
                                         _mm512_and_si512(_mm512_srai_epi32(bits, 31), low16));
    const __mmask16 above = _mm512_cmpgt_epu32_mask(low, _mm512_srli_epi32(entry, 8));
    const __m512i c0 = _mm512_and_si512(entry, _mm512_set1_epi32(0xff));
    StoreLow8<full>(codes + i, k, _mm512_mask_add_epi32(c0, above, c0, _mm512_set1_epi32(1)));
  });
}

// out[i] = values[codes[i]] * scale by gathers, for i in [from, n).
void DequantizeGather(const uint8_t* codes, float scale, size_t from, size_t n, const float* values,
                      float* out) {
  const __m512 vscale = _mm512_set1_ps(scale);
  ForVectors(n - from, [&](auto full, size_t i, __mmask16 k) {
    i += from;
    __m512i idx;
    if constexpr (full) {
      idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    } else {
      idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes + i));
    }
    const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, idx, values, 4);
    StoreFloats<full>(out + i, k, _mm512_mul_ps(v, vscale));
  });
}

void Dequantize(const uint8_t* codes, float scale, size_t n, const CodeTables& t, float* out) {
  DequantizeGather(codes, scale, 0, n, t.values, out);
}

// Note [8-bit values by byte permutes]
// With AVX512_VBMI, 64 codes at a time look up each byte of their values in that byte's plane
// (CodeTables::planes, 256 bytes in four registers): two vpermi2b on the code's low 7 bits and a
// blend by its top bit per plane, then the four planes interleave into 64 floats. The interleave
// (bytes, then words) works within 128-bit lanes, so output register q's lane k would hold the
// codes at 16k + 4q .. 16k + 4q + 3; the codes are first permuted by 4-byte groups (group 4k + q
// takes group 4q + k) so that the floats come out in order. The values are the table's bits, so
// the result is the gather's bit for bit. On AMD Zen 5 it takes 0.13 ns per value against the
// gathers' 0.38 (one thread, L1-resident blocks).
__attribute__((target("avx512vbmi"))) void DequantizeVbmi(const uint8_t* codes, float scale, size_t n,
                                                         const CodeTables& t, float* out) {
  __m512i plane[4][4];
  for (int j = 0; j < 4; ++j)
    for (int q = 0; q < 4; ++q) plane[j][q] = _mm512_load_si512(t.planes + 256 * j + 64 * q);
  const __m512i groups = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512 vscale = _mm512_set1_ps(scale);
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i c = _mm512_permutexvar_epi32(groups, _mm512_loadu_si512(codes + i));
    const __mmask64 top = _mm512_movepi8_mask(c);
    __m512i b[4];
    for (int j = 0; j < 4; ++j)
      b[j] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(plane[j][0], c, plane[j][1]),
                                    _mm512_permutex2var_epi8(plane[j][2], c, plane[j][3]));
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i f[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                          _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
    for (int q = 0; q < 4; ++q)
      _mm512_storeu_ps(out + i + 16 * q, _mm512_mul_ps(_mm512_castsi512_ps(f[q]), vscale));
  }
  DequantizeGather(codes, scale, i, n, t.values, out);
}

float Absmax(const float* x, size_t n) {
  __m512 m = _mm512_setzero_ps();
  ForVectors(n, [&](auto full, size_t i, __mmask16 k) {
    // max(|x|, m) takes m when |x| is NaN: NaNs are skipped, as in the scalar path.
    m = _mm512_max_ps(_mm512_abs_ps(_mm512_castsi512_ps(LoadBits<full>(x + i, k))), m);
  });
  return _mm512_reduce_max_ps(m);
}

void WidenBf16(const uint16_t* h, float* out, size_t n) {
  ForVectors(n, [&](auto full, size_t i, __mmask16 k) {
    __m256i half;
    if constexpr (full) {
      half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i));
    } else {
      half = _mm256_maskz_loadu_epi16(k, h + i);
    }
    StoreFloats<full>(out + i, k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
  });
}

// FloatToBf16 (dtype.h) lane by lane, as the AVX2 path.
void NarrowBf16(const float* x, uint16_t* out, size_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
  ForVectors(n, [&](auto full, size_t i, __mmask16 k) {
    const __m512i u = LoadBits<full>(x + i, k);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, abs_mask), inf);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    StoreLow16<full>(out + i, k, r);
  });
}

}  // namespace

CompactKernels CompactKernelsAvx512(bool vbmi) {
  return {&RoundSr, &Quantize, vbmi ? &DequantizeVbmi : &Dequantize, &Absmax, &WidenBf16, &NarrowBf16};
}

}  // namespace strata::optim::internal
