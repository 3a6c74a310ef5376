// AVX2 paths of the compact-format block functions (compact_kernels.h): 8 lanes, the scalar
// reference's operations lane by lane; tails run the scalar reference.
#include <immintrin.h>

#include <cmath>

#include "optim/compact_formats.h"
#include "optim/compact_kernels.h"

namespace strata::optim::internal {
namespace {

constexpr size_t kW = 8;

// Stores value(i) (eight lanes whose low 16 bits are the results) at out + i for every whole
// vector of [0, n), sixteen values per 256-bit store where it can: two vectors pack in one
// instruction (per 128-bit lane, hence the qword permute that puts the lanes in order). Returns
// where the whole vectors end; the caller finishes the tail.
template <class Value>
inline size_t StoreHalves(uint16_t* out, size_t n, const Value& value) {
  size_t i = 0;
  for (; i + 2 * kW <= n; i += 2 * kW) {
    const __m256i packed = _mm256_packus_epi32(value(i), value(i + kW));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permute4x64_epi64(packed, 0xd8));
  }
  for (; i + kW <= n; i += kW) {
    const __m256i r = value(i);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  return i;
}

inline __m256i Hash32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x7feb352du)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

void RoundSr(const float* x, uint16_t* out, size_t n, uint32_t high, uint32_t lo) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i vhigh = _mm256_set1_epi32(static_cast<int>(high));
  const __m256i low16 = _mm256_set1_epi32(0xffff);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  const auto round = [&](size_t i) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo + i)), iota);
    const __m256i bits = _mm256_and_si256(Hash32x8(_mm256_xor_si256(idx, vhigh)), low16);
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    // |u| > inf as signed 32-bit integers: both sides are below 2^31.
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bits), 16);
    const __m256i kept = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
    return _mm256_blendv_epi8(rounded, kept, nan);
  };
  const size_t i = StoreHalves(out, n, round);
  CompactKernelsScalar().round_sr(x + i, out + i, n - i, high, lo + static_cast<uint32_t>(i));
}

// The bucket of each lane from its upper 16 bits (Note [bucket index] in compact_kernel_avx512.cc).
inline __m256i Buckets(__m256i bits) {
  const __m256i row_bits = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x7fff));
  const __m256i idx = _mm256_max_epi32(
      _mm256_sub_epi32(row_bits, _mm256_set1_epi32((kBucketMinExponent - 1) << kBucketMantissaBits)),
      _mm256_setzero_si256());
  const __m256i half = _mm256_and_si256(_mm256_srai_epi32(bits, 31),
                                        _mm256_set1_epi32((128 - kBucketMinExponent + 1) << kBucketMantissaBits));
  return _mm256_add_epi32(idx, half);
}

void Quantize(const float* x, size_t n, float scale, const CodeTables& t, uint8_t* codes) {
  static_assert(kBucketProbes == 1, "the bucket entry holds one midpoint");
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256i low16 = _mm256_set1_epi32(0xffff);
  size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m256i bits = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(x + i), vscale));
    // One gather: the count below the bucket and the threshold of its midpoint (BucketCode).
    // Only a NaN quotient (a NaN or infinite moment) has a bucket past the table: clamped to the
    // last one, it gets code 0, the scalar search's for NaN (Note [fast 8-bit codes]).
    const __m256i bucket = _mm256_min_epu32(Buckets(bits), _mm256_set1_epi32(kBucketCount - 1));
    const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(t.buckets), bucket, 4);
    const __m256i low = _mm256_xor_si256(_mm256_and_si256(bits, low16),
                                         _mm256_and_si256(_mm256_srai_epi32(bits, 31), low16));
    const __m256i above = _mm256_cmpgt_epi32(low, _mm256_srli_epi32(entry, 8));  // both < 2^16
    const __m256i idx = _mm256_sub_epi32(_mm256_and_si256(entry, _mm256_set1_epi32(0xff)), above);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(idx), _mm256_extracti128_si256(idx, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + i), _mm_packus_epi16(w, w));
  }
  CompactKernelsScalar().quantize(x + i, n - i, scale, t, codes + i);
}

void Dequantize(const uint8_t* codes, float scale, size_t n, const CodeTables& t, float* out) {
  const __m256 vscale = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m256i idx =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_i32gather_ps(t.values, idx, 4), vscale));
  }
  CompactKernelsScalar().dequantize(codes + i, scale, n - i, t, out + i);
}

float Absmax(const float* x, size_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  size_t i = 0;
  // max(|x|, m) takes m when |x| is NaN: NaNs are skipped, as in the scalar path.
  for (; i + kW <= n; i += kW) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), m);
  alignas(32) float lanes[kW];
  _mm256_store_ps(lanes, m);
  float r = CompactKernelsScalar().absmax(x + i, n - i);
  for (float v : lanes) r = std::fmax(r, v);
  return r;
}

void WidenBf16(const uint16_t* h, float* out, size_t n) {
  size_t i = 0;
  for (; i + kW <= n; i += kW) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  CompactKernelsScalar().widen_bf16(h + i, out + i, n - i);
}

// FloatToBf16 (dtype.h) lane by lane: add 0x7fff plus the kept part's lowest bit, keep the upper
// half; NaN keeps its upper half with the quiet bit.
void NarrowBf16(const float* x, uint16_t* out, size_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff);
  const auto narrow = [&](size_t i) {
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
    const __m256i kept = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, kept, nan);
  };
  const size_t i = StoreHalves(out, n, narrow);
  CompactKernelsScalar().narrow_bf16(x + i, out + i, n - i);
}

}  // namespace

CompactKernels CompactKernelsAvx2() {
  return {&RoundSr, &Quantize, &Dequantize, &Absmax, &WidenBf16, &NarrowBf16};
}

}  // namespace strata::optim::internal
