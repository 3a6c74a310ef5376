#include "tools/planner/largest.h"

#include "runtime/base/units.h"

namespace strata::planner {
namespace {

// Why `est` does not fit the machine, or "" when it does.
std::string Overflows(const MemoryEstimate& est, const LargestOptions& o) {
  const uint64_t device = DeviceBudgetPeak(est);
  if (device > o.device_bytes)
    return StrCat("device peak ", FormatBytes(device), " > ", FormatBytes(o.device_bytes));
  // On the CPU device the activations are host memory too.
  const uint64_t host = est.host_pinned_bytes + est.host_pageable_bytes + HostTorchBytes(est);
  if (host > o.host_bytes) return StrCat("host ", FormatBytes(host), " > ", FormatBytes(o.host_bytes));
  if (est.nvme_bytes > o.disk_bytes)
    return StrCat("nvme ", FormatBytes(est.nvme_bytes), " > ", FormatBytes(o.disk_bytes));
  // The start's disk: the staging file and the NVMe blocks written while it is read back
  // (MemoryEstimate::init_disk_need_bytes).
  if (est.init_disk_need_bytes > o.disk_bytes) {
    // A script's fp32 build stages 4 bytes a parameter where 2 would do.
    const bool fp32_file = o.build == EstimateOptions::Build::kPythonZeroInit &&
                           est.staged_bytes >= 4 * static_cast<uint64_t>(est.param_numel);
    return StrCat("disk at start (the staging file and the NVMe state written as it is read) ",
                  FormatBytes(est.init_disk_need_bytes), " > ", FormatBytes(o.disk_bytes),
                  fp32_file ? StrCat("; the staging file holds fp32 values (", FormatBytes(est.staged_bytes),
                                     "): zero.Init(dtype=torch.bfloat16) halves it (--init-dtype bf16), the fp32 "
                                     "master then starting from the bf16 values")
                            : std::string());
  }
  return "";
}

struct Try {
  bool fits = false;
  std::string why;
  MemoryEstimate est;
  Config config;
};

Try Estimate(const Config& base, const LargestOptions& o, int64_t layers, int64_t d, int64_t heads) {
  Try t;
  t.config = base;
  t.config.model.n_layers = layers;
  t.config.model.d_model = d;
  t.config.model.n_heads = heads;
  auto spec = GptModelSpec(t.config.model);
  if (!spec.ok()) {
    t.why = spec.status().message();
    return t;
  }
  EstimateOptions eo;
  eo.world_size = o.world_size;
  eo.device = o.device;
  eo.device_capacity = o.device_bytes;
  eo.host_available = o.host_bytes;
  eo.disk_free = o.disk_bytes;
  eo.build = o.build;
  eo.init_element_bytes = o.init_element_bytes;
  eo.device_flag = o.device_flag;
  eo.host_flag = o.host_flag;
  eo.disk_flag = o.disk_flag;
  auto est = EstimateAutoReserve(t.config, *spec, eo);
  if (!est.ok()) {
    t.why = est.status().message();
    return t;
  }
  t.est = *est;
  t.config.strata.device_reserve = t.est.device_reserve;
  t.why = Overflows(t.est, o);
  t.fits = t.why.empty();
  return t;
}

}  // namespace

const std::vector<std::pair<int64_t, int64_t>>& Gpt3Widths() {
  static const std::vector<std::pair<int64_t, int64_t>> widths = {
      {768, 12},   {1024, 16},  {1536, 16},  {2048, 16}, {2560, 32},
      {4096, 32},  {5120, 40},  {6144, 48},  {8192, 64}, {12288, 96}};
  return widths;
}

StatusOr<LargestResult> FindLargest(const Config& base_in, const LargestOptions& o) {
  if (o.device_bytes == 0 || o.host_bytes == 0)
    return InvalidArgument("--largest needs the device's and the host's memory (--hbm, --host)");
  Config base = base_in;
  auto& z = base.zero_optimization;
  z.stage = 3;
  for (auto* section : {&z.offload_param.device, &z.offload_optimizer.device}) *section = OffloadDevice::kNvme;
  if (z.offload_optimizer.nvme_path.empty()) z.offload_optimizer.nvme_path = {o.nvme_path};
  if (z.offload_param.nvme_path.empty()) z.offload_param.nvme_path = {o.nvme_path};
  base.strata.placement = PlacementMode::kAuto;
  if (base.strata.device_memory_budget == 0) base.strata.device_memory_budget = o.device_bytes;
  base.model.checkpoint_activations = true;
  if (!base.fp16.enabled) base.bf16.enabled = true;

  std::optional<LargestResult> best;
  std::string narrowest_why;
  for (const auto& [d, heads] : Gpt3Widths()) {
    // The most layers that fit at this width: doubling, then bisection (fitting is monotone).
    Try one = Estimate(base, o, 1, d, heads);
    if (!one.fits) {
      if (narrowest_why.empty()) narrowest_why = StrCat("1 x ", d, ": ", one.why);
      continue;
    }
    const int64_t deepest = d / 32;
    int64_t lo = 1, hi = 2;
    Try at_lo = one, at_hi;
    while (hi <= deepest) {
      at_hi = Estimate(base, o, hi, d, heads);
      if (!at_hi.fits) break;
      lo = hi;
      at_lo = at_hi;
      hi *= 2;
    }
    if (hi > deepest) {  // as deep as the family goes: the bisection runs to one past it
      at_hi = Estimate(base, o, deepest, d, heads);
      if (at_hi.fits) {
        lo = deepest;
        at_lo = at_hi;
        hi = deepest + 1;
        at_hi.why = StrCat("deeper than the family's aspect (d_model / 32 = ", deepest, " layers)");
        at_hi.fits = false;
      } else {
        hi = deepest;
      }
    }
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      Try m = Estimate(base, o, mid, d, heads);
      if (m.fits) {
        lo = mid;
        at_lo = std::move(m);
      } else {
        hi = mid;
        at_hi = std::move(m);
      }
    }
    if (!best || at_lo.est.param_numel > best->params) {
      LargestResult r;
      r.shape = at_lo.config.model;
      r.params = at_lo.est.param_numel;
      r.estimate = at_lo.est;
      r.config = at_lo.config;
      Try next = hi == lo + 1 ? at_hi : Estimate(base, o, lo + 1, d, heads);
      r.next_refused = StrCat(lo + 1, " x ", d, ": ", next.why);
      best = std::move(r);
    }
  }
  if (!best) return NotFound(StrCat("no GPT of the GPT-3 widths fits: ", narrowest_why));
  return *best;
}

nlohmann::json LargestResult::ToJson() const {
  return {{"n_layers", shape.n_layers},
          {"d_model", shape.d_model},
          {"n_heads", shape.n_heads},
          {"seq_len", shape.seq_len},
          {"params", params},
          {"bytes_per_param", estimate.bytes_per_param},
          {"placement", estimate.placement},
          {"hbm_bytes", estimate.hbm_bytes},
          {"host_pinned_bytes", estimate.host_pinned_bytes},
          {"host_pageable_bytes", estimate.host_pageable_bytes},
          {"nvme_bytes", estimate.nvme_bytes},
          {"device_reserve", config.strata.device_reserve},
          {"next_refused", next_refused}};
}

}  // namespace strata::planner
