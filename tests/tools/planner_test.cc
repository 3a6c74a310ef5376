#include <algorithm>
// strata_planner without LibTorch: GPT parameter list, memory model arithmetic, profile schema,
// and the tuner's choices on synthetic profiles.
#include <fstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/base/config.h"
#include "runtime/base/units.h"
#include "tests/test_util.h"
#include "tools/planner/cli_util.h"
#include "tools/planner/cost_model.h"
#include "tools/planner/memory_model.h"
#include "tools/planner/model_spec.h"
#include "tools/planner/profile.h"

namespace strata::planner {
namespace {

ModelConfig SmallGpt() {
  ModelConfig m;
  m.n_layers = 2;
  m.d_model = 64;
  m.n_heads = 4;
  m.seq_len = 32;
  m.vocab_size = 128;
  return m;
}

TEST(ModelSpecTest, GptParameterListMatchesTheArchitecture) {
  ModelConfig m = SmallGpt();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(m));
  const int64_t d = 64, V = 128, T = 32;
  // The head's projection is the token embedding (tied): counted once, shared by block 3.
  EXPECT_EQ(spec.param_count(), V * d + T * d + 2 * (12 * d * d + 13 * d) + 2 * d);
  EXPECT_EQ(spec.num_blocks, 4);
  EXPECT_EQ(spec.params.front().name, "embed.pos");
  EXPECT_EQ(spec.params[1].name, "embed.tok.weight");
  EXPECT_EQ(spec.params[1].also_in, std::vector<int64_t>{3});
  EXPECT_EQ(spec.params.back().name, "head.ln.bias");
  EXPECT_EQ(spec.params.back().block, 3);
  // Every parameter's gradient arrives once.
  std::vector<int64_t> order = spec.gradient_order;
  std::sort(order.begin(), order.end());
  ASSERT_EQ(order.size(), spec.params.size());
  for (size_t i = 0; i < order.size(); ++i) EXPECT_EQ(order[i], static_cast<int64_t>(i));
  m.n_heads = 5;
  EXPECT_FALSE(GptModelSpec(m).ok());
}

TEST(ModelSpecTest, SyntheticSplitsIntoLayers) {
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, SyntheticModelSpec(1000, 300));
  ASSERT_EQ(spec.params.size(), 4u);
  EXPECT_EQ(spec.params[3].numel, 100);
  EXPECT_EQ(spec.largest_block_numel(), 300);
  EXPECT_FALSE(SyntheticModelSpec(100, 200).ok());
  EXPECT_FALSE(SyntheticModelSpec(0, 1).ok());
}

TEST(MemoryModelTest, Stage2CpuOffloadPutsEveryOptimizerStateOnTheHost) {
  Config c;
  c.zero_optimization.stage = 2;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  c.bf16.enabled = true;
  c.strata.chunk_size = 64 << 10;
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(SmallGpt()));
  EstimateOptions eo;
  eo.world_size = 2;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate e, EstimateMemory(c, spec, eo));
  // master32 + grad (fp32) + two fp32 moments per element of this rank's shards, each block in a
  // power-of-two class of the pinned pool, which is reserved at exactly that size.
  EXPECT_GE(e.engine_host_peak_bytes, static_cast<uint64_t>(e.shard_numel) * 16);
  EXPECT_LT(e.engine_host_peak_bytes, static_cast<uint64_t>(e.shard_numel) * 32);
  EXPECT_EQ(e.host_pinned_bytes, e.engine_host_peak_bytes);
  EXPECT_EQ(e.host_min_bytes, e.engine_host_peak_bytes);
  EXPECT_EQ(e.nvme_bytes, 0u);
  EXPECT_GE(e.padded_numel, e.param_numel);
  EXPECT_EQ(e.shard_numel * 2, e.padded_numel);
  // The device keeps the whole bf16 working copy plus gradient buffers.
  EXPECT_GE(e.engine_device_peak_bytes, static_cast<uint64_t>(e.padded_numel) * 2);
  EXPECT_GT(e.activation_bytes, 0u);
  EXPECT_EQ(e.hbm_bytes > e.engine_device_peak_bytes, true);
  nlohmann::json j = e.ToJson();
  for (const char* k : {"hbm_bytes", "host_pinned_bytes", "host_pageable_bytes", "nvme_bytes", "per_state"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_EQ(j["per_state"]["master32"]["tier"], "host_pinned");
}

TEST(MemoryModelTest, NvmeOffloadMovesBytesFromHostToNvmeAndAddsStaging) {
  Config c;
  c.zero_optimization.stage = 3;
  c.bf16.enabled = true;
  c.strata.chunk_size = 16 << 10;  // many chunks: NVMe's working set is a fraction of them
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(SmallGpt()));
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero_optimization.offload_param.device = OffloadDevice::kCpu;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate cpu, EstimateMemory(c, spec));
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate nvme, EstimateMemory(c, spec));
  EXPECT_EQ(cpu.nvme_bytes, 0u);
  EXPECT_GE(nvme.nvme_bytes, static_cast<uint64_t>(nvme.shard_numel) * 18);
  EXPECT_LT(nvme.host_min_bytes, cpu.host_min_bytes);
  // With the budget at that minimum, the pool caches only 8 blocks' worth of NVMe state.
  c.strata.host_memory_budget = nvme.host_min_bytes;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate tight, EstimateMemory(c, spec));
  EXPECT_EQ(tight.host_pinned_bytes, nvme.host_min_bytes);
  EXPECT_LT(tight.engine_host_peak_bytes, cpu.engine_host_peak_bytes);
  // Stage 3 with everything offloaded: the device holds only the transient gather and gradient
  // buffers, the same whether the states sit on the host or on NVMe.
  EXPECT_EQ(nvme.engine_device_peak_bytes, cpu.engine_device_peak_bytes);
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNone;
  c.zero_optimization.offload_param.device = OffloadDevice::kNone;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate dev, EstimateMemory(c, spec));
  uint64_t resident = 0;  // every state on the device (each allocation rounded to 64 B)
  for (const auto& it : dev.items)
    if (!it.transient) resident += it.bytes;
  EXPECT_EQ(dev.engine_device_peak_bytes - nvme.engine_device_peak_bytes, resident);
  EXPECT_GE(resident, static_cast<uint64_t>(dev.shard_numel) * 18);
}

HardwareProfile SyntheticProfile(double nvme_gbps) {
  HardwareProfile h;
  h.nvme_path = "/tmp";
  for (int64_t bs : {1 << 20, 8 << 20}) {
    h.nvme.push_back({false, bs, 32, 1, bs == (8 << 20) ? nvme_gbps : nvme_gbps / 2});
    h.nvme.push_back({true, bs, 32, 1, nvme_gbps / 2});
  }
  h.dram_gbps = 10;
  h.copies = {{"cpu", "pinned", "h2d", 8}, {"cpu", "pinned", "d2h", 8}};
  h.adam_gelems_per_s = 1.0;
  h.compute_gflops = 100;
  h.compute_dtype = "bf16";
  return h;
}

Config TuneConfig() {
  Config c;
  c.zero_optimization.stage = 3;
  c.bf16.enabled = true;
  c.strata.chunk_size = 16 << 10;
  c.model = SmallGpt();
  return c;
}

TEST(TunerTest, SlowNvmeChoosesHostWhenItFits) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  Config all_host = c;
  all_host.zero_optimization.offload_param.device = OffloadDevice::kCpu;
  all_host.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate floor, EstimateMemory(all_host, spec));
  TuneOptions o;
  o.device_budget = floor.hbm_bytes + 1024;  // too small for states on the device
  o.host_budget = 1ull << 30;
  ASSERT_OK_AND_ASSIGN(TuneResult r, Tune(c, spec, SyntheticProfile(0.001), o));
  ASSERT_FALSE(r.candidates.empty());
  const Candidate& best = r.candidates.front();
  ASSERT_TRUE(best.feasible);
  EXPECT_EQ(best.optimizer, OffloadDevice::kCpu) << best.Describe();
  EXPECT_NE(best.param, OffloadDevice::kNvme) << best.Describe();
  EXPECT_FALSE(best.uses_nvme);
  // A device-resident placement exists but breaks the device budget.
  bool saw_device_over = false;
  for (const auto& cand : r.candidates)
    if (cand.optimizer == OffloadDevice::kNone && !cand.feasible) saw_device_over = true;
  EXPECT_TRUE(saw_device_over);
}

TEST(TunerTest, TinyHostBudgetChoosesNvme) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  // Budgets from the estimates: the device fits the all-offloaded placement only; the host fits
  // one chunk's NVMe staging, not every optimizer state.
  Config all_nvme = c;
  all_nvme.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  all_nvme.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate floor, EstimateMemory(all_nvme, spec));
  TuneOptions o;
  o.device_budget = DeviceBudgetPeak(floor) + 1024;
  o.host_budget = floor.host_min_bytes + floor.host_pageable_bytes + HostTorchBytes(floor) + 1024;
  ASSERT_LT(o.host_budget, static_cast<uint64_t>(floor.shard_numel) * 16);
  ASSERT_OK_AND_ASSIGN(TuneResult r, Tune(c, spec, SyntheticProfile(0.001), o));
  const Candidate& best = r.candidates.front();
  ASSERT_TRUE(best.feasible) << best.Describe() << ": " << best.why_not;
  EXPECT_EQ(best.optimizer, OffloadDevice::kNvme) << best.Describe();
  // Among NVMe settings it picks the faster measured aio point.
  EXPECT_EQ(best.aio.block_size, 8 << 20);
  o.nvme_allowed = false;
  ASSERT_OK_AND_ASSIGN(TuneResult none, Tune(c, spec, SyntheticProfile(0.001), o));
  EXPECT_FALSE(none.candidates.front().feasible);
}

TEST(TunerTest, FasterLaneWinsWhenBothFit) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  TuneOptions o;
  o.device_budget = 1ull << 30;
  o.host_budget = 1ull << 30;
  ASSERT_OK_AND_ASSIGN(TuneResult r, Tune(c, spec, SyntheticProfile(2.0), o));
  const Candidate& best = r.candidates.front();
  // Everything on the (cpu) device moves no bytes: nothing can be faster.
  EXPECT_EQ(best.optimizer, OffloadDevice::kNone) << best.Describe();
  EXPECT_EQ(best.param, OffloadDevice::kNone) << best.Describe();
  for (size_t i = 1; i < r.candidates.size(); ++i) {
    if (r.candidates[i].feasible) {
      EXPECT_LE(r.candidates[i - 1].prediction.step_s, r.candidates[i].prediction.step_s * 1.01 + 1e-12);
    }
  }
}

TEST(TunerTest, AppliedConfigKeepsOtherKeysAndParses) {
  strata::testing::TempDir dir;
  const std::string in = dir.path() + "/in.json";
  nlohmann::json raw = {{"train_micro_batch_size_per_gpu", 2},
                        {"bf16", {{"enabled", true}}},
                        {"gradient_clipping", 1.0},
                        {"zero_optimization", {{"stage", 3}, {"reduce_bucket_size", 5e7}}},
                        {"aio", {{"thread_count", 2}}},
                        {"model", {{"n_layers", 2}, {"d_model", 64}, {"n_heads", 4}, {"seq_len", 32},
                                   {"vocab_size", 128}}}};
  Candidate cand;
  cand.param = OffloadDevice::kCpu;
  cand.optimizer = OffloadDevice::kNvme;
  cand.uses_nvme = true;
  cand.aio = {false, 8 << 20, 32, 2, 1.0};
  ApplyCandidate(cand, dir.path(), &raw);
  const std::string out = dir.path() + "/out.json";
  ASSERT_OK(WriteJsonFileAtomic(out, raw));
  ASSERT_OK_AND_ASSIGN(Config parsed, Config::FromFile(out));
  EXPECT_EQ(parsed.zero_optimization.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_EQ(parsed.zero_optimization.offload_param.device, OffloadDevice::kCpu);
  ASSERT_EQ(parsed.zero_optimization.offload_optimizer.nvme_path.size(), 1u);
  EXPECT_EQ(parsed.aio.block_size, 8 << 20);
  EXPECT_EQ(parsed.aio.intra_op_parallelism, 2);
  EXPECT_EQ(parsed.gradient_clipping, 1.0);
  EXPECT_EQ(parsed.zero_optimization.reduce_bucket_size, 50000000);
  EXPECT_EQ(parsed.train_micro_batch_size_per_gpu, 2);
  EXPECT_TRUE(parsed.warnings.empty());
}

// The sum of what a state placement puts in each tier: its plan's per-tier totals.
uint64_t TierTotal(const MemoryEstimate& m, const char* tier) {
  return m.placement.contains(tier) ? m.placement[tier].value("total", uint64_t{0}) : 0;
}

// The device holds the working shards and about half the optimizer groups, the host the other
// half, and there is no NVMe: no section as written fits, the per-chunk fill does.
TEST(TunerTest, AutoPlacementSplitsWhatNoSingleTierHolds) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  Config on_device = c;  // everything on the (cpu) device
  ASSERT_OK_AND_ASSIGN(MemoryEstimate all_dev, EstimateMemory(on_device, spec));
  Config split = c;  // working shards on the device, optimizer groups on the host
  split.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate groups_host, EstimateMemory(split, spec));
  const uint64_t groups = TierTotal(groups_host, "host");
  ASSERT_GT(groups, 0u);
  TuneOptions o;
  o.nvme_allowed = false;
  o.device_budget = DeviceBudgetPeak(all_dev) - groups / 2;
  o.host_budget = groups_host.host_pageable_bytes + HostTorchBytes(groups_host) + groups * 3 / 4;
  ASSERT_OK_AND_ASSIGN(TuneResult r, Tune(c, spec, SyntheticProfile(1.0), o));
  for (const Candidate& cand : r.candidates) {
    if (cand.mode == PlacementMode::kConfig) {
      EXPECT_FALSE(cand.feasible) << cand.Describe();
    }
  }
  const Candidate& best = r.candidates.front();
  ASSERT_TRUE(best.feasible) << best.Describe() << ": " << best.why_not;
  EXPECT_EQ(best.mode, PlacementMode::kAuto);
  EXPECT_EQ(best.optimizer, OffloadDevice::kCpu);
  EXPECT_FALSE(best.uses_nvme);
  // Some optimizer groups on each side, as the budgets force.
  const auto& dev = best.memory.placement["device"];
  const auto& host = best.memory.placement["host"];
  EXPECT_GT(dev.value("exp_avg", uint64_t{0}), 0u) << best.memory.placement.dump();
  EXPECT_GT(host.value("exp_avg", uint64_t{0}), 0u) << best.memory.placement.dump();
  EXPECT_EQ(TierTotal(best.memory, "nvme"), 0u);
  EXPECT_LE(DeviceBudgetPeak(best.memory), o.device_budget);
  EXPECT_LE(best.memory.host_min_bytes + best.memory.host_pageable_bytes + HostTorchBytes(best.memory),
            o.host_budget);
  // The pool the plan was made with, which the written config carries.
  EXPECT_GE(best.host_pool, TierTotal(best.memory, "host"));
  EXPECT_LE(best.host_pool, o.host_budget);
  // Without auto nothing fits, and the search says so rather than failing.
  o.try_auto = false;
  ASSERT_OK_AND_ASSIGN(TuneResult config_only, Tune(c, spec, SyntheticProfile(1.0), o));
  EXPECT_FALSE(config_only.candidates.front().feasible);
}

// A config the plan refuses is one candidate that does not fit, not the search's error: with the
// input at placement auto and a host budget that cannot hold the optimizer groups, the search
// once stopped at its first candidate (everything on the device).
TEST(TunerTest, ARefusedPlanIsAnInfeasibleCandidateNotAnError) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  Config split = c;
  split.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate groups_host, EstimateMemory(split, spec));
  c.strata.placement = PlacementMode::kAuto;
  c.strata.host_memory_budget = TierTotal(groups_host, "host") / 4 / 4096 * 4096;
  TuneOptions o;
  o.device_budget = TierTotal(groups_host, "device") + (8u << 20);
  o.host_budget = 1ull << 30;
  o.disk_free = 64ull << 30;
  ASSERT_OK_AND_ASSIGN(TuneResult r, Tune(c, spec, SyntheticProfile(2.0), o));
  size_t refused = 0;
  for (const Candidate& cand : r.candidates) {
    if (cand.planned) continue;
    ++refused;
    EXPECT_FALSE(cand.feasible);
    EXPECT_FALSE(cand.why_not.empty()) << cand.Describe();
  }
  EXPECT_GT(refused, 0u);
  const Candidate& best = r.candidates.front();
  ASSERT_TRUE(best.feasible) << best.Describe() << ": " << best.why_not;
  EXPECT_GT(best.prediction.step_s, 0);
}

// A placement with NVMe is feasible only when the disk its start grows to is free at the path:
// for a stage-3 build the staging file beside the NVMe blocks written while it is read back
// (more than the NVMe state alone), which the engine checks before it reads anything.
TEST(TunerTest, ACandidateWhoseStartOutgrowsTheFreeDiskIsInfeasible) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  // The all-NVMe candidates, one per measured aio setting, with the free disk given.
  const auto all_nvme_candidates = [&](uint64_t disk_free) {
    TuneOptions o;
    o.device_budget = 1ull << 30;
    o.host_budget = 1ull << 30;
    o.try_auto = false;
    o.disk_free = disk_free;
    std::vector<Candidate> out;
    auto r = Tune(c, spec, SyntheticProfile(1.0), o);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return out;
    for (const Candidate& cand : r->candidates)
      if (cand.param == OffloadDevice::kNvme && cand.optimizer == OffloadDevice::kNvme) out.push_back(cand);
    std::sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) { return a.aio.block_size < b.aio.block_size; });
    EXPECT_EQ(out.size(), 2u);
    return out;
  };
  const std::vector<Candidate> unknown = all_nvme_candidates(0);  // free disk unknown: not checked
  ASSERT_EQ(unknown.size(), 2u);
  for (const Candidate& cand : unknown) {
    EXPECT_TRUE(cand.feasible) << cand.why_not;
    // Each candidate's start is estimated at its own aio block size (the stripes the start writes).
    Config all_nvme = c;
    all_nvme.zero_optimization.offload_param.device = OffloadDevice::kNvme;
    all_nvme.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
    all_nvme.aio.block_size = cand.aio.block_size;
    EstimateOptions eo;
    eo.assume_nvme_path = true;
    eo.device = "cpu";
    ASSERT_OK_AND_ASSIGN(MemoryEstimate est, EstimateMemory(all_nvme, spec, eo));
    ASSERT_GT(est.staged_bytes, 0u);
    ASSERT_GT(est.init_disk_need_bytes, est.nvme_bytes);  // the premise: the start needs more than the state
    EXPECT_EQ(cand.memory.init_disk_need_bytes, est.init_disk_need_bytes) << cand.Describe();
  }
  const uint64_t need = unknown[0].memory.init_disk_need_bytes;
  EXPECT_TRUE(all_nvme_candidates(need)[0].feasible);
  // Room for the NVMe state but not for the start: refused, naming both figures.
  ASSERT_GT(need - 1, unknown[0].memory.nvme_bytes);
  const Candidate short_of_it = all_nvme_candidates(need - 1)[0];
  EXPECT_FALSE(short_of_it.feasible);
  EXPECT_NE(short_of_it.why_not.find("disk at start " + FormatBytes(need) + " > free disk " + FormatBytes(need - 1)),
            std::string::npos)
      << short_of_it.why_not;
  // A candidate without NVMe is not held to the disk.
  TuneOptions o;
  o.device_budget = 1ull << 30;
  o.host_budget = 1ull << 30;
  o.disk_free = 1;
  ASSERT_OK_AND_ASSIGN(TuneResult r, Tune(c, spec, SyntheticProfile(1.0), o));
  for (const Candidate& cand : r.candidates)
    EXPECT_EQ(cand.feasible, !cand.uses_nvme) << cand.Describe() << ": " << cand.why_not;
}

// Without a host budget the tuner assumes half of RAM as the host tier, and the pool is the
// plan's need (the engine sizes it so without strata.host_memory_budget), not that half.
TEST(TunerTest, AutoWithoutAHostBudgetSizesThePoolToThePlan) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  TuneOptions o;
  o.device_budget = 1u << 20;
  o.nvme_allowed = false;
  o.try_config = false;
  ASSERT_OK_AND_ASSIGN(TuneResult r, Tune(c, spec, SyntheticProfile(1.0), o));
  const Candidate& best = r.candidates.front();
  ASSERT_TRUE(best.feasible) << best.Describe() << ": " << best.why_not;
  EXPECT_EQ(best.mode, PlacementMode::kAuto);
  EXPECT_EQ(best.host_pool, 0u);
  EXPECT_GT(TierTotal(best.memory, "host"), 0u);
  EXPECT_GE(best.memory.host_pinned_bytes, TierTotal(best.memory, "host"));
  EXPECT_LT(best.memory.host_pinned_bytes, r.host_budget / 64) << r.host_budget;
}

TEST(TunerTest, AppliedCandidateNamesItsPlacementMode) {
  Candidate automatic;
  automatic.mode = PlacementMode::kAuto;
  automatic.param = OffloadDevice::kNvme;
  automatic.optimizer = OffloadDevice::kNvme;
  automatic.uses_nvme = true;
  automatic.aio = {false, 1 << 20, 16, 1, 1.0};
  nlohmann::json plain = {{"zero_optimization", {{"stage", 3}}}};
  ApplyCandidate(automatic, "/var/tmp/x", &plain);
  EXPECT_EQ(plain["strata"]["placement"], "auto");
  EXPECT_EQ(plain["zero_optimization"]["offload_param"]["device"], "nvme");
  EXPECT_EQ(plain["zero_optimization"]["offload_optimizer"]["nvme_path"], "/var/tmp/x");
  EXPECT_EQ(automatic.Describe(), "auto param>=nvme optimizer>=nvme aio=1.00 MiBxQD16x1");
  // A config candidate on an input that asked for auto must say config: the engine would
  // otherwise re-plan the chunks it was predicted for.
  Candidate written;
  written.optimizer = OffloadDevice::kCpu;
  nlohmann::json was_auto = {{"zero_optimization", {{"stage", 2}}}, {"strata", {{"placement", "auto"}}}};
  ApplyCandidate(written, "", &was_auto);
  EXPECT_EQ(was_auto["strata"]["placement"], "config");
  nlohmann::json unset = {{"zero_optimization", {{"stage", 2}}}};
  ApplyCandidate(written, "", &unset);
  EXPECT_FALSE(unset.contains("strata")) << unset.dump();
  Config parsed;
  parsed.strata.placement = PlacementMode::kAuto;
  ApplyCandidate(written, &parsed);
  EXPECT_EQ(parsed.strata.placement, PlacementMode::kConfig);
  EXPECT_EQ(parsed.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
}

// A layout other than the config's changes the numerics: searched only when asked, and then
// the smaller state fits where the config's does not.
TEST(TunerTest, LayoutsAreSearchedOnlyWhenAsked) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  Config split = c;
  split.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate groups_host, EstimateMemory(split, spec));
  TuneOptions o;
  o.nvme_allowed = false;
  o.device_budget = DeviceBudgetPeak(groups_host) + (64u << 10);
  // Half the fp32 optimizer groups: the 6-byte layout's fit, the 18-byte one's do not.
  o.host_budget =
      groups_host.host_pageable_bytes + HostTorchBytes(groups_host) + TierTotal(groups_host, "host") / 2;
  ASSERT_OK_AND_ASSIGN(TuneResult own, Tune(c, spec, SyntheticProfile(1.0), o));
  for (const Candidate& cand : own.candidates) {
    EXPECT_FALSE(cand.layout_searched);
    EXPECT_EQ(cand.layout, StateLayout{});
  }
  EXPECT_FALSE(own.candidates.front().feasible) << own.candidates.front().Describe();
  o.layouts = AllLayouts();
  ASSERT_EQ(o.layouts.size(), 6u);
  EXPECT_EQ(o.layouts.front(), StateLayout{});
  EXPECT_EQ(o.layouts.back(), (StateLayout{true, optim::MomentFormat::kInt8}));
  ASSERT_OK_AND_ASSIGN(TuneResult all, Tune(c, spec, SyntheticProfile(1.0), o));
  const Candidate& best = all.candidates.front();
  ASSERT_TRUE(best.feasible) << best.Describe() << ": " << best.why_not;
  EXPECT_TRUE(best.layout_searched);
  EXPECT_NE(best.layout, StateLayout{});
  EXPECT_EQ(best.memory.state_layout, best.layout.Name());
  EXPECT_LT(best.memory.bytes_per_param, 10.0);
  EXPECT_NE(best.Describe().find("[" + best.layout.Name() + "]"), std::string::npos) << best.Describe();
  for (const Candidate& cand : all.candidates) {
    if (cand.layout == StateLayout{}) {
      EXPECT_FALSE(cand.feasible) << cand.Describe();
    }
  }
  // fp32 compute: a bf16 master cannot be its working copy; those layouts are skipped, by name.
  c.bf16.enabled = false;
  ASSERT_OK_AND_ASSIGN(TuneResult fp32, Tune(c, spec, SyntheticProfile(1.0), o));
  for (const Candidate& cand : fp32.candidates) EXPECT_FALSE(cand.layout.bf16_master) << cand.Describe();
  const std::string said = ::testing::PrintToString(fp32.assumptions);
  EXPECT_NE(said.find("layout int8+bf16_master skipped: a bf16 master"), std::string::npos) << said;
  // Nothing asked for can run: an error, not an empty ranking.
  o.layouts = {StateLayout{true, optim::MomentFormat::kInt8}};
  auto none = Tune(c, spec, SyntheticProfile(1.0), o);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(std::string(none.status().message()).find("bf16.enabled"), std::string::npos) << none.status();
}

TEST(TunerTest, AppliedLayoutWritesItsKeysOnly) {
  Candidate cand;
  cand.optimizer = OffloadDevice::kCpu;
  cand.layout_searched = true;
  cand.layout = StateLayout{true, optim::MomentFormat::kInt8};
  // DeepSpeed's other name for the section is kept, and its bf16_optimizer_states, which would
  // contradict int8 moments, goes.
  nlohmann::json raw = {{"zero_optimization", {{"stage", 2}}},
                        {"bfloat16", {{"enabled", true}, {"bf16_optimizer_states", true}}}};
  ApplyCandidate(cand, "", &raw);
  EXPECT_FALSE(raw.contains("bf16")) << raw.dump();
  EXPECT_EQ(raw["bfloat16"]["bf16_master_weights_and_grads"], true);
  EXPECT_FALSE(raw["bfloat16"].contains("bf16_optimizer_states")) << raw.dump();
  EXPECT_EQ(raw["strata"]["optimizer_state_dtype"], "int8");
  ASSERT_OK_AND_ASSIGN(Config parsed, Config::FromJsonText(raw.dump()));
  EXPECT_EQ(ConfigLayout(parsed), cand.layout);
  // Not searched: the config's layout stays as written.
  cand.layout_searched = false;
  nlohmann::json kept = {{"zero_optimization", {{"stage", 2}}},
                         {"bf16", {{"enabled", true}, {"bf16_optimizer_states", true}}}};
  ApplyCandidate(cand, "", &kept);
  EXPECT_EQ(kept["bf16"]["bf16_optimizer_states"], true);
  EXPECT_FALSE(kept["bf16"].contains("bf16_master_weights_and_grads"));
}

TEST(ProfileTest, RoundTripsAndNamesBadKeys) {
  HardwareProfile h = SyntheticProfile(1.5);
  h.has_fio = true;
  h.fio = {false, 8 << 20, 32, 1, 2.0};
  ASSERT_OK_AND_ASSIGN(HardwareProfile back, HardwareProfile::FromJson(h.ToJson()));
  EXPECT_EQ(back.nvme.size(), h.nvme.size());
  EXPECT_DOUBLE_EQ(back.fio.gbps, 2.0);
  ASSERT_OK_AND_ASSIGN(NvmePoint best, back.BestAio());
  EXPECT_EQ(best.block_size, 8 << 20);
  EXPECT_DOUBLE_EQ(back.CopyGbps("cpu", "h2d"), 8);
  nlohmann::json bad = h.ToJson();
  bad["nvme"]["points"][1]["gbps"] = "fast";
  auto r = HardwareProfile::FromJson(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("nvme.points[1].gbps"), std::string::npos) << r.status().message();
  HardwareProfile empty;
  EXPECT_FALSE(RatesFromProfile(empty, "cpu", 0).ok());
}

// A GPU's profile: its matmul and its free memory. Profiles made before these were measured
// there read as a CPU matmul and no device memory, and a cuda tuning refuses the CPU's rate.
TEST(ProfileTest, TheGpusMatmulAndMemoryRoundTripAndBadOnesAreNamed) {
  HardwareProfile h = SyntheticProfile(1.0);
  h.device = "cuda";
  h.compute_device = "cuda";
  h.device_name = "cuda:0 (Test GPU)";
  h.device_capacity_bytes = 70ull << 30;
  ASSERT_OK_AND_ASSIGN(HardwareProfile back, HardwareProfile::FromJson(h.ToJson()));
  EXPECT_EQ(back.compute_device, "cuda");
  EXPECT_EQ(back.device_name, "cuda:0 (Test GPU)");
  EXPECT_EQ(back.device_capacity_bytes, 70ull << 30);
  nlohmann::json old = h.ToJson();
  old["compute"].erase("device");
  old.erase("device_memory");
  ASSERT_OK_AND_ASSIGN(HardwareProfile before, HardwareProfile::FromJson(old));
  EXPECT_EQ(before.compute_device, "cpu");
  EXPECT_EQ(before.device_capacity_bytes, 0u);
  const std::pair<const char*, nlohmann::json> bad[] = {
      {"compute.device", {{"compute", {{"gflops", 1.0}, {"device", "tpu"}}}}},
      {"device_memory.capacity_bytes", {{"device_memory", {{"capacity_bytes", 1.5}}}}},
      {"device_memory.capacity_bytes", {{"device_memory", {{"capacity_bytes", 1e300}}}}},
      {"adam.elements", {{"adam", {{"gelems_per_s", 1.0}, {"elements", -4}}}}},
      {"comm.world_size", {{"comm", {{"busbw_gbps", 1.0}, {"world_size", 1e12}}}}},
  };
  for (const auto& [key, j] : bad) {
    auto r = HardwareProfile::FromJson(j);
    ASSERT_FALSE(r.ok()) << j.dump();
    EXPECT_NE(r.status().message().find(key), std::string::npos) << r.status().message();
  }
}

TEST(TunerTest, ACudaTuningTakesTheProfilesGpuRateAndMemory) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  HardwareProfile h = SyntheticProfile(1.0);
  h.device = "cuda";
  h.copies = {{"cuda", "pinned", "h2d", 20}, {"cuda", "pinned", "d2h", 20}};
  TuneOptions o;
  o.device = "cuda";
  o.nvme_allowed = false;
  // The matmul ran on the CPU: its rate is refused for a GPU's step, and --gflops is the way out.
  auto refused = Tune(c, spec, h, o);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("measured on the cpu"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("--gflops"), std::string::npos) << refused.status().message();
  o.gflops_override = 1e5;
  ASSERT_OK_AND_ASSIGN(TuneResult no_memory, Tune(c, spec, h, o));
  EXPECT_EQ(no_memory.device_budget, 0u);
  for (const Candidate& cand : no_memory.candidates) EXPECT_EQ(cand.mode, PlacementMode::kConfig);
  // Measured on the GPU, with the GPU's memory: the budget is that memory, said so, and the
  // auto fill is searched under it.
  o.gflops_override = 0;
  h.compute_device = "cuda";
  h.compute_gflops = 1e5;
  h.device_name = "cuda:0 (Test GPU)";
  EstimateOptions on_gpu;
  on_gpu.device = "cuda";
  ASSERT_OK_AND_ASSIGN(MemoryEstimate everything, EstimateMemory(c, spec, on_gpu));
  h.device_capacity_bytes = DeviceBudgetPeak(everything) / 2;  // too small to hold it all
  ASSERT_OK_AND_ASSIGN(TuneResult r, Tune(c, spec, h, o));
  EXPECT_EQ(r.device_budget, h.device_capacity_bytes);
  EXPECT_TRUE(std::any_of(r.assumptions.begin(), r.assumptions.end(), [](const std::string& a) {
    return a.find("cuda:0 (Test GPU)'s free memory") != std::string::npos;
  })) << nlohmann::json(r.assumptions).dump();
  bool auto_searched = false;
  for (const Candidate& cand : r.candidates) {
    auto_searched |= cand.mode == PlacementMode::kAuto;
    if (cand.feasible) {
      EXPECT_LE(DeviceBudgetPeak(cand.memory), r.device_budget) << cand.Describe();
    }
  }
  EXPECT_TRUE(auto_searched);
  ASSERT_TRUE(r.candidates.front().feasible) << r.candidates.front().Describe();
  // A budget given still wins over the profile's.
  o.device_budget = h.device_capacity_bytes / 2;
  ASSERT_OK_AND_ASSIGN(TuneResult given, Tune(c, spec, h, o));
  EXPECT_EQ(given.device_budget, o.device_budget);
}

TEST(CostModelTest, NvmeBandwidthDrivesTheNvmePlacement) {
  Config c = TuneConfig();
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  ASSERT_OK_AND_ASSIGN(MemoryEstimate mem, EstimateMemory(c, spec));
  ASSERT_OK_AND_ASSIGN(Rates r, RatesFromProfile(SyntheticProfile(1.0), "cpu", 0));
  r.nvme_read_gbps = r.nvme_write_gbps = 1.0;
  ASSERT_OK_AND_ASSIGN(StepPrediction fast, PredictStep(c, spec, mem, r, "cpu"));
  r.nvme_read_gbps = r.nvme_write_gbps = 0.01;
  ASSERT_OK_AND_ASSIGN(StepPrediction slow, PredictStep(c, spec, mem, r, "cpu"));
  EXPECT_GT(slow.step_s, fast.step_s * 10);
  // Per step: master/m/v/grad read, master/m/v written, and each micro-step's grad shard.
  EXPECT_EQ(fast.bytes_nvme_read, static_cast<uint64_t>(mem.shard_numel) * 16);
  EXPECT_EQ(fast.bytes_nvme_write, static_cast<uint64_t>(mem.shard_numel) * 16);
  EXPECT_GE(slow.step_s, slow.nvme_s);
}

// A bf16 master with 8-bit moments on NVMe: the lane moves the blocks' own sizes (a bf16
// gradient, a bf16 master, about a byte per moment), not fp32's 16 bytes, and the optimizer runs
// at the profile's rate for that layout, or at the fp32 rate with a note where the profile has
// none.
TEST(CostModelTest, CompactLayoutsMoveTheirBytesAtTheirRate) {
  Config c = TuneConfig();
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  c.bf16.bf16_master_weights_and_grads = true;
  c.strata.optimizer_state_dtype = StateDtype::kInt8;
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  ASSERT_OK_AND_ASSIGN(MemoryEstimate mem, EstimateMemory(c, spec));
  EXPECT_EQ(mem.state_layout, "int8+bf16_master");
  const double n = static_cast<double>(mem.shard_numel);
  HardwareProfile h = SyntheticProfile(1.0);
  ASSERT_OK_AND_ASSIGN(Rates fp32_only, RatesFromProfile(h, "cpu", 0));
  fp32_only.nvme_read_gbps = fp32_only.nvme_write_gbps = 1.0;
  ASSERT_OK_AND_ASSIGN(StepPrediction guessed, PredictStep(c, spec, mem, fp32_only, "cpu"));
  ASSERT_EQ(guessed.notes.size(), 1u);
  EXPECT_NE(guessed.notes[0].find("int8+bf16_master"), std::string::npos) << guessed.notes[0];
  EXPECT_NEAR(guessed.optimizer_s, n / 1e9, 1e-12);  // the fp32 rate, 1 G elements/s
  h.adam_layout_gelems_per_s["int8+bf16_master"] = 0.25;
  ASSERT_OK_AND_ASSIGN(HardwareProfile back, HardwareProfile::FromJson(h.ToJson()));
  ASSERT_OK_AND_ASSIGN(Rates r, RatesFromProfile(back, "cpu", 0));
  r.nvme_read_gbps = r.nvme_write_gbps = 1.0;
  ASSERT_OK_AND_ASSIGN(StepPrediction p, PredictStep(c, spec, mem, r, "cpu"));
  EXPECT_TRUE(p.notes.empty());
  EXPECT_NEAR(p.optimizer_s, 4 * n / 1e9, 1e-12);
  // Per element: the bf16 gradient (2), the bf16 master (2; its shard is on the device, so it
  // is a block of its own) and two 8-bit moments (1 + 4/256 each, the shard a whole number of
  // 256-element blocks here). Read: gradient and states; written: states and the gradient.
  const double states = n * (2 + 2 * (1 + 4.0 / 256));
  EXPECT_NEAR(static_cast<double>(p.bytes_nvme_read), n * 2 + states, 64);
  EXPECT_NEAR(static_cast<double>(p.bytes_nvme_write), n * 2 + states, 64);
}

// The optimizer lane runs on the threads the engine gives it (ChooseOptimizerThreads): where its
// updates overlap compute, the physical cores compute leaves. Its rate is the profile's one-thread
// figure times those threads, capped at the all-thread figure. Expected rates written from that
// rule, and the thread count from the engine's own function's contract.
TEST(CostModelTest, TheOptimizerLaneRunsAtItsOwnThreadsRate) {
  Config c = TuneConfig();
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  c.strata.optimizer_state_dtype = StateDtype::kInt8;
  c.gradient_clipping = 1.0;  // stage 3 defers the updates to beside the next forward
  c.strata.overlap_optimizer = true;
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  ASSERT_OK_AND_ASSIGN(MemoryEstimate mem, EstimateMemory(c, spec));
  ASSERT_EQ(mem.state_layout, "int8");
  const double n = static_cast<double>(mem.shard_numel);
  HardwareProfile h = SyntheticProfile(1.0);
  h.adam_layout_gelems_per_s["int8"] = 0.8;  // on 4 threads
  h.adam_threads = 4;
  h.physical_cores = 4;
  h.adam_one_thread_gelems_per_s = {{"fp32", 0.6}, {"int8", 0.25}};
  ASSERT_OK_AND_ASSIGN(HardwareProfile back, HardwareProfile::FromJson(h.ToJson()));
  EXPECT_EQ(back.adam_threads, 4);
  EXPECT_EQ(back.physical_cores, 4);
  EXPECT_EQ(back.adam_one_thread_gelems_per_s, h.adam_one_thread_gelems_per_s);
  ASSERT_OK_AND_ASSIGN(Rates r, RatesFromProfile(back, "cpu", 0));
  const auto lane_rate = [&](const Config& cfg, const Rates& rates, const std::string& device = "cpu") {
    auto p = PredictStep(cfg, spec, mem, rates, device);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? n / p->optimizer_s / 1e9 : 0.0;
  };
  // Compute threads unknown: the profile's all-thread rate, as before.
  EXPECT_NEAR(lane_rate(c, r), 0.8, 1e-9);
  // 3 compute threads of 4 cores: one lane thread, 0.25; with 2, two threads, 0.5.
  r.cpu_compute_threads = 3;
  EXPECT_NEAR(lane_rate(c, r), 0.25, 1e-9);
  r.cpu_compute_threads = 2;
  EXPECT_NEAR(lane_rate(c, r), 0.5, 1e-9);
  // One compute thread: three lane threads, 0.75, below the all-thread 0.8; the GPU's compute
  // takes one thread whatever LibTorch's CPU pool holds.
  r.cpu_compute_threads = 1;
  EXPECT_NEAR(lane_rate(c, r), 0.75, 1e-9);
  r.cpu_compute_threads = 3;
  Config gpu = c;
  gpu.strata.device = "cuda";
  EXPECT_NEAR(lane_rate(gpu, r, "cuda"), 0.75, 1e-9);
  // Updates that run alone in Step get every core: the all-thread figure.
  Config alone = c;
  alone.strata.overlap_optimizer = false;
  EXPECT_NEAR(lane_rate(alone, r), 0.8, 1e-9);
  // strata.optimizer_threads decides: 2 threads, 0.5; 8 (more than profiled), not extrapolated.
  Config two = c;
  two.strata.optimizer_threads = 2;
  EXPECT_NEAR(lane_rate(two, r), 0.5, 1e-9);
  two.strata.optimizer_threads = 8;
  EXPECT_NEAR(lane_rate(two, r), 0.8, 1e-9);
  // A memory-bound layout reaches its all-thread figure before it has every thread: capped.
  Config fp32 = c;
  fp32.strata.optimizer_state_dtype = StateDtype::kFp32;
  ASSERT_OK_AND_ASSIGN(MemoryEstimate mem32, EstimateMemory(fp32, spec));
  r.cpu_compute_threads = 2;
  ASSERT_OK_AND_ASSIGN(StepPrediction p32, PredictStep(fp32, spec, mem32, r, "cpu"));
  EXPECT_NEAR(static_cast<double>(mem32.shard_numel) / p32.optimizer_s / 1e9, 1.0, 1e-9);  // min(1.0, 2 x 0.6)
  // Without a one-thread figure: the all-thread rate scaled by threads, and a note says so.
  r.adam_one_thread.clear();
  r.cpu_compute_threads = 3;
  ASSERT_OK_AND_ASSIGN(StepPrediction scaled, PredictStep(c, spec, mem, r, "cpu"));
  EXPECT_NEAR(n / scaled.optimizer_s / 1e9, 0.2, 1e-9);
  ASSERT_EQ(scaled.notes.size(), 1u);
  EXPECT_NE(scaled.notes[0].find("1 of the profile's 4 threads"), std::string::npos) << scaled.notes[0];
  // Bad figures in a profile are named.
  nlohmann::json bad = h.ToJson();
  bad["adam"]["threads"] = 0;
  EXPECT_NE(std::string(HardwareProfile::FromJson(bad).status().message()).find("adam.threads=0"), std::string::npos);
  bad = h.ToJson();
  bad["adam"]["one_thread"] = {{"int8", -1}};
  EXPECT_NE(std::string(HardwareProfile::FromJson(bad).status().message()).find("adam.one_thread.int8=-1"),
            std::string::npos);
}

// Note [deferred updates in the step]: the lane's updates and the next forward are a two-stage
// pipeline over the chunks. The closed form is checked against an event-by-event run of that
// pipeline (each chunk's forward starts when both its update and the previous chunk's forward
// are done) and against the uniform case worked by hand.
TEST(CostModelTest, DeferredUpdatesPipelineWithTheNextForward) {
  const auto simulate = [](const std::vector<int64_t>& numel, double lane, double forward) {
    double total = 0;
    for (int64_t n : numel) total += static_cast<double>(n);
    double updated = 0, forward_end = 0;
    for (int64_t n : numel) {
      const double share = static_cast<double>(n) / total;
      updated += lane * share;
      forward_end = std::max(forward_end, updated) + forward * share;
    }
    return forward_end - forward;
  };
  const std::vector<std::vector<int64_t>> orders = {
      std::vector<int64_t>(8, 1000), {750, 50, 50, 50, 50, 50}, {10, 990}, {300, 10, 500, 20, 170}, {42}};
  for (const auto& order : orders)
    for (const auto& [lane, forward] : {std::pair{2.0, 1.0}, {1.0, 2.0}, {1.0, 1.0}, {0.0, 1.0}, {3.0, 0.0}})
      EXPECT_NEAR(DeferredUpdatesAdd(order, lane, forward), simulate(order, lane, forward), 1e-12)
          << order.size() << " chunks, lane " << lane << ", forward " << forward;
  // Eight equal chunks: the longer lane adds L - F + F/8; the shorter, its first chunk.
  EXPECT_NEAR(DeferredUpdatesAdd(orders[0], 2.0, 1.0), 1.0 + 1.0 / 8, 1e-12);
  EXPECT_NEAR(DeferredUpdatesAdd(orders[0], 1.0, 2.0), 1.0 / 8, 1e-12);
  // A first chunk of three quarters of the model (a large tied embedding) hides little.
  EXPECT_GE(DeferredUpdatesAdd(orders[1], 1.0, 1.0), 0.75);
}

// Under stage 3, with a global condition (here gradient clipping) and overlap, the updates are
// deferred: the prediction adds what the pipeline above says, over the estimate's chunk order.
// Below stage 3, or without overlap, Step waits for the updates. The norm is summed as the
// gradients land, so no mode pays a pass of its own over them. With the parameters on a GPU
// the first forward is a third of one micro-step's compute.
TEST(CostModelTest, DeferredUpdatesRunBesideTheNextForward) {
  Config c = TuneConfig();
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
  c.gradient_clipping = 1.0;
  c.gradient_accumulation_steps = 2;
  ASSERT_TRUE(c.strata.overlap_optimizer);
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  EstimateOptions on_gpu;
  on_gpu.device = "cuda";
  ASSERT_OK_AND_ASSIGN(MemoryEstimate mem, EstimateMemory(c, spec, on_gpu));
  ASSERT_EQ(static_cast<int64_t>(mem.update_order_shard_numel.size()), mem.chunks);
  int64_t ordered = 0;
  for (int64_t n : mem.update_order_shard_numel) ordered += n;
  EXPECT_EQ(ordered, mem.shard_numel);
  Rates r;
  r.gflops = 1;
  r.copy_gbps = 10;
  r.dram_gbps = 10;
  const auto predict = [&](const Config& cfg, double adam_gelems) {
    r.adam_gelems = adam_gelems;
    auto m = EstimateMemory(cfg, spec, on_gpu);
    EXPECT_TRUE(m.ok()) << m.status();
    auto p = PredictStep(cfg, spec, *m, r, "cuda");
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : StepPrediction{};
  };
  for (double adam : {1e-4, 1e3}) {  // a lane far longer than the forward, and far shorter
    StepPrediction p = predict(c, adam);
    const double first_forward = p.compute_s / 2 / 3;
    const double added = DeferredUpdatesAdd(mem.update_order_shard_numel, p.lane_s, first_forward);
    EXPECT_NEAR(p.step_s, p.main_s + added, 1e-9 * p.step_s) << adam;
    EXPECT_LT(added, p.lane_s) << adam;
  }
  // Step waits for the updates without overlap, and below stage 3.
  Config in_step = c;
  in_step.strata.overlap_optimizer = false;
  StepPrediction waited = predict(in_step, 1e-4);
  EXPECT_NEAR(waited.step_s, waited.main_s + waited.lane_s, 1e-9 * waited.step_s);
  Config stage2 = c;
  stage2.zero_optimization.stage = 2;
  StepPrediction s2 = predict(stage2, 1e-4);
  EXPECT_NEAR(s2.step_s, s2.main_s + s2.lane_s, 1e-9 * s2.step_s);
  // NVMe-homed optimizer groups: the update reads each gradient once, clipped or not.
  Config nvme = c;
  nvme.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  r.nvme_read_gbps = r.nvme_write_gbps = 1.0;
  Config unclipped = nvme;
  unclipped.gradient_clipping = 0;
  const StepPrediction clipped_nvme = predict(nvme, 1e-4);
  const StepPrediction unclipped_nvme = predict(unclipped, 1e-4);
  EXPECT_GT(clipped_nvme.bytes_nvme_read, 0u);
  EXPECT_EQ(clipped_nvme.bytes_nvme_read, unclipped_nvme.bytes_nvme_read);
}

// With W ranks, ring collectives move (W-1) shards per rank: per micro-step a reduce-scatter of
// fp32 gradients and, under stage 3, a parameter all-gather in forward and in backward; below
// stage 3 one all-gather of the updated parameters per step. Expected values are written here
// from that description, not taken from the model.
TEST(CostModelTest, CommTermFollowsRingCollectives) {
  for (int stage : {2, 3}) {
    for (int world : {2, 4}) {
      Config c = TuneConfig();  // bf16: 2-byte working parameters
      c.zero_optimization.stage = stage;
      c.gradient_accumulation_steps = 2;
      c.zero_optimization.offload_optimizer.device = OffloadDevice::kCpu;
      ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
      EstimateOptions eo;
      eo.world_size = world;
      ASSERT_OK_AND_ASSIGN(MemoryEstimate mem, EstimateMemory(c, spec, eo));
      ASSERT_OK_AND_ASSIGN(Rates r, RatesFromProfile(SyntheticProfile(1.0), "cpu", 0));
      EXPECT_FALSE(PredictStep(c, spec, mem, r, "cpu", world).ok()) << "no bandwidth: must fail";
      r.comm_busbw_gbps = 2.0;
      ASSERT_OK_AND_ASSIGN(StepPrediction p, PredictStep(c, spec, mem, r, "cpu", world));
      const double S = static_cast<double>(mem.shard_numel), W = world;
      const double per_micro = (W - 1) * S * 4 + (stage == 3 ? 2 * (W - 1) * S * 2 : 0);
      const double bytes = 2 * per_micro + (stage == 3 ? 0 : (W - 1) * S * 2);
      EXPECT_EQ(p.bytes_comm, static_cast<uint64_t>(bytes)) << "stage " << stage << " world " << world;
      EXPECT_NEAR(p.comm_s, bytes / 2e9, 1e-12);
      r.comm_busbw_gbps = 0.002;  // a thousand times slower: the step grows by the comm time
      ASSERT_OK_AND_ASSIGN(StepPrediction slow, PredictStep(c, spec, mem, r, "cpu", world));
      EXPECT_NEAR(slow.comm_s, p.comm_s * 1000, p.comm_s * 1e-6);
      EXPECT_GE(slow.step_s, p.step_s + 0.9 * (slow.comm_s - p.comm_s));
      ASSERT_OK_AND_ASSIGN(StepPrediction alone, PredictStep(c, spec, mem, r, "cpu", 1));
      EXPECT_EQ(alone.comm_s, 0.0);
    }
  }
}

TEST(TunerTest, MoreThanOneRankNeedsACommFigure) {
  Config c = TuneConfig();
  ASSERT_OK_AND_ASSIGN(ModelSpec spec, GptModelSpec(c.model));
  TuneOptions o;
  o.world_size = 2;
  HardwareProfile prof = SyntheticProfile(1.0);
  auto none = Tune(c, spec, prof, o);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("strata-commbench --profile"), std::string::npos);
  EXPECT_NE(none.status().message().find("--comm-gbps"), std::string::npos);
  prof.comm_busbw_gbps = 3.5;
  prof.comm_backend = "gloo";
  prof.comm_world_size = 2;
  // The section survives the profile's JSON round trip.
  ASSERT_OK_AND_ASSIGN(HardwareProfile back, HardwareProfile::FromJson(prof.ToJson()));
  EXPECT_EQ(back.comm_busbw_gbps, 3.5);
  EXPECT_EQ(back.comm_world_size, 2);
  ASSERT_OK_AND_ASSIGN(TuneResult from_profile, Tune(c, spec, back, o));
  EXPECT_GT(from_profile.candidates.front().prediction.comm_s, 0);
  o.comm_gbps_override = 35;
  ASSERT_OK_AND_ASSIGN(TuneResult overridden, Tune(c, spec, back, o));
  EXPECT_NEAR(overridden.candidates.front().prediction.comm_s * 10,
              from_profile.candidates.front().prediction.comm_s, 1e-9);
}

}  // namespace
}  // namespace strata::planner
