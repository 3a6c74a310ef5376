// The planner CLIs end to end: exit codes and messages for bad arguments, strata-estimate's JSON
// keys, strata-tune writing a config that parses, from a synthetic profile.

#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/base/config.h"
#include "runtime/base/host_info.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using Result = strata::testing::CommandResult;

Result Exec(const std::string& cmd) { return strata::testing::RunCommand(cmd); }

void Write(const std::string& path, const std::string& text) {
  std::ofstream o(path);
  o << text;
}

const char* kConfig = R"({
  "train_micro_batch_size_per_gpu": 2,
  "bf16": {"enabled": true},
  "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7},
  "strata": {"chunk_size": "64KiB", "device": "cpu"},
  "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 128}
})";

std::string Profile(double nvme_gbps) {
  nlohmann::json j = {
      {"version", 1},
      {"device", "cpu"},
      {"nvme", {{"path", "/tmp"}, {"engine", "io_uring"}, {"points", nlohmann::json::array({
          {{"op", "read"}, {"block_size", 1 << 20}, {"queue_depth", 32}, {"intra_op_parallelism", 1}, {"gbps", nvme_gbps}},
          {{"op", "write"}, {"block_size", 1 << 20}, {"queue_depth", 32}, {"intra_op_parallelism", 1}, {"gbps", nvme_gbps}}})}}},
      {"dram", {{"copy_gbps", 10.0}}},
      {"copies", nlohmann::json::array({{{"device", "cpu"}, {"memory", "pinned"}, {"direction", "h2d"}, {"gbps", 8.0}},
                                        {{"device", "cpu"}, {"memory", "pinned"}, {"direction", "d2h"}, {"gbps", 8.0}}})},
      {"adam", {{"elements", 16777216}, {"gelems_per_s", 1.0}}},
      {"compute", {{"dtype", "bf16"}, {"gflops", 50.0}}}};
  return j.dump();
}

TEST(EstimateCliTest, BadArgumentsExitTwoWithAMessage) {
  Result r = Exec(std::string(STRATA_ESTIMATE_BIN) + " --no-such-flag");
  EXPECT_EQ(r.rc, 2) << r.out;
  r = Exec(std::string(STRATA_ESTIMATE_BIN) + " --params 1e9");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--largest-layer"), std::string::npos) << r.out;
  r = Exec(std::string(STRATA_ESTIMATE_BIN) + " --params 1e9 --largest-layer 1e7 --world-size 0");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--world-size=0"), std::string::npos) << r.out;
  r = Exec(std::string(STRATA_ESTIMATE_BIN) + " --params 1e9 --largest-layer 1e7 --offload-optimizer disk");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("none, cpu or nvme"), std::string::npos) << r.out;
  r = Exec(std::string(STRATA_ESTIMATE_BIN) + " --help");
  EXPECT_EQ(r.rc, 0);
  EXPECT_NE(r.out.find("--world-size"), std::string::npos);
}

TEST(EstimateCliTest, JsonHasEveryTier) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json", kConfig);
  Result r = Exec(std::string(STRATA_ESTIMATE_BIN) + " --json --world-size 2 --config " + dir.path() + "/c.json");
  ASSERT_EQ(r.rc, 0) << r.out;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  for (const char* k : {"hbm_bytes", "host_pinned_bytes", "host_pageable_bytes", "nvme_bytes", "per_state",
                        "breakdown", "activation_bytes"})
    EXPECT_TRUE(j.contains(k)) << k;
  EXPECT_GT(j["hbm_bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(j["world_size"], 2);
}

// --hbm, --host and --disk plan placement auto for another machine: a large device takes every
// block, a tiny one leaves the optimizer groups to a large host, and with no host room they go
// to NVMe; the plan's tiers always hold the whole state. A config placed by its sections refuses the
// flags, and a bad size names the flag.
TEST(EstimateCliTest, AnotherMachinesBudgetsPlanPlacementAuto) {
  testing::TempDir dir;
  auto cfg = nlohmann::json::parse(kConfig);
  cfg["strata"]["placement"] = "auto";
  cfg["zero_optimization"]["offload_optimizer"] = {{"device", "nvme"}, {"nvme_path", {dir.path()}}};
  cfg["zero_optimization"]["offload_param"] = {{"device", "nvme"}, {"nvme_path", {dir.path()}}};
  Write(dir.path() + "/auto.json", cfg.dump());
  const std::string base = std::string(STRATA_ESTIMATE_BIN) + " --json --config " + dir.path() + "/auto.json";
  auto plan = [&](const std::string& flags) {
    Result r = Exec(base + " " + flags);
    EXPECT_EQ(r.rc, 0) << flags << ": " << r.out;
    auto j = nlohmann::json::parse(r.out, nullptr, false);
    std::map<std::string, uint64_t> t;
    if (j.is_discarded() || !j.contains("placement")) {
      ADD_FAILURE() << flags << ": " << r.out;
      return t;
    }
    for (const char* tier : {"device", "host", "nvme"}) t[tier] = j["placement"][tier]["total"].get<uint64_t>();
    return t;
  };
  auto all_device = plan("--hbm 4GiB --host 64GiB --disk 64GiB");
  auto all_host = plan("--hbm 1MiB --host 64GiB --disk 64GiB");
  auto all_nvme = plan("--hbm 1MiB --host 2GiB --disk 64GiB");  // an eighth, at least 2 GiB, is kept
  const uint64_t total = all_device["device"] + all_device["host"] + all_device["nvme"];
  EXPECT_GT(total, 0u);
  EXPECT_EQ(all_device["device"], total);
  // A 1 MiB device keeps the working shards (under 1 MiB here), not the optimizer groups.
  EXPECT_LT(all_host["device"], 1u << 20);
  EXPECT_EQ(all_host["device"] + all_host["host"], total);
  EXPECT_GT(all_host["host"], total / 2);
  EXPECT_EQ(all_nvme["device"], all_host["device"]);
  EXPECT_EQ(all_nvme["host"], 0u);
  EXPECT_EQ(all_nvme["nvme"], all_host["host"]);
  // Sections as written: the flags would not change anything, so they are refused.
  Write(dir.path() + "/c.json", kConfig);
  Result r = Exec(std::string(STRATA_ESTIMATE_BIN) + " --config " + dir.path() + "/c.json --hbm 80GiB");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("placement"), std::string::npos) << r.out;
  r = Exec(base + " --host lots");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--host=lots"), std::string::npos) << r.out;
}

// --largest on a GPU: without --hbm the device is the GPU's free memory a profile made there
// measured, and the prediction has every lane, NVMe's at the profile's figures (the config's aio
// setting was not measured, so at the best point, said so). Before, a cuda --largest needed
// --hbm, and the NVMe lane was predicted at 0 s.
TEST(EstimateCliTest, LargestOnCudaTakesTheProfilesGpuMemoryAndPredictsTheNvmeLane) {
  strata::testing::TempDir dir;
  nlohmann::json profile = nlohmann::json::parse(Profile(1.0));
  profile["device"] = "cuda";
  profile["copies"] = nlohmann::json::array();
  for (const char* d : {"h2d", "d2h"})
    profile["copies"].push_back({{"device", "cuda"}, {"memory", "pinned"}, {"direction", d}, {"gbps", 20.0}});
  profile["compute"] = {{"device", "cuda"}, {"dtype", "bf16"}, {"gflops", 1e5}};
  Write(dir.path() + "/p.json", profile.dump());
  Write(dir.path() + "/c.json", R"({
  "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3},
  "strata": {"chunk_size": "16MiB"}, "model": {"seq_len": 128, "vocab_size": 256}
})");
  const std::string cmd = std::string(STRATA_ESTIMATE_BIN) + " --largest --config " + dir.path() +
                          "/c.json --device cuda --host 4GiB --disk 8GiB --json --profile " + dir.path() + "/p.json";
  // A profile without the GPU's memory gives no device size.
  Result r = Exec(cmd);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--hbm"), std::string::npos) << r.out;
  profile["device_memory"] = {{"name", "cuda:0 (Test GPU)"}, {"capacity_bytes", 2ull << 30}};
  Write(dir.path() + "/p.json", profile.dump());
  r = Exec(cmd);
  ASSERT_EQ(r.rc, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j["budgets"]["device_bytes"].get<uint64_t>(), 2ull << 30);
  ASSERT_GT(j["largest"]["nvme_bytes"].get<uint64_t>(), 0u) << j.dump(2);  // the budgets push state to NVMe
  const nlohmann::json& p = j["prediction"];
  EXPECT_GT(p["bytes_nvme_read"].get<double>(), 0);
  // 1 GB/s each way: the lane's time is its bytes at that rate.
  EXPECT_NEAR(p["nvme_s"].get<double>(),
              (p["bytes_nvme_read"].get<double>() + p["bytes_nvme_write"].get<double>()) / 1e9,
              1e-6 * p["nvme_s"].get<double>());
  EXPECT_NE(j["assumptions"].dump().find("best point"), std::string::npos) << j.dump(2);
}

TEST(TuneCliTest, BadArgumentsExitTwo) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json", kConfig);
  Write(dir.path() + "/p.json", Profile(1.0));
  const std::string base = std::string(STRATA_TUNE_BIN) + " --config " + dir.path() + "/c.json";
  Result r = Exec(std::string(STRATA_TUNE_BIN) + " --profile " + dir.path() + "/p.json");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--config"), std::string::npos) << r.out;
  r = Exec(base + " --profile " + dir.path() + "/missing.json");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("missing.json"), std::string::npos) << r.out;
  r = Exec(base + " --profile " + dir.path() + "/p.json --host-budget lots");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--host-budget=lots"), std::string::npos) << r.out;
  // A profile given as --config: strata-tune has no --params, which the message named.
  r = Exec(std::string(STRATA_TUNE_BIN) + " --config " + dir.path() + "/p.json --profile " +
           dir.path() + "/p.json");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("has no \"model\" section: strata-tune tunes a config strata-train runs"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("--params"), std::string::npos) << r.out;
  Write(dir.path() + "/bad.json", R"({"nvme": {"points": [{"op": "sideways"}]}})");
  r = Exec(base + " --profile " + dir.path() + "/bad.json");
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("nvme.points[0].op"), std::string::npos) << r.out;
  // Figures no machine has, which the ranking used as given: infinite compute, a point no aio
  // config can run (block size 0, queue depth 0), a rate of 0.
  for (const char* flag : {"--gflops inf", "--gflops 1e30", "--comm-gbps 1e30"}) {
    r = Exec(base + " --profile " + dir.path() + "/p.json " + flag);
    EXPECT_EQ(r.rc, 2) << flag << "\n" << r.out;
    EXPECT_NE(r.out.find(std::string(flag).substr(0, std::string(flag).find(' '))), std::string::npos) << r.out;
  }
  const std::pair<const char*, const char*> points[] = {
      {R"("block_size": 0, "queue_depth": 32, "gbps": 1)", "block_size=0"},
      {R"("block_size": 4097, "queue_depth": 32, "gbps": 1)", "block_size=4097"},
      {R"("block_size": 4096, "queue_depth": 0, "gbps": 1)", "queue_depth=0"},
      {R"("block_size": 4096, "queue_depth": 32, "gbps": 0)", "gbps=0"},
  };
  for (const auto& [point, want] : points) {
    Write(dir.path() + "/bad.json", StrCat(R"({"nvme": {"points": [{"op": "read", )", point, "}]}}"));
    r = Exec(base + " --profile " + dir.path() + "/bad.json");
    EXPECT_EQ(r.rc, 2) << point << "\n" << r.out;
    EXPECT_NE(r.out.find(StrCat("nvme.points[0].", want)), std::string::npos) << r.out;
  }
}

TEST(TuneCliTest, WritesAConfigThatParsesAndKeepsOtherKeys) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json", kConfig);
  Write(dir.path() + "/p.json", Profile(0.001));
  const std::string out = dir.path() + "/tuned.json";
  Result r = Exec(std::string(STRATA_TUNE_BIN) + " --config " + dir.path() + "/c.json --profile " + dir.path() +
                 "/p.json --device-budget 1MiB --host-budget 1GiB --nvme-path " + dir.path() + " --out " + out);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("step_s"), std::string::npos) << r.out;
  // Its figures are measured here: it names the machine (CPU model, ISA, cores).
  EXPECT_NE(r.out.find("strata-tune: on " + ReadHostInfo().cpu_model), std::string::npos) << r.out;
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromFile(out));
  // Very slow NVMe and room on the host: the optimizer goes to the host.
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu) << r.out;
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size, 50000000);
  EXPECT_EQ(c.model.d_model, 64);
  EXPECT_EQ(c.strata.chunk_size, 64u << 10);
}

// --verify reports predicted against measured for every lane, not only the step.
TEST(TuneCliTest, VerifyReportsEveryLane) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json", kConfig);
  Write(dir.path() + "/p.json", Profile(1.0));
  Result r = Exec(std::string(STRATA_TUNE_BIN) + " --config " + dir.path() + "/c.json --profile " + dir.path() +
                  "/p.json --host-budget 1GiB --gflops 5 --dry-run --json --verify --verify-steps 3");
  ASSERT_EQ(r.rc, 0) << r.out;
  const size_t start = r.out.find("{\n");  // engine logs on stderr come first
  ASSERT_NE(start, std::string::npos) << r.out;
  auto j = nlohmann::json::parse(r.out.substr(start), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  const auto& lanes = j["verify"]["lanes"];
  for (const char* lane : {"step", "compute", "copy", "nvme", "optimizer", "comm"}) {
    ASSERT_TRUE(lanes.contains(lane)) << lane << ": " << j["verify"].dump();
    EXPECT_GE(lanes[lane]["predicted_s"].get<double>(), 0) << lane;
    EXPECT_GE(lanes[lane]["measured_s"].get<double>(), 0) << lane;
  }
  EXPECT_GT(lanes["step"]["measured_s"].get<double>(), 0);
  EXPECT_GT(lanes["step"]["ratio"].get<double>(), 0);
  EXPECT_GT(lanes["compute"]["predicted_s"].get<double>(), 0);
  // Compute less only the waits inside forward and backward: Step's own copies (refreshing
  // persistent chunks) once made this small model's compute read 0 on a loaded machine.
  EXPECT_GT(lanes["compute"]["measured_s"].get<double>(), 0);
  EXPECT_EQ(lanes["comm"]["predicted_s"].get<double>(), 0);  // one rank
}

// A 4 x 128 GPT at stage 3 (0.83 M parameters, 14.3 MiB of fp32 state), with more keys for
// its "strata" section.
std::string FourByOneTwentyEight(const std::string& strata_keys) {
  return R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true}, "zero_optimization": {"stage": 3},
    "strata": {"chunk_size": "64KiB", "device": "cpu")" +
         strata_keys + R"(},
    "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 32, "vocab_size": 128}})";
}

// A config at strata.placement auto whose host budget (6 MiB) cannot hold the optimizer groups
// (13 MiB): every section as written is refused or spills wholly to NVMe; the per-chunk fill
// splits the groups between device, host and NVMe, wins, and the engine that --verify starts
// makes the same plan, line for line. (The search once stopped at its first candidate with the plan's
// refusal.)
TEST(TuneCliTest, AutoPlacementIsSearchedAndTheEngineMakesTheSamePlan) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json", FourByOneTwentyEight(R"(, "placement": "auto", "host_memory_budget": "6MiB")"));
  Write(dir.path() + "/p.json", Profile(1.0));
  ASSERT_EQ(::mkdir((dir.path() + "/nv").c_str(), 0755), 0);
  const std::string out = dir.path() + "/tuned.json";
  const std::string base = std::string(STRATA_TUNE_BIN) + " --config " + dir.path() + "/c.json --profile " +
                           dir.path() + "/p.json --no-calibrate --device-budget 4MiB --nvme-path " + dir.path() +
                           "/nv --top 20";
  Result r = Exec(base + " --out " + out + " --verify --verify-steps 2");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("chose auto param>=nvme optimizer>=nvme"), std::string::npos) << r.out;
  // Sections as written that the plan refuses are listed as not fitting, with the reason.
  EXPECT_NE(r.out.find("param=none optimizer=cpu"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cannot hold"), std::string::npos) << r.out;
  // The tuner's plan and the engine's, tier by tier.
  std::vector<std::string> tuned_lines, engine_lines;
  std::istringstream lines(r.out);
  const std::string tag = "placement (auto) ";
  for (std::string line; std::getline(lines, line);) {
    const size_t at = line.find(tag);
    if (at == 0) tuned_lines.push_back(line.substr(tag.size()));
    else if (at != std::string::npos && line.find("engine_init.cc") != std::string::npos)
      engine_lines.push_back(line.substr(at + tag.size()));
  }
  ASSERT_EQ(tuned_lines.size(), 3u) << r.out;  // device, host and NVMe all hold state
  EXPECT_EQ(tuned_lines, engine_lines) << r.out;
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromFile(out));
  EXPECT_EQ(c.strata.placement, PlacementMode::kAuto);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kNvme);
  EXPECT_GT(c.strata.device_reserve, 0u);
  EXPECT_EQ(c.strata.device_memory_budget, 4u << 20);
  // Sections as written only: the optimizer goes wholly to NVMe, and the config written from an
  // input at auto says config, or the engine would re-plan what was predicted.
  r = Exec(base + " --placement config --out " + out);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("chose param="), std::string::npos) << r.out;
  ASSERT_OK_AND_ASSIGN(c, Config::FromFile(out));
  EXPECT_EQ(c.strata.placement, PlacementMode::kConfig);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kNvme);
  r = Exec(base + " --placement sideways --dry-run");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--placement=sideways"), std::string::npos) << r.out;
}

// 14.3 MiB of fp32 state against 4 MiB of device, 8 of host and 2 of NVMe: nothing fits as
// written. The answer names the smaller layouts that fit, without choosing one; asked for, one
// is chosen and its keys written.
TEST(TuneCliTest, SmallerLayoutsAreNamedWhenNothingFitsAndChosenWhenAsked) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json", FourByOneTwentyEight(""));
  Write(dir.path() + "/p.json", Profile(1.0));
  const std::string out = dir.path() + "/tuned.json";
  const std::string base = std::string(STRATA_TUNE_BIN) + " --config " + dir.path() + "/c.json --profile " +
                           dir.path() + "/p.json --no-calibrate --device-budget 4MiB --host-budget 8MiB " +
                           "--nvme-budget 2MiB --nvme-path " + dir.path() + " --out " + out;
  Result r = Exec(base);
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("no placement fits"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("It fits with a smaller optimizer-state layout"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("int8+bf16_master ("), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("bytes per parameter"), std::string::npos) << r.out;
  EXPECT_FALSE(std::ifstream(out).good());  // nothing chosen, nothing written
  r = Exec(base + " --layouts int8+bf16_master");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("[int8+bf16_master]; wrote"), std::string::npos) << r.out;
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromFile(out));
  EXPECT_TRUE(c.bf16.bf16_master_weights_and_grads);
  EXPECT_EQ(c.strata.optimizer_state_dtype, StateDtype::kInt8);
  EXPECT_EQ(c.model.d_model, 128);
  for (const char* bad : {"--layouts fp16", "--layouts int8,,bf16", "--layouts ''"}) {
    r = Exec(base + " " + bad);
    EXPECT_EQ(r.rc, 2) << bad << "\n" << r.out;
    EXPECT_NE(r.out.find("--layouts"), std::string::npos) << r.out;
  }
}

// Several ranks: the collectives' bandwidth comes from --comm-gbps or the profile's comm section.
TEST(TuneCliTest, WorldSizeTwoNeedsACommFigure) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json", kConfig);
  Write(dir.path() + "/p.json", Profile(1.0));
  const std::string base = std::string(STRATA_TUNE_BIN) + " --config " + dir.path() + "/c.json --profile " +
                           dir.path() + "/p.json --gflops 5 --dry-run --world-size 2";
  Result r = Exec(base);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--comm-gbps"), std::string::npos) << r.out;
  r = Exec(base + " --comm-gbps fast");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--comm-gbps=fast"), std::string::npos) << r.out;
  r = Exec(base + " --comm-gbps 1.5");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("comm"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("collectives at 1.5 GB/s"), std::string::npos) << r.out;
}

// The compute rate: calibrated on the CPU by default (and reported), the profile's matmul figure
// with --no-calibrate, the user's with --gflops; the cuda device says why it is not calibrated.
TEST(TuneCliTest, CalibratesComputeOnTheCpuUnlessTold) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json", kConfig);
  Write(dir.path() + "/p.json", Profile(1.0));
  const std::string base = std::string(STRATA_TUNE_BIN) + " --config " + dir.path() + "/c.json --profile " +
                           dir.path() + "/p.json --dry-run --json";
  auto report = [](const Result& r) {
    const size_t brace = r.out.find('{');  // log lines may precede the JSON
    return nlohmann::json::parse(r.out.substr(brace == std::string::npos ? 0 : brace));
  };
  Result r = Exec(base);
  ASSERT_EQ(r.rc, 0) << r.out;
  nlohmann::json j = report(r);
  ASSERT_TRUE(j["calibration"].contains("gflops")) << r.out;
  EXPECT_EQ(j["calibration"]["method"], "whole_model");
  const double gflops = j["calibration"]["gflops"].get<double>();
  EXPECT_GT(gflops, 0.0);
  ASSERT_FALSE(j["assumptions"].empty());
  EXPECT_NE(j["assumptions"].dump().find("calibrated"), std::string::npos) << j.dump(2);
  // The predicted compute lane is the model's FLOPs at the calibrated rate (one micro-batch).
  const double flops = j["candidates"][0]["predicted"]["flops"].get<double>();
  const double compute_s = j["candidates"][0]["predicted"]["compute_s"].get<double>();
  EXPECT_NEAR(compute_s, flops / (gflops * 1e9), 1e-6 * compute_s);

  r = Exec(base + " --no-calibrate");
  ASSERT_EQ(r.rc, 0) << r.out;
  j = report(r);
  EXPECT_TRUE(j["calibration"].is_null()) << j.dump(2);
  // The synthetic profile's 50 GFLOP/s.
  EXPECT_NEAR(j["candidates"][0]["predicted"]["compute_s"].get<double>(),
              j["candidates"][0]["predicted"]["flops"].get<double>() / 50e9, 1e-12);

  r = Exec(base + " --gflops 7");
  ASSERT_EQ(r.rc, 0) << r.out;
  j = report(r);
  EXPECT_TRUE(j["calibration"].is_null());
  EXPECT_NE(j["assumptions"].dump().find("(--gflops)"), std::string::npos) << j.dump(2);

  nlohmann::json cuda_profile = nlohmann::json::parse(Profile(1.0));
  for (const char* dir_name : {"h2d", "d2h"})
    cuda_profile["copies"].push_back(
        {{"device", "cuda"}, {"memory", "pinned"}, {"direction", dir_name}, {"gbps", 20.0}});
  Write(dir.path() + "/cuda.json", cuda_profile.dump());
  const std::string on_cuda = std::string(STRATA_TUNE_BIN) + " --config " + dir.path() + "/c.json --profile " +
                              dir.path() + "/cuda.json --dry-run --json --device cuda";
  // Its matmul ran on the CPU: not a GPU's rate.
  r = Exec(on_cuda);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("measured on the cpu"), std::string::npos) << r.out;
  // Profiled on the GPU: its rate, and its free memory as the device budget.
  cuda_profile["compute"]["device"] = "cuda";
  cuda_profile["device_memory"] = {{"name", "cuda:0 (Test GPU)"}, {"capacity_bytes", 1ull << 30}};
  Write(dir.path() + "/cuda.json", cuda_profile.dump());
  r = Exec(on_cuda);
  ASSERT_EQ(r.rc, 0) << r.out;
  j = report(r);
  ASSERT_TRUE(j["calibration"].contains("skipped")) << r.out;
  EXPECT_NE(j["calibration"]["skipped"].get<std::string>().find("CPU only"), std::string::npos);
  EXPECT_EQ(j["device_budget"].get<uint64_t>(), 1ull << 30) << j.dump(2);
  EXPECT_NE(j["assumptions"].dump().find("cuda:0 (Test GPU)'s free memory"), std::string::npos) << j.dump(2);
}

TEST(ProfileCliTest, BadArgumentsExitTwo) {
  Result r = Exec(std::string(STRATA_SWAPBENCH_BIN) + " profile --quick --full");
  EXPECT_EQ(r.rc, 2) << r.out;
  r = Exec(std::string(STRATA_SWAPBENCH_BIN) + " profile --path /no/such/dir");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--path=/no/such/dir"), std::string::npos) << r.out;
  r = Exec(std::string(STRATA_SWAPBENCH_BIN) + " profile --apply /tmp/x.json");
  EXPECT_EQ(r.rc, 2) << r.out;
}

TEST(FormatsCliTest, IsaPicksTheKernelsAndABadOneExitsTwo) {
  Result r = Exec(std::string(STRATA_SWAPBENCH_BIN) + " formats --isa avx1024 --n 1024 --reps 1");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("avx1024"), std::string::npos) << r.out;
  r = Exec(std::string(STRATA_SWAPBENCH_BIN) + " formats --isa scalar --n 4096 --reps 1 --threads 1 --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j["isa"], "scalar");
  ASSERT_EQ(j["layouts"].size(), 6u) << r.out;
  for (const auto& row : j["layouts"]) EXPECT_GT(row["gparams_s"].get<double>(), 0.0) << row.dump();
}

// tiers' default host budget is a quarter of the state but never under what the optimizer step
// pins twice over: four 4 KiB chunks were refused by their own default ("lower --chunk-size",
// already the smallest). What cannot work on the default names --chunks, and a budget below the
// step's pins no longer suggests a smaller chunk when the chunk is the smallest.
TEST(TiersCliTest, FewSmallChunksRunOnTheDefaultBudget) {
  const std::string tiers = std::string(STRATA_SWAPBENCH_BIN) + " tiers";
  Result r = Exec(tiers + " --chunks 4 --chunk-size 4KiB --iterations 1 --json");
  ASSERT_EQ(r.rc, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  EXPECT_EQ(j["host_budget"].get<uint64_t>(), 64u << 10) << r.out;  // 2 x 4 slots of 8 KiB
  EXPECT_EQ(j["total_bytes"].get<uint64_t>(), 128u << 10) << r.out;
  EXPECT_GT(j["bytes_read"].get<uint64_t>(), 0u) << r.out;  // the state really went to NVMe
  EXPECT_NE(r.out.find("case 4 of 4"), std::string::npos) << r.out;  // progress on stderr

  r = Exec(tiers + " --chunks 3 --chunk-size 5MiB");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--chunks=3 of 5.00 MiB: the default --host-budget (128.00 MiB"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("raise --chunks"), std::string::npos) << r.out;
  r = Exec(tiers + " --chunks 8 --chunk-size 4KiB --host-budget 16KiB");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("give at least 64.00 KiB\n"), std::string::npos) << r.out;
  r = Exec(tiers + " --chunks 8 --chunk-size 8KiB --host-budget 16KiB");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("or lower --chunk-size"), std::string::npos) << r.out;
  r = Exec(tiers + " --chunks 2");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--chunks=2: must be an integer in 3.."), std::string::npos) << r.out;
}

// Flags a fuzzing pass found unchecked: each now exits 2 with a message naming the flag and the
// value (before: a crash in TBB or std::vector, an int overflow that printed zeros and exit 0,
// NaN or an empty string taken as "not given", CLI11's own exit codes 104/105).
TEST(CliFlagsTest, OutOfRangeValuesExitTwoNamingTheFlag) {
  const std::string swapbench = STRATA_SWAPBENCH_BIN, train = STRATA_TRAIN_BIN;
  const std::string launch = STRATA_LAUNCH_BIN, commbench = STRATA_COMMBENCH_BIN;
  const std::string estimate = STRATA_ESTIMATE_BIN;
  const std::pair<std::string, std::string> cases[] = {
      {swapbench + " sgd --n 4294967296 --reps 1", "--n=4294967296"},
      {swapbench + " lion --n 4096 --reps 1000000000", "--reps=1000000000"},
      {swapbench + " formats --n 4096 --reps 1 --threads 100000", "--threads=100000"},
      {launch + " --nproc 1 --grace nan -- true", "--grace=nan"},
      {launch + " --nproc 0 -- true", "--nproc"},
      {commbench + " --timeout abc", "--timeout"},
      {commbench + " --bytes 3b --iters 1", "--bytes=3b"},
      {commbench + " --bucket -1 --iters 1", "--bucket=-1"},
      {train + " --lr nan --steps 1", "--lr"},
      {train + " --resume '' --steps 1", "--resume=''"},
      {train + " --nvme-path '' --steps 1", "--nvme-path=''"},
      {train + " --micro-batch 16777217 --steps 1", "--micro-batch"},
      {train + " --threads 100000 --steps 1", "--threads 100000 is more than 1024"},
      // Flags that do nothing without another were ignored: no checkpoint, no trace.
      {train + " --save-every 1 --steps 1", "--save-every requires --save"},
      {train + " --trace-steps 2 --steps 1", "--trace-steps requires --trace"},
      // The reason a size is refused (it said "must be a size above 0" for each), and an empty
      // value, which read as the default.
      {estimate + " --params 1e9 --largest-layer 1e7 --largest --hbm 0.5",
       "not a whole number of bytes"},
      {estimate + " --params 1e9 --largest-layer 1e7 --largest --hbm 1PiB", "unknown unit"},
      {estimate + " --params 1e9 --largest-layer 1e7 --largest --hbm ''",
       "--hbm='': needs a value"},
      // --largest took any --device ("--largest on cuda needs the GPU's memory" for tpu).
      {estimate + " --largest --device tpu --hbm 1GiB", "--device=tpu: must be cpu or cuda"},
      // 10^12 layers of one element each filled memory until std::bad_alloc aborted.
      {estimate + " --params 1e12 --largest-layer 1", "more than the 1000000 modelled"},
      // A buffer no host holds aborted in std::bad_alloc.
      {commbench + " --bytes 1TiB --iters 1", "this host has available"},
  };
  std::vector<std::pair<std::string, std::string>> all(std::begin(cases), std::end(cases));
  // Two formats benchmarks' worth of buffers at the largest --n: about 180 GB.
  if (ReadHostMemory().available_bytes < (uint64_t{150} << 30))
    all.push_back({swapbench + " formats --n 2147483648 --reps 1",
                   "this host has available; give a smaller --n"});
  for (const auto& [cmd, want] : all) {
    const Result r = Exec(cmd);
    EXPECT_EQ(r.rc, 2) << cmd << "\n" << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << cmd << "\n" << r.out;
  }
  // No GPT fitting the budgets is an answer, not a usage error: exit 1, the reason naming the
  // flags that gave the budgets (it named the config key --hbm had replaced, and the host's and
  // the disk's measures), and under --json a report with "largest": null (it printed none).
  const std::string tight = estimate + " --largest --hbm 60MiB --host 1GiB --disk 1GiB";
  Result r = Exec(tight);
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("(--hbm 60.00 MiB), host 0 B (--host 1.00 GiB less 2.00 GiB"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("nvme 0 B (--disk 1.00 GiB"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("--help"), std::string::npos) << r.out;
  r = strata::testing::RunCommand(tight + " --json", /*with_stderr=*/false);
  EXPECT_EQ(r.rc, 1) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  EXPECT_TRUE(j["largest"].is_null()) << r.out;
  EXPECT_NE(j.value("reason", "").find("no GPT of the GPT-3 widths fits"), std::string::npos)
      << r.out;
  EXPECT_EQ(j["budgets"]["device_bytes"].get<uint64_t>(), uint64_t{60} << 20) << r.out;
}

// A micro-batch whose activations alone exceed the host's available memory is refused before
// the model is built, naming the figure and the keys that lower it (it was killed by the kernel,
// or failed in LibTorch's allocator with no word of the micro-batch).
TEST(CliFlagsTest, AMicroBatchBeyondMemoryIsRefusedBeforeTheModelIsBuilt) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json", R"({
    "train_micro_batch_size_per_gpu": "auto",
    "zero_optimization": {"stage": 2},
    "strata": {"chunk_size": "1MiB", "device": "cpu"},
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 128, "vocab_size": 256}
  })");
  const Result r = Exec(std::string(STRATA_TRAIN_BIN) + " --config " + dir.path() +
                        "/c.json --micro-batch 4000000 --steps 1 --plot ''");
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("one micro-batch of 4000000 x 128 tokens keeps"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("the host has available"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("building the model"), std::string::npos) << r.out;
  // A model whose fp32 parameters alone outgrow the host (12 T of them) is refused before it is
  // built, naming the way to build it on disk; it failed in LibTorch's allocator.
  Write(dir.path() + "/huge.json", R"({
    "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "strata": {"device": "cpu"},
    "model": {"n_layers": 1, "d_model": 1048576, "n_heads": 8, "seq_len": 8, "vocab_size": 256}
  })");
  const Result huge = Exec(std::string(STRATA_TRAIN_BIN) + " --config " + dir.path() + "/huge.json --steps 1 --plot ''");
  EXPECT_EQ(huge.rc, 1) << huge.out;
  EXPECT_NE(huge.out.find("of fp32 host memory before the engine places them"), std::string::npos) << huge.out;
  EXPECT_NE(huge.out.find("offload_param.device nvme"), std::string::npos) << huge.out;
  EXPECT_EQ(huge.out.find("building the model:"), std::string::npos) << huge.out;
}

// What the engine would refuse only once the model is built and the engine started is refused
// first: a --resume of another model size, of another data seed or of no checkpoint, and fp16
// on the cpu device. The same checkpoint resumes under its own config.
TEST(CliFlagsTest, ABadResumeOrFp16OnTheCpuIsRefusedBeforeTheModelIsBuilt) {
  testing::TempDir dir;
  const std::string model = R"("model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32,
                                         "vocab_size": 256, "seed": 7})";
  Write(dir.path() + "/c.json",
        R"({"zero_optimization": {"stage": 2}, "strata": {"device": "cpu"}, )" + model + "}");
  const std::string train = std::string(STRATA_TRAIN_BIN) + " --eval-batches 0 --plot '' ";
  Result r =
      Exec(train + "--config " + dir.path() + "/c.json --steps 1 --save " + dir.path() + "/ck");
  ASSERT_EQ(r.rc, 0) << r.out;
  r = Exec(train + "--config " + dir.path() + "/c.json --steps 2 --resume " + dir.path() + "/ck");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << r.out;

  std::string wider = model;
  wider.replace(wider.find("\"d_model\": 64"), 13, "\"d_model\": 96");
  std::string reseeded = model;
  reseeded.replace(reseeded.find("\"seed\": 7"), 9, "\"seed\": 8");
  // Another head count changes no parameter's shape: only the recorded model section tells.
  std::string other_heads = model;
  other_heads.replace(other_heads.find("\"n_heads\": 4"), 12, "\"n_heads\": 2");
  Write(dir.path() + "/heads.json", R"({"strata": {"device": "cpu"}, )" + other_heads + "}");
  Write(dir.path() + "/wider.json", R"({"strata": {"device": "cpu"}, )" + wider + "}");
  Write(dir.path() + "/reseeded.json", R"({"strata": {"device": "cpu"}, )" + reseeded + "}");
  Write(dir.path() + "/fp16.json",
        R"({"fp16": {"enabled": true}, "strata": {"device": "cpu"}, )" + model + "}");
  const std::pair<std::string, std::string> cases[] = {
      {"wider.json --resume " + dir.path() + "/ck",
       "this config's model (its \"model\" section) has"},
      {"reseeded.json --resume " + dir.path() + "/ck", "was trained with model.seed=7"},
      {"heads.json --resume " + dir.path() + "/ck",
       "was trained with model.n_heads=4; this config has 2"},
      {"c.json --resume " + dir.path() + "/none", "does not exist"},
      {"fp16.json", "fp16.enabled=true on the cpu device"},
  };
  for (const auto& [args, want] : cases) {
    r = Exec(train + "--steps 2 --config " + dir.path() + "/" + args);
    EXPECT_EQ(r.rc, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << args << "\n" << r.out;
    EXPECT_EQ(r.out.find("GPT 2 layers"), std::string::npos) << args << ": refused after the model";
  }
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Where strata-train writes is checked before the model is built: a --save that is a file, or
// one checkpoint rather than the folder of them (the next save went inside it, where no resume
// found it), a --trace or --plot over the config (they replaced it), a directory that does not
// exist. Each is refused with exit 2, naming the flag, and the config is left as it was.
TEST(CliFlagsTest, OutputPathsAreCheckedBeforeTheModelIsBuilt) {
  testing::TempDir dir;
  const std::string d = dir.path();
  const std::string config = R"({"zero_optimization": {"stage": 2}, "strata": {"device": "cpu"},
      "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 256}})";
  Write(d + "/c.json", config);
  Write(d + "/file", "x");
  std::filesystem::create_directories(d + "/corpus");
  const std::string text(4096, 'a');
  Write(d + "/corpus/a.txt", text);
  Write(d + "/corpus/b.txt", text);
  const std::string train = std::string(STRATA_TRAIN_BIN) + " --eval-batches 0 --config " + d + "/c.json ";
  Result r = Exec(train + "--steps 1 --plot '' --save " + d + "/ck");
  ASSERT_EQ(r.rc, 0) << r.out;
  const std::string step = d + "/ck/step-00000001";
  const std::pair<std::string, std::string> cases[] = {
      {"--plot '' --save " + d + "/file", "--save " + d + "/file is a file"},
      {"--plot '' --save " + step, "save to the folder that holds it, " + d + "/ck"},
      {"--plot '' --save " + step + "/", "save to the folder that holds it, " + d + "/ck"},
      {"--plot " + d + "/c.json", "--plot " + d + "/c.json is also --config"},
      {"--plot '' --trace " + d + "/c.json", "--trace " + d + "/c.json is also --config"},
      {"--plot '' --trace " + d + "/none/t.json", "its directory " + d + "/none does not exist"},
      {"--plot " + d + "/ck", "--plot " + d + "/ck is a directory"},
      {"--plot '' --save /proc/strata-ck", "--save /proc/strata-ck: cannot create it"},
      // A --data directory is read whole: a plot or trace written into it replaced training
      // text, and the next run trained on SVG.
      {"--data " + d + "/corpus --plot " + d + "/corpus/b.txt",
       "--plot " + d + "/corpus/b.txt is in the --data directory"},
      {"--data " + d + "/corpus --plot '' --trace " + d + "/corpus/new.json",
       "--trace " + d + "/corpus/new.json is in the --data directory"},
  };
  for (const auto& [args, want] : cases) {
    r = Exec(train + "--steps 1 " + args);
    EXPECT_EQ(r.rc, 2) << args << "\n" << r.out;
    EXPECT_NE(r.out.find(want), std::string::npos) << args << "\n" << r.out;
    EXPECT_EQ(r.out.find("GPT 2 layers"), std::string::npos) << args << ": refused after the model";
  }
  EXPECT_EQ(ReadAll(d + "/c.json"), config);
  EXPECT_EQ(ReadAll(d + "/corpus/b.txt"), text);
  EXPECT_FALSE(std::filesystem::exists(d + "/corpus/new.json"));
  EXPECT_FALSE(std::filesystem::exists(step + "/step-00000001")) << "a save went inside a checkpoint";
  // The default plot in a working directory the run cannot write is left out with a warning
  // (its failure at the end only warned), not refused.
  r = Exec("cd /proc && " + train + "--steps 1");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("no plot is written"), std::string::npos) << r.out;
  // The checks leave no probe files behind, and the checkpoint still resumes.
  for (const auto& e : std::filesystem::directory_iterator(d + "/ck"))
    EXPECT_EQ(e.path().filename().string().find(".strata-write-check"), std::string::npos) << e.path();
  r = Exec(train + "--plot '' --steps 2 --resume " + step + " --save " + d + "/ck");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(std::filesystem::exists(d + "/ck/step-00000002/rank-00000.json")) << r.out;
}

// A --trace that cannot be written at the end (its disk full) ended the run with exit 1 before
// its final save, losing the steps trained. It warns, as a failed plot does, and the run saves.
TEST(CliFlagsTest, ATraceThatCannotBeWrittenStillLeavesTheRunSaved) {
  testing::TempDir dir;
  const std::string d = dir.path();
  std::filesystem::create_directories(d + "/full");
  testing::TmpfsMount full(d + "/full", "size=4k");
  if (!full.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here";
  Write(d + "/full/filler", std::string(8192, 'x'));  // every block taken (a file still opens)
  Write(d + "/c.json", R"({"zero_optimization": {"stage": 2}, "strata": {"device": "cpu"},
      "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 256}})");
  const Result r =
      Exec(std::string(STRATA_TRAIN_BIN) + " --eval-batches 0 --plot '' --config " + d +
           "/c.json --steps 3 --trace " + d + "/full/trace.json --save " + d + "/ck");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("--trace " + d + "/full/trace.json not written"), std::string::npos)
      << r.out;
  EXPECT_TRUE(std::filesystem::exists(d + "/ck/step-00000003/rank-00000.json")) << r.out;
}

// An interrupted strata-swapbench tiers left its swap file and index (1 GiB at the defaults) on
// the disk it measured; --keep is what keeps them. SIGTERM now removes them, and the run ends as
// the signal ends it (the shell's 128 + 15).
TEST(CliFlagsTest, AnInterruptedTiersBenchmarkRemovesItsSwapFile) {
  testing::TempDir dir;
  const std::string d = dir.path() + "/tiers";
  std::filesystem::create_directories(d);
  const std::string cmd =
      std::string(STRATA_SWAPBENCH_BIN) + " tiers --path " + d +
      " --chunks 8 --chunk-size 1MiB --iterations 1000 >/dev/null 2>&1 & p=$!; for i in $(seq 400);"
      " do [ -e " +
      d +
      "/strata-rank0.swap ] && break; sleep 0.05; done; sleep 0.3; kill -TERM $p;"
      " wait $p; echo rc=$?";
  const Result r = Exec(cmd);
  EXPECT_NE(r.out.find("rc=143"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(d + "/strata-rank0.swap")) << r.out;
  EXPECT_FALSE(std::filesystem::exists(d + "/strata-rank0.index")) << r.out;
}

// A save of a step the root already holds, from another run, printed "saved" and kept the other
// run's weights (the step's manifest existed, so nothing was written). It replaces them, and the
// exchange leaves no temporary folder behind.
TEST(CliFlagsTest, ASaveOverAnotherRunsStepReplacesIt) {
  testing::TempDir dir;
  const std::string d = dir.path();
  const std::string model = R"("model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16,
                                         "vocab_size": 256})";
  Write(d + "/a.json",
        R"({"zero_optimization": {"stage": 2}, "strata": {"device": "cpu"}, )" + model + "}");
  Write(d + "/b.json", R"({"zero_optimization": {"stage": 2}, "strata": {"device": "cpu"},
      "optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, )" +
                           model + "}");
  const std::string train =
      std::string(STRATA_TRAIN_BIN) + " --eval-batches 0 --plot '' --steps 2 ";
  Result r = Exec(train + "--config " + d + "/a.json --save " + d + "/ck");
  ASSERT_EQ(r.rc, 0) << r.out;
  const std::string bin = d + "/ck/step-00000002/rank-00000.bin";
  const std::string first = ReadAll(bin);
  r = Exec(train + "--config " + d + "/b.json --save " + d + "/fresh");
  ASSERT_EQ(r.rc, 0) << r.out;
  const std::string want = ReadAll(d + "/fresh/step-00000002/rank-00000.bin");
  ASSERT_NE(first, want) << "the two runs' weights should differ";
  r = Exec(train + "--config " + d + "/b.json --save " + d + "/ck");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("checkpoint step 2 saved"), std::string::npos) << r.out;
  EXPECT_EQ(ReadAll(bin), want) << "the older run's step 2 was kept";
  for (const auto& e : std::filesystem::directory_iterator(d + "/ck"))
    if (e.path().filename() != ".strata-save.lock")
      EXPECT_NE(e.path().filename().string()[0], '.') << "left behind: " << e.path();
  // Saved every step, with the last step both periodic and final: written once.
  r = Exec(train + "--config " + d + "/a.json --save-every 1 --save " + d + "/every");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out.find("checkpoint step 2 saved"), r.out.rfind("checkpoint step 2 saved")) << r.out;
  EXPECT_TRUE(std::filesystem::exists(d + "/every/step-00000001/rank-00000.json")) << r.out;
}

// What a run leaves out was left out without a word: a flag the config's own value overrides
// (--lr, --micro-batch fill "auto" values only), and a --data directory's links, folders and
// lone *.dat files. Each is named; fortune's own *.dat indexes and *.u8 links stay silent.
TEST(CliFlagsTest, WhatARunLeavesOutIsNamed) {
  testing::TempDir dir;
  const std::string d = dir.path();
  Write(d + "/c.json", R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
      "strata": {"device": "cpu"}, "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
      "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16, "vocab_size": 256}})");
  std::filesystem::create_directories(d + "/data/sub");
  std::string text;
  for (int i = 0; i < 40; ++i) text += "the quick brown fox jumps over the lazy dog\n";
  Write(d + "/data/a", text);
  Write(d + "/data/a.dat", "fortune's index of a");
  std::filesystem::create_symlink("a", d + "/data/a.u8");
  Write(d + "/elsewhere.txt", text);
  std::filesystem::create_symlink(d + "/elsewhere.txt", d + "/data/link.txt");
  Write(d + "/data/train.dat", text);
  const Result r =
      Exec(std::string(STRATA_TRAIN_BIN) + " --eval-batches 0 --plot '' --steps 1 --config " + d +
           "/c.json --lr 0.5 --micro-batch 3 --data " + d + "/data");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("--lr 0.5 not used: the config sets optimizer.params.lr to 0.05"),
            std::string::npos)
      << r.out;
  EXPECT_NE(
      r.out.find("--micro-batch 3 not used: the config sets train_micro_batch_size_per_gpu to 2"),
      std::string::npos)
      << r.out;
  EXPECT_NE(
      r.out.find(
          "3 entries left out (symbolic links, folders and fortune's *.dat indexes are not read): "
          "link.txt, sub, train.dat"),
      std::string::npos)
      << r.out;
}

// Signals. During the start there is nothing to save, and a start can block for good (here a
// FIFO with no writer given as --data): one SIGTERM, as `timeout` sends, ends it at once (it
// was ignored until the start finished). Once training, a SIGINT that reaches one rank of two
// stops both after the same step, and the checkpoint is written by both (the rank that stopped
// alone waited in the save's barrier while the other waited in the next step's collectives).
TEST(TrainSignalsTest, AStartEndsAtOnceAndRanksStopTogether) {
  testing::TempDir dir;
  const std::string d = dir.path();
  Write(d + "/c.json", R"({"zero_optimization": {"stage": 2}, "strata": {"device": "cpu"},
      "model": {"n_layers": 1, "d_model": 32, "n_heads": 2, "seq_len": 16, "vocab_size": 256}})");
  const std::string train =
      std::string(STRATA_TRAIN_BIN) + " --eval-batches 0 --plot '' --config " + d + "/c.json ";
  // The signal is sent once the start is blocked opening the FIFO (wait_for_partner), not while
  // the process is still loading, when the default action would end it anyway.
  Result r = Exec("{ mkfifo " + d + "/fifo; " + train + "--steps 1 --data " + d + "/fifo & p=$!; "
                  "for i in $(seq 600); do [ \"$(cat /proc/$p/wchan 2>/dev/null)\" = wait_for_partner ] && break; "
                  "sleep 0.1; done; start=$(date +%s); kill -TERM $p; (sleep 60; kill -KILL $p) >/dev/null 2>&1 & k=$!; wait $p; "
                  "echo \"rc=$? took=$(( $(date +%s) - start ))\"; kill $k; } 2>&1");
  EXPECT_NE(r.out.find("interrupted during the start; nothing trained or saved"), std::string::npos)
      << r.out;
  const size_t took = r.out.find("took=");
  ASSERT_NE(took, std::string::npos) << r.out;
  EXPECT_LT(std::atoi(r.out.c_str() + took + 5), 30) << r.out;

  // Rank 1 alone is interrupted once step 1's checkpoint is published (so, in the loop).
  const std::string ck = d + "/ck";
  r = Exec("{ timeout -k 10 240 " + std::string(STRATA_LAUNCH_BIN) +
           " --nproc 2 -- sh -c 'if [ $RANK = 1 ]; then "
           "(while [ ! -e " +
           ck + "/step-00000001 ]; do sleep 0.05; done; kill -INT $$) & fi; exec " +
           STRATA_TRAIN_BIN + " --eval-batches 0 --plot \"\" --config " + d +
           "/c.json --steps 100000 --save-every 1 " + "--save " + ck + "'; echo \"rc=$?\"; } 2>&1");
  EXPECT_NE(r.out.find("rc=130"), std::string::npos) << r.out;
  const std::string latest = ReadAll(ck + "/latest");
  ASSERT_EQ(latest.rfind("step-", 0), 0u) << r.out;
  for (const char* f : {"/rank-00000.json", "/rank-00001.json"})
    EXPECT_TRUE(std::filesystem::exists(ck + "/" + latest + f)) << latest << f << "\n" << r.out;
  EXPECT_EQ(r.out.find("Connection closed"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("timed out"), std::string::npos) << r.out;
  // Rank 0 stopped after the same step on its own, within strata-launch's grace period.
  EXPECT_EQ(r.out.find("terminating"), std::string::npos) << r.out;

  // A trace over steps the run never took was left out without a word.
  r = Exec(train + "--steps 1 --trace " + d + "/t.json");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("--trace " + d +
                       "/t.json not written: a trace records the steps after the run's first"),
            std::string::npos)
      << r.out;
}

// strata-tune's --out may not be its --profile or --config (it replaced the measured profile
// with a config); strata-estimate's --gflops sets --largest's compute rate for a profile
// without one, and is refused without --largest and --profile.
TEST(TuneCliTest, OutMayNotReplaceAnInputAndEstimateTakesGflops) {
  testing::TempDir dir;
  const std::string d = dir.path();
  Write(d + "/c.json", kConfig);
  Write(d + "/p.json", Profile(1.0));
  const std::string tune = std::string(STRATA_TUNE_BIN) + " --config " + d + "/c.json --profile " + d +
                           "/p.json --no-calibrate --device-budget 1MiB --host-budget 1GiB --nvme-path " + d;
  for (const std::string input : {"p.json", "c.json"}) {
    const std::string before = ReadAll(d + "/" + input);
    const Result r = Exec(tune + " --out " + d + "/" + input);
    EXPECT_EQ(r.rc, 2) << r.out;
    EXPECT_NE(r.out.find("--out " + d + "/" + input + " is also --"), std::string::npos) << r.out;
    EXPECT_EQ(ReadAll(d + "/" + input), before) << input << " was written";
  }
  nlohmann::json no_compute = nlohmann::json::parse(Profile(1.0));
  no_compute.erase("compute");
  Write(d + "/nc.json", no_compute.dump());
  const std::string estimate = std::string(STRATA_ESTIMATE_BIN) + " --largest --hbm 1GiB --host 4GiB --disk 8GiB ";
  Result r = Exec(estimate + "--profile " + d + "/nc.json");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--gflops"), std::string::npos) << r.out;
  r = Exec(estimate + "--profile " + d + "/nc.json --gflops 50");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("compute rate 50 GFLOP/s"), std::string::npos) << r.out;
  r = Exec(std::string(STRATA_ESTIMATE_BIN) + " --params 1e6 --gflops 50");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("pass it with --largest and --profile"), std::string::npos) << r.out;
  r = Exec(estimate + "--profile " + d + "/nc.json --gflops inf");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("--gflops=inf"), std::string::npos) << r.out;
}

// strata-swapbench nvme refuses a file larger than the disk's free space before writing, and
// leaves nothing behind (it filled the disk, failed, and kept the partial file); profile
// --apply refuses a config with comments before the sweep, since rewriting it would drop them.
TEST(ProfileCliTest, NvmeBenchesDoNotFillTheDiskAndApplyKeepsComments) {
  testing::TempDir dir;
  const std::string d = dir.path();
  const uint64_t free_bytes = FreeDiskBytes(d);
  ASSERT_GT(free_bytes, 0u);
  const std::string size = std::to_string(free_bytes / (1ull << 20) * 2 + (64ull << 10)) + "MiB";
  Result r = Exec(std::string(STRATA_SWAPBENCH_BIN) + " nvme --path " + d + " --rw write --size " + size);
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("lower --size or free disk space"), std::string::npos) << r.out;
  EXPECT_TRUE(std::filesystem::is_empty(d)) << "the bench left a file in " << d;
  Write(d + "/cfg.json", "{\n  // tuned by hand\n  \"train_micro_batch_size_per_gpu\": 1\n}\n");
  r = Exec(std::string(STRATA_SWAPBENCH_BIN) + " profile --quick --no-fio --path " + d + " --apply " + d + "/cfg.json");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("holds comments"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("GB/s"), std::string::npos) << "refused after measuring:\n" << r.out;
}

// placement auto asks the estimator's replay for the device reserve; a config the replay
// refuses is refused by the engine too, with its own error, and the replay's line that would
// precede it (keeping the default reserve, because of that same error) is not printed.
TEST(CliFlagsTest, AnInvalidAutoPlacedConfigIsRefusedOnceWithItsOwnError) {
  testing::TempDir dir;
  Write(dir.path() + "/c.json",
        R"({"zero_optimization": {"stage": 1}, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
            "strata": {"device": "cpu", "placement": "auto", "optimizer_state_dtype": "int8"},
            "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 256}})");
  const Result r = Exec(std::string(STRATA_TRAIN_BIN) +
                        " --eval-batches 0 --plot '' --steps 1 --config " + dir.path() + "/c.json");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_NE(r.out.find("SGD without momentum keeps no optimizer state"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("default device reserve"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace strata
