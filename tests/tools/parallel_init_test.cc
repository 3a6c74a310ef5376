// strata-train's parallel initialization (tools/train/parallel_init.h): each value against the
// Box-Muller formula evaluated in double from the generator's definition, the same bits on one
// thread and on several, the moments and tail mass of a normal distribution, and a GptBlock
// whose large layers take the parallel path while its small ones still draw what LibTorch's
// generator gives.
#include <cmath>
#include <cstdint>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tools/train/gpt.h"
#include "tools/train/parallel_init.h"

namespace strata::models {
namespace {

// Note [parallel normal]'s definition, written out again in double: element e of a tensor of n.
double Expected(int64_t e, int64_t n, uint64_t key, double mean, double std) {
  constexpr int64_t kHalf = 32768;
  const int64_t b = e / (2 * kHalf), begin = b * 2 * kHalf;
  const int64_t m = std::min(2 * kHalf, n - begin), k = m / 2, i = e - begin;
  int64_t pair;
  bool use_sin = false;
  if (i < k) {
    pair = b * kHalf + i;
  } else if (i < 2 * k) {
    pair = b * kHalf + i - k, use_sin = true;
  } else {
    pair = b * kHalf + k;  // the odd block's last value
  }
  uint64_t z = key + static_cast<uint64_t>(pair + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  const double u1 = (static_cast<double>(z >> 41) + 0.5) / 8388608.0;
  const double u2 = static_cast<double>((z >> 16) & 0xffffff) / 16777216.0;
  const double r = std::sqrt(-2.0 * std::log(u1));
  return mean + std * r * (use_sin ? std::sin(2 * M_PI * u2) : std::cos(2 * M_PI * u2));
}

TEST(ParallelNormal, EveryValueIsTheFormulasAcrossBlocksAndOddTails) {
  for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{65536}, int64_t{65537}, int64_t{200001}}) {
    torch::Tensor w = torch::empty({n});
    ParallelNormal(w, 0.5, 0.02, 42);
    const float* p = w.data_ptr<float>();
    for (int64_t e = 0; e < n; ++e) {
      const double want = Expected(e, n, 42, 0.5, 0.02);
      // LibTorch's float log, sqrt, cos and sin against double: a few float ulps of the value.
      ASSERT_NEAR(p[e], want, 2e-6) << "n=" << n << " element " << e;
    }
  }
}

TEST(ParallelNormal, SameBitsOnOneThreadAndOnSeveral) {
  const int before = torch::get_num_threads();
  torch::Tensor one = torch::empty({300000}), many = torch::empty({300000});
  torch::set_num_threads(1);
  ParallelNormal(one, 0.0, 1.0, 7);
  torch::set_num_threads(4);
  ParallelNormal(many, 0.0, 1.0, 7);
  torch::set_num_threads(before);
  EXPECT_TRUE(torch::equal(one, many));
  torch::Tensor other = torch::empty({300000});
  ParallelNormal(other, 0.0, 1.0, 8);
  EXPECT_FALSE(torch::equal(one, other)) << "another key must give other values";
}

TEST(ParallelNormal, HasTheMomentsAndTailsOfANormal) {
  const int64_t n = int64_t{1} << 22;
  torch::Tensor w = torch::empty({n});
  ParallelNormal(w, 0.0, 0.02, 123);
  const torch::Tensor x = w.to(torch::kDouble) / 0.02;
  const double mean = x.mean().item<double>(), var = x.var().item<double>();
  const double kurt = ((x - mean).pow(4).mean() / (var * var)).item<double>();
  EXPECT_LT(std::fabs(mean), 4.0 / std::sqrt(static_cast<double>(n)));  // 4 standard errors
  EXPECT_NEAR(var, 1.0, 0.005);
  EXPECT_NEAR(kurt, 3.0, 0.03);
  const auto share = [&](double k) { return (x.abs() < k).to(torch::kDouble).mean().item<double>(); };
  EXPECT_NEAR(share(1.0), 0.682689, 0.002);
  EXPECT_NEAR(share(2.0), 0.954500, 0.001);
  EXPECT_NEAR(share(3.0), 0.997300, 0.0003);
  EXPECT_LE(x.abs().max().item<double>(), 5.8);  // the 23-bit u1 bounds the tail at 5.77
}

TEST(ParallelNormal, LargeGptLayersTakeItAndSmallOnesKeepLibTorchsDraws) {
  ModelConfig c;
  c.d_model = 2048;  // fc and out are 2048 x 8192 = 2^24 elements; qkv and proj are smaller
  c.n_heads = 16;
  torch::manual_seed(5);
  GptBlock a(c);
  torch::manual_seed(5);
  GptBlock b(c);
  EXPECT_EQ(a->fc->weight.sizes(), (std::vector<int64_t>{8192, 2048}));
  EXPECT_EQ(a->fc->options.in_features(), 2048);
  EXPECT_EQ(a->fc->options.out_features(), 8192);
  EXPECT_EQ(a->out->weight.sizes(), (std::vector<int64_t>{2048, 8192}));
  EXPECT_TRUE(torch::equal(a->fc->weight, b->fc->weight)) << "the seed decides the parallel draw";
  EXPECT_TRUE(torch::equal(a->out->weight, b->out->weight));
  EXPECT_FALSE(torch::equal(a->fc->weight.view({-1}).narrow(0, 0, 1 << 20),
                            a->out->weight.view({-1}).narrow(0, 0, 1 << 20)))
      << "each large layer has its own key";
  EXPECT_EQ(a->fc->bias.count_nonzero().item<int64_t>(), 0);
  EXPECT_NEAR(a->fc->weight.std().item<double>(), 0.02, 0.0002);
  // Sizes the tests and benchmarks use are drawn as before: a stock Linear, then normal_.
  ModelConfig small;
  torch::manual_seed(9);
  GptBlock s(small);
  torch::manual_seed(9);
  torch::nn::LayerNorm ln1(torch::nn::LayerNormOptions({small.d_model}));
  torch::nn::LayerNorm ln2(torch::nn::LayerNormOptions({small.d_model}));
  torch::nn::Linear qkv(torch::nn::LinearOptions(small.d_model, 3 * small.d_model));
  torch::NoGradGuard ng;
  qkv->weight.normal_(0.0, 0.02);
  EXPECT_TRUE(torch::equal(s->qkv->weight, qkv->weight));
}

}  // namespace
}  // namespace strata::models
