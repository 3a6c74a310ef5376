// Compact formats (optim/compact_formats.h): every ISA bit-identical to the scalar reference,
// stochastic rounding unbiased and independent of how a range is split, 8-bit blocks within the
// format's stated error and picking the nearest map value.
#include "optim/compact_formats.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "optim/compact_kernels.h"
#include "runtime/base/cpu_features.h"

namespace strata::optim {
namespace {

std::vector<Isa> Isas() {
  std::vector<Isa> out = {Isa::kScalar};
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512})
    if (IsaSupported(isa)) out.push_back(isa);
  return out;
}

// Values of every kind: normal, tiny, subnormal, huge, signed zeros, inf, NaN.
std::vector<float> MixedValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-140, 127);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = std::ldexp(normal(rng), exp(rng));
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(), 1.0f, -1.0f};
  for (size_t i = 0; i < std::size(specials) && i * 97 < n; ++i) x[i * 97] = specials[i];
  return x;
}

TEST(StochasticRounding, EveryIsaEqualsTheScalarFormulaAcrossTheIndexWrap) {
  const size_t n = 4099;  // not a multiple of any vector width
  const std::vector<float> x = MixedValues(n, 1);
  const uint32_t key = RoundingKey(1234, 17);
  const uint64_t base = (uint64_t{5} << 32) - 1000;  // the upper 32 bits change inside the range
  std::vector<uint16_t> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = FloatToBf16Stochastic(x[i], RoundingBits(key, base + i));
  for (Isa isa : Isas()) {
    std::vector<uint16_t> got(n, 0xdead);
    RoundToBf16Stochastic(x.data(), got.data(), n, key, base, isa);
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], want[i]) << IsaName(isa) << " element " << i << " x=" << x[i];
  }
}

TEST(StochasticRounding, PicksOneOfTheTwoNeighboursAndKeepsSpecials) {
  const std::vector<float> x = MixedValues(20000, 2);
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t r = FloatToBf16Stochastic(x[i], RoundingBits(99, i));
    const uint32_t u = FloatBits(x[i]);
    if (std::isnan(x[i])) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(r)));
    } else if (std::isinf(x[i])) {
      EXPECT_EQ(Bf16ToFloat(r), x[i]);
    } else {
      const uint16_t down = static_cast<uint16_t>(u >> 16);
      EXPECT_TRUE(r == down || (r == down + 1 && (u & 0xffff) != 0)) << x[i];
    }
  }
}

TEST(StochasticRounding, IsUnbiasedWhereNearestIsNot) {
  // x sits a third of a bf16 ulp above a bf16 value: nearest always rounds down (bias -ulp/3);
  // the mean of 2^16 stochastic roundings (different element indices) must be x within
  // 6 standard errors (each rounding's deviation is below one ulp, so the error of the mean is
  // below ulp / 2^8).
  for (float base : {1.0f, -3.5f, 1e-20f, 7e30f}) {
    const uint32_t b = FloatBits(base);
    const float next = BitsToFloat(((b >> 16) + 1) << 16);
    const float x = base + (next - base) / 3;
    const size_t n = size_t{1} << 16;
    std::vector<float> in(n, x);
    std::vector<uint16_t> out(n);
    RoundToBf16Stochastic(in.data(), out.data(), n, RoundingKey(7, 3), 0);
    double sum = 0;
    for (uint16_t h : out) sum += Bf16ToFloat(h);
    const double mean = sum / n;
    const double gap = std::fabs(static_cast<double>(next) - base);
    EXPECT_NEAR(mean, x, 6 * gap / 256) << "base " << base;
    EXPECT_GT(std::fabs(static_cast<double>(Bf16ToFloat(FloatToBf16(x))) - x), gap / 4)
        << "nearest should be biased here";
  }
}

TEST(StochasticRounding, BitsDependOnlyOnSeedStepAndIndex) {
  // One call over [0, n) equals calls over pieces at the matching index bases (how chunk size,
  // thread count and rank count split the work), and a different step or seed changes the bits.
  const size_t n = 3000;
  const std::vector<float> x = MixedValues(n, 3);
  const uint32_t key = RoundingKey(42, 1000);
  std::vector<uint16_t> whole(n), pieces(n);
  RoundToBf16Stochastic(x.data(), whole.data(), n, key, 500);
  size_t at = 0;
  for (size_t len : {size_t{7}, size_t{1017}, size_t{1}, size_t{1975}}) {
    RoundToBf16Stochastic(x.data() + at, pieces.data() + at, len, key, 500 + at, Isa::kScalar);
    at += len;
  }
  ASSERT_EQ(at, n);
  EXPECT_EQ(whole, pieces);
  EXPECT_NE(RoundingKey(42, 1000), RoundingKey(42, 1001));
  EXPECT_NE(RoundingKey(42, 1000), RoundingKey(43, 1000));
  int differ = 0;
  for (uint64_t i = 0; i < 1000; ++i)
    differ += RoundingBits(RoundingKey(42, 1000), i) != RoundingBits(RoundingKey(42, 1001), i);
  EXPECT_GT(differ, 990);
}

TEST(Int8Map, SortedWithZeroAndOne) {
  for (bool is_signed : {true, false}) {
    const float* map = DynamicMap(is_signed);
    for (int i = 0; i < 255; ++i) ASSERT_LT(map[i], map[i + 1]) << i;
    EXPECT_EQ(map[DynamicMapZero(is_signed)], 0.0f);
    EXPECT_EQ(map[255], 1.0f);
    if (is_signed) {
      EXPECT_LT(map[0], -0.99f);
    } else {
      EXPECT_EQ(map[0], 0.0f);
    }
    // The stated bound: 1/128 of the block's scale is what seven decades in 256 codes allow.
    EXPECT_LT(DynamicMapMaxError(is_signed), 1.0f / 128) << is_signed;
    std::printf("map %s: largest quantization error %.5f of the block's scale\n",
                is_signed ? "signed" : "unsigned", DynamicMapMaxError(is_signed));
  }
}

// Blocks of several shapes: Gaussian, log-uniform over 12 decades, one outlier, all zero,
// Adam-like second moments (squares).
std::vector<std::vector<float>> Blocks(bool is_signed) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> uni(-12.0f, 0.0f);
  std::vector<std::vector<float>> out;
  for (size_t n : {kInt8Block, size_t{1}, size_t{37}, size_t{255}}) {
    std::vector<float> g(n), l(n), o(n), z(n, 0.0f);
    for (size_t i = 0; i < n; ++i) {
      g[i] = normal(rng) * 1e-3f;
      l[i] = std::pow(10.0f, uni(rng)) * (normal(rng) < 0 && is_signed ? -1.0f : 1.0f);
      o[i] = normal(rng) * 1e-6f;
      if (!is_signed) {
        g[i] = g[i] * g[i];
        o[i] = std::fabs(o[i]);
      }
    }
    o[n / 2] = is_signed ? -5.0f : 5.0f;
    out.push_back(g);
    out.push_back(l);
    out.push_back(o);
    out.push_back(z);
  }
  return out;
}

TEST(Int8Blocks, EveryIsaEqualsTheScalarReferenceAndPicksTheNearestCode) {
  for (bool is_signed : {true, false}) {
    const float* map = DynamicMap(is_signed);
    for (const auto& x : Blocks(is_signed)) {
      const size_t n = x.size();
      std::vector<uint8_t> want(n);
      float want_scale = -1;
      QuantizeBlock(x.data(), n, is_signed, want.data(), &want_scale, Isa::kScalar);
      float absmax = 0;
      for (float v : x) absmax = std::max(absmax, std::fabs(v));
      ASSERT_EQ(want_scale, absmax);
      for (size_t i = 0; i < n; ++i) {
        // Nearest by brute force (ties to the lower code).
        const float y = absmax > 0 ? x[i] / absmax : 0.0f;
        int best = 0;
        for (int c = 1; c < 256; ++c)
          if (std::fabs(map[c] - y) < std::fabs(map[best] - y)) best = c;
        ASSERT_EQ(want[i], best) << "y=" << y;
      }
      std::vector<float> back(n);
      DequantizeBlock(want.data(), want_scale, n, is_signed, back.data(), Isa::kScalar);
      for (size_t i = 0; i < n; ++i)
        ASSERT_LE(std::fabs(back[i] - x[i]), DynamicMapMaxError(is_signed) * absmax * 1.0001f)
            << x[i];
      for (Isa isa : Isas()) {
        std::vector<uint8_t> got(n, 77);
        float scale = -1;
        QuantizeBlock(x.data(), n, is_signed, got.data(), &scale, isa);
        ASSERT_EQ(scale, want_scale) << IsaName(isa);
        ASSERT_EQ(got, want) << IsaName(isa) << " n=" << n;
        std::vector<float> deq(n, -9);
        DequantizeBlock(got.data(), scale, n, is_signed, deq.data(), isa);
        ASSERT_EQ(0, std::memcmp(deq.data(), back.data(), n * sizeof(float))) << IsaName(isa);
      }
    }
  }
}

TEST(Int8Blocks, VectorCodesEqualTheBinarySearchAtEveryBoundary) {
  // The vector paths count midpoints through a bucket table (Note [fast 8-bit codes]); at every
  // midpoint, one ulp either side, every map value, and 2^16 random values of each sign and
  // magnitude (scale 1, so y = x), they must give the scalar binary search's code.
  for (bool is_signed : {true, false}) {
    std::vector<float> x;
    const float* mids = DynamicMapMidpoints(is_signed);
    const float* map = DynamicMap(is_signed);
    for (int k = 0; k < 255; ++k)
      for (float v : {mids[k], std::nextafter(mids[k], -2.0f), std::nextafter(mids[k], 2.0f)})
        if (std::fabs(v) <= 1.0f && (is_signed || v >= 0)) x.push_back(v);
    for (int k = 0; k < 256; ++k) x.push_back(map[k]);
    std::mt19937 rng(9);
    std::uniform_real_distribution<float> e(-30.0f, 0.0f);
    for (int i = 0; i < 65536; ++i) {
      const float v = std::pow(2.0f, e(rng));
      x.push_back(is_signed && (i & 1) ? -v : v);
    }
    x.push_back(0.0f);
    x.push_back(-0.0f);
    x.push_back(1e-40f);  // subnormal
    x.push_back(1.0f);
    // Quantize in blocks whose scale is exactly 1: each block holds a 1.0.
    for (size_t b = 0; b < x.size(); b += kInt8Block - 1) {
      std::vector<float> block(x.begin() + b, x.begin() + std::min(x.size(), b + kInt8Block - 1));
      block.push_back(1.0f);
      std::vector<uint8_t> want(block.size());
      float scale;
      QuantizeBlock(block.data(), block.size(), is_signed, want.data(), &scale, Isa::kScalar);
      ASSERT_EQ(scale, 1.0f);
      for (Isa isa : Isas()) {
        std::vector<uint8_t> got(block.size());
        QuantizeBlock(block.data(), block.size(), is_signed, got.data(), &scale, isa);
        for (size_t i = 0; i < block.size(); ++i)
          ASSERT_EQ(got[i], want[i]) << IsaName(isa) << " y=" << block[i];
      }
    }
  }
}

TEST(Int8Blocks, NonFiniteValuesGiveTheScalarCodesOnEveryIsa) {
  // A diverged run can hand the quantizer NaN or infinite moments. Every ISA must give the
  // scalar reference's bytes (its scale skips NaNs, a NaN counts no midpoint below it) and stay
  // inside the bucket table (an unchecked NaN's bucket lies past its end).
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1e-3f, 1e-3f);
  for (bool is_signed : {true, false}) {
    for (int pattern = 0; pattern < 5; ++pattern) {
      std::vector<float> x(kInt8Block);
      for (float& v : x) v = is_signed ? u(rng) : std::fabs(u(rng));
      if (pattern == 0) x[3] = nan, x[200] = -nan;  // NaNs beside finite values
      if (pattern == 1) x[17] = inf;                // the scale was inf: every other value NaN
      if (pattern == 2)
        for (float& v : x) v = nan;  // nothing but NaN: scale 0
      if (pattern == 3) x[0] = nan, x[255] = is_signed ? -inf : inf;
      if (pattern == 4) x[128] = nan, x[129] = 0.0f;
      std::vector<uint8_t> want(kInt8Block);
      float want_scale = -1;
      QuantizeBlock(x.data(), x.size(), is_signed, want.data(), &want_scale, Isa::kScalar);
      if (pattern == 2) {
        EXPECT_EQ(want_scale, 0.0f);
      }
      if (pattern == 0 || pattern == 4) {
        EXPECT_TRUE(std::isfinite(want_scale));
        EXPECT_EQ(want[pattern == 0 ? 3 : 128], 0);  // no midpoint lies below a NaN
      }
      if (pattern == 1 || pattern == 3) {
        // Note [an infinite moment]: the infinity counts as the largest finite float, so the
        // block decodes to finite values: it, and its neighbours far below it as zero (they
        // decoded 0 * inf = NaN).
        const float big = std::numeric_limits<float>::max();
        EXPECT_EQ(want_scale, big) << "pattern " << pattern;
        std::vector<float> back(kInt8Block);
        DequantizeBlock(want.data(), want_scale, back.size(), is_signed, back.data(), Isa::kScalar);
        for (float v : back) EXPECT_TRUE(std::isfinite(v)) << "pattern " << pattern;
        const size_t at = pattern == 1 ? 17 : 255;
        // The map's end codes: 1 and, signed, its most negative value (-0.993).
        EXPECT_EQ(back[at], (is_signed && pattern == 3 ? DynamicMap(true)[0] : 1.0f) * big)
            << "pattern " << pattern;
        EXPECT_EQ(back[at == 17 ? 16 : 254], 0.0f) << "pattern " << pattern;
      }
      for (Isa isa : Isas()) {
        std::vector<uint8_t> got(kInt8Block, 77);
        float scale = -1;
        QuantizeBlock(x.data(), x.size(), is_signed, got.data(), &scale, isa);
        EXPECT_EQ(std::memcmp(&scale, &want_scale, 4), 0) << IsaName(isa) << " pattern " << pattern;
        EXPECT_EQ(got, want) << IsaName(isa) << " pattern " << pattern;
      }
    }
  }
}

// Each vector path's block functions against the scalar ones, bit for bit, at every length up to
// 300 (every tail of a 16-lane vector and of the 64-code VBMI loop) and from unaligned addresses:
// the vector loops run whole vectors unmasked and only the tail masked (Note [unmasked main
// loops]), and the VBMI dequantizer interleaves byte planes (Note [8-bit values by byte
// permutes]); the AVX-512 gather dequantizer is checked here even on a CPU that would pick VBMI.
TEST(CompactKernels, EveryVectorPathEqualsTheScalarOneAtEveryLength) {
  struct Path {
    const char* name;
    internal::CompactKernels k;
  };
  std::vector<Path> paths;
  if (IsaSupported(Isa::kAvx2)) paths.push_back({"avx2", internal::CompactKernelsAvx2()});
  if (IsaSupported(Isa::kAvx512)) {
    paths.push_back({"avx512 gather", internal::CompactKernelsAvx512(/*vbmi=*/false)});
    if (Cpu().avx512vbmi) paths.push_back({"avx512 vbmi", internal::CompactKernelsAvx512(/*vbmi=*/true)});
  }
  if (paths.empty()) GTEST_SKIP() << "this CPU has no vector path";
  const internal::CompactKernels ref = internal::CompactKernelsScalar();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  uint32_t snan_bits = 0x7f800001u;  // a signalling NaN: narrowing must quiet it
  float snan;
  std::memcpy(&snan, &snan_bits, sizeof snan);
  constexpr size_t kGuard = 80;  // elements past n that no path may write
  std::mt19937 rng(11);
  for (size_t n = 0; n <= 300; ++n) {
    std::vector<float> mixed = MixedValues(n + 1, static_cast<uint32_t>(n));
    float* x = mixed.data() + 1;  // 4 bytes past the vector's alignment
    // Specials inside even the shortest inputs: NaN (absmax skips it, its code is 0), a
    // signalling NaN, infinities, a subnormal, a negative zero.
    const float specials[] = {nan, snan, inf, -inf, 1e-40f, -0.0f};
    for (size_t j = 0; j < std::size(specials) && n > 0; ++j) x[(n * (j + 1)) / 7 % n] = specials[j];
    std::vector<uint16_t> halves(n + 1);
    std::vector<uint8_t> codes(n + 1);
    for (size_t i = 0; i <= n; ++i) halves[i] = static_cast<uint16_t>(rng()), codes[i] = static_cast<uint8_t>(rng());
    std::vector<uint16_t> want16(n + kGuard, 0xdead), got16(n + kGuard);
    std::vector<float> want(n + kGuard, -7.0f), got(n + kGuard);
    std::vector<uint8_t> want8(n + kGuard, 77), got8(n + kGuard);
    for (const Path& p : paths) {
      SCOPED_TRACE(testing::Message() << p.name << " n=" << n);
      ref.narrow_bf16(x, want16.data(), n);
      std::fill(got16.begin(), got16.end(), 0xdead);
      p.k.narrow_bf16(x, got16.data(), n);
      ASSERT_EQ(got16, want16);
      ref.round_sr(x, want16.data(), n, 0x9e3779b9u, 0x7ffffff0u);  // lo + i crosses 2^31
      std::fill(got16.begin(), got16.end(), 0xdead);
      p.k.round_sr(x, got16.data(), n, 0x9e3779b9u, 0x7ffffff0u);
      ASSERT_EQ(got16, want16);
      ref.widen_bf16(halves.data() + 1, want.data(), n);
      std::fill(got.begin(), got.end(), -7.0f);
      p.k.widen_bf16(halves.data() + 1, got.data(), n);
      ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
      const float absmax = ref.absmax(x, n), got_absmax = p.k.absmax(x, n);
      ASSERT_EQ(0, std::memcmp(&absmax, &got_absmax, sizeof absmax));
      for (bool is_signed : {true, false}) {
        const internal::CodeTables& t = internal::CodeTablesOf(is_signed);
        ref.dequantize(codes.data() + 1, 0.37f, n, t, want.data());
        std::fill(got.begin(), got.end(), -7.0f);
        p.k.dequantize(codes.data() + 1, 0.37f, n, t, got.data());
        ASSERT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << is_signed;
        // Quantize what the block holds once its infinities are gone (a finite scale; NaNs stay).
        std::vector<float> y(x, x + n);
        for (float& v : y)
          if (std::isinf(v)) v = 0.5f;
        const float scale = ref.absmax(y.data(), n);
        if (scale == 0.0f) continue;
        ref.quantize(y.data(), n, scale, t, want8.data());
        std::fill(got8.begin(), got8.end(), 77);
        p.k.quantize(y.data(), n, scale, t, got8.data());
        ASSERT_EQ(got8, want8) << is_signed;
      }
    }
  }
}

TEST(Int8Blocks, StateBytesHoldCodesAndScales) {
  EXPECT_EQ(Int8StateBytes(256), 256u + 4u);
  EXPECT_EQ(Int8StateBytes(257), 260u + 8u);
  EXPECT_EQ(Int8ScaleOffset(257), 260u);
  EXPECT_EQ(Int8StateBytes(0), 0u);
}

}  // namespace
}  // namespace strata::optim
