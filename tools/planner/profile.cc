#include "tools/planner/profile.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace strata::planner {

StatusOr<NvmePoint> HardwareProfile::BestAio() const {
  const NvmePoint* best = nullptr;
  for (const auto& p : nvme) {
    if (p.write) continue;
    if (!best || p.gbps > best->gbps * 1.03) {
      best = &p;
    } else if (p.gbps > best->gbps * 0.97) {
      // Within noise of the best read: prefer the better write at that setting.
      auto w_new = NvmeGbps(true, p.block_size, p.queue_depth, p.parallelism);
      auto w_old = NvmeGbps(true, best->block_size, best->queue_depth, best->parallelism);
      if (w_new.ok() && (!w_old.ok() || *w_new > *w_old)) best = &p;
    }
  }
  if (!best) return NotFound("the profile has no NVMe read measurements (run profile with --path)");
  return *best;
}

StatusOr<double> HardwareProfile::NvmeGbps(bool write, int64_t block_size, int64_t queue_depth,
                                           int64_t parallelism) const {
  for (const auto& p : nvme)
    if (p.write == write && p.block_size == block_size && p.queue_depth == queue_depth &&
        p.parallelism == parallelism)
      return p.gbps;
  return NotFound(StrCat("no NVMe ", write ? "write" : "read", " figure at block_size=", block_size,
                         " queue_depth=", queue_depth, " intra_op_parallelism=", parallelism));
}

double HardwareProfile::CopyGbps(const std::string& dev, const std::string& direction) const {
  double pageable = 0;
  for (const auto& c : copies) {
    if (c.device != dev || c.direction != direction) continue;
    if (c.memory == "pinned") return c.gbps;
    pageable = c.gbps;
  }
  return pageable;
}

nlohmann::json HardwareProfile::ToJson() const {
  nlohmann::json j = {{"version", 1}, {"device", device}};
  if (!nvme.empty()) {
    nlohmann::json pts = nlohmann::json::array();
    for (const auto& p : nvme)
      pts.push_back({{"op", p.write ? "write" : "read"},
                     {"block_size", p.block_size},
                     {"queue_depth", p.queue_depth},
                     {"intra_op_parallelism", p.parallelism},
                     {"gbps", p.gbps}});
    j["nvme"] = {{"path", nvme_path}, {"engine", nvme_engine}, {"points", pts}};
    if (has_fio)
      j["nvme"]["fio"] = {{"op", fio.write ? "write" : "read"},
                          {"block_size", fio.block_size},
                          {"queue_depth", fio.queue_depth},
                          {"gbps", fio.gbps}};
    auto best = BestAio();
    if (best.ok())
      j["recommended_aio"] = {{"block_size", best->block_size},
                              {"queue_depth", best->queue_depth},
                              {"intra_op_parallelism", best->parallelism}};
  }
  if (dram_gbps > 0) j["dram"] = {{"copy_gbps", dram_gbps}};
  if (!copies.empty()) {
    nlohmann::json cs = nlohmann::json::array();
    for (const auto& c : copies)
      cs.push_back({{"device", c.device}, {"memory", c.memory}, {"direction", c.direction}, {"gbps", c.gbps}});
    j["copies"] = cs;
  }
  if (adam_gelems_per_s > 0) {
    j["adam"] = {{"elements", adam_elements}, {"gelems_per_s", adam_gelems_per_s}, {"isa", adam_isa}};
    for (const auto& [layout, rate] : adam_layout_gelems_per_s) j["adam"]["layouts"][layout] = rate;
    if (adam_threads > 0) j["adam"]["threads"] = adam_threads;
    if (physical_cores > 0) j["adam"]["physical_cores"] = physical_cores;
    for (const auto& [layout, rate] : adam_one_thread_gelems_per_s) j["adam"]["one_thread"][layout] = rate;
  }
  if (comm_busbw_gbps > 0)
    j["comm"] = {{"backend", comm_backend}, {"world_size", comm_world_size}, {"busbw_gbps", comm_busbw_gbps}};
  if (compute_gflops > 0) {
    j["compute"] = {{"device", compute_device}, {"dtype", compute_dtype}, {"gflops", compute_gflops}};
    if (compute_fp32_gflops > 0) j["compute"]["fp32_gflops"] = compute_fp32_gflops;
  }
  if (device_capacity_bytes > 0)
    j["device_memory"] = {{"name", device_name}, {"capacity_bytes", device_capacity_bytes}};
  return j;
}

namespace {

// Reads j[key] as a number > 0 (or >= 0), naming the path on failure.
Status Num(const nlohmann::json& j, const std::string& where, const char* key, double* out) {
  if (!j.contains(key) || !j[key].is_number())
    return InvalidArgument(StrCat("profile: ", where, ".", key, " is missing or not a number"));
  *out = j[key].get<double>();
  if (!(*out >= 0) || !std::isfinite(*out))
    return InvalidArgument(StrCat("profile: ", where, ".", key, "=", *out, ": must be a finite number >= 0"));
  return Status::Ok();
}

// Reads j[key] as a whole number in [lo, hi], naming the path on failure.
Status Whole(const nlohmann::json& j, const std::string& where, const char* key, int64_t lo, int64_t hi,
             int64_t* out) {
  double v = 0;
  STRATA_RETURN_IF_ERROR(Num(j, where, key, &v));
  if (v != std::floor(v) || v < static_cast<double>(lo) || v > static_cast<double>(hi))
    return InvalidArgument(StrCat("profile: ", where, ".", key, "=", v, ": must be a whole number in ", lo,
                                  "..", hi));
  *out = static_cast<int64_t>(v);
  return Status::Ok();
}

Status Str(const nlohmann::json& j, const std::string& where, const char* key, std::string* out) {
  if (!j.contains(key) || !j[key].is_string())
    return InvalidArgument(StrCat("profile: ", where, ".", key, " is missing or not a string"));
  *out = j[key].get<std::string>();
  return Status::Ok();
}

Status Point(const nlohmann::json& p, const std::string& where, NvmePoint* out) {
  std::string op;
  STRATA_RETURN_IF_ERROR(Str(p, where, "op", &op));
  if (op != "read" && op != "write")
    return InvalidArgument(StrCat("profile: ", where, ".op=\"", op, "\": must be read or write"));
  out->write = op == "write";
  // The ranges the aio config accepts: a point outside them is one no run could use.
  STRATA_RETURN_IF_ERROR(Whole(p, where, "block_size", 4096, int64_t{1} << 30, &out->block_size));
  if (out->block_size % 4096 != 0)
    return InvalidArgument(StrCat("profile: ", where, ".block_size=", out->block_size,
                                  ": must be a multiple of 4096 (O_DIRECT)"));
  STRATA_RETURN_IF_ERROR(Whole(p, where, "queue_depth", 1, 4096, &out->queue_depth));
  out->parallelism = 1;
  if (p.contains("intra_op_parallelism"))
    STRATA_RETURN_IF_ERROR(Whole(p, where, "intra_op_parallelism", 1, 256, &out->parallelism));
  STRATA_RETURN_IF_ERROR(Num(p, where, "gbps", &out->gbps));
  if (out->gbps <= 0) return InvalidArgument(StrCat("profile: ", where, ".gbps=0: a measured rate is > 0"));
  return Status::Ok();
}

}  // namespace

StatusOr<HardwareProfile> HardwareProfile::FromJson(const nlohmann::json& j) {
  if (!j.is_object()) return InvalidArgument("profile: the top level must be a JSON object");
  HardwareProfile h;
  if (j.contains("device")) STRATA_RETURN_IF_ERROR(Str(j, "", "device", &h.device));
  if (j.contains("nvme")) {
    const auto& n = j["nvme"];
    if (n.contains("path")) STRATA_RETURN_IF_ERROR(Str(n, "nvme", "path", &h.nvme_path));
    if (n.contains("engine")) STRATA_RETURN_IF_ERROR(Str(n, "nvme", "engine", &h.nvme_engine));
    if (!n.contains("points") || !n["points"].is_array())
      return InvalidArgument("profile: nvme.points is missing or not an array");
    for (size_t i = 0; i < n["points"].size(); ++i) {
      NvmePoint p;
      STRATA_RETURN_IF_ERROR(Point(n["points"][i], StrCat("nvme.points[", i, "]"), &p));
      h.nvme.push_back(p);
    }
    if (n.contains("fio")) {
      STRATA_RETURN_IF_ERROR(Point(n["fio"], "nvme.fio", &h.fio));
      h.has_fio = true;
    }
  }
  if (j.contains("dram")) STRATA_RETURN_IF_ERROR(Num(j["dram"], "dram", "copy_gbps", &h.dram_gbps));
  if (j.contains("copies")) {
    if (!j["copies"].is_array()) return InvalidArgument("profile: copies must be an array");
    for (size_t i = 0; i < j["copies"].size(); ++i) {
      const auto& c = j["copies"][i];
      const std::string w = StrCat("copies[", i, "]");
      CopyFigure f;
      STRATA_RETURN_IF_ERROR(Str(c, w, "device", &f.device));
      STRATA_RETURN_IF_ERROR(Str(c, w, "memory", &f.memory));
      STRATA_RETURN_IF_ERROR(Str(c, w, "direction", &f.direction));
      STRATA_RETURN_IF_ERROR(Num(c, w, "gbps", &f.gbps));
      h.copies.push_back(f);
    }
  }
  if (j.contains("adam")) {
    STRATA_RETURN_IF_ERROR(Num(j["adam"], "adam", "gelems_per_s", &h.adam_gelems_per_s));
    if (j["adam"].contains("elements"))
      STRATA_RETURN_IF_ERROR(Whole(j["adam"], "adam", "elements", 0, int64_t{1} << 50, &h.adam_elements));
    if (j["adam"].contains("isa")) STRATA_RETURN_IF_ERROR(Str(j["adam"], "adam", "isa", &h.adam_isa));
    if (j["adam"].contains("layouts")) {
      const nlohmann::json& ls = j["adam"]["layouts"];
      if (!ls.is_object()) return InvalidArgument("profile: adam.layouts must be an object of rates by layout name");
      for (auto it = ls.begin(); it != ls.end(); ++it) {
        double rate = 0;
        STRATA_RETURN_IF_ERROR(Num(ls, "adam.layouts", it.key().c_str(), &rate));
        h.adam_layout_gelems_per_s[it.key()] = rate;
      }
    }
    int64_t count = 0;
    if (j["adam"].contains("threads")) {
      STRATA_RETURN_IF_ERROR(Whole(j["adam"], "adam", "threads", 1, 1 << 16, &count));
      h.adam_threads = static_cast<int>(count);
    }
    if (j["adam"].contains("physical_cores")) {
      STRATA_RETURN_IF_ERROR(Whole(j["adam"], "adam", "physical_cores", 1, 1 << 16, &count));
      h.physical_cores = static_cast<int>(count);
    }
    if (j["adam"].contains("one_thread")) {
      const nlohmann::json& ls = j["adam"]["one_thread"];
      if (!ls.is_object())
        return InvalidArgument("profile: adam.one_thread must be an object of one-thread rates by layout name");
      for (auto it = ls.begin(); it != ls.end(); ++it) {
        double rate = 0;
        STRATA_RETURN_IF_ERROR(Num(ls, "adam.one_thread", it.key().c_str(), &rate));
        h.adam_one_thread_gelems_per_s[it.key()] = rate;
      }
    }
  }
  if (j.contains("compute")) {
    STRATA_RETURN_IF_ERROR(Num(j["compute"], "compute", "gflops", &h.compute_gflops));
    if (j["compute"].contains("fp32_gflops"))
      STRATA_RETURN_IF_ERROR(Num(j["compute"], "compute", "fp32_gflops", &h.compute_fp32_gflops));
    if (j["compute"].contains("dtype"))
      STRATA_RETURN_IF_ERROR(Str(j["compute"], "compute", "dtype", &h.compute_dtype));
    if (j["compute"].contains("device"))
      STRATA_RETURN_IF_ERROR(Str(j["compute"], "compute", "device", &h.compute_device));
    if (h.compute_device != "cpu" && h.compute_device != "cuda")
      return InvalidArgument(StrCat("profile: compute.device=\"", h.compute_device, "\": must be cpu or cuda"));
  }
  if (j.contains("device_memory")) {
    int64_t cap = 0;
    STRATA_RETURN_IF_ERROR(Whole(j["device_memory"], "device_memory", "capacity_bytes", 0, int64_t{1} << 60, &cap));
    if (j["device_memory"].contains("name"))
      STRATA_RETURN_IF_ERROR(Str(j["device_memory"], "device_memory", "name", &h.device_name));
    h.device_capacity_bytes = static_cast<uint64_t>(cap);
  }
  if (j.contains("comm")) {
    int64_t w = 0;
    STRATA_RETURN_IF_ERROR(Num(j["comm"], "comm", "busbw_gbps", &h.comm_busbw_gbps));
    if (j["comm"].contains("world_size"))
      STRATA_RETURN_IF_ERROR(Whole(j["comm"], "comm", "world_size", 0, 1 << 20, &w));
    if (j["comm"].contains("backend")) STRATA_RETURN_IF_ERROR(Str(j["comm"], "comm", "backend", &h.comm_backend));
    h.comm_world_size = static_cast<int>(w);
  }
  return h;
}

StatusOr<HardwareProfile> HardwareProfile::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound(StrCat("profile ", path, ": cannot open it (run `strata-swapbench profile --json > ",
                                  path, "`)"));
  std::stringstream ss;
  ss << in.rdbuf();
  return FromJsonText(ss.str(), path);
}

StatusOr<HardwareProfile> HardwareProfile::FromJsonText(std::string_view text, const std::string& source) {
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(StrCat("profile ", source, ": not valid JSON"));
  auto h = FromJson(j);
  if (!h.ok()) return h.status().WithContext(source);
  return h;
}

}  // namespace strata::planner
