// Config::ResolveAuto: Hugging Face's "auto" values filled from the run, and DeepSpeed's batch
// size rules (Note [auto values] in config_section.h).
#include <algorithm>
#include <set>
#include <sstream>
#include <string>
#include <utility>

#include "runtime/base/config.h"

namespace strata {

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
  // 0 is the field's "not given"; written in the file it is DeepSpeed's error too.
  if (c->train_batch_size_given && c->train_batch_size < 1)
    return InvalidArgument(StrCat("train_batch_size=", c->train_batch_size, ": must be at least 1"));
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
  // A value derived from train_batch_size keeps its own key's range (1..2^24, as if written).
  for (const auto& [key, v] : {std::pair<const char*, int64_t>{"train_micro_batch_size_per_gpu",
                                                               c->train_micro_batch_size_per_gpu},
                               {"gradient_accumulation_steps", c->gradient_accumulation_steps}})
    if (v < 1 || v > (int64_t{1} << 24))
      return InvalidArgument(StrCat(key, "=", v, " (from train_batch_size=", c->train_batch_size,
                                    " and world size ", world, "): must be in 1..", int64_t{1} << 24,
                                    "; give train_batch_size that divides into such values"));
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
  if ((bf16.bf16_master_weights_and_grads || bf16.bf16_optimizer_states) && !bf16.enabled)
    return InvalidArgument(
        StrCat("bf16.",
               bf16.bf16_master_weights_and_grads ? "bf16_master_weights_and_grads"
                                                  : "bf16_optimizer_states",
               "=true needs bf16.enabled=true, and bf16.enabled \"auto\" resolved to false (",
               fp16.enabled ? "fp16 is on" : "the device has no native bf16",
               "): set bf16.enabled to true, or leave the compact layout out"));
  return CheckBatchSizes(ctx.world_size);
}

}  // namespace strata
