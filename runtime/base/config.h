// Config: the DeepSpeed-style JSON that drives Strata, parsed and validated into structs.
//
// A user's ds_config.json for supported features works unchanged: every DeepSpeed key Strata
// reads has DeepSpeed's default. Strata's own settings live under "strata"; the model trained by
// strata-train under "model". Parsing is strict:
// - an unknown or misspelled key inside a section is an error naming the closest valid spelling;
// - a wrong type or an out-of-range value is an error naming the key, the value and the range;
// - deprecated spellings (aio.thread_count, num_threads, "true"/"false" strings) are accepted
//   with a warning (collected in Config::warnings and logged), never silently ignored;
// - numbers may be written as 5e8; byte sizes in "strata" may also be strings like "24GiB";
// - "auto" (Hugging Face's placeholder) is accepted where DeepSpeed's integration accepts it
//   and resolved by ResolveAuto;
// - the rule for compatibility: a file DeepSpeed accepts loads here. An unknown key at the top
//   level is a warning naming the closest known key (DeepSpeed ignores it); an unknown key inside
//   a known section is an error (DeepSpeed errors too). Every key that is accepted but has no
//   effect in Strata says so in one warning.
// ToJson() prints the effective config with every default filled in; parsing that JSON again
// gives an equal Config.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "runtime/base/status.h"

namespace strata {

enum class OffloadDevice { kNone, kCpu, kNvme };
enum class EvictionPolicy { kNextUse, kLru };
enum class ChecksumKind { kNone, kCrc32c };
enum class StateDtype { kFp32, kBf16, kInt8 };
// strata.placement (runtime/state/placement_plan.h): the sections' tiers as written, or filled
// under the measured budgets.
enum class PlacementMode { kConfig, kAuto };

struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::vector<std::string> nvme_path;  // one or more directories; several are striped
  int64_t buffer_count = 5;
  int64_t buffer_size = 100000000;     // elements
  // Elements of this rank's working shards kept in host memory under device nvme; the rest go to
  // NVMe. -1: absent, every shard on NVMe (DeepSpeed's default of 1e9 would keep every shard of a
  // model below a billion elements in host memory, which is not what device nvme asks for).
  int64_t max_in_cpu = -1;
  bool pin_memory = true;
};

struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::vector<std::string> nvme_path;
  int64_t buffer_count = 4;
  bool pin_memory = true;
  bool pipeline_read = false;
  bool pipeline_write = false;
  double ratio = 1.0;  // fraction of optimizer states offloaded; the rest stay on the device
};

struct ZeroConfig {
  int stage = 0;
  bool contiguous_gradients = true;
  bool overlap_comm = true;  // DeepSpeed turns it on for stage 3; honoured for all stages here
  int64_t reduce_bucket_size = 500000000;      // elements
  int64_t allgather_bucket_size = 500000000;   // elements
  int64_t sub_group_size = 1000000000;         // elements
  int64_t stage3_prefetch_bucket_size = 50000000;       // elements
  int64_t stage3_param_persistence_threshold = 100000;  // elements
  int64_t stage3_max_live_parameters = 1000000000;      // elements
  int64_t stage3_max_reuse_distance = 1000000000;       // elements
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;

  // The directories the NVMe tier stripes over: the optimizer section's paths when it offloads
  // to nvme, then the parameter section's likewise, each directory once (a trailing '/' aside);
  // none when neither offloads to nvme with a path. DeepSpeed swaps parameters under
  // offload_param's path and optimizer states under offload_optimizer's; Strata's one tier
  // stripes every block over all of them, so two disks named there both serve all the state.
  // The engine (unless EngineOptions::nvme_path overrides them), the estimator, and the staging
  // directory of strata-train's and Python's zero.Init (the first of them) all take these.
  std::vector<std::string> NvmeTierPaths() const;
};

// Drives the NVMe engine (tiers/nvme). Effects are documented in tiers/nvme/uring_engine.h.
struct AioConfig {
  int64_t block_size = 1048576;     // bytes per request; larger transfers are split
  int64_t queue_depth = 8;          // requests in flight per ring
  int64_t intra_op_parallelism = 1; // rings (and completion threads) per direction
  bool single_submit = false;       // submit each request alone instead of in batches
  bool overlap_events = true;       // keep the ring full while completions are reaped
  bool use_gds = false;             // GPUDirect Storage: accepted, not supported (warns)
};

enum class OptimizerType { kAdam, kAdamW, kSGD, kAdagrad, kLion };

// "Adam", "AdamW", "SGD", "Adagrad", "Lion".
const char* OptimizerTypeName(OptimizerType type);

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool bias_correction = true;
  // SGD (torch.optim.SGD's): the momentum buffer lives in the exp_avg state.
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  // Adagrad (torch.optim.Adagrad's): the sum of squared gradients lives in exp_avg_sq; lr_decay
  // is one value for every group. Lion: its momentum lives in exp_avg (betas as Adam's).
  double lr_decay = 0.0;
};

enum class SchedulerType { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kOneCycle, kLRRangeTest };
enum class WarmupType { kLog, kLinear };

struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;
  WarmupType warmup_type = WarmupType::kLog;  // DeepSpeed's default: lr rises with log(step)
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;
  int64_t warmup_num_steps = 1000;
  int64_t total_num_steps = 10000;  // WarmupDecayLR / WarmupCosineLR
  // WarmupCosineLR (DeepSpeed's): ratios of the optimizer's lr, from warmup_min_ratio up to 1
  // over the warmup, then down a cosine to cos_min_ratio at total_num_steps.
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 1e-4;
  // OneCycle (DeepSpeed's names and defaults; cycle_min_lr and cycle_max_lr are required). A
  // second step size or stair count of -1 takes the first's.
  double cycle_min_lr = 0.0;
  double cycle_max_lr = 0.0;
  double decay_lr_rate = 0.0;
  int64_t cycle_first_step_size = 2000;
  int64_t cycle_second_step_size = -1;
  int64_t cycle_first_stair_count = 0;
  int64_t cycle_second_stair_count = -1;
  int64_t decay_step_size = 0;
  bool cycle_momentum = true;  // cycles beta1 inversely to the lr (optimizers with betas only)
  double cycle_min_mom = 0.8;
  double cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
  // LRRangeTest.
  double lr_range_test_min_lr = 1e-3;
  int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
};

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;  // 0 selects dynamic loss scaling
  int64_t initial_scale_power = 16;
  int64_t loss_scale_window = 1000;
  int64_t hysteresis = 2;
  double min_loss_scale = 1.0;  // 0: no floor (DeepSpeed's reading)
};

struct Bf16Config {
  bool enabled = false;
  // DeepSpeed's compact layouts: the master weights are the bf16 working copy (no fp32 master),
  // and the moments are bf16. Strata rounds the bf16 master stochastically unless
  // strata.stochastic_rounding is false (DeepSpeed's nearest rounding).
  bool bf16_master_weights_and_grads = false;
  bool bf16_optimizer_states = false;
};

// DeepSpeed's activation_checkpointing section, with its keys and defaults. Parsed and validated;
// the engine acts on cpu_checkpointing (CheckpointUnit stashes its inputs on the host); the other
// switches have no effect and warn once (config.cc says why).
struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  int64_t number_checkpoints = 0;  // 0: not set (DeepSpeed's null)
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
};

// What "auto" values are resolved from (Config::ResolveAuto). Zero / false means "not given":
// the value then comes from Strata's default, as listed beside each field.
struct AutoContext {
  int world_size = 1;
  int64_t micro_batch = 0;   // train_micro_batch_size_per_gpu (default 1)
  int64_t accumulation = 0;  // gradient_accumulation_steps (default 1)
  double lr = 0;             // optimizer.params.lr and scheduler warmup_max_lr (default 1e-3)
  double weight_decay = -1;  // optimizer.params.weight_decay (default 0); < 0: not given
  double clipping = -1;      // gradient_clipping (default 1.0, Hugging Face's max_grad_norm); < 0: not given
  int64_t total_steps = 0;   // scheduler total_num_steps (default 10000)
  int64_t warmup_steps = -1; // scheduler warmup_num_steps (default 0); < 0: not given
  int64_t hidden_size = 0;   // the model's hidden size, for bucket sizes; 0: keep Strata's defaults
  bool native_bf16 = false;  // the device computes bf16 at full speed (bf16.enabled "auto" -> true)
  bool fp16 = false;         // fp16.enabled "auto" -> this (default off)
};

// Strata's own settings.
struct StrataConfig {
  uint64_t device_memory_budget = 0;  // bytes; 0: the whole device (CPU device: 4 GiB)
  uint64_t host_memory_budget = 0;    // bytes; 0: half of physical memory
  uint64_t nvme_capacity = 0;         // bytes per rank; 0: what the filesystem has free
  uint64_t chunk_size = 64ull << 20;  // bytes per chunk before sharding
  PlacementMode placement = PlacementMode::kConfig;
  // placement auto: device memory kept for compute (gathered chunks, gradient buffers,
  // activations); 0: a quarter of the device, at least eight of the largest chunks.
  // strata-estimate --largest sets it from its replay of the step.
  uint64_t device_reserve = 0;
  EvictionPolicy eviction = EvictionPolicy::kNextUse;
  bool overlap_optimizer = true;      // run CPU Adam per chunk during backward
  ChecksumKind checksums = ChecksumKind::kCrc32c;
  int64_t prefetch_lookahead = 4;     // blocks issued ahead of use from the trace
  // exp_avg / exp_avg_sq: fp32, bf16, or int8 (8-bit blockwise, optim/compact_formats.h).
  StateDtype optimizer_state_dtype = StateDtype::kFp32;
  // With bf16.bf16_master_weights_and_grads: round the bf16 master's updates stochastically
  // (Note [stochastic rounding] in optim/compact_formats.h); false rounds to nearest.
  bool stochastic_rounding = true;
  int64_t optimizer_threads = 0;      // 0: all cores
  // Host pool address colouring (PinnedPoolOptions::colour_step): each MiB of the pool is shifted
  // by one more step, so an optimizer call's buffers never share a large power-of-two alignment.
  // 0 turns it off (only to measure what it buys).
  uint64_t host_pool_colour_step = 4096;
  std::string comm_backend = "auto";  // auto | single | gloo | nccl
  double comm_timeout_s = 300;
  std::string device = "auto";  // auto | cpu | cuda | cuda:N

  // Whether `device` names a GPU ("cuda" or "cuda:N"), and which: N, or -1 for "cuda" (the
  // launcher's LOCAL_RANK, else GPU 0) and for the others.
  bool NamesCuda() const { return device == "cuda" || device.rfind("cuda:", 0) == 0; }
  int CudaIndex() const;
};

// The model strata-train builds (a decoder-only GPT with byte-level tokens by default).
struct ModelConfig {
  int64_t n_layers = 4;
  int64_t d_model = 128;
  int64_t n_heads = 4;
  int64_t seq_len = 128;
  int64_t vocab_size = 256;
  double dropout = 0.0;
  // Activation checkpointing of every transformer block (strata::CheckpointUnit): only each
  // block's input is kept from forward to backward, which recomputes the block.
  bool checkpoint_activations = false;
  uint64_t seed = 1234;
};

struct Config {
  int64_t train_batch_size = 0;  // 0: micro × accumulation × world size
  int64_t train_micro_batch_size_per_gpu = 1;
  int64_t gradient_accumulation_steps = 1;
  double gradient_clipping = 0.0;  // 0 disables clipping
  int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  // DeepSpeed's: a torch optimizer outside Strata's own set runs itself, on the device, over
  // this rank's master shards (stages 0-2, nothing offloaded). The Python front end acts on it
  // (EngineOptions::client_optimizer); strata-train has no such optimizer.
  bool zero_allow_untested_optimizer = false;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  Fp16Config fp16;
  Bf16Config bf16;
  ActivationCheckpointingConfig activation_checkpointing;
  ZeroConfig zero_optimization;
  AioConfig aio;
  StrataConfig strata;
  ModelConfig model;

  // Which of the three batch keys the file set to a number ("auto" and absent are not set);
  // ResolveAuto derives the others as DeepSpeed does.
  bool train_batch_size_given = false;
  bool micro_batch_given = false;
  bool accumulation_given = false;

  std::vector<std::string> warnings;  // deprecations met while parsing, in order
  // Keys given as "auto" (dotted paths, e.g. "optimizer.params.lr"), in file order. Their fields
  // hold Strata's defaults until ResolveAuto fills them from the run.
  std::vector<std::string> auto_keys;
  // After ResolveAuto: one "key = value (from ...)" line per auto key, for --print-config.
  std::vector<std::string> auto_resolved;

  // Parses and validates. `source` names the input in messages (a path or "<string>").
  static StatusOr<Config> FromJsonText(const std::string& text, const std::string& source = "<string>");
  static StatusOr<Config> FromFile(const std::string& path);

  // Fills every "auto" key from `ctx` (Hugging Face's rules: batch sizes from the run, the
  // optimizer's and scheduler's values from the command line, bucket sizes from the hidden size,
  // bf16 from the device's capability), then checks the batch sizes against the world size.
  // Idempotent; a config without "auto" keys only gets the batch check.
  Status ResolveAuto(const AutoContext& ctx);
  // train_batch_size must equal micro × accumulation × world (0 means "compute it").
  Status CheckBatchSizes(int world_size) const;

  // The effective config, every default filled in.
  nlohmann::json ToJson() const;
  std::string ToJsonString(int indent = 2) const;
};

bool operator==(const Config& a, const Config& b);

}  // namespace strata
