#include "runtime/base/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

#include "runtime/base/logging.h"
#include "runtime/base/units.h"

namespace strata {
namespace {

using json = nlohmann::json;

size_t EditDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string Describe(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// Reads one JSON object section, recording which keys were consumed so that Finish() can name
// any key nobody asked for. Every accessor leaves the default in place when the key is absent.
// Note [strict keys]: DeepSpeed silently ignores keys it does not know, so a typo such as
// "stage3_prefech_bucket_size" runs with the default and nobody notices. Strata refuses them.
class Section {
 public:
  Section(const json* obj, std::string path, std::vector<std::string>* warnings,
          std::vector<std::string>* autos)
      : obj_(obj), path_(std::move(path)), warnings_(warnings), autos_(autos) {}

  bool has(const std::string& key) const { return obj_ && obj_->contains(key); }

  std::string Key(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

  void Warn(const std::string& msg) { warnings_->push_back(msg); }

  const json* Get(const std::string& key) {
    known_.insert(key);
    if (!obj_) return nullptr;
    auto it = obj_->find(key);
    if (it == obj_->end() || it->is_null()) return nullptr;
    return &*it;
  }

  // Keys DeepSpeed accepts that have no effect here: allowed, with a warning.
  void Ignored(const std::string& key, const char* why) {
    if (Get(key)) Warn(StrCat(Key(key), " is accepted for DeepSpeed compatibility but ", why));
  }

  // Note [auto values]: Hugging Face's DeepSpeed integration writes "auto" for values it fills
  // in from the trainer's arguments. Strata records the key (Config::auto_keys), leaves the
  // default in place, and Config::ResolveAuto fills it from the run. Accessors call this first.
  bool IsAuto(const std::string& key) {
    const json* v = Get(key);
    if (!v || !v->is_string() || v->get<std::string>() != "auto") return false;
    autos_->push_back(Key(key));
    return true;
  }

  // An old spelling: read as `now` (which must not also be present).
  Status Alias(const std::string& old_key, const std::string& now_key) {
    known_.insert(old_key);
    if (!obj_ || !obj_->contains(old_key)) return Status::Ok();
    if (obj_->contains(now_key)) {
      return InvalidArgument(StrCat(Key(old_key), " and ", Key(now_key),
                                    " are both set; remove the deprecated ", Key(old_key)));
    }
    Warn(StrCat(Key(old_key), " is deprecated; use ", Key(now_key), " (value taken)"));
    aliases_[now_key] = old_key;
    return Status::Ok();
  }

  Status Bool(const std::string& key, bool* out) {
    if (IsAuto(key)) return Status::Ok();
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    if (v->is_boolean()) {
      *out = v->get<bool>();
      return Status::Ok();
    }
    if (v->is_string()) {
      std::string s = v->get<std::string>();
      std::string lower = s;
      std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
      if (lower == "true" || lower == "false") {
        Warn(StrCat(Name(key), "=\"", s, "\" is a string; write the JSON boolean ", lower));
        *out = lower == "true";
        return Status::Ok();
      }
    }
    return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be true or false"));
  }

  Status Int(const std::string& key, int64_t* out, int64_t lo, int64_t hi) {
    if (IsAuto(key)) return Status::Ok();
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    double d;
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
        return Range(key, *v, lo, hi);
      *out = v->get<int64_t>();
    } else if (v->is_number_float()) {  // 5e8 parses as a float in JSON
      d = v->get<double>();
      if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.2e18)
        return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a whole number in ",
                                      lo, "..", hi));
      *out = static_cast<int64_t>(d);
    } else {
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a whole number in ", lo,
                                    "..", hi));
    }
    if (*out < lo || *out > hi) return Range(key, *v, lo, hi);
    return Status::Ok();
  }

  Status Double(const std::string& key, double* out, double lo, double hi, bool hi_open = false,
                bool lo_open = false) {
    if (IsAuto(key)) return Status::Ok();
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    if (!v->is_number())
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a number in ",
                                    lo_open ? "(" : "[", lo, ", ", hi, hi_open ? ")" : "]"));
    double d = v->get<double>();
    bool ok = std::isfinite(d) && (lo_open ? d > lo : d >= lo) && (hi_open ? d < hi : d <= hi);
    if (!ok)
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be in ",
                                    lo_open ? "(" : "[", lo, ", ", hi, hi_open ? ")" : "]"));
    *out = d;
    return Status::Ok();
  }

  // A byte count: a whole number, 5e8, or a string such as "24GiB".
  Status Bytes(const std::string& key, uint64_t* out, uint64_t lo, uint64_t hi) {
    if (IsAuto(key)) return Status::Ok();
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    uint64_t b = 0;
    if (v->is_string()) {
      auto parsed = ParseBytes(v->get<std::string>());
      if (!parsed.ok()) return InvalidArgument(StrCat(Name(key), ": ", parsed.status().message()));
      b = *parsed;
    } else if (v->is_number_unsigned() || (v->is_number_integer() && v->get<int64_t>() >= 0)) {
      b = v->get<uint64_t>();
    } else if (v->is_number_float() && std::isfinite(v->get<double>()) && v->get<double>() >= 0 &&
               v->get<double>() == std::floor(v->get<double>()) && v->get<double>() < 1.8e19) {
      b = static_cast<uint64_t>(v->get<double>());
    } else {
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v),
                                    ": must be a byte count such as 1073741824, 1e9 or \"1GiB\""));
    }
    if (b < lo || b > hi)
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be between ",
                                    FormatBytes(lo), " and ", FormatBytes(hi)));
    *out = b;
    return Status::Ok();
  }

  Status String(const std::string& key, std::string* out) {
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    if (!v->is_string())
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a string"));
    *out = v->get<std::string>();
    return Status::Ok();
  }

  // A string or a list of strings.
  Status StringList(const std::string& key, std::vector<std::string>* out) {
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    std::vector<std::string> r;
    if (v->is_string()) {
      r.push_back(v->get<std::string>());
    } else if (v->is_array()) {
      for (const auto& e : *v) {
        if (!e.is_string())
          return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a string or a list of strings"));
        r.push_back(e.get<std::string>());
      }
    } else {
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be a string or a list of strings"));
    }
    for (const auto& s : r)
      if (s.empty()) return InvalidArgument(StrCat(Name(key), ": an empty path is not allowed"));
    *out = std::move(r);
    return Status::Ok();
  }

  // A case-insensitive choice among named values.
  template <typename E>
  Status Enum(const std::string& key, E* out, const std::vector<std::pair<std::string, E>>& choices) {
    const json* v = Lookup(key);
    if (!v) return Status::Ok();
    std::string names;
    for (const auto& c : choices) names += (names.empty() ? "" : ", ") + c.first;
    if (!v->is_string())
      return InvalidArgument(StrCat(Name(key), "=", Describe(*v), ": must be one of ", names));
    std::string s = v->get<std::string>();
    std::string lower = s;
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    for (const auto& c : choices) {
      std::string cl = c.first;
      std::transform(cl.begin(), cl.end(), cl.begin(), ::tolower);
      if (cl == lower) {
        *out = c.second;
        return Status::Ok();
      }
    }
    return InvalidArgument(StrCat(Name(key), "=\"", s, "\": must be one of ", names));
  }

  // A nested object (absent → an empty section so defaults stay).
  StatusOr<Section> Child(const std::string& key) {
    const json* v = Get(key);
    if (v && !v->is_object())
      return InvalidArgument(StrCat(Key(key), "=", Describe(*v), ": must be a JSON object"));
    return Section(v, Key(key), warnings_, autos_);
  }

  // Errors on the first key nobody consumed, suggesting the closest known spelling. With
  // warn_only (the top level, where DeepSpeed ignores unknown keys) each such key is a warning.
  Status Finish(bool warn_only = false) {
    if (!obj_) return Status::Ok();
    for (auto it = obj_->begin(); it != obj_->end(); ++it) {
      if (known_.count(it.key())) continue;
      std::string best;
      size_t best_d = std::numeric_limits<size_t>::max();
      for (const auto& k : known_) {
        size_t d = EditDistance(it.key(), k);
        // A truncated or extended spelling ("train_micro_batch_size") is closer than its raw
        // edit distance says.
        if (k.find(it.key()) != std::string::npos || it.key().find(k) != std::string::npos)
          d = std::min(d, 1 + (std::max(k.size(), it.key().size()) -
                               std::min(k.size(), it.key().size())) / 4);
        if (d < best_d) best_d = d, best = k;
      }
      std::string msg = StrCat("unknown key ", Key(it.key()));
      const bool close = !best.empty() && best_d <= std::max<size_t>(3, it.key().size() / 3);
      if (warn_only) {
        Warn(StrCat(msg, " is ignored (DeepSpeed ignores it too)",
                    close ? StrCat("; did you mean ", Key(best), "?") : std::string()));
        continue;
      }
      if (close)
        msg += StrCat("; did you mean ", Key(best), "?");
      else if (!known_.empty()) {
        std::string all;
        for (const auto& k : known_) all += (all.empty() ? "" : ", ") + k;
        msg += StrCat("; valid keys here: ", all);
      }
      return InvalidArgument(msg);
    }
    return Status::Ok();
  }

 private:
  // The value for `key`, or for its deprecated alias.
  const json* Lookup(const std::string& key) {
    const json* v = Get(key);
    if (v) return v;
    auto a = aliases_.find(key);
    if (a != aliases_.end()) return Get(a->second);
    return nullptr;
  }
  std::string Name(const std::string& key) const {
    auto a = aliases_.find(key);
    if (a != aliases_.end() && obj_ && obj_->contains(a->second)) return Key(a->second);
    return Key(key);
  }
  Status Range(const std::string& key, const json& v, int64_t lo, int64_t hi) const {
    return InvalidArgument(StrCat(Name(key), "=", Describe(v), ": must be in ", lo, "..", hi));
  }

  const json* obj_;
  std::string path_;
  std::vector<std::string>* warnings_;
  std::vector<std::string>* autos_;
  std::set<std::string> known_;
  std::map<std::string, std::string> aliases_;
};

constexpr int64_t kMaxElems = int64_t{1} << 50;
constexpr uint64_t kMaxBytes = uint64_t{1} << 56;

const std::vector<std::pair<std::string, OffloadDevice>> kOffloadDevices = {
    {"none", OffloadDevice::kNone}, {"cpu", OffloadDevice::kCpu}, {"nvme", OffloadDevice::kNvme}};

template <typename E>
std::string EnumName(E v, const std::vector<std::pair<std::string, E>>& choices) {
  for (const auto& c : choices)
    if (c.second == v) return c.first;
  return "?";
}

Status ParseOffloadParam(Section s, OffloadParamConfig* c) {
  STRATA_RETURN_IF_ERROR(s.Enum("device", &c->device, kOffloadDevices));
  STRATA_RETURN_IF_ERROR(s.StringList("nvme_path", &c->nvme_path));
  STRATA_RETURN_IF_ERROR(s.Int("buffer_count", &c->buffer_count, 1, 1024));
  STRATA_RETURN_IF_ERROR(s.Int("buffer_size", &c->buffer_size, 1, kMaxElems));
  STRATA_RETURN_IF_ERROR(s.Int("max_in_cpu", &c->max_in_cpu, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(s.Bool("pin_memory", &c->pin_memory));
  // Note [no silent key]: a key Strata parses but does not act on says so once.
  s.Ignored("buffer_count",
            "has no effect: parameters are staged through the host pool, sized by "
            "strata.host_memory_budget, not through a fixed number of buffers");
  s.Ignored("buffer_size", "has no effect: staging buffers are the host pool's chunk-sized blocks");
  s.Ignored("max_in_cpu",
            "has no effect: NVMe-homed parameters are cached in the host pool up to "
            "strata.host_memory_budget");
  return s.Finish();
}

Status ParseOffloadOptimizer(Section s, OffloadOptimizerConfig* c) {
  STRATA_RETURN_IF_ERROR(s.Enum("device", &c->device, kOffloadDevices));
  STRATA_RETURN_IF_ERROR(s.StringList("nvme_path", &c->nvme_path));
  STRATA_RETURN_IF_ERROR(s.Int("buffer_count", &c->buffer_count, 1, 1024));
  STRATA_RETURN_IF_ERROR(s.Bool("pin_memory", &c->pin_memory));
  STRATA_RETURN_IF_ERROR(s.Bool("pipeline_read", &c->pipeline_read));
  STRATA_RETURN_IF_ERROR(s.Bool("pipeline_write", &c->pipeline_write));
  bool pipeline = false;
  if (s.has("pipeline")) {
    STRATA_RETURN_IF_ERROR(s.Bool("pipeline", &pipeline));
    s.Warn(StrCat(s.Key("pipeline"), " is deprecated; use pipeline_read and pipeline_write"));
    c->pipeline_read = c->pipeline_write = pipeline;
  } else {
    s.Get("pipeline");
  }
  s.Ignored("fast_init", "has no effect in Strata");
  STRATA_RETURN_IF_ERROR(s.Double("ratio", &c->ratio, 0.0, 1.0));
  s.Ignored("buffer_count",
            "has no effect: optimizer states are staged through the host pool, sized by "
            "strata.host_memory_budget");
  if (s.has("pipeline_read") || s.has("pipeline_write") || s.has("pipeline"))
    s.Warn(StrCat(s.Key("pipeline_read"), "/pipeline_write have no effect: Strata always prefetches "
                  "optimizer states ahead of use from the recorded trace and writes them behind "
                  "(strata.prefetch_lookahead sets how far)"));
  if (c->ratio < 1.0)
    s.Warn(StrCat(s.Key("ratio"), "=", c->ratio,
                  " has no effect: partial optimizer offload is not implemented, every optimizer "
                  "state is offloaded (as with ratio 1.0)"));
  return s.Finish();
}

Status ParseZero(Section s, ZeroConfig* c) {
  int64_t stage = c->stage;
  STRATA_RETURN_IF_ERROR(s.Int("stage", &stage, 0, 3));
  c->stage = static_cast<int>(stage);
  STRATA_RETURN_IF_ERROR(s.Bool("contiguous_gradients", &c->contiguous_gradients));
  STRATA_RETURN_IF_ERROR(s.Bool("overlap_comm", &c->overlap_comm));
  // 0 is accepted as DeepSpeed does (Hugging Face's tests use it): no bucketing / no grouping.
  STRATA_RETURN_IF_ERROR(s.Int("reduce_bucket_size", &c->reduce_bucket_size, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(s.Int("allgather_bucket_size", &c->allgather_bucket_size, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(s.Int("sub_group_size", &c->sub_group_size, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(
      s.Int("stage3_prefetch_bucket_size", &c->stage3_prefetch_bucket_size, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(s.Int("stage3_param_persistence_threshold",
                               &c->stage3_param_persistence_threshold, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(
      s.Int("stage3_max_live_parameters", &c->stage3_max_live_parameters, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(
      s.Int("stage3_max_reuse_distance", &c->stage3_max_reuse_distance, 0, kMaxElems));
  // DeepSpeed reads these without the stage3_ prefix as well (its pydantic aliases).
  for (const char* k : {"prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
                        "max_reuse_distance", "gather_16bit_weights_on_model_save"}) {
    const std::string full = StrCat("stage3_", k);
    if (s.has(k) && s.has(full))
      return InvalidArgument(StrCat(s.Key(k), " and ", s.Key(full), " are both set; keep one"));
  }
  STRATA_RETURN_IF_ERROR(s.Int("prefetch_bucket_size", &c->stage3_prefetch_bucket_size, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(
      s.Int("param_persistence_threshold", &c->stage3_param_persistence_threshold, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(s.Int("max_live_parameters", &c->stage3_max_live_parameters, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(s.Int("max_reuse_distance", &c->stage3_max_reuse_distance, 0, kMaxElems));
  if (!c->contiguous_gradients)
    s.Warn(StrCat(s.Key("contiguous_gradients"),
                  "=false has no effect: gradients always live in contiguous chunk buffers"));
  if (s.has("overlap_comm") && c->overlap_comm)
    s.Warn(StrCat(s.Key("overlap_comm"),
                  "=true has no effect yet: all-gathers and reduce-scatters run on the compute "
                  "thread; NVMe reads and the CPU optimizer do overlap compute"));
  s.Ignored("sub_group_size",
            "has no effect: the optimizer works one chunk at a time (strata.chunk_size)");

  // DeepSpeed's pre-0.3.16 spellings of the offload switches.
  if (s.has("cpu_offload")) {
    bool v = false;
    STRATA_RETURN_IF_ERROR(s.Bool("cpu_offload", &v));
    if (s.has("offload_optimizer"))
      return InvalidArgument(StrCat(s.Key("cpu_offload"), " and ", s.Key("offload_optimizer"),
                                    " are both set; remove the deprecated cpu_offload"));
    s.Warn(StrCat(s.Key("cpu_offload"), " is deprecated; use ", s.Key("offload_optimizer"),
                  ": {\"device\": \"cpu\"} (value taken)"));
    if (v) c->offload_optimizer.device = OffloadDevice::kCpu;
  } else {
    s.Get("cpu_offload");
  }
  if (s.has("cpu_offload_params")) {
    bool v = false;
    STRATA_RETURN_IF_ERROR(s.Bool("cpu_offload_params", &v));
    if (s.has("offload_param"))
      return InvalidArgument(StrCat(s.Key("cpu_offload_params"), " and ", s.Key("offload_param"),
                                    " are both set; remove the deprecated cpu_offload_params"));
    s.Warn(StrCat(s.Key("cpu_offload_params"), " is deprecated; use ", s.Key("offload_param"),
                  ": {\"device\": \"cpu\"} (value taken)"));
    if (v) c->offload_param.device = OffloadDevice::kCpu;
  } else {
    s.Get("cpu_offload_params");
  }
  if (s.has("cpu_offload_use_pin_memory")) {
    bool v = true;
    STRATA_RETURN_IF_ERROR(s.Bool("cpu_offload_use_pin_memory", &v));
    s.Warn(StrCat(s.Key("cpu_offload_use_pin_memory"),
                  " is deprecated; use offload_param.pin_memory and offload_optimizer.pin_memory "
                  "(value taken for both)"));
    c->offload_param.pin_memory = c->offload_optimizer.pin_memory = v;
  } else {
    s.Get("cpu_offload_use_pin_memory");
  }

  STRATA_ASSIGN_OR_RETURN(Section op, s.Child("offload_param"));
  STRATA_RETURN_IF_ERROR(ParseOffloadParam(op, &c->offload_param));
  STRATA_ASSIGN_OR_RETURN(Section oo, s.Child("offload_optimizer"));
  STRATA_RETURN_IF_ERROR(ParseOffloadOptimizer(oo, &c->offload_optimizer));

  for (const char* k : {"allgather_partitions", "reduce_scatter", "round_robin_gradients",
                        "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
                        "stage3_model_persistence_threshold", "model_persistence_threshold",
                        "offload_param_nvme_path", "offload_optimizer_nvme_path",
                        "zeropp_loco_param", "log_trace_cache_warnings", "pipeline_loading_checkpoint",
                        "override_module_apply", "module_granularity_threshold",
                        "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
                        "legacy_stage1", "reduce_scatter_bucket_size",
                        "stage3_module_granularity_threshold", "zeropp_loco_param",
                        "stage3_gather_fp16_weights_on_model_save", "load_from_fp32_weights",
                        "elastic_checkpoint", "ignore_unused_parameters", "memory_efficient_linear",
                        "use_multi_rank_bucket_allreduce", "zero_hpz_partition_size",
                        "zero_quantized_weights", "zero_quantized_gradients", "mics_shard_size",
                        "mics_hierarchical_params_gather"})
    s.Ignored(k, "has no effect in Strata");
  return s.Finish();
}

Status ParseAio(Section s, AioConfig* c) {
  STRATA_RETURN_IF_ERROR(s.Alias("thread_count", "intra_op_parallelism"));
  STRATA_RETURN_IF_ERROR(s.Alias("num_threads", "intra_op_parallelism"));
  STRATA_RETURN_IF_ERROR(s.Int("block_size", &c->block_size, 4096, int64_t{1} << 30));
  if (c->block_size % 4096 != 0)
    return InvalidArgument(StrCat(s.Key("block_size"), "=", c->block_size,
                                  ": must be a multiple of 4096 (O_DIRECT alignment)"));
  STRATA_RETURN_IF_ERROR(s.Int("queue_depth", &c->queue_depth, 1, 4096));
  STRATA_RETURN_IF_ERROR(s.Int("intra_op_parallelism", &c->intra_op_parallelism, 1, 256));
  STRATA_RETURN_IF_ERROR(s.Bool("single_submit", &c->single_submit));
  STRATA_RETURN_IF_ERROR(s.Bool("overlap_events", &c->overlap_events));
  STRATA_RETURN_IF_ERROR(s.Bool("use_gds", &c->use_gds));
  if (c->use_gds)
    s.Warn(StrCat(s.Key("use_gds"),
                  "=true: GPUDirect Storage is not supported; NVMe transfers go through pinned "
                  "host memory"));
  return s.Finish();
}

}  // namespace

const char* OptimizerTypeName(OptimizerType type) {
  switch (type) {
    case OptimizerType::kAdam: return "Adam";
    case OptimizerType::kAdamW: return "AdamW";
    case OptimizerType::kSGD: return "SGD";
    case OptimizerType::kAdagrad: return "Adagrad";
    case OptimizerType::kLion: return "Lion";
  }
  return "unknown";
}

namespace {

// optimizer.params.betas: two numbers in [0, 1), or "auto" (Config::ResolveAuto fills the
// optimizer's defaults).
Status ParseBetas(Section& p, OptimizerConfig* c) {
  if (p.IsAuto("betas")) {
    // left at the optimizer's defaults, which Config::ResolveAuto reports
  } else if (const json* b = p.Get("betas")) {
    if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number() || !(*b)[1].is_number())
      return InvalidArgument(StrCat(p.Key("betas"), "=", Describe(*b),
                                    ": must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]"));
    double b1 = (*b)[0].get<double>(), b2 = (*b)[1].get<double>();
    if (!(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1))
      return InvalidArgument(StrCat(p.Key("betas"), "=", Describe(*b), ": both must be in [0, 1)"));
    c->beta1 = b1;
    c->beta2 = b2;
  }
  return Status::Ok();
}

// ParseOptimizer's parts: the type, then that type's params (each refuses what it cannot run).
Status ParseOptimizerType(Section& s, OptimizerConfig* c, bool* named_adamw) {
  // DeepSpeed's type names are case-insensitive; "DeepSpeed_Adam" is an old name of its CPU Adam.
  // Note [Adam means AdamW]: DeepSpeed builds "Adam" with adam_w_mode=true unless the params say
  // otherwise, i.e. decoupled weight decay; Strata follows it so a config trains the same here.
  if (const json* t = s.Get("type"); t && t->is_string()) {
    std::string lower = t->get<std::string>();
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    *named_adamw = lower == "adamw";
    if (lower == "adam" || lower == "deepspeed_adam" || lower == "fusedadam" || lower == "cpuadam") {
      if (lower != "adam")
        s.Warn(StrCat(s.Key("type"), "=\"", t->get<std::string>(), "\" runs Strata's CPU Adam"));
      c->type = OptimizerType::kAdamW;  // adam_w_mode below may turn it back into Adam
    } else if (lower == "adamw") {
      c->type = OptimizerType::kAdamW;
    } else if (lower == "sgd") {
      c->type = OptimizerType::kSGD;
    } else if (lower == "adagrad" || lower == "deepspeedcpuadagrad") {
      c->type = OptimizerType::kAdagrad;
    } else if (lower == "lion" || lower == "fusedlion" || lower == "deepspeedcpulion") {
      c->type = OptimizerType::kLion;
    } else {
      return InvalidArgument(StrCat(
          s.Key("type"), "=\"", t->get<std::string>(),
          "\": Strata implements Adam, AdamW, SGD, Adagrad and Lion (DeepSpeed's Lamb, OneBitAdam, "
          "OneBitLamb and ZeroOneAdam are not available); use one of those"));
    }
  } else if (t) {
    return InvalidArgument(StrCat(s.Key("type"), "=", Describe(*t),
                                  ": must be \"Adam\", \"AdamW\", \"SGD\", \"Adagrad\" or \"Lion\""));
  }
  return Status::Ok();
}

Status ParseSgdParams(Section& p, OptimizerConfig* c) {
  // torch.optim.SGD's parameters and rules.
  c->lr = 1e-2;
  STRATA_RETURN_IF_ERROR(p.Double("lr", &c->lr, 0.0, 10.0));
  STRATA_RETURN_IF_ERROR(p.Double("momentum", &c->momentum, 0.0, 1e3));
  STRATA_RETURN_IF_ERROR(p.Double("dampening", &c->dampening, 0.0, 1e3));
  STRATA_RETURN_IF_ERROR(p.Double("weight_decay", &c->weight_decay, 0.0, 1e3));
  STRATA_RETURN_IF_ERROR(p.Bool("nesterov", &c->nesterov));
  if (c->nesterov && (c->momentum <= 0 || c->dampening != 0))
    return InvalidArgument(StrCat(p.Key("nesterov"), "=true needs momentum > 0 and dampening = 0 "
                                  "(as torch.optim.SGD)"));
  if (const json* m = p.Get("maximize"); m && m->is_boolean() && m->get<bool>())
    return InvalidArgument(StrCat(p.Key("maximize"), "=true is not supported; remove it"));
  p.Ignored("foreach", "Strata's SGD is always one fused pass per chunk");
  p.Ignored("differentiable", "does not apply");
  return Status::Ok();
}

Status ParseAdagradParams(Section& p, OptimizerConfig* c) {
  // torch.optim.Adagrad's parameters (DeepSpeed's CPU Adagrad takes lr, eps, weight_decay).
  c->lr = 1e-2;
  c->eps = 1e-10;
  STRATA_RETURN_IF_ERROR(p.Double("lr", &c->lr, 0.0, 10.0));
  STRATA_RETURN_IF_ERROR(p.Double("lr_decay", &c->lr_decay, 0.0, 1e3));
  STRATA_RETURN_IF_ERROR(p.Double("eps", &c->eps, 0.0, 1.0, false, true));
  STRATA_RETURN_IF_ERROR(p.Double("weight_decay", &c->weight_decay, 0.0, 1e3));
  if (const json* a = p.Get("initial_accumulator_value");
      a && !(a->is_number() && a->get<double>() == 0.0))
    return InvalidArgument(StrCat(p.Key("initial_accumulator_value"), "=", Describe(*a),
                                  ": Strata's Adagrad starts the sum at 0 (torch's default); "
                                  "remove it or set 0"));
  if (const json* m = p.Get("maximize"); m && m->is_boolean() && m->get<bool>())
    return InvalidArgument(StrCat(p.Key("maximize"), "=true is not supported; remove it"));
  p.Ignored("foreach", "Strata's Adagrad is always one fused pass per chunk");
  p.Ignored("fused", "Strata's Adagrad is always fused");
  p.Ignored("differentiable", "does not apply");
  p.Ignored("amsgrad", "does not apply to Adagrad");
  return Status::Ok();
}

Status ParseLionParams(Section& p, OptimizerConfig* c) {
  // DeepSpeed's Lion: lr, betas, weight_decay (decoupled), with its defaults 1e-3 and
  // (0.9, 0.999) (the paper suggests beta2 = 0.99 and a 3-10x smaller lr than AdamW's).
  STRATA_RETURN_IF_ERROR(p.Double("lr", &c->lr, 0.0, 10.0));
  STRATA_RETURN_IF_ERROR(ParseBetas(p, c));
  STRATA_RETURN_IF_ERROR(p.Double("weight_decay", &c->weight_decay, 0.0, 1e3));
  p.Ignored("fused", "Strata's Lion is always fused");
  return Status::Ok();
}

Status ParseAdamParams(Section& p, OptimizerConfig* c, bool named_adamw) {
  STRATA_RETURN_IF_ERROR(p.Double("lr", &c->lr, 0.0, 10.0));
  STRATA_RETURN_IF_ERROR(ParseBetas(p, c));
  STRATA_RETURN_IF_ERROR(p.Double("eps", &c->eps, 0.0, 1.0, false, true));
  STRATA_RETURN_IF_ERROR(p.Double("weight_decay", &c->weight_decay, 0.0, 1e3));
  STRATA_RETURN_IF_ERROR(p.Bool("bias_correction", &c->bias_correction));
  // DeepSpeed's Adam takes adam_w_mode to pick decoupled decay; AdamW is always decoupled.
  if (p.has("adam_w_mode")) {
    bool w = true;
    STRATA_RETURN_IF_ERROR(p.Bool("adam_w_mode", &w));
    if (!w && !named_adamw) c->type = OptimizerType::kAdam;
  } else {
    p.Get("adam_w_mode");
  }
  p.Ignored("torch_adam", "Strata always uses its own CPU Adam");
  p.Ignored("max_grad_norm", "set gradient_clipping at the top level instead (DeepSpeed does the same)");
  p.Ignored("fused", "Strata's CPU Adam is always fused");
  p.Ignored("amsgrad", "is not supported (amsgrad=true is rejected)");
  if (const json* a = p.Get("amsgrad"); a && a->is_boolean() && a->get<bool>())
    return InvalidArgument(StrCat(p.Key("amsgrad"), "=true: AMSGrad is not supported; remove it"));
  return Status::Ok();
}

Status ParseOptimizer(Section s, OptimizerConfig* c) {
  bool named_adamw = false;  // "AdamW" itself: decoupled whatever adam_w_mode says
  STRATA_RETURN_IF_ERROR(ParseOptimizerType(s, c, &named_adamw));
  STRATA_ASSIGN_OR_RETURN(Section p, s.Child("params"));
  switch (c->type) {
    case OptimizerType::kSGD:
      STRATA_RETURN_IF_ERROR(ParseSgdParams(p, c));
      break;
    case OptimizerType::kAdagrad:
      STRATA_RETURN_IF_ERROR(ParseAdagradParams(p, c));
      break;
    case OptimizerType::kLion:
      STRATA_RETURN_IF_ERROR(ParseLionParams(p, c));
      break;
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      STRATA_RETURN_IF_ERROR(ParseAdamParams(p, c, named_adamw));
      break;
  }
  STRATA_RETURN_IF_ERROR(p.Finish());
  return s.Finish();
}

Status ParseScheduler(Section s, SchedulerConfig* c) {
  STRATA_RETURN_IF_ERROR(s.Enum("type", &c->type,
                                {{"WarmupLR", SchedulerType::kWarmupLR},
                                 {"WarmupDecayLR", SchedulerType::kWarmupDecayLR},
                                 {"WarmupCosineLR", SchedulerType::kWarmupCosineLR},
                                 {"OneCycle", SchedulerType::kOneCycle},
                                 {"LRRangeTest", SchedulerType::kLRRangeTest}}));
  STRATA_ASSIGN_OR_RETURN(Section p, s.Child("params"));
  p.Ignored("last_batch_iteration", "has no effect in Strata (a resumed run continues its "
                                    "schedule from the checkpoint's step)");
  if (c->type == SchedulerType::kOneCycle) {
    for (const char* key : {"cycle_min_lr", "cycle_max_lr"}) {
      if (!p.has(key))
        return InvalidArgument(StrCat(p.Key(key), " is required by OneCycle (its lower and upper "
                                      "learning rates), e.g. 1e-4 and 1e-3"));
    }
    STRATA_RETURN_IF_ERROR(p.Double("cycle_min_lr", &c->cycle_min_lr, 0.0, 10.0));
    STRATA_RETURN_IF_ERROR(p.Double("cycle_max_lr", &c->cycle_max_lr, 0.0, 10.0));
    STRATA_RETURN_IF_ERROR(p.Double("decay_lr_rate", &c->decay_lr_rate, 0.0, 1e6));
    STRATA_RETURN_IF_ERROR(p.Int("cycle_first_step_size", &c->cycle_first_step_size, 1, kMaxElems));
    STRATA_RETURN_IF_ERROR(p.Int("cycle_second_step_size", &c->cycle_second_step_size, -1, kMaxElems));
    STRATA_RETURN_IF_ERROR(p.Int("cycle_first_stair_count", &c->cycle_first_stair_count, 0, kMaxElems));
    STRATA_RETURN_IF_ERROR(p.Int("cycle_second_stair_count", &c->cycle_second_stair_count, -1, kMaxElems));
    STRATA_RETURN_IF_ERROR(p.Int("decay_step_size", &c->decay_step_size, 0, kMaxElems));
    STRATA_RETURN_IF_ERROR(p.Bool("cycle_momentum", &c->cycle_momentum));
    STRATA_RETURN_IF_ERROR(p.Double("cycle_min_mom", &c->cycle_min_mom, 0.0, 1.0, true, false));
    STRATA_RETURN_IF_ERROR(p.Double("cycle_max_mom", &c->cycle_max_mom, 0.0, 1.0, true, false));
    STRATA_RETURN_IF_ERROR(p.Double("decay_mom_rate", &c->decay_mom_rate, 0.0, 1e6));
    if (c->cycle_second_step_size == 0)
      return InvalidArgument(StrCat(p.Key("cycle_second_step_size"),
                                    "=0: must be >= 1, or -1 for cycle_first_step_size"));
    STRATA_RETURN_IF_ERROR(p.Finish());
    return s.Finish();
  }
  if (c->type == SchedulerType::kLRRangeTest) {
    STRATA_RETURN_IF_ERROR(p.Double("lr_range_test_min_lr", &c->lr_range_test_min_lr, 0.0, 10.0));
    STRATA_RETURN_IF_ERROR(p.Int("lr_range_test_step_size", &c->lr_range_test_step_size, 1, kMaxElems));
    STRATA_RETURN_IF_ERROR(p.Double("lr_range_test_step_rate", &c->lr_range_test_step_rate, 0.0, 1e6));
    STRATA_RETURN_IF_ERROR(p.Bool("lr_range_test_staircase", &c->lr_range_test_staircase));
    STRATA_RETURN_IF_ERROR(p.Finish());
    return s.Finish();
  }
  if (c->type == SchedulerType::kWarmupCosineLR) {
    // DeepSpeed's WarmupCosineLR scales the optimizer's lr by ratios; it takes no lr of its own.
    for (const char* key : {"warmup_min_lr", "warmup_max_lr"}) {
      if (p.has(key))
        return InvalidArgument(StrCat(p.Key(key), ": WarmupCosineLR takes ratios of the "
                                      "optimizer's lr (warmup_min_ratio, cos_min_ratio), as "
                                      "DeepSpeed's does; set the peak in optimizer.params.lr"));
    }
    STRATA_RETURN_IF_ERROR(p.Double("warmup_min_ratio", &c->warmup_min_ratio, 0.0, 1.0));
    STRATA_RETURN_IF_ERROR(p.Double("cos_min_ratio", &c->cos_min_ratio, 0.0, 1.0));
  } else {
    STRATA_RETURN_IF_ERROR(p.Double("warmup_min_lr", &c->warmup_min_lr, 0.0, 10.0));
    STRATA_RETURN_IF_ERROR(p.Double("warmup_max_lr", &c->warmup_max_lr, 0.0, 10.0));
  }
  STRATA_RETURN_IF_ERROR(p.Int("warmup_num_steps", &c->warmup_num_steps, 0, kMaxElems));
  STRATA_RETURN_IF_ERROR(p.Int("total_num_steps", &c->total_num_steps, 1, kMaxElems));
  STRATA_RETURN_IF_ERROR(p.Enum("warmup_type", &c->warmup_type,
                                {{"log", WarmupType::kLog}, {"linear", WarmupType::kLinear}}));
  STRATA_RETURN_IF_ERROR(p.Finish());
  if (c->type != SchedulerType::kNone && c->type != SchedulerType::kWarmupLR &&
      c->total_num_steps < c->warmup_num_steps)
    return InvalidArgument(StrCat(p.Key("total_num_steps"), "=", c->total_num_steps,
                                  ": must be at least warmup_num_steps=", c->warmup_num_steps));
  return s.Finish();
}

Status ParseFp16(Section s, Fp16Config* c) {
  STRATA_RETURN_IF_ERROR(s.Bool("enabled", &c->enabled));
  STRATA_RETURN_IF_ERROR(s.Double("loss_scale", &c->loss_scale, 0.0, 1e30));
  STRATA_RETURN_IF_ERROR(s.Int("initial_scale_power", &c->initial_scale_power, 0, 64));
  STRATA_RETURN_IF_ERROR(s.Int("loss_scale_window", &c->loss_scale_window, 1, kMaxElems));
  STRATA_RETURN_IF_ERROR(s.Int("hysteresis", &c->hysteresis, 1, 1000000));
  STRATA_RETURN_IF_ERROR(s.Double("min_loss_scale", &c->min_loss_scale, 0.0, 1e30));
  s.Ignored("consecutive_hysteresis", "has no effect in Strata");
  s.Ignored("auto_cast", "has no effect in Strata (the model's parameters are cast)");
  s.Ignored("fp16_master_weights_and_grads", "master weights are always fp32 in Strata");
  return s.Finish();
}

Status ParseActivationCheckpointing(Section s, ActivationCheckpointingConfig* c) {
  STRATA_RETURN_IF_ERROR(s.Bool("partition_activations", &c->partition_activations));
  STRATA_RETURN_IF_ERROR(s.Bool("cpu_checkpointing", &c->cpu_checkpointing));
  STRATA_RETURN_IF_ERROR(s.Bool("contiguous_memory_optimization", &c->contiguous_memory_optimization));
  STRATA_RETURN_IF_ERROR(s.Int("number_checkpoints", &c->number_checkpoints, 0, 1 << 20));
  STRATA_RETURN_IF_ERROR(s.Bool("synchronize_checkpoint_boundary", &c->synchronize_checkpoint_boundary));
  STRATA_RETURN_IF_ERROR(s.Bool("profile", &c->profile));
  // cpu_checkpointing acts (strata::CheckpointUnit keeps saved inputs in host memory). The rest
  // tune DeepSpeed's Megatron-style implementation and have no counterpart here.
  if (c->partition_activations)
    s.Warn("activation_checkpointing.partition_activations has no effect: it splits checkpoints "
           "across model-parallel ranks, and Strata has no model parallelism");
  if (c->contiguous_memory_optimization || c->number_checkpoints > 0)
    s.Warn("activation_checkpointing.contiguous_memory_optimization / number_checkpoints have no "
           "effect: checkpointed inputs are ordinary allocations, as many as units checkpointed");
  if (c->synchronize_checkpoint_boundary || c->profile)
    s.Warn("activation_checkpointing.synchronize_checkpoint_boundary / profile have no effect: "
           "the step report times recomputation as compute");
  return s.Finish();
}

Status ParseStrata(Section s, StrataConfig* c) {
  STRATA_RETURN_IF_ERROR(s.Bytes("device_memory_budget", &c->device_memory_budget, 0, kMaxBytes));
  STRATA_RETURN_IF_ERROR(s.Bytes("host_memory_budget", &c->host_memory_budget, 0, kMaxBytes));
  STRATA_RETURN_IF_ERROR(s.Bytes("nvme_capacity", &c->nvme_capacity, 0, kMaxBytes));
  STRATA_RETURN_IF_ERROR(s.Bytes("chunk_size", &c->chunk_size, 4096, uint64_t{1} << 34));
  if (c->chunk_size % 4096 != 0)
    return InvalidArgument(StrCat(s.Key("chunk_size"), "=", c->chunk_size,
                                  ": must be a multiple of 4096 bytes (O_DIRECT alignment)"));
  STRATA_RETURN_IF_ERROR(s.Enum("eviction", &c->eviction,
                                {{"next_use", EvictionPolicy::kNextUse}, {"lru", EvictionPolicy::kLru}}));
  STRATA_RETURN_IF_ERROR(s.Bool("overlap_optimizer", &c->overlap_optimizer));
  STRATA_RETURN_IF_ERROR(s.Enum("checksums", &c->checksums,
                                {{"crc32c", ChecksumKind::kCrc32c}, {"none", ChecksumKind::kNone}}));
  STRATA_RETURN_IF_ERROR(s.Int("prefetch_lookahead", &c->prefetch_lookahead, 0, 4096));
  STRATA_RETURN_IF_ERROR(s.Enum("optimizer_state_dtype", &c->optimizer_state_dtype,
                                {{"fp32", StateDtype::kFp32}, {"bf16", StateDtype::kBf16}}));
  STRATA_RETURN_IF_ERROR(s.Int("optimizer_threads", &c->optimizer_threads, 0, 4096));
  STRATA_RETURN_IF_ERROR(s.Bytes("host_pool_colour_step", &c->host_pool_colour_step, 0, 1 << 20));
  if (c->host_pool_colour_step % 4096 != 0)
    return InvalidArgument(StrCat(s.Key("host_pool_colour_step"), "=", c->host_pool_colour_step,
                                  ": must be a multiple of 4096 bytes (pages stay aligned for "
                                  "O_DIRECT); 0 turns colouring off"));
  std::string backend = c->comm_backend;
  STRATA_RETURN_IF_ERROR(s.String("comm_backend", &backend));
  if (backend != "auto" && backend != "single" && backend != "gloo" && backend != "nccl")
    return InvalidArgument(StrCat(s.Key("comm_backend"), "=\"", backend,
                                  "\": must be one of auto, single, gloo, nccl"));
  c->comm_backend = backend;
  STRATA_RETURN_IF_ERROR(s.Double("comm_timeout_s", &c->comm_timeout_s, 0.0, 86400.0, false, true));
  std::string device = c->device;
  STRATA_RETURN_IF_ERROR(s.String("device", &device));
  if (device != "auto" && device != "cpu" && device != "cuda")
    return InvalidArgument(
        StrCat(s.Key("device"), "=\"", device, "\": must be one of auto, cpu, cuda"));
  c->device = device;
  return s.Finish();
}

Status ParseModel(Section s, ModelConfig* c) {
  STRATA_RETURN_IF_ERROR(s.Int("n_layers", &c->n_layers, 1, 4096));
  STRATA_RETURN_IF_ERROR(s.Int("d_model", &c->d_model, 8, 1 << 20));
  STRATA_RETURN_IF_ERROR(s.Int("n_heads", &c->n_heads, 1, 4096));
  STRATA_RETURN_IF_ERROR(s.Int("seq_len", &c->seq_len, 2, 1 << 20));
  STRATA_RETURN_IF_ERROR(s.Int("vocab_size", &c->vocab_size, 2, 1 << 24));
  STRATA_RETURN_IF_ERROR(s.Double("dropout", &c->dropout, 0.0, 1.0, true));
  STRATA_RETURN_IF_ERROR(s.Bool("checkpoint_activations", &c->checkpoint_activations));
  int64_t seed = static_cast<int64_t>(c->seed);
  STRATA_RETURN_IF_ERROR(s.Int("seed", &seed, 0, std::numeric_limits<int64_t>::max()));
  c->seed = static_cast<uint64_t>(seed);
  if (c->d_model % c->n_heads != 0)
    return InvalidArgument(StrCat(s.Key("d_model"), "=", c->d_model, " is not divisible by ",
                                  s.Key("n_heads"), "=", c->n_heads,
                                  "; pick a head count that divides the hidden size"));
  return s.Finish();
}

// ParseRoot's parts: the sections DeepSpeed knows and Strata accepts without acting on them;
// bf16 (or its old name bfloat16); what the sections allow only together.
void AcceptDeepSpeedSections(Section& s) {
  // Note [DeepSpeed sections]: sections DeepSpeed knows and Strata does not act on are accepted
  // with one line each saying so, and what Strata offers instead.
  for (const char* k : {"zero_force_ds_cpu_optimizer",
                        "dump_state", "memory_breakdown", "gradient_predivide_factor",
                        "seq_parallel_communication_data_type", "sparse_gradients",
                        "amp", "elasticity", "autotuning", "quantize_training",
                        "compression_training", "sparse_attention", "data_types",
                        "eigenvalue", "progressive_layer_drop", "pld", "graph_harvesting",
                        "use_data_before_expert_parallelism", "use_node_local_storage", "fp8",
                        "torch_autocast", "timers", "hybrid_engine", "pipeline", "nebula",
                        "checkpoint", "dataloader_drop_last", "data_efficiency",
                        "curriculum_learning", "tensor_parallel", "compile", "weight_quantization",
                        "steps_per_print_ranks", "disable_allgather", "cuda_visible_devices",
                        "_comment", "comment", "train_batch_size_per_gpu_eval"})
    s.Ignored(k, "has no effect in Strata");
  for (const char* k : {"prescale_gradients", "communication_data_type"}) {
    if (const json* v = s.Get(k); v && !(v->is_boolean() && !v->get<bool>()) && !v->is_null())
      s.Warn(StrCat(k, "=", Describe(*v), " has no effect: gradients are reduced in fp32 and "
                                            "averaged after the reduction"));
  }
  for (const char* k : {"wandb", "tensorboard", "csv_monitor", "monitor_config", "comet"})
    s.Ignored(k, "is not a Strata monitor: strata-train prints per-step loss, lr, tokens/s and "
                 "per-lane times, --json writes them as JSON lines and --plot draws an SVG");
  s.Ignored("flops_profiler",
            "has no effect: strata-train reports tokens/s and per-lane busy time each step; "
            "strata-swapbench profile measures the machine's compute and copy rates");
  for (const char* k : {"comms_logger", "comms_config"})
    s.Ignored(k, "has no effect: strata-train's --json reports the comm lane's busy seconds "
                 "per step, and strata-launch commbench measures collective bandwidth");
}

Status ParseBf16(Section& s, Bf16Config* c) {
  STRATA_RETURN_IF_ERROR(s.Alias("bfloat16", "bf16"));
  const char* bf16_key = s.has("bf16") || !s.has("bfloat16") ? "bf16" : "bfloat16";
  STRATA_ASSIGN_OR_RETURN(Section bf16, s.Child(bf16_key));
  STRATA_RETURN_IF_ERROR(bf16.Bool("enabled", &c->enabled));
  bf16.Ignored("immediate_grad_update", "has no effect in Strata");
  // Megatron-DeepSpeed's bf16 configs copy fp16's loss-scaling keys; DeepSpeed reads only
  // "enabled" there.
  for (const char* k : {"loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale",
                        "initial_scale_power", "consecutive_hysteresis", "auto_cast"})
    bf16.Ignored(k, "has no effect: bf16 needs no loss scaling");
  STRATA_RETURN_IF_ERROR(bf16.Finish());
  return Status::Ok();
}

Status CheckCombinations(Section& s, Config* c) {
  if (c->fp16.enabled && c->bf16.enabled)
    return InvalidArgument("fp16.enabled and bf16.enabled are both true; enable at most one");
  auto& z = c->zero_optimization;
  // DeepSpeed only offloads parameters at stage 3 and the optimizer at stages 1-3; elsewhere it
  // ignores the section, and so does Strata, saying so.
  if (z.offload_param.device != OffloadDevice::kNone && z.stage != 3) {
    s.Warn(StrCat("zero_optimization.offload_param.device=", EnumName(z.offload_param.device, kOffloadDevices),
                  " is ignored at stage ", z.stage,
                  ": parameters are offloaded only under stage 3 (as in DeepSpeed); set "
                  "zero_optimization.stage to 3 to offload them"));
    z.offload_param.device = OffloadDevice::kNone;
  }
  if (z.offload_optimizer.device != OffloadDevice::kNone && z.stage == 0) {
    s.Warn(StrCat("zero_optimization.offload_optimizer.device=",
                  EnumName(z.offload_optimizer.device, kOffloadDevices),
                  " is ignored at stage 0 (as in DeepSpeed); set zero_optimization.stage to 1, 2 "
                  "or 3 to offload the optimizer"));
    z.offload_optimizer.device = OffloadDevice::kNone;
  }
  if (c->train_batch_size != 0 &&
      c->train_batch_size % (c->train_micro_batch_size_per_gpu * c->gradient_accumulation_steps) != 0)
    return InvalidArgument(StrCat(
        "train_batch_size=", c->train_batch_size, " is not a multiple of train_micro_batch_size_per_gpu=",
        c->train_micro_batch_size_per_gpu, " x gradient_accumulation_steps=",
        c->gradient_accumulation_steps, " (it must equal their product times the world size)"));
  return Status::Ok();
}

Status ParseRoot(const json& given_root, Config* c) {
  if (!given_root.is_object())
    return InvalidArgument(StrCat("the config must be a JSON object, got ", Describe(given_root)));
  // DeepSpeed still reads its oldest form, "zero_optimization": true/false, as stage 1/0.
  json rewritten;
  const bool bool_zero = given_root.contains("zero_optimization") &&
                         given_root.at("zero_optimization").is_boolean();
  if (bool_zero) {
    rewritten = given_root;
    rewritten["zero_optimization"] = {{"stage", given_root.at("zero_optimization").get<bool>() ? 1 : 0}};
  }
  const json& root = bool_zero ? rewritten : given_root;
  Section s(&root, "", &c->warnings, &c->auto_keys);
  if (bool_zero)
    s.Warn(StrCat("zero_optimization=", given_root.at("zero_optimization").dump(),
                  " is DeepSpeed's deprecated form; read as {\"stage\": ",
                  root.at("zero_optimization").at("stage").get<int>(), "}"));
  STRATA_RETURN_IF_ERROR(s.Int("train_batch_size", &c->train_batch_size, 0, kMaxElems));
  auto given = [&](const char* k) {
    const json* v = root.contains(k) ? &root.at(k) : nullptr;
    return v && v->is_number();
  };
  c->train_batch_size_given = given("train_batch_size");
  c->micro_batch_given = given("train_micro_batch_size_per_gpu");
  c->accumulation_given = given("gradient_accumulation_steps");
  STRATA_RETURN_IF_ERROR(
      s.Int("train_micro_batch_size_per_gpu", &c->train_micro_batch_size_per_gpu, 1, 1 << 24));
  STRATA_RETURN_IF_ERROR(
      s.Int("gradient_accumulation_steps", &c->gradient_accumulation_steps, 1, 1 << 24));
  STRATA_RETURN_IF_ERROR(s.Double("gradient_clipping", &c->gradient_clipping, 0.0, 1e12));
  STRATA_RETURN_IF_ERROR(
      s.Int("steps_per_print", &c->steps_per_print, 1, std::numeric_limits<int64_t>::max()));
  STRATA_RETURN_IF_ERROR(s.Bool("wall_clock_breakdown", &c->wall_clock_breakdown));
  STRATA_RETURN_IF_ERROR(
      s.Bool("zero_allow_untested_optimizer", &c->zero_allow_untested_optimizer));
  if (c->wall_clock_breakdown)
    s.Warn("wall_clock_breakdown=true has no effect: Strata always reports per-lane busy time "
           "(compute, NVMe, optimizer, comm) in strata-train's step lines and --json");
  AcceptDeepSpeedSections(s);
  STRATA_ASSIGN_OR_RETURN(Section ac, s.Child("activation_checkpointing"));
  STRATA_RETURN_IF_ERROR(ParseActivationCheckpointing(ac, &c->activation_checkpointing));

  STRATA_ASSIGN_OR_RETURN(Section opt, s.Child("optimizer"));
  STRATA_RETURN_IF_ERROR(ParseOptimizer(opt, &c->optimizer));
  STRATA_ASSIGN_OR_RETURN(Section sch, s.Child("scheduler"));
  STRATA_RETURN_IF_ERROR(ParseScheduler(sch, &c->scheduler));
  STRATA_ASSIGN_OR_RETURN(Section fp16, s.Child("fp16"));
  STRATA_RETURN_IF_ERROR(ParseFp16(fp16, &c->fp16));

  STRATA_RETURN_IF_ERROR(ParseBf16(s, &c->bf16));
  STRATA_ASSIGN_OR_RETURN(Section zero, s.Child("zero_optimization"));
  STRATA_RETURN_IF_ERROR(ParseZero(zero, &c->zero_optimization));
  STRATA_ASSIGN_OR_RETURN(Section aio, s.Child("aio"));
  STRATA_RETURN_IF_ERROR(ParseAio(aio, &c->aio));
  STRATA_ASSIGN_OR_RETURN(Section st, s.Child("strata"));
  STRATA_RETURN_IF_ERROR(ParseStrata(st, &c->strata));
  STRATA_ASSIGN_OR_RETURN(Section model, s.Child("model"));
  STRATA_RETURN_IF_ERROR(ParseModel(model, &c->model));
  STRATA_RETURN_IF_ERROR(s.Finish(/*warn_only=*/true));

  return CheckCombinations(s, c);
}


}  // namespace

StatusOr<Config> Config::FromJsonText(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text, nullptr, /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e400
    return InvalidArgument(StrCat(source, ": not valid JSON: ", e.what()));
  }
  Config c;
  Status s = ParseRoot(root, &c);
  if (!s.ok()) return s.WithContext(source);
  for (const auto& w : c.warnings) STRATA_LOG(WARN) << source << ": " << w;
  return c;
}

StatusOr<Config> Config::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return ErrnoToStatus(errno, StrCat("cannot open config ", path));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return ErrnoToStatus(errno, StrCat("cannot read config ", path));
  return FromJsonText(ss.str(), path);
}

namespace {

// ToJson's "optimizer" section: the type and the parameters that type reads.
json OptimizerJson(const OptimizerConfig& o) {
  json j;
  switch (o.type) {
    case OptimizerType::kSGD:
      j["params"] = {{"lr", o.lr},
                    {"momentum", o.momentum},
                    {"dampening", o.dampening},
                    {"weight_decay", o.weight_decay},
                    {"nesterov", o.nesterov}};
      break;
    case OptimizerType::kAdagrad:
      j["params"] = {{"lr", o.lr},
                    {"lr_decay", o.lr_decay},
                    {"eps", o.eps},
                    {"weight_decay", o.weight_decay}};
      break;
    case OptimizerType::kLion:
      j["params"] = {{"lr", o.lr},
                    {"betas", {o.beta1, o.beta2}},
                    {"weight_decay", o.weight_decay}};
      break;
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      j["params"] = {{"lr", o.lr},
                    {"betas", {o.beta1, o.beta2}},
                    {"eps", o.eps},
                    {"weight_decay", o.weight_decay},
                    {"bias_correction", o.bias_correction}};
      // Note [Adam means AdamW]: "Adam" alone reads back as AdamW, so plain Adam says so.
      if (o.type == OptimizerType::kAdam) j["params"]["adam_w_mode"] = false;
      break;
  }
  j["type"] = OptimizerTypeName(o.type);
  return j;
}

// ToJson's "scheduler" section: the type and the parameters that type reads.
json SchedulerJson(const SchedulerConfig& sc) {
  const char* names[] = {"none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                         "LRRangeTest"};
  json params;
  if (sc.type == SchedulerType::kOneCycle) {
    params = {{"cycle_min_lr", sc.cycle_min_lr},
              {"cycle_max_lr", sc.cycle_max_lr},
              {"decay_lr_rate", sc.decay_lr_rate},
              {"cycle_first_step_size", sc.cycle_first_step_size},
              {"cycle_second_step_size", sc.cycle_second_step_size},
              {"cycle_first_stair_count", sc.cycle_first_stair_count},
              {"cycle_second_stair_count", sc.cycle_second_stair_count},
              {"decay_step_size", sc.decay_step_size},
              {"cycle_momentum", sc.cycle_momentum},
              {"cycle_min_mom", sc.cycle_min_mom},
              {"cycle_max_mom", sc.cycle_max_mom},
              {"decay_mom_rate", sc.decay_mom_rate}};
  } else if (sc.type == SchedulerType::kLRRangeTest) {
    params = {{"lr_range_test_min_lr", sc.lr_range_test_min_lr},
              {"lr_range_test_step_size", sc.lr_range_test_step_size},
              {"lr_range_test_step_rate", sc.lr_range_test_step_rate},
              {"lr_range_test_staircase", sc.lr_range_test_staircase}};
  } else if (sc.type == SchedulerType::kWarmupCosineLR) {
    params = {{"warmup_type", sc.warmup_type == WarmupType::kLog ? "log" : "linear"},
              {"warmup_min_ratio", sc.warmup_min_ratio},
              {"cos_min_ratio", sc.cos_min_ratio},
              {"warmup_num_steps", sc.warmup_num_steps},
              {"total_num_steps", sc.total_num_steps}};
  } else {
    params = {{"warmup_type", sc.warmup_type == WarmupType::kLog ? "log" : "linear"},
              {"warmup_min_lr", sc.warmup_min_lr},
              {"warmup_max_lr", sc.warmup_max_lr},
              {"warmup_num_steps", sc.warmup_num_steps},
              {"total_num_steps", sc.total_num_steps}};
  }
  return {{"type", names[static_cast<int>(sc.type)]}, {"params", params}};
}

}  // namespace

json Config::ToJson() const {
  auto dev = [](OffloadDevice d) { return EnumName(d, kOffloadDevices); };
  const auto& z = zero_optimization;
  json j;
  j["train_batch_size"] = train_batch_size;
  j["train_micro_batch_size_per_gpu"] = train_micro_batch_size_per_gpu;
  j["gradient_accumulation_steps"] = gradient_accumulation_steps;
  j["gradient_clipping"] = gradient_clipping;
  j["steps_per_print"] = steps_per_print;
  j["wall_clock_breakdown"] = wall_clock_breakdown;
  j["zero_allow_untested_optimizer"] = zero_allow_untested_optimizer;
  j["optimizer"] = OptimizerJson(optimizer);
  if (scheduler.type != SchedulerType::kNone) j["scheduler"] = SchedulerJson(scheduler);
  j["fp16"] = {{"enabled", fp16.enabled},
               {"loss_scale", fp16.loss_scale},
               {"initial_scale_power", fp16.initial_scale_power},
               {"loss_scale_window", fp16.loss_scale_window},
               {"hysteresis", fp16.hysteresis},
               {"min_loss_scale", fp16.min_loss_scale}};
  j["bf16"] = {{"enabled", bf16.enabled}};
  const auto& ac = activation_checkpointing;
  j["activation_checkpointing"] = {{"partition_activations", ac.partition_activations},
                                   {"cpu_checkpointing", ac.cpu_checkpointing},
                                   {"contiguous_memory_optimization", ac.contiguous_memory_optimization},
                                   {"number_checkpoints", ac.number_checkpoints},
                                   {"synchronize_checkpoint_boundary", ac.synchronize_checkpoint_boundary},
                                   {"profile", ac.profile}};
  j["zero_optimization"] = {
      {"stage", z.stage},
      {"contiguous_gradients", z.contiguous_gradients},
      {"overlap_comm", z.overlap_comm},
      {"reduce_bucket_size", z.reduce_bucket_size},
      {"allgather_bucket_size", z.allgather_bucket_size},
      {"sub_group_size", z.sub_group_size},
      {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size},
      {"stage3_param_persistence_threshold", z.stage3_param_persistence_threshold},
      {"stage3_max_live_parameters", z.stage3_max_live_parameters},
      {"stage3_max_reuse_distance", z.stage3_max_reuse_distance},
      {"offload_param",
       {{"device", dev(z.offload_param.device)},
        {"nvme_path", z.offload_param.nvme_path},
        {"buffer_count", z.offload_param.buffer_count},
        {"buffer_size", z.offload_param.buffer_size},
        {"max_in_cpu", z.offload_param.max_in_cpu},
        {"pin_memory", z.offload_param.pin_memory}}},
      {"offload_optimizer",
       {{"device", dev(z.offload_optimizer.device)},
        {"nvme_path", z.offload_optimizer.nvme_path},
        {"buffer_count", z.offload_optimizer.buffer_count},
        {"pin_memory", z.offload_optimizer.pin_memory},
        {"pipeline_read", z.offload_optimizer.pipeline_read},
        {"pipeline_write", z.offload_optimizer.pipeline_write},
        {"ratio", z.offload_optimizer.ratio}}}};
  j["aio"] = {{"block_size", aio.block_size},
              {"queue_depth", aio.queue_depth},
              {"intra_op_parallelism", aio.intra_op_parallelism},
              {"single_submit", aio.single_submit},
              {"overlap_events", aio.overlap_events},
              {"use_gds", aio.use_gds}};
  j["strata"] = {
      {"device_memory_budget", strata.device_memory_budget},
      {"host_memory_budget", strata.host_memory_budget},
      {"nvme_capacity", strata.nvme_capacity},
      {"chunk_size", strata.chunk_size},
      {"eviction", strata.eviction == EvictionPolicy::kNextUse ? "next_use" : "lru"},
      {"overlap_optimizer", strata.overlap_optimizer},
      {"checksums", strata.checksums == ChecksumKind::kCrc32c ? "crc32c" : "none"},
      {"prefetch_lookahead", strata.prefetch_lookahead},
      {"optimizer_state_dtype", strata.optimizer_state_dtype == StateDtype::kFp32 ? "fp32" : "bf16"},
      {"optimizer_threads", strata.optimizer_threads},
      {"host_pool_colour_step", strata.host_pool_colour_step},
      {"comm_backend", strata.comm_backend},
      {"comm_timeout_s", strata.comm_timeout_s},
      {"device", strata.device}};
  j["model"] = {{"n_layers", model.n_layers}, {"d_model", model.d_model},
                {"n_heads", model.n_heads},   {"seq_len", model.seq_len},
                {"vocab_size", model.vocab_size}, {"dropout", model.dropout},
                {"checkpoint_activations", model.checkpoint_activations}, {"seed", model.seed}};
  return j;
}

Status Config::CheckBatchSizes(int world_size) const {
  const int64_t product = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size;
  if (train_batch_size != 0 && train_batch_size != product)
    return InvalidArgument(StrCat(
        "train_batch_size=", train_batch_size, " does not equal train_micro_batch_size_per_gpu=",
        train_micro_batch_size_per_gpu, " x gradient_accumulation_steps=", gradient_accumulation_steps,
        " x world size ", world_size, " = ", product,
        "; fix one of them, or write \"auto\" for the one that should follow"));
  return Status::Ok();
}

namespace {

// Batch sizes, DeepSpeed's rules (its _set_batch_related_parameters): of train_batch_size,
// the micro batch and the accumulation steps, the ones the file (or the command line) gives
// fix the rest through train = micro x accumulation x world.
Status ResolveBatchSizes(const AutoContext& ctx, Config* c) {
  const int64_t world = ctx.world_size;
  bool micro_known = c->micro_batch_given, accum_known = c->accumulation_given;
  if (!micro_known && ctx.micro_batch > 0) c->train_micro_batch_size_per_gpu = ctx.micro_batch, micro_known = true;
  if (!accum_known && ctx.accumulation > 0) c->gradient_accumulation_steps = ctx.accumulation, accum_known = true;
  if (c->train_batch_size_given && !(micro_known && accum_known)) {
    const int64_t known = (micro_known ? c->train_micro_batch_size_per_gpu : c->gradient_accumulation_steps) * world;
    if (!micro_known && !accum_known) {
      c->gradient_accumulation_steps = 1;
      if (c->train_batch_size % world != 0)
        return InvalidArgument(StrCat("train_batch_size=", c->train_batch_size,
                                      " is not divisible by the world size ", world));
      c->train_micro_batch_size_per_gpu = c->train_batch_size / world;
    } else if (c->train_batch_size % known != 0) {
      return InvalidArgument(StrCat("train_batch_size=", c->train_batch_size, " is not divisible by ",
                                    micro_known ? "train_micro_batch_size_per_gpu=" : "gradient_accumulation_steps=",
                                    known / world, " x world size ", world));
    } else if (micro_known) {
      c->gradient_accumulation_steps = c->train_batch_size / known;
    } else {
      c->train_micro_batch_size_per_gpu = c->train_batch_size / known;
    }
  } else if (!c->train_batch_size_given) {
    c->train_batch_size = c->train_micro_batch_size_per_gpu * c->gradient_accumulation_steps * world;
  }
  return Status::Ok();
}

}  // namespace

Status Config::ResolveAuto(const AutoContext& ctx) {
  auto_resolved.clear();
  const std::set<std::string> autos(auto_keys.begin(), auto_keys.end());
  auto is = [&](const char* k) { return autos.count(k) > 0; };
  auto note = [&](const std::string& key, const std::string& value, const std::string& from) {
    auto_resolved.push_back(StrCat(key, " = ", value, " (auto: ", from, ")"));
  };
  auto num = [](double v) {
    std::ostringstream o;
    o << v;
    return o.str();
  };
  STRATA_RETURN_IF_ERROR(ResolveBatchSizes(ctx, this));
  if (is("train_micro_batch_size_per_gpu"))
    note("train_micro_batch_size_per_gpu", std::to_string(train_micro_batch_size_per_gpu),
         ctx.micro_batch > 0 ? "the command line" : train_batch_size_given ? "train_batch_size" : "Strata's default");
  if (is("gradient_accumulation_steps"))
    note("gradient_accumulation_steps", std::to_string(gradient_accumulation_steps),
         ctx.accumulation > 0 ? "the command line" : train_batch_size_given ? "train_batch_size" : "Strata's default");
  if (is("train_batch_size"))
    note("train_batch_size", std::to_string(train_batch_size),
         StrCat("micro batch x accumulation x world size ", ctx.world_size));
  if (is("gradient_clipping")) {
    gradient_clipping = ctx.clipping >= 0 ? ctx.clipping : 1.0;
    note("gradient_clipping", num(gradient_clipping),
         ctx.clipping >= 0 ? "the command line" : "Hugging Face's default max_grad_norm");
  }
  if (is("optimizer.params.lr")) {
    optimizer.lr = ctx.lr > 0 ? ctx.lr : 1e-3;
    note("optimizer.params.lr", num(optimizer.lr), ctx.lr > 0 ? "the command line" : "Strata's default");
  }
  if (is("optimizer.params.weight_decay")) {
    optimizer.weight_decay = ctx.weight_decay >= 0 ? ctx.weight_decay : 0.0;
    note("optimizer.params.weight_decay", num(optimizer.weight_decay),
         ctx.weight_decay >= 0 ? "the command line" : "Strata's default");
  }
  if (is("optimizer.params.betas"))
    note("optimizer.params.betas", StrCat("[", num(optimizer.beta1), ", ", num(optimizer.beta2), "]"),
         "Strata's default");
  if (is("optimizer.params.eps")) note("optimizer.params.eps", num(optimizer.eps), "Strata's default");
  if (is("scheduler.params.warmup_min_lr"))
    note("scheduler.params.warmup_min_lr", num(scheduler.warmup_min_lr), "Strata's default");
  if (is("scheduler.params.warmup_max_lr")) {
    scheduler.warmup_max_lr = optimizer.lr;
    note("scheduler.params.warmup_max_lr", num(scheduler.warmup_max_lr), "optimizer.params.lr");
  }
  if (is("scheduler.params.warmup_num_steps")) {
    scheduler.warmup_num_steps = ctx.warmup_steps >= 0 ? ctx.warmup_steps : 0;
    note("scheduler.params.warmup_num_steps", std::to_string(scheduler.warmup_num_steps),
         ctx.warmup_steps >= 0 ? "the command line" : "no warmup");
  }
  if (is("scheduler.params.total_num_steps")) {
    if (ctx.total_steps > 0) scheduler.total_num_steps = ctx.total_steps;
    scheduler.total_num_steps = std::max(scheduler.total_num_steps, scheduler.warmup_num_steps);
    note("scheduler.params.total_num_steps", std::to_string(scheduler.total_num_steps),
         ctx.total_steps > 0 ? "the run's steps" : "Strata's default");
  }
  if (is("fp16.enabled")) {
    fp16.enabled = ctx.fp16;
    note("fp16.enabled", fp16.enabled ? "true" : "false", "the command line (off unless asked)");
  }
  if (is("bf16.enabled") || is("bfloat16.enabled")) {
    bf16.enabled = ctx.native_bf16 && !fp16.enabled;
    note("bf16.enabled", bf16.enabled ? "true" : "false",
         ctx.native_bf16 ? "the device computes bf16 natively" : "the device has no native bf16");
  }
  // Hugging Face's formulas from the model's hidden size h.
  const int64_t h = ctx.hidden_size;
  auto& z = zero_optimization;
  auto bucket = [&](const char* key, const char* alt, int64_t* field, int64_t value, const char* formula) {
    if (!is(key) && !(alt && is(alt))) return;
    if (h > 0) *field = value;
    note(key, std::to_string(*field), h > 0 ? formula : "Strata's default (hidden size unknown)");
  };
  bucket("zero_optimization.reduce_bucket_size", nullptr, &z.reduce_bucket_size, h * h, "hidden^2");
  bucket("zero_optimization.allgather_bucket_size", nullptr, &z.allgather_bucket_size, h * h, "hidden^2");
  bucket("zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.prefetch_bucket_size",
         &z.stage3_prefetch_bucket_size, static_cast<int64_t>(0.9 * static_cast<double>(h * h)),
         "0.9 x hidden^2");
  bucket("zero_optimization.stage3_param_persistence_threshold",
         "zero_optimization.param_persistence_threshold", &z.stage3_param_persistence_threshold,
         10 * h, "10 x hidden");
  // Anything else given as "auto" keeps Strata's default, and says so.
  static const std::set<std::string> handled = {
      "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
      "gradient_clipping", "optimizer.params.lr", "optimizer.params.weight_decay",
      "optimizer.params.betas", "optimizer.params.eps", "scheduler.params.warmup_min_lr",
      "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
      "scheduler.params.total_num_steps", "fp16.enabled", "bf16.enabled", "bfloat16.enabled",
      "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
      "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.prefetch_bucket_size",
      "zero_optimization.stage3_param_persistence_threshold",
      "zero_optimization.param_persistence_threshold"};
  for (const std::string& k : auto_keys)
    if (!handled.count(k)) auto_resolved.push_back(StrCat(k, " = Strata's default (auto)"));
  if (fp16.enabled && bf16.enabled)
    return InvalidArgument("fp16.enabled and bf16.enabled are both true after resolving \"auto\"; "
                           "enable at most one");
  return CheckBatchSizes(ctx.world_size);
}

std::string Config::ToJsonString(int indent) const { return ToJson().dump(indent); }

bool operator==(const Config& a, const Config& b) { return a.ToJson() == b.ToJson(); }

}  // namespace strata
