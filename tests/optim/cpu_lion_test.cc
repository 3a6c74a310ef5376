// LionStep on every ISA this CPU runs against LionReference (the published rule written out one
// element at a time): bit-identical with and without decay and 16-bit copies, over several
// parallel blocks with a ragged tail; sign(0) = 0; and the refusals.
#include "optim/cpu_lion.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace strata::optim {
namespace {

void RunCase(double weight_decay, bool with16, DType dtype16, Isa isa) {
  const size_t n = 10007;
  std::mt19937 rng(11);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> p(n), g(n), m(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = dist(rng);
    g[i] = dist(rng);
    m[i] = dist(rng) * 0.1f;
  }
  g[3] = 0.0f;  // c = 0 exactly: sign 0, the parameter moves only by decay
  m[3] = 0.0f;
  const std::vector<float> before = p;
  std::vector<float> p2 = p, m2 = m;
  std::vector<uint16_t> h(n), h2(n);
  LionParams lp;
  lp.lr = 1e-3;
  lp.weight_decay = weight_decay;
  LionBuffers a{p.data(), g.data(), m.data(), with16 ? h.data() : nullptr, dtype16, n};
  LionBuffers b{p2.data(), g.data(), m2.data(), with16 ? h2.data() : nullptr, dtype16, n};
  ElementwiseOptions o;
  o.isa = isa;
  o.grain = 1024;
  auto r = LionStep(lp, a, 0.5f, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, isa);
  LionReference(lp, b, 0.5f);
  EXPECT_EQ(std::memcmp(p.data(), p2.data(), n * 4), 0) << IsaName(isa);
  EXPECT_EQ(std::memcmp(m.data(), m2.data(), n * 4), 0) << IsaName(isa);
  if (with16) {
    EXPECT_EQ(std::memcmp(h.data(), h2.data(), n * 2), 0) << IsaName(isa);
  }
  if (weight_decay == 0) {
    EXPECT_EQ(p[3], before[3]);
  }
  // Every other element moved by exactly lr (times its decay), up or down.
  const float keep = static_cast<float>(1.0 - lp.lr * weight_decay);
  for (size_t i : {size_t{0}, size_t{100}, n - 1}) {
    const float decayed = weight_decay != 0 ? before[i] * keep : before[i];
    EXPECT_TRUE(p[i] == decayed - 1e-3f || p[i] == decayed + 1e-3f) << i;
  }
}

TEST(CpuLion, EveryIsaEqualsTheReference) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (!IsaSupported(isa)) continue;
    RunCase(0.0, false, DType::kBFloat16, isa);
    RunCase(0.1, true, DType::kBFloat16, isa);
    RunCase(0.01, true, DType::kFloat16, isa);
  }
}

TEST(CpuLion, OneElementByHand) {
  // c = 0.9 * 1 + 0.1 * (-20) = -1.1 < 0: p rises by lr; with DeepSpeed's default beta2 0.999,
  // m = 0.999 * 1 + 0.001 * (-20) = 0.979.
  float p = 1.0f, g = -20.0f, m = 1.0f;
  LionParams lp;
  lp.lr = 0.25;
  ASSERT_TRUE(LionStep(lp, {&p, &g, &m, nullptr, DType::kBFloat16, 1}, 1.0f).ok());
  EXPECT_EQ(p, 1.25f);
  EXPECT_FLOAT_EQ(m, 0.979f);
}

TEST(CpuLion, BadValuesAreRefusedByName) {
  float p = 0, g = 1, m = 0;
  LionBuffers b{&p, &g, &m, nullptr, DType::kBFloat16, 1};
  LionParams lp;
  lp.beta1 = 1.0;
  EXPECT_NE(LionStep(lp, b, 1.0f).status().message().find("Lion beta1=1"), std::string::npos);
  lp = {};
  lp.weight_decay = -1;
  EXPECT_NE(LionStep(lp, b, 1.0f).status().message().find("weight_decay"), std::string::npos);
  lp = {};
  b.exp_avg = nullptr;
  EXPECT_FALSE(LionStep(lp, b, 1.0f).ok());
  EXPECT_EQ(p, 0.0f);
}

}  // namespace
}  // namespace strata::optim
