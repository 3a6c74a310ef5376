// strata-estimate: how many bytes a training run will need on each tier (device memory, pinned
// and pageable host memory, NVMe), per rank, before launching it. The figures follow what
// strata::Engine allocates (tools/planner/memory_model.h), and the breakdown says which engine
// counter (StepReport.peak_device_bytes / peak_host_bytes) each line shows up in.
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/config.h"
#include "runtime/base/host_info.h"
#include "runtime/base/units.h"
#include "tools/planner/cli_util.h"
#include "tools/planner/cost_model.h"
#include "tools/planner/largest.h"
#include "tools/planner/memory_model.h"

namespace {

using namespace strata;
using namespace strata::planner;

StatusOr<OffloadDevice> ParseOffload(const std::string& flag, const std::string& v) {
  if (v == "none") return OffloadDevice::kNone;
  if (v == "cpu") return OffloadDevice::kCpu;
  if (v == "nvme") return OffloadDevice::kNvme;
  return InvalidArgument(StrCat(flag, "=", v, ": must be none, cpu or nvme"));
}

// strata.placement auto: the plan fills the tiers under what this machine has, as the engine
// would at start.
void MeasureForAuto(const Config& config, EstimateOptions* eo) {
  if (config.strata.placement != PlacementMode::kAuto) return;
  eo->host_available = ReadHostMemory().available_bytes;
  // Over several nvme paths, what the striped tier can fill on their file systems, as the
  // engine budgets it.
  eo->disk_free = StripedFreeDisk(config.zero_optimization.NvmeTierPaths()).free;
}

StatusOr<uint64_t> BytesFlag(const std::string& flag, const std::string& v) {
  auto b = ParseBytes(v);
  if (!b.ok())  // ParseBytes says why: the unit, a fraction of a byte, too large
    return InvalidArgument(
        StrCat(flag, "=", v, ": ", b.status().message(), "; give a size such as 80GiB or 512MiB"));
  if (*b == 0)
    return InvalidArgument(
        StrCat(flag, "=", v, ": must be a size above 0, such as 80GiB or 512MiB"));
  return *b;
}

// --largest: the machine's budgets (flags, else this machine), the search, and its report.
int RunLargest(const Config& config, const std::string& device, const std::string& hbm,
               const std::string& host, const std::string& disk, std::string nvme_path,
               const std::string& profile_path, const std::string& gflops_s, int world,
               EstimateOptions::Build build, int init_element_bytes, bool json) {
  auto fail = [](const Status& s) {
    std::cerr << "strata-estimate: " << s.message() << "\nRun `strata-estimate --help` for the options.\n";
    return 2;
  };
  if (!device.empty() && device != "cpu" && device != "cuda")
    return fail(InvalidArgument(StrCat("--device=", device, ": must be cpu or cuda")));
  LargestOptions o;
  o.device = device.empty() ? (config.strata.NamesCuda() ? "cuda" : "cpu") : device;
  o.world_size = world;
  o.build = build;
  o.init_element_bytes = init_element_bytes;
  if (nvme_path.empty())
    nvme_path = !config.zero_optimization.offload_optimizer.nvme_path.empty()
                    ? config.zero_optimization.offload_optimizer.nvme_path.front()
                    : "/var/tmp/strata-nvme";
  o.nvme_path = nvme_path;
  std::optional<HardwareProfile> prof;
  if (!profile_path.empty()) {
    auto p = HardwareProfile::FromFile(profile_path);
    if (!p.ok()) return fail(p.status());
    prof = *p;
  }
  std::string source;
  if (!hbm.empty()) {
    auto b = BytesFlag("--hbm", hbm);
    if (!b.ok()) return fail(b.status());
    o.device_bytes = *b;
    o.device_flag = "--hbm";
  } else if (config.strata.device_memory_budget) {
    o.device_bytes = config.strata.device_memory_budget;
  } else if (o.device == "cpu") {
    o.device_bytes = 4ull << 30;  // the CPU device's default budget
  } else if (prof && prof->device_capacity_bytes > 0) {
    o.device_bytes = prof->device_capacity_bytes;
    source += StrCat(" device: the free memory of ", prof->device_name.empty() ? "the GPU" : prof->device_name,
                     " in the profile;");
  } else {
    return fail(InvalidArgument("--largest on cuda needs the GPU's memory: pass --hbm (e.g. --hbm 80GiB), or a "
                                "--profile made on the GPU machine"));
  }
  // A flag's size, else what this machine has (and the report says where it came from).
  for (auto [flag, text, out, out_flag, measured, from] :
       {std::tuple{"--host", &host, &o.host_bytes, &o.host_flag, ReadHostMemory().available_bytes,
                   std::string(" host from MemAvailable;")},
        std::tuple{"--disk", &disk, &o.disk_bytes, &o.disk_flag, FreeDiskBytes(nvme_path),
                   StrCat(" disk free at ", nvme_path, ";")}}) {
    if (text->empty()) {
      *out = measured;
      source += from;
      continue;
    }
    auto b = BytesFlag(flag, *text);
    if (!b.ok()) return fail(b.status());
    *out = *b;
    *out_flag = flag;
  }
  auto r = FindLargest(config, o);
  if (!r.ok() && r.status().code() == StatusCode::kNotFound) {
    // Nothing fits these budgets: an answer, not a usage error (exit 1, and JSON under --json).
    if (json) {
      nlohmann::json j = {{"largest", nullptr},
                          {"reason", r.status().message()},
                          {"budgets",
                           {{"device", o.device},
                            {"device_bytes", o.device_bytes},
                            {"host_bytes", o.host_bytes},
                            {"disk_bytes", o.disk_bytes}}}};
      std::cout << j.dump(2) << "\n";
    } else {
      std::cerr << "strata-estimate: " << r.status().message() << "\n";
    }
    return 1;
  }
  if (!r.ok()) return fail(r.status());
  // The lane that bounds the step, when a measured profile is given.
  std::optional<StepPrediction> pred;
  std::string lane;
  std::vector<std::string> assumptions;  // the rates' (where a figure came from)
  if (prof) {
    double gflops = 0;
    if (!gflops_s.empty()) {
      auto g = ParseGflops(gflops_s);
      if (!g.ok()) return fail(g.status());
      gflops = *g;
    }
    auto rates = RatesFromProfile(*prof, o.device, gflops, !r->config.bf16.enabled && !r->config.fp16.enabled);
    if (!rates.ok()) return fail(rates.status());
    SetNvmeRates(*prof, r->config.aio, &*rates);
    rates->comm_busbw_gbps = prof->comm_busbw_gbps;
    if (world > 1 && rates->comm_busbw_gbps <= 0)
      return fail(InvalidArgument(StrCat("--world-size ", world, " with --profile needs the collectives' bandwidth: "
                                         "run `strata-launch --nproc ", world, " -- strata-commbench --profile ",
                                         profile_path, "` to add it")));
    assumptions = rates->assumptions;
    auto spec = GptModelSpec(r->shape);
    if (!spec.ok()) return fail(spec.status());
    auto p = PredictStep(r->config, *spec, r->estimate, *rates, o.device, world);
    if (!p.ok()) return fail(p.status());
    pred = *p;
    const std::pair<const char*, double> lanes[] = {{"compute thread", p->main_s}, {"optimizer lane", p->lane_s},
                                                    {"nvme", p->nvme_s}, {"copy", p->copy_s}};
    double most = -1;
    for (const auto& [name, t] : lanes)
      if (t > most) most = t, lane = name;
  }
  const auto& m = r->shape;
  if (json) {
    nlohmann::json j = {{"largest", r->ToJson()},
                        {"bytes_per_param", r->estimate.bytes_per_param},
                        {"budgets", {{"device", o.device}, {"device_bytes", o.device_bytes},
                                     {"host_bytes", o.host_bytes}, {"disk_bytes", o.disk_bytes}}}};
    if (pred) j["prediction"] = pred->ToJson(), j["bounding_lane"] = lane, j["assumptions"] = assumptions;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << "largest GPT that trains on " << o.device << " " << FormatBytes(o.device_bytes) << ", host "
            << FormatBytes(o.host_bytes) << ", disk " << FormatBytes(o.disk_bytes)
            << (source.empty() ? "" : " (" + source.substr(1, source.size() - 2) + ")") << ":\n  "
            << m.n_layers << " layers x d_model " << m.d_model << " (" << m.n_heads << " heads), "
            << std::fixed << std::setprecision(2) << r->params / 1e9 << std::defaultfloat << "B parameters; seq " << m.seq_len << ", micro-batch "
            << r->config.train_micro_batch_size_per_gpu << ", "
            << (r->config.bf16.enabled ? "bf16" : r->config.fp16.enabled ? "fp16" : "fp32")
            << ", activation checkpointing\n";
  std::printf("  %.2f bytes per parameter over every tier\n", r->estimate.bytes_per_param);
  std::cout << "placement plan (strata.placement auto):\n";
  for (const auto& l : r->estimate.placement_lines) std::cout << "  " << l << "\n";
  std::cout << "per rank at the step's peak: device " << FormatBytes(r->estimate.hbm_bytes) << ", host pinned "
            << FormatBytes(r->estimate.host_pinned_bytes) << ", nvme " << FormatBytes(r->estimate.nvme_bytes) << "\n";
  if (pred)
    std::printf("cost model: step %.3g s bound by the %s (compute thread %.3g s, optimizer lane %.3g s, "
                "nvme %.3g s, copy %.3g s)\n",
                pred->step_s, lane.c_str(), pred->main_s, pred->lane_s, pred->nvme_s, pred->copy_s);
  if (pred) {
    for (const std::string& a : assumptions) std::cout << "  assumed: " << a << "\n";
    for (const std::string& note : pred->notes) std::cout << "  note: " << note << "\n";
  }
  if (!pred)
    std::cout << "bounding lane: pass --profile (a `strata-swapbench profile --json` report) to predict it\n";
  std::cout << "one layer more does not fit: " << r->next_refused << "\n";
  std::cout << "for the engine to run this plan, give its config \"strata\": {\"placement\": \"auto\", "
               "\"device_reserve\": "
            << r->config.strata.device_reserve << "} (the replay's compute working set on the device)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "strata-estimate: memory per tier (hbm = device memory, host pinned, host pageable, NVMe) that "
      "strata-train will use per rank for a model under a config, including chunk padding, the "
      "stage-3 gather and gradient buffers, NVMe staging buffers and (for a config with a \"model\" "
      "section) the activations of one micro-batch.\n\n"
      "Examples:\n"
      "  strata-estimate --config configs/gpt_small.json --world-size 2\n"
      "  strata-estimate --params 1.3e9 --largest-layer 5e7 --stage 3 --offload-optimizer nvme --json\n"
      "  strata-estimate --largest                      # the largest GPT this machine trains\n"
      "  strata-estimate --largest --device cuda --hbm 80GiB --host 128GiB --disk 64GiB --profile p.json\n"
      "  strata-estimate --config run.json --device cuda --hbm 80GiB --host 120GiB   # placement auto's plan there",
      "strata-estimate"};
  std::string config_path, params, largest, device, stage_s, off_param, off_optim;
  std::string world_s = "1";
  bool json = false, largest_mode = false;
  std::string hbm, host, disk, nvme_path, profile_path, gflops_s, build_s = "strata-train", init_dtype;
  app.add_option("--config", config_path,
                 "DeepSpeed-style config (strata-train's); its \"model\" section describes the GPT");
  app.add_option("--params", params, "model size in elements, instead of a \"model\" section (e.g. 1.3e9)");
  app.add_option("--largest-layer", largest, "elements of the largest layer (with --params)");
  app.add_option("--world-size", world_s, "ranks sharing the model (default 1)");
  app.add_option("--device", device, "cpu or cuda (default: the config's strata.device; auto reads as cpu)");
  app.add_option("--stage", stage_s, "override zero_optimization.stage (0..3)");
  app.add_option("--offload-param", off_param, "override offload_param.device: none|cpu|nvme");
  app.add_option("--offload-optimizer", off_optim, "override offload_optimizer.device: none|cpu|nvme");
  app.add_flag("--largest", largest_mode,
               "find the largest GPT (GPT-3 widths, up to d_model/32 layers) that trains under the budgets, "
               "placed over device, host and NVMe by strata.placement auto; the config (optional) "
               "gives seq_len, micro-batch, dtype and chunk size");
  app.add_option("--hbm", hbm, "device memory per rank of the machine to plan for (default: strata.device_memory_budget; cpu 4GiB); "
                               "with --largest, or under strata.placement auto");
  app.add_option("--host", host, "host memory available on the machine to plan for (default: this machine's MemAvailable); "
                                 "with --largest, or under strata.placement auto");
  app.add_option(
      "--disk", disk,
      "free disk for NVMe offload on the machine to plan for; over several nvme paths, what the "
      "striped state can fill, n x the tightest file system's free / its paths there (default: "
      "measured at --nvme-path, or at the config's nvme paths); with --largest, or under "
      "strata.placement auto");
  app.add_option("--nvme-path", nvme_path, "with --largest: where NVMe state would go (default: the config's, else /var/tmp/strata-nvme)");
  app.add_option("--profile", profile_path, "with --largest: a `strata-swapbench profile --json` report, to predict the bounding lane "
                                            "(and, on cuda without --hbm, the GPU's memory it measured)");
  app.add_option("--gflops", gflops_s, "with --largest and --profile: the compute rate (GFLOP/s) to predict the step "
                                       "with, instead of the profile's compute.gflops (for a profile without one, or "
                                       "made on another device)");
  app.add_option("--build", build_s,
                 "how the model is built, which sets the disk it needs at start: strata-train (default; "
                 "its zero::Init stages a stage-3 model with NVMe parameter offload, all but the large "
                 "matrices it draws as the engine reads them) or python (a script's strata.zero.Init stages "
                 "every parameter, whatever the stage and offload, in the NVMe directory, else the temporary "
                 "directory)");
  app.add_option("--init-dtype", init_dtype,
                 "with --build python: the dtype the script's zero.Init(dtype=...) builds in, fp32, bf16 or fp16 "
                 "(default: zero.Init's, bf16 with bf16.bf16_master_weights_and_grads, else fp32). A 16-bit "
                 "build halves the staging file; an fp32 master then starts from the 16-bit values");
  app.add_flag("--json", json, "print JSON (hbm_bytes, host_pinned_bytes, host_pageable_bytes, nvme_bytes, "
                               "per_state, breakdown, notes, bytes_per_param: the model state per parameter over every "
                               "tier and rank) instead of a table");
  if (int rc = ParseArgs(app, argc, argv); rc >= 0) return rc;

  auto fail = [](const Status& s, int code) {
    std::cerr << "strata-estimate: " << s.message() << "\nRun `strata-estimate --help` for the options.\n";
    return code;
  };
  Config config;
  nlohmann::json raw;
  bool have_raw = false;
  if (!config_path.empty()) {
    auto c = Config::FromFile(config_path);
    if (!c.ok()) return fail(c.status(), 2);
    config = *c;
    auto r = ReadJsonFile(config_path);
    if (!r.ok()) return fail(r.status(), 2);
    raw = *r;
    have_raw = true;
  }
  auto world = ParseCount("--world-size", world_s, 1, 1 << 20);
  if (!world.ok()) return fail(world.status(), 2);
  // "auto" values (bf16 included) resolve as the run would resolve them on this machine.
  if (Status rs = ResolveAutoForPlanning(&config, device.empty() ? config.strata.device : device,
                                         static_cast<int>(*world));
      !rs.ok())
    return fail(rs, 2);
  if (!stage_s.empty()) {
    auto st = ParseCount("--stage", stage_s, 0, 3);
    if (!st.ok()) return fail(st.status(), 2);
    config.zero_optimization.stage = static_cast<int>(*st);
  }
  if (!off_param.empty()) {
    auto d = ParseOffload("--offload-param", off_param);
    if (!d.ok()) return fail(d.status(), 2);
    config.zero_optimization.offload_param.device = *d;
  }
  if (!off_optim.empty()) {
    auto d = ParseOffload("--offload-optimizer", off_optim);
    if (!d.ok()) return fail(d.status(), 2);
    config.zero_optimization.offload_optimizer.device = *d;
  }
  if (build_s != "strata-train" && build_s != "python")
    return fail(InvalidArgument(StrCat("--build=", build_s, ": must be strata-train or python")), 2);
  const auto build = build_s == "python" ? EstimateOptions::Build::kPythonZeroInit
                                         : EstimateOptions::Build::kStrataTrain;
  int init_element_bytes = 0;
  if (!init_dtype.empty()) {
    if (build != EstimateOptions::Build::kPythonZeroInit)
      return fail(InvalidArgument(StrCat("--init-dtype=", init_dtype, " is the dtype of a script's strata.zero.Init: "
                                         "pass --build python with it (strata-train stages in its own dtype)")), 2);
    if (init_dtype == "fp32") init_element_bytes = 4;
    else if (init_dtype == "bf16" || init_dtype == "fp16") init_element_bytes = 2;
    else return fail(InvalidArgument(StrCat("--init-dtype=", init_dtype, ": must be fp32, bf16 or fp16")), 2);
  }
  if (!gflops_s.empty() && (!largest_mode || profile_path.empty()))
    return fail(InvalidArgument(StrCat("--gflops=", gflops_s, " sets the compute rate of --largest's step "
                                       "prediction: pass it with --largest and --profile")), 2);
  // --hbm is the machine planned for: it replaces the config's strata.device_memory_budget,
  // which the plan would otherwise take before the device's own size.
  if (!hbm.empty()) {
    auto b = BytesFlag("--hbm", hbm);
    if (!b.ok()) return fail(b.status(), 2);
    config.strata.device_memory_budget = *b;
  }
  if (largest_mode)
    return RunLargest(config, device, hbm, host, disk, nvme_path, profile_path, gflops_s, static_cast<int>(*world),
                      build, init_element_bytes, json);
  auto model = ModelFromArgs(have_raw ? &raw : nullptr, config, params, largest);
  if (!model.ok()) return fail(model.status(), 2);
  EstimateOptions eo;
  eo.world_size = static_cast<int>(*world);
  eo.device = device;
  eo.build = build;
  eo.init_element_bytes = init_element_bytes;
  MeasureForAuto(config, &eo);
  // Another machine's budgets: the plan placement auto would make there.
  if (!hbm.empty() || !host.empty() || !disk.empty()) {
    if (config.strata.placement != PlacementMode::kAuto)
      return fail(InvalidArgument("--hbm, --host and --disk size the tiers of strata.placement auto (or --largest); "
                                  "this config places each state by its offload section. Set \"strata\": "
                                  "{\"placement\": \"auto\"} or drop the flags"), 2);
    for (auto [flag, text, out, out_flag] :
         {std::tuple{"--hbm", &hbm, &eo.device_capacity, &eo.device_flag},
          std::tuple{"--host", &host, &eo.host_available, &eo.host_flag},
          std::tuple{"--disk", &disk, &eo.disk_free, &eo.disk_flag}}) {
      if (text->empty()) continue;
      auto b = BytesFlag(flag, *text);
      if (!b.ok()) return fail(b.status(), 2);
      *out = *b;
      *out_flag = flag;
    }
  }
  auto est = EstimateAutoReserve(config, *model, eo);
  if (!est.ok()) return fail(est.status(), 2);
  if (json) {
    std::cout << est->ToJson().dump(2) << "\n";
  } else {
    std::cout << est->ToTable();
  }
  return 0;
}
