// Shared by the equivalence suites: a small GPT, learnable synthetic text, plain LibTorch
// training as the reference, and the same training through the engine.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <string>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/comm/communicator.h"
#include "runtime/config.h"
#include "runtime/device.h"
#include "runtime/engine.h"
#include "tests/runtime/delaying_device.h"
#include "tests/test_util.h"
#include "tools/train/gpt.h"

namespace strata {

inline constexpr int kSteps = 4;

// The device the engine trains on in these suites: STRATA_TEST_DEVICE ("cuda" in the gpu-labelled
// runs), the CPU device otherwise. The reference always trains on the CPU.
inline std::string TestDeviceSpec() {
  const char* v = std::getenv("STRATA_TEST_DEVICE");
  return v != nullptr && *v != '\0' ? std::string(v) : std::string("cpu");
}
// How much looser a GPU run's comparison with the CPU reference is (summation order only).
inline constexpr double kGpuToleranceFactor = 5.0;

inline Config BaseConfig() {
  Config c;
  c.model.n_layers = 2;
  c.model.d_model = 32;
  c.model.n_heads = 4;
  c.model.seq_len = 16;
  c.model.vocab_size = 64;
  c.model.seed = 99;
  c.train_micro_batch_size_per_gpu = 4;
  c.optimizer.type = OptimizerType::kAdamW;
  c.optimizer.lr = 3e-3;
  c.optimizer.weight_decay = 0.01;
  c.strata.chunk_size = 16 << 10;  // small chunks: several per block, some spanning blocks
  c.strata.device = "cpu";
  return c;
}

// Batches for one micro-step: [B, T+1] tokens from a fixed generator.
// The text follows a rule (each token is 5 x the previous + 3, mod the vocabulary) from random
// starting tokens, so there is something to learn and the loss falls within a few steps.
inline torch::Tensor Batch(const Config& c, int step, int micro) {
  torch::manual_seed(1000 + step * 31 + micro);
  const int64_t B = c.train_micro_batch_size_per_gpu, T = c.model.seq_len + 1;
  torch::Tensor t = torch::empty({B, T}, torch::kLong);
  t.select(1, 0).copy_(torch::randint(0, c.model.vocab_size, {B}, torch::kLong));
  for (int64_t i = 1; i < T; ++i)
    t.select(1, i).copy_((t.select(1, i - 1) * 5 + 3).remainder(c.model.vocab_size));
  return t;
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<torch::Tensor> params;
};

// Plain LibTorch AdamW over `params` with the config's hyper-parameters, accumulation and
// clipping: `steps` steps of gradient_accumulation_steps micro-steps, `loss(step, micro)` giving
// each micro-step's loss. Returns the steps' mean losses. The reference every equivalence test
// compares the engine with.
inline std::vector<double> TrainWithAdamW(const std::vector<torch::Tensor>& params, const Config& c,
                                          int steps,
                                          const std::function<torch::Tensor(int, int)>& loss) {
  torch::optim::AdamW adamw(params, torch::optim::AdamWOptions(c.optimizer.lr)
                                        .betas({c.optimizer.beta1, c.optimizer.beta2})
                                        .eps(c.optimizer.eps)
                                        .weight_decay(c.optimizer.weight_decay));
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    double step_loss = 0;
    for (int m = 0; m < c.gradient_accumulation_steps; ++m) {
      torch::Tensor l = loss(s, m);
      (l / c.gradient_accumulation_steps).backward();
      step_loss += l.item<double>() / c.gradient_accumulation_steps;
    }
    if (c.gradient_clipping > 0) torch::nn::utils::clip_grad_norm_(params, c.gradient_clipping);
    adamw.step();
    adamw.zero_grad();
    losses.push_back(step_loss);
  }
  return losses;
}

// Plain LibTorch training of the GPT: the reference.
inline TrainRun Reference(const Config& c) {
  auto model = models::BuildGpt(c.model);
  std::vector<torch::Tensor> params = models::UniqueParameters(*model);
  TrainRun run;
  run.losses = TrainWithAdamW(params, c, kSteps, [&](int s, int m) {
    torch::Tensor b = Batch(c, s, m);
    return models::LanguageModelLoss(model->forward(b.narrow(1, 0, c.model.seq_len)),
                                     b.narrow(1, 1, c.model.seq_len));
  });
  for (auto& p : params) run.params.push_back(p.detach().clone());
  return run;
}

// The engine's side of TrainWithAdamW: Backward of each micro-step's loss (this rank's slice),
// Step after each accumulation. Returns the steps' losses averaged over ranks.
inline std::vector<double> TrainWithEngine(Engine& engine, const Config& c, Communicator* comm,
                                           int steps,
                                           const std::function<torch::Tensor(int, int)>& loss) {
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    double step_loss = 0;
    for (int m = 0; m < c.gradient_accumulation_steps; ++m) {
      torch::Tensor l = loss(s, m);
      Status st = engine.Backward(l);
      EXPECT_TRUE(st.ok()) << st;
      double v = l.item<double>() / c.gradient_accumulation_steps;
      if (comm->world_size() > 1) EXPECT_OK(comm->AllReduce(&v, 1, strata::DType::kF64, ReduceOp::kAvg));
      step_loss += v;
    }
    auto rep = engine.Step();
    EXPECT_TRUE(rep.ok()) << rep.status();
    losses.push_back(step_loss);
  }
  return losses;
}

// Trains through the engine on `comm` (a single-rank one when null). With several ranks, rank r
// takes micro-batch r of each step's global batch and the reported loss is the mean over ranks.
// `delay_us` > 0 runs it on a DelayingDevice (tests/runtime/delaying_device.h) over the CPU
// device: every stream's work completes up to that many microseconds late, and each chunk's
// reduction on the reduce lane starts up to that late.
inline TrainRun ThroughEngine(const Config& c, const EngineOptions& opts_in = {},
                              Communicator* comm_in = nullptr, int delay_us = 0) {
  EngineOptions opts = opts_in;
  std::mt19937 rng(11);
  std::mutex rng_mu;
  if (delay_us > 0 && !opts.reduce_delay_hook) {
    opts.reduce_delay_hook = [&rng, &rng_mu, delay_us](int64_t) {
      int us;
      {
        std::lock_guard<std::mutex> l(rng_mu);
        us = std::uniform_int_distribution<int>(0, delay_us)(rng);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    };
  }
  std::unique_ptr<Communicator> own;
  Communicator* comm = comm_in;
  if (!comm) {
    own = CreateSingleCommunicator();
    comm = own.get();
  }
  std::unique_ptr<Device> device = CreateDevice(TestDeviceSpec(), 256 << 20).value();
  if (delay_us > 0) device = std::make_unique<testing::DelayingDevice>(std::move(device), delay_us);
  const torch::Device on = TorchDevice(*device);
  auto engine_or = Engine::Create(models::BuildGpt(c.model), c, comm, device.get(), opts);
  EXPECT_TRUE(engine_or.ok()) << engine_or.status();
  if (!engine_or.ok()) return {};
  auto engine = std::move(engine_or).value();
  TrainRun run;
  run.losses = TrainWithEngine(*engine, c, comm, kSteps, [&](int s, int m) {
    torch::Tensor b = Batch(c, s, m).chunk(comm->world_size(), 0)[comm->rank()].contiguous().to(on);
    return models::LanguageModelLoss(engine->Forward(b.narrow(1, 0, c.model.seq_len)),
                                     b.narrow(1, 1, c.model.seq_len));
  });
  auto params = engine->GatherMasterParams();
  EXPECT_TRUE(params.ok()) << params.status();
  if (params.ok()) run.params = *params;
  return run;
}

inline void ExpectMatch(const TrainRun& ref, const TrainRun& got, double loss_tol, double param_tol) {
  // On a GPU the engine's matmuls and reductions sum in another order than the CPU reference.
  if (TestDeviceSpec() != "cpu") {
    loss_tol *= kGpuToleranceFactor;
    param_tol *= kGpuToleranceFactor;
  }
  ASSERT_EQ(ref.losses.size(), got.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], loss_tol * std::abs(ref.losses[i])) << "step " << i;
  ASSERT_EQ(ref.params.size(), got.params.size());
  for (size_t i = 0; i < ref.params.size(); ++i) {
    double diff = (ref.params[i] - got.params[i]).abs().max().item<double>();
    EXPECT_LT(diff, param_tol) << "parameter " << i;
  }
}

}  // namespace strata
