// strata-train's attention: the explicit path against a scalar loop written from the formula,
// and the fused path (LibTorch 2.x) against the explicit one, values and gradients, in fp32 and
// bf16, alone and inside a GptBlock.
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "tools/train/gpt.h"

namespace strata::models {
namespace {

torch::Tensor Causal(int64_t t) { return torch::ones({t, t}).tril().to(torch::kBool); }

// softmax(q k^T / sqrt(hd) over j <= i) v, one output element at a time, in double.
torch::Tensor ScalarReference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  auto Q = q.to(torch::kDouble).contiguous(), K = k.to(torch::kDouble).contiguous(),
       V = v.to(torch::kDouble).contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  torch::Tensor out = torch::zeros({B, H, T, D}, torch::kDouble);
  auto qa = Q.accessor<double, 4>(), ka = K.accessor<double, 4>(), va = V.accessor<double, 4>();
  auto oa = out.accessor<double, 4>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> s(i + 1);
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qa[b][h][i][d] * ka[b][h][j][d];
          s[j] = dot / std::sqrt(static_cast<double>(D));
          mx = std::max(mx, s[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (int64_t j = 0; j <= i; ++j) acc += s[j] / sum * va[b][h][j][d];
          oa[b][h][i][d] = acc;
        }
      }
  return out;
}

TEST(GptAttention, ExplicitPathEqualsTheFormula) {
  torch::manual_seed(1);
  auto q = torch::randn({2, 3, 7, 8}), k = torch::randn({2, 3, 7, 8}), v = torch::randn({2, 3, 7, 8});
  auto got = CausalAttention(q, k, v, Causal(7), 0.0, AttentionPath::kExplicit);
  EXPECT_TRUE(torch::allclose(got.to(torch::kDouble), ScalarReference(q, k, v), 1e-5, 1e-6));
}

TEST(GptAttention, FusedPathNeedsLibTorch2) {
  if (FusedAttentionAvailable()) GTEST_SKIP() << "this LibTorch has the fused path";
  auto q = torch::randn({1, 1, 4, 4});
  try {
    CausalAttention(q, q, q, Causal(4), 0.0, AttentionPath::kFused);
    FAIL() << "the fused path ran on a LibTorch without it";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("fused attention needs LibTorch 2.x"), std::string::npos);
  }
}

class FusedVsExplicit : public ::testing::TestWithParam<torch::Dtype> {};

TEST_P(FusedVsExplicit, ValuesAndGradientsAgree) {
  if (!FusedAttentionAvailable()) GTEST_SKIP() << "fused attention needs LibTorch 2.x";
  const torch::Dtype dt = GetParam();
  const double tol = dt == torch::kFloat32 ? 1e-5 : 2e-2;
  torch::manual_seed(2);
  std::vector<torch::Tensor> in[2];
  for (int i = 0; i < 3; ++i) {
    auto t = torch::randn({2, 4, 33, 16}).to(dt);
    in[0].push_back(t.clone().requires_grad_(true));
    in[1].push_back(t.clone().requires_grad_(true));
  }
  auto grad = torch::randn({2, 4, 33, 16}).to(dt);
  auto fused = CausalAttention(in[0][0], in[0][1], in[0][2], Causal(33), 0.0, AttentionPath::kFused);
  auto expl = CausalAttention(in[1][0], in[1][1], in[1][2], Causal(33), 0.0, AttentionPath::kExplicit);
  EXPECT_TRUE(torch::allclose(fused.to(torch::kFloat32), expl.to(torch::kFloat32), tol, tol));
  fused.backward(grad);
  expl.backward(grad);
  for (int i = 0; i < 3; ++i)
    EXPECT_TRUE(torch::allclose(in[0][i].grad().to(torch::kFloat32), in[1][i].grad().to(torch::kFloat32),
                                tol * 4, tol * 4))
        << "gradient " << i;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedVsExplicit, ::testing::Values(torch::kFloat32, torch::kBFloat16),
                         [](const auto& info) { return info.param == torch::kFloat32 ? "fp32" : "bf16"; });

TEST(GptAttention, BlockOutputDoesNotDependOnThePath) {
  if (!FusedAttentionAvailable()) GTEST_SKIP() << "fused attention needs LibTorch 2.x";
  ModelConfig c;
  c.d_model = 32;
  c.n_heads = 4;
  c.seq_len = 16;
  torch::manual_seed(3);
  GptBlock block(c);
  block->eval();
  auto x = torch::randn({2, 16, 32});
  block->attention = AttentionPath::kFused;
  auto a = block->forward(x, Causal(16));
  block->attention = AttentionPath::kExplicit;
  auto b = block->forward(x, Causal(16));
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-5));
}

}  // namespace
}  // namespace strata::models
