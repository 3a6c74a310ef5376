// FindLargest: the largest GPT a machine trains, by the engine's own placement plan
// (strata.placement auto over device, host and NVMe) and the memory model's peaks.
//
// A shape family fixes the widths (GPT-3's table: d_model 768 to 12288 with its head counts);
// for each width the layer count is searched (training fits when it fits with fewer layers) up
// to GPT-3's aspect (at most d_model / 32 layers: its table runs from 64 to 128), and the largest
// parameter count over all widths wins. A size fits when:
// - the placement plan places every block (StepPlan::Make does not refuse it);
// - the device's peak (resident states, gathered chunks, gradient buffers, activations of one
//   micro-batch) stays within the device budget;
// - the pinned pool and the pageable host memory stay within the host's;
// - the NVMe bytes stay within the disk's.
// The runs are stage 3 with both sections' device nvme (the floors: every tier allowed), bf16
// unless the base config computes in fp32, activation checkpointing on.
// Thread-safety: plain functions on values.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/config.h"
#include "runtime/base/status.h"
#include "tools/planner/memory_model.h"
#include "tools/planner/model_spec.h"

namespace strata::planner {

struct LargestOptions {
  std::string device = "cpu";  // "cpu" or "cuda"
  uint64_t device_bytes = 0;   // the device's memory per rank (> 0)
  uint64_t host_bytes = 0;     // host memory available (> 0)
  uint64_t disk_bytes = 0;     // free disk at the NVMe path (0: no NVMe)
  std::string nvme_path;       // written into the configs tried
  int world_size = 1;
  EstimateOptions::Build build = EstimateOptions::Build::kStrataTrain;  // whose staging bounds the disk
  int init_element_bytes = 0;  // EstimateOptions::init_element_bytes
  std::string device_flag, host_flag, disk_flag;  // EstimateOptions' (the flags that set them)
};

struct LargestResult {
  ModelConfig shape;        // the largest that fits
  int64_t params = 0;
  MemoryEstimate estimate;  // its estimate, placement plan included
  Config config;            // the config it was estimated with
  // The next size up at the same width (one more layer), and why it does not fit.
  std::string next_refused;
  nlohmann::json ToJson() const;
};

// The GPT-3 widths (d_model, heads) the search walks.
const std::vector<std::pair<int64_t, int64_t>>& Gpt3Widths();

// Searches from `base` (its seq_len, micro-batch, dtype, chunk size, budgets if set). NOT_FOUND
// when not even one layer of the narrowest width fits, naming why.
StatusOr<LargestResult> FindLargest(const Config& base, const LargestOptions& options);

}  // namespace strata::planner
