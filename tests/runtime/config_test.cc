#include "runtime/base/config.h"
#include "runtime/base/relaxed_json.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/state/lr_schedule.h"
#include "runtime/state/tier_manager.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using nlohmann::json;

// Every key Strata reads, each set to a value other than its default.
const char* kFullConfig = R"({
  "train_batch_size": 32,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 2,
  "gradient_clipping": 1.0,
  "steps_per_print": 5,
  "wall_clock_breakdown": true,
  "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6,
                "weight_decay": 0.01, "bias_correction": false, "adam_w_mode": false}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_type": "linear", "warmup_min_lr": 1e-5, "warmup_max_lr": 3e-4,
                "warmup_num_steps": 10, "total_num_steps": 100}},
  "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
           "hysteresis": 3, "min_loss_scale": 0.5},
  "bf16": {"enabled": false},
  "zero_optimization": {
    "stage": 3, "contiguous_gradients": false, "overlap_comm": false,
    "reduce_bucket_size": 2e8, "allgather_bucket_size": 3e8, "sub_group_size": 5e8,
    "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e4,
    "stage3_max_live_parameters": 2e8, "stage3_max_reuse_distance": 3e8,
    "offload_param": {"device": "nvme", "nvme_path": ["/a", "/b"], "buffer_count": 6,
                      "buffer_size": 2e8, "max_in_cpu": 5e8, "pin_memory": false},
    "offload_optimizer": {"device": "cpu", "nvme_path": "/c", "buffer_count": 8,
                          "pin_memory": false, "pipeline_read": true, "pipeline_write": true,
                          "ratio": 0.5}
  },
  "aio": {"block_size": 8388608, "queue_depth": 64, "intra_op_parallelism": 2,
          "single_submit": true, "overlap_events": false, "use_gds": false},
  "strata": {"device_memory_budget": "2GiB", "host_memory_budget": "24GiB",
             "nvme_capacity": "100GiB", "chunk_size": "32MiB", "eviction": "lru",
             "overlap_optimizer": false, "checksums": "none", "prefetch_lookahead": 8,
             "optimizer_state_dtype": "bf16", "optimizer_threads": 2, "comm_backend": "gloo",
             "comm_timeout_s": 30, "device": "cpu", "host_pool_colour_step": "8KiB"},
  "model": {"n_layers": 6, "d_model": 256, "n_heads": 8, "seq_len": 64, "vocab_size": 256,
            "dropout": 0.1, "seed": 7}
})";

TEST(Config, DefaultsMatchDeepSpeed) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText("{}"));
  const auto& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 0);
  EXPECT_TRUE(z.contiguous_gradients);
  EXPECT_EQ(z.reduce_bucket_size, 500000000);
  EXPECT_EQ(z.allgather_bucket_size, 500000000);
  EXPECT_EQ(z.sub_group_size, 1000000000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 50000000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 100000);
  EXPECT_EQ(z.stage3_max_live_parameters, 1000000000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 1000000000);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(z.offload_param.buffer_count, 5);
  EXPECT_EQ(z.offload_param.buffer_size, 100000000);
  // Strata's one departure: DeepSpeed's 1e9 would keep every shard of a smaller model in host
  // memory under device nvme; absent, the key keeps none there.
  EXPECT_EQ(z.offload_param.max_in_cpu, -1);
  EXPECT_TRUE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_optimizer.buffer_count, 4);
  EXPECT_FALSE(z.offload_optimizer.pipeline_read);
  EXPECT_FALSE(z.offload_optimizer.pipeline_write);
  EXPECT_DOUBLE_EQ(z.offload_optimizer.ratio, 1.0);
  EXPECT_EQ(c.aio.block_size, 1048576);
  EXPECT_EQ(c.aio.queue_depth, 8);
  EXPECT_EQ(c.aio.intra_op_parallelism, 1);
  EXPECT_FALSE(c.aio.single_submit);
  EXPECT_TRUE(c.aio.overlap_events);
  EXPECT_FALSE(c.aio.use_gds);
  EXPECT_EQ(c.fp16.initial_scale_power, 16);
  EXPECT_EQ(c.fp16.loss_scale_window, 1000);
  EXPECT_EQ(c.fp16.hysteresis, 2);
  EXPECT_DOUBLE_EQ(c.fp16.min_loss_scale, 1.0);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 1);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_TRUE(c.warnings.empty());
}

// Note [no silent key]: every key of kFullConfig that Strata parses but does not act on is named
// by exactly one warning; the keys that do act (everything else) raise none.
TEST(Config, KeysWithoutEffectSaySoOnce) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(kFullConfig));
  const std::vector<std::string> silent = {
      "wall_clock_breakdown", "contiguous_gradients", "sub_group_size",
      "offload_param.buffer_count", "offload_param.buffer_size",
      "offload_optimizer.buffer_count", "pipeline_read"};
  for (const std::string& key : silent) {
    int hits = 0;
    for (const std::string& w : c.warnings) hits += w.find(key) != std::string::npos;
    EXPECT_EQ(hits, 1) << key;
  }
  EXPECT_EQ(c.warnings.size(), silent.size());
  for (const std::string& w : c.warnings) EXPECT_NE(w.find("no effect"), std::string::npos) << w;
}

TEST(Config, EveryKeyIsRead) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(kFullConfig));
  EXPECT_EQ(c.train_batch_size, 32);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_EQ(c.steps_per_print, 5);
  EXPECT_TRUE(c.wall_clock_breakdown);
  EXPECT_EQ(c.optimizer.type, OptimizerType::kAdam);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.01);
  EXPECT_FALSE(c.optimizer.bias_correction);
  EXPECT_EQ(c.scheduler.type, SchedulerType::kWarmupDecayLR);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_min_lr, 1e-5);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 3e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 10);
  EXPECT_EQ(c.scheduler.total_num_steps, 100);
  EXPECT_TRUE(c.fp16.enabled);
  EXPECT_DOUBLE_EQ(c.fp16.loss_scale, 0);
  EXPECT_EQ(c.fp16.initial_scale_power, 12);
  EXPECT_EQ(c.fp16.loss_scale_window, 500);
  EXPECT_EQ(c.fp16.hysteresis, 3);
  EXPECT_DOUBLE_EQ(c.fp16.min_loss_scale, 0.5);
  const auto& z = c.zero_optimization;
  EXPECT_EQ(z.stage, 3);
  EXPECT_FALSE(z.contiguous_gradients);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_EQ(z.reduce_bucket_size, 200000000);
  EXPECT_EQ(z.allgather_bucket_size, 300000000);
  EXPECT_EQ(z.sub_group_size, 500000000);
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 10000000);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 10000);
  EXPECT_EQ(z.stage3_max_live_parameters, 200000000);
  EXPECT_EQ(z.stage3_max_reuse_distance, 300000000);
  EXPECT_EQ(z.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(z.offload_param.nvme_path, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(z.offload_param.buffer_count, 6);
  EXPECT_EQ(z.offload_param.buffer_size, 200000000);
  EXPECT_EQ(z.offload_param.max_in_cpu, 500000000);
  EXPECT_FALSE(z.offload_param.pin_memory);
  EXPECT_EQ(z.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(z.offload_optimizer.nvme_path, (std::vector<std::string>{"/c"}));
  EXPECT_EQ(z.offload_optimizer.buffer_count, 8);
  EXPECT_FALSE(z.offload_optimizer.pin_memory);
  EXPECT_TRUE(z.offload_optimizer.pipeline_read);
  EXPECT_TRUE(z.offload_optimizer.pipeline_write);
  EXPECT_DOUBLE_EQ(z.offload_optimizer.ratio, 0.5);
  EXPECT_EQ(c.aio.block_size, 8388608);
  EXPECT_EQ(c.aio.queue_depth, 64);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_FALSE(c.aio.overlap_events);
  EXPECT_EQ(c.strata.device_memory_budget, 2ull << 30);
  EXPECT_EQ(c.strata.host_memory_budget, 24ull << 30);
  EXPECT_EQ(c.strata.nvme_capacity, 100ull << 30);
  EXPECT_EQ(c.strata.chunk_size, 32ull << 20);
  EXPECT_EQ(c.strata.eviction, EvictionPolicy::kLru);
  EXPECT_FALSE(c.strata.overlap_optimizer);
  EXPECT_EQ(c.strata.checksums, ChecksumKind::kNone);
  EXPECT_EQ(c.strata.prefetch_lookahead, 8);
  EXPECT_EQ(c.strata.optimizer_state_dtype, StateDtype::kBf16);
  EXPECT_EQ(c.strata.optimizer_threads, 2);
  EXPECT_EQ(c.strata.host_pool_colour_step, 8192u);
  EXPECT_EQ(TierManagerOptions::FromConfig(c.strata, 0).pool.colour_step, 8192u);
  EXPECT_EQ(c.strata.comm_backend, "gloo");
  EXPECT_DOUBLE_EQ(c.strata.comm_timeout_s, 30);
  EXPECT_EQ(c.strata.device, "cpu");
  EXPECT_EQ(c.model.n_layers, 6);
  EXPECT_EQ(c.model.d_model, 256);
  EXPECT_EQ(c.model.n_heads, 8);
  EXPECT_EQ(c.model.seq_len, 64);
  EXPECT_EQ(c.model.vocab_size, 256);
  EXPECT_DOUBLE_EQ(c.model.dropout, 0.1);
  EXPECT_EQ(c.model.seed, 7u);
}

// One NVMe tier stripes over both sections' paths when both offload to nvme: the optimizer's
// first (the staging directory of zero::Init is the first), each directory once.
TEST(Config, TheNvmeTierStripesOverBothSectionsPaths) {
  ZeroConfig z;
  EXPECT_TRUE(z.NvmeTierPaths().empty());
  z.offload_param.nvme_path = {"/p1", "/o1/"};
  z.offload_optimizer.nvme_path = {"/o1", "/o2"};
  EXPECT_TRUE(z.NvmeTierPaths().empty()) << "no section offloads to nvme";
  z.offload_param.device = OffloadDevice::kNvme;
  EXPECT_EQ(z.NvmeTierPaths(), (std::vector<std::string>{"/p1", "/o1/"}));
  z.offload_optimizer.device = OffloadDevice::kNvme;
  EXPECT_EQ(z.NvmeTierPaths(), (std::vector<std::string>{"/o1", "/o2", "/p1"}));
  z.offload_param.device = OffloadDevice::kCpu;
  EXPECT_EQ(z.NvmeTierPaths(), (std::vector<std::string>{"/o1", "/o2"}));
  // A directory listed twice in one section stays twice, for the swap store to refuse by name.
  z.offload_optimizer.nvme_path = {"/o1", "/o1"};
  EXPECT_EQ(z.NvmeTierPaths(), (std::vector<std::string>{"/o1", "/o1"}));
  // One existing directory spelled otherwise in the other section (a symlink, "x/../d") is one.
  testing::TempDir t;
  const std::string d = t.path() + "/d";
  std::filesystem::create_directories(t.path() + "/x");
  std::filesystem::create_directories(d);
  std::filesystem::create_directory_symlink(d, t.path() + "/link");
  z.offload_param.device = OffloadDevice::kNvme;
  z.offload_optimizer.nvme_path = {d};
  z.offload_param.nvme_path = {t.path() + "/link", t.path() + "/x/../d/", t.path() + "/x"};
  EXPECT_EQ(z.NvmeTierPaths(), (std::vector<std::string>{d, t.path() + "/x"}));
}

TEST(Config, DeviceTakesCpuCudaAutoAndOneGpuByIndex) {
  for (const char* spec : {"auto", "cpu", "cuda", "cuda:0", "cuda:7"}) {
    ASSERT_OK_AND_ASSIGN(
        Config c, Config::FromJsonText(StrCat(R"({"strata": {"device": ")", spec, R"("}})")));
    EXPECT_EQ(c.strata.device, spec);
    EXPECT_EQ(c.strata.NamesCuda(), std::string(spec).rfind("cuda", 0) == 0) << spec;
    EXPECT_EQ(c.strata.CudaIndex(), std::string(spec) == "cuda:7"   ? 7
                                    : std::string(spec) == "cuda:0" ? 0
                                                                    : -1);
  }
  for (const char* spec : {"gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:123456", "CPU", "cuda:1 "}) {
    auto c = Config::FromJsonText(StrCat(R"({"strata": {"device": ")", spec, R"("}})"));
    ASSERT_FALSE(c.ok()) << spec;
    EXPECT_NE(c.status().message().find("must be auto, cpu, cuda or cuda:N"), std::string::npos)
        << c.status();
  }
}

TEST(Config, RoundTripThroughNormalizedJson) {
  for (const char* text : {"{}", kFullConfig}) {
    ASSERT_OK_AND_ASSIGN(Config a, Config::FromJsonText(text));
    std::string normalized = a.ToJsonString();
    ASSERT_OK_AND_ASSIGN(Config b, Config::FromJsonText(normalized));
    EXPECT_TRUE(a == b) << normalized;
    EXPECT_EQ(normalized, b.ToJsonString());
  }
}

// A value of the same kind as `v` and different from it, valid for every key ToJson writes
// (ranges, multiples of 4096, d_model divisible by n_heads); nullopt where no such value is known.
std::optional<json> Changed(const std::string& key, const json& v) {
  static const std::map<std::string, json> strings = {
      {"device", "cpu"}, {"eviction", "lru"}, {"checksums", "none"},
      {"optimizer_state_dtype", "bf16"}, {"comm_backend", "gloo"}, {"warmup_type", "linear"},
      {"placement", "auto"}};
  if (v.is_boolean()) return !v.get<bool>();
  if (key == "stage") return v.get<int>() == 3 ? 2 : 3;
  if (v.is_number_integer()) return v.get<int64_t>() > 0 ? v.get<int64_t>() * 2 : 1;
  if (v.is_number_float()) return v.get<double>() > 0 ? v.get<double>() / 2 : 0.5;
  if (v.is_string()) {
    auto it = strings.find(key);
    if (it == strings.end()) return std::nullopt;
    // make_optional: GCC 16 finds a json -> optional<json> conversion ambiguous.
    return std::make_optional<json>(it->second != v ? it->second : json("auto"));
  }
  if (v.is_array() && key == "nvme_path") return json::array({"/x"});
  if (v.is_array() && key == "betas") return json::array({0.5, 0.75});
  return std::nullopt;
}

// Note [one table of keys]: every key the effective config writes is a key the parser reads into
// the same field. For each leaf of ToJson() (with each optimizer and scheduler type), a config
// that changes only that leaf parses to a config whose ToJson() shows the change, and nothing else.
TEST(Config, EveryKeyToJsonWritesIsReadBackIntoItsField) {
  // Offloading needs stage 3 (elsewhere it is ignored, saying so); nesterov needs momentum.
  const std::vector<std::string> bases = {
      R"({"optimizer": {"type": "AdamW"}})",
      R"({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}},
          "scheduler": {"type": "WarmupLR"}})",
      R"({"optimizer": {"type": "Adagrad"}, "scheduler": {"type": "WarmupCosineLR"}})",
      R"({"optimizer": {"type": "Lion"}, "scheduler": {"type": "OneCycle",
          "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})",
      R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}},
          "scheduler": {"type": "LRRangeTest"}})"};
  int checked = 0;
  for (const std::string& text : bases) {
    json base = json::parse(text);
    base["zero_optimization"]["stage"] = 3;
    base["bf16"]["enabled"] = true;  // the compact layouts' keys need it
    ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(base.dump()));
    const json effective = c.ToJson();
    const json flat = effective.flatten();
    for (auto it = flat.begin(); it != flat.end(); ++it) {
      const json::json_pointer ptr(it.key());
      std::string leaf = ptr.back();
      if (!ptr.parent_pointer().empty() && ptr.parent_pointer().back() == "betas") {
        leaf = "betas";
      }
      if (leaf == "type" || leaf == "adam_w_mode") continue;  // they pick the table itself
      json edited = effective;
      const json::json_pointer target = leaf == "betas" ? ptr.parent_pointer() : ptr;
      std::optional<json> changed = Changed(leaf, edited.at(target));
      ASSERT_TRUE(changed.has_value()) << "no changed value known for " << it.key();
      edited[target] = *changed;
      // fp16 and bf16 exclude each other: turning fp16 on turns the bases' bf16 off.
      const bool fp16_on = it.key() == "/fp16/enabled";
      if (fp16_on) edited["bf16"]["enabled"] = false;
      // bf16_optimizer_states beside an explicit optimizer_state_dtype "fp32" asks for two
      // moment formats: the written "fp32" goes, as a config that sets the key alone has none.
      if (it.key() == "/bf16/bf16_optimizer_states")
        edited["strata"].erase("optimizer_state_dtype");
      auto parsed = Config::FromJsonText(edited.dump());
      ASSERT_TRUE(parsed.ok()) << it.key() << ": " << parsed.status().message();
      json back = parsed->ToJson();
      EXPECT_EQ(back.at(target), *changed) << it.key() << " was not read into its field";
      back[target] = effective.at(target);
      if (fp16_on) back["bf16"]["enabled"] = true;
      // DeepSpeed's bf16_optimizer_states is Strata's optimizer_state_dtype "bf16".
      if (it.key() == "/bf16/bf16_optimizer_states") {
        EXPECT_EQ(back["strata"]["optimizer_state_dtype"], "bf16");
        back["strata"]["optimizer_state_dtype"] = effective["strata"]["optimizer_state_dtype"];
      }
      EXPECT_EQ(back, effective) << it.key() << " changed another key too";
      ++checked;
    }
  }
  EXPECT_GT(checked, 100);  // every section's keys were visited, not an empty walk
}

// Parses `text` and expects an INVALID_ARGUMENT whose message contains every piece.
void ExpectError(const std::string& text, std::initializer_list<std::string> pieces) {
  auto r = Config::FromJsonText(text);
  ASSERT_FALSE(r.ok()) << "accepted: " << text;
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  for (const auto& p : pieces)
    EXPECT_NE(r.status().message().find(p), std::string::npos)
        << "message '" << r.status().message() << "' lacks '" << p << "'";
}

// DeepSpeed parses configs with hjson: a JSON-shaped file with `//`, `#` and `/* */` comments and
// trailing commas loads (strata-train refused what the same script's Python loader took); what
// is inside strings is kept, and an error still names the right line.
TEST(Config, CommentsAndTrailingCommasLoadAsDeepSpeedReadsThem) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({
    # a hash comment
    "train_micro_batch_size_per_gpu": 3, // a line comment
    /* a block
       comment */
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                            "nvme_path": ["/tmp/a#b//c", ], }, },
    "strata": {"device": "cpu",},
  })"));
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 3);
  EXPECT_EQ(c.zero_optimization.stage, 2);
  ASSERT_EQ(c.zero_optimization.offload_optimizer.nvme_path.size(), 1u);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.nvme_path[0], "/tmp/a#b//c");
  EXPECT_EQ(RelaxedJson("[1, 2, ]"), "[1, 2  ]");
  EXPECT_EQ(RelaxedJson("{\"a\": \"x,}\"} # c\n"), "{\"a\": \"x,}\"} \n");
  auto bad = Config::FromJsonText("{\n/* two\nlines */\n\"stage\": }\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 4"), std::string::npos) << bad.status();
}

TEST(Config, UnknownKeysSuggestTheClosestSpelling) {
  ExpectError(R"({"zero_optimization": {"stage3_prefech_bucket_size": 5}})",
              {"unknown key zero_optimization.stage3_prefech_bucket_size",
               "did you mean zero_optimization.stage3_prefetch_bucket_size?"});
  ExpectError(R"({"aio": {"queue_dept": 5}})", {"did you mean aio.queue_depth?"});
  ExpectError(R"({"strata": {"chunksize": 4096}})", {"did you mean strata.chunk_size?"});
  ExpectError(R"({"optimizer": {"params": {"zzzzzzzzzzzz": 1}}})",
              {"unknown key optimizer.params.zzzzzzzzzzzz", "valid keys here:"});
  // Two edits of three letters is another word, not a misspelling: no suggestion.
  ExpectError(R"({"strata": {"foo": 1}})", {"unknown key strata.foo", "valid keys here:"});
  auto short_key = Config::FromJsonText(R"({"strata": {"foo": 1}})");
  EXPECT_EQ(short_key.status().message().find("did you mean"), std::string::npos) << short_key.status();
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({"foo": 1})"));
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_EQ(c.warnings[0].find("did you mean"), std::string::npos) << c.warnings[0];
}

// DeepSpeed ignores unknown top-level keys, so a file with one must load; the key is named in a
// warning with its likely intended spelling.
TEST(Config, UnknownTopLevelKeysWarnWithTheClosestSpelling) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({"train_micro_batch_size": 5, "zzzzzzzzzzzz": 1})"));
  ASSERT_EQ(c.warnings.size(), 2u);
  EXPECT_NE(c.warnings[0].find("unknown key train_micro_batch_size is ignored"), std::string::npos) << c.warnings[0];
  EXPECT_NE(c.warnings[0].find("did you mean train_micro_batch_size_per_gpu?"), std::string::npos) << c.warnings[0];
  EXPECT_NE(c.warnings[1].find("unknown key zzzzzzzzzzzz is ignored"), std::string::npos) << c.warnings[1];
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 1) << "the misspelled key must not be read";
}

TEST(Config, WrongTypes) {
  ExpectError(R"({"zero_optimization": {"stage": "three"}})",
              {"zero_optimization.stage=\"three\"", "whole number in 0..3"});
  ExpectError(R"({"aio": {"single_submit": 1}})", {"aio.single_submit=1", "true or false"});
  ExpectError(R"({"zero_optimization": []})", {"zero_optimization=[]", "JSON object"});
  ExpectError(R"({"optimizer": {"params": {"betas": 0.9}}})", {"optimizer.params.betas", "two numbers"});
  ExpectError(R"({"strata": {"host_memory_budget": "lots"}})", {"strata.host_memory_budget", "'lots'"});
  ExpectError(R"({"zero_optimization": {"offload_param": {"nvme_path": 3}}})",
              {"nvme_path=3", "list of strings"});
  ExpectError(R"([1, 2])", {"must be a JSON object"});
  ExpectError(R"({"aio": )", {"not valid JSON"});
  ExpectError(R"({"optimizer": {"type": "Adam", "params": {"amsgrad": "x"}}})",
              {"optimizer.params.amsgrad=\"x\"", "true or false"});
  ExpectError(R"({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}})", {"AMSGrad is not supported"});
}

TEST(Config, OutOfRange) {
  ExpectError(R"({"aio": {"queue_depth": 0}})", {"aio.queue_depth=0", "1..4096"});
  ExpectError(R"({"aio": {"block_size": 5000}})", {"aio.block_size=5000", "multiple of 4096"});
  ExpectError(R"({"zero_optimization": {"stage": 4}})", {"zero_optimization.stage=4", "0..3"});
  ExpectError(R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})",
              {"ratio=1.5", "[0, 1]"});
  ExpectError(R"({"zero_optimization": {"offload_optimizer": {"ratio": -0.1}}})",
              {"ratio=-0.1", "[0, 1]"});
  ExpectError(R"({"zero_optimization": {"offload_param": {"max_in_cpu": -1}}})",
              {"offload_param.max_in_cpu=-1"});
  ExpectError(R"({"strata": {"placement": "fill"}})", {"strata.placement", "auto"});
  ExpectError(R"({"optimizer": {"params": {"eps": 0}}})", {"optimizer.params.eps=0", "(0, 1]"});
  ExpectError(R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})", {"[0, 1)"});
  ExpectError(R"({"train_micro_batch_size_per_gpu": 2.5})", {"whole number"});
  ExpectError(R"({"zero_optimization": {"offload_param": {"device": "disk"}}})",
              {"device=\"disk\"", "none, cpu, nvme"});
  ExpectError(R"({"strata": {"eviction": "fifo"}})", {"next_use, lru"});
  ExpectError(R"({"strata": {"chunk_size": 5000}})", {"multiple of 4096"});
  ExpectError(R"({"strata": {"host_pool_colour_step": 1000}})",
              {"strata.host_pool_colour_step=1000", "multiple of 4096", "0 turns colouring off"});
  ExpectError(R"({"model": {"d_model": 100, "n_heads": 3}})", {"not divisible"});
}

TEST(Config, CrossKeyChecks) {
  ExpectError(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})", {"enable at most one"});

  ExpectError(R"({"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2})",
              {"train_batch_size=7"});
  ExpectError(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10,
              "total_num_steps": 5}}})", {"total_num_steps=5"});
}

// DeepSpeed ignores an offload section its stage does not use; so does Strata, with a warning.
TEST(Config, OffloadBelowItsStageIsIgnoredWithAWarning) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(
                                     R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})"));
  EXPECT_EQ(c.zero_optimization.offload_param.device, OffloadDevice::kNone);
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("ignored at stage 2"), std::string::npos) << c.warnings[0];
  ASSERT_OK_AND_ASSIGN(c, Config::FromJsonText(R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})"));
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kNone);
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_NE(c.warnings[0].find("ignored at stage 0"), std::string::npos) << c.warnings[0];
}

TEST(Config, DeprecatedSpellingsWarnAndApply) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({
    "aio": {"thread_count": 4, "single_submit": "true", "overlap_events": "False"},
    "zero_optimization": {"stage": 2, "cpu_offload": true}
  })"));
  EXPECT_EQ(c.aio.intra_op_parallelism, 4);
  EXPECT_TRUE(c.aio.single_submit);
  EXPECT_FALSE(c.aio.overlap_events);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
  ASSERT_EQ(c.warnings.size(), 4u);
  auto has = [&](const std::string& piece) {
    for (const auto& w : c.warnings)
      if (w.find(piece) != std::string::npos) return true;
    return false;
  };
  EXPECT_TRUE(has("aio.thread_count is deprecated; use aio.intra_op_parallelism"));
  EXPECT_TRUE(has("aio.single_submit=\"true\" is a string; write the JSON boolean true"));
  EXPECT_TRUE(has("zero_optimization.cpu_offload is deprecated"));

  ASSERT_OK_AND_ASSIGN(Config d, Config::FromJsonText(R"({"aio": {"num_threads": 3}})"));
  EXPECT_EQ(d.aio.intra_op_parallelism, 3);
  ASSERT_EQ(d.warnings.size(), 1u);

  ASSERT_OK_AND_ASSIGN(Config e, Config::FromJsonText(R"({"bfloat16": {"enabled": true}})"));
  EXPECT_TRUE(e.bf16.enabled);
  ASSERT_EQ(e.warnings.size(), 1u);

  // Both spellings at once is ambiguous.
  ExpectError(R"({"aio": {"thread_count": 2, "intra_op_parallelism": 3}})", {"both set"});
  // A deprecated key's value is still validated, under its own name.
  ExpectError(R"({"aio": {"thread_count": 0}})", {"aio.thread_count=0", "1..256"});
}

TEST(Config, IgnoredDeepSpeedKeysWarn) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({
    "zero_force_ds_cpu_optimizer": true,
    "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": true}
  })"));
  EXPECT_EQ(c.warnings.size(), 2u);
}

// Acted on by the Python front end (a client optimizer): read, not warned about.
TEST(Config, AllowUntestedOptimizerIsRead) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({"zero_allow_untested_optimizer": true})"));
  EXPECT_TRUE(c.zero_allow_untested_optimizer);
  EXPECT_TRUE(c.warnings.empty());
  EXPECT_FALSE(Config::FromJsonText(R"({"zero_allow_untested_optimizer": "yes"})").ok());
}

TEST(Config, NumbersAndSizes) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({
    "zero_optimization": {"reduce_bucket_size": 5e8},
    "strata": {"chunk_size": 4194304, "host_memory_budget": 1.6e10, "device_memory_budget": "512MiB"}
  })"));
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size, 500000000);
  EXPECT_EQ(c.strata.chunk_size, 4194304u);
  EXPECT_EQ(c.strata.host_memory_budget, 16000000000u);
  EXPECT_EQ(c.strata.device_memory_budget, 512ull << 20);
  ExpectError(R"({"zero_optimization": {"reduce_bucket_size": 5.5}})", {"whole number"});
}

TEST(Config, FromFileNamesThePath) {
  testing::TempDir dir;
  auto missing = Config::FromFile(dir.path() + "/nope.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nope.json"), std::string::npos);

  std::string path = dir.path() + "/bad.json";
  std::ofstream(path) << R"({"aio": {"queue_depth": -1}})";
  auto bad = Config::FromFile(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(path + ": aio.queue_depth=-1"), std::string::npos)
      << bad.status().message();
}

// A key given twice in one object was read as its last value without a word; DeepSpeed (and
// Strata's Python side) refuse it. The same name in two objects is two keys.
TEST(Config, AKeyGivenTwiceInOneObjectIsRefused) {
  for (const char* text : {R"({"train_micro_batch_size_per_gpu": 2, "train_micro_batch_size_per_gpu": 4})",
                           R"({"zero_optimization": {"stage": 2, "stage": 3}})"}) {
    auto twice = Config::FromJsonText(text, "twice.json");
    ASSERT_FALSE(twice.ok()) << text;
    EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(twice.status().message().find("twice.json: key '"), std::string::npos) << twice.status();
    EXPECT_NE(twice.status().message().find("' appears twice in one object; keep one"), std::string::npos)
        << twice.status();
  }
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}})"));
  EXPECT_EQ(c.zero_optimization.offload_param.device, OffloadDevice::kCpu);
  EXPECT_EQ(c.zero_optimization.offload_optimizer.device, OffloadDevice::kCpu);
}

// Note [config limits]: a value nested 100,000 deep used to overflow the stack while its error
// message was written; an endless file was read until memory ran out.
TEST(Config, DeepNestingAndEndlessFilesAreRefused) {
  const int depth = 100000;
  const std::string deep = "{\"train_batch_size\": " + std::string(depth, '[') + std::string(depth, ']') + "}";
  auto nested = Config::FromJsonText(deep, "deep.json");
  ASSERT_FALSE(nested.ok());
  EXPECT_EQ(nested.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(nested.status().message().find("deep.json: a value is nested more than 64 levels"),
            std::string::npos) << nested.status();
  // Within the limit the value reaches its key's check, which names it.
  const std::string shallow = "{\"train_batch_size\": " + std::string(60, '[') + std::string(60, ']') + "}";
  auto typed = Config::FromJsonText(shallow, "shallow.json");
  ASSERT_FALSE(typed.ok());
  EXPECT_NE(typed.status().message().find("train_batch_size"), std::string::npos) << typed.status();
  auto endless = Config::FromFile("/dev/zero");
  ASSERT_FALSE(endless.ok());
  EXPECT_NE(endless.status().message().find("larger than 64 MiB"), std::string::npos) << endless.status();
}

TEST(Config, ShippedConfigsParseWithoutWarnings) {
  int seen = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(std::string(STRATA_SOURCE_DIR) + "/configs")) {
    if (entry.path().extension() != ".json") continue;
    ++seen;
    auto c = Config::FromFile(entry.path().string());
    ASSERT_TRUE(c.ok()) << entry.path() << ": " << c.status();
    EXPECT_TRUE(c->warnings.empty()) << entry.path() << ": " << c->warnings[0];
  }
  EXPECT_GE(seen, 4);
}


// Note [auto values]: a Hugging Face-style config with "auto" everywhere it puts them.
const char* kAutoConfig = R"({
  "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
  "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                "warmup_num_steps": "auto", "total_num_steps": "auto"}},
  "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                        "stage3_param_persistence_threshold": "auto",
                        "stage3_gather_16bit_weights_on_model_save": "auto"}
})";

TEST(ConfigAuto, AutoKeysAreRecordedAndResolvedFromTheRun) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(kAutoConfig));
  EXPECT_EQ(c.auto_keys.size(), 17u);
  AutoContext ctx;
  ctx.world_size = 2;
  ctx.micro_batch = 4;
  ctx.lr = 3e-4;
  ctx.total_steps = 100;
  ctx.hidden_size = 256;
  ctx.native_bf16 = false;
  ASSERT_OK(c.ResolveAuto(ctx));
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.gradient_accumulation_steps, 1);
  EXPECT_EQ(c.train_batch_size, 8) << "micro x accumulation x world";
  EXPECT_DOUBLE_EQ(c.gradient_clipping, 1.0);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(c.scheduler.warmup_max_lr, 3e-4);
  EXPECT_EQ(c.scheduler.warmup_num_steps, 0);
  EXPECT_EQ(c.scheduler.total_num_steps, 100);
  EXPECT_FALSE(c.fp16.enabled);
  EXPECT_FALSE(c.bf16.enabled) << "no native bf16: auto picks fp32";
  EXPECT_EQ(c.zero_optimization.reduce_bucket_size, 256 * 256);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size, static_cast<int64_t>(0.9 * 256 * 256));
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold, 2560);
  EXPECT_EQ(c.auto_resolved.size(), c.auto_keys.size()) << "one line per auto key for --print-config";
  // The same file on a device with native bf16 picks bf16.
  ASSERT_OK_AND_ASSIGN(Config d, Config::FromJsonText(kAutoConfig));
  ctx.native_bf16 = true;
  ASSERT_OK(d.ResolveAuto(ctx));
  EXPECT_TRUE(d.bf16.enabled);
}

// A compact layout beside bf16.enabled "auto" (what Hugging Face's Trainer writes) was refused as
// needing bf16.enabled=true before "auto" was resolved, even where it resolves to true. It is
// checked once resolved: taken on a device with native bf16, refused without one, saying why.
TEST(ConfigAuto, ACompactLayoutBesideBf16AutoIsCheckedOnceResolved) {
  for (const char* key : {"bf16_master_weights_and_grads", "bf16_optimizer_states"}) {
    const std::string text =
        StrCat(R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": "auto", ")", key,
               R"(": true}})");
    AutoContext ctx;
    ctx.native_bf16 = true;
    ASSERT_OK_AND_ASSIGN(Config with, Config::FromJsonText(text));
    ASSERT_OK(with.ResolveAuto(ctx));
    EXPECT_TRUE(with.bf16.enabled) << key;
    ctx.native_bf16 = false;
    ASSERT_OK_AND_ASSIGN(Config without, Config::FromJsonText(text));
    const Status s = without.ResolveAuto(ctx);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << key << ": " << s;
    EXPECT_NE(
        s.message().find(StrCat("bf16.", key,
                                "=true needs bf16.enabled=true, and bf16.enabled "
                                "\"auto\" resolved to false (the device has no native bf16)")),
        std::string::npos)
        << s;
  }
  // Without "auto" the refusal stands at parse time.
  EXPECT_FALSE(
      Config::FromJsonText(R"({"bf16": {"enabled": false, "bf16_optimizer_states": true}})").ok());
  // Two moment formats asked for: "fp32" given beside bf16_optimizer_states ran bf16 moments
  // without a word ("int8" was refused).
  for (const char* dtype : {"fp32", "int8"}) {
    auto both =
        Config::FromJsonText(StrCat(R"({"bf16": {"enabled": true, "bf16_optimizer_states": true},
                   "strata": {"optimizer_state_dtype": ")",
                                    dtype, R"("}})"));
    EXPECT_EQ(both.status().code(), StatusCode::kInvalidArgument) << dtype;
    EXPECT_NE(both.status().message().find(StrCat("strata.optimizer_state_dtype=\"", dtype,
                                                  "\" ask for two moment formats")),
              std::string::npos)
        << both.status();
  }
  // strata.stochastic_rounding rounds the bf16 master's update: without that master it says so.
  ASSERT_OK_AND_ASSIGN(Config fp32_master,
                       Config::FromJsonText(R"({"strata": {"stochastic_rounding": false}})"));
  bool warned = false;
  for (const std::string& w : fp32_master.warnings)
    warned |= w.find("strata.stochastic_rounding has no effect") != std::string::npos;
  EXPECT_TRUE(warned);
}

// DeepSpeed's batch rules: all three given must agree; two given fix the third.
TEST(ConfigAuto, BatchSizesFollowDeepSpeedsRules) {
  AutoContext two;
  two.world_size = 2;
  ASSERT_OK_AND_ASSIGN(Config all, Config::FromJsonText(
      R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1})"));
  Status s = all.ResolveAuto(two);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("train_batch_size=16 does not equal"), std::string::npos) << s;
  EXPECT_NE(s.message().find("world size 2 = 8"), std::string::npos) << s;
  AutoContext four;
  four.world_size = 4;
  EXPECT_OK(all.ResolveAuto(four));
  // Train and micro given: the accumulation follows.
  ASSERT_OK_AND_ASSIGN(Config tm, Config::FromJsonText(
      R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})"));
  ASSERT_OK(tm.ResolveAuto(two));
  EXPECT_EQ(tm.gradient_accumulation_steps, 2);
  // Train given, micro "auto": the micro batch follows.
  ASSERT_OK_AND_ASSIGN(Config ta, Config::FromJsonText(
      R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"})"));
  ASSERT_OK(ta.ResolveAuto(two));
  EXPECT_EQ(ta.train_micro_batch_size_per_gpu, 8);
  EXPECT_EQ(ta.gradient_accumulation_steps, 1);
  ASSERT_OK(ta.ResolveAuto(two));  // idempotent
  EXPECT_EQ(ta.train_micro_batch_size_per_gpu, 8);
  // Micro and accumulation given: the train batch follows.
  ASSERT_OK_AND_ASSIGN(Config ma, Config::FromJsonText(
      R"({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2})"));
  ASSERT_OK(ma.ResolveAuto(two));
  EXPECT_EQ(ma.train_batch_size, 12);
  // Indivisible: an error naming the values.
  ASSERT_OK_AND_ASSIGN(Config bad, Config::FromJsonText(
      R"({"train_batch_size": 10, "train_micro_batch_size_per_gpu": "auto"})"));
  AutoContext three;
  three.world_size = 3;
  s = bad.ResolveAuto(three);
  EXPECT_NE(s.message().find("train_batch_size=10 is not divisible by the world size 3"), std::string::npos) << s;
  // 0 written in the file, and a train batch whose derived micro batch leaves its key's range
  // (0 resolved to accumulation 0, which divided by zero in the Python engine's backward).
  AutoContext one;
  ASSERT_OK_AND_ASSIGN(Config zero, Config::FromJsonText(R"({"train_batch_size": 0})"));
  s = zero.ResolveAuto(one);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("train_batch_size=0: must be at least 1"), std::string::npos) << s;
  ASSERT_OK_AND_ASSIGN(Config huge, Config::FromJsonText(R"({"train_batch_size": 1099511627776})"));
  s = huge.ResolveAuto(one);
  EXPECT_NE(s.message().find("train_micro_batch_size_per_gpu=1099511627776 (from train_batch_size"),
            std::string::npos) << s;
}

// Note [Adam means AdamW]: DeepSpeed's "Adam" is decoupled unless adam_w_mode is false.
TEST(ConfigDeepSpeed, OptimizerTypesFollowDeepSpeed) {
  auto type_of = [](const std::string& text) {
    auto c = Config::FromJsonText(text);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? c->optimizer.type : OptimizerType::kAdam;
  };
  EXPECT_EQ(type_of(R"({"optimizer": {"type": "Adam"}})"), OptimizerType::kAdamW);
  EXPECT_EQ(type_of(R"({"optimizer": {"type": "adam", "params": {"adam_w_mode": false}}})"), OptimizerType::kAdam);
  EXPECT_EQ(type_of(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})"), OptimizerType::kAdamW);
  EXPECT_EQ(type_of(R"({"optimizer": {"type": "DeepSpeed_Adam"}})"), OptimizerType::kAdamW);
  ExpectError(R"({"optimizer": {"type": "Lamb"}})",
              {"optimizer.type=\"Lamb\"", "Adam, AdamW, SGD, Adagrad and Lion"});
  ExpectError(R"({"scheduler": {"type": "OneCycle"}})",
              {"scheduler.params.cycle_min_lr", "required by OneCycle"});
  ExpectError(R"({"scheduler": {"type": "OneCycleLR"}})", {"scheduler.type", "OneCycle"});
}

TEST(ConfigDeepSpeed, SgdTakesTorchsParametersAndRules) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({"optimizer": {"type": "SGD",
      "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": true}}})"));
  EXPECT_EQ(c.optimizer.type, OptimizerType::kSGD);
  EXPECT_EQ(c.optimizer.lr, 0.05);
  EXPECT_EQ(c.optimizer.momentum, 0.9);
  EXPECT_EQ(c.optimizer.dampening, 0.0);
  EXPECT_TRUE(c.optimizer.nesterov);
  // torch.optim.SGD's default lr when the config leaves it out.
  ASSERT_OK_AND_ASSIGN(Config d, Config::FromJsonText(R"({"optimizer": {"type": "sgd"}})"));
  EXPECT_EQ(d.optimizer.lr, 1e-2);
  // The effective config reads back as the same SGD.
  ASSERT_OK_AND_ASSIGN(Config back, Config::FromJsonText(c.ToJson().dump()));
  EXPECT_EQ(back.optimizer.type, OptimizerType::kSGD);
  EXPECT_EQ(back.optimizer.momentum, 0.9);
  EXPECT_TRUE(back.optimizer.nesterov);
  ExpectError(R"({"optimizer": {"type": "SGD", "params": {"nesterov": true}}})",
              {"optimizer.params.nesterov", "momentum > 0"});
  ExpectError(R"({"optimizer": {"type": "SGD", "params": {"momentum": -1}}})",
              {"optimizer.params.momentum"});
  ExpectError(R"({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}})",
              {"optimizer.params.betas"});
}

TEST(ConfigDeepSpeed, AdagradAndLionTakeTheirParametersAndDefaults) {
  ASSERT_OK_AND_ASSIGN(Config a, Config::FromJsonText(R"({"optimizer": {"type": "Adagrad",
      "params": {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 1e-4}}})"));
  EXPECT_EQ(a.optimizer.type, OptimizerType::kAdagrad);
  EXPECT_EQ(a.optimizer.lr_decay, 0.01);
  EXPECT_EQ(a.optimizer.eps, 1e-10);  // torch's and DeepSpeed's Adagrad default
  ASSERT_OK_AND_ASSIGN(Config back, Config::FromJsonText(a.ToJson().dump()));
  EXPECT_EQ(back.optimizer.type, OptimizerType::kAdagrad);
  EXPECT_EQ(back.optimizer.lr_decay, 0.01);
  EXPECT_EQ(back.optimizer.eps, 1e-10);
  ASSERT_OK_AND_ASSIGN(Config d, Config::FromJsonText(R"({"optimizer": {"type": "adagrad"}})"));
  EXPECT_EQ(d.optimizer.lr, 1e-2);

  ASSERT_OK_AND_ASSIGN(Config l, Config::FromJsonText(R"({"optimizer": {"type": "Lion",
      "params": {"lr": 3e-4, "betas": [0.95, 0.98], "weight_decay": 0.1}}})"));
  EXPECT_EQ(l.optimizer.type, OptimizerType::kLion);
  EXPECT_EQ(l.optimizer.beta1, 0.95);
  EXPECT_EQ(l.optimizer.beta2, 0.98);
  ASSERT_OK_AND_ASSIGN(Config lb, Config::FromJsonText(l.ToJson().dump()));
  EXPECT_EQ(lb.optimizer.type, OptimizerType::kLion);
  EXPECT_EQ(lb.optimizer.weight_decay, 0.1);
  // DeepSpeed's Lion defaults: lr 1e-3, betas (0.9, 0.999).
  ASSERT_OK_AND_ASSIGN(Config ld, Config::FromJsonText(R"({"optimizer": {"type": "lion"}})"));
  EXPECT_EQ(ld.optimizer.lr, 1e-3);
  EXPECT_EQ(ld.optimizer.beta2, 0.999);

  ExpectError(R"({"optimizer": {"type": "Adagrad", "params": {"initial_accumulator_value": 0.1}}})",
              {"optimizer.params.initial_accumulator_value", "starts the sum at 0"});
  ExpectError(R"({"optimizer": {"type": "Adagrad", "params": {"betas": [0.9, 0.99]}}})",
              {"optimizer.params.betas"});
  ExpectError(R"({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})",
              {"optimizer.params.eps"});
  ExpectError(R"({"optimizer": {"type": "Lion", "params": {"betas": [1.0, 0.99]}}})",
              {"optimizer.params.betas", "[0, 1)"});
}

TEST(ConfigDeepSpeed, SpellingsWithoutTheStage3Prefix) {
  ASSERT_OK_AND_ASSIGN(Config c, Config::FromJsonText(R"({"zero_optimization": {"stage": 3,
      "max_live_parameters": 7e8, "max_reuse_distance": 6e8, "prefetch_bucket_size": 5e6,
      "param_persistence_threshold": 1e3, "gather_16bit_weights_on_model_save": true}})"));
  EXPECT_EQ(c.zero_optimization.stage3_max_live_parameters, 700000000);
  EXPECT_EQ(c.zero_optimization.stage3_max_reuse_distance, 600000000);
  EXPECT_EQ(c.zero_optimization.stage3_prefetch_bucket_size, 5000000);
  EXPECT_EQ(c.zero_optimization.stage3_param_persistence_threshold, 1000);
  ExpectError(R"({"zero_optimization": {"max_live_parameters": 1, "stage3_max_live_parameters": 2}})",
              {"both set"});
}

// DeepSpeed's WarmupLR defaults to a logarithmic warmup: gamma = log(it + 1) / log(warmup), and
// optimizer step s runs with iteration s - 2 (Note [warmup schedules' first steps]; the values
// against real DeepSpeed: tests/python/test_lr_schedule_vs_deepspeed.py).
TEST(ConfigDeepSpeed, WarmupTypeLogIsDeepSpeedsDefault) {
  ASSERT_OK_AND_ASSIGN(Config log_cfg, Config::FromJsonText(R"({"scheduler": {"type": "WarmupLR",
      "params": {"warmup_min_lr": 0, "warmup_max_lr": 1.0, "warmup_num_steps": 10}}})"));
  EXPECT_EQ(log_cfg.scheduler.warmup_type, WarmupType::kLog);
  EXPECT_NEAR(LearningRate(log_cfg, 6), std::log(5.0) / std::log(10.0), 1e-12);  // iteration 4
  EXPECT_NEAR(LearningRate(log_cfg, 1), 0.0, 1e-12);
  EXPECT_NEAR(LearningRate(log_cfg, 2), 0.0, 1e-12);
  EXPECT_NEAR(LearningRate(log_cfg, 12), 1.0, 1e-12);
  ASSERT_OK_AND_ASSIGN(Config lin, Config::FromJsonText(R"({"scheduler": {"type": "WarmupLR",
      "params": {"warmup_type": "linear", "warmup_min_lr": 0, "warmup_max_lr": 1.0, "warmup_num_steps": 10}}})"));
  EXPECT_NEAR(LearningRate(lin, 7), 0.5, 1e-12);
}

}  // namespace
}  // namespace strata
