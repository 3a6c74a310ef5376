// Shared by the equivalence suites: a small GPT, learnable synthetic text, plain LibTorch
// training as the reference, and the same training through the engine.
#pragma once

#include <algorithm>
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

#include "runtime/base/config.h"
#include "runtime/base/device.h"
#include "runtime/comm/communicator.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/engine_test_hooks.h"
#include "tests/runtime/delaying_device.h"
#include "tests/runtime/poisoning_store.h"
#include "tests/test_util.h"
#include "tiers/hbm/device_factory.h"
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
  // With loss scaling (TrainWithScaledAdamW, ThroughEngine with EngineOptions::loss_scaling or
  // fp16): per step, whether it was skipped for a non-finite gradient and the scale its
  // backward ran with.
  std::vector<bool> skipped;
  std::vector<double> scales;
  nlohmann::json placement;  // the engine's placement plan (ThroughEngine), PlacementPlan::ToJson
};

// Rewrites a micro-step's loss before it goes backward (the overflow tests poison some steps).
using LossShaper = std::function<torch::Tensor(torch::Tensor loss, int step, int micro)>;

// The test hooks of `o`, copied (or made) for the caller to set: opts may share them.
inline EngineTestHooks& MutableHooks(EngineOptions* o) {
  auto h = std::make_shared<EngineTestHooks>(o->test_hooks ? *o->test_hooks : EngineTestHooks{});
  o->test_hooks = h;
  return *h;
}

// The config's optimizer hyper-parameters for LibTorch's AdamW.
inline torch::optim::AdamWOptions ReferenceAdamWOptions(const Config& c) {
  return torch::optim::AdamWOptions(c.optimizer.lr)
      .betas({c.optimizer.beta1, c.optimizer.beta2})
      .eps(c.optimizer.eps)
      .weight_decay(c.optimizer.weight_decay);
}

// LibTorch's own optimizer for the config's optimizer.type and hyper-parameters: AdamW, SGD or
// Adagrad (LibTorch has no Lion; the Python suite checks Lion against the paper's rule).
inline std::unique_ptr<torch::optim::Optimizer> ReferenceOptimizer(
    const std::vector<torch::Tensor>& params, const Config& c) {
  const OptimizerConfig& o = c.optimizer;
  switch (o.type) {
    case OptimizerType::kSGD:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).dampening(o.dampening)
                      .weight_decay(o.weight_decay).nesterov(o.nesterov));
    case OptimizerType::kAdagrad:
      return std::make_unique<torch::optim::Adagrad>(
          params, torch::optim::AdagradOptions(o.lr).lr_decay(o.lr_decay)
                      .weight_decay(o.weight_decay).eps(o.eps));
    default:
      return std::make_unique<torch::optim::AdamW>(params, ReferenceAdamWOptions(c));
  }
}

// Plain LibTorch training over `params` with the config's optimizer (ReferenceOptimizer),
// accumulation and clipping: `steps` steps of gradient_accumulation_steps micro-steps,
// `loss(step, micro)` giving each micro-step's loss. Returns the steps' mean losses. The
// reference every equivalence test compares the engine with.
inline std::vector<double> TrainPlainLibTorch(const std::vector<torch::Tensor>& params, const Config& c,
                                          int steps,
                                          const std::function<torch::Tensor(int, int)>& loss) {
  std::unique_ptr<torch::optim::Optimizer> opt = ReferenceOptimizer(params, c);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    double step_loss = 0;
    for (int m = 0; m < c.gradient_accumulation_steps; ++m) {
      torch::Tensor l = loss(s, m);
      (l / c.gradient_accumulation_steps).backward();
      step_loss += l.item<double>() / c.gradient_accumulation_steps;
    }
    if (c.gradient_clipping > 0) torch::nn::utils::clip_grad_norm_(params, c.gradient_clipping);
    opt->step();
    opt->zero_grad();
    losses.push_back(step_loss);
  }
  return losses;
}

// fp16's dynamic loss scaling by the rule DeepSpeed documents, written out here apart from
// optim::DynamicLossScaler, so that the tests check the engine's scaler as well: an overflow
// spends one unit of hysteresis, or halves the scale (not below min_loss_scale) once one unit is
// left; loss_scale_window good steps after the last overflow (or the start) double the scale and
// restore the hysteresis. A static loss_scale never changes.
struct ReferenceLossScaler {
  explicit ReferenceLossScaler(const Fp16Config& f)
      : fp16(f), scale(f.loss_scale > 0 ? f.loss_scale : std::ldexp(1.0, static_cast<int>(f.initial_scale_power))),
        hysteresis_left(f.hysteresis) {}
  void Update(bool overflow) {
    if (fp16.loss_scale <= 0) {
      if (overflow) {
        if (hysteresis_left <= 1) scale = std::max(scale / 2, fp16.min_loss_scale);
        else --hysteresis_left;
        last_overflow = iteration;
      } else if ((iteration - last_overflow) % fp16.loss_scale_window == 0) {
        scale *= 2;
        hysteresis_left = fp16.hysteresis;
      }
    }
    ++iteration;
  }
  Fp16Config fp16;
  double scale;
  int64_t hysteresis_left;
  int64_t iteration = 0;
  int64_t last_overflow = -1;
};

// TrainPlainLibTorch under loss scaling (the config's "fp16" block, whatever fp16.enabled says):
// each micro-step's loss times the scale goes backward; a step whose summed gradients hold an
// inf or NaN is skipped (no update, AdamW's step count unchanged), the others are unscaled,
// clipped and applied. `run` gets the losses, skips and scales.
inline void TrainWithScaledAdamW(const std::vector<torch::Tensor>& params, const Config& c, int steps,
                                 const std::function<torch::Tensor(int, int)>& loss, TrainRun* run) {
  torch::optim::AdamW adamw(params, ReferenceAdamWOptions(c));
  ReferenceLossScaler scaler(c.fp16);
  for (int s = 0; s < steps; ++s) {
    double step_loss = 0;
    for (int m = 0; m < c.gradient_accumulation_steps; ++m) {
      torch::Tensor l = loss(s, m);
      (l * (scaler.scale / c.gradient_accumulation_steps)).backward();
      step_loss += l.item<double>() / c.gradient_accumulation_steps;
    }
    bool finite = true;
    for (const auto& p : params)
      if (p.grad().defined()) finite = finite && torch::isfinite(p.grad()).all().item<bool>();
    run->scales.push_back(scaler.scale);
    run->skipped.push_back(!finite);
    run->losses.push_back(step_loss);
    if (finite) {
      for (const auto& p : params)
        if (p.grad().defined()) p.grad().mul_(1.0 / scaler.scale);
      if (c.gradient_clipping > 0) torch::nn::utils::clip_grad_norm_(params, c.gradient_clipping);
      adamw.step();
    }
    adamw.zero_grad();
    scaler.Update(!finite);
  }
}

// The GPT's language-model loss on micro-step `m` of step `s` (plain LibTorch).
template <typename Model>
torch::Tensor ReferenceLoss(Model& model, const Config& c, int s, int m) {
  torch::Tensor b = Batch(c, s, m);
  return models::LanguageModelLoss(model->forward(b.narrow(1, 0, c.model.seq_len)),
                                   b.narrow(1, 1, c.model.seq_len));
}

// Plain LibTorch training of the GPT: the reference.
inline TrainRun Reference(const Config& c) {
  auto model = models::BuildGpt(c.model);
  std::vector<torch::Tensor> params = models::UniqueParameters(*model);
  TrainRun run;
  run.losses = TrainPlainLibTorch(params, c, kSteps,
                              [&](int s, int m) { return ReferenceLoss(model, c, s, m); });
  for (auto& p : params) run.params.push_back(p.detach().clone());
  return run;
}

// The reference under loss scaling (TrainWithScaledAdamW), each micro-step's loss through `shape`.
inline TrainRun ScaledReference(const Config& c, int steps, const LossShaper& shape) {
  auto model = models::BuildGpt(c.model);
  std::vector<torch::Tensor> params = models::UniqueParameters(*model);
  TrainRun run;
  TrainWithScaledAdamW(
      params, c, steps, [&](int s, int m) { return shape(ReferenceLoss(model, c, s, m), s, m); },
      &run);
  for (auto& p : params) run.params.push_back(p.detach().clone());
  return run;
}

// The engine's side of TrainPlainLibTorch: Backward of each micro-step's loss (this rank's slice),
// Step after each accumulation. Returns the steps' losses averaged over ranks.
inline std::vector<double> TrainWithEngine(Engine& engine, const Config& c, Communicator* comm,
                                           int steps,
                                           const std::function<torch::Tensor(int, int)>& loss,
                                           std::vector<StepReport>* reports = nullptr) {
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
    if (reports != nullptr && rep.ok()) reports->push_back(*rep);
    losses.push_back(step_loss);
  }
  return losses;
}

// Trains through the engine on `comm` (a single-rank one when null). With several ranks, rank r
// takes micro-batch r of each step's global batch and the reported loss is the mean over ranks.
// `delay_us` > 0 runs it on a DelayingDevice (tests/runtime/delaying_device.h) over the CPU
// device: every stream's work completes up to that many microseconds late, and each chunk's
// reduction on the reduce lane starts up to that late; the block store is then wrapped in a
// PoisoningStore (tests/runtime/poisoning_store.h), so a block used after its release, or a
// copy still reading it then, shows as NaN. `shape`, when set, rewrites each
// micro-step's loss before Backward; `steps` steps are taken.
inline TrainRun ThroughEngine(const Config& c, const EngineOptions& opts_in = {},
                              Communicator* comm_in = nullptr, int delay_us = 0, int steps = kSteps,
                              const LossShaper& shape = nullptr) {
  EngineOptions opts = opts_in;
  std::mt19937 rng(11);
  std::mutex rng_mu;
  if (delay_us > 0 && !(opts.test_hooks && opts.test_hooks->reduce_delay_hook)) {
    MutableHooks(&opts).reduce_delay_hook = [&rng, &rng_mu, delay_us](int64_t) {
      int us;
      {
        std::lock_guard<std::mutex> l(rng_mu);
        us = std::uniform_int_distribution<int>(0, delay_us)(rng);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    };
  }
  if (delay_us > 0 && !(opts.test_hooks && opts.test_hooks->wrap_store)) {
    MutableHooks(&opts).wrap_store = [](std::unique_ptr<BlockStore> inner) -> std::unique_ptr<BlockStore> {
      return std::make_unique<testing::PoisoningStore>(std::move(inner));
    };
  }
  std::unique_ptr<Communicator> own;
  Communicator* comm = comm_in;
  if (!comm) {
    own = CreateSingleCommunicator();
    comm = own.get();
  }
  rng.seed(11 + comm->rank());  // each rank's lane late by its own amounts
  std::unique_ptr<Device> device = CreateDevice(TestDeviceSpec(), 256 << 20).value();
  if (delay_us > 0)
    device = std::make_unique<testing::DelayingDevice>(std::move(device), delay_us, 1 + comm->rank());
  const torch::Device on = TorchDevice(*device);
  auto engine_or = Engine::Create(models::BuildGpt(c.model), c, comm, device.get(), opts);
  EXPECT_TRUE(engine_or.ok()) << engine_or.status();
  if (!engine_or.ok()) return {};
  auto engine = std::move(engine_or).value();
  TrainRun run;
  std::vector<StepReport> reports;
  run.losses = TrainWithEngine(*engine, c, comm, steps, [&](int s, int m) {
    torch::Tensor b = Batch(c, s, m).chunk(comm->world_size(), 0)[comm->rank()].contiguous().to(on);
    torch::Tensor l = models::LanguageModelLoss(engine->Forward(b.narrow(1, 0, c.model.seq_len)),
                                                b.narrow(1, 1, c.model.seq_len));
    return shape ? shape(l, s, m) : l;
  }, &reports);
  for (const StepReport& r : reports) {
    run.skipped.push_back(r.skipped);
    run.scales.push_back(r.loss_scale);
  }
  auto params = engine->GatherMasterParams();
  EXPECT_TRUE(params.ok()) << params.status();
  if (params.ok()) run.params = *params;
  run.placement = engine->Describe()["placement"];
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
