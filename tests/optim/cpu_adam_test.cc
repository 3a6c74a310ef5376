// CPU Adam: every ISA this CPU has against the scalar reference (bit for bit), the formula
// against a double-precision model, inf/NaN skipping, 16-bit conversions, grad statistics.
#include "optim/cpu_adam.h"

#include <immintrin.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/base/cpu_features.h"
#include "tests/test_util.h"

namespace strata::optim {
namespace {

std::vector<Isa> VectorIsas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (IsaSupported(isa)) out.push_back(isa);
  }
  return out;
}

std::vector<Isa> AllIsas() {
  std::vector<Isa> out = {Isa::kScalar};
  for (Isa isa : VectorIsas()) out.push_back(isa);
  return out;
}

// One shard's buffers as raw bytes, so any dtype combination fits and copies compare exactly.
struct Shard {
  size_t n = 0;
  DType grad_dtype = DType::kFloat32, state_dtype = DType::kFloat32, p16_dtype = DType::kBFloat16;
  bool has_p16 = false;
  std::vector<float> master;
  std::vector<uint8_t> grad, m, v, p16;

  AdamBuffers Buffers() {
    AdamBuffers b;
    b.master = master.data();
    b.grad = grad.data();
    b.grad_dtype = grad_dtype;
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.state_dtype = state_dtype;
    b.param16 = has_p16 ? p16.data() : nullptr;
    b.param16_dtype = p16_dtype;
    b.n = n;
    return b;
  }
};

void Put(std::vector<uint8_t>& buf, DType t, size_t i, float x) {
  if (t == DType::kFloat32) {
    std::memcpy(buf.data() + 4 * i, &x, 4);
  } else {
    const uint16_t h = t == DType::kBFloat16 ? FloatToBf16(x) : FloatToHalf(x);
    std::memcpy(buf.data() + 2 * i, &h, 2);
  }
}

float Get(const std::vector<uint8_t>& buf, DType t, size_t i) {
  if (t == DType::kFloat32) {
    float x;
    std::memcpy(&x, buf.data() + 4 * i, 4);
    return x;
  }
  uint16_t h;
  std::memcpy(&h, buf.data() + 2 * i, 2);
  return t == DType::kBFloat16 ? Bf16ToFloat(h) : HalfToFloat(h);
}

Shard MakeShard(size_t n, DType g, DType s, bool has_p16, DType p16, std::mt19937& rng) {
  Shard sh;
  sh.n = n;
  sh.grad_dtype = g;
  sh.state_dtype = s;
  sh.has_p16 = has_p16;
  sh.p16_dtype = p16;
  sh.master.resize(n);
  sh.grad.resize(n * DTypeSize(g));
  sh.m.resize(n * DTypeSize(s));
  sh.v.resize(n * DTypeSize(s));
  sh.p16.assign(n * 2, 0xAB);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    sh.master[i] = normal(rng);
    Put(sh.grad, g, i, normal(rng) * 0.5f);
    Put(sh.m, s, i, normal(rng) * 0.1f);
    Put(sh.v, s, i, std::fabs(normal(rng)) * 0.01f);
  }
  return sh;
}

bool SameBytes(const Shard& a, const Shard& b) {
  return std::memcmp(a.master.data(), b.master.data(), a.n * 4) == 0 && a.grad == b.grad &&
         a.m == b.m && a.v == b.v && a.p16 == b.p16;
}

AdamParams RandomParams(std::mt19937& rng) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  AdamParams p;
  p.lr = std::pow(10.0, -4.0 + 3.0 * u(rng));
  p.beta1 = 0.8 + 0.19 * u(rng);
  p.beta2 = 0.9 + 0.0999 * u(rng);
  p.eps = std::pow(10.0, -9.0 + 3.0 * u(rng));
  p.weight_decay = u(rng) < 0.3 ? 0.0 : 0.1 * u(rng);
  p.adamw = u(rng) < 0.5;
  p.bias_correction = u(rng) < 0.8;
  p.step = 1 + static_cast<int64_t>(u(rng) * 200);
  return p;
}

TEST(CpuAdamTest, IsaNamesRoundTrip) {
  for (Isa isa : {Isa::kAuto, Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    ASSERT_OK_AND_ASSIGN(Isa parsed, ParseIsa(IsaName(isa)));
    EXPECT_EQ(parsed, isa);
  }
  StatusOr<Isa> bad = ParseIsa("sse9");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("sse9"), std::string::npos);
  EXPECT_NE(DetectIsa(), Isa::kAuto);
  EXPECT_TRUE(IsaSupported(DetectIsa()));
}

// Every vector path must produce the scalar path's bytes for every dtype combination, sizes
// that are not multiples of the vector width, and random hyperparameters, over two steps.
TEST(CpuAdamTest, EveryIsaMatchesScalarBitForBit) {
  const std::vector<Isa> isas = VectorIsas();
  if (isas.empty()) GTEST_SKIP() << "no vector ISA on this CPU";
  std::mt19937 rng(1234);
  tbb::task_arena arena(2);
  const size_t sizes[] = {1, 7, 8, 15, 16, 17, 31, 33, 100, 1000, 4099};
  const DType grads[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const DType states[] = {DType::kFloat32, DType::kBFloat16};
  int cases = 0;
  for (DType g : grads) {
    for (DType s : states) {
      for (int p16 = 0; p16 < 3; ++p16) {
        for (size_t n : sizes) {
          const bool has_p16 = p16 != 0;
          const DType p16_dtype = p16 == 2 ? DType::kFloat16 : DType::kBFloat16;
          const Shard start = MakeShard(n, g, s, has_p16, p16_dtype, rng);
          AdamParams params = RandomParams(rng);
          const float scale = std::uniform_real_distribution<float>(0.25f, 2.0f)(rng);
          Shard ref = start;
          AdamOptions ref_opt;
          ref_opt.isa = Isa::kScalar;
          for (int step = 0; step < 2; ++step) {
            ASSERT_OK_AND_ASSIGN(AdamResult r, AdamStep(params, ref.Buffers(), scale, ref_opt));
            ASSERT_FALSE(r.skipped);
            EXPECT_EQ(r.isa, Isa::kScalar);
          }
          for (Isa isa : isas) {
            // The AVX-512 kernels run with and without software prefetch (Note [prefetch]).
            for (SoftwarePrefetch pf : {SoftwarePrefetch::kOn, SoftwarePrefetch::kOff}) {
              const bool avx512 = isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16;
              if (!avx512 && pf == SoftwarePrefetch::kOff) continue;
              Shard got = start;
              AdamOptions opt;
              opt.isa = isa;
              opt.prefetch = pf;
              opt.arena = &arena;
              opt.grain = 64;  // many tasks even for small n: exercises the partitioning too
              for (int step = 0; step < 2; ++step) {
                ASSERT_OK_AND_ASSIGN(AdamResult r, AdamStep(params, got.Buffers(), scale, opt));
                ASSERT_FALSE(r.skipped);
                EXPECT_EQ(r.isa, isa);
                EXPECT_EQ(r.prefetch, avx512 && pf == SoftwarePrefetch::kOn);
              }
              ASSERT_TRUE(SameBytes(ref, got))
                  << IsaName(isa) << " prefetch=" << (pf == SoftwarePrefetch::kOn)
                  << " grad=" << DTypeName(g) << " state=" << DTypeName(s) << " p16=" << p16
                  << " n=" << n << " adamw=" << params.adamw << " wd=" << params.weight_decay
                  << " step=" << params.step;
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(cases, 0);
}

// The 16-bit copy takes a streaming-store path when it is aligned and an ordinary one when not;
// both must write the scalar reference's bytes.
TEST(CpuAdamTest, Param16AlignedAndUnalignedMatchScalar) {
  std::mt19937 rng(77);
  tbb::task_arena arena(2);
  const size_t n = 3000;
  const Shard start = MakeShard(n, DType::kFloat32, DType::kFloat32, false, DType::kBFloat16, rng);
  for (DType p16 : {DType::kBFloat16, DType::kFloat16}) {
    for (size_t offset_elems : {size_t{0}, size_t{1}, size_t{8}}) {
      std::vector<std::vector<uint16_t>> outs;
      for (Isa isa : AllIsas()) {
        // 64-byte aligned storage, then shifted by offset_elems 16-bit elements.
        std::vector<uint16_t> storage(n + 64, 0);
        uint16_t* base = storage.data();
        while (reinterpret_cast<uintptr_t>(base) % 64 != 0) ++base;
        uint16_t* out = base + offset_elems;
        Shard sh = start;
        AdamBuffers b = sh.Buffers();
        b.param16 = out;
        b.param16_dtype = p16;
        AdamOptions opt;
        opt.isa = isa;
        opt.arena = &arena;
        opt.grain = 256;
        ASSERT_OK(AdamStep(AdamParams{}, b, 1.0f, opt).status());
        outs.emplace_back(out, out + n);
      }
      for (size_t k = 1; k < outs.size(); ++k) {
        EXPECT_EQ(outs[k], outs[0]) << IsaName(AllIsas()[k]) << " offset=" << offset_elems;
      }
    }
  }
}

// The formula in cpu_adam.h evaluated in double; the float kernel must agree to float
// precision (a few ulps, plus the rounding of the constants).
TEST(CpuAdamTest, MatchesDoublePrecisionFormula) {
  std::mt19937 rng(99);
  for (bool adamw : {false, true}) {
    for (bool bias_correction : {false, true}) {
      const size_t n = 1003;
      Shard sh = MakeShard(n, DType::kFloat32, DType::kFloat32, false, DType::kBFloat16, rng);
      AdamParams p;
      p.lr = 1e-2;
      p.weight_decay = 0.05;
      p.adamw = adamw;
      p.bias_correction = bias_correction;
      p.step = 3;
      const float scale = 0.5f;
      std::vector<double> pd(n), md(n), vd(n), mag(n);
      for (size_t i = 0; i < n; ++i) {
        double param = sh.master[i], g = Get(sh.grad, DType::kFloat32, i) * double{scale};
        double m = Get(sh.m, DType::kFloat32, i), v = Get(sh.v, DType::kFloat32, i);
        if (!adamw) g += p.weight_decay * param;
        // m and v are sums of two terms that may cancel: float error scales with the terms.
        mag[i] = std::fabs(m) + std::fabs(g) + g * g;
        if (adamw) param *= 1 - p.lr * p.weight_decay;
        m = p.beta1 * m + (1 - p.beta1) * g;
        v = p.beta2 * v + (1 - p.beta2) * g * g;
        const double bc1 = bias_correction ? 1 - std::pow(p.beta1, 3) : 1;
        const double bc2 = bias_correction ? 1 - std::pow(p.beta2, 3) : 1;
        param -= p.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + p.eps);
        pd[i] = param;
        md[i] = m;
        vd[i] = v;
      }
      ASSERT_OK_AND_ASSIGN(AdamResult r, AdamStep(p, sh.Buffers(), scale));
      ASSERT_FALSE(r.skipped);
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(sh.master[i], pd[i], 1e-6 * (1 + std::fabs(pd[i]))) << i;
        ASSERT_NEAR(Get(sh.m, DType::kFloat32, i), md[i], 1e-6 * mag[i]) << i;
        ASSERT_NEAR(Get(sh.v, DType::kFloat32, i), vd[i], 1e-6 * (mag[i] + std::fabs(vd[i]))) << i;
      }
    }
  }
}

// An inf or NaN anywhere (first element, inside a vector, in the masked tail) skips the step
// and leaves every buffer untouched, on every ISA and grad dtype.
TEST(CpuAdamTest, NonFiniteGradSkipsWithoutWriting) {
  std::mt19937 rng(7);
  tbb::task_arena arena(2);
  const float bad_values[] = {std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN()};
  for (Isa isa : AllIsas()) {
    for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const size_t n = 1000 + 13;
      for (size_t pos : {size_t{0}, size_t{517}, n - 1}) {
        for (float bad : bad_values) {
          Shard sh = MakeShard(n, g, DType::kFloat32, true, DType::kBFloat16, rng);
          Put(sh.grad, g, pos, bad);
          const Shard before = sh;
          AdamOptions opt;
          opt.isa = isa;
          opt.arena = &arena;
          opt.grain = 128;
          ASSERT_OK_AND_ASSIGN(AdamResult r, AdamStep(AdamParams{}, sh.Buffers(), 0.5f, opt));
          EXPECT_TRUE(r.skipped) << IsaName(isa) << " " << DTypeName(g) << " pos=" << pos;
          EXPECT_TRUE(SameBytes(before, sh)) << IsaName(isa) << " " << DTypeName(g);
        }
      }
    }
  }
}

// A finite gradient that overflows once multiplied by grad_scale counts as non-finite too.
TEST(CpuAdamTest, OverflowFromScalingSkips) {
  std::mt19937 rng(8);
  Shard sh = MakeShard(64, DType::kFloat32, DType::kFloat32, false, DType::kBFloat16, rng);
  Put(sh.grad, DType::kFloat32, 40, 3e38f);
  const Shard before = sh;
  ASSERT_OK_AND_ASSIGN(AdamResult r, AdamStep(AdamParams{}, sh.Buffers(), 4.0f));
  EXPECT_TRUE(r.skipped);
  EXPECT_TRUE(SameBytes(before, sh));
  // With the caller vouching for the grads, no scan happens: the NaN reaches the state.
  AdamOptions trusted;
  trusted.grad_check = GradCheck::kCallerChecked;
  ASSERT_OK_AND_ASSIGN(r, AdamStep(AdamParams{}, sh.Buffers(), 4.0f, trusted));
  EXPECT_FALSE(r.skipped);
  EXPECT_TRUE(std::isnan(sh.master[40]));
}

TEST(CpuAdamTest, RejectsBadInputWithClearMessages) {
  std::mt19937 rng(3);
  Shard sh = MakeShard(16, DType::kFloat32, DType::kFloat32, false, DType::kBFloat16, rng);
  auto expect_error = [&](AdamParams p, AdamBuffers b, float scale, const char* needle) {
    const Shard before = sh;
    StatusOr<AdamResult> r = AdamStep(p, b, scale);
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
    EXPECT_TRUE(SameBytes(before, sh));
  };
  AdamParams p;
  AdamBuffers b = sh.Buffers();
  p.lr = -1;
  expect_error(p, b, 1.0f, "lr=-1");
  p = AdamParams{};
  p.beta1 = 1.0;
  expect_error(p, b, 1.0f, "beta1=1");
  p = AdamParams{};
  p.eps = 0;
  expect_error(p, b, 1.0f, "eps=0");
  p = AdamParams{};
  p.step = 0;
  expect_error(p, b, 1.0f, "step=0");
  expect_error(AdamParams{}, b, std::nanf(""), "grad_scale=nan");
  b.state_dtype = DType::kFloat16;
  expect_error(AdamParams{}, b, 1.0f, "state dtype=fp16");
  b = sh.Buffers();
  b.master = nullptr;
  expect_error(AdamParams{}, b, 1.0f, "master is null");
  b = sh.Buffers();
  b.param16 = sh.p16.data();
  b.param16_dtype = DType::kFloat32;
  expect_error(AdamParams{}, b, 1.0f, "param16 dtype=fp32");
  // n == 0 with null pointers is a valid no-op.
  ASSERT_OK_AND_ASSIGN(AdamResult r, AdamStep(AdamParams{}, AdamBuffers{}, 1.0f));
  EXPECT_FALSE(r.skipped);
}

TEST(CpuAdamTest, Bf16RoundToNearestEvenOnTies) {
  struct Case {
    uint32_t in;
    uint16_t out;
  };
  const Case cases[] = {
      {0x3F808000u, 0x3F80u},  // 1 + 2^-8: tie, kept part even -> down
      {0x3F818000u, 0x3F82u},  // tie, kept part odd -> up
      {0x3F808001u, 0x3F81u},  // just above the tie -> up
      {0x3F807FFFu, 0x3F80u},  // just below -> down
      {0xBF818000u, 0xBF82u},  // negative tie, odd -> away from zero
      {0x7F7F8000u, 0x7F80u},  // tie at the top, odd -> infinity
      {0x7F7F7FFFu, 0x7F7Fu},  // largest that stays finite
      {0x00018000u, 0x0002u},  // subnormal tie, odd -> up (not flushed)
      {0x00008000u, 0x0000u},  // subnormal tie, even -> zero
      {0x00008001u, 0x0001u},  // subnormal just above the tie
      {0x80000000u, 0x8000u},  // -0
      {0x7F800000u, 0x7F80u},  // inf
      {0x7FA00000u, 0x7FE0u},  // signalling NaN -> quiet NaN, payload kept
  };
  for (const Case& c : cases) {
    EXPECT_EQ(FloatToBf16(BitsToFloat(c.in)), c.out) << std::hex << c.in;
  }
  // The same values through every kernel's param16 store (lr = 0 leaves master unchanged).
  for (Isa isa : AllIsas()) {
    const size_t n = std::size(cases) * 3;  // 39: full vectors plus a tail on every ISA
    std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f), grad(n, 0.0f);
    std::vector<uint16_t> out(n, 0);
    for (size_t i = 0; i < n; ++i) master[i] = BitsToFloat(cases[i % std::size(cases)].in);
    AdamBuffers b;
    b.master = master.data();
    b.grad = grad.data();
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.param16 = out.data();
    b.param16_dtype = DType::kBFloat16;
    b.n = n;
    AdamParams p;
    p.lr = 0;
    AdamOptions opt;
    opt.isa = isa;
    opt.grad_check = GradCheck::kCallerChecked;
    ASSERT_OK(AdamStep(p, b, 1.0f, opt).status());
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(out[i], cases[i % std::size(cases)].out)
          << IsaName(isa) << " in=" << std::hex << cases[i % std::size(cases)].in;
    }
  }
}

// A direct model of IEEE binary16 used as the reference for HalfToFloat.
double HalfModel(uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  if (exp == 31) return mant ? std::nan("") : sign * std::numeric_limits<double>::infinity();
  return sign * std::ldexp(1024 + mant, exp - 25);
}

__attribute__((target("f16c"))) uint16_t HardwareHalf(float x) {
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}

TEST(CpuAdamTest, Fp16ConversionsExact) {
  // fp16 -> fp32 for all 65536 inputs, and fp32 -> fp16 round trip for every non-NaN.
  for (uint32_t h = 0; h < 65536; ++h) {
    const double want = HalfModel(static_cast<uint16_t>(h));
    const float got = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(got), want) << h;
    ASSERT_EQ(FloatToHalf(got), h) << h;
  }
  // Hand-picked ties and edges.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3C00);      // tie, even -> down
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);  // tie, odd -> up
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65519.996f), 0x7BFF);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7C00);  // tie with infinity, which is even
  EXPECT_EQ(FloatToHalf(-1e6f), 0xFC00);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);      // tie with 0
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);      // tie 1 vs 2 -> 2
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)), 0x0001);      // above the tie
  EXPECT_EQ(FloatToHalf(std::ldexp(1023.5f, -24)), 0x0400);   // rounds into the first normal
  // Random fp32 bit patterns: the result is the nearest half (ties to even) by definition,
  // and equals F16C's conversion where the CPU has it.
  std::mt19937 rng(5);
  const bool f16c = Cpu().f16c;
  for (int i = 0; i < 200000; ++i) {
    // Exponents concentrated on fp16's range so subnormals, normals and overflow all appear.
    const uint32_t sign = rng() & 0x80000000u;
    const uint32_t exp = 100 + rng() % 48;  // 2^-27 .. 2^20
    const uint32_t bits = sign | (exp << 23) | (rng() & 0x7fffffu);
    const float x = BitsToFloat(bits);
    const uint16_t h = FloatToHalf(x);
    if (f16c) {
      ASSERT_EQ(h, HardwareHalf(x)) << std::hex << bits;
    }
    const double err = std::fabs(HalfModel(h) - x);
    if ((h & 0x7c00) != 0x7c00) {
      for (int d : {-1, 1}) {
        const uint16_t other = static_cast<uint16_t>(h + d);
        if ((other & 0x7fff) >= 0x7c00 || ((other ^ h) & 0x8000)) continue;
        const double other_err = std::fabs(HalfModel(other) - x);
        ASSERT_TRUE(err < other_err || (err == other_err && (h & 1) == 0)) << std::hex << bits;
      }
    }
  }
  // Through every kernel's fp16 store.
  for (Isa isa : AllIsas()) {
    const size_t n = 1001;
    std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f), grad(n, 0.0f);
    std::vector<uint16_t> out(n);
    for (size_t i = 0; i < n; ++i) master[i] = BitsToFloat((rng() & 0x80000000u) | ((100 + rng() % 48) << 23) | (rng() & 0x7fffffu));
    AdamBuffers b;
    b.master = master.data();
    b.grad = grad.data();
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.param16 = out.data();
    b.param16_dtype = DType::kFloat16;
    b.n = n;
    AdamParams p;
    p.lr = 0;
    AdamOptions opt;
    opt.isa = isa;
    ASSERT_OK(AdamStep(p, b, 1.0f, opt).status());
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(out[i], FloatToHalf(master[i])) << IsaName(isa) << i;
    }
  }
}

TEST(CpuAdamTest, UnscaleCheckNormMatchesReference) {
  std::mt19937 rng(11);
  tbb::task_arena arena(2);
  for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (size_t n : {size_t{0}, size_t{5}, size_t{16}, size_t{1000}, size_t{100003}}) {
      Shard sh = MakeShard(n, g, DType::kFloat32, false, DType::kBFloat16, rng);
      const float scale = 0.125f;
      double want = 0;
      for (size_t i = 0; i < n; ++i) {
        const double x = static_cast<double>(Get(sh.grad, g, i) * scale);
        want += x * x;
      }
      for (Isa isa : AllIsas()) {
        AdamOptions opt;
        opt.isa = isa;
        opt.arena = &arena;
        opt.grain = 4096;
        ASSERT_OK_AND_ASSIGN(GradStats s, UnscaleCheckNorm(sh.grad.data(), g, n, scale, opt));
        EXPECT_FALSE(s.found_nonfinite);
        EXPECT_NEAR(s.sum_sq, want, 1e-12 * (1 + want)) << IsaName(isa) << " " << DTypeName(g);
        // Deterministic: the same call gives the same bits.
        ASSERT_OK_AND_ASSIGN(GradStats again, UnscaleCheckNorm(sh.grad.data(), g, n, scale, opt));
        EXPECT_EQ(s.sum_sq, again.sum_sq);
        if (n > 0) {
          for (size_t pos : {size_t{0}, n / 2, n - 1}) {
            Shard bad = sh;
            Put(bad.grad, g, pos, std::numeric_limits<float>::quiet_NaN());
            ASSERT_OK_AND_ASSIGN(GradStats b, UnscaleCheckNorm(bad.grad.data(), g, n, scale, opt));
            EXPECT_TRUE(b.found_nonfinite) << IsaName(isa) << " pos=" << pos;
          }
        }
      }
    }
  }
  EXPECT_FALSE(UnscaleCheckNorm(nullptr, DType::kFloat32, 4, 1.0f).ok());
}

// Clipping by global norm across shards: the combined scale brings the norm to max_norm.
TEST(CpuAdamTest, CombinedGradScaleClipsGlobalNorm) {
  std::mt19937 rng(31);
  const float inv_loss_scale = 1.0f / 1024;
  double sum_sq = 0;
  std::vector<Shard> shards;
  for (size_t n : {size_t{1000}, size_t{517}}) {
    shards.push_back(MakeShard(n, DType::kFloat32, DType::kFloat32, false, DType::kBFloat16, rng));
    ASSERT_OK_AND_ASSIGN(GradStats s, UnscaleCheckNorm(shards.back().grad.data(), DType::kFloat32,
                                                       n, inv_loss_scale));
    sum_sq += s.sum_sq;
  }
  const double norm = std::sqrt(sum_sq);
  EXPECT_EQ(CombinedGradScale(sum_sq, 0.0, inv_loss_scale), inv_loss_scale);      // off
  EXPECT_EQ(CombinedGradScale(sum_sq, norm * 2, inv_loss_scale), inv_loss_scale);  // below
  const float scale = CombinedGradScale(sum_sq, norm / 4, inv_loss_scale);
  double clipped = 0;
  for (Shard& sh : shards) {
    ASSERT_OK_AND_ASSIGN(GradStats s, UnscaleCheckNorm(sh.grad.data(), DType::kFloat32, sh.n, scale));
    clipped += s.sum_sq;
  }
  // DeepSpeed's rule divides by (norm + 1e-6) / max_norm, so the result sits just below max_norm.
  const double want = norm * (norm / 4) / (norm + 1e-6);
  EXPECT_NEAR(std::sqrt(clipped), want, 1e-6 * want);
  EXPECT_LT(std::sqrt(clipped), norm / 4);
}

// Note [bf16 optimizer states] claims 0.999 * v rounds back to v in bf16, so v cannot decay,
// while m (beta1 = 0.9) still does. Check both on every ISA, against fp32 states.
TEST(CpuAdamTest, Bf16StatesBehaveAsDocumented) {
  for (Isa isa : AllIsas()) {
    const size_t n = 100;
    std::mt19937 rng(21);
    Shard bf = MakeShard(n, DType::kFloat32, DType::kBFloat16, false, DType::kBFloat16, rng);
    Shard fp = MakeShard(n, DType::kFloat32, DType::kFloat32, false, DType::kBFloat16, rng);
    for (size_t i = 0; i < n; ++i) {
      Put(bf.grad, DType::kFloat32, i, 0.0f);
      Put(fp.grad, DType::kFloat32, i, 0.0f);
      Put(fp.m, DType::kFloat32, i, Get(bf.m, DType::kBFloat16, i));
      Put(fp.v, DType::kFloat32, i, Get(bf.v, DType::kBFloat16, i));
    }
    const Shard bf0 = bf, fp0 = fp;
    AdamOptions opt;
    opt.isa = isa;
    AdamParams p;  // beta2 = 0.999
    for (int step = 1; step <= 10; ++step) {
      p.step = step;
      ASSERT_OK(AdamStep(p, bf.Buffers(), 1.0f, opt).status());
      ASSERT_OK(AdamStep(p, fp.Buffers(), 1.0f, opt).status());
    }
    for (size_t i = 0; i < n; ++i) {
      const float v0 = Get(bf0.v, DType::kBFloat16, i);
      if (v0 == 0) continue;
      EXPECT_EQ(Get(bf.v, DType::kBFloat16, i), v0) << "bf16 v decayed at " << i;
      EXPECT_LT(Get(fp.v, DType::kFloat32, i), v0) << "fp32 v did not decay at " << i;
      const float m0 = Get(bf0.m, DType::kBFloat16, i);
      const float m_fp = Get(fp.m, DType::kFloat32, i);
      EXPECT_LT(std::fabs(m_fp), std::fabs(m0));
      EXPECT_NEAR(Get(bf.m, DType::kBFloat16, i), m_fp, 0.02 * std::fabs(m0));
    }
  }
}

}  // namespace
}  // namespace strata::optim
