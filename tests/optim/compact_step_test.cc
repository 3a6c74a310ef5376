// CompactAdamStep (optim/compact_step.h) against references built from parts tested elsewhere:
// fp32 AdamStep for the update, and the scalar format functions (brute-force nearest code,
// FloatToBf16Stochastic with RoundingBits) for the stores. Every ISA, every layout, bit for bit.
#include "optim/compact_step.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <gtest/gtest.h>
#include <tbb/task_arena.h>

namespace strata::optim {
namespace {

std::vector<Isa> Isas() {
  std::vector<Isa> out = {Isa::kScalar};
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16})
    if (IsaSupported(isa)) out.push_back(isa);
  return out;
}

// A layout's buffers, holding the same starting values in every format.
struct State {
  MasterFormat master_format;
  MomentFormat moment_format;
  size_t n;
  std::vector<uint8_t> master, m, v;

  State(MasterFormat mf, MomentFormat of, size_t count) : master_format(mf), moment_format(of), n(count) {
    master.resize(MasterBytes(mf, n));
    m.resize(MomentBytes(of, n));
    v.resize(MomentBytes(of, n));
  }
  bool operator==(const State& o) const { return master == o.master && m == o.m && v == o.v; }
};

uint8_t Nearest(float y, bool is_signed) {
  const float* map = DynamicMap(is_signed);
  int best = 0;
  for (int c = 1; c < 256; ++c)
    if (std::fabs(map[c] - y) < std::fabs(map[best] - y)) best = c;
  return static_cast<uint8_t>(best);
}

float ReadMaster(const State& s, size_t i) {
  if (s.master_format == MasterFormat::kFp32) return reinterpret_cast<const float*>(s.master.data())[i];
  return Bf16ToFloat(reinterpret_cast<const uint16_t*>(s.master.data())[i]);
}

float ReadMoment(const State& s, const std::vector<uint8_t>& buf, size_t i, bool is_signed) {
  switch (s.moment_format) {
    case MomentFormat::kFp32: return reinterpret_cast<const float*>(buf.data())[i];
    case MomentFormat::kBf16: return Bf16ToFloat(reinterpret_cast<const uint16_t*>(buf.data())[i]);
    case MomentFormat::kInt8: {
      const float* scales = reinterpret_cast<const float*>(buf.data() + Int8ScaleOffset(s.n));
      return DynamicMap(is_signed)[buf[i]] * scales[i / kInt8Block];
    }
  }
  return 0;
}

// Stores fp32 values into a moment buffer by the scalar rules (brute-force nearest code).
void WriteMoment(const State& s, std::vector<uint8_t>& buf, const std::vector<float>& x, bool is_signed) {
  for (size_t b = 0; b < s.n; b += kInt8Block) {
    const size_t len = std::min(kInt8Block, s.n - b);
    float scale = 0;
    for (size_t i = b; i < b + len; ++i) scale = std::max(scale, std::fabs(x[i]));
    for (size_t i = b; i < b + len; ++i) {
      switch (s.moment_format) {
        case MomentFormat::kFp32: reinterpret_cast<float*>(buf.data())[i] = x[i]; break;
        case MomentFormat::kBf16: reinterpret_cast<uint16_t*>(buf.data())[i] = FloatToBf16(x[i]); break;
        case MomentFormat::kInt8: buf[i] = Nearest(scale > 0 ? x[i] / scale : 0.0f, is_signed); break;
      }
    }
    if (s.moment_format == MomentFormat::kInt8)
      reinterpret_cast<float*>(buf.data() + Int8ScaleOffset(s.n))[b / kInt8Block] = scale;
  }
}

void WriteMaster(State& s, const std::vector<float>& x, uint32_t key, uint64_t base) {
  for (size_t i = 0; i < s.n; ++i) {
    switch (s.master_format) {
      case MasterFormat::kFp32: reinterpret_cast<float*>(s.master.data())[i] = x[i]; break;
      case MasterFormat::kBf16Nearest:
        reinterpret_cast<uint16_t*>(s.master.data())[i] = FloatToBf16(x[i]);
        break;
      case MasterFormat::kBf16Stochastic:
        reinterpret_cast<uint16_t*>(s.master.data())[i] =
            FloatToBf16Stochastic(x[i], RoundingBits(key, base + i));
        break;
    }
  }
}

State Initial(MasterFormat mf, MomentFormat of, size_t n) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> p(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    m[i] = normal(rng) * 1e-3f;
    v[i] = m[i] * m[i] * (1.0f + std::fabs(normal(rng)));
  }
  State s(mf, of, n);
  WriteMaster(s, p, 0, 0);  // nearest for the start (key unused)
  if (mf == MasterFormat::kBf16Stochastic)
    for (size_t i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(s.master.data())[i] = FloatToBf16(p[i]);
  WriteMoment(s, s.m, m, true);
  WriteMoment(s, s.v, v, false);
  return s;
}

std::vector<float> Grads(size_t n, int step) {
  std::mt19937 rng(100 + step);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> g(n);
  for (float& x : g) x = normal(rng) * 0.01f;
  return g;
}

// The reference step: widen every value, one fp32 AdamStep (scalar), narrow by the scalar rules.
void ReferenceStep(State& s, const AdamParams& params, const std::vector<float>& g, float scale,
                   uint32_t key, uint64_t base) {
  std::vector<float> p(s.n), m(s.n), v(s.n);
  for (size_t i = 0; i < s.n; ++i) {
    p[i] = ReadMaster(s, i);
    m[i] = ReadMoment(s, s.m, i, true);
    v[i] = ReadMoment(s, s.v, i, false);
  }
  AdamBuffers b;
  b.master = p.data();
  b.grad = g.data();
  b.exp_avg = m.data();
  b.exp_avg_sq = v.data();
  b.n = s.n;
  AdamOptions o;
  o.isa = Isa::kScalar;
  ASSERT_TRUE(AdamStep(params, b, scale, o).ok());
  WriteMaster(s, p, key, base);
  WriteMoment(s, s.m, m, true);
  WriteMoment(s, s.v, v, false);
}

StatusOr<AdamResult> Step(State& s, const AdamParams& params, const std::vector<float>& g,
                          float scale, uint32_t key, uint64_t base, AdamOptions o) {
  CompactAdamBuffers b;
  b.master = s.master.data();
  b.master_format = s.master_format;
  b.grad = g.data();
  b.exp_avg = s.m.data();
  b.exp_avg_sq = s.v.data();
  b.moment_format = s.moment_format;
  b.n = s.n;
  b.rounding_key = key;
  b.index_base = base;
  return CompactAdamStep(params, b, scale, o);
}

TEST(CompactAdamStep, EveryLayoutAndIsaEqualsTheReferenceForFiveSteps) {
  const size_t n = 1000;  // three full 8-bit blocks and a tail of 232
  for (MasterFormat mf : {MasterFormat::kFp32, MasterFormat::kBf16Nearest, MasterFormat::kBf16Stochastic}) {
    for (MomentFormat of : {MomentFormat::kFp32, MomentFormat::kBf16, MomentFormat::kInt8}) {
      for (bool adamw : {true, false}) {
        State want = Initial(mf, of, n);
        std::vector<State> got(Isas().size(), Initial(mf, of, n));
        for (int t = 1; t <= 5; ++t) {
          AdamParams params;
          params.lr = 1e-2;
          params.weight_decay = 0.1;
          params.adamw = adamw;
          params.step = t;
          const std::vector<float> g = Grads(n, t);
          const uint32_t key = RoundingKey(1234, t);
          ReferenceStep(want, params, g, 0.5f, key, 777);
          for (size_t k = 0; k < got.size(); ++k) {
            AdamOptions o;
            o.isa = Isas()[k];
            o.grain = 512;  // several tasks
            ASSERT_TRUE(Step(got[k], params, g, 0.5f, key, 777, o).ok());
            ASSERT_TRUE(got[k] == want) << MasterFormatName(mf) << "/" << MomentFormatName(of)
                                        << (adamw ? " AdamW" : " Adam") << " isa "
                                        << IsaName(Isas()[k]) << " step " << t;
          }
        }
      }
    }
  }
}

TEST(CompactAdamStep, Fp32AndBf16MomentLayoutsEqualAdamStepItself) {
  const size_t n = 777;
  for (MomentFormat of : {MomentFormat::kFp32, MomentFormat::kBf16}) {
    State compact = Initial(MasterFormat::kFp32, of, n);
    State plain = compact;
    AdamParams params;
    params.weight_decay = 0.01;
    const std::vector<float> g = Grads(n, 1);
    ASSERT_TRUE(Step(compact, params, g, 1.0f, 0, 0, {}).ok());
    AdamBuffers b;
    b.master = reinterpret_cast<float*>(plain.master.data());
    b.grad = g.data();
    b.exp_avg = plain.m.data();
    b.exp_avg_sq = plain.v.data();
    b.state_dtype = of == MomentFormat::kFp32 ? DType::kFloat32 : DType::kBFloat16;
    b.n = n;
    ASSERT_TRUE(AdamStep(params, b).ok());
    EXPECT_TRUE(compact == plain) << MomentFormatName(of);
  }
}

TEST(CompactAdamStep, ThreadsAndGrainDoNotChangeTheBits) {
  const size_t n = 5000;
  State a = Initial(MasterFormat::kBf16Stochastic, MomentFormat::kInt8, n), b = a, c = a;
  AdamParams params;
  const std::vector<float> g = Grads(n, 2);
  tbb::task_arena one(1), two(2);
  AdamOptions o1, o2, o3;
  o1.arena = &one;
  o2.arena = &two;
  o2.grain = 256;
  o3.grain = 1000;  // rounded down to whole 8-bit blocks
  ASSERT_TRUE(Step(a, params, g, 1.0f, RoundingKey(1, 1), 0, o1).ok());
  ASSERT_TRUE(Step(b, params, g, 1.0f, RoundingKey(1, 1), 0, o2).ok());
  ASSERT_TRUE(Step(c, params, g, 1.0f, RoundingKey(1, 1), 0, o3).ok());
  EXPECT_TRUE(a == b);
  EXPECT_TRUE(a == c);
}

TEST(CompactAdamStep, StochasticMasterDependsOnTheModelIndexNotTheSplit) {
  // Two shards of one parameter ([0, 512) and [512, 1000) at index_base 512) give the bits the
  // whole does: how a chunk size or a rank count splits the model does not matter.
  const size_t n = 1000;
  State whole = Initial(MasterFormat::kBf16Stochastic, MomentFormat::kFp32, n);
  State lo = Initial(MasterFormat::kBf16Stochastic, MomentFormat::kFp32, 512);
  State hi = Initial(MasterFormat::kBf16Stochastic, MomentFormat::kFp32, n - 512);
  std::memcpy(lo.master.data(), whole.master.data(), 512 * 2);
  std::memcpy(hi.master.data(), whole.master.data() + 512 * 2, (n - 512) * 2);
  std::memcpy(lo.m.data(), whole.m.data(), 512 * 4);
  std::memcpy(hi.m.data(), whole.m.data() + 512 * 4, (n - 512) * 4);
  std::memcpy(lo.v.data(), whole.v.data(), 512 * 4);
  std::memcpy(hi.v.data(), whole.v.data() + 512 * 4, (n - 512) * 4);
  AdamParams params;
  const std::vector<float> g = Grads(n, 3);
  const std::vector<float> glo(g.begin(), g.begin() + 512), ghi(g.begin() + 512, g.end());
  const uint32_t key = RoundingKey(9, 4);
  ASSERT_TRUE(Step(whole, params, g, 1.0f, key, 40, {}).ok());
  ASSERT_TRUE(Step(lo, params, glo, 1.0f, key, 40, {}).ok());
  ASSERT_TRUE(Step(hi, params, ghi, 1.0f, key, 40 + 512, {}).ok());
  EXPECT_EQ(0, std::memcmp(whole.master.data(), lo.master.data(), 512 * 2));
  EXPECT_EQ(0, std::memcmp(whole.master.data() + 512 * 2, hi.master.data(), (n - 512) * 2));
}

TEST(CompactAdamStep, SmallUpdatesSurviveStochasticRoundingButNotNearest) {
  // Weights at 1.0 pulled toward 1.001 by plain SGD-like Adam steps of lr 1e-4: each update
  // (1e-4) is below half a bf16 ulp at 1.0 (2^-8 = 0.0039), so nearest rounding never moves
  // the weight; stochastic rounding moves it on average by the update.
  const size_t n = 4096;
  State nearest(MasterFormat::kBf16Nearest, MomentFormat::kFp32, n);
  State sr(MasterFormat::kBf16Stochastic, MomentFormat::kFp32, n);
  for (State* s : {&nearest, &sr}) {
    for (size_t i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(s->master.data())[i] = FloatToBf16(1.0f);
    std::fill(s->m.begin(), s->m.end(), 0);
    std::fill(s->v.begin(), s->v.end(), 0);
  }
  AdamParams params;
  params.lr = 1e-4;
  const std::vector<float> g(n, -1.0f);  // a constant pull upward: each Adam step moves +lr
  for (int t = 1; t <= 10; ++t) {
    params.step = t;
    ASSERT_TRUE(Step(nearest, params, g, 1.0f, RoundingKey(5, t), 0, {}).ok());
    ASSERT_TRUE(Step(sr, params, g, 1.0f, RoundingKey(5, t), 0, {}).ok());
  }
  double mean_nearest = 0, mean_sr = 0;
  for (size_t i = 0; i < n; ++i) {
    mean_nearest += ReadMaster(nearest, i) / n;
    mean_sr += ReadMaster(sr, i) / n;
  }
  EXPECT_EQ(mean_nearest, 1.0);
  EXPECT_NEAR(mean_sr, 1.0 + 10 * 1e-4, 1e-4);  // ten steps of 1e-4, within 10 %
}

TEST(CompactAdamStep, RunsWithTheirOwnHyperparametersShareBlocks) {
  // A shard of four parameters of two groups (as a chunk holds them), a gap of padding, and a
  // block with no run: the reference widens everything, applies each run's AdamStep, and
  // narrows every block a run touches; the untouched block keeps its bytes.
  const size_t n = 1000;
  for (MasterFormat mf : {MasterFormat::kBf16Stochastic, MasterFormat::kFp32}) {
    State got = Initial(mf, MomentFormat::kInt8, n);
    State want = got;
    std::vector<AdamRun> runs(3);
    runs[0] = {0, 100, AdamParams{}, 5000};
    runs[1] = {100, 200, AdamParams{}, 7000};
    runs[2] = {320, 400, AdamParams{}, 9000};  // [300, 320) padding; [768, 1000) no run
    runs[0].params.lr = 1e-2;
    runs[1].params.lr = 3e-3;
    runs[1].params.weight_decay = 0.1;
    runs[2].params.lr = 1e-3;
    const std::vector<float> g = Grads(n, 4);
    const uint32_t key = RoundingKey(77, 2);
    CompactAdamBuffers b;
    b.master = got.master.data();
    b.master_format = mf;
    b.grad = g.data();
    b.exp_avg = got.m.data();
    b.exp_avg_sq = got.v.data();
    b.moment_format = MomentFormat::kInt8;
    b.n = n;
    b.rounding_key = key;
    for (Isa isa : Isas()) {
      State s = want;  // fresh copy for each ISA
      b.master = s.master.data();
      b.exp_avg = s.m.data();
      b.exp_avg_sq = s.v.data();
      AdamOptions o;
      o.isa = isa;
      o.grain = 256;
      ASSERT_TRUE(CompactAdamStep(runs, b, 1.0f, o).ok());
      if (isa == Isa::kScalar) got = s;
      ASSERT_TRUE(s == got) << IsaName(isa);
    }
    // The reference.
    std::vector<float> p(n), m(n), v(n);
    for (size_t i = 0; i < n; ++i) {
      p[i] = ReadMaster(want, i);
      m[i] = ReadMoment(want, want.m, i, true);
      v[i] = ReadMoment(want, want.v, i, false);
    }
    std::vector<uint16_t> sr_bits(n);
    for (const AdamRun& r : runs) {
      AdamBuffers ab;
      ab.master = p.data() + r.begin;
      ab.grad = g.data() + r.begin;
      ab.exp_avg = m.data() + r.begin;
      ab.exp_avg_sq = v.data() + r.begin;
      ab.n = r.size;
      AdamOptions o;
      o.isa = Isa::kScalar;
      ASSERT_TRUE(AdamStep(r.params, ab, 1.0f, o).ok());
      for (size_t j = 0; j < r.size; ++j)
        sr_bits[r.begin + j] = FloatToBf16Stochastic(p[r.begin + j], RoundingBits(key, r.index_base + j));
    }
    State ref = want;
    WriteMoment(ref, ref.m, m, true);
    WriteMoment(ref, ref.v, v, false);
    for (size_t i = 0; i < n; ++i) {
      if (mf == MasterFormat::kFp32) {
        reinterpret_cast<float*>(ref.master.data())[i] = p[i];
      } else {
        const bool in_run = i < 300 || (i >= 320 && i < 720);
        reinterpret_cast<uint16_t*>(ref.master.data())[i] = in_run ? sr_bits[i] : FloatToBf16(p[i]);
      }
    }
    // The last block [768, 1000) has no run: its codes and scale stay as they were.
    std::memcpy(ref.m.data() + 768, want.m.data() + 768, n - 768);
    std::memcpy(ref.v.data() + 768, want.v.data() + 768, n - 768);
    const size_t scales = Int8ScaleOffset(n);
    std::memcpy(ref.m.data() + scales + 12, want.m.data() + scales + 12, 4);
    std::memcpy(ref.v.data() + scales + 12, want.v.data() + scales + 12, 4);
    EXPECT_TRUE(got == ref) << MasterFormatName(mf);
  }
}

// SGD with momentum, Adagrad and Lion through the same walk: every layout and ISA equals widening,
// the optimizer's own fp32 step (scalar), and narrowing by the scalar rules, for three steps.
TEST(CompactElementwiseStep, EveryOptimizerLayoutAndIsaEqualsTheReference) {
  const size_t n = 700;
  for (ElementwiseKind kind : {ElementwiseKind::kSgd, ElementwiseKind::kAdagrad, ElementwiseKind::kLion}) {
    for (MasterFormat mf : {MasterFormat::kFp32, MasterFormat::kBf16Nearest, MasterFormat::kBf16Stochastic}) {
      for (MomentFormat of : {MomentFormat::kFp32, MomentFormat::kBf16, MomentFormat::kInt8}) {
        State want = Initial(mf, of, n);
        // Adagrad's sum must not be negative: its state is the unsigned one (exp_avg_sq).
        std::vector<State> got(Isas().size(), want);
        for (int t = 1; t <= 3; ++t) {
          ElementwiseRun run;
          run.size = n;
          run.index_base = 11;
          run.sgd.lr = 0.05;
          run.sgd.momentum = 0.9;
          run.sgd.weight_decay = 0.01;
          run.sgd.first = t == 1;
          run.adagrad.lr = 0.05;
          run.adagrad.weight_decay = 0.01;
          run.adagrad.step = t;
          run.lion.lr = 1e-3;
          run.lion.weight_decay = 0.1;
          const std::vector<float> g = Grads(n, 10 + t);
          const uint32_t key = RoundingKey(3, t);
          // The reference.
          std::vector<float> p(n), m(n), v(n);
          for (size_t i = 0; i < n; ++i) {
            p[i] = ReadMaster(want, i);
            m[i] = ReadMoment(want, want.m, i, true);
            v[i] = ReadMoment(want, want.v, i, false);
          }
          ElementwiseOptions o;
          o.isa = Isa::kScalar;
          bool stepped = false;
          if (kind == ElementwiseKind::kSgd) {
            stepped = SgdStep(run.sgd, {p.data(), g.data(), m.data(), nullptr, DType::kBFloat16, n}, 1.0f, o).ok();
          } else if (kind == ElementwiseKind::kAdagrad) {
            stepped = AdagradStep(run.adagrad, {p.data(), g.data(), v.data(), nullptr, DType::kBFloat16, n}, 1.0f, o).ok();
          } else {
            stepped = LionStep(run.lion, {p.data(), g.data(), m.data(), nullptr, DType::kBFloat16, n}, 1.0f, o).ok();
          }
          ASSERT_TRUE(stepped);
          WriteMaster(want, p, key, 11);
          if (kind != ElementwiseKind::kAdagrad) WriteMoment(want, want.m, m, true);
          if (kind == ElementwiseKind::kAdagrad) WriteMoment(want, want.v, v, false);
          for (size_t k = 0; k < got.size(); ++k) {
            CompactAdamBuffers b;
            b.master = got[k].master.data();
            b.master_format = mf;
            b.grad = g.data();
            b.exp_avg = kind == ElementwiseKind::kAdagrad ? nullptr : got[k].m.data();
            b.exp_avg_sq = kind == ElementwiseKind::kAdagrad ? got[k].v.data() : nullptr;
            b.moment_format = of;
            b.n = n;
            b.rounding_key = key;
            ElementwiseOptions eo;
            eo.isa = Isas()[k];
            eo.grain = 256;
            ASSERT_TRUE(CompactElementwiseStep(kind, {run}, b, 1.0f, eo).ok());
            ASSERT_TRUE(got[k] == want) << static_cast<int>(kind) << " " << MasterFormatName(mf)
                                        << "/" << MomentFormatName(of) << " isa "
                                        << IsaName(Isas()[k]) << " step " << t;
          }
        }
      }
    }
  }
}

TEST(CompactAdamStep, RefusesParam16BesideABf16MasterAndSkipsNonFiniteGrads) {
  State s = Initial(MasterFormat::kBf16Nearest, MomentFormat::kInt8, 300);
  const State before = s;
  std::vector<uint16_t> p16(300);
  CompactAdamBuffers b;
  b.master = s.master.data();
  b.master_format = s.master_format;
  std::vector<float> g = Grads(300, 1);
  b.grad = g.data();
  b.exp_avg = s.m.data();
  b.exp_avg_sq = s.v.data();
  b.moment_format = s.moment_format;
  b.n = 300;
  b.param16 = p16.data();
  auto r = CompactAdamStep(AdamParams{}, b);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("param16 with a bf16 master"), std::string::npos);
  b.param16 = nullptr;
  g[299] = std::nanf("");
  r = CompactAdamStep(AdamParams{}, b);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->skipped);
  EXPECT_TRUE(s == before);
}

}  // namespace
}  // namespace strata::optim
