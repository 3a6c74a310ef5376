// Equivalence with several ranks: run under strata-launch, each rank trains on its slice of every
// global batch through Gloo (or, with STRATA_TEST_DEVICE=cuda, on GPU LOCAL_RANK through NCCL),
// and the result must match plain LibTorch training on the whole batch in one process.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string_view>

#include <gtest/gtest.h>

#include "runtime/comm/backends.h"
#include "runtime/engine/zero_init.h"
#include "runtime/state/checkpoint.h"
#include "tests/runtime/gpt_training.h"
#include "tests/runtime/model_zoo.h"
#include "tiers/hbm/device_factory.h"
#include "tools/planner/memory_model.h"
#include "tools/planner/model_spec.h"

namespace strata {
namespace {

struct RankCase {
  const char* name;
  int stage;
  OffloadDevice param;
  OffloadDevice optim;
  double clipping;
  int accumulation = 1;
  // > 0: every stream's work and every reduce-lane job (reductions, all-gathers issued ahead)
  // up to this many microseconds late, at random on each rank (tests/runtime/gpt_training.h).
  int delay_us = 0;
  // Stage 3 drops every chunk once its unit is done (persistence threshold and reuse distance
  // 0), so each unit is gathered, and the next one gathered ahead, every time it runs.
  bool release = false;
  // Split placements (runtime/state/placement_plan.h): offload_optimizer.ratio, or
  // strata.placement auto under a 320 KiB device budget and host pool (small chunks), which
  // spreads each rank's shards over device, host and NVMe.
  double ratio = 1.0;
  bool auto_placement = false;
  // The model built under zero::Init as strata-train builds it: rank 0 stages its values, the
  // other ranks build shapes only (zero::StageMode::kShapesOnly) and take rank 0's values from
  // Engine::Create's broadcast.
  bool zero_init = false;
};

RankCase UnderZeroInit(RankCase k) {
  k.zero_init = true;
  return k;
}

RankCase Split(RankCase k, double ratio, bool auto_placement) {
  k.ratio = ratio;
  k.auto_placement = auto_placement;
  return k;
}

// One process group for the whole binary: the rendezvous store lives on a fixed port, and ranks
// must not race to re-create it between tests.
Communicator* SharedComm() {
  static std::unique_ptr<Communicator> comm = [] {
    CommOptions co;
    co.timeout_s = 60;
    co.device = TestDeviceSpec() == "cpu" ? "cpu" : "cuda";  // "auto" then picks NCCL for cuda
    auto c = CreateCommunicator(co);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(c).value() : nullptr;
  }();
  return comm.get();
}

class MultiRank : public ::testing::TestWithParam<RankCase> {};

// A GPU run needs a GPU per rank; with fewer it says so, and ctest reports the test as skipped
// (SKIP_REGULAR_EXPRESSION on engine_multirank_nccl), never as passed.
bool EnoughGpus() {
  if (TestDeviceSpec() == "cpu") return true;
  auto env = ReadDistEnv();
  const int ranks = env.ok() ? env->local_world_size : 1;
  if (CudaDeviceCount() >= ranks) return true;
  std::printf("this run needs %d GPUs (one per rank); %d visible\n", ranks, CudaDeviceCount());
  return false;
}

TEST_P(MultiRank, MatchesSingleProcessLibTorch) {
  if (!EnoughGpus()) GTEST_SKIP();
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
  c.gradient_accumulation_steps = k.accumulation;
  if (k.release) {
    c.zero_optimization.stage3_param_persistence_threshold = 0;
    c.zero_optimization.stage3_max_reuse_distance = 0;
  }
  c.zero_optimization.offload_optimizer.ratio = k.ratio;
  if (k.auto_placement) {
    c.strata.placement = PlacementMode::kAuto;
    c.strata.device_memory_budget = c.strata.host_memory_budget = 320 << 10;
    c.strata.chunk_size = 4 << 10;
  }
  testing::TempDir dir;
  EngineOptions opts;
  if (k.param == OffloadDevice::kNvme || k.optim == OffloadDevice::kNvme) opts.nvme_path = {dir.path()};
  TrainRun ref = Reference(c);
  Config per_rank = c;
  testing::TempDir staging;
  std::unique_ptr<zero::Init> init;
  if (k.zero_init) {
    auto created = zero::Init::Create(staging.path(), torch::kFloat32,
                                      comm->rank() == 0 ? zero::StageMode::kValues
                                                        : zero::StageMode::kShapesOnly);
    ASSERT_TRUE(created.ok()) << created.status();
    init = std::move(created).value();
  }
  TrainRun got = ThroughEngine(per_rank, opts, comm, k.delay_us);  // builds under `init`
  if (init) {
    EXPECT_GT(init->staged_params(), 0);
    if (comm->rank() == 0) {
      EXPECT_GT(init->staged_bytes(), 0u);
    } else {
      EXPECT_EQ(init->staged_bytes(), 0u) << "rank " << comm->rank() << " staged values";
    }
  }
  const double f = TestDeviceSpec() == "cpu" ? 1.0 : kGpuToleranceFactor;
  ExpectMatch(ref, got, 1e-5 * f, 2e-5 * f);
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, MultiRank,
    ::testing::Values(RankCase{"stage0", 0, OffloadDevice::kNone, OffloadDevice::kNone, 0.0},
                      RankCase{"stage1", 1, OffloadDevice::kNone, OffloadDevice::kNone, 0.0},
                      RankCase{"stage2_cpu", 2, OffloadDevice::kNone, OffloadDevice::kCpu, 1.0},
                      RankCase{"stage3", 3, OffloadDevice::kNone, OffloadDevice::kNone, 0.0},
                      RankCase{"stage3_nvme_clip", 3, OffloadDevice::kNvme, OffloadDevice::kNvme, 0.5},
                      UnderZeroInit(RankCase{"stage3_nvme_zero_init", 3, OffloadDevice::kNvme,
                                             OffloadDevice::kNvme, 0.5}),
                      // The reduce lane's collectives (reduce-scatters, all-gathers issued
                      // ahead) late by different amounts on each rank: they must still pair up.
                      RankCase{"stage3_accum_delays", 3, OffloadDevice::kNone, OffloadDevice::kNone,
                               0.0, 2, 2000, true},
                      RankCase{"stage3_cpu_clip_delays", 3, OffloadDevice::kCpu, OffloadDevice::kCpu,
                               1.0, 1, 2000, true},
                      // Half of each rank's optimizer states update on the device, half on the
                      // host; then every tier at once, with accumulation and clipping.
                      Split(RankCase{"stage2_cpu_ratio", 2, OffloadDevice::kNone, OffloadDevice::kCpu, 1.0},
                            0.5, false),
                      Split(RankCase{"stage3_auto_three_tiers", 3, OffloadDevice::kNvme, OffloadDevice::kNvme,
                                     0.5, 2},
                            1.0, true)),
    [](const auto& info) { return std::string(info.param.name); });

// fp16's overflow with one rank's gradients only: the step is skipped on every rank, and the
// scale follows the same schedule everywhere. Rank 0's first micro-batch of steps 1 and 3 is
// poisoned (its loss times 1e38); the reference poisons the whole batch of those steps. The loss
// scaling runs in fp32 on the CPU (EngineOptions::loss_scaling), real fp16 on CUDA.
TEST(MultiRankOverflow, OneRankOverflowingSkipsTheStepEverywhere) {
  if (!EnoughGpus()) GTEST_SKIP();
  Communicator* comm = SharedComm();
  ASSERT_NE(comm, nullptr);
  ASSERT_GE(comm->world_size(), 2);
  Config c = BaseConfig();
  c.train_micro_batch_size_per_gpu = 8;
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_param.device = OffloadDevice::kCpu;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  c.gradient_clipping = 1.0;
  c.fp16.initial_scale_power = 8;
  c.fp16.hysteresis = 1;
  c.fp16.loss_scale_window = 100;
  constexpr int kOverflowSteps = 5;
  auto poisoned = [](int s, int m) { return m == 0 && (s == 1 || s == 3); };
  TrainRun ref = ScaledReference(c, kOverflowSteps, [&](torch::Tensor l, int s, int m) {
    return poisoned(s, m) ? l * 1e38 : l;
  });
  ASSERT_EQ(ref.skipped, (std::vector<bool>{false, true, false, true, false}));
  EngineOptions opts;
  const bool fp16 = TestDeviceSpec() != "cpu";
  if (fp16) c.fp16.enabled = true;
  else MutableHooks(&opts).loss_scaling = true;
  const int rank = comm->rank();
  TrainRun got = ThroughEngine(c, opts, comm, 0, kOverflowSteps, [&](torch::Tensor l, int s, int m) {
    return rank == 0 && poisoned(s, m) ? l * 1e38 : l;
  });
  EXPECT_EQ(got.skipped, ref.skipped);
  EXPECT_EQ(got.scales, ref.scales);
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    if (ref.skipped[i]) continue;  // a poisoned loss is inf
    EXPECT_NEAR(got.losses[i], ref.losses[i], (fp16 ? 0.02 : 1e-5) * ref.losses[i]) << "step " << i;
  }
  if (fp16) return;
  ASSERT_EQ(got.params.size(), ref.params.size());
  for (size_t i = 0; i < ref.params.size(); ++i)
    EXPECT_LT((ref.params[i] - got.params[i]).abs().max().item<double>(), 2e-5) << "parameter " << i;
}

// A save that one rank cannot finish ends on every rank with an error (rank 1's own, and on
// rank 0 one naming rank 1), where rank 0 once waited for good at the publication's barrier;
// nothing is published, and the next save works.
TEST(MultiRankSave, ARankThatCannotWriteEndsTheSaveOnEveryRank) {
  if (!EnoughGpus()) GTEST_SKIP();
  Communicator* comm = SharedComm();
  ASSERT_NE(comm, nullptr);
  ASSERT_GE(comm->world_size(), 2);
  namespace fs = std::filesystem;
  // Both ranks are children of one strata-launch, so its pid names a folder they share.
  const std::string root =
      StrCat(fs::temp_directory_path().string(), "/strata-multirank-save-", getppid());
  if (comm->rank() == 0) {
    fs::remove_all(root);
    fs::create_directories(root);
  }
  ASSERT_OK(comm->Barrier());
  bool break_write = false;
  EngineOptions opts;
  MutableHooks(&opts).crash_point = [&](std::string_view point) {
    // A folder where rank 1's state file goes: its open fails with EISDIR.
    if (break_write && comm->rank() == 1 && point == "checkpoint:before_write")
      fs::create_directories(root + "/.step-00000001.tmp/rank-00001.bin");
  };
  Config c = BaseConfig();
  c.zero_optimization.stage = 2;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  auto device = CreateDevice(TestDeviceSpec(), 256 << 20).value();
  ASSERT_OK_AND_ASSIGN(auto engine,
                       Engine::Create(models::BuildGpt(c.model), c, comm, device.get(), opts));
  torch::Tensor b = Batch(c, 0, comm->rank()).to(TorchDevice(*device));
  ASSERT_OK(engine->Backward(models::LanguageModelLoss(
      engine->Forward(b.narrow(1, 0, c.model.seq_len)), b.narrow(1, 1, c.model.seq_len))));
  ASSERT_OK(engine->Step().status());

  break_write = true;
  Status refused = engine->SaveCheckpoint(root, {});
  break_write = false;
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.ToString().find(comm->rank() == 1 ? "rank-00001.bin" : "rank 1 could not"),
            std::string::npos)
      << refused;
  ASSERT_OK(comm->Barrier());
  EXPECT_FALSE(fs::exists(root + "/step-00000001"));
  EXPECT_FALSE(fs::exists(root + "/.step-00000001.tmp")) << "rank 0 removes what was written";
  EXPECT_FALSE(fs::exists(root + "/latest"));
  // Both ranks have looked before rank 0's next save makes the folder afresh.
  ASSERT_OK(comm->Barrier());

  // A root that differs by rank: refused on both, before anything is written in either.
  const std::string own_root = StrCat(root, "/by-rank-", comm->rank());
  refused = engine->SaveCheckpoint(own_root, {});
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("the ranks name different save folders"), std::string::npos)
      << refused;
  // Rank 1 alone refuses its root (it names one checkpoint, not a folder of them); rank 0 hears
  // of it in the same agreement instead of waiting for rank 1 until the communicator's timeout.
  const std::string one_checkpoint = root + "/one-checkpoint";
  if (comm->rank() == 0) {
    fs::create_directories(one_checkpoint);
    std::ofstream(one_checkpoint + "/rank-00000.json") << "{}";
  }
  ASSERT_OK(comm->Barrier());
  const auto before = std::chrono::steady_clock::now();
  refused = engine->SaveCheckpoint(comm->rank() == 1 ? one_checkpoint : root, {});
  EXPECT_LT(std::chrono::steady_clock::now() - before, std::chrono::seconds(20));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find(comm->rank() == 1 ? "not a folder of them" : "rank 1 refused"),
            std::string::npos)
      << refused;
  ASSERT_OK(comm->Barrier());
  for (const char* r : {"/by-rank-0", "/by-rank-1"})
    EXPECT_FALSE(fs::exists(StrCat(root, r, "/step-00000001"))) << r;
  EXPECT_FALSE(fs::exists(root + "/.step-00000001.tmp")) << "nothing prepared stays";
  EXPECT_FALSE(fs::exists(root + "/latest"));
  ASSERT_OK(comm->Barrier());

  ASSERT_OK(engine->SaveCheckpoint(root, {}));
  ASSERT_OK_AND_ASSIGN(std::string saved, checkpoint::ResolveCheckpointDir(root));
  EXPECT_TRUE(fs::exists(fs::path(saved) / "rank-00001.json"));
  ASSERT_OK(comm->Barrier());
  if (comm->rank() == 0) fs::remove_all(root);
}

// Per-rank memory of each stage on 2 ranks, from the engine's measured device allocations
// (StepReport.peak_device_bytes: every allocation of the rank's device): each stage must save
// what ZeRO says it saves - stage 1 the optimizer states, stage 2 the accumulated gradients,
// stage 3 the parameters - and land within 10 % of strata-estimate's figure for 2 ranks, which
// is derived from the partitioner's per-stage plan.
TEST(MultiRankMemory, PerRankDeviceBytesFollowTheStage) {
  Communicator* comm = SharedComm();
  ASSERT_NE(comm, nullptr);
  ASSERT_GE(comm->world_size(), 2);
  uint64_t peak[4] = {};
  for (int stage = 0; stage <= 3; ++stage) {
    Config c = BaseConfig();
    c.model.d_model = 64;
    c.model.n_layers = 4;
    c.gradient_accumulation_steps = 2;  // stage 1 keeps the whole gradient between micro-steps
    c.zero_optimization.stage = stage;
    c.zero_optimization.stage3_param_persistence_threshold = 0;
    c.zero_optimization.stage3_max_reuse_distance = 0;
    // No gathering ahead: with two small layers the next unit's chunks would outweigh what
    // sharding the parameters saves, and this compares what each stage shards.
    c.zero_optimization.stage3_prefetch_bucket_size = 0;
    auto device = CreateDevice("cpu", 256 << 20).value();
    ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(models::BuildGpt(c.model), c, comm, device.get()));
    torch::manual_seed(5 + comm->rank());
    for (int s = 0; s < 2; ++s) {
      for (int m = 0; m < 2; ++m) {
        torch::Tensor t = torch::randint(0, c.model.vocab_size,
                                         {c.train_micro_batch_size_per_gpu, c.model.seq_len + 1}, torch::kLong);
        torch::Tensor logits = engine->Forward(t.narrow(1, 0, c.model.seq_len));
        ASSERT_OK(engine->Backward(models::LanguageModelLoss(logits, t.narrow(1, 1, c.model.seq_len))));
      }
      ASSERT_OK_AND_ASSIGN(StepReport rep, engine->Step());
      peak[stage] = std::max(peak[stage], rep.peak_device_bytes);
    }
    ASSERT_OK_AND_ASSIGN(planner::ModelSpec spec, planner::GptModelSpec(c.model));
    planner::EstimateOptions eo;
    eo.world_size = comm->world_size();
    ASSERT_OK_AND_ASSIGN(planner::MemoryEstimate e, planner::EstimateMemory(c, spec, eo));
    // The estimate bounds the peak from both sides: the reduce lane keeping up with compute or
    // lagging one chunk (Note [device replay] in tools/planner/memory_model.cc).
    if (comm->rank() == 0)
      std::printf("stage %d, 2 ranks: device peak per rank %llu B measured, %llu-%llu B estimated\n", stage,
                  static_cast<unsigned long long>(peak[stage]),
                  static_cast<unsigned long long>(e.engine_device_peak_min_bytes),
                  static_cast<unsigned long long>(e.engine_device_peak_bytes));
    EXPECT_GE(static_cast<double>(peak[stage]), 0.9 * static_cast<double>(e.engine_device_peak_min_bytes))
        << "stage " << stage << " on rank " << comm->rank();
    EXPECT_LE(static_cast<double>(peak[stage]), 1.1 * static_cast<double>(e.engine_device_peak_bytes))
        << "stage " << stage << " on rank " << comm->rank();
  }
  EXPECT_GT(peak[0], peak[1]) << "stage 1 shards the optimizer states";
  EXPECT_GT(peak[1], peak[2]) << "stage 2 shards the accumulated gradients";
  EXPECT_GT(peak[2], peak[3]) << "stage 3 shards the parameters";
}

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
                         ::testing::Combine(::testing::Values(0, 2, 3, 4), ::testing::Values(1, 3)),
                         [](const auto& info) {
                           return zoo::Models()[std::get<0>(info.param)].name + "_stage" +
                                  std::to_string(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace strata
