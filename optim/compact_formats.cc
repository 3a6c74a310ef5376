#include "optim/compact_formats.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "runtime/base/check.h"
#include "runtime/base/cpu_features.h"

#include "optim/compact_kernels.h"

namespace strata::optim {
namespace {

struct Map {
  std::array<float, 256> values;
  alignas(64) std::array<uint8_t, 4 * 256> planes;  // the values' bytes by plane
  // The 255 midpoints, then +inf padding (a count of 255 still names a slot).
  std::array<float, 255 + internal::kBucketProbes> mids;
  std::array<uint32_t, internal::kBucketCount> buckets;  // Note [fast 8-bit codes]
  uint8_t zero = 0;
  float max_error = 0;
};

// Note [fast 8-bit codes]
// A code is the count of midpoints below y. The scalar reference finds it by binary search (eight
// probes); the vector paths, where each probe is a gather, start from a table instead: y's sign,
// exponent and top seven mantissa bits (its upper 16 bits) name a bucket of values, the table
// holds the count of midpoints below the bucket, and at most kBucketProbes (one) midpoint falls
// inside any bucket, so one comparison finishes the count. That midpoint shares the bucket's
// upper 16 bits, so the comparison is one of low 16 bits, and the entry carries them: one
// gather per value instead of eight (a second gather, of the midpoint, waited for the first and
// took about a fifth of the 8-bit step). The table, 26 KB, stays in L1. BuildBuckets checks the
// bound, and that each midpoint lies in its bucket, for every bucket of both maps.
// A NaN quotient (from a NaN or infinite moment) has an exponent past the table's rows; the
// vector paths clamp its bucket to the last one, [-2, -1.992), which holds no midpoint and has
// none below it: code 0, what the binary search gives a NaN (every comparison false).
void BuildBuckets(Map* m) {
  const int exps = 128 - static_cast<int>(internal::kBucketMinExponent) + 1;
  const int per = 1 << internal::kBucketMantissaBits;
  const auto below = [&](double y, bool inclusive) {  // midpoints < y (or <= y)
    uint32_t c = 0;
    for (int k = 0; k < 255; ++k) c += inclusive ? m->mids[k] <= y : m->mids[k] < y;
    return c;
  };
  for (int sign = 0; sign < 2; ++sign) {
    for (int e = 0; e < exps; ++e) {
      for (int j = 0; j < per; ++j) {
        // The magnitudes of the bucket: [lo, hi); the lowest exponent row holds [0, 2^-24).
        double lo, hi;
        if (e == 0) {
          // Every tiny magnitude: BucketOf maps them to mantissa bucket 0, the vector paths'
          // clamped index (Note [bucket index]) to any bucket of this row; all hold the same.
          lo = 0, hi = std::ldexp(1.0, static_cast<int>(internal::kBucketMinExponent) - 127);
        } else {
          const double base = std::ldexp(1.0, e + static_cast<int>(internal::kBucketMinExponent) - 1 - 127);
          lo = base * (1.0 + static_cast<double>(j) / per);
          hi = base * (1.0 + static_cast<double>(j + 1) / per);
        }
        const uint32_t bucket = (static_cast<uint32_t>(sign * exps + e) << internal::kBucketMantissaBits) + j;
        // Positive: y in [lo, hi), the count below lo. Negative: y in (-hi, -lo], the count of
        // midpoints at or below -hi.
        const uint32_t first = sign == 0 ? below(lo, false) : below(-hi, true);
        const uint32_t last = sign == 0 ? below(hi, false) : below(-lo, true);
        STRATA_DCHECK(last - first <= static_cast<uint32_t>(internal::kBucketProbes),
                     "8-bit map: bucket ", bucket, " holds ", last - first, " midpoints");
        uint32_t threshold = 0xffffu;  // no midpoint inside: never one more
        if (last > first) {
          // The midpoint shares the bucket's upper 16 bits (the tiny bucket, which spans several
          // exponents, holds none), so comparing y with it is comparing their low 16 bits: for a
          // positive y it is passed when y's low bits exceed its own; for a negative y when they
          // are below, that is when their complements exceed its complement.
          uint32_t mid_bits;
          std::memcpy(&mid_bits, &m->mids[first], sizeof mid_bits);
          STRATA_DCHECK(e > 0 && internal::BucketOf(mid_bits) == bucket, "8-bit map: midpoint ", first,
                       " is not in bucket ", bucket);
          threshold = (mid_bits & 0xffffu) ^ (sign ? 0xffffu : 0u);
        }
        m->buckets[bucket] = first | (threshold << 8);
      }
    }
  }
}

// Note [8-bit moments]: seven decades, 10^-6 .. 10^0; the decade at 10^(d-6) holds 2^d values
// per sign (signed) or 2^(d+1) (unsigned), each the centre of an equal slice of [0.1, 1] times
// the decade's scale; then 0 and 1.
Map BuildMap(bool is_signed) {
  std::vector<double> v;
  for (int d = 0; d < 7; ++d) {
    const int count = is_signed ? 1 << d : 1 << (d + 1);
    const double decade = std::pow(10.0, d - 6);
    for (int j = 0; j < count; ++j) {
      const double value = (0.1 + 0.9 * (j + 0.5) / count) * decade;
      v.push_back(value);
      if (is_signed) v.push_back(-value);
    }
  }
  v.push_back(0.0);
  v.push_back(1.0);
  std::sort(v.begin(), v.end());
  Map m;
  for (size_t i = 0; i < 256; ++i) m.values[i] = static_cast<float>(v[i]);
  m.mids.fill(std::numeric_limits<float>::infinity());
  for (size_t i = 0; i < 255; ++i) {
    m.mids[i] = static_cast<float>((static_cast<double>(m.values[i]) + m.values[i + 1]) / 2);
    m.max_error = std::max(m.max_error, (m.values[i + 1] - m.values[i]) / 2);
    if (m.values[i] == 0.0f) m.zero = static_cast<uint8_t>(i);
  }
  if (is_signed) m.max_error = std::max(m.max_error, m.values[0] + 1.0f);  // -1 to the lowest
  BuildBuckets(&m);
  // The VBMI path's byte planes (Note [8-bit values by byte permutes]).
  for (int c = 0; c < 256; ++c) {
    uint32_t bits;
    std::memcpy(&bits, &m.values[c], sizeof bits);
    for (int j = 0; j < 4; ++j) m.planes[256 * j + c] = static_cast<uint8_t>(bits >> (8 * j));
  }
  return m;
}

const Map& GetMap(bool is_signed) {
  static const Map s = BuildMap(true), u = BuildMap(false);
  return is_signed ? s : u;
}

internal::CodeTables TablesOf(const Map& m) {
  return {m.values.data(), m.mids.data(), m.buckets.data(), m.planes.data()};
}

}  // namespace

namespace internal {

CompactKernels CompactKernelsFor(Isa isa) {
  if (isa == Isa::kAuto) isa = ResolveAutoIsa();
  switch (isa) {
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      if (IsaSupported(isa)) return CompactKernelsAvx512(Cpu().avx512vbmi);
      break;
    case Isa::kAvx2:
      if (IsaSupported(isa)) return CompactKernelsAvx2();
      break;
    default:
      break;
  }
  return CompactKernelsScalar();
}

const CodeTables& CodeTablesOf(bool is_signed) {
  static const CodeTables s = TablesOf(GetMap(true)), u = TablesOf(GetMap(false));
  return is_signed ? s : u;
}

void RoundSrSplit(const CompactKernels& k, const float* x, uint16_t* out, size_t n, uint32_t key,
                  uint64_t index_base) {
  while (n > 0) {
    const uint64_t to_wrap = (uint64_t{1} << 32) - (index_base & 0xffffffffu);
    const size_t piece = static_cast<size_t>(std::min<uint64_t>(n, to_wrap));
    k.round_sr(x, out, piece, RoundingHigh(key, index_base), static_cast<uint32_t>(index_base));
    x += piece;
    out += piece;
    n -= piece;
    index_base += piece;
  }
}

}  // namespace internal

const float* DynamicMap(bool is_signed) { return GetMap(is_signed).values.data(); }
const float* DynamicMapMidpoints(bool is_signed) { return GetMap(is_signed).mids.data(); }
uint8_t DynamicMapZero(bool is_signed) { return GetMap(is_signed).zero; }
float DynamicMapMaxError(bool is_signed) { return GetMap(is_signed).max_error; }

void RoundToBf16Stochastic(const float* x, uint16_t* out, size_t n, uint32_t key,
                           uint64_t index_base, Isa isa) {
  internal::RoundSrSplit(internal::CompactKernelsFor(isa), x, out, n, key, index_base);
}

// Note [an infinite moment]
// One gradient whose square overflows (1e25 in fp32) makes its exp_avg_sq infinite. As the
// block's scale, inf quantized every other value of the block to the zero code, and decoded
// 0 * inf = NaN: 255 neighbours' weights went NaN beside the one fp32 moments freeze. An infinite
// value is taken as the largest finite float of its sign instead: the block's scale is FLT_MAX,
// the value decodes to it, and its neighbours (far below it) to zero, for that step. Every path
// clamps before the scale (the CPU here and in CompactStep, the GPU in StoreMoment), so the
// kernels see finite quotients alone, and NaNs stay as they were (skipped by the scale).
void internal::ClampInfinities(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (std::isinf(x[i])) x[i] = std::copysign(std::numeric_limits<float>::max(), x[i]);
}

void QuantizeBlock(const float* x, size_t n, bool is_signed, uint8_t* codes, float* scale,
                   Isa isa) {
  const internal::CompactKernels k = internal::CompactKernelsFor(isa);
  *scale = k.absmax(x, n);
  std::vector<float> clamped;
  if (std::isinf(*scale)) {  // Note [an infinite moment]
    clamped.assign(x, x + n);
    internal::ClampInfinities(clamped.data(), n);
    x = clamped.data();
    *scale = k.absmax(x, n);
  }
  if (*scale == 0.0f) {
    std::fill(codes, codes + n, DynamicMapZero(is_signed));
    return;
  }
  k.quantize(x, n, *scale, internal::CodeTablesOf(is_signed), codes);
}

void DequantizeBlock(const uint8_t* codes, float scale, size_t n, bool is_signed, float* out,
                     Isa isa) {
  internal::CompactKernelsFor(isa).dequantize(codes, scale, n, internal::CodeTablesOf(is_signed), out);
}

}  // namespace strata::optim
