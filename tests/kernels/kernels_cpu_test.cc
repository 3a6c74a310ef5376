// The CPU twins of kernels/kernels.h against the scalar references in optim/, the documented
// reduction order, and the shared argument validation. Runs everywhere.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "optim/compact_formats.h"
#include "optim/compact_step.h"
#include "optim/cpu_adam.h"
#include "optim/dtype.h"
#include "runtime/base/device.h"
#include "tests/kernels/kernel_test_data.h"
#include "tests/test_util.h"
#include "tiers/hbm/device_factory.h"

namespace strata::kernels {
namespace {

using optim::DType;
using testing::CastInputs;
using testing::DoubleBits;
using testing::Encode;
using testing::RandomFloats;

constexpr Backend kCpu = Backend::kCpu;

// ---- Casts ----

TEST(KernelsCpuCast, Fp32To16MatchesScalarReferenceBitForBit) {
  const std::vector<float> in = CastInputs();
  std::vector<uint16_t> bf(in.size()), hf(in.size());
  ASSERT_OK(CastFp32To16(kCpu, in.data(), bf.data(), DType::kBFloat16, in.size()));
  ASSERT_OK(CastFp32To16(kCpu, in.data(), hf.data(), DType::kFloat16, in.size()));
  size_t bad_bf = 0, bad_hf = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    bad_bf += bf[i] != optim::FloatToBf16(in[i]);
    bad_hf += hf[i] != optim::FloatToHalf(in[i]);
  }
  EXPECT_EQ(bad_bf, 0u);
  EXPECT_EQ(bad_hf, 0u);
  // Spot checks against known roundings, so the test does not only compare a function with
  // itself: ties go to even, overflow goes to infinity.
  const float one_plus_half_ulp_bf = optim::BitsToFloat(0x3f808000u);  // tie, kept part even
  const float one_plus_3half_ulp_bf = optim::BitsToFloat(0x3f818000u);  // tie, kept part odd
  const float big = 65520.0f;                                             // fp16 tie -> inf
  const float src[3] = {one_plus_half_ulp_bf, one_plus_3half_ulp_bf, big};
  uint16_t out_bf[3], out_hf[3];
  ASSERT_OK(CastFp32To16(kCpu, src, out_bf, DType::kBFloat16, 3));
  ASSERT_OK(CastFp32To16(kCpu, src, out_hf, DType::kFloat16, 3));
  EXPECT_EQ(out_bf[0], 0x3f80);
  EXPECT_EQ(out_bf[1], 0x3f82);
  EXPECT_EQ(out_hf[2], 0x7c00);
}

TEST(KernelsCpuCast, Widen16ToFp32IsExactForEveryInput) {
  std::vector<uint16_t> in(65536);
  std::iota(in.begin(), in.end(), uint16_t{0});
  std::vector<float> bf(in.size()), hf(in.size());
  ASSERT_OK(Cast16ToFp32(kCpu, in.data(), DType::kBFloat16, bf.data(), in.size()));
  ASSERT_OK(Cast16ToFp32(kCpu, in.data(), DType::kFloat16, hf.data(), in.size()));
  for (uint32_t h = 0; h < 65536; ++h) {
    ASSERT_EQ(optim::FloatBits(bf[h]), optim::FloatBits(optim::Bf16ToFloat(h))) << h;
    ASSERT_EQ(optim::FloatBits(hf[h]), optim::FloatBits(optim::HalfToFloat(h))) << h;
    // Round trip through the narrowing cast gives the 16 bits back (NaN: quieted).
    if (!std::isnan(hf[h])) {
      ASSERT_EQ(optim::FloatToHalf(hf[h]), h);
    }
  }
}

TEST(KernelsCpuCast, RejectsBadArguments) {
  float f = 1.0f;
  uint16_t h = 0;
  EXPECT_EQ(CastFp32To16(kCpu, &f, &h, DType::kFloat32, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CastFp32To16(kCpu, nullptr, &h, DType::kBFloat16, 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Cast16ToFp32(kCpu, &h, DType::kFloat32, &f, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CastFp32To16(static_cast<Backend>(7), &f, &h, DType::kBFloat16, 1).code(),
            StatusCode::kInvalidArgument);
  EXPECT_OK(CastFp32To16(kCpu, nullptr, nullptr, DType::kFloat16, 0));
}

// ---- Gradient statistics ----

// Note [stats order] in kernels/internal.h, written out the plainest way: one accumulator per
// lane, elements dealt round-robin, then the halving trees. The twin must give the same bits.
double StatsInDocumentedOrder(const std::vector<float>& x) {
  constexpr size_t T = 256, kPerLane = 8, kMaxBlocks = 1024;
  const size_t n = x.size();
  size_t blocks = (n + T * kPerLane - 1) / (T * kPerLane);
  blocks = std::max<size_t>(1, std::min(blocks, kMaxBlocks));
  std::vector<double> lane(blocks * T, 0.0);
  for (size_t i = 0; i < n; ++i) lane[i % lane.size()] += static_cast<double>(x[i]) * x[i];
  auto fold = [](double* s) {
    for (size_t w = T / 2; w > 0; w /= 2) {
      for (size_t t = 0; t < w; ++t) s[t] += s[t + w];
    }
    return s[0];
  };
  std::vector<double> partial(blocks);
  for (size_t b = 0; b < blocks; ++b) partial[b] = fold(&lane[b * T]);
  std::vector<double> fin(T, 0.0);
  for (size_t t = 0; t < T; ++t) {
    for (size_t b = t; b < blocks; b += T) fin[t] += partial[b];
  }
  return 0.0 + fold(fin.data());
}

class KernelsCpuStats : public ::testing::TestWithParam<DType> {};

TEST_P(KernelsCpuStats, MatchesOptimAndTheDocumentedOrder) {
  const DType dt = GetParam();
  // Sizes around the block and lane boundaries, and past the block cap (1024 * 2048).
  for (size_t n : {size_t{1}, size_t{255}, size_t{256}, size_t{2049}, size_t{100003},
                   size_t{1024 * 2048 + 77}, size_t{5000000}}) {
    SCOPED_TRACE(n);
    const std::vector<float> values = RandomFloats(n, static_cast<uint32_t>(n), 1.0f, 4);
    const std::vector<uint8_t> grad = Encode(values, dt);
    const std::vector<uint8_t> before = grad;
    const float scale = 0.25f;
    ASSERT_OK_AND_ASSIGN(const optim::GradStats ours,
                         UnscaleCheckNorm(kCpu, grad.data(), dt, n, scale));
    ASSERT_OK_AND_ASSIGN(const optim::GradStats ref,
                         optim::UnscaleCheckNorm(grad.data(), dt, n, scale));
    EXPECT_FALSE(ours.found_nonfinite);
    EXPECT_FALSE(ref.found_nonfinite);
    EXPECT_NEAR(ours.sum_sq, ref.sum_sq, 1e-12 * ref.sum_sq);
    // Bit-exact against the documented order (what the GPU computes too).
    std::vector<float> scaled(n);
    for (size_t i = 0; i < n; ++i) {
      float g = dt == DType::kFloat32 ? values[i]
                : dt == DType::kBFloat16 ? optim::Bf16ToFloat(optim::FloatToBf16(values[i]))
                                         : optim::HalfToFloat(optim::FloatToHalf(values[i]));
      scaled[i] = g * scale;
    }
    EXPECT_EQ(DoubleBits(ours.sum_sq), DoubleBits(StatsInDocumentedOrder(scaled)));
    EXPECT_EQ(grad, before) << "the pass must be read-only";
  }
}

TEST_P(KernelsCpuStats, FlagsInfNanAndOverflowOfTheScaledValue) {
  const DType dt = GetParam();
  const size_t n = 50000;
  const std::vector<float> base = RandomFloats(n, 7, 1.0f, 2);
  const float specials[] = {std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  for (float special : specials) {
    for (size_t at : {size_t{0}, size_t{4097}, n - 1}) {
      std::vector<float> v = base;
      v[at] = special;
      const std::vector<uint8_t> grad = Encode(v, dt);
      ASSERT_OK_AND_ASSIGN(const optim::GradStats s, UnscaleCheckNorm(kCpu, grad.data(), dt, n, 1.0f));
      EXPECT_TRUE(s.found_nonfinite) << special << " at " << at;
      EXPECT_EQ(s.sum_sq, 0.0);
    }
  }
  // Finite grads whose product with the scale overflows fp32 count as non-finite, as in optim.
  std::vector<float> v = base;
  v[123] = dt == DType::kFloat16 ? 60000.0f : 1e30f;
  const std::vector<uint8_t> grad = Encode(v, dt);
  ASSERT_OK_AND_ASSIGN(const optim::GradStats ours,
                       UnscaleCheckNorm(kCpu, grad.data(), dt, n, 3e34f));
  ASSERT_OK_AND_ASSIGN(const optim::GradStats ref,
                       optim::UnscaleCheckNorm(grad.data(), dt, n, 3e34f));
  EXPECT_TRUE(ours.found_nonfinite);
  EXPECT_EQ(ours.found_nonfinite, ref.found_nonfinite);
}

TEST_P(KernelsCpuStats, AccumulatesShardsInCallOrder) {
  const DType dt = GetParam();
  const std::vector<float> a = RandomFloats(3000, 1), b = RandomFloats(70000, 2);
  const std::vector<uint8_t> ga = Encode(a, dt), gb = Encode(b, dt);
  GradStatsAccumulator acc;
  acc.sum_sq = 123.0;  // garbage that Reset must clear
  acc.found_nonfinite = 1;
  ASSERT_OK(ResetGradStats(kCpu, &acc));
  ASSERT_OK(AccumulateGradStats(kCpu, ga.data(), dt, a.size(), 0.5f, &acc));
  ASSERT_OK(AccumulateGradStats(kCpu, gb.data(), dt, b.size(), 0.5f, &acc));
  ASSERT_OK_AND_ASSIGN(const optim::GradStats total, ReadGradStats(kCpu, &acc));
  ASSERT_OK_AND_ASSIGN(const optim::GradStats sa, UnscaleCheckNorm(kCpu, ga.data(), dt, a.size(), 0.5f));
  ASSERT_OK_AND_ASSIGN(const optim::GradStats sb, UnscaleCheckNorm(kCpu, gb.data(), dt, b.size(), 0.5f));
  EXPECT_FALSE(total.found_nonfinite);
  EXPECT_EQ(DoubleBits(total.sum_sq), DoubleBits(0.0 + sa.sum_sq + sb.sum_sq));
  // Deterministic: the same calls give the same bits.
  ASSERT_OK(ResetGradStats(kCpu, &acc));
  ASSERT_OK(AccumulateGradStats(kCpu, ga.data(), dt, a.size(), 0.5f, &acc));
  ASSERT_OK(AccumulateGradStats(kCpu, gb.data(), dt, b.size(), 0.5f, &acc));
  EXPECT_EQ(DoubleBits(acc.sum_sq), DoubleBits(total.sum_sq));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KernelsCpuStats,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) { return std::string(optim::DTypeName(info.param)); });

TEST(KernelsCpuStatsArgs, RejectsBadArguments) {
  GradStatsAccumulator acc{};
  float g = 1.0f;
  EXPECT_EQ(AccumulateGradStats(kCpu, nullptr, DType::kFloat32, 4, 1.0f, &acc).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(AccumulateGradStats(kCpu, &g, DType::kFloat32, 1, 1.0f, nullptr).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(AccumulateGradStats(kCpu, &g, DType::kFloat32, 1,
                                std::numeric_limits<float>::infinity(), &acc).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(AccumulateGradStats(kCpu, &g, static_cast<DType>(9), 1, 1.0f, &acc).code(),
            StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(const optim::GradStats empty,
                       UnscaleCheckNorm(kCpu, nullptr, DType::kFloat16, 0, 1.0f));
  EXPECT_FALSE(empty.found_nonfinite);
  EXPECT_EQ(empty.sum_sq, 0.0);
}

// ---- Adam ----

struct AdamCase {
  DType grad, state;
  bool has_p16;
  DType p16;
  bool adamw;
};

std::vector<AdamCase> AllAdamCases() {
  std::vector<AdamCase> out;
  for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (DType s : {DType::kFloat32, DType::kBFloat16}) {
      for (int p = 0; p < 3; ++p) {
        for (bool adamw : {true, false}) {
          out.push_back({g, s, p != 0, p == 2 ? DType::kFloat16 : DType::kBFloat16, adamw});
        }
      }
    }
  }
  return out;
}

// One shard's state for both runs.
struct AdamState {
  std::vector<float> master;
  std::vector<uint8_t> grad, m, v, p16;
  optim::AdamBuffers Buffers(const AdamCase& c) {
    optim::AdamBuffers b;
    b.master = master.data();
    b.grad = grad.data();
    b.grad_dtype = c.grad;
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    b.state_dtype = c.state;
    b.param16 = c.has_p16 ? p16.data() : nullptr;
    b.param16_dtype = c.p16;
    b.n = master.size();
    return b;
  }
};

AdamState MakeAdamState(const AdamCase& c, size_t n, uint32_t seed) {
  AdamState s;
  s.master = RandomFloats(n, seed, 0.1f, 4);
  s.grad = Encode(RandomFloats(n, seed + 1, 1e-3f, 6), c.grad);
  s.m = Encode(RandomFloats(n, seed + 2, 1e-4f, 4), c.state);
  std::vector<float> v = RandomFloats(n, seed + 3, 1e-6f, 4);
  for (auto& x : v) x = std::fabs(x);
  s.v = Encode(v, c.state);
  s.p16.assign(2 * n, 0);
  return s;
}

optim::AdamParams TestParams(const AdamCase& c, int64_t step) {
  optim::AdamParams p;
  p.lr = 1e-3;
  p.weight_decay = 0.01;
  p.adamw = c.adamw;
  p.step = step;
  return p;
}

TEST(KernelsCpuAdam, EqualsOptimAdamStepBitForBit) {
  for (const AdamCase& c : AllAdamCases()) {
    SCOPED_TRACE(::testing::Message() << "grad=" << optim::DTypeName(c.grad) << " state="
                                      << optim::DTypeName(c.state) << " p16="
                                      << (c.has_p16 ? optim::DTypeName(c.p16) : "none")
                                      << " adamw=" << c.adamw);
    const size_t n = 10007;
    AdamState ours = MakeAdamState(c, n, 11), ref = MakeAdamState(c, n, 11);
    for (int64_t step = 1; step <= 3; ++step) {
      ASSERT_OK(AdamStep(kCpu, TestParams(c, step), ours.Buffers(c), 0.5f));
      optim::AdamOptions o;
      o.isa = optim::Isa::kScalar;
      ASSERT_OK(optim::AdamStep(TestParams(c, step), ref.Buffers(c), 0.5f, o).status());
    }
    EXPECT_EQ(0, std::memcmp(ours.master.data(), ref.master.data(), 4 * n));
    EXPECT_EQ(ours.m, ref.m);
    EXPECT_EQ(ours.v, ref.v);
    EXPECT_EQ(ours.p16, ref.p16);
    // And it moved: the test would pass vacuously otherwise.
    const AdamState init = MakeAdamState(c, n, 11);
    EXPECT_NE(0, std::memcmp(ours.master.data(), init.master.data(), 4 * n));
  }
}

// The independent twin: Adam/AdamW written from the formula (optim/cpu_adam.h's header, which is
// torch.optim's) in double precision, element by element, without any of optim's code. The
// bit-for-bit test above shows the kernel path equals optim::AdamStep; this one shows both
// compute Adam. fp32 states only: bf16 states round on every store by design.
float FromBf16(const uint8_t* p) {
  uint32_t bits = static_cast<uint32_t>(p[0] | (p[1] << 8)) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(KernelsCpuAdam, MatchesADoublePrecisionReferenceFromTheFormula) {
  for (DType g : {DType::kFloat32, DType::kBFloat16}) {
    for (bool adamw : {true, false}) {
      const AdamCase c{g, DType::kFloat32, true, DType::kBFloat16, adamw};
      SCOPED_TRACE(::testing::Message() << "grad=" << optim::DTypeName(g) << " adamw=" << adamw);
      const size_t n = 4099;
      AdamState s = MakeAdamState(c, n, 21);
      // mag_m bounds |m|'s terms, so a cancellation near zero is judged against what was summed.
      std::vector<double> p(n), m(n), v(n), grad(n), mag_m(n);
      for (size_t i = 0; i < n; ++i) {
        p[i] = s.master[i];
        float mf, vf;
        std::memcpy(&mf, &s.m[4 * i], 4);
        std::memcpy(&vf, &s.v[4 * i], 4);
        m[i] = mf;
        mag_m[i] = std::fabs(mf);
        v[i] = vf;
        if (g == DType::kFloat32) {
          float gf;
          std::memcpy(&gf, &s.grad[4 * i], 4);
          grad[i] = gf;
        } else {
          grad[i] = FromBf16(&s.grad[2 * i]);
        }
      }
      const double scale = 0.5, lr = 1e-3, wd = 0.01, b1 = 0.9, b2 = 0.999, eps = 1e-8;
      for (int64_t t = 1; t <= 3; ++t) {
        ASSERT_OK(AdamStep(kCpu, TestParams(c, t), s.Buffers(c), static_cast<float>(scale)));
        const double bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
        for (size_t i = 0; i < n; ++i) {
          double gi = grad[i] * scale;
          if (adamw) p[i] *= 1 - lr * wd;
          else gi += wd * p[i];
          m[i] = b1 * m[i] + (1 - b1) * gi;
          mag_m[i] = b1 * mag_m[i] + (1 - b1) * std::fabs(gi);
          v[i] = b2 * v[i] + (1 - b2) * gi * gi;
          p[i] -= lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
        }
      }
      double worst_p = 0, worst_m = 0, worst_v = 0;
      for (size_t i = 0; i < n; ++i) {
        float mf, vf;
        std::memcpy(&mf, &s.m[4 * i], 4);
        std::memcpy(&vf, &s.v[4 * i], 4);
        worst_p = std::max(worst_p, std::fabs(s.master[i] - p[i]) / std::max(1e-3, std::fabs(p[i])));
        worst_m = std::max(worst_m, std::fabs(mf - m[i]) / mag_m[i]);
        worst_v = std::max(worst_v, std::fabs(vf - v[i]) / std::max(1e-20, std::fabs(v[i])));
        // The bf16 working copy is the master rounded to nearest.
        EXPECT_LE(std::fabs(FromBf16(&s.p16[2 * i]) - s.master[i]), std::fabs(s.master[i]) * 0x1p-8) << i;
      }
      // fp32 arithmetic (fused multiply-adds, a float sqrt and divide) against double over three
      // steps: measured up to ~1e-5 of the summed magnitudes. A wrong formula is far outside:
      // dropping bias correction moves p by ~1e-1 relative, swapping Adam and AdamW moves m by
      // ~1e-1 of its magnitude.
      EXPECT_LT(worst_p, 2e-5);
      EXPECT_LT(worst_m, 5e-5);
      EXPECT_LT(worst_v, 2e-5);
      std::printf("reference twin (grad %s, adamw %d): worst relative error p %.2e m %.2e v %.2e\n",
                  optim::DTypeName(g), adamw, worst_p, worst_m, worst_v);
    }
  }
}

TEST(KernelsCpuAdam, SkipFlagLeavesEverythingUntouched) {
  const AdamCase c{DType::kFloat32, DType::kFloat32, true, DType::kBFloat16, true};
  AdamState s = MakeAdamState(c, 1000, 3);
  const AdamState before = s;
  GradStatsAccumulator acc{};
  acc.found_nonfinite = 1;
  ASSERT_OK(AdamStep(kCpu, TestParams(c, 1), s.Buffers(c), 1.0f, &acc));
  EXPECT_EQ(s.master, before.master);
  EXPECT_EQ(s.m, before.m);
  EXPECT_EQ(s.v, before.v);
  EXPECT_EQ(s.p16, before.p16);
  acc.found_nonfinite = 0;
  ASSERT_OK(AdamStep(kCpu, TestParams(c, 1), s.Buffers(c), 1.0f, &acc));
  EXPECT_NE(s.master, before.master);
}

TEST(KernelsCpuAdam, RejectsWhatOptimRejects) {
  const AdamCase c{DType::kFloat32, DType::kFloat32, false, DType::kBFloat16, true};
  AdamState s = MakeAdamState(c, 16, 5);
  const AdamState before = s;
  optim::AdamParams p = TestParams(c, 1);
  p.lr = -1;
  EXPECT_EQ(AdamStep(kCpu, p, s.Buffers(c)).code(), StatusCode::kInvalidArgument);
  p = TestParams(c, 0);
  EXPECT_EQ(AdamStep(kCpu, p, s.Buffers(c)).code(), StatusCode::kInvalidArgument);
  optim::AdamBuffers b = s.Buffers(c);
  b.state_dtype = DType::kFloat16;
  EXPECT_EQ(AdamStep(kCpu, TestParams(c, 1), b).code(), StatusCode::kInvalidArgument);
  b = s.Buffers(c);
  b.exp_avg = nullptr;
  EXPECT_EQ(AdamStep(kCpu, TestParams(c, 1), b).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(AdamStep(kCpu, TestParams(c, 1), s.Buffers(c), -1.0f).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(s.master, before.master);
  EXPECT_EQ(s.m, before.m);
}

// ---- Chunks ----

template <typename T>
void RunPackUnpack() {
  std::mt19937 rng(42);
  const size_t count = 150;  // more than one CUDA launch's worth of segments (64)
  std::vector<std::vector<T>> tensors(count);
  std::vector<ChunkSlot> slots(count);
  size_t offset = 0;
  for (size_t k = 0; k < count; ++k) {
    const size_t numel = k % 17 == 0 ? 0 : 1 + rng() % 300;
    offset += rng() % 5;  // gaps of 0..4 elements, some tensors unaligned
    tensors[k].resize(numel);
    for (auto& x : tensors[k]) x = static_cast<T>(rng());
    slots[k] = {tensors[k].data(), numel, offset};
    offset += numel;
  }
  const size_t chunk_numel = offset + 33;  // tail padding
  std::shuffle(slots.begin(), slots.end(), rng);  // order must not matter

  std::vector<T> chunk(chunk_numel);
  std::memset(chunk.data(), 0xab, chunk.size() * sizeof(T));
  ASSERT_OK(PackChunk(kCpu, slots, sizeof(T), chunk.data(), chunk_numel));
  std::vector<bool> covered(chunk_numel, false);
  for (const ChunkSlot& s : slots) {
    const T* t = static_cast<const T*>(s.tensor);
    for (size_t i = 0; i < s.numel; ++i) {
      ASSERT_EQ(chunk[s.offset + i], t[i]);
      covered[s.offset + i] = true;
    }
  }
  for (size_t i = 0; i < chunk_numel; ++i) {
    if (!covered[i]) {
      ASSERT_EQ(chunk[i], T{0}) << "padding at " << i;
    }
  }

  std::vector<std::vector<T>> back(count);
  std::vector<ChunkSlot> out_slots = slots;
  for (size_t k = 0; k < count; ++k) {
    back[k].assign(slots[k].numel, T{0});
    out_slots[k].tensor = back[k].data();
  }
  ASSERT_OK(UnpackChunk(kCpu, chunk.data(), chunk_numel, out_slots, sizeof(T)));
  for (size_t k = 0; k < count; ++k) {
    const T* orig = static_cast<const T*>(slots[k].tensor);
    ASSERT_TRUE(std::equal(back[k].begin(), back[k].end(), orig)) << "slot " << k;
  }
}

TEST(KernelsCpuChunk, PackZeroPadsAndUnpackRoundTrips) {
  RunPackUnpack<uint8_t>();
  RunPackUnpack<uint16_t>();
  RunPackUnpack<uint32_t>();
  RunPackUnpack<uint64_t>();
}

TEST(KernelsCpuChunk, RejectsBadSlotsWithoutWriting) {
  std::vector<uint16_t> a(10, 1), b(10, 2);
  std::vector<uint16_t> chunk(32, 0x5555);
  const std::vector<uint16_t> before = chunk;
  auto pack = [&](std::vector<ChunkSlot> slots, size_t elem = 2) {
    return PackChunk(kCpu, slots, elem, chunk.data(), chunk.size()).code();
  };
  EXPECT_EQ(pack({{a.data(), 10, 0}, {b.data(), 10, 9}}), StatusCode::kInvalidArgument);  // overlap
  EXPECT_EQ(pack({{a.data(), 10, 23}}), StatusCode::kInvalidArgument);  // past the end
  EXPECT_EQ(pack({{nullptr, 10, 0}}), StatusCode::kInvalidArgument);
  EXPECT_EQ(pack({{a.data(), 10, 0}}, 3), StatusCode::kInvalidArgument);
  EXPECT_EQ(pack({{a.data(), 10, std::numeric_limits<size_t>::max()}}),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(chunk, before);
  EXPECT_EQ(UnpackChunk(kCpu, nullptr, 32, {{a.data(), 10, 0}}, 2).code(),
            StatusCode::kInvalidArgument);
  // Adjacent slots are fine, and empty slots may sit anywhere inside.
  EXPECT_EQ(pack({{a.data(), 10, 0}, {b.data(), 10, 10}, {nullptr, 0, 5}}), StatusCode::kOk);
  EXPECT_EQ(chunk[9], 1);
  EXPECT_EQ(chunk[10], 2);
  EXPECT_EQ(chunk[31], 0);
}

// ---- Compact layouts ----

// The kernels' compact step on the CPU is optim's, behind the shared validation: a set
// non-finite flag writes nothing (as AdamStep's), and both backends refuse bad arguments in
// optim's words before anything runs.
TEST(KernelsCpuCompact, SkipFlagAndValidationOnBothBackends) {
  const size_t n = 600;
  std::vector<uint16_t> master(n);
  const std::vector<float> w = RandomFloats(n, 3, 0.1f, 4);
  for (size_t i = 0; i < n; ++i) master[i] = optim::FloatToBf16(w[i]);
  const std::vector<float> grad = RandomFloats(n, 4, 1e-2f, 4);
  std::vector<uint8_t> m(optim::Int8StateBytes(n), 0), v(optim::Int8StateBytes(n), 0);
  optim::CompactAdamBuffers b;
  b.master = master.data();
  b.master_format = optim::MasterFormat::kBf16Stochastic;
  b.grad = grad.data();
  b.exp_avg = m.data();
  b.exp_avg_sq = v.data();
  b.moment_format = optim::MomentFormat::kInt8;
  b.n = n;
  b.rounding_key = optim::RoundingKey(1, 1);
  const std::vector<optim::AdamRun> runs = {{0, 300, {}, 0}, {300, 300, {}, 300}};
  const std::vector<uint16_t> before = master;
  GradStatsAccumulator acc{};
  acc.found_nonfinite = 1;
  ASSERT_OK(CompactAdamStep(kCpu, runs, b, 1.0f, &acc));
  EXPECT_EQ(master, before);
  acc.found_nonfinite = 0;
  ASSERT_OK(CompactAdamStep(kCpu, runs, b, 1.0f, &acc));
  // Exactly optim's step from the same start.
  std::vector<uint16_t> want = before;
  std::vector<uint8_t> wm(optim::Int8StateBytes(n), 0), wv(optim::Int8StateBytes(n), 0);
  optim::CompactAdamBuffers wb = b;
  wb.master = want.data();
  wb.exp_avg = wm.data();
  wb.exp_avg_sq = wv.data();
  ASSERT_OK(optim::CompactAdamStep(runs, wb, 1.0f).status());
  EXPECT_EQ(master, want);
  EXPECT_EQ(m, wm);
  EXPECT_EQ(v, wv);

  // Refusals: a bad lr, overlapping runs, a param16 beside a bf16 master; nothing written.
  const std::vector<uint16_t> kept = master;
  std::vector<optim::AdamRun> bad_lr = runs;
  bad_lr[1].params.lr = -1;
  const std::vector<optim::AdamRun> overlap = {{0, 300, {}, 0}, {200, 300, {}, 200}};
  std::vector<uint16_t> p16(n);
  optim::CompactAdamBuffers with_p16 = b;
  with_p16.param16 = p16.data();
  for (Backend backend : {kCpu, Backend::kCuda}) {
    SCOPED_TRACE(BackendName(backend));
    const Status lr = CompactAdamStep(backend, bad_lr, b);
    EXPECT_EQ(lr.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(lr.message().find("lr=-1"), std::string::npos) << lr.message();
    const Status ov = CompactAdamStep(backend, overlap, b);
    EXPECT_EQ(ov.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(ov.message().find("overlaps"), std::string::npos) << ov.message();
    const Status pp = CompactAdamStep(backend, runs, with_p16);
    EXPECT_EQ(pp.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(pp.message().find("param16"), std::string::npos) << pp.message();
    optim::ElementwiseRun er;
    er.size = n;
    er.sgd.lr = -2;
    const Status sgd = CompactElementwiseStep(backend, optim::ElementwiseKind::kSgd, {er}, b);
    EXPECT_EQ(sgd.code(), StatusCode::kInvalidArgument) << sgd.ToString();
    EXPECT_EQ(master, kept);
  }
}

// ---- The CUDA backend where it cannot run ----

TEST(KernelsCudaUnavailable, FailsCleanlyWithoutBuildOrDevice) {
  if (CudaKernelsBuilt() && CudaDeviceCount() > 0) GTEST_SKIP() << "a GPU is present";
  std::vector<float> src(64, 1.0f);
  std::vector<uint16_t> dst(64);
  const Status s = CastFp32To16(Backend::kCuda, src.data(), dst.data(), DType::kBFloat16, 64);
  EXPECT_FALSE(s.ok());
  if (!CudaKernelsBuilt()) {
    EXPECT_EQ(s.code(), StatusCode::kUnimplemented);
    EXPECT_NE(s.message().find("Backend::kCpu"), std::string::npos) << s.message();
  } else {
    // The launch fails with "no device" or "driver insufficient", both UNAVAILABLE.
    EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s.ToString();
  }
  GradStatsAccumulator acc{};
  EXPECT_FALSE(AccumulateGradStats(Backend::kCuda, src.data(), DType::kFloat32, 64, 1.0f, &acc).ok());
  EXPECT_FALSE(UnscaleCheckNorm(Backend::kCuda, src.data(), DType::kFloat32, 64, 1.0f).ok());
  // The compact step too (its launcher allocates on the stream first).
  std::vector<uint16_t> master(64, 0);
  optim::CompactAdamBuffers b;
  b.master = master.data();
  b.master_format = optim::MasterFormat::kBf16Stochastic;
  b.grad = src.data();
  b.exp_avg = b.exp_avg_sq = src.data();
  b.n = 64;
  const Status compact = CompactAdamStep(Backend::kCuda, {{0, 64, {}, 0}}, b);
  EXPECT_FALSE(compact.ok());
  EXPECT_EQ(compact.code(), CudaKernelsBuilt() ? StatusCode::kUnavailable : StatusCode::kUnimplemented)
      << compact.ToString();
  // Validation still comes first: a bad argument is INVALID_ARGUMENT on every build.
  EXPECT_EQ(CastFp32To16(Backend::kCuda, src.data(), dst.data(), DType::kFloat32, 64).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::kernels
