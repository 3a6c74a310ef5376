// HardwareProfile: the measured figures the cost model needs, as `strata-swapbench profile --json`
// writes them and strata-tune reads them. One schema, one struct, both directions.
//
// JSON (all bandwidths decimal GB/s):
//   {"version": 1, "device": "cpu",
//    "nvme": {"path": "...", "engine": "io_uring", "points": [
//       {"op": "read"|"write", "block_size": B, "queue_depth": Q, "intra_op_parallelism": P,
//        "gbps": x}, ...],
//       "fio": {"op": "read", "block_size": B, "queue_depth": Q, "gbps": x} (optional)},
//    "dram": {"copy_gbps": x},
//    "copies": [{"device": "cpu"|"cuda", "memory": "pinned"|"pageable",
//                "direction": "h2d"|"d2h", "gbps": x}, ...],
//    "adam": {"elements": N, "gelems_per_s": x, "isa": "avx512",
//             "layouts": {"int8+bf16_master": x, ...} (optional: the rate of each optimizer-state
//             layout other than fp32, keyed by StateLayout::Name()),
//             "threads": T, "physical_cores": P (optional: the threads those rates ran on, and
//             the machine's physical cores),
//             "one_thread": {"fp32": x, "int8": y, ...} (optional: each layout's rate on one
//             thread)},
//    "compute": {"device": "cpu"|"cuda", "dtype": "bf16"|"fp32", "gflops": x,
//                "fp32_gflops": y (optional)} (a matmul on the profile's device; "device" missing
//                reads as "cpu", where profiles before it measured),
//    "device_memory": {"name": "cuda:0 (...)", "capacity_bytes": N} (cuda only: the memory the
//                engine's device would have, the GPU's free memory when profiled),
//    "comm": {"backend": "gloo", "world_size": N, "busbw_gbps": x} (strata-commbench --profile),
//    "recommended_aio": {"block_size": B, "queue_depth": Q, "intra_op_parallelism": P}}
// Sections may be missing (a profile without --path has no "nvme"); readers say what is missing
// when they need it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "runtime/base/status.h"

namespace strata::planner {

struct NvmePoint {
  bool write = false;
  int64_t block_size = 0;
  int64_t queue_depth = 0;
  int64_t parallelism = 1;
  double gbps = 0;
};

struct CopyFigure {
  std::string device;     // "cpu" or "cuda"
  std::string memory;     // "pinned" or "pageable"
  std::string direction;  // "h2d" or "d2h"
  double gbps = 0;
};

struct HardwareProfile {
  std::string device = "cpu";
  std::string nvme_path;
  std::string nvme_engine;
  std::vector<NvmePoint> nvme;
  bool has_fio = false;
  NvmePoint fio;           // fio's figure at one point (the ceiling for ours)
  double dram_gbps = 0;    // streaming copy (the ceiling for host copies)
  std::vector<CopyFigure> copies;
  int64_t adam_elements = 0;
  double adam_gelems_per_s = 0;  // fp32 master and moments
  // The other optimizer-state layouts' rates, by StateLayout::Name() ("bf16", "int8",
  // "bf16+bf16_master", "int8+bf16_master"); a layout missing here has no figure.
  std::map<std::string, double> adam_layout_gelems_per_s;
  std::string adam_isa;
  // Optional (0 or empty where a profile lacks them): the threads the rates above ran on, the
  // physical cores, and each layout's rate on one thread ("fp32" and the layouts' names), from
  // which the cost model scales the rate to the optimizer lane's own threads.
  int adam_threads = 0;
  int physical_cores = 0;
  std::map<std::string, double> adam_one_thread_gelems_per_s;
  std::string compute_device = "cpu";  // where the matmul ran: the profile's device
  std::string compute_dtype;      // dtype of compute_gflops ("bf16" when measured by profile)
  double compute_gflops = 0;
  double compute_fp32_gflops = 0;  // optional: fp32 matmul rate (for configs without bf16/fp16)
  // cuda only: the device as the engine would open it (its name, and its capacity: the free
  // memory when profiled); 0 when not measured.
  std::string device_name;
  uint64_t device_capacity_bytes = 0;
  // Optional: collectives' bus bandwidth (the slower of all-gather and reduce-scatter), measured
  // by strata-commbench on comm_world_size ranks; strata-tune needs it for --world-size > 1.
  std::string comm_backend;
  int comm_world_size = 0;
  double comm_busbw_gbps = 0;

  // The fastest read point, with the write figure at the same setting breaking ties; aio.
  // block_size / queue_depth / intra_op_parallelism to recommend. NOT_FOUND without NVMe points.
  StatusOr<NvmePoint> BestAio() const;
  // Bandwidth at exactly this setting, or NOT_FOUND.
  StatusOr<double> NvmeGbps(bool write, int64_t block_size, int64_t queue_depth,
                            int64_t parallelism) const;
  // A copy figure for `device` ("cpu"/"cuda") preferring pinned memory; 0 when not measured.
  double CopyGbps(const std::string& device, const std::string& direction) const;

  nlohmann::json ToJson() const;
  // Fails with the key that is malformed (missing sections are allowed).
  static StatusOr<HardwareProfile> FromJson(const nlohmann::json& j);
  // The same from JSON text; `source` (the file's path) names it in messages.
  static StatusOr<HardwareProfile> FromJsonText(std::string_view text, const std::string& source);
  static StatusOr<HardwareProfile> FromFile(const std::string& path);
};

}  // namespace strata::planner
