// Internal to optim/: the per-ISA block functions behind compact_formats.h. Each ISA's file is
// compiled with its flags (optim/CMakeLists.txt) and called only after cpuid says it can run.
// Every vector path performs the scalar reference's operations lane by lane (the same integer
// hash, the same IEEE division and comparisons), so the results are bit-identical.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/cpu_adam.h"

namespace strata::optim::internal {

// The quantizer's bucket table (Note [fast 8-bit codes] in compact_formats.cc): for a value's
// sign, exponent and top mantissa bits (the upper 16 bits of a float), the count of midpoints
// below the bucket and the one midpoint that may fall inside it, so that the code is that count
// plus at most kBucketProbes (one) comparison.
inline constexpr int kBucketMantissaBits = 7;
inline constexpr uint32_t kBucketMinExponent = 103;  // 2^-24; smaller magnitudes share one bucket
inline constexpr int kBucketProbes = 1;
inline constexpr size_t kBucketCount = 2u * (128 - kBucketMinExponent + 1) << kBucketMantissaBits;
// The bucket of y (finite, |y| < 2), as the scalar code computes it. The vector paths compute
// the same bucket from y's upper 16 bits in three operations (Note [bucket index] in
// compact_kernel_avx512.cc), except that a tiny magnitude may land in any bucket of the tiny row,
// which BuildBuckets fills alike.
inline uint32_t BucketOf(uint32_t bits) {
  const uint32_t sign = bits >> 31;
  uint32_t e = (bits >> 23) & 0xffu;
  uint32_t mant = (bits >> (23 - kBucketMantissaBits)) & ((1u << kBucketMantissaBits) - 1u);
  if (e < kBucketMinExponent) e = kBucketMinExponent - 1, mant = 0;
  return (sign * (128 - kBucketMinExponent + 1) + (e - (kBucketMinExponent - 1))) *
             (1u << kBucketMantissaBits) + mant;
}

// One 8-bit map's tables, as the block functions read them. Built once per map
// (compact_formats.cc) and never freed.
struct CodeTables {
  const float* values;      // the 256 map values
  const float* mids;        // the 255 midpoints, then +inf (the scalar binary search)
  const uint32_t* buckets;  // the bucket table (AVX2 and AVX-512; BucketCode)
  const uint8_t* planes;    // byte j of values[c] at planes[256 * j + c] (AVX-512 VBMI), 64-aligned
};
const CodeTables& CodeTablesOf(bool is_signed);

// Each infinite value of x[0, n) replaced by the largest finite float of its sign, before an
// 8-bit block's scale is taken (Note [an infinite moment], compact_formats.cc).
void ClampInfinities(float* x, size_t n);

struct CompactKernels {
  // out[i] = FloatToBf16Stochastic(x[i], Hash32(lo + i ^ high)): the caller guarantees that
  // lo + n does not wrap (indices of one call share their upper 32 bits), and passes
  // high = RoundingHigh(key, index_base), lo = low 32 bits of index_base.
  void (*round_sr)(const float* x, uint16_t* out, size_t n, uint32_t high, uint32_t lo);
  // codes[i] = #{k < 255 : t.mids[k] < x[i] / scale} for scale > 0 (0 for a NaN quotient: the
  // vector paths clamp its bucket to the table's last, [-2, -1.992), which holds no midpoint).
  void (*quantize)(const float* x, size_t n, float scale, const CodeTables& t, uint8_t* codes);
  // out[i] = t.values[codes[i]] * scale.
  void (*dequantize)(const uint8_t* codes, float scale, size_t n, const CodeTables& t, float* out);
  // max |x[i]| over the x[i] that are not NaN (quiet or signalling), 0 for none.
  float (*absmax)(const float* x, size_t n);
  // out[i] = Bf16ToFloat(h[i]); out[i] = FloatToBf16(x[i]) (nearest even, dtype.h's rule).
  void (*widen_bf16)(const uint16_t* h, float* out, size_t n);
  void (*narrow_bf16)(const float* x, uint16_t* out, size_t n);
};

// The kernels of `isa` (kAuto resolves; an unsupported one falls back to scalar).
CompactKernels CompactKernelsFor(Isa isa);
CompactKernels CompactKernelsScalar();
// RoundToBf16Stochastic with kernels already resolved (split where the index's upper 32 bits
// change, so each piece has one RoundingHigh).
void RoundSrSplit(const CompactKernels& k, const float* x, uint16_t* out, size_t n, uint32_t key,
                  uint64_t index_base);
// A bucket table entry (Note [fast 8-bit codes] in compact_formats.cc), one per bucket: bits 0-7
// the count of midpoints below the bucket; bits 8-23 a threshold T on the low 16 bits of y
// (their complement, 0xffff - low, for a negative y): the code is the count plus one when they
// exceed T. T is 0xffff when no midpoint falls inside the bucket.
inline uint32_t BucketCode(uint32_t entry, uint32_t bits) {
  const uint32_t low = (bits & 0xffffu) ^ ((bits >> 31) ? 0xffffu : 0u);
  return (entry & 0xffu) + (low > (entry >> 8) ? 1u : 0u);
}
CompactKernels CompactKernelsAvx2();
// vbmi: dequantize by byte permutes (AVX512_VBMI, which this CPU must have) instead of gathers.
CompactKernels CompactKernelsAvx512(bool vbmi);

}  // namespace strata::optim::internal
