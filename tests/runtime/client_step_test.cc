// EngineOptions::client_optimizer: the caller's own optimizer (here LibTorch's RMSprop, which
// Strata has no kernel for) updates the fp32 master shards the engine lends at each boundary, and
// training equals plain LibTorch with that optimizer at stages 0-2, clipping included. The
// protocol's misuse and the configurations it cannot serve are refused by name, and a
// checkpoint's client file comes back as saved or is refused when damaged.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/runtime/gpt_training.h"
#include "tiers/hbm/device_factory.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

constexpr double kClip = 0.5;

torch::optim::RMSpropOptions Rmsprop() {
  // eps 1e-3, not the default 1e-8: RMSprop divides a gradient by its own size, and the
  // attention's key bias has a gradient of zero up to rounding noise (about 1e-7) that depends on
  // the BLAS kernels' summation order (the CPU, the operands' alignment); a tiny eps amplifies
  // that noise into moves of about lr (6.8e-3 apart on a Zen 5 with AVX-512), while at 1e-3 it
  // stays noise and the gradients that carry signal still set the update.
  return torch::optim::RMSpropOptions(1e-2).alpha(0.9).momentum(0.5).weight_decay(0.01).eps(1e-3);
}

Config ClientConfig(int stage) {
  Config c = BaseConfig();
  c.zero_optimization.stage = stage;
  c.gradient_clipping = kClip;
  return c;
}

TrainRun PlainLibTorch(const Config& c) {
  auto model = models::BuildGpt(c.model);
  std::vector<torch::Tensor> params = models::UniqueParameters(*model);
  torch::optim::RMSprop opt(params, Rmsprop());
  TrainRun run;
  for (int s = 0; s < kSteps; ++s) {
    torch::Tensor loss = ReferenceLoss(model, c, s, 0);
    loss.backward();
    torch::nn::utils::clip_grad_norm_(params, kClip);
    opt.step();
    opt.zero_grad();
    run.losses.push_back(loss.item<double>());
  }
  for (auto& p : params) run.params.push_back(p.detach().clone());
  return run;
}

struct ClientEngine {
  std::unique_ptr<Communicator> comm = CreateSingleCommunicator();
  std::unique_ptr<Device> device = CreateDevice("cpu", 256 << 20).value();
  StatusOr<std::unique_ptr<Engine>> engine = FailedPrecondition("not made");

  ClientEngine(const Config& c, bool client) {
    EngineOptions o;
    o.client_optimizer = client;
    engine = Engine::Create(models::BuildGpt(c.model), c, comm.get(), device.get(), o);
  }
  torch::Tensor ForwardBackward(const Config& c, int s) {
    torch::Tensor b = Batch(c, s, 0);
    torch::Tensor loss = models::LanguageModelLoss((*this)->Forward(b.narrow(1, 0, c.model.seq_len)),
                                                   b.narrow(1, 1, c.model.seq_len));
    EXPECT_OK((*this)->Backward(loss));
    return loss;
  }
  Engine* operator->() { return engine->get(); }
};

class ClientStep : public ::testing::TestWithParam<int> {};

TEST_P(ClientStep, LibTorchsRmspropOverTheLentShardsEqualsPlainLibTorch) {
  const Config c = ClientConfig(GetParam());
  ClientEngine e(c, /*client=*/true);
  ASSERT_TRUE(e.engine.ok()) << e.engine.status();
  // The tensors the optimizer steps: the same objects every step (its state is keyed by them),
  // each lent the shard's memory for the length of a step.
  std::vector<torch::Tensor> flat;
  for (const auto& sizes : e->ClientSegments())
    for (size_t i = 0; i < sizes.size(); ++i) flat.push_back(torch::empty({0}).requires_grad_());
  ASSERT_FALSE(flat.empty());
  torch::optim::RMSprop opt(flat, Rmsprop());
  TrainRun got;
  for (int s = 0; s < kSteps; ++s) {
    got.losses.push_back(e.ForwardBackward(c, s).item<double>());
    auto step = e->BeginClientStep();
    ASSERT_TRUE(step.ok()) << step.status();
    ASSERT_FALSE(step->skipped);
    EXPECT_GT(step->grad_norm, 0.0);
    EXPECT_LE(step->grad_scale, 1.0f);  // clipped (the norm is well above 0.5 here)
    size_t k = 0;
    for (const auto& group : step->groups) {
      for (const auto& [master, grad] : group) {
        flat[k].set_data(master);
        flat[k].mutable_grad() = grad;
        ++k;
      }
    }
    ASSERT_EQ(k, flat.size());
    opt.step();
    for (auto& t : flat) {
      t.mutable_grad() = torch::Tensor();
      t.set_data(torch::empty({0}));
    }
    auto report = e->FinishClientStep();
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_EQ(report->step, s + 1);
    EXPECT_DOUBLE_EQ(report->grad_norm, step->grad_norm);
  }
  auto params = e->GatherMasterParams();
  ASSERT_TRUE(params.ok()) << params.status();
  got.params = *params;
  // The suites' tolerances: the clip factor comes from a norm summed in another order.
  ExpectMatch(PlainLibTorch(c), got, 1e-5, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Stages, ClientStep, ::testing::Values(0, 1, 2));

TEST(ClientStepProtocol, MisuseIsRefusedByName) {
  const Config c = ClientConfig(2);
  ClientEngine e(c, /*client=*/true);
  ASSERT_TRUE(e.engine.ok()) << e.engine.status();
  auto early = e->FinishClientStep();
  EXPECT_EQ(early.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(early.status().message().find("without BeginClientStep"), std::string::npos);
  e.ForwardBackward(c, 0);
  auto own = e->Step();
  EXPECT_EQ(own.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(own.status().message().find("BeginClientStep"), std::string::npos) << own.status();
  ASSERT_TRUE(e->BeginClientStep().ok());
  auto twice = e->BeginClientStep();
  EXPECT_NE(twice.status().message().find("twice"), std::string::npos) << twice.status();
  // A failed update: the blocks go back, the step does not count.
  ASSERT_TRUE(e->FinishClientStep(/*apply=*/false).ok());
  EXPECT_EQ(e->global_step(), 0);

  ClientEngine own_optimizer(c, /*client=*/false);
  ASSERT_TRUE(own_optimizer.engine.ok());
  own_optimizer.ForwardBackward(c, 0);
  auto not_client = own_optimizer->BeginClientStep();
  EXPECT_NE(not_client.status().message().find("runs its own optimizer"), std::string::npos);
}

TEST(ClientStepProtocol, WhereThePartitionIsNotInDeviceMemoryItIsRefused) {
  Config stage3 = ClientConfig(3);
  ClientEngine a(stage3, /*client=*/true);
  ASSERT_FALSE(a.engine.ok());
  EXPECT_NE(a.engine.status().message().find("stage 0-2 (this config: 3)"), std::string::npos)
      << a.engine.status();
  Config offloaded = ClientConfig(2);
  offloaded.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  ClientEngine b(offloaded, /*client=*/true);
  ASSERT_FALSE(b.engine.ok());
  EXPECT_NE(b.engine.status().message().find("offload_optimizer.device none"), std::string::npos)
      << b.engine.status();
}

TEST(ClientStepProtocol, TheClientFileComesBackOrIsRefused) {
  const Config c = ClientConfig(1);
  ClientEngine e(c, /*client=*/true);
  ASSERT_TRUE(e.engine.ok()) << e.engine.status();
  const fs::path root = fs::temp_directory_path() /
                        ("strata-client-file-" + std::to_string(::getpid()));
  fs::remove_all(root);
  const std::string bytes = std::string("client optimizer state\0with a zero", 34);
  ASSERT_OK(e->SaveCheckpoint((root / "with").string(), nlohmann::json::object(), bytes));
  auto back = e->ReadClientFile((root / "with").string());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, bytes);
  ASSERT_OK(e->SaveCheckpoint((root / "without").string(), nlohmann::json::object()));
  EXPECT_EQ(e->ReadClientFile((root / "without").string()).status().code(), StatusCode::kNotFound);
  // One byte changed: refused against the manifest's crc32c.
  fs::path file;
  for (const auto& entry : fs::recursive_directory_iterator(root / "with"))
    if (entry.path().filename() == "rank-00000.client.bin") file = entry.path();
  ASSERT_FALSE(file.empty());
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(3);
    f.put('X');
  }
  auto damaged = e->ReadClientFile((root / "with").string());
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss) << damaged.status();
  fs::remove_all(root);
}

}  // namespace
}  // namespace strata
