// strata-estimate: how many bytes a training run will need on each tier (device memory, pinned
// and pageable host memory, NVMe), per rank, before launching it. The figures follow what
// strata::Engine allocates (tools/planner/memory_model.h), and the breakdown says which engine
// counter (StepReport.peak_device_bytes / peak_host_bytes) each line shows up in.
#include <iostream>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/base/config.h"
#include "tools/planner/cli_util.h"
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "strata-estimate: memory per tier (hbm = device memory, host pinned, host pageable, NVMe) that "
      "strata-train will use per rank for a model under a config, including chunk padding, the "
      "stage-3 gather and gradient buffers, NVMe staging buffers and (for a config with a \"model\" "
      "section) the activations of one micro-batch.\n\n"
      "Examples:\n"
      "  strata-estimate --config configs/gpt_small.json --world-size 2\n"
      "  strata-estimate --params 1.3e9 --largest-layer 5e7 --stage 3 --offload-optimizer nvme --json",
      "strata-estimate"};
  std::string config_path, params, largest, device, stage_s, off_param, off_optim;
  std::string world_s = "1";
  bool json = false;
  app.add_option("--config", config_path,
                 "DeepSpeed-style config (strata-train's); its \"model\" section describes the GPT");
  app.add_option("--params", params, "model size in elements, instead of a \"model\" section (e.g. 1.3e9)");
  app.add_option("--largest-layer", largest, "elements of the largest layer (with --params)");
  app.add_option("--world-size", world_s, "ranks sharing the model (default 1)");
  app.add_option("--device", device, "cpu or cuda (default: the config's strata.device; auto reads as cpu)");
  app.add_option("--stage", stage_s, "override zero_optimization.stage (0..3)");
  app.add_option("--offload-param", off_param, "override offload_param.device: none|cpu|nvme");
  app.add_option("--offload-optimizer", off_optim, "override offload_optimizer.device: none|cpu|nvme");
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
  auto model = ModelFromArgs(have_raw ? &raw : nullptr, config, params, largest);
  if (!model.ok()) return fail(model.status(), 2);
  EstimateOptions eo;
  eo.world_size = static_cast<int>(*world);
  eo.device = device;
  auto est = EstimateMemory(config, *model, eo);
  if (!est.ok()) return fail(est.status(), 2);
  if (json) {
    std::cout << est->ToJson().dump(2) << "\n";
  } else {
    std::cout << est->ToTable();
  }
  return 0;
}
