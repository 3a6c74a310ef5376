// strata-tune: picks where each training state lives (device, host, NVMe) and the aio settings,
// from measured bandwidths (a `strata-swapbench profile --json` report) and a cost model of the
// engine's lanes (tools/planner/cost_model.h), under the device/host/NVMe budgets. Writes the
// chosen config (every other key of the input kept) and prints the top candidates with their
// predicted step times. On the cpu device the compute rate comes from timing the model's own
// layers (calibrate.h) rather than the profile's large matmul; --verify runs the chosen config
// for a few steps and compares.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <tuple>
#include <iostream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/base/config.h"
#include "runtime/base/host_info.h"
#include "runtime/base/units.h"
#include "runtime/state/placement_plan.h"
#include "tools/planner/cli_util.h"
#include "tools/planner/cost_model.h"
#include "tools/planner/output_paths.h"
#include "tools/tune/calibrate.h"
#include "tools/tune/verify.h"

namespace {

using namespace strata;
using namespace strata::planner;

StatusOr<uint64_t> Budget(const std::string& flag, const std::string& v) {
  if (v.empty()) return uint64_t{0};
  auto b = ParseBytes(v);
  if (!b.ok()) return InvalidArgument(StrCat(flag, "=", v, ": ", b.status().message(), " (e.g. 24GiB)"));
  return *b;
}

std::string DefaultOut(const std::string& in) {
  const auto dot = in.rfind(".json");
  return (dot != std::string::npos && dot + 5 == in.size() ? in.substr(0, dot) : in) + ".tuned.json";
}

// Times the model on this CPU (calibrate.h) and, when that works, sets the cost model's compute
// rate in `to`. Returns what goes under "calibration" in the report: the figures, or "skipped"
// with the reason when the profile's matmul figure stays in use.
nlohmann::json CalibrateForTune(const Config& config, bool quiet, TuneOptions* to) {
  if (to->device != "cpu")
    return {{"skipped", "calibration times the model on the CPU only; the cuda compute rate comes "
                        "from the profile's matmul figure"}};
  const uint64_t need = tune::CalibrationBytes(config, 2);
  const uint64_t avail = static_cast<uint64_t>(sysconf(_SC_AVPHYS_PAGES)) *
                         static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (need > avail / 2)
    return {{"skipped", StrCat("two layers of this model need about ", FormatBytes(need), " and ",
                               FormatBytes(avail), " is free; using the profile's figure")}};
  if (!quiet)
    std::fprintf(stderr, "strata-tune: calibrating compute on this CPU (micro-batch %lld x %lld tokens)...\n",
                 static_cast<long long>(config.train_micro_batch_size_per_gpu),
                 static_cast<long long>(config.model.seq_len));
  // The whole model is timed when it is small (exact shapes, a few seconds at most); larger ones
  // are extrapolated from one and two blocks.
  const uint64_t whole_limit = std::min<uint64_t>(avail / 4, 1ull << 30);
  auto cal = tune::CalibrateCompute(config, 3, whole_limit);
  if (!cal.ok()) return {{"skipped", std::string(cal.status().message())}};
  to->gflops_override = cal->gflops;
  const char* opt_out = "; --no-calibrate for the profile's matmul figure";
  to->gflops_source = cal->whole_model
                          ? StrCat("calibrated: the whole model, ", cal->micro_batch_s * 1e3,
                                   " ms per micro-batch", opt_out)
                          : StrCat("calibrated: ", cal->block_s * 1e3, " ms per block, ",
                                   cal->rest_s * 1e3, " ms embedding+head+loss per micro-batch", opt_out);
  nlohmann::json j = {{"method", cal->whole_model ? "whole_model" : "two_blocks"},
                      {"micro_batch_s", cal->micro_batch_s},
                      {"gflops", cal->gflops}};
  if (!cal->whole_model) {
    j["one_layer_s"] = cal->one_layer_s;
    j["two_layer_s"] = cal->two_layer_s;
    j["block_s"] = cal->block_s;
    j["rest_s"] = cal->rest_s;
  }
  return j;
}

// The candidates that did not fit, each with why, and what to change.
void PrintInfeasible(const TuneResult& res) {
  std::cerr << "strata-tune: no placement fits the budgets (device "
            << (res.device_budget ? FormatBytes(res.device_budget) : "unlimited") << ", host "
            << FormatBytes(res.host_budget) << ", nvme "
            << (res.nvme_budget ? FormatBytes(res.nvme_budget) : "unlimited") << "):\n";
  for (const auto& c : res.candidates) std::cerr << "  " << c.Describe() << ": " << c.why_not << "\n";
  std::cerr << "Raise a budget, use more ranks (--world-size), or allow NVMe (--nvme-path).\n";
}

// Nothing fits in the config's own layout: the fastest placement of each smaller layout that
// does, so the answer says what a compact layout would buy without choosing one (it changes the
// optimizer's numerics, which is the user's call).
void SuggestSmallerLayouts(const Config& config, const ModelSpec& model, const HardwareProfile& profile,
                           TuneOptions to) {
  const StateLayout own = ConfigLayout(config);
  for (const StateLayout& l : AllLayouts())
    if (LayoutStateBytes(l) < LayoutStateBytes(own) && LayoutRefusal(l, config).empty()) to.layouts.push_back(l);
  if (to.layouts.empty()) return;
  auto res = Tune(config, model, profile, to);
  if (!res.ok()) return;
  std::vector<std::string> fits;
  for (const StateLayout& l : to.layouts) {
    for (const Candidate& c : res->candidates) {  // ranked: the first feasible one is the fastest
      if (!c.feasible || c.layout != l) continue;
      char figures[96];
      std::snprintf(figures, sizeof figures, " (%.2f bytes per parameter): ", c.memory.bytes_per_param);
      char step[48];
      std::snprintf(step, sizeof step, ", %.4g s a step", c.prediction.step_s);
      fits.push_back(StrCat(l.Name(), figures, c.Describe(), step));
      break;
    }
  }
  if (fits.empty()) {
    std::cerr << "No smaller optimizer-state layout fits either.\n";
    return;
  }
  std::cerr << "It fits with a smaller optimizer-state layout, which changes the optimizer's numerics "
               "(README, \"Compact layouts\": their measured convergence):\n";
  for (const auto& f : fits) std::cerr << "  " << f << "\n";
  std::cerr << "Rerun with --layouts <name> (or --layouts all) to choose among them.\n";
}

// The first `top` candidates, as the report's JSON and as the table.
nlohmann::json RankingJson(const TuneResult& res, size_t top) {
  nlohmann::json cands = nlohmann::json::array();
  for (size_t i = 0; i < res.candidates.size() && i < top; ++i) {
    const Candidate& c = res.candidates[i];
    cands.push_back({{"placement", c.Describe()},
                     {"mode", PlacementModeName(c.mode)},
                     {"layout", c.layout.Name()},
                     {"bytes_per_param", c.memory.bytes_per_param},
                     {"planned", c.planned},
                     {"feasible", c.feasible},
                     {"why_not", c.why_not},
                     {"predicted", c.prediction.ToJson()},
                     {"hbm_bytes", c.memory.hbm_bytes},
                     {"host_bytes", c.memory.host_pageable_bytes + c.memory.host_pinned_bytes},
                     {"nvme_bytes", c.memory.nvme_bytes}});
  }
  return cands;
}

// A refusal's first clause: the table keeps one line per candidate (PrintInfeasible and the
// JSON carry the whole text).
std::string FirstClause(const std::string& why) {
  const size_t cut = why.find(';');
  return cut == std::string::npos ? why : why.substr(0, cut);
}

void PrintRanking(const TuneResult& res, size_t top) {
  int width = 44;  // the placement column fits the longest description printed
  for (size_t i = 0; i < res.candidates.size() && i < top; ++i)
    width = std::max(width, static_cast<int>(res.candidates[i].Describe().size()));
  std::printf("%-3s %-*s %10s %9s %9s %9s %9s %9s %10s %10s %10s\n", "#", width, "placement", "step_s",
              "compute", "copy", "nvme", "adam", "comm", "hbm", "host", "nvme_B");
  for (size_t i = 0; i < res.candidates.size() && i < top; ++i) {
    const Candidate& c = res.candidates[i];
    if (!c.planned) {
      std::printf("%-3zu %-*s %10s (%s)\n", i + 1, width, c.Describe().c_str(), "-",
                  FirstClause(c.why_not).c_str());
      continue;
    }
    std::printf("%-3zu %-*s %10.4f %9.4f %9.4f %9.4f %9.4f %9.4f %10s %10s %10s %s\n", i + 1, width,
                c.Describe().c_str(), c.prediction.step_s, c.prediction.compute_s, c.prediction.copy_s,
                c.prediction.nvme_s, c.prediction.optimizer_s, c.prediction.comm_s,
                FormatBytes(c.memory.hbm_bytes).c_str(),
                FormatBytes(c.memory.host_pageable_bytes + c.memory.host_pinned_bytes).c_str(),
                FormatBytes(c.memory.nvme_bytes).c_str(), c.feasible ? "" : ("(" + c.why_not + ")").c_str());
  }
  for (const auto& a : res.assumptions) std::printf("assumed: %s\n", a.c_str());
  // A prediction's own assumption (a layout's optimizer rate missing from the profile) is the
  // same for every candidate: said once.
  if (!res.candidates.empty())
    for (const auto& note : res.candidates.front().prediction.notes) std::printf("assumed: %s\n", note.c_str());
}

// --verify: the chosen placement run through the engine, predicted against measured lane by
// lane (a good step figure can hide two lanes wrong in opposite directions); into
// report["verify"]. Returns the exit code.
int Verify(const Config& config, const TuneOptions& to, const Candidate& best,
           const std::string& nvme_path, int steps, bool json, nlohmann::json* report) {
  Config chosen = config;
  if (to.host_budget) chosen.strata.host_memory_budget = to.host_budget;
  if (to.device_budget) chosen.strata.device_memory_budget = to.device_budget;
  if (to.nvme_budget) chosen.strata.nvme_capacity = to.nvme_budget;
  ApplyCandidate(best, &chosen);
  if (best.mode == PlacementMode::kAuto && (to.host_budget || config.strata.host_memory_budget))
    chosen.strata.host_memory_budget = best.host_pool;
  auto v = tune::VerifyConfig(chosen, to.device, best.uses_nvme ? nvme_path : "", steps);
  if (!v.ok()) {
    std::cerr << "strata-tune: --verify: " << v.status().message() << "\n";
    return 1;
  }
  const StepPrediction& pr = best.prediction;
  const std::vector<std::pair<std::string, double>> predicted = {
      {"step", pr.step_s},  {"compute", pr.compute_s}, {"copy", pr.copy_s},
      {"nvme", pr.nvme_s},  {"optimizer", pr.optimizer_s}, {"comm", pr.comm_s}};
  nlohmann::json lanes = nlohmann::json::object();
  if (!json)
    std::printf("verify (median of %lld steps after a warm-up):\n  %-10s %12s %12s %10s\n",
                static_cast<long long>(steps - 1), "lane", "predicted_s", "measured_s",
                "pred/meas");
  for (const auto& [lane, pred] : predicted) {
    const double meas = v->lanes.at(lane);
    // A lane that neither predicts nor measures a millisecond has no meaningful ratio.
    const bool both = pred > 1e-3 || meas > 1e-3;
    lanes[lane] = {{"predicted_s", pred}, {"measured_s", meas},
                   {"ratio", both && meas > 0 ? nlohmann::json(pred / meas) : nlohmann::json(nullptr)}};
    if (!json) {
      if (both && meas > 0)
        std::printf("  %-10s %12.4f %12.4f %10.2f\n", lane.c_str(), pred, meas, pred / meas);
      else
        std::printf("  %-10s %12.4f %12.4f %10s\n", lane.c_str(), pred, meas, "-");
    }
  }
  (*report)["verify"] = {{"steps", steps - 1}, {"lanes", lanes}, {"last_step", v->last_report}};
  return 0;
}

// strata-tune's command line.
struct Args {
  std::string config_path, profile_path, out_path, device = "", world_s = "1", top_s = "5";
  std::string dev_budget, host_budget, nvme_budget, nvme_path, gflops_s, comm_s, steps_s = "4";
  std::string placement = "both", layouts = "config";
  bool json = false, verify = false, dry_run = false, no_calibrate = false;
};

void AddOptions(CLI::App* app, Args* a) {
  app->add_option("--config", a->config_path, "input config with a \"model\" section (required)")->required();
  app->add_option("--profile", a->profile_path, "`strata-swapbench profile --json` report (required)")->required();
  app->add_option("--out", a->out_path, "where to write the tuned config (default: <config>.tuned.json)");
  app->add_option("--world-size", a->world_s, "ranks (default 1)");
  app->add_option("--device", a->device, "cpu or cuda (default: the config's strata.device; auto reads as cpu)");
  app->add_option("--device-budget", a->dev_budget, "device memory per rank, e.g. 40GiB (default: strata.device_memory_budget; cpu: 4GiB; "
                  "cuda: the GPU's free memory in the profile)");
  app->add_option("--host-budget", a->host_budget, "host memory per rank (default: strata.host_memory_budget, else half of RAM)");
  app->add_option("--nvme-budget", a->nvme_budget, "NVMe bytes per rank (default: strata.nvme_capacity, else unlimited)");
  app->add_option("--nvme-path", a->nvme_path, "NVMe directory for candidates that use NVMe (default: the config's, "
                                           "else the profile's)");
  app->add_option("--placement", a->placement,
                  "placement modes to search: config (each state kind wholly in its section's device), "
                  "auto (strata.placement auto: the sections' devices are floors and each chunk's "
                  "state fills device, host and NVMe under the budgets), or both (default)");
  app->add_option("--layouts", a->layouts,
                  "optimizer-state layouts to search: config (default: the config's own, as written), "
                  "all, or a comma list of fp32, bf16, int8, fp32+bf16_master, bf16+bf16_master, "
                  "int8+bf16_master (moments, then a bf16 master: README, \"Compact layouts\"). A layout "
                  "other than the config's changes the optimizer's numerics; when nothing fits, the "
                  "answer names the smaller layouts that would");
  app->add_option("--gflops", a->gflops_s, "compute rate to assume instead of the profile's compute.gflops "
                                       "(turns calibration off)");
  app->add_option("--comm-gbps", a->comm_s, "collectives' bus bandwidth (GB/s) for --world-size > 1, instead "
                                       "of the profile's comm section (`strata-launch --nproc N -- "
                                       "strata-commbench --profile <profile.json>` measures it)");
  app->add_flag("--no-calibrate", a->no_calibrate,
               "use the profile's matmul figure as is. By default, on the cpu device, strata-tune "
               "times the model on this CPU (forward, loss, backward at the config's "
               "micro-batch and dtype; a model over 1 GiB is extrapolated from copies with one and "
               "two blocks) and uses that rate instead of the profile's large-matmul figure, which "
               "overstates small models");
  app->add_option("--top", a->top_s, "candidates to print (default 5)");
  app->add_flag("--json", a->json, "print the ranking as JSON");
  app->add_flag("--dry-run", a->dry_run, "print the ranking, write nothing");
  app->add_flag("--verify", a->verify, "run the chosen config through the engine (small models; one rank) and "
                                   "report predicted vs measured time per lane and per step");
  app->add_option("--verify-steps", a->steps_s, "optimizer steps for --verify, the first being warm-up (default 4)");
}

// The search's options from the command line (budgets, rates, the NVMe folder: the flag, else
// the config's, else the profile's). Fills in a->nvme_path.
StatusOr<TuneOptions> MakeTuneOptions(Args* a, const Config& config, const HardwareProfile& profile,
                                      int world) {
  TuneOptions to;
  to.world_size = world;
  to.cpu_compute_threads = tune::ComputeThreads();
  to.device = a->device.empty() ? (config.strata.NamesCuda() ? "cuda" : "cpu") : a->device;
  if (to.device != "cpu" && to.device != "cuda")
    return InvalidArgument(StrCat("--device=", a->device, ": must be cpu or cuda"));
  for (auto [flag, text, dst] : {std::tuple{"--device-budget", &a->dev_budget, &to.device_budget},
                                 std::tuple{"--host-budget", &a->host_budget, &to.host_budget},
                                 std::tuple{"--nvme-budget", &a->nvme_budget, &to.nvme_budget}}) {
    auto b = Budget(flag, *text);
    if (!b.ok()) return b.status();
    *dst = *b;
  }
  if (!a->gflops_s.empty()) {
    STRATA_ASSIGN_OR_RETURN(to.gflops_override, ParseGflops(a->gflops_s));
  }
  if (!a->comm_s.empty()) {
    char* end = nullptr;
    to.comm_gbps_override = std::strtod(a->comm_s.c_str(), &end);
    if (*end != '\0' || !(to.comm_gbps_override > 0) || !(to.comm_gbps_override <= 1e5))
      return InvalidArgument(StrCat("--comm-gbps=", a->comm_s, ": must be a number in (0, 1e5] GB/s"));
  }
  if (a->nvme_path.empty()) {
    const auto& z = config.zero_optimization;
    if (!z.offload_optimizer.nvme_path.empty()) a->nvme_path = z.offload_optimizer.nvme_path[0];
    else if (!z.offload_param.nvme_path.empty()) a->nvme_path = z.offload_param.nvme_path[0];
    else a->nvme_path = profile.nvme_path;
  }
  to.nvme_allowed = !a->nvme_path.empty();
  if (to.nvme_allowed) to.disk_free = FreeDiskBytes(a->nvme_path);
  if (a->placement != "both" && a->placement != "config" && a->placement != "auto")
    return InvalidArgument(StrCat("--placement=", a->placement, ": must be config, auto or both"));
  to.try_config = a->placement != "auto";
  to.try_auto = a->placement != "config";
  if (a->layouts == "all") {
    to.layouts = AllLayouts();
  } else if (a->layouts != "config") {
    std::stringstream list(a->layouts);
    for (std::string name; std::getline(list, name, ',');) {
      auto l = StateLayout::Parse(name);
      if (!l.ok()) return InvalidArgument(StrCat("--layouts=", a->layouts, ": ", l.status().message()));
      to.layouts.push_back(*l);
    }
    if (to.layouts.empty()) return InvalidArgument("--layouts is empty: name one, or all, or config");
  }
  return to;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "strata-tune: searches the placement of parameters and optimizer states over device memory, "
      "host memory and NVMe (zero_optimization.offload_param / offload_optimizer devices as written, "
      "and strata.placement auto, which fills each chunk's state into the tiers under the budgets; aio "
      "block_size / queue_depth / intra_op_parallelism) with a cost model of the step's lanes "
      "(compute from FLOPs and the measured FLOP rate, NVMe bytes / NVMe bandwidth at each measured "
      "aio setting, host<->device bytes / copy bandwidth, Adam elements / Adam throughput), keeps the "
      "placements that fit the budgets, and writes the fastest as a config.\n\n"
      "Example:\n"
      "  strata-swapbench profile --quick --path /mnt/nvme --json > profile.json\n"
      "  strata-tune --config configs/gpt_small.json --profile profile.json --host-budget 8GiB "
      "--out tuned.json --verify",
      "strata-tune"};
  Args a;
  AddOptions(&app, &a);
  if (int rc = ParseArgs(app, argc, argv); rc >= 0) return rc;

  auto fail = [](const Status& s, int code) {
    std::cerr << "strata-tune: " << s.message() << (code == 2 ? "\nRun `strata-tune --help` for the options." : "")
              << "\n";
    return code;
  };
  if (!a.out_path.empty() && !a.dry_run) {
    Status out = CheckOutputFile("--out", a.out_path, {{"--config", a.config_path}, {"--profile", a.profile_path}});
    if (!out.ok()) return fail(out, 2);
  }
  auto config = Config::FromFile(a.config_path);
  if (!config.ok()) return fail(config.status(), 2);
  auto raw = ReadJsonFile(a.config_path);
  if (!raw.ok()) return fail(raw.status(), 2);
  auto profile = HardwareProfile::FromFile(a.profile_path);
  if (!profile.ok()) return fail(profile.status(), 2);
  auto world = ParseCount("--world-size", a.world_s, 1, 1 << 20);
  if (!world.ok()) return fail(world.status(), 2);
  // "auto" values resolve as the run would: in particular bf16 only where it is native, so the
  // compute rate calibrated below is that of the dtype that will run.
  if (Status rs = ResolveAutoForPlanning(&*config, a.device.empty() ? config->strata.device : a.device,
                                         static_cast<int>(*world));
      !rs.ok())
    return fail(rs, 2);
  auto top = ParseCount("--top", a.top_s, 1, 1000);
  if (!top.ok()) return fail(top.status(), 2);
  auto steps = ParseCount("--verify-steps", a.steps_s, 2, 1000);
  if (!steps.ok()) return fail(steps.status(), 2);
  auto options = MakeTuneOptions(&a, *config, *profile, static_cast<int>(*world));
  if (!options.ok()) return fail(options.status(), 2);
  TuneOptions to = *options;
  if (!raw->contains(
          "model"))  // strata-tune has no --params: the model comes from the config alone
    return fail(InvalidArgument(
                    StrCat("--config ", a.config_path,
                           " has no \"model\" section: strata-tune tunes "
                           "a config strata-train runs, with its GPT (n_layers, d_model, n_heads, "
                           "seq_len, vocab_size), as configs/tiny.json has")),
                2);
  auto model = ModelFromArgs(&*raw, *config, "", "");
  if (!model.ok()) return fail(model.status(), 2);
  if (a.verify && to.world_size != 1)
    return fail(InvalidArgument("--verify runs one rank: use --world-size 1"), 2);

  // Calibration and --verify measure this machine: name it beside the figures.
  const std::string host = HostDescription(a.nvme_path);
  if (!a.json) std::fprintf(stderr, "strata-tune: on %s\n", host.c_str());
  nlohmann::json calibration;
  if (!a.no_calibrate && to.gflops_override == 0) calibration = CalibrateForTune(*config, a.json, &to);
  if (calibration.contains("skipped") && !a.json)
    std::fprintf(stderr, "strata-tune: compute calibration skipped: %s\n",
                 calibration["skipped"].get<std::string>().c_str());

  auto res = Tune(*config, *model, *profile, to);
  if (!res.ok()) return fail(res.status(), 2);
  if (res->candidates.empty() || !res->candidates.front().feasible) {
    PrintInfeasible(*res);
    if (to.layouts.empty()) SuggestSmallerLayouts(*config, *model, *profile, to);
    return 1;
  }
  const Candidate& best = res->candidates.front();
  nlohmann::json tuned = *raw;
  ApplyCandidate(best, a.nvme_path, &tuned);
  // Budgets given here bind the engine too: its pinned pool and device allocator read them.
  if (to.host_budget) tuned["strata"]["host_memory_budget"] = to.host_budget;
  if (to.device_budget) tuned["strata"]["device_memory_budget"] = to.device_budget;
  if (to.nvme_budget) tuned["strata"]["nvme_capacity"] = to.nvme_budget;
  // An auto plan was made with the host budget less the run's pageable memory as its host tier:
  // the engine plans with the same pool. Without a budget (half of RAM assumed) the engine
  // measures the host at start instead (MemAvailable less an eighth).
  if (best.mode == PlacementMode::kAuto && (to.host_budget || config->strata.host_memory_budget))
    tuned["strata"]["host_memory_budget"] = best.host_pool;
  if (a.out_path.empty()) a.out_path = DefaultOut(a.config_path);

  nlohmann::json report = {{"host", host},
                           {"device_budget", res->device_budget},
                           {"host_budget", res->host_budget},
                           {"nvme_budget", res->nvme_budget},
                           {"assumptions", res->assumptions},
                           {"calibration", calibration},
                           {"out", a.dry_run ? "" : a.out_path}};
  report["candidates"] = RankingJson(*res, static_cast<size_t>(*top));
  if (!a.json) PrintRanking(*res, static_cast<size_t>(*top));
  if (!a.dry_run) {
    Status w = WriteJsonFileAtomic(a.out_path, tuned);
    if (!w.ok()) return fail(w, 1);
    auto check = Config::FromFile(a.out_path);
    if (!check.ok()) return fail(check.status().WithContext("the tuned config does not parse (a bug)"), 1);
    if (!a.json) std::printf("chose %s; wrote %s\n", best.Describe().c_str(), a.out_path.c_str());
  }
  // The chosen plan, tier by tier, as the engine logs it at start.
  if (!a.json)
    for (const auto& line : best.memory.placement_lines)
      std::printf("placement (%s) %s\n", PlacementModeName(best.mode), line.c_str());
  report["chosen_placement"] = best.memory.placement;
  const int rc = a.verify ? Verify(*config, to, best, a.nvme_path, static_cast<int>(*steps), a.json, &report)
                        : 0;
  if (a.json) std::cout << report.dump(2) << "\n";
  return rc;
}
