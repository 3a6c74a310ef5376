// The per-step overlap figures (StepReport::FillOverlap against the formula by hand) and
// strata-train's --trace end to end: a Chrome trace-event document with every lane's spans.

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/engine/engine.h"
#include "tests/test_util.h"

namespace strata {
namespace {

StepReport Lanes(double step, double compute, double copy, double comm, double nvme, double optim) {
  StepReport r;
  r.step_time_s = step;
  r.compute_s = compute;
  r.copy_s = copy;
  r.comm_s = comm;
  r.nvme_s = nvme;
  r.optimizer_s = optim;
  r.FillOverlap();
  return r;
}

TEST(StepReportTest, OverlapIsZeroWhenSerialAndOneWhenHidden) {
  // compute 4 + nvme 2 + optimizer 1: 7 s of lane work, 3 s of it off the longest lane.
  StepReport serial = Lanes(7.0, 4, 0, 0, 2, 1);
  EXPECT_DOUBLE_EQ(serial.lane_sum_s, 7.0);
  EXPECT_DOUBLE_EQ(serial.longest_lane_s, 4.0);
  EXPECT_DOUBLE_EQ(serial.overlap, 0.0);
  EXPECT_DOUBLE_EQ(serial.compute_idle_share, 3.0 / 7.0);
  EXPECT_DOUBLE_EQ(Lanes(4.0, 4, 0, 0, 2, 1).overlap, 1.0);
  EXPECT_DOUBLE_EQ(Lanes(5.5, 4, 0, 0, 2, 1).overlap, 0.5);
  // A step longer than its lanes (time no lane accounts for) reads 0, never negative.
  EXPECT_DOUBLE_EQ(Lanes(9.0, 4, 0, 0, 2, 1).overlap, 0.0);
  // The longest lane's own share of a step that hid nothing: the old figure (longest / step)
  // read 0.57 here; the new one says the lanes did not overlap at all.
  EXPECT_NEAR(serial.longest_lane_s / serial.step_time_s, 0.571, 1e-3);
  // One busy lane: nothing could overlap; JSON says null.
  StepReport alone = Lanes(2.0, 2, 0, 0, 0, 0);
  EXPECT_TRUE(std::isnan(alone.overlap));
  EXPECT_TRUE(alone.ToJson()["overlap"].is_null());
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(TrainTraceTest, TraceHasEveryLaneAndTheJsonLinesTheOverlap) {
  testing::TempDir dir;
  // Stage 3 with everything on NVMe and clipping: gathers, NVMe I/O and deferred updates.
  const std::string config = dir.path() + "/c.json";
  std::ofstream(config) << R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
                          "offload_optimizer": {"device": "nvme"},
                          "stage3_param_persistence_threshold": 0},
    "strata": {"chunk_size": "64KiB", "device": "cpu", "host_memory_budget": "512KiB"},
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 256}
  })";
  const std::string trace = dir.path() + "/trace.json";
  auto r = testing::RunCommand(std::string(STRATA_TRAIN_BIN) + " --config " + config +
                               " --nvme-path " + dir.path() + " --steps 4 --json --eval-batches 0" +
                               " --plot '' --trace " + trace + " --trace-steps 2 2>/dev/null");
  ASSERT_EQ(r.rc, 0) << r.out;

  // Per-step JSON: the overlap figures are there and consistent.
  int steps = 0;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != '{') continue;  // the log, on stderr
    auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << line;
    if (j.contains("summary")) {
      EXPECT_TRUE(j.contains("mean_overlap"));
      continue;
    }
    ++steps;
    const double sum = j["lane_sum_s"], longest = j["longest_lane_s"];
    EXPECT_GE(sum, longest);
    EXPECT_NEAR(sum, j["compute_s"].get<double>() + j["copy_s"].get<double>() +
                         j["comm_s"].get<double>() + j["nvme_s"].get<double>() +
                         j["optimizer_s"].get<double>(), 1e-9);
    if (!j["overlap"].is_null()) {
      EXPECT_GE(j["overlap"].get<double>(), 0.0);
      EXPECT_LE(j["overlap"].get<double>(), 1.0);
    }
    EXPECT_GE(j["compute_idle_share"].get<double>(), 0.0);
    EXPECT_LE(j["update_wait_s"].get<double>(), j["stall_s"].get<double>() + 1e-12);
  }
  EXPECT_EQ(steps, 4);

  // The trace: a track per lane, and spans from the traced steps (2 and 3) only.
  auto t = nlohmann::json::parse(Slurp(trace), nullptr, false);
  ASSERT_FALSE(t.is_discarded());
  std::set<std::string> tracks, names;
  std::set<int64_t> forward_steps, adam_chunks;
  for (const auto& e : t["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") tracks.insert(e["args"]["name"]);
    if (e["ph"] != "X") continue;
    names.insert(e["name"]);
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    if (e["name"] == "forward") forward_steps.insert(e["args"]["step"].get<int64_t>());
    if (e["name"] == "adam") adam_chunks.insert(e["args"]["chunk"].get<int64_t>());
  }
  for (const char* lane : {"compute", "compute waits", "copy", "comm", "nvme", "optimizer"})
    EXPECT_TRUE(tracks.count(lane)) << lane;
  for (const char* span : {"forward", "backward", "adam", "nvme busy"})
    EXPECT_TRUE(names.count(span)) << span;
  EXPECT_EQ(forward_steps, (std::set<int64_t>{2, 3}));
  EXPECT_GT(adam_chunks.size(), 1u);  // one span per chunk's update
}

// strata.placement auto without strata.device_reserve: strata-train takes the reserve from the
// estimator's replay of its model's step. With the engine's own default (a quarter of the device)
// this model's plan leaves compute too little and the allocator refuses it; with the replay's
// reserve it trains, its log names the reserve, and its JSON summary has three steps.
TEST(TrainAutoReserveTest, PlacementAutoTakesTheReplaysReserve) {
  testing::TempDir dir;
  auto config = [&](const std::string& reserve) {
    const std::string path = dir.path() + "/c" + reserve + ".json";
    std::ofstream(path) << R"({
      "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "bf16": {"enabled": true, "bf16_master_weights_and_grads": true},
      "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"},
                            "offload_optimizer": {"device": "nvme"}},
      "strata": {"chunk_size": "4MiB", "device": "cpu", "placement": "auto",
                 "device_memory_budget": "96MiB", "host_memory_budget": "256MiB",
                 "optimizer_state_dtype": "int8")"
                        << (reserve.empty() ? "" : ", \"device_reserve\": " + reserve) << R"(},
      "model": {"n_layers": 4, "d_model": 512, "n_heads": 8, "seq_len": 64, "vocab_size": 256,
                "checkpoint_activations": true}
    })";
    return path;
  };
  auto run = [&](const std::string& cfg) {
    return testing::RunCommand(std::string(STRATA_TRAIN_BIN) + " --config " + cfg + " --nvme-path " +
                                   dir.path() + " --steps 3 --eval-batches 0 --plot ''",
                               /*with_stderr=*/true);
  };
  auto quarter = run(config(std::to_string(96 << 20 >> 2)));
  EXPECT_NE(quarter.rc, 0) << quarter.out;
  EXPECT_NE(quarter.out.find("RESOURCE_EXHAUSTED"), std::string::npos) << quarter.out;
  auto replay = run(config(""));
  ASSERT_EQ(replay.rc, 0) << replay.out;
  EXPECT_NE(replay.out.find("placement auto keeps"), std::string::npos) << replay.out;
  EXPECT_NE(replay.out.find("step     3/3"), std::string::npos) << replay.out;
}

}  // namespace
}  // namespace strata
