// Bring-your-own-model equivalence: models built only from stock LibTorch layers (a residual
// across units, BatchNorm buffers, units with two inputs and two outputs; the GPT with a tied
// head is engine_equivalence_test's) train through the engine exactly as with plain LibTorch
// AdamW, under every stage and placement. And stage 3 really frees a unit's gathered parameters
// after its forward, with stock Linear layers, measured by the device allocator.
#include <cmath>

#include <gtest/gtest.h>

#include "tests/runtime/model_zoo.h"

namespace strata {
namespace {

struct Placement3 {
  const char* name;
  int stage;
  OffloadDevice param;
  OffloadDevice optim;
  int accumulation = 1;
  double clipping = 0;
  bool release = true;  // drop every chunk after its unit (threshold and reuse distance 0)
};

const Placement3 kPlacements[] = {
    {"stage0", 0, OffloadDevice::kNone, OffloadDevice::kNone},
    {"stage1", 1, OffloadDevice::kNone, OffloadDevice::kNone},
    {"stage2_cpu_clip", 2, OffloadDevice::kNone, OffloadDevice::kCpu, 1, 1.0},
    {"stage3", 3, OffloadDevice::kNone, OffloadDevice::kNone},
    {"stage3_cpu_keep_live", 3, OffloadDevice::kCpu, OffloadDevice::kCpu, 1, 0.0, false},
    {"stage3_nvme_clip_accum", 3, OffloadDevice::kNvme, OffloadDevice::kNvme, 2, 0.5},
};

class Zoo : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(Zoo, MatchesPlainLibTorchAdamW) {
  const zoo::Model model = zoo::Models()[std::get<0>(GetParam())];
  const Placement3& k = kPlacements[std::get<1>(GetParam())];
  Config c = zoo::ZooConfig();
  c.zero_optimization.stage = k.stage;
  c.zero_optimization.offload_param.device = k.param;
  c.zero_optimization.offload_optimizer.device = k.optim;
  c.gradient_accumulation_steps = k.accumulation;
  c.gradient_clipping = k.clipping;
  if (k.release) {
    c.zero_optimization.stage3_param_persistence_threshold = 0;
    c.zero_optimization.stage3_max_reuse_distance = 0;
  }
  testing::TempDir dir;
  EngineOptions opts;
  if (k.param == OffloadDevice::kNvme || k.optim == OffloadDevice::kNvme) opts.nvme_path = {dir.path()};
  zoo::Run ref = zoo::Reference(model, c);
  auto comm = CreateSingleCommunicator();
  zoo::Run got = zoo::ThroughEngine(model, c, comm.get(), opts);
  ASSERT_LT(ref.losses.back(), ref.losses.front()) << "the reference does not learn";
  zoo::ExpectMatch(ref, got, 1e-5, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    StockLayers, Zoo,
    ::testing::Combine(::testing::Range(0, 3), ::testing::Range(0, 6)),
    [](const auto& info) {
      return zoo::Models()[std::get<0>(info.param)].name + "_" +
             kPlacements[std::get<1>(info.param)].name;
    });

// Stage 3 with stock Linear layers: inside a unit the device holds at least its parameters;
// after it the device allocator is back exactly where it was before the forward, although
// autograd saved the Linear weights' transposed views for backward (their storage is empty until
// backward gathers the unit again). The training result is the reference's.
TEST(ZooMemory, Stage3ReleasesEachUnitAfterItsForward) {
  Config c = zoo::ZooConfig();
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_param.device = OffloadDevice::kCpu;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero_optimization.stage3_param_persistence_threshold = 0;
  c.zero_optimization.stage3_max_reuse_distance = 0;
  torch::manual_seed(7);
  zoo::ResMlp net;
  auto comm = CreateSingleCommunicator();
  auto device = CreateDevice("cpu", 64 << 20).value();
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(net.ptr(), c, comm.get(), device.get()));
  const uint64_t unit_bytes[] = {(12 * 16 + 16) * 4, (16 * 2 + 16 * 48 + 48 + 48 * 16 + 16) * 4};
  for (int step = 0; step < 2; ++step) {
    const uint64_t before = engine->device_bytes_in_use();
    std::vector<uint64_t> inside, after;
    net->inside_unit = [&](int) { inside.push_back(engine->device_bytes_in_use()); };
    net->after_unit = [&](int) { after.push_back(engine->device_bytes_in_use()); };
    torch::Tensor x = torch::randn({8, 12});
    torch::Tensor loss = net->forward(x).pow(2).mean();
    ASSERT_EQ(inside.size(), 4u);
    for (size_t u = 0; u < inside.size(); ++u) {
      EXPECT_GE(inside[u], before + unit_bytes[u == 0 ? 0 : 1]) << "unit " << u << " step " << step;
      EXPECT_EQ(after[u], before) << "unit " << u << " still holds "
                                  << (after[u] - before) << " B after its forward (step " << step << ")";
    }
    net->inside_unit = nullptr;
    net->after_unit = nullptr;
    ASSERT_OK(engine->Backward(loss));
    ASSERT_TRUE(engine->Step().ok());
    EXPECT_EQ(engine->device_bytes_in_use(), before) << "step " << step;
  }
}

// Outside its RunUnit a stage-3 parameter has an empty storage (no stale copy to read by
// mistake); inside it the storage holds the gathered values.
TEST(ZooMemory, ParameterStorageIsEmptyOutsideItsUnit) {
  Config c = zoo::ZooConfig();
  c.zero_optimization.stage = 3;
  c.zero_optimization.stage3_param_persistence_threshold = 0;
  c.zero_optimization.stage3_max_reuse_distance = 0;
  torch::manual_seed(7);
  zoo::ResMlp net;
  auto comm = CreateSingleCommunicator();
  auto device = CreateDevice("cpu", 64 << 20).value();
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(net.ptr(), c, comm.get(), device.get()));
  EXPECT_EQ(net->out->weight.storage().nbytes(), 0u);
  EXPECT_THROW(net->out->weight.data_ptr<float>(), c10::Error);
  size_t inside = 0;
  float first = 0;
  strata::RunUnit(*net->out, [&] {
    inside = net->out->weight.storage().nbytes();
    first = net->out->weight.data_ptr<float>()[0];
    return torch::Tensor();
  });
  EXPECT_GE(inside, static_cast<size_t>(16 * 4 * 4));
  EXPECT_TRUE(std::isfinite(first));
  EXPECT_NE(first, 0.0f);  // Linear's default init: nonzero weights
  EXPECT_EQ(net->out->weight.storage().nbytes(), 0u);
  EXPECT_EQ(engine->num_units(), 6);
  EXPECT_EQ(engine->unit_name(1), "blocks.0");
}

// Calling loss.backward() instead of Engine::Backward is a clear error naming the fix.
TEST(ZooMemory, PlainBackwardIsRefusedWithTheFix) {
  Config c = zoo::ZooConfig();
  c.zero_optimization.stage = 3;
  torch::manual_seed(7);
  zoo::ResMlp net;
  auto comm = CreateSingleCommunicator();
  auto device = CreateDevice("cpu", 64 << 20).value();
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(net.ptr(), c, comm.get(), device.get()));
  torch::Tensor loss = net->forward(torch::randn({8, 12})).pow(2).mean();
  try {
    loss.backward();
    FAIL() << "loss.backward() went through";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("engine->Backward(loss)"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace strata
