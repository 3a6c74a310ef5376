// CPU Adam against LibTorch's torch::optim::Adam / AdamW, and CPU Adagrad against
// torch::optim::Adagrad, over several steps. The only LibTorch translation unit of the optim
// tests: keep it one file (they compile slowly).
#include <torch/torch.h>

#include <cstring>
#include <random>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "optim/cpu_adagrad.h"
#include "optim/cpu_adam.h"
#include "tests/test_util.h"

namespace strata::optim {
namespace {

struct Case {
  bool adamw;
  double weight_decay;
  DType grad_dtype;
  float grad_scale;
};

class TorchParityTest : public ::testing::TestWithParam<Case> {};

TEST_P(TorchParityTest, MatchesTorchOverSteps) {
  const Case c = GetParam();
  const int64_t n = 4099;  // not a multiple of any vector width
  const double lr = 3e-3, beta1 = 0.9, beta2 = 0.99, eps = 1e-8;
  torch::manual_seed(17);
  torch::Tensor param = torch::randn({n});
  std::vector<float> master(param.data_ptr<float>(), param.data_ptr<float>() + n);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  std::vector<uint16_t> p16(n);

  std::vector<torch::Tensor> params = {param.clone().set_requires_grad(true)};
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (c.adamw) {
    opt = std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(lr).betas(std::make_tuple(beta1, beta2)).eps(eps).weight_decay(c.weight_decay));
  } else {
    opt = std::make_unique<torch::optim::Adam>(
        params, torch::optim::AdamOptions(lr).betas(std::make_tuple(beta1, beta2)).eps(eps).weight_decay(c.weight_decay));
  }

  const torch::ScalarType grad_type = c.grad_dtype == DType::kFloat32    ? torch::kFloat32
                                      : c.grad_dtype == DType::kBFloat16 ? torch::kBFloat16
                                                                          : torch::kFloat16;
  for (Isa isa : {Isa::kScalar, DetectIsa()}) {
    SCOPED_TRACE(IsaName(isa));
    // Each ISA restarts from the same state and replays the same gradients.
    std::vector<float> mm = master, mv = m, vv = v;
    torch::NoGradGuard no_grad;
    params[0].copy_(param);
    opt->state().clear();
    torch::manual_seed(23);
    for (int64_t step = 1; step <= 6; ++step) {
      const torch::Tensor g16 = (torch::randn({n}) * 0.3).to(grad_type).contiguous();
      // torch sees exactly the scaled fp32 gradient the kernel computes.
      params[0].mutable_grad() = g16.to(torch::kFloat32) * c.grad_scale;
      opt->step();

      AdamBuffers b;
      b.master = mm.data();
      b.grad = g16.data_ptr();
      b.grad_dtype = c.grad_dtype;
      b.exp_avg = mv.data();
      b.exp_avg_sq = vv.data();
      b.param16 = p16.data();
      b.param16_dtype = DType::kBFloat16;
      b.n = static_cast<size_t>(n);
      AdamParams p;
      p.lr = lr;
      p.beta1 = beta1;
      p.beta2 = beta2;
      p.eps = eps;
      p.weight_decay = c.weight_decay;
      p.adamw = c.adamw;
      p.step = step;
      AdamOptions o;
      o.isa = isa;
      ASSERT_OK_AND_ASSIGN(AdamResult r, AdamStep(p, b, c.grad_scale, o));
      ASSERT_FALSE(r.skipped);

      const float* want = params[0].data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_NEAR(mm[i], want[i], 2e-6 * (1.0 + std::fabs(want[i])))
            << "step " << step << " element " << i;
      }
      // The bf16 copy is torch's own round-to-nearest-even of the master, bit for bit.
      const torch::Tensor ours = torch::from_blob(mm.data(), {n}, torch::kFloat32);
      const torch::Tensor torch_bf16 = ours.to(torch::kBFloat16).contiguous();
      ASSERT_EQ(std::memcmp(torch_bf16.data_ptr(), p16.data(), n * 2), 0) << "step " << step;
    }
    // The optimizer states agree too, to float rounding of their terms: m is a sum of terms of
    // the gradient's size (~0.3, ulp 3e-8) that may cancel, so the bound is absolute there.
    auto& state = opt->state();
    ASSERT_EQ(state.size(), 1u);
    torch::Tensor exp_avg, exp_avg_sq;
    if (c.adamw) {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*state.begin()->second);
      exp_avg = s.exp_avg();
      exp_avg_sq = s.exp_avg_sq();
    } else {
      auto& s = static_cast<torch::optim::AdamParamState&>(*state.begin()->second);
      exp_avg = s.exp_avg();
      exp_avg_sq = s.exp_avg_sq();
    }
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(mv[i], exp_avg.data_ptr<float>()[i], 3e-8 + 1e-6 * std::fabs(mv[i]));
      ASSERT_NEAR(vv[i], exp_avg_sq.data_ptr<float>()[i], 1e-9 + 1e-5 * std::fabs(vv[i]));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, TorchParityTest,
    ::testing::Values(Case{false, 0.0, DType::kFloat32, 1.0f}, Case{false, 0.01, DType::kFloat32, 0.5f},
                      Case{true, 0.0, DType::kFloat32, 1.0f}, Case{true, 0.1, DType::kFloat32, 0.25f},
                      Case{true, 0.05, DType::kBFloat16, 1.0f}, Case{false, 0.05, DType::kFloat16, 0.125f}));

// Adagrad (weight decay, lr_decay, a grad scale) against torch::optim::Adagrad over six steps,
// on the scalar path and this CPU's best: the same unfused fp32 operations in the same order,
// so the parameters and sums agree to a few ulps (LibTorch's kernels are its own vector code).
TEST(TorchAdagradParity, MatchesTorchOverSteps) {
  const int64_t n = 4099;
  const double lr = 0.05, lr_decay = 0.01, weight_decay = 0.01, eps = 1e-10;
  const float grad_scale = 0.5f;
  torch::manual_seed(5);
  const torch::Tensor param = torch::randn({n});
  for (Isa isa : {Isa::kScalar, DetectIsa()}) {
    SCOPED_TRACE(IsaName(isa));
    std::vector<torch::Tensor> params = {param.clone().set_requires_grad(true)};
    torch::optim::Adagrad opt(params, torch::optim::AdagradOptions(lr).lr_decay(lr_decay)
                                          .weight_decay(weight_decay).eps(eps));
    std::vector<float> master(param.data_ptr<float>(), param.data_ptr<float>() + n);
    std::vector<float> sum(n, 0.0f);
    torch::manual_seed(29);
    for (int64_t step = 1; step <= 6; ++step) {
      const torch::Tensor g = torch::randn({n}) * 0.3;
      {
        torch::NoGradGuard no_grad;
        params[0].mutable_grad() = g * grad_scale;
      }
      opt.step();
      AdagradParams ap;
      ap.lr = lr;
      ap.lr_decay = lr_decay;
      ap.weight_decay = weight_decay;
      ap.eps = eps;
      ap.step = step;
      ElementwiseOptions o;
      o.isa = isa;
      ASSERT_OK(AdagradStep(ap, {master.data(), g.data_ptr<float>(), sum.data(), nullptr,
                                 DType::kBFloat16, static_cast<size_t>(n)},
                            grad_scale, o)
                    .status());
      const float* want = params[0].data_ptr<float>();
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_NEAR(master[i], want[i], 1e-6 * (1.0 + std::fabs(want[i])))
            << "step " << step << " element " << i;
      }
    }
    auto& st = static_cast<torch::optim::AdagradParamState&>(*opt.state().begin()->second);
    const float* want_sum = st.sum().data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(sum[i], want_sum[i], 1e-6 * (1e-3 + want_sum[i]));
  }
}

// fp16 conversion against torch's c10::Half for random values across fp16's range.
TEST(TorchConversionTest, Fp16MatchesTorch) {
  torch::manual_seed(3);
  const torch::Tensor x = torch::randn({100000}) * torch::pow(2.0, torch::randint(-26, 17, {100000}));
  const torch::Tensor h = x.to(torch::kFloat16).contiguous();
  const float* xs = x.data_ptr<float>();
  const uint16_t* hs = static_cast<const uint16_t*>(h.data_ptr());
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(FloatToHalf(xs[i]), hs[i]) << xs[i];
}

}  // namespace
}  // namespace strata::optim
