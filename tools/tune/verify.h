// --verify for strata-tune: runs a few steps of a config through strata::Engine on one rank and
// reports the measured step time and lanes.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/base/config.h"
#include "runtime/base/status.h"

namespace strata::tune {

struct VerifyResult {
  double step_time_s = 0;  // median over the steps after the first (warm-up)
  // Median busy seconds per lane over the same steps, named as strata-tune's prediction names
  // them: step, compute, copy, nvme, optimizer, comm.
  std::map<std::string, double> lanes;
  nlohmann::json last_report;  // StepReport::ToJson of the last step
};

// Trains config.model (a GPT) for `steps` optimizer steps on random tokens. `device` is "cpu"
// or "cuda"; `nvme_path` overrides the config's paths when set.
StatusOr<VerifyResult> VerifyConfig(const Config& config, const std::string& device,
                                    const std::string& nvme_path, int steps);

}  // namespace strata::tune
