// The most important test: training through the engine gives the same results as plain LibTorch
// training with the same seed, under every placement and stage.
#include <cmath>
#include <cstdlib>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/comm/communicator.h"
#include "runtime/config.h"
#include "runtime/device.h"
#include "runtime/engine.h"
#include "tests/test_util.h"
#include "tests/runtime/gpt_training.h"
#include "tools/train/gpt.h"

namespace strata {
namespace {

struct Case {
  const char* name;
  int stage;
  OffloadDevice param;
  OffloadDevice optim;
  int accumulation;
  double clipping;
  uint64_t host_budget = 0;  // 0: sized by the engine
  // Stage 3 keeps gathered chunks by DeepSpeed's defaults; 'release' drops every chunk as soon
  // as its block is done (threshold and reuse distance 0), exercising gather/release fully.
  bool release = true;
  int64_t max_live = 1000000000;
};

class Equivalence : public ::testing::TestWithParam<Case> {};

TEST_P(Equivalence, MatchesPlainLibTorchInFp32) {
  const Case& k = GetParam();
  Config c = BaseConfig();
  c.zero_optimization.stage = k.stage;
  c.zero_optimization.offload_param.device = k.param;
  c.zero_optimization.offload_optimizer.device = k.optim;
  c.gradient_accumulation_steps = k.accumulation;
  c.gradient_clipping = k.clipping;
  c.strata.host_memory_budget = k.host_budget;
  if (k.release) {
    c.zero_optimization.stage3_param_persistence_threshold = 0;
    c.zero_optimization.stage3_max_reuse_distance = 0;
  }
  c.zero_optimization.stage3_max_live_parameters = k.max_live;
  testing::TempDir dir;
  EngineOptions opts;
  if (k.param == OffloadDevice::kNvme || k.optim == OffloadDevice::kNvme) opts.nvme_path = {dir.path()};
  TrainRun ref = Reference(c);
  TrainRun got = ThroughEngine(c, opts);
  // The loss falls, and both runs agree to float rounding (the SIMD Adam fuses a multiply-add
  // that torch rounds twice).
  ASSERT_LT(ref.losses.back(), ref.losses.front());
  ExpectMatch(ref, got, 1e-5, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Placements, Equivalence,
    ::testing::Values(
        Case{"stage0", 0, OffloadDevice::kNone, OffloadDevice::kNone, 1, 0.0},
        Case{"stage1", 1, OffloadDevice::kNone, OffloadDevice::kNone, 1, 0.0},
        Case{"stage2_accum", 2, OffloadDevice::kNone, OffloadDevice::kNone, 2, 0.0},
        Case{"stage3", 3, OffloadDevice::kNone, OffloadDevice::kNone, 1, 0.0},
        Case{"stage3_clip_keep_live", 3, OffloadDevice::kNone, OffloadDevice::kNone, 1, 0.5, 0,
             false},
        Case{"stage3_max_live", 3, OffloadDevice::kCpu, OffloadDevice::kCpu, 1, 0.0, 0, false,
             12000},
        Case{"cpu_offload", 2, OffloadDevice::kNone, OffloadDevice::kCpu, 1, 1.0},
        Case{"cpu_offload_stage3", 3, OffloadDevice::kCpu, OffloadDevice::kCpu, 2, 0.0},
        Case{"nvme_offload", 3, OffloadDevice::kNvme, OffloadDevice::kNvme, 1, 0.0},
        Case{"nvme_offload_clip_accum", 3, OffloadDevice::kNvme, OffloadDevice::kNvme, 2, 0.5},
        // A host budget of a few blocks: every step evicts to NVMe and reads back.
        Case{"nvme_offload_evicting", 3, OffloadDevice::kNvme, OffloadDevice::kNvme, 1, 1.0,
             256 << 10}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(EquivalenceLowPrecision, Bf16TracksTheFp32LossCurve) {
  Config c = BaseConfig();
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  TrainRun ref = Reference(c);
  c.bf16.enabled = true;
  TrainRun got = ThroughEngine(c);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], 0.02 * ref.losses[i]) << "step " << i;
  EXPECT_LT(got.losses.back(), got.losses.front());
}

TEST(EquivalenceLowPrecision, Fp16OnTheCpuDeviceIsAClearError) {
  Config c = BaseConfig();
  c.zero_optimization.stage = 2;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  c.fp16.enabled = true;
  auto comm = CreateSingleCommunicator();
  auto device = CreateDevice("cpu", 256 << 20).value();
  auto engine = Engine::Create(models::BuildGpt(c.model), c, comm.get(), device.get());
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("use bf16.enabled=true"), std::string::npos);
}

}  // namespace
}  // namespace strata
