// AdagradStep on every ISA this CPU runs against AdagradReference (the formula written out one
// element at a time): bit-identical for every case (decay, lr_decay at a later step, 16-bit copy)
// over several parallel blocks with a ragged tail; and the refusals.
#include "optim/cpu_adagrad.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace strata::optim {
namespace {

struct Case {
  double weight_decay, lr_decay;
  int64_t step;
  bool with16;
  DType dtype16;
};

void RunCase(const Case& c, Isa isa) {
  const size_t n = 10007;  // not a multiple of any vector width; several 1024-element blocks
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> p(n), g(n), s(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = dist(rng);
    g[i] = dist(rng);
    s[i] = c.step == 1 ? 0.0f : std::fabs(dist(rng));  // a later step: a sum already built up
  }
  g[5] = 0.0f;  // a zero gradient on an empty sum: 0 / eps
  s[5] = 0.0f;
  const std::vector<float> before = p;
  std::vector<float> p2 = p, s2 = s;
  std::vector<uint16_t> h(n), h2(n);
  AdagradParams ap;
  ap.lr = 0.05;
  ap.weight_decay = c.weight_decay;
  ap.lr_decay = c.lr_decay;
  ap.step = c.step;
  AdagradBuffers a{p.data(), g.data(), s.data(), c.with16 ? h.data() : nullptr, c.dtype16, n};
  AdagradBuffers b{p2.data(), g.data(), s2.data(), c.with16 ? h2.data() : nullptr, c.dtype16, n};
  ElementwiseOptions o;
  o.isa = isa;
  o.grain = 1024;
  auto r = AdagradStep(ap, a, 0.5f, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, isa);
  AdagradReference(ap, b, 0.5f);
  EXPECT_EQ(std::memcmp(p.data(), p2.data(), n * 4), 0) << IsaName(isa);
  EXPECT_EQ(std::memcmp(s.data(), s2.data(), n * 4), 0) << IsaName(isa);
  if (c.with16) {
    EXPECT_EQ(std::memcmp(h.data(), h2.data(), n * 2), 0) << IsaName(isa);
  }
  if (c.weight_decay == 0) {
    EXPECT_EQ(p[5], before[5]);  // no gradient, no decay: unchanged
  }
  EXPECT_NE(std::memcmp(p2.data(), before.data(), n * 4), 0);
}

TEST(CpuAdagrad, EveryIsaEqualsTheReferenceInEveryCase) {
  const Case cases[] = {
      {0.0, 0.0, 1, false, DType::kBFloat16},
      {0.01, 0.0, 1, true, DType::kBFloat16},
      {0.0, 0.1, 5, true, DType::kFloat16},
      {1e-4, 0.01, 3, false, DType::kBFloat16},
  };
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (!IsaSupported(isa)) continue;
    for (const Case& c : cases) RunCase(c, isa);
  }
}

TEST(CpuAdagrad, OneElementByHand) {
  // torch.optim.Adagrad, step 1, lr 0.1, no decay: sum = g^2, p -= 0.1 * g / (|g| + eps).
  float p = 1.0f, g = 2.0f, s = 0.0f;
  AdagradParams ap;
  ap.lr = 0.1;
  ASSERT_TRUE(AdagradStep(ap, {&p, &g, &s, nullptr, DType::kBFloat16, 1}, 1.0f).ok());
  EXPECT_EQ(s, 4.0f);
  EXPECT_EQ(p, 1.0f - 0.1f * (2.0f / (2.0f + 1e-10f)));
  // Step 3 with lr_decay 0.5: clr = 0.1 / (1 + 2 * 0.5) = 0.05.
  ap.step = 3;
  ap.lr_decay = 0.5;
  const float p_before = p;
  ASSERT_TRUE(AdagradStep(ap, {&p, &g, &s, nullptr, DType::kBFloat16, 1}, 1.0f).ok());
  EXPECT_EQ(s, 8.0f);
  EXPECT_EQ(p, p_before - 0.05f * (2.0f / (std::sqrt(8.0f) + 1e-10f)));
}

TEST(CpuAdagrad, BadValuesAreRefusedByName) {
  float p = 0, g = 1, s = 0;
  AdagradBuffers b{&p, &g, &s, nullptr, DType::kBFloat16, 1};
  AdagradParams ap;
  ap.lr = -1;
  EXPECT_NE(AdagradStep(ap, b, 1.0f).status().message().find("Adagrad lr=-1"), std::string::npos);
  ap = {};
  ap.eps = 0;
  EXPECT_NE(AdagradStep(ap, b, 1.0f).status().message().find("Adagrad eps=0"), std::string::npos);
  ap = {};
  ap.step = 0;
  EXPECT_NE(AdagradStep(ap, b, 1.0f).status().message().find("step=0"), std::string::npos);
  ap = {};
  b.sum = nullptr;
  EXPECT_FALSE(AdagradStep(ap, b, 1.0f).ok());
  EXPECT_EQ(p, 0.0f);  // nothing written
}

}  // namespace
}  // namespace strata::optim
