// SgdStep on every ISA this CPU runs against SgdReference, the element-by-element loop written
// from torch.optim.SGD's formula: bit-identical (both unfused fp32, the same operation order),
// for every case (momentum, nesterov, dampening, decay, first step, 16-bit copy) and over
// several parallel blocks with a ragged tail.
#include "optim/cpu_sgd.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace strata::optim {
namespace {

struct Case {
  double momentum, dampening, weight_decay;
  bool nesterov, first;
  bool with16;
  DType dtype16;
};

void RunCase(const Case& c, Isa isa) {
  const size_t n = 10007;  // not a multiple of any vector width; several 1024-element blocks
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> p(n), g(n), m(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = dist(rng);
    g[i] = dist(rng);
    m[i] = dist(rng) * 0.1f;
  }
  const std::vector<float> before = p;
  std::vector<float> p2 = p, m2 = m;
  std::vector<uint16_t> h(n), h2(n);
  SgdParams sp;
  sp.lr = 0.05;
  sp.momentum = c.momentum;
  sp.dampening = c.dampening;
  sp.weight_decay = c.weight_decay;
  sp.nesterov = c.nesterov;
  sp.first = c.first;
  SgdBuffers a{p.data(), g.data(), m.data(), c.with16 ? h.data() : nullptr, c.dtype16, n};
  SgdBuffers b{p2.data(), g.data(), m2.data(), c.with16 ? h2.data() : nullptr, c.dtype16, n};
  SgdOptions o;
  o.isa = isa;
  o.grain = 1024;
  auto r = SgdStep(sp, a, 0.5f, o);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, isa);
  SgdReference(sp, b, 0.5f);
  EXPECT_EQ(std::memcmp(p.data(), p2.data(), n * 4), 0) << IsaName(isa);
  if (c.momentum != 0) {
    EXPECT_EQ(std::memcmp(m.data(), m2.data(), n * 4), 0) << IsaName(isa);
  }
  if (c.with16) {
    EXPECT_EQ(std::memcmp(h.data(), h2.data(), n * 2), 0) << IsaName(isa);
  }
  // And the update did something.
  EXPECT_NE(std::memcmp(p2.data(), before.data(), n * 4), 0);
}

TEST(CpuSgd, EveryIsaEqualsTheReferenceInEveryCase) {
  const Case cases[] = {
      {0.0, 0.0, 0.0, false, true, false, DType::kBFloat16},
      {0.0, 0.0, 0.01, false, false, true, DType::kBFloat16},
      {0.9, 0.0, 0.0, false, true, false, DType::kBFloat16},
      {0.9, 0.1, 1e-4, false, false, true, DType::kFloat16},
      {0.9, 0.0, 1e-4, true, true, true, DType::kBFloat16},
      {0.9, 0.0, 0.0, true, false, false, DType::kBFloat16},
  };
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (!IsaSupported(isa)) continue;
    for (const Case& c : cases) RunCase(c, isa);
  }
}

TEST(CpuSgd, TheFirstStepStartsTheMomentumAtTheGradient) {
  // torch.optim.SGD: buf = grad at the first step, so dampening does not scale it.
  float p = 1.0f, g = 2.0f, m = 123.0f;
  SgdParams sp;
  sp.lr = 0.1;
  sp.momentum = 0.9;
  sp.dampening = 0.5;
  sp.first = true;
  ASSERT_TRUE(SgdStep(sp, {&p, &g, &m, nullptr, DType::kBFloat16, 1}, 1.0f).ok());
  EXPECT_EQ(m, 2.0f);
  EXPECT_EQ(p, 1.0f - 0.1f * 2.0f);
  sp.first = false;  // then buf = 0.9 * 2 + 0.5 * 2 = 2.8
  ASSERT_TRUE(SgdStep(sp, {&p, &g, &m, nullptr, DType::kBFloat16, 1}, 1.0f).ok());
  EXPECT_FLOAT_EQ(m, 2.8f);
}

TEST(CpuSgd, BadValuesAreRefusedByName) {
  float p = 0, g = 0, m = 0;
  SgdBuffers b{&p, &g, &m, nullptr, DType::kBFloat16, 1};
  SgdParams sp;
  sp.lr = -1;
  EXPECT_NE(SgdStep(sp, b, 1.0f).status().message().find("SGD lr=-1"), std::string::npos);
  sp = {};
  sp.nesterov = true;  // without momentum
  EXPECT_NE(SgdStep(sp, b, 1.0f).status().message().find("nesterov"), std::string::npos);
  sp = {};
  sp.momentum = 0.9;
  b.momentum = nullptr;
  EXPECT_FALSE(SgdStep(sp, b, 1.0f).ok());
  EXPECT_EQ(p, 0.0f);  // nothing written
}

}  // namespace
}  // namespace strata::optim
