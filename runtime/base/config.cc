#include "runtime/base/config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/config_keys.h"
#include "runtime/base/config_section.h"
#include "runtime/base/logging.h"
#include "runtime/base/relaxed_json.h"
#include "runtime/base/units.h"

namespace strata {
namespace {

using namespace config_internal;  // NOLINT: the parser's own building blocks


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

// The tables of keys (Note [one table of keys] in config_keys.h), one per section, in the
// order keys are read: that order decides which of two bad keys an error names.
const KeyTable<OffloadParamConfig>& OffloadParamKeys() {
  using C = OffloadParamConfig;
  static const KeyTable<C> keys = {
      EnumKey("device", &C::device, kOffloadDevices),
      StringListKey("nvme_path", &C::nvme_path),
      IntKey("buffer_count", &C::buffer_count, 1, 1024),
      IntKey("buffer_size", &C::buffer_size, 1, kMaxElems),
      OptionalIntKey("max_in_cpu", &C::max_in_cpu, 0, kMaxElems),
      BoolKey("pin_memory", &C::pin_memory),
  };
  return keys;
}

const KeyTable<OffloadOptimizerConfig>& OffloadOptimizerKeys() {
  using C = OffloadOptimizerConfig;
  static const KeyTable<C> keys = {
      EnumKey("device", &C::device, kOffloadDevices),
      StringListKey("nvme_path", &C::nvme_path),
      IntKey("buffer_count", &C::buffer_count, 1, 1024),
      BoolKey("pin_memory", &C::pin_memory),
      BoolKey("pipeline_read", &C::pipeline_read),
      BoolKey("pipeline_write", &C::pipeline_write),
      DoubleKey("ratio", &C::ratio, 0.0, 1.0),
  };
  return keys;
}

// zero_optimization's own keys; its two offload sections have their tables above.
const KeyTable<ZeroConfig>& ZeroKeys() {
  using C = ZeroConfig;
  static const KeyTable<C> keys = {
      IntKey("stage", &C::stage, 0, 3),
      BoolKey("contiguous_gradients", &C::contiguous_gradients),
      BoolKey("overlap_comm", &C::overlap_comm),
      // 0 is accepted as DeepSpeed does (Hugging Face's tests use it): no bucketing / no grouping.
      IntKey("reduce_bucket_size", &C::reduce_bucket_size, 0, kMaxElems),
      IntKey("allgather_bucket_size", &C::allgather_bucket_size, 0, kMaxElems),
      IntKey("sub_group_size", &C::sub_group_size, 0, kMaxElems),
      IntKey("stage3_prefetch_bucket_size", &C::stage3_prefetch_bucket_size, 0, kMaxElems),
      IntKey("stage3_param_persistence_threshold", &C::stage3_param_persistence_threshold, 0,
             kMaxElems),
      IntKey("stage3_max_live_parameters", &C::stage3_max_live_parameters, 0, kMaxElems),
      IntKey("stage3_max_reuse_distance", &C::stage3_max_reuse_distance, 0, kMaxElems),
  };
  return keys;
}

Status ParseOffloadParam(Section s, OffloadParamConfig* c) {
  STRATA_RETURN_IF_ERROR(ReadKeys(s, OffloadParamKeys(), c));
  // Note [no silent key]: a key Strata parses but does not act on says so once.
  s.Ignored("buffer_count",
            "has no effect: parameters are staged through the host pool, sized by "
            "strata.host_memory_budget, not through a fixed number of buffers");
  s.Ignored("buffer_size", "has no effect: staging buffers are the host pool's chunk-sized blocks");
  return s.Finish();
}

Status ParseOffloadOptimizer(Section s, OffloadOptimizerConfig* c) {
  STRATA_RETURN_IF_ERROR(ReadKeys(s, OffloadOptimizerKeys(), c));
  bool pipeline = false;
  if (s.has("pipeline")) {
    STRATA_RETURN_IF_ERROR(s.Bool("pipeline", &pipeline));
    s.Warn(StrCat(s.Key("pipeline"), " is deprecated; use pipeline_read and pipeline_write"));
    c->pipeline_read = c->pipeline_write = pipeline;
  } else {
    s.Get("pipeline");
  }
  s.Ignored("fast_init", "has no effect in Strata");
  s.Ignored("buffer_count",
            "has no effect: optimizer states are staged through the host pool, sized by "
            "strata.host_memory_budget");
  if (s.has("pipeline_read") || s.has("pipeline_write") || s.has("pipeline"))
    s.Warn(StrCat(s.Key("pipeline_read"), "/pipeline_write have no effect: Strata always prefetches "
                  "optimizer states ahead of use from the recorded trace and writes them behind "
                  "(strata.prefetch_lookahead sets how far)"));
  return s.Finish();
}

Status ParseZero(Section s, ZeroConfig* c) {
  STRATA_RETURN_IF_ERROR(ReadKeys(s, ZeroKeys(), c));
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
  s.Ignored("zenflow", "has no effect: ZenFlow's selective updates are not implemented; every "
                       "gradient updates its parameter at every step (the run trains as without "
                       "the section)");
  return s.Finish();
}

const KeyTable<AioConfig>& AioKeys() {
  using C = AioConfig;
  static const KeyTable<C> keys = {
      Checked(IntKey("block_size", &C::block_size, 4096, int64_t{1} << 30),
              [](const Section& s, const C& c) {
                return c.block_size % 4096 == 0
                           ? Status::Ok()
                           : InvalidArgument(StrCat(s.Key("block_size"), "=", c.block_size,
                                                    ": must be a multiple of 4096 (O_DIRECT alignment)"));
              }),
      IntKey("queue_depth", &C::queue_depth, 1, 4096),
      IntKey("intra_op_parallelism", &C::intra_op_parallelism, 1, 256),
      BoolKey("single_submit", &C::single_submit),
      BoolKey("overlap_events", &C::overlap_events),
      BoolKey("use_gds", &C::use_gds),
  };
  return keys;
}

Status ParseAio(Section s, AioConfig* c) {
  STRATA_RETURN_IF_ERROR(s.Alias("thread_count", "intra_op_parallelism"));
  STRATA_RETURN_IF_ERROR(s.Alias("num_threads", "intra_op_parallelism"));
  STRATA_RETURN_IF_ERROR(ReadKeys(s, AioKeys(), c));
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

// optimizer.params.betas as a key of the tables below.
ConfigKey<OptimizerConfig> BetasKey() {
  return {"betas", ParseBetas, [](const OptimizerConfig& c, json* j) {
            (*j)["betas"] = {c.beta1, c.beta2};
          }};
}

// optimizer.params: each optimizer type reads its own keys (and refuses the others by name).
const KeyTable<OptimizerConfig>& OptimizerParamKeys(OptimizerType type) {
  using C = OptimizerConfig;
  // torch.optim.SGD's parameters.
  static const KeyTable<C> sgd = {
      DoubleKey("lr", &C::lr, 0.0, 10.0),
      DoubleKey("momentum", &C::momentum, 0.0, 1e3),
      DoubleKey("dampening", &C::dampening, 0.0, 1e3),
      DoubleKey("weight_decay", &C::weight_decay, 0.0, 1e3),
      BoolKey("nesterov", &C::nesterov),
      IgnoredKey<C>("foreach", "Strata's SGD is always one fused pass per chunk"),
      IgnoredKey<C>("differentiable", "does not apply"),
  };
  // torch.optim.Adagrad's (DeepSpeed's CPU Adagrad takes lr, eps, weight_decay).
  static const KeyTable<C> adagrad = {
      DoubleKey("lr", &C::lr, 0.0, 10.0),
      DoubleKey("lr_decay", &C::lr_decay, 0.0, 1e3),
      DoubleKey("eps", &C::eps, 0.0, 1.0, false, true),
      DoubleKey("weight_decay", &C::weight_decay, 0.0, 1e3),
      IgnoredKey<C>("foreach", "Strata's Adagrad is always one fused pass per chunk"),
      IgnoredKey<C>("fused", "Strata's Adagrad is always fused"),
      IgnoredKey<C>("differentiable", "does not apply"),
      IgnoredKey<C>("amsgrad", "does not apply to Adagrad"),
  };
  // DeepSpeed's Lion: lr, betas, weight_decay (decoupled), with its defaults 1e-3 and
  // (0.9, 0.999) (the paper suggests beta2 = 0.99 and a 3-10x smaller lr than AdamW's).
  static const KeyTable<C> lion = {
      DoubleKey("lr", &C::lr, 0.0, 10.0),
      BetasKey(),
      DoubleKey("weight_decay", &C::weight_decay, 0.0, 1e3),
      IgnoredKey<C>("fused", "Strata's Lion is always fused"),
  };
  static const KeyTable<C> adam = {
      DoubleKey("lr", &C::lr, 0.0, 10.0),
      BetasKey(),
      DoubleKey("eps", &C::eps, 0.0, 1.0, false, true),
      DoubleKey("weight_decay", &C::weight_decay, 0.0, 1e3),
      BoolKey("bias_correction", &C::bias_correction),
      IgnoredKey<C>("torch_adam", "Strata always uses its own CPU Adam"),
      IgnoredKey<C>("max_grad_norm",
                    "set gradient_clipping at the top level instead (DeepSpeed does the same)"),
      IgnoredKey<C>("fused", "Strata's CPU Adam is always fused"),
  };
  switch (type) {
    case OptimizerType::kSGD: return sgd;
    case OptimizerType::kAdagrad: return adagrad;
    case OptimizerType::kLion: return lion;
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW: break;
  }
  return adam;
}

Status ParseSgdParams(Section& p, OptimizerConfig* c) {
  c->lr = 1e-2;  // torch.optim.SGD's default
  STRATA_RETURN_IF_ERROR(ReadKeys(p, OptimizerParamKeys(OptimizerType::kSGD), c));
  if (c->nesterov && (c->momentum <= 0 || c->dampening != 0))
    return InvalidArgument(StrCat(p.Key("nesterov"), "=true needs momentum > 0 and dampening = 0 "
                                  "(as torch.optim.SGD)"));
  if (const json* m = p.Get("maximize"); m && m->is_boolean() && m->get<bool>())
    return InvalidArgument(StrCat(p.Key("maximize"), "=true is not supported; remove it"));
  return Status::Ok();
}

Status ParseAdagradParams(Section& p, OptimizerConfig* c) {
  c->lr = 1e-2;  // torch's Adagrad defaults
  c->eps = 1e-10;
  STRATA_RETURN_IF_ERROR(ReadKeys(p, OptimizerParamKeys(OptimizerType::kAdagrad), c));
  if (const json* a = p.Get("initial_accumulator_value");
      a && !(a->is_number() && a->get<double>() == 0.0))
    return InvalidArgument(StrCat(p.Key("initial_accumulator_value"), "=", Describe(*a),
                                  ": Strata's Adagrad starts the sum at 0 (torch's default); "
                                  "remove it or set 0"));
  if (const json* m = p.Get("maximize"); m && m->is_boolean() && m->get<bool>())
    return InvalidArgument(StrCat(p.Key("maximize"), "=true is not supported; remove it"));
  return Status::Ok();
}

Status ParseLionParams(Section& p, OptimizerConfig* c) {
  return ReadKeys(p, OptimizerParamKeys(OptimizerType::kLion), c);
}

Status ParseAdamParams(Section& p, OptimizerConfig* c, bool named_adamw) {
  STRATA_RETURN_IF_ERROR(ReadKeys(p, OptimizerParamKeys(OptimizerType::kAdamW), c));
  // DeepSpeed's Adam takes adam_w_mode to pick decoupled decay; AdamW is always decoupled. Not a
  // table key: what it reads depends on the type's name, and ToJson writes it from the type.
  if (p.has("adam_w_mode")) {
    bool w = true;
    STRATA_RETURN_IF_ERROR(p.Bool("adam_w_mode", &w));
    if (!w && !named_adamw) c->type = OptimizerType::kAdam;
  } else {
    p.Get("adam_w_mode");
  }
  p.Ignored("amsgrad", "is not supported (amsgrad=true is rejected)");
  if (const json* a = p.Get("amsgrad"); a && !a->is_boolean())
    return InvalidArgument(StrCat(p.Key("amsgrad"), "=", Describe(*a), ": must be true or false"));
  if (const json* a = p.Get("amsgrad"); a && a->get<bool>())
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

const std::vector<std::pair<std::string, SchedulerType>> kSchedulerTypes = {
    {"WarmupLR", SchedulerType::kWarmupLR},
    {"WarmupDecayLR", SchedulerType::kWarmupDecayLR},
    {"WarmupCosineLR", SchedulerType::kWarmupCosineLR},
    {"OneCycle", SchedulerType::kOneCycle},
    {"LRRangeTest", SchedulerType::kLRRangeTest}};

// scheduler.params: each schedule reads its own keys.
const KeyTable<SchedulerConfig>& SchedulerParamKeys(SchedulerType type) {
  using C = SchedulerConfig;
  static const std::vector<std::pair<std::string, WarmupType>> warmup_types = {
      {"log", WarmupType::kLog}, {"linear", WarmupType::kLinear}};
  static const KeyTable<C> one_cycle = {
      DoubleKey("cycle_min_lr", &C::cycle_min_lr, 0.0, 10.0),
      DoubleKey("cycle_max_lr", &C::cycle_max_lr, 0.0, 10.0),
      DoubleKey("decay_lr_rate", &C::decay_lr_rate, 0.0, 1e6),
      IntKey("cycle_first_step_size", &C::cycle_first_step_size, 1, kMaxElems),
      IntKey("cycle_second_step_size", &C::cycle_second_step_size, -1, kMaxElems),
      IntKey("cycle_first_stair_count", &C::cycle_first_stair_count, 0, kMaxElems),
      IntKey("cycle_second_stair_count", &C::cycle_second_stair_count, -1, kMaxElems),
      IntKey("decay_step_size", &C::decay_step_size, 0, kMaxElems),
      BoolKey("cycle_momentum", &C::cycle_momentum),
      DoubleKey("cycle_min_mom", &C::cycle_min_mom, 0.0, 1.0, true, false),
      DoubleKey("cycle_max_mom", &C::cycle_max_mom, 0.0, 1.0, true, false),
      DoubleKey("decay_mom_rate", &C::decay_mom_rate, 0.0, 1e6),
  };
  static const KeyTable<C> range_test = {
      DoubleKey("lr_range_test_min_lr", &C::lr_range_test_min_lr, 0.0, 10.0),
      IntKey("lr_range_test_step_size", &C::lr_range_test_step_size, 1, kMaxElems),
      DoubleKey("lr_range_test_step_rate", &C::lr_range_test_step_rate, 0.0, 1e6),
      BoolKey("lr_range_test_staircase", &C::lr_range_test_staircase),
  };
  // DeepSpeed's WarmupCosineLR scales the optimizer's lr by ratios; it takes no lr of its own.
  static const KeyTable<C> cosine = {
      DoubleKey("warmup_min_ratio", &C::warmup_min_ratio, 0.0, 1.0),
      DoubleKey("cos_min_ratio", &C::cos_min_ratio, 0.0, 1.0),
      IntKey("warmup_num_steps", &C::warmup_num_steps, 0, kMaxElems),
      IntKey("total_num_steps", &C::total_num_steps, 1, kMaxElems),
      EnumKey("warmup_type", &C::warmup_type, warmup_types),
  };
  static const KeyTable<C> warmup = {
      DoubleKey("warmup_min_lr", &C::warmup_min_lr, 0.0, 10.0),
      DoubleKey("warmup_max_lr", &C::warmup_max_lr, 0.0, 10.0),
      IntKey("warmup_num_steps", &C::warmup_num_steps, 0, kMaxElems),
      IntKey("total_num_steps", &C::total_num_steps, 1, kMaxElems),
      EnumKey("warmup_type", &C::warmup_type, warmup_types),
  };
  switch (type) {
    case SchedulerType::kOneCycle: return one_cycle;
    case SchedulerType::kLRRangeTest: return range_test;
    case SchedulerType::kWarmupCosineLR: return cosine;
    case SchedulerType::kNone:
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR: break;
  }
  return warmup;
}

Status ParseScheduler(Section s, SchedulerConfig* c) {
  STRATA_RETURN_IF_ERROR(s.Enum("type", &c->type, kSchedulerTypes));
  STRATA_ASSIGN_OR_RETURN(Section p, s.Child("params"));
  p.Ignored("last_batch_iteration", "has no effect in Strata (a resumed run continues its "
                                    "schedule from the checkpoint's step)");
  if (c->type == SchedulerType::kOneCycle) {
    for (const char* key : {"cycle_min_lr", "cycle_max_lr"}) {
      if (!p.has(key))
        return InvalidArgument(StrCat(p.Key(key), " is required by OneCycle (its lower and upper "
                                      "learning rates), e.g. 1e-4 and 1e-3"));
    }
  }
  if (c->type == SchedulerType::kWarmupCosineLR) {
    for (const char* key : {"warmup_min_lr", "warmup_max_lr"}) {
      if (p.has(key))
        return InvalidArgument(StrCat(p.Key(key), ": WarmupCosineLR takes ratios of the "
                                      "optimizer's lr (warmup_min_ratio, cos_min_ratio), as "
                                      "DeepSpeed's does; set the peak in optimizer.params.lr"));
    }
  }
  STRATA_RETURN_IF_ERROR(ReadKeys(p, SchedulerParamKeys(c->type), c));
  if (c->type == SchedulerType::kOneCycle && c->cycle_second_step_size == 0)
    return InvalidArgument(StrCat(p.Key("cycle_second_step_size"),
                                  "=0: must be >= 1, or -1 for cycle_first_step_size"));
  STRATA_RETURN_IF_ERROR(p.Finish());
  const bool warms_up = c->type == SchedulerType::kWarmupDecayLR ||
                        c->type == SchedulerType::kWarmupCosineLR;
  if (warms_up && c->total_num_steps < c->warmup_num_steps)
    return InvalidArgument(StrCat(p.Key("total_num_steps"), "=", c->total_num_steps,
                                  ": must be at least warmup_num_steps=", c->warmup_num_steps));
  return s.Finish();
}

const KeyTable<Fp16Config>& Fp16Keys() {
  using C = Fp16Config;
  static const KeyTable<C> keys = {
      BoolKey("enabled", &C::enabled),
      DoubleKey("loss_scale", &C::loss_scale, 0.0, 1e30),
      IntKey("initial_scale_power", &C::initial_scale_power, 0, 64),
      IntKey("loss_scale_window", &C::loss_scale_window, 1, kMaxElems),
      IntKey("hysteresis", &C::hysteresis, 1, 1000000),
      DoubleKey("min_loss_scale", &C::min_loss_scale, 0.0, 1e30),
      IgnoredKey<C>("consecutive_hysteresis", "has no effect in Strata"),
      IgnoredKey<C>("auto_cast", "has no effect in Strata (the model's parameters are cast)"),
      IgnoredKey<C>("fp16_master_weights_and_grads", "master weights are always fp32 in Strata"),
  };
  return keys;
}

Status ParseFp16(Section s, Fp16Config* c) {
  STRATA_RETURN_IF_ERROR(ReadKeys(s, Fp16Keys(), c));
  return s.Finish();
}

const KeyTable<ActivationCheckpointingConfig>& ActivationCheckpointingKeys() {
  using C = ActivationCheckpointingConfig;
  static const KeyTable<C> keys = {
      BoolKey("partition_activations", &C::partition_activations),
      BoolKey("cpu_checkpointing", &C::cpu_checkpointing),
      BoolKey("contiguous_memory_optimization", &C::contiguous_memory_optimization),
      IntKey("number_checkpoints", &C::number_checkpoints, 0, 1 << 20),
      BoolKey("synchronize_checkpoint_boundary", &C::synchronize_checkpoint_boundary),
      BoolKey("profile", &C::profile),
  };
  return keys;
}

Status ParseActivationCheckpointing(Section s, ActivationCheckpointingConfig* c) {
  STRATA_RETURN_IF_ERROR(ReadKeys(s, ActivationCheckpointingKeys(), c));
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

// A byte count that must keep pages aligned for O_DIRECT.
template <typename C>
ConfigKey<C> PageMultipleKey(const char* name, uint64_t C::*m, uint64_t lo, uint64_t hi,
                             const char* why) {
  return Checked(BytesKey(name, m, lo, hi), [=](const Section& s, const C& c) {
    return c.*m % 4096 == 0 ? Status::Ok()
                            : InvalidArgument(StrCat(s.Key(name), "=", c.*m,
                                                     ": must be a multiple of 4096 bytes ", why));
  });
}

// "cuda:N"'s N, -1 for any other text (a digit string of at most four digits: no GPU count
// comes near, and stoi cannot overflow).
int CudaIndexOf(const std::string& spec) {
  if (spec.rfind("cuda:", 0) != 0) return -1;
  const std::string n = spec.substr(5);
  if (n.empty() || n.size() > 4 || n.find_first_not_of("0123456789") != std::string::npos)
    return -1;
  return std::stoi(n);
}

// strata.device: the specs CreateDevice takes.
template <typename C>
ConfigKey<C> DeviceSpecKey(const char* name, std::string C::*m) {
  return {
      name,
      [=](Section& s, C* c) -> Status {
        std::string v = c->*m;
        STRATA_RETURN_IF_ERROR(s.String(name, &v));
        if (v != "auto" && v != "cpu" && v != "cuda" && CudaIndexOf(v) < 0)
          return InvalidArgument(StrCat(
              s.Key(name), "=\"", v, "\": must be auto, cpu, cuda or cuda:N (N: a GPU's index)"));
        c->*m = v;
        return Status::Ok();
      },
      [=](const C& c, json* j) { (*j)[name] = c.*m; }};
}

const KeyTable<StrataConfig>& StrataKeys() {
  using C = StrataConfig;
  static const KeyTable<C> keys = {
      BytesKey("device_memory_budget", &C::device_memory_budget, 0, kMaxBytes),
      BytesKey("host_memory_budget", &C::host_memory_budget, 0, kMaxBytes),
      BytesKey("nvme_capacity", &C::nvme_capacity, 0, kMaxBytes),
      PageMultipleKey("chunk_size", &C::chunk_size, 4096, uint64_t{1} << 34,
                      "(O_DIRECT alignment)"),
      EnumKey("eviction", &C::eviction,
              {{"next_use", EvictionPolicy::kNextUse}, {"lru", EvictionPolicy::kLru}}),
      BoolKey("overlap_optimizer", &C::overlap_optimizer),
      EnumKey("checksums", &C::checksums,
              {{"crc32c", ChecksumKind::kCrc32c}, {"none", ChecksumKind::kNone}}),
      IntKey("prefetch_lookahead", &C::prefetch_lookahead, 0, 4096),
      EnumKey("placement", &C::placement,
              {{"config", PlacementMode::kConfig}, {"auto", PlacementMode::kAuto}}),
      BytesKey("device_reserve", &C::device_reserve, 0, kMaxBytes),
      EnumKey(
          "optimizer_state_dtype", &C::optimizer_state_dtype,
          {{"fp32", StateDtype::kFp32}, {"bf16", StateDtype::kBf16}, {"int8", StateDtype::kInt8}}),
      BoolKey("stochastic_rounding", &C::stochastic_rounding),
      IntKey("optimizer_threads", &C::optimizer_threads, 0, 4096),
      PageMultipleKey("host_pool_colour_step", &C::host_pool_colour_step, 0, 1 << 20,
                      "(pages stay aligned for O_DIRECT); 0 turns colouring off"),
      ChoiceKey("comm_backend", &C::comm_backend, {"auto", "single", "gloo", "nccl"}),
      DoubleKey("comm_timeout_s", &C::comm_timeout_s, 0.0, 86400.0, false, true),
      DeviceSpecKey("device", &C::device),
  };
  return keys;
}

Status ParseStrata(Section s, StrataConfig* c) {
  STRATA_RETURN_IF_ERROR(ReadKeys(s, StrataKeys(), c));
  return s.Finish();
}

const KeyTable<ModelConfig>& ModelKeys() {
  using C = ModelConfig;
  static const KeyTable<C> keys = {
      IntKey("n_layers", &C::n_layers, 1, 4096),
      IntKey("d_model", &C::d_model, 8, 1 << 20),
      IntKey("n_heads", &C::n_heads, 1, 4096),
      IntKey("seq_len", &C::seq_len, 2, 1 << 20),
      IntKey("vocab_size", &C::vocab_size, 2, 1 << 24),
      DoubleKey("dropout", &C::dropout, 0.0, 1.0, true),
      BoolKey("checkpoint_activations", &C::checkpoint_activations),
      IntKey("seed", &C::seed, 0, std::numeric_limits<int64_t>::max()),
  };
  return keys;
}

Status ParseModel(Section s, ModelConfig* c) {
  STRATA_RETURN_IF_ERROR(ReadKeys(s, ModelKeys(), c));
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
                        "dataloader_drop_last", "data_efficiency",
                        "curriculum_learning", "tensor_parallel", "compile", "weight_quantization",
                        "steps_per_print_ranks", "disable_allgather", "cuda_visible_devices",
                        "_comment", "comment", "train_batch_size_per_gpu_eval"})
    s.Ignored(k, "has no effect in Strata");
  // DeepSpeed's checkpoint section picks the universal format (load_universal, after a
  // ds_to_universal conversion), node-local storage and parallel writes. Every Strata checkpoint
  // loads on any world size, stage and precision as saved (Note [elastic resume]); the Python
  // frontend reads tag_validation itself.
  s.Ignored("checkpoint",
            "only its tag_validation acts (in the Python frontend): a Strata checkpoint loads on "
            "another world size, ZeRO stage or precision as saved, with no ds_to_universal "
            "conversion and no load_universal");
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

const KeyTable<Bf16Config>& Bf16Keys() {
  using C = Bf16Config;
  static const KeyTable<C> keys = {
      BoolKey("enabled", &C::enabled),
      BoolKey("bf16_master_weights_and_grads", &C::bf16_master_weights_and_grads),
      BoolKey("bf16_optimizer_states", &C::bf16_optimizer_states),
      IgnoredKey<C>("immediate_grad_update", "has no effect in Strata"),
      // Megatron-DeepSpeed's bf16 configs copy fp16's loss-scaling keys; DeepSpeed reads only
      // "enabled" there.
      IgnoredKey<C>("loss_scale", "has no effect: bf16 needs no loss scaling"),
      IgnoredKey<C>("loss_scale_window", "has no effect: bf16 needs no loss scaling"),
      IgnoredKey<C>("hysteresis", "has no effect: bf16 needs no loss scaling"),
      IgnoredKey<C>("min_loss_scale", "has no effect: bf16 needs no loss scaling"),
      IgnoredKey<C>("initial_scale_power", "has no effect: bf16 needs no loss scaling"),
      IgnoredKey<C>("consecutive_hysteresis", "has no effect: bf16 needs no loss scaling"),
      IgnoredKey<C>("auto_cast", "has no effect: bf16 needs no loss scaling"),
  };
  return keys;
}

Status ParseBf16(Section& s, Bf16Config* c) {
  STRATA_RETURN_IF_ERROR(s.Alias("bfloat16", "bf16"));
  const char* bf16_key = s.has("bf16") || !s.has("bfloat16") ? "bf16" : "bfloat16";
  STRATA_ASSIGN_OR_RETURN(Section bf16, s.Child(bf16_key));
  STRATA_RETURN_IF_ERROR(ReadKeys(bf16, Bf16Keys(), c));
  return bf16.Finish();
}

Status CheckCombinations(Section& s, Config* c) {
  if (c->fp16.enabled && c->bf16.enabled)
    return InvalidArgument("fp16.enabled and bf16.enabled are both true; enable at most one");
  // bf16.enabled "auto" is known once resolved (ResolveAuto checks it there): Hugging Face's
  // Trainer and accelerate write "auto".
  const bool bf16_auto =
      std::count(c->auto_keys.begin(), c->auto_keys.end(), "bf16.enabled") > 0 ||
      std::count(c->auto_keys.begin(), c->auto_keys.end(), "bfloat16.enabled") > 0;
  if ((c->bf16.bf16_master_weights_and_grads || c->bf16.bf16_optimizer_states) &&
      !c->bf16.enabled && !bf16_auto)
    return InvalidArgument(StrCat(
        "bf16.", c->bf16.bf16_master_weights_and_grads ? "bf16_master_weights_and_grads"
                                                       : "bf16_optimizer_states",
        "=true needs bf16.enabled=true (the compact layouts keep bf16 copies of bf16 training)"));
  const json* strata_section = s.Get("strata");
  auto strata_given = [&](const char* key) {
    return strata_section != nullptr && strata_section->is_object() &&
           strata_section->contains(key);
  };
  if (strata_given("stochastic_rounding") && !c->bf16.bf16_master_weights_and_grads)
    s.Warn(
        "strata.stochastic_rounding has no effect without bf16.bf16_master_weights_and_grads=true: "
        "it rounds the bf16 master's update, and the master is fp32 here");
  if (c->bf16.bf16_optimizer_states) {
    // An explicit "fp32" beside it asks for fp32 moments as plainly as "int8" asks for 8-bit ones.
    if (c->strata.optimizer_state_dtype == StateDtype::kInt8 ||
        (c->strata.optimizer_state_dtype == StateDtype::kFp32 &&
         strata_given("optimizer_state_dtype")))
      return InvalidArgument(StrCat(
          "bf16.bf16_optimizer_states=true and strata.optimizer_state_dtype=",
          strata_given("optimizer_state_dtype") ? strata_section->at("optimizer_state_dtype").dump()
                                                : std::string("\"int8\""),
          " ask for two moment formats; keep one"));
    c->strata.optimizer_state_dtype = StateDtype::kBf16;  // DeepSpeed's key, Strata's field
  }
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

// The top level's own keys; each section has its table above.
const KeyTable<Config>& RootKeys() {
  using C = Config;
  static const KeyTable<C> keys = {
      IntKey("train_batch_size", &C::train_batch_size, 0, kMaxElems),
      IntKey("train_micro_batch_size_per_gpu", &C::train_micro_batch_size_per_gpu, 1, 1 << 24),
      IntKey("gradient_accumulation_steps", &C::gradient_accumulation_steps, 1, 1 << 24),
      DoubleKey("gradient_clipping", &C::gradient_clipping, 0.0, 1e12),
      IntKey("steps_per_print", &C::steps_per_print, 1, std::numeric_limits<int64_t>::max()),
      BoolKey("wall_clock_breakdown", &C::wall_clock_breakdown),
      BoolKey("zero_allow_untested_optimizer", &C::zero_allow_untested_optimizer),
  };
  return keys;
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
  auto given = [&](const char* k) {
    const json* v = root.contains(k) ? &root.at(k) : nullptr;
    return v && v->is_number();
  };
  c->train_batch_size_given = given("train_batch_size");
  c->micro_batch_given = given("train_micro_batch_size_per_gpu");
  c->accumulation_given = given("gradient_accumulation_steps");
  STRATA_RETURN_IF_ERROR(ReadKeys(s, RootKeys(), c));
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

// Note [config limits]
// A config is a few KiB nested four deep. The parser itself keeps its own stack, but writing a
// value into an error message recurses once per level, so a value nested tens of thousands deep
// overflowed the stack on the way to saying it was wrong. Values deeper than kMaxConfigDepth are
// discarded while parsing and the file refused; FromFile reads at most kMaxConfigBytes (a
// device such as /dev/zero never ends).
constexpr int kMaxConfigDepth = 64;
constexpr size_t kMaxConfigBytes = size_t{64} << 20;

StatusOr<Config> Config::FromJsonText(const std::string& text, const std::string& source) {
  json root;
  bool too_deep = false;
  // The keys of each object being read, innermost last: a key given twice is refused, as
  // DeepSpeed refuses it (and Strata's Python side), where the parser alone would keep the last.
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  const json::parser_callback_t check = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth > kMaxConfigDepth) {
      too_deep = true;
      return false;  // discard it, and what it holds
    }
    if (event == json::parse_event_t::object_start) keys.emplace_back();
    if (event == json::parse_event_t::object_end && !keys.empty()) keys.pop_back();
    if (event == json::parse_event_t::key && !keys.empty() && parsed.is_string() &&
        !keys.back().insert(parsed.get<std::string>()).second && duplicate.empty())
      duplicate = parsed.get<std::string>();
    return true;
  };
  try {
    // DeepSpeed reads configs with hjson: comments and trailing commas load (RelaxedJson).
    root = json::parse(RelaxedJson(text), check, /*allow_exceptions=*/true);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e400
    return InvalidArgument(StrCat(source, ": not valid JSON: ", e.what()));
  }
  if (too_deep)
    return InvalidArgument(StrCat(source, ": a value is nested more than ", kMaxConfigDepth,
                                  " levels deep; a DeepSpeed config nests four"));
  if (!duplicate.empty())
    return InvalidArgument(
        StrCat(source, ": key '", duplicate, "' appears twice in one object; keep one"));
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
  std::string text;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxConfigBytes)
      return InvalidArgument(StrCat("config ", path, " is larger than ", kMaxConfigBytes >> 20,
                                    " MiB; a DeepSpeed config is a few KiB (Note [config limits])"));
  }
  if (in.bad()) return ErrnoToStatus(errno, StrCat("cannot read config ", path));
  return FromJsonText(text, path);
}

namespace {

// ToJson's "optimizer" section: the type and the parameters that type reads.
json OptimizerJson(const OptimizerConfig& o) {
  json j;
  j["params"] = WriteKeys(OptimizerParamKeys(o.type), o);
  // Note [Adam means AdamW]: "Adam" alone reads back as AdamW, so plain Adam says so.
  if (o.type == OptimizerType::kAdam) j["params"]["adam_w_mode"] = false;
  j["type"] = OptimizerTypeName(o.type);
  return j;
}

// ToJson's "scheduler" section: the type and the parameters that type reads.
json SchedulerJson(const SchedulerConfig& sc) {
  return {{"type", EnumName(sc.type, kSchedulerTypes)},
          {"params", WriteKeys(SchedulerParamKeys(sc.type), sc)}};
}

}  // namespace

json Config::ToJson() const {
  json j = WriteKeys(RootKeys(), *this);
  j["optimizer"] = OptimizerJson(optimizer);
  if (scheduler.type != SchedulerType::kNone) j["scheduler"] = SchedulerJson(scheduler);
  j["fp16"] = WriteKeys(Fp16Keys(), fp16);
  j["bf16"] = WriteKeys(Bf16Keys(), bf16);
  j["activation_checkpointing"] = WriteKeys(ActivationCheckpointingKeys(), activation_checkpointing);
  j["zero_optimization"] = WriteKeys(ZeroKeys(), zero_optimization);
  j["zero_optimization"]["offload_param"] =
      WriteKeys(OffloadParamKeys(), zero_optimization.offload_param);
  j["zero_optimization"]["offload_optimizer"] =
      WriteKeys(OffloadOptimizerKeys(), zero_optimization.offload_optimizer);
  j["aio"] = WriteKeys(AioKeys(), aio);
  j["strata"] = WriteKeys(StrataKeys(), strata);
  j["model"] = WriteKeys(ModelKeys(), model);
  return j;
}

std::string Config::ToJsonString(int indent) const { return ToJson().dump(indent); }

bool operator==(const Config& a, const Config& b) { return a.ToJson() == b.ToJson(); }

int StrataConfig::CudaIndex() const { return CudaIndexOf(device); }

std::vector<std::string> ZeroConfig::NvmeTierPaths() const {
  std::vector<std::string> paths;
  if (offload_optimizer.device == OffloadDevice::kNvme) paths = offload_optimizer.nvme_path;
  if (offload_param.device != OffloadDevice::kNvme) return paths;
  // The parameter section's directories the optimizer's do not name already: "/nvme/", "/nvme",
  // a relative spelling or a symlink of an existing one are one. A directory listed twice in one
  // section stays so: the swap store refuses it, naming both spellings.
  const auto same = [](std::string a, std::string b) {
    while (a.size() > 1 && a.back() == '/') a.pop_back();
    while (b.size() > 1 && b.back() == '/') b.pop_back();
    std::error_code ec;
    return a == b || (std::filesystem::equivalent(a, b, ec) && !ec);
  };
  const size_t optimizer_paths = paths.size();
  for (const std::string& p : offload_param.nvme_path) {
    const auto end = paths.begin() + static_cast<std::ptrdiff_t>(optimizer_paths);
    if (std::none_of(paths.begin(), end, [&](const std::string& q) { return same(q, p); }))
      paths.push_back(p);
  }
  return paths;
}

}  // namespace strata
