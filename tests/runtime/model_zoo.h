// A zoo of models built only from stock LibTorch layers, each running its units through
// strata::RunUnit in its own forward, so that the same model is the plain-LibTorch reference
// (RunUnit is a plain call without an engine) and the engine's model. Shared by the
// single-process and the multi-rank equivalence tests.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/base/config.h"
#include "runtime/base/device.h"
#include "runtime/comm/communicator.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/run_unit.h"
#include "tests/runtime/gpt_training.h"
#include "tests/test_util.h"
#include "tiers/hbm/device_factory.h"
#include "tools/train/gpt.h"

namespace strata::zoo {

inline constexpr int64_t kGlobalBatch = 8;
inline constexpr int kZooSteps = 4;

// --- An MLP whose blocks (LayerNorm, Linear, GELU, Linear) add the first unit's output: a
// residual that crosses units.
struct ResBlockImpl : torch::nn::Module {
  ResBlockImpl() {
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    fc1 = register_module("fc1", torch::nn::Linear(16, 48));
    fc2 = register_module("fc2", torch::nn::Linear(48, 16));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(ln(x)))); }
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ResBlock);

struct ResMlpImpl : torch::nn::Module {
  ResMlpImpl() {
    in = register_module("in", torch::nn::Linear(12, 16));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) blocks->push_back(ResBlock());
    ln_out = register_module("ln_out", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    out = register_module("out", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor h0 = strata::RunUnit(*in, [&] {
      torch::Tensor y = in(x);
      if (inside_unit) inside_unit(0);
      return y;
    });
    if (after_unit) after_unit(0);
    torch::Tensor h = h0;
    int k = 1;
    for (const auto& b : *blocks) {
      auto* blk = b->as<ResBlockImpl>();
      h = strata::RunUnit(*blk, [&] {
            torch::Tensor y = blk->forward(h);
            if (inside_unit) inside_unit(k);
            return y;
          }) + h0;
      if (after_unit) after_unit(k);
      ++k;
    }
    h = strata::RunUnit(*ln_out, [&] { return ln_out(h); });
    return strata::RunUnit(*out, [&] { return out(h); });
  }
  torch::nn::Linear in{nullptr}, out{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_out{nullptr};
  // Test probes: called inside a unit's RunUnit (parameters gathered) and right after it.
  std::function<void(int)> inside_unit, after_unit;
};
TORCH_MODULE(ResMlp);

// --- A conv net with BatchNorm: running statistics are buffers the engine must keep. (The convs
// have no bias, as usual before BatchNorm: its gradient is zero up to rounding, and Adam would
// amplify the rounding into steps that differ between any two summation orders.)
struct ConvBlockImpl : torch::nn::Module {
  ConvBlockImpl(int64_t in, int64_t out) {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm2d(out));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::relu(bn(conv(x))); }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
};
TORCH_MODULE(ConvBlock);

struct ConvNetImpl : torch::nn::Module {
  ConvNetImpl() {
    b1 = register_module("b1", ConvBlock(3, 8));
    b2 = register_module("b2", ConvBlock(8, 8));
    fc = register_module("fc", torch::nn::Linear(8 * 4 * 4, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = strata::RunUnit(*b1, [&] { return b1->forward(x); });
    h = torch::avg_pool2d(strata::RunUnit(*b2, [&] { return b2->forward(h); }), 2);
    return strata::RunUnit(*fc, [&] { return fc(h.flatten(1)); });
  }
  ConvBlock b1{nullptr}, b2{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ConvNet);

// --- Units that take two inputs and return two outputs (one Linear used twice in a unit).
struct MixImpl : torch::nn::Module {
  MixImpl() {
    la = register_module("la", torch::nn::Linear(10, 10));
    lb = register_module("lb", torch::nn::Linear(10, 10));
    n = register_module("n", torch::nn::LayerNorm(torch::nn::LayerNormOptions({10})));
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& a, const torch::Tensor& b) {
    torch::Tensor pa = la(a);
    return {pa + torch::tanh(lb(b)), n(b + la(pa))};
  }
  torch::nn::Linear la{nullptr}, lb{nullptr};
  torch::nn::LayerNorm n{nullptr};
};
TORCH_MODULE(Mix);

struct TwoWayImpl : torch::nn::Module {
  TwoWayImpl() {
    mixes = register_module("mixes", torch::nn::ModuleList());
    for (int i = 0; i < 3; ++i) mixes->push_back(Mix());
    head = register_module("head", torch::nn::Linear(10, 3));
  }
  torch::Tensor forward(const torch::Tensor& a0, const torch::Tensor& b0) {
    torch::Tensor a = a0, b = b0;
    for (const auto& m : *mixes) {
      auto* mix = m->as<MixImpl>();
      std::tie(a, b) = strata::RunUnit(*mix, [&] { return mix->forward(a, b); });
    }
    return strata::RunUnit(*head, [&] { return head(a * b); });
  }
  torch::nn::ModuleList mixes{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(TwoWay);

// --- Every trainable tensor is the root's own parameter, used through torch::linear with no
// child module and no RunUnit (logistic regression, matrix factorisation and many research
// models look like this): the engine's root unit, never released.
struct RootOnlyImpl : torch::nn::Module {
  RootOnlyImpl() {
    w1 = register_parameter("w1", torch::randn({16, 12}) * 0.3);
    b1 = register_parameter("b1", torch::zeros({16}));
    w2 = register_parameter("w2", torch::randn({4, 16}) * 0.3);
    b2 = register_parameter("b2", torch::zeros({4}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::linear(torch::tanh(torch::linear(x, w1, b1)), w2, b2);
  }
  torch::Tensor w1, b1, w2, b2;
};
TORCH_MODULE(RootOnly);

// --- The root's own parameters used before its children (a learned input scale) and after them
// (an output bias), around two Linear units.
struct RootAroundImpl : torch::nn::Module {
  RootAroundImpl() {
    scale = register_parameter("scale", torch::ones({12}));
    fc1 = register_module("fc1", torch::nn::Linear(12, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    bias = register_parameter("bias", torch::zeros({4}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = strata::RunUnit(*fc1, [&] { return fc1(x * scale); });
    return strata::RunUnit(*fc2, [&] { return fc2(torch::tanh(h)); }) + bias;
  }
  torch::Tensor scale, bias;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(RootAround);

// A model of the zoo: how to build it (seeded) and its loss on rows [row0, row0 + rows) of the
// global batch of (step, micro).
struct Model {
  std::string name;
  std::function<std::shared_ptr<torch::nn::Module>()> build;
  std::function<torch::Tensor(torch::nn::Module&, int, int, int64_t, int64_t)> loss;
  bool batch_statistics = false;  // BatchNorm: ranks see different batches, so 1 rank only
};

inline void Seed(int step, int micro) { torch::manual_seed(5000 + step * 17 + micro); }

inline std::vector<Model> Models() {
  std::vector<Model> out;
  out.push_back({"res_mlp", [] { torch::manual_seed(7); return std::static_pointer_cast<torch::nn::Module>(ResMlp().ptr()); },
                 [](torch::nn::Module& m, int s, int k, int64_t r0, int64_t n) {
                   Seed(s, k);
                   // A target the model can learn: a fixed linear map of the input.
                   torch::Tensor x = torch::randn({kGlobalBatch, 12});
                   torch::Tensor y = x.matmul(torch::linspace(-1, 1, 48).view({12, 4}));
                   auto* net = m.as<ResMlpImpl>();
                   return torch::mse_loss(net->forward(x.narrow(0, r0, n)), y.narrow(0, r0, n));
                 }});
  out.push_back({"conv_bn", [] { torch::manual_seed(8); return std::static_pointer_cast<torch::nn::Module>(ConvNet().ptr()); },
                 [](torch::nn::Module& m, int s, int k, int64_t r0, int64_t n) {
                   Seed(s, k);
                   torch::Tensor x = torch::randn({kGlobalBatch, 3, 8, 8});
                   torch::Tensor y = torch::randint(0, 10, {kGlobalBatch}, torch::kLong);
                   auto* net = m.as<ConvNetImpl>();
                   return torch::nn::functional::cross_entropy(net->forward(x.narrow(0, r0, n)), y.narrow(0, r0, n));
                 },
                 true});
  out.push_back({"two_in_two_out", [] { torch::manual_seed(9); return std::static_pointer_cast<torch::nn::Module>(TwoWay().ptr()); },
                 [](torch::nn::Module& m, int s, int k, int64_t r0, int64_t n) {
                   Seed(s, k);
                   torch::Tensor a = torch::randn({kGlobalBatch, 10}), b = torch::randn({kGlobalBatch, 10});
                   // A label the model can learn: how many of the two inputs sum above zero.
                   torch::Tensor y = (a.sum(1) > 0).to(torch::kLong) + (b.sum(1) > 0).to(torch::kLong);
                   auto* net = m.as<TwoWayImpl>();
                   return torch::nn::functional::cross_entropy(
                       net->forward(a.narrow(0, r0, n), b.narrow(0, r0, n)), y.narrow(0, r0, n));
                 }});
  // A target the two root-parameter models can learn: which quarter of the input's range its
  // first feature falls in. The same batch every step (these models are small, and four steps
  // on fresh batches of 8 do not show whether they learn).
  auto quarter_loss = [](auto forward) {
    return [forward](torch::nn::Module& m, int, int k, int64_t r0, int64_t n) {
      Seed(0, k);
      torch::Tensor x = torch::randn({kGlobalBatch, 12});
      torch::Tensor y =
          torch::bucketize(x.select(1, 0).contiguous(), torch::tensor({-0.67f, 0.0f, 0.67f}));
      return torch::nn::functional::cross_entropy(forward(m, x.narrow(0, r0, n)), y.narrow(0, r0, n));
    };
  };
  out.push_back({"root_only", [] { torch::manual_seed(10); return std::static_pointer_cast<torch::nn::Module>(RootOnly().ptr()); },
                 quarter_loss([](torch::nn::Module& m, const torch::Tensor& x) {
                   return m.as<RootOnlyImpl>()->forward(x);
                 })});
  out.push_back({"root_around", [] { torch::manual_seed(11); return std::static_pointer_cast<torch::nn::Module>(RootAround().ptr()); },
                 quarter_loss([](torch::nn::Module& m, const torch::Tensor& x) {
                   return m.as<RootAroundImpl>()->forward(x);
                 })});
  return out;
}

struct Run {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
  std::vector<torch::Tensor> buffers;
};

inline std::vector<torch::Tensor> Buffers(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& b : m.buffers(true)) out.push_back(b.detach().clone());
  return out;
}

// Plain LibTorch AdamW on the whole global batch.
inline Run Reference(const Model& z, const Config& c) {
  auto model = z.build();
  model->train();
  std::vector<torch::Tensor> params = models::UniqueParameters(*model);
  Run run;
  run.losses = TrainPlainLibTorch(params, c, kZooSteps,
                              [&](int s, int k) { return z.loss(*model, s, k, 0, kGlobalBatch); });
  for (auto& p : params) run.params.push_back(p.detach().clone());
  run.buffers = Buffers(*model);
  return run;
}

// The same through the engine; with several ranks each takes its slice of the global batch.
inline Run ThroughEngine(const Model& z, const Config& c, Communicator* comm,
                         const EngineOptions& opts = {}) {
  auto model = z.build();
  model->train();
  auto device = CreateDevice("cpu", 256 << 20).value();
  auto engine_or = Engine::Create(model, c, comm, device.get(), opts);
  EXPECT_TRUE(engine_or.ok()) << engine_or.status();
  if (!engine_or.ok()) return {};
  auto engine = std::move(engine_or).value();
  const int64_t rows = kGlobalBatch / comm->world_size();
  Run run;
  run.losses = TrainWithEngine(*engine, c, comm, kZooSteps, [&](int s, int k) {
    return z.loss(*model, s, k, comm->rank() * rows, rows);
  });
  auto params = engine->GatherMasterParams();
  EXPECT_TRUE(params.ok()) << params.status();
  if (params.ok()) run.params = *params;
  run.buffers = Buffers(*model);
  return run;
}

inline void ExpectMatch(const Run& ref, const Run& got, double loss_tol, double param_tol) {
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], loss_tol * std::abs(ref.losses[i])) << "step " << i;
  ASSERT_EQ(ref.params.size(), got.params.size());
  for (size_t i = 0; i < ref.params.size(); ++i)
    EXPECT_LT((ref.params[i] - got.params[i]).abs().max().item<double>(), param_tol) << "parameter " << i;
  ASSERT_EQ(ref.buffers.size(), got.buffers.size());
  for (size_t i = 0; i < ref.buffers.size(); ++i)
    EXPECT_TRUE(torch::allclose(ref.buffers[i].to(torch::kDouble), got.buffers[i].to(torch::kDouble),
                                1e-5, 1e-6))
        << "buffer " << i;
}

inline Config ZooConfig() {
  Config c;
  c.optimizer.type = OptimizerType::kAdamW;
  c.optimizer.lr = 3e-3;
  c.optimizer.weight_decay = 0.01;
  c.strata.chunk_size = 4 << 10;  // small chunks: several per unit, some spanning units
  c.strata.device = "cpu";
  c.train_micro_batch_size_per_gpu = kGlobalBatch;
  return c;
}

}  // namespace strata::zoo
