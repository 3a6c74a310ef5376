// Bring-your-own-model equivalence: models built only from stock LibTorch layers (a residual
// across units, BatchNorm buffers, units with two inputs and two outputs; the GPT with a tied
// head is engine_equivalence_test's) train through the engine exactly as with plain LibTorch
// AdamW, under every stage and placement. And stage 3 really frees a unit's gathered parameters
// after its forward, with stock Linear layers, measured by the device allocator.
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <map>

#include <gtest/gtest.h>

#include "tests/runtime/model_zoo.h"
#include "tiers/hbm/device_factory.h"

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

// Stages 0-3 x offload none/cpu/nvme (parameters are offloaded with the optimizer under stage 3
// only: DeepSpeed ignores offload_param below it), with clipping, accumulation and the stage-3
// live set exercised along the way.
const Placement3 kPlacements[] = {
    {"stage0", 0, OffloadDevice::kNone, OffloadDevice::kNone},
    {"stage1", 1, OffloadDevice::kNone, OffloadDevice::kNone},
    {"stage1_cpu", 1, OffloadDevice::kNone, OffloadDevice::kCpu, 2},
    {"stage1_nvme_clip", 1, OffloadDevice::kNone, OffloadDevice::kNvme, 1, 1.0},
    {"stage2", 2, OffloadDevice::kNone, OffloadDevice::kNone, 2},
    {"stage2_cpu_clip", 2, OffloadDevice::kNone, OffloadDevice::kCpu, 1, 1.0},
    {"stage2_nvme", 2, OffloadDevice::kNone, OffloadDevice::kNvme},
    {"stage3", 3, OffloadDevice::kNone, OffloadDevice::kNone},
    {"stage3_cpu_keep_live", 3, OffloadDevice::kCpu, OffloadDevice::kCpu, 1, 0.0, false},
    {"stage3_nvme_clip_accum", 3, OffloadDevice::kNvme, OffloadDevice::kNvme, 2, 0.5},
};
constexpr int kNumPlacements = sizeof(kPlacements) / sizeof(kPlacements[0]);

class Zoo : public ::testing::TestWithParam<std::tuple<int, int>> {};

// Stage 3 that drops every chunk as soon as its unit is done, optionally with offload to cpu.
Config ReleasingStage3(bool offload) {
  Config c = zoo::ZooConfig();
  c.zero_optimization.stage = 3;
  if (offload) {
    c.zero_optimization.offload_param.device = OffloadDevice::kCpu;
    c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  }
  c.zero_optimization.stage3_param_persistence_threshold = 0;
  c.zero_optimization.stage3_max_reuse_distance = 0;
  return c;
}

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
    ::testing::Combine(::testing::Range(0, static_cast<int>(zoo::Models().size())),
                       ::testing::Range(0, kNumPlacements)),
    [](const auto& info) {
      return zoo::Models()[std::get<0>(info.param)].name + "_" +
             kPlacements[std::get<1>(info.param)].name;
    });

// Stage 3 with stock Linear layers: inside a unit the device holds at least its parameters;
// after it the device allocator is back exactly where it was before the forward, although
// autograd saved the Linear weights' transposed views for backward (their storage is empty until
// backward gathers the unit again). The training result is the reference's.
TEST(ZooMemory, Stage3ReleasesEachUnitAfterItsForward) {
  Config c = ReleasingStage3(/*offload=*/true);
  // No gathering ahead (Note [prefetched gathers]): it would hold the next unit's chunks here.
  c.zero_optimization.stage3_prefetch_bucket_size = 0;
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
    auto rep = engine->Step();
    ASSERT_TRUE(rep.ok()) << rep.status();
    EXPECT_EQ(engine->device_bytes_in_use(), before) << "step " << step;
    // The step's device peak, from the allocator: at most two units gathered at once (backward
    // gathers a unit while the one after it waits for its last gradient) plus the fp32 gradient
    // buffers of two chunks (4 KiB chunks: 4 KiB of fp32 each).
    uint64_t largest = 0;
    for (uint64_t b : inside) largest = std::max(largest, b - before);
    EXPECT_LE(rep->peak_device_bytes, before + 2 * largest + 2 * 4096)
        << "step " << step << ": largest unit gathered " << largest << " B";
  }
}

// Note [a unit that cannot fit]: a device too small for the largest unit (gathered whole, with
// one chunk's fp32 gradient) is refused by the start, naming the unit and the budget's key,
// instead of failing in the first forward. The floor stays below what a step really takes: a
// device of exactly the peak the allocator measured over two steps still starts.
TEST(ZooMemory, ADeviceBelowTheLargestUnitIsRefusedAtTheStart) {
  Config c = ReleasingStage3(/*offload=*/true);
  c.zero_optimization.stage3_prefetch_bucket_size = 0;
  auto comm = CreateSingleCommunicator();
  uint64_t peak = 0;
  {
    torch::manual_seed(7);
    zoo::ResMlp net;
    auto device = CreateDevice("cpu", 64 << 20).value();
    ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(net.ptr(), c, comm.get(), device.get()));
    for (int step = 0; step < 2; ++step) {
      torch::Tensor loss = net->forward(torch::randn({8, 12})).pow(2).mean();
      ASSERT_OK(engine->Backward(loss));
      ASSERT_OK_AND_ASSIGN(StepReport rep, engine->Step());
      peak = std::max(peak, rep.peak_device_bytes);
    }
  }
  ASSERT_GT(peak, 0u);
  {
    torch::manual_seed(7);
    zoo::ResMlp net;
    auto device = CreateDevice("cpu", peak).value();
    const Status started = Engine::Create(net.ptr(), c, comm.get(), device.get()).status();
    EXPECT_TRUE(started.ok()) << "capacity " << peak << ": " << started;
  }
  // A residual block's parameters alone take 6.5 KB; 4 KiB cannot hold it.
  torch::manual_seed(7);
  zoo::ResMlp net;
  auto device = CreateDevice("cpu", 4 << 10).value();
  const Status refused = Engine::Create(net.ptr(), c, comm.get(), device.get()).status();
  EXPECT_EQ(refused.code(), StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("stage 3 gathers each unit whole on the device: unit 'blocks."),
            std::string::npos)
      << refused;
  EXPECT_NE(refused.message().find("strata.device_memory_budget"), std::string::npos) << refused;
  EXPECT_EQ(device->allocated(), 0u) << "the refusal came after device memory was taken";
}

// Outside its RunUnit a stage-3 parameter has an empty storage (no stale copy to read by
// mistake) and 0 elements (Note [released parameters]); inside it, its shape and the gathered
// values.
TEST(ZooMemory, ParameterStorageIsEmptyOutsideItsUnit) {
  Config c = ReleasingStage3(/*offload=*/false);
  torch::manual_seed(7);
  zoo::ResMlp net;
  auto comm = CreateSingleCommunicator();
  auto device = CreateDevice("cpu", 64 << 20).value();
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(net.ptr(), c, comm.get(), device.get()));
  const std::vector<int64_t> shape = {net->out->options.out_features(), net->out->options.in_features()};
  EXPECT_EQ(net->out->weight.storage().nbytes(), 0u);
  EXPECT_EQ(net->out->weight.numel(), 0);
  EXPECT_EQ(net->out->weight.sum().item<float>(), 0.0f);  // empty, not a read of address 0
  size_t inside = 0;
  float first = 0;
  std::vector<int64_t> inside_shape;
  strata::RunUnit(*net->out, [&] {
    inside = net->out->weight.storage().nbytes();
    inside_shape = net->out->weight.sizes().vec();
    first = net->out->weight.data_ptr<float>()[0];
    return torch::Tensor();
  });
  EXPECT_EQ(inside_shape, shape);
  EXPECT_EQ(net->out->weight.numel(), 0);
  EXPECT_GE(inside, static_cast<size_t>(16 * 4 * 4));
  EXPECT_TRUE(std::isfinite(first));
  EXPECT_NE(first, 0.0f);  // Linear's default init: nonzero weights
  EXPECT_EQ(net->out->weight.storage().nbytes(), 0u);
  EXPECT_EQ(engine->num_units(), 6);
  EXPECT_EQ(engine->unit_name(1), "blocks.0");
}

// A stock Linear as the whole model (its weight and bias are the root's own parameters): through
// Engine::Forward (the model given with its forward) and through RunUnit on the root, at stage 3
// with NVMe offload, it trains as plain LibTorch does.
TEST(ZooRoot, LinearAsTheModelMatchesPlainLibTorch) {
  Config c = zoo::ZooConfig();
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  // One batch for every step: a small Linear learns it within the test's four steps.
  auto loss_of = [](const torch::Tensor& out, int, int k) {
    zoo::Seed(0, k);
    torch::Tensor y = torch::randint(0, 3, {zoo::kGlobalBatch}, torch::kLong);
    return torch::nn::functional::cross_entropy(out, y);
  };
  auto input = [](int, int k) {
    zoo::Seed(100, k);
    return torch::randn({zoo::kGlobalBatch, 6});
  };
  torch::manual_seed(12);
  torch::nn::Linear ref_model(6, 3);
  std::vector<torch::Tensor> ref_params = models::UniqueParameters(*ref_model);
  const std::vector<double> ref = TrainPlainLibTorch(
      ref_params, c, zoo::kZooSteps, [&](int s, int k) { return loss_of(ref_model(input(s, k)), s, k); });
  ASSERT_LT(ref.back(), ref.front()) << "the reference does not learn";
  for (bool through_forward : {true, false}) {
    SCOPED_TRACE(through_forward ? "Engine::Forward" : "RunUnit on the root");
    torch::manual_seed(12);
    torch::nn::Linear model(6, 3);
    testing::TempDir dir;
    EngineOptions opts;
    opts.nvme_path = {dir.path()};
    auto comm = CreateSingleCommunicator();
    auto device = CreateDevice("cpu", 64 << 20).value();
    ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(torch::nn::AnyModule(model), c, comm.get(),
                                                     device.get(), opts));
    const std::vector<double> got = TrainWithEngine(*engine, c, comm.get(), zoo::kZooSteps, [&](int s, int k) {
      torch::Tensor x = input(s, k);
      torch::Tensor out = through_forward ? engine->Forward(x)
                                          : strata::RunUnit(*model, [&] { return model(x); });
      return loss_of(out, s, k);
    });
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5 * std::abs(ref[i])) << "step " << i;
    ASSERT_OK_AND_ASSIGN(auto params, engine->GatherMasterParams());
    ASSERT_EQ(params.size(), ref_params.size());
    for (size_t i = 0; i < params.size(); ++i)
      EXPECT_LT((params[i] - ref_params[i]).abs().max().item<double>(), 2e-5) << "parameter " << i;
  }
}

// A loss without a graph is refused by Backward, naming why, whatever the model.
TEST(ZooRoot, BackwardOfALossWithoutAGraphIsRefused) {
  Config c = zoo::ZooConfig();
  torch::manual_seed(10);
  zoo::RootOnly net;
  auto comm = CreateSingleCommunicator();
  auto device = CreateDevice("cpu", 64 << 20).value();
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(net.ptr(), c, comm.get(), device.get()));
  torch::Tensor loss;
  {
    torch::NoGradGuard ng;
    loss = net->forward(torch::randn({8, 12})).pow(2).mean();
  }
  Status s = engine->Backward(loss);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.ToString().find("no graph"), std::string::npos) << s;
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
    EXPECT_NE(std::string(e.what()).find("Engine::Backward"), std::string::npos) << e.what();
  }
}

// A loss whose graph outlives its engine: its stage-3 units' hooks refuse the backward instead
// of calling into the ended engine, and at stage 1 the chunk memory the graph's parameter views
// hold keeps the device (EngineOptions::device_owner) until the graph is freed, and then goes
// back to it, after the caller's own references to the device have gone.
TEST(ZooMemory, AGraphKeptPastTheEngineIsRefusedOrFreedSafely) {
  for (int stage : {1, 3}) {
    SCOPED_TRACE(stage);
    Config c = zoo::ZooConfig();
    c.zero_optimization.stage = stage;
    torch::manual_seed(7);
    zoo::ResMlp net;
    auto comm = CreateSingleCommunicator();
    std::shared_ptr<Device> device = CreateDevice("cpu", 64 << 20).value();
    std::weak_ptr<Device> watch = device;
    EngineOptions eo;
    eo.device_owner = device;
    ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(net.ptr(), c, comm.get(), device.get(), eo));
    torch::Tensor loss = net->forward(torch::randn({8, 12})).pow(2).mean();
    engine.reset();
    device.reset();
    eo.device_owner.reset();
    if (stage == 3) {
      // The engine emptied its chunks' storage as it closed: the graph holds none of the device.
      EXPECT_TRUE(watch.expired());
      try {
        loss.backward();
        FAIL() << "a backward through the ended engine's units went through";
      } catch (const std::exception& e) {
        EXPECT_NE(std::string(e.what()).find("an engine that has since ended"), std::string::npos)
            << e.what();
      }
    } else {
      EXPECT_FALSE(watch.expired());  // the graph holds the chunks' memory, and so the device
      loss.backward();                // the values are the graph's own: it runs
    }
    loss = torch::Tensor();
    EXPECT_TRUE(watch.expired());  // the last view gone, the memory went back, then the device
  }
  // Another device than the engine's is refused.
  Config c = zoo::ZooConfig();
  zoo::ResMlp net;
  auto comm = CreateSingleCommunicator();
  auto device = CreateDevice("cpu", 64 << 20).value();
  EngineOptions eo;
  eo.device_owner = CreateDevice("cpu", 64 << 20).value();
  const Status refused = Engine::Create(net.ptr(), c, comm.get(), device.get(), eo).status();
  EXPECT_NE(refused.message().find("device_owner holds another device"), std::string::npos)
      << refused;
}

// Chunks under stage3_param_persistence_threshold stay gathered across steps: after each update
// they are refilled in place once, instead of being gathered again for forward and for backward.
// With every chunk persistent a step copies the model host -> device once; with the threshold at
// 0 (and no reuse) at least twice. Both train to the reference.
TEST(ZooPersistence, SmallChunksStayGatheredAcrossSteps) {
  const zoo::Model model = zoo::Models()[0];
  std::map<int64_t, std::vector<uint64_t>> h2d;
  for (int64_t threshold : {int64_t{0}, int64_t{1} << 30}) {
    Config c = zoo::ZooConfig();
    c.zero_optimization.stage = 3;
    c.zero_optimization.offload_param.device = OffloadDevice::kCpu;
    c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
    c.zero_optimization.stage3_param_persistence_threshold = threshold;
    c.zero_optimization.stage3_max_reuse_distance = 0;
    auto comm = CreateSingleCommunicator();
    auto device = CreateDevice("cpu", 64 << 20).value();
    auto m = model.build();
    ASSERT_OK_AND_ASSIGN(auto e, Engine::Create(m, c, comm.get(), device.get()));
    for (int s = 0; s < zoo::kZooSteps; ++s) {
      ASSERT_OK(e->Backward(model.loss(*m, s, 0, 0, zoo::kGlobalBatch)));
      auto rep = e->Step();
      ASSERT_TRUE(rep.ok()) << rep.status();
      h2d[threshold].push_back(rep->bytes_host_to_device);
    }
    auto params = e->GatherMasterParams();
    ASSERT_TRUE(params.ok());
    zoo::Run ref = zoo::Reference(model, c);
    zoo::Run got{ref.losses, *params, zoo::Buffers(*m)};
    zoo::ExpectMatch(ref, got, 0, 2e-5);
  }
  const auto& none = h2d[0];
  const auto& all = h2d[int64_t{1} << 30];
  for (int s = 1; s < zoo::kZooSteps; ++s) {
    EXPECT_GT(all[s], 0u) << "step " << s << ": the updated values never reached the device";
    EXPECT_GE(none[s], 2 * all[s]) << "step " << s << ": persistent " << all[s]
                                   << " B vs gathered every time " << none[s] << " B";
  }
}

// BatchNorm's running statistics are part of a checkpoint: a new model resumed from it has the
// saved statistics (not its fresh ones), trains on to the same parameters and statistics as the
// run that continued, and a damaged buffer is refused before anything is overwritten.
TEST(ZooCheckpoint, BuffersAreSavedRestoredAndChecked) {
  const zoo::Model model = zoo::Models()[1];
  ASSERT_TRUE(model.batch_statistics);
  Config c = zoo::ZooConfig();
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  testing::TempDir dir;
  auto comm = CreateSingleCommunicator();
  auto device = CreateDevice("cpu", 64 << 20).value();
  auto train = [&](Engine& e, torch::nn::Module& m, int from, int to) {
    for (int s = from; s < to; ++s) {
      ASSERT_OK(e.Backward(model.loss(m, s, 0, 0, zoo::kGlobalBatch)));
      ASSERT_TRUE(e.Step().ok());
    }
  };
  auto a = model.build();
  ASSERT_OK_AND_ASSIGN(auto ea, Engine::Create(a, c, comm.get(), device.get()));
  train(*ea, *a, 0, 2);
  ASSERT_OK(ea->SaveCheckpoint(dir.path(), {}));
  const std::vector<torch::Tensor> saved = zoo::Buffers(*a);
  train(*ea, *a, 2, 4);
  auto a_params = ea->GatherMasterParams();
  ASSERT_TRUE(a_params.ok());

  auto b = model.build();
  ASSERT_OK_AND_ASSIGN(auto eb, Engine::Create(b, c, comm.get(), device.get()));
  ASSERT_FALSE(torch::equal(zoo::Buffers(*b)[0], saved[0])) << "fresh statistics equal the saved ones";
  ASSERT_TRUE(eb->LoadCheckpoint(dir.path()).ok());
  const std::vector<torch::Tensor> loaded = zoo::Buffers(*b);
  ASSERT_EQ(loaded.size(), saved.size());
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_TRUE(torch::equal(loaded[i], saved[i])) << "buffer " << i;
  train(*eb, *b, 2, 4);
  auto b_params = eb->GatherMasterParams();
  ASSERT_TRUE(b_params.ok());
  zoo::Run ra{{}, *a_params, zoo::Buffers(*a)}, rb{{}, *b_params, zoo::Buffers(*b)};
  zoo::ExpectMatch(ra, rb, 0, 1e-7);

  // Flip a byte of the last buffer in the file: Load refuses, and the live buffers are untouched.
  const std::string bin = dir.path() + "/step-00000002/rank-00000.bin";
  {
    std::FILE* f = std::fopen(bin.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, -1, SEEK_END);
    int ch = std::fgetc(f);
    std::fseek(f, -1, SEEK_END);
    std::fputc(ch ^ 0x5a, f);
    std::fclose(f);
  }
  const std::vector<torch::Tensor> before = zoo::Buffers(*b);
  auto bad = eb->LoadCheckpoint(dir.path());
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().ToString().find("buffer"), std::string::npos) << bad.status();
  const std::vector<torch::Tensor> after = zoo::Buffers(*b);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(torch::equal(before[i], after[i])) << "buffer " << i;
}

}  // namespace
}  // namespace strata
