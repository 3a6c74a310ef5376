// strata-estimate against what the operating system measures: the peak RSS of real strata-train
// runs (getrusage's ru_maxrss, reported as peak_rss_bytes). On the CPU device every tier is host
// memory, so the estimate's device, pinned and pageable bytes, activations included, all land in
// RSS. The process also holds a baseline the estimate does not model (LibTorch's code and
// allocator, the text, thread stacks). Two model sizes under the same placement cancel it: the
// RSS growth from the small model to the large one must match the estimate's growth within 10 %,
// and the baseline each run implies (RSS - estimate) must agree across placements. Then a whole
// NVMe run must stay within its host budget plus that stated overhead.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace strata {
namespace {

// The JSON line of `out` holding `key` (strata-train --json prints one per step, then a summary).
nlohmann::json LineWith(const std::string& out, const std::string& key) {
  size_t start = 0;
  nlohmann::json found;
  while (start < out.size()) {
    size_t end = out.find('\n', start);
    if (end == std::string::npos) end = out.size();
    auto j = nlohmann::json::parse(out.substr(start, end - start), nullptr, false);
    if (!j.is_discarded() && j.is_object() && j.contains(key)) found = j;
    start = end + 1;
  }
  return found;
}

struct Sizes {
  double rss = 0;          // bytes, measured
  double estimate = 0;     // bytes: device + pinned + pageable
  double device = 0;       // bytes: the estimate's device part (host RAM on the CPU device)
  double model_state = 0;  // bytes of parameters, gradients and Adam states (the run's report)
  double host_budget = 0;  // bytes: the pinned pool the run used
};

Sizes Measure(const std::string& dir, const std::string& name, const std::string& zero, bool large,
              const std::string& strata_extra = "") {
  const std::string model = large
      ? R"("model": {"n_layers": 6, "d_model": 768, "n_heads": 8, "seq_len": 128, "vocab_size": 256})"
      : R"("model": {"n_layers": 4, "d_model": 256, "n_heads": 8, "seq_len": 128, "vocab_size": 256})";
  const std::string path = dir + "/" + name + (large ? "_large" : "_small") + ".json";
  std::ofstream(path) << "{\"train_micro_batch_size_per_gpu\": " << (large ? 4 : 8)
                      << ", \"zero_optimization\": " << zero
                      << ", \"strata\": {\"chunk_size\": \"1MiB\", \"device\": \"cpu\"" << strata_extra << "}, "
                      << model << "}";
  Sizes s;
  const auto [rc, train] = testing::RunCommand(std::string(STRATA_TRAIN_BIN) +
                                                   " --json --steps 2 --eval-every 0 --plot " + dir +
                                                   "/plot.svg --config " + path,
                                               /*with_stderr=*/false);
  EXPECT_EQ(rc, 0) << name << ": " << train.substr(0, 2000);
  const nlohmann::json summary = LineWith(train, "peak_rss_bytes");
  EXPECT_FALSE(summary.is_null()) << name << ": no summary in " << train.substr(0, 2000);
  if (!summary.is_null()) {
    s.rss = summary["peak_rss_bytes"].get<double>();
    s.model_state = summary["model_state_bytes"].get<double>();
    s.host_budget = summary["engine"]["host_budget"].get<double>();
  }
  const auto [est_rc, est] =
      testing::RunCommand(std::string(STRATA_ESTIMATE_BIN) + " --json --config " + path, /*with_stderr=*/false);
  EXPECT_EQ(est_rc, 0) << name << ": " << est.substr(0, 2000);
  auto e = nlohmann::json::parse(est, nullptr, false);
  EXPECT_FALSE(e.is_discarded()) << est.substr(0, 2000);
  if (!e.is_discarded()) {
    s.device = e["hbm_bytes"].get<double>();
    s.estimate = s.device + e["host_pinned_bytes"].get<double>() + e["host_pageable_bytes"].get<double>();
  }
  return s;
}

TEST(EstimateVsProcessTest, RssGrowthMatchesTheEstimate) {
  testing::TempDir dir;
  const std::string nvme = dir.path() + "/nvme";
  std::filesystem::create_directories(nvme);  // an nvme_path must exist (the engine creates none)
  const std::pair<const char*, std::string> placements[] = {
      {"stage3", R"({"stage": 3})"},
      {"stage2_cpu", R"({"stage": 2, "offload_optimizer": {"device": "cpu"}})"},
      {"stage3_nvme", R"({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": ")" + nvme +
                          R"("}, "offload_optimizer": {"device": "nvme", "nvme_path": ")" + nvme + R"("}})"}};
  double min_base = 1e18, max_base = 0;
  for (const auto& [name, zero] : placements) {
    const Sizes small = Measure(dir.path(), name, zero, false);
    const Sizes large = Measure(dir.path(), name, zero, true);
    const double grown = large.rss - small.rss, predicted = large.estimate - small.estimate;
    std::printf("%-12s RSS %.1f -> %.1f MiB, estimate %.1f -> %.1f MiB: growth %.1f vs %.1f MiB (%.3f)\n", name,
                small.rss / 1048576, large.rss / 1048576, small.estimate / 1048576, large.estimate / 1048576,
                grown / 1048576, predicted / 1048576, predicted / grown);
    ASSERT_GT(grown, 256.0 * 1048576) << name << ": the large model should need hundreds of MiB more";
    EXPECT_NEAR(predicted / grown, 1.0, 0.10) << name;
    for (const Sizes& s : {small, large}) {
      min_base = std::min(min_base, s.rss - s.estimate);
      max_base = std::max(max_base, s.rss - s.estimate);
    }
  }
  // One process baseline for every run: the estimate misses nothing that scales with the model
  // or the placement.
  std::printf("baseline (RSS - estimate): %.1f to %.1f MiB\n", min_base / 1048576, max_base / 1048576);
  EXPECT_LT(max_base - min_base, 64.0 * 1048576);

  // Host within budget, as the process sees it: a whole NVMe run whose model state is several
  // times a 128 MiB host budget peaks at no more than that budget plus a stated overhead - the
  // device memory the estimate gives (host RAM on the CPU device: gathered chunks, gradient
  // buffers, activations) and the process baseline measured above, with 32 MiB of slack.
  const Sizes tight = Measure(dir.path(), "stage3_nvme_128MiB", placements[2].second, true,
                              R"(, "host_memory_budget": "128MiB")");
  ASSERT_EQ(tight.host_budget, 128.0 * 1048576);
  ASSERT_GT(tight.model_state, 4 * tight.host_budget) << "the states must not fit in the budget";
  const double allowed = tight.host_budget + tight.device + max_base + 32.0 * 1048576;
  std::printf("128 MiB host budget, %.1f MiB of model state: peak RSS %.1f MiB, allowed %.1f MiB "
              "(budget + device %.1f + baseline %.1f + 32)\n",
              tight.model_state / 1048576, tight.rss / 1048576, allowed / 1048576, tight.device / 1048576,
              max_base / 1048576);
  EXPECT_LE(tight.rss, allowed);
}

}  // namespace
}  // namespace strata
