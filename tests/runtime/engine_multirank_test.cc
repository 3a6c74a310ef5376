// Equivalence with several ranks: run under strata-launch, each rank trains on its slice of every
// global batch through Gloo, and the result must match plain LibTorch training on the whole
// batch in one process.
#include <gtest/gtest.h>

#include "runtime/comm/backends.h"
#include "tests/runtime/gpt_training.h"
#include "tests/runtime/model_zoo.h"

namespace strata {
namespace {

struct RankCase {
  const char* name;
  int stage;
  OffloadDevice param;
  OffloadDevice optim;
  double clipping;
};

// One process group for the whole binary: the rendezvous store lives on a fixed port, and ranks
// must not race to re-create it between tests.
Communicator* SharedComm() {
  static std::unique_ptr<Communicator> comm = [] {
    CommOptions co;
    co.timeout_s = 60;
    auto c = CreateCommunicator(co);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(c).value() : nullptr;
  }();
  return comm.get();
}

class MultiRank : public ::testing::TestWithParam<RankCase> {};

TEST_P(MultiRank, MatchesSingleProcessLibTorch) {
  const RankCase& k = GetParam();
  Communicator* comm = SharedComm();
  ASSERT_NE(comm, nullptr);
  ASSERT_GE(comm->world_size(), 2) << "this test needs 2 ranks: run it as strata-launch --nproc 2 -- "
                                       "engine_multirank_test (ctest's engine_multirank_2ranks)";
  Config c = BaseConfig();
  c.train_micro_batch_size_per_gpu = 8;  // the global batch; each rank takes its slice
  c.zero_optimization.stage = k.stage;
  c.zero_optimization.offload_param.device = k.param;
  c.zero_optimization.offload_optimizer.device = k.optim;
  c.gradient_clipping = k.clipping;
  testing::TempDir dir;
  EngineOptions opts;
  if (k.param == OffloadDevice::kNvme || k.optim == OffloadDevice::kNvme) opts.nvme_path = {dir.path()};
  TrainRun ref = Reference(c);
  Config per_rank = c;
  TrainRun got = ThroughEngine(per_rank, opts, comm);
  ExpectMatch(ref, got, 1e-5, 2e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Gloo, MultiRank,
    ::testing::Values(RankCase{"stage0", 0, OffloadDevice::kNone, OffloadDevice::kNone, 0.0},
                      RankCase{"stage1", 1, OffloadDevice::kNone, OffloadDevice::kNone, 0.0},
                      RankCase{"stage2_cpu", 2, OffloadDevice::kNone, OffloadDevice::kCpu, 1.0},
                      RankCase{"stage3", 3, OffloadDevice::kNone, OffloadDevice::kNone, 0.0},
                      RankCase{"stage3_nvme_clip", 3, OffloadDevice::kNvme, OffloadDevice::kNvme, 0.5}),
    [](const auto& info) { return std::string(info.param.name); });

// Models of the zoo (stock layers, residual across units, two-in/two-out units) on 2 ranks: each
// rank takes half of every global batch. (The BatchNorm net is single-process only: its batch
// statistics depend on the rows a rank sees.)
class ZooMultiRank : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(ZooMultiRank, MatchesSingleProcessLibTorch) {
  const zoo::Model model = zoo::Models()[std::get<0>(GetParam())];
  ASSERT_FALSE(model.batch_statistics);
  Communicator* comm = SharedComm();
  ASSERT_NE(comm, nullptr);
  ASSERT_GE(comm->world_size(), 2);
  Config c = zoo::ZooConfig();
  const int stage = std::get<1>(GetParam());
  c.zero_optimization.stage = stage;
  c.zero_optimization.stage3_param_persistence_threshold = 0;
  c.zero_optimization.stage3_max_reuse_distance = 0;
  if (stage == 3) {
    c.zero_optimization.offload_param.device = OffloadDevice::kCpu;
    c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
    c.gradient_clipping = 0.5;
  }
  zoo::Run ref = zoo::Reference(model, c);
  zoo::Run got = zoo::ThroughEngine(model, c, comm);
  zoo::ExpectMatch(ref, got, 1e-5, 2e-5);
}

// Buffers start from rank 0's values: rank 1 disturbs its BatchNorm statistics before the engine
// takes the model, and afterwards every rank holds rank 0's.
TEST(ZooMultiRankBuffers, BroadcastFromRankZeroAtStart) {
  Communicator* comm = SharedComm();
  ASSERT_NE(comm, nullptr);
  ASSERT_GE(comm->world_size(), 2);
  const zoo::Model model = zoo::Models()[1];
  ASSERT_TRUE(model.batch_statistics);
  auto m = model.build();
  if (comm->rank() == 1) {
    torch::NoGradGuard ng;
    for (auto& b : m->buffers(true)) b.add_(7);
  }
  Config c = zoo::ZooConfig();
  c.zero_optimization.stage = 3;
  auto device = CreateDevice("cpu", 64 << 20).value();
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(m, c, comm, device.get()));
  // Rank 0's values are those of a freshly built model (same seed).
  const std::vector<torch::Tensor> fresh = zoo::Buffers(*model.build());
  const std::vector<torch::Tensor> now = zoo::Buffers(*m);
  ASSERT_EQ(now.size(), fresh.size());
  for (size_t i = 0; i < now.size(); ++i)
    EXPECT_TRUE(torch::equal(now[i], fresh[i])) << "rank " << comm->rank() << " buffer " << i;
}

INSTANTIATE_TEST_SUITE_P(StockLayers, ZooMultiRank,
                         ::testing::Combine(::testing::Values(0, 2), ::testing::Values(1, 3)),
                         [](const auto& info) {
                           return zoo::Models()[std::get<0>(info.param)].name + "_stage" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace strata
