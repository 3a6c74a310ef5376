// strata-train: trains a decoder-only GPT on real text across device memory, host DRAM and NVMe.
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runtime/base/config.h"
#include "runtime/base/device.h"
#include "runtime/base/env_vars.h"
#include "runtime/base/host_info.h"
#include "runtime/base/logging.h"
#include "runtime/base/units.h"
#include "runtime/comm/backends.h"
#include "runtime/engine/comm_memory.h"
#include "runtime/engine/compute_dtype.h"
#include "runtime/engine/engine.h"
#include "runtime/engine/zero_init.h"
#include "runtime/state/checkpoint.h"
#include "runtime/state/step_plan.h"
#include "tiers/hbm/device_factory.h"
#include "tools/planner/memory_model.h"
#include "tools/planner/model_spec.h"
#include "tools/planner/output_paths.h"
#include "tools/train/embedded_config.h"
#include "tools/train/gpt.h"
#include "tools/train/plot.h"
#include "tools/train/text_data.h"

namespace strata::train {

// "--steps -3: must be a whole number >= 1" instead of CLI11's range text.
CLI::Validator WholeAtLeast(int64_t lo) {
  return CLI::Validator(
      [lo](std::string& text) -> std::string {
        char* end = nullptr;
        errno = 0;
        long long v = std::strtoll(text.c_str(), &end, 10);
        if (text.empty() || *end != '\0' || errno == ERANGE || v < lo)
          return StrCat("'", text, "' must be a whole number >= ", lo);
        return "";
      },
      StrCat("INT>=", lo));
}

namespace {

// Once training has begun, the first SIGINT or SIGTERM stops the run after its current step,
// which then saves as at the end (--save); a second one ends the process at once, as the
// signal's default does (a user pressing Ctrl-C twice means it). Before that, during the start,
// there is nothing to save, and the start may be blocked for minutes (a peer rank that never
// comes, a FIFO given as --data with no writer): the first signal ends the process at once, so
// `timeout` and other supervisors that send one SIGTERM are obeyed. Checkpoints are written to a
// temporary name and renamed, so an end mid-save leaves the last whole one. Several ranks agree
// on the stop after each step (Loop), so a signal that reaches them at different steps stops
// them all after the same one.
std::atomic<bool> g_stop{false};
std::atomic<bool> g_training{false};
void OnSignal(int sig) {
  if (!g_training.load() || g_stop.exchange(true)) {
    if (!g_training.load()) {
      static const char kMsg[] =
          "strata-train: interrupted during the start; nothing trained or saved\n";
      (void)!write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
    }
    signal(sig, SIG_DFL);  // all three async-signal-safe
    raise(sig);
  }
}

constexpr int kExitUsage = 2;
constexpr int kMaxThreads = 1024;  // as strata-swapbench's --threads

// A parameter count for the log: "51.0 M" below a billion, "2.13 B" from there (%g printed a
// 2.1B model as "2.13e+03 M").
std::string FormatParams(double n) {
  char buf[32];
  if (n < 1e9) std::snprintf(buf, sizeof(buf), "%.1f M", n / 1e6);
  else std::snprintf(buf, sizeof(buf), "%.2f B", n / 1e9);
  return buf;
}

// A line every 10 s while a large model is built (minutes, before the engine logs anything):
// under zero::Init the share of the model built so far, else the time it has taken.
class BuildProgress {
 public:
  BuildProgress(const zero::Init* init, uint64_t total_bytes, bool enabled)
      : t0_(std::chrono::steady_clock::now()) {
    if (!enabled) return;
    thread_ = std::thread([this, init, total_bytes] {
      std::unique_lock<std::mutex> l(mu_);
      while (!cv_.wait_for(l, std::chrono::seconds(10), [this] { return done_; })) {
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
        if (init != nullptr && init->mode() == zero::StageMode::kValues && total_bytes > 0) {
          // Generated parameters are built too: only their draw waits for the engine.
          const uint64_t staged = init->staged_bytes() + init->generated_bytes();
          std::fprintf(stderr, "strata-train: building the model: %s of %s built (%.0f%%), %.0f s\n",
                       FormatBytes(staged).c_str(), FormatBytes(total_bytes).c_str(),
                       100.0 * static_cast<double>(staged) / static_cast<double>(total_bytes), secs);
        } else {
          std::fprintf(stderr, "strata-train: building the model: %.0f s\n", secs);
        }
      }
    });
  }
  ~BuildProgress() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> l(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  BuildProgress(const BuildProgress&) = delete;
  BuildProgress& operator=(const BuildProgress&) = delete;

 private:
  const std::chrono::steady_clock::time_point t0_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};



struct Flags {
  std::string config;
  int64_t steps = 0;
  std::string data = kDefaultData;
  std::string nvme_path;
  std::string save;
  int64_t save_every = 0;
  std::string resume;
  bool json = false;
  int64_t eval_every = 50;
  int64_t eval_batches = 8;
  int64_t log_every = 0;
  std::string plot = "strata-train.svg";
  bool print_config = false;
  std::string device;
  int threads = 0;
  std::string trace;        // Chrome trace-event JSON of the lanes
  int64_t trace_steps = 3;
  int64_t micro_batch = 0;  // fills train_micro_batch_size_per_gpu = "auto"
  double lr = 0;            // fills optimizer.params.lr = "auto"
};

// What the config's "auto" values are resolved from (Note [auto values] in runtime/base/config.cc):
// this run's flags, its world size (torchrun's WORLD_SIZE), the model and the device.
AutoContext MakeAutoContext(const Flags& f, const Config& c, int world_size) {
  AutoContext ctx;
  ctx.world_size = world_size;
  ctx.micro_batch = f.micro_batch;
  ctx.lr = f.lr;
  ctx.total_steps = f.steps;
  ctx.hidden_size = c.model.d_model;
  const std::string dev = f.device.empty() ? c.strata.device : f.device;
  const bool cuda = dev.rfind("cuda", 0) == 0 || (dev == "auto" && CudaDeviceCount() > 0);
  ctx.native_bf16 = DeviceHasNativeBf16(cuda ? DeviceKind::kCuda : DeviceKind::kCpu);
  return ctx;
}

uint64_t PeakRssBytes() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<uint64_t>(ru.ru_maxrss) * 1024;
}

std::string Duration(double s) {
  char b[32];
  if (s < 60) std::snprintf(b, sizeof b, "%.0fs", s);
  else if (s < 3600) std::snprintf(b, sizeof b, "%dm%02ds", int(s) / 60, int(s) % 60);
  else std::snprintf(b, sizeof b, "%dh%02dm", int(s) / 3600, (int(s) % 3600) / 60);
  return b;
}

torch::Tensor ToTensor(const std::vector<int64_t>& tokens, int64_t batch, int64_t window) {
  return torch::from_blob(const_cast<int64_t*>(tokens.data()), {batch, window}, torch::kLong).clone();
}

class Trainer {
 public:
  Trainer(Flags flags, Config config) : f_(std::move(flags)), c_(std::move(config)) {}

  int Run() {
    Status s = Setup();
    if (!s.ok()) return Fail(s);
    g_training.store(true);
    s = Loop();
    if (!s.ok()) return Fail(s);
    return interrupted_ ? 130 : 0;
  }

 private:
  int Fail(const Status& s) {
    std::fprintf(stderr, "strata-train: %s\n", s.ToString().c_str());
    return s.code() == StatusCode::kInvalidArgument || s.code() == StatusCode::kNotFound ? kExitUsage : 1;
  }
  bool leader() const { return comm_->rank() == 0; }

  // A --resume that cannot load is refused before the model is built and the engine started
  // (minutes for a large model): the checkpoint's manifest must parse, hold a model of this
  // config's size (its layout section) and of its model section (as the checkpoint recorded it),
  // and come from the same data seed. The engine's load checks the rest.
  Status CheckResumable() const {
    if (f_.resume.empty()) return Status::Ok();
    namespace fs = std::filesystem;
    STRATA_ASSIGN_OR_RETURN(std::string dir, checkpoint::ResolveCheckpointDir(f_.resume));
    STRATA_ASSIGN_OR_RETURN(const std::string stem, checkpoint::LoadingStem(dir, comm_->rank()));
    const std::string path = (fs::path(dir) / (stem + ".json")).string();
    STRATA_ASSIGN_OR_RETURN(std::string text, checkpoint::ReadFile(path));
    STRATA_ASSIGN_OR_RETURN(checkpoint::Manifest m, checkpoint::ParseManifest(text, path));
    if (m.extra.is_object() && m.extra.contains("seed") && m.extra["seed"] != c_.model.seed)
      return InvalidArgument(
          StrCat("--resume ", f_.resume, " was trained with model.seed=", m.extra["seed"].dump(),
                 "; this config has ", c_.model.seed, ": the data order would differ"));
    if (m.layout.is_object() && m.layout.contains("params") && m.layout["params"].is_array()) {
      // In double: the shapes are the file's, and a product of them may not fit an int64.
      double saved = 0;
      for (const auto& p : m.layout["params"]) {
        double n = 1;
        if (p.is_object() && p.contains("shape") && p["shape"].is_array())
          for (const auto& d : p["shape"]) n *= d.is_number() ? d.get<double>() : 0.0;
        saved += n;
      }
      const int64_t ours = models::GptParameterCount(c_.model);
      if (saved != static_cast<double>(ours))
        // Exact counts: rounded ones print two models that differ a little (or small ones) alike.
        return InvalidArgument(StrCat(
            "--resume ", f_.resume, " holds a model of ", StrCat(static_cast<long long>(saved)),
            " parameters but this config's model (its \"model\" section) has ", ours,
            ": resume with the config it was saved with"));
    }
    if (m.extra.is_object() && m.extra.contains("model") && m.extra["model"].is_object()) {
      const nlohmann::json ours = ModelShapeJson();
      for (const auto& [key, saved] : m.extra["model"].items())
        if (ours.contains(key) && saved != ours[key])
          return InvalidArgument(StrCat("--resume ", f_.resume, " was trained with model.", key,
                                        "=", saved.dump(), "; this config has ", ours[key].dump(),
                                        ": resume with the config it was saved with"));
    }
    return Status::Ok();
  }

  // The model section's fields that make the GPT, recorded in every checkpoint: n_heads changes
  // no parameter's shape, so the layout alone would take a 2-head model's weights into a 4-head
  // one without a word.
  nlohmann::json ModelShapeJson() const {
    return {{"n_layers", c_.model.n_layers},
            {"d_model", c_.model.d_model},
            {"n_heads", c_.model.n_heads},
            {"seq_len", c_.model.seq_len},
            {"vocab_size", c_.model.vocab_size}};
  }

  // Where the run writes, checked before the model is built: a run must not train for an hour
  // and then fail to save, nor write its trace or plot over an input.
  Status CheckOutputs() {
    planner::NamedPaths inputs = {{"--config", f_.config}, {"--data", f_.data}};
    if (!f_.save.empty()) {
      STRATA_RETURN_IF_ERROR(checkpoint::CheckSaveRoot(f_.save).WithContext("--save"));
      STRATA_RETURN_IF_ERROR(planner::PrepareOutputDir("--save", f_.save, inputs));
      inputs.push_back({"--save", f_.save});
    }
    // A --data directory is read whole: every file directly in it is training text.
    for (const auto& [flag, path] :
         {std::pair{"--trace", &f_.trace}, std::pair{"--plot", &f_.plot}}) {
      std::error_code ec;
      const std::filesystem::path parent =
          std::filesystem::absolute(*path, ec).lexically_normal().parent_path();
      if (!path->empty() && std::filesystem::is_directory(f_.data, ec) &&
          std::filesystem::equivalent(parent, f_.data, ec))
        return InvalidArgument(StrCat(flag, " ", *path, " is in the --data directory ", f_.data,
                                      ", whose every file the run reads as training text; pass a "
                                      "path outside it"));
    }
    if (!f_.trace.empty()) {
      STRATA_RETURN_IF_ERROR(planner::CheckOutputFile("--trace", f_.trace, inputs));
      inputs.push_back({"--trace", f_.trace});
    }
    if (!f_.plot.empty() && leader()) {
      Status plot = planner::CheckOutputFile("--plot", f_.plot, inputs);
      // The default plot, in a working directory the run cannot write, is only left out, as its
      // failure at the end only warned; one the user named must be writable.
      if (!plot.ok() && f_.plot == Flags{}.plot && planner::InputNamedBy(f_.plot, inputs).empty()) {
        STRATA_LOG(WARN) << plot.message() << "; no plot is written (--plot FILE to choose one)";
        f_.plot.clear();
      } else {
        STRATA_RETURN_IF_ERROR(plot);
      }
    }
    return Status::Ok();
  }

  Status Setup() {
    if (c_.model.vocab_size < 256)
      return InvalidArgument(StrCat("model.vocab_size=", c_.model.vocab_size,
                                    ": strata-train uses byte tokens, so it must be at least 256"));
    if (!f_.device.empty()) c_.strata.device = f_.device;
    // LibTorch starts an OS thread per compute thread, whatever the cores: tens of thousands
    // took minutes and gigabytes before the first step.
    if (f_.threads > kMaxThreads)
      return InvalidArgument(StrCat("--threads ", f_.threads, " is more than ", kMaxThreads,
                                    "; this machine has ", std::thread::hardware_concurrency(),
                                    " logical CPUs (0 leaves the choice to LibTorch)"));
    if (f_.threads > 0) torch::set_num_threads(f_.threads);
    CommOptions co;
    co.backend = c_.strata.comm_backend;
    co.device = c_.strata.NamesCuda() || (c_.strata.device == "auto" && CudaDeviceCount() > 0)
                    ? "cuda"
                    : "cpu";
    co.cuda_device = c_.strata.CudaIndex();  // cuda:N: NCCL on that GPU, not LOCAL_RANK's
    co.timeout_s = c_.strata.comm_timeout_s;
    co.buckets = BucketSizes::FromConfig(c_.zero_optimization.allgather_bucket_size,
                                         c_.zero_optimization.reduce_bucket_size);
    STRATA_ASSIGN_OR_RETURN(comm_, CreateCommunicator(co));
    STRATA_RETURN_IF_ERROR(c_.ResolveAuto(MakeAutoContext(f_, c_, comm_->world_size())));
    if (leader() && !f_.json) {
      for (const std::string& line : c_.auto_resolved) std::fprintf(stderr, "config: %s\n", line.c_str());
      // The two flags fill "auto" values only (their --help says so); one the config's own value
      // overrode is named, not dropped without a word.
      if (f_.micro_batch > 0 && c_.train_micro_batch_size_per_gpu != f_.micro_batch)
        std::fprintf(stderr,
                     "strata-train: --micro-batch %lld not used: the config sets "
                     "train_micro_batch_size_per_gpu "
                     "to %lld (the flag fills \"auto\" only)\n",
                     (long long)f_.micro_batch, (long long)c_.train_micro_batch_size_per_gpu);
      if (f_.lr > 0 && c_.optimizer.lr != f_.lr)
        std::fprintf(
            stderr,
            "strata-train: --lr %g not used: the config sets optimizer.params.lr to %g (the flag "
            "fills \"auto\" only)\n",
            f_.lr, c_.optimizer.lr);
    }
    STRATA_ASSIGN_OR_RETURN(device_, CreateDevice(c_.strata.device, c_.strata.device_memory_budget));
    // What the engine would refuse only after the model is built (and, under NVMe, staged).
    STRATA_RETURN_IF_ERROR(
        StepPlan::CheckPrecisionOnDevice(c_, device_->kind(), /*fp16_ops_in_fp32=*/false));
    STRATA_RETURN_IF_ERROR(CheckResumable());
    STRATA_RETURN_IF_ERROR(CheckOutputs());
    STRATA_ASSIGN_OR_RETURN(data_, LoadText(f_.data, c_.model.seq_len));
    if (leader() && !f_.json && !data_.skipped.empty()) {
      // Left out without a word, a corpus could be a fraction of what the user meant.
      std::string names;
      for (size_t i = 0; i < data_.skipped.size() && i < 5; ++i)
        names += (i ? ", " : "") + data_.skipped[i];
      if (data_.skipped.size() > 5) names += StrCat(" and ", data_.skipped.size() - 5, " more");
      std::fprintf(
          stderr,
          "strata-train: --data %s: %zu entries left out (symbolic links, folders and fortune's "
          "*.dat indexes are not read): %s\n",
          f_.data.c_str(), data_.skipped.size(), names.c_str());
    }
    EngineOptions eo;
    if (!f_.nvme_path.empty()) eo.nvme_path = {f_.nvme_path};
    const int64_t params = models::GptParameterCount(c_.model);
    if (leader() && !f_.json)
      std::fprintf(stderr,
                   "strata-train: GPT %lld layers, d_model %lld, %lld heads, seq %lld: %s params "
                   "on %s, %zu rank(s); data %s (%s train, %s held out)\n",
                   (long long)c_.model.n_layers, (long long)c_.model.d_model,
                   (long long)c_.model.n_heads, (long long)c_.model.seq_len,
                   FormatParams(static_cast<double>(params)).c_str(),
                   device_->name().c_str(), (size_t)comm_->world_size(), f_.data.c_str(),
                   FormatBytes(data_.train.size()).c_str(),
                   FormatBytes(data_.validation.size()).c_str());
    // A step time means little without its machine (figures are compared across sessions).
    host_ = HostDescription(NvmeDirForHost());
    if (leader() && !f_.json) std::fprintf(stderr, "strata-train: on %s\n", host_.c_str());
    STRATA_RETURN_IF_ERROR(ReserveForCompute());
    STRATA_RETURN_IF_ERROR(CheckActivationsFit());
    STRATA_RETURN_IF_ERROR(CheckModelBuildFits());
    {
      // Stage 3 with NVMe offload: build the model under zero::Init, unit by unit into a staging
      // file on the NVMe directory, so the whole fp32 model never sits in DRAM; its large
      // matrices are registered with their draw instead (MakeLinear in gpt.cc).
      std::unique_ptr<zero::Init> init;
      const std::string nvme_dir = NvmeDirForHost();
      if (BuildsUnderZeroInit()) {
        // A bf16 master is the bf16 working copy the engine rounds to nearest at start: staging
        // in bf16 gives it the same bits from half the disk (zero_init.h). Only rank 0 keeps
        // values: Engine::Create broadcasts its chunks to the others, which build shapes only,
        // so ranks sharing a disk stage the model once.
        STRATA_ASSIGN_OR_RETURN(
            init, zero::Init::Create(nvme_dir,
                                     c_.bf16.enabled && c_.bf16.bf16_master_weights_and_grads
                                         ? torch::kBFloat16
                                         : torch::kFloat32,
                                     comm_->rank() == 0 ? zero::StageMode::kValues
                                                        : zero::StageMode::kShapesOnly));
      }
      models::Gpt model{nullptr};
      try {
        const uint64_t staged_esize = init && init->mode() == zero::StageMode::kValues
                                          ? (c_.bf16.enabled && c_.bf16.bf16_master_weights_and_grads ? 2 : 4)
                                          : 0;
        BuildProgress progress(init.get(), static_cast<uint64_t>(models::GptParameterCount(c_.model)) * staged_esize,
                               leader() && !f_.json);
        model = models::BuildGpt(c_.model);
      } catch (const std::exception& e) {
        return Internal(StrCat("building the model: ", e.what()));
      }
      if (init && leader() && !f_.json)
        std::fprintf(stderr,
                     "strata-train: zero::Init staged %lld parameters (%s) in %s; %lld more (%s) are "
                     "drawn as the engine reads them\n",
                     (long long)init->staged_params(), FormatBytes(init->staged_bytes()).c_str(),
                     nvme_dir.c_str(), (long long)init->generated_params(),
                     FormatBytes(init->generated_bytes()).c_str());
      STRATA_ASSIGN_OR_RETURN(engine_, Engine::Create(model, c_, comm_.get(), device_.get(), eo));
      if (!reserve_note_.empty()) std::fputs(reserve_note_.c_str(), stderr);
    }
    if (!f_.resume.empty()) {
      STRATA_RETURN_IF_ERROR(
          engine_->LoadCheckpoint(f_.resume).status());  // CheckResumable read it
      if (leader() && !f_.json)
        std::fprintf(stderr, "strata-train: resumed from %s at step %lld\n", f_.resume.c_str(),
                     (long long)engine_->global_step());
    }
    return Status::Ok();
  }

  StatusOr<double> Validate() {
    torch::NoGradGuard ng;
    const int64_t B = c_.train_micro_batch_size_per_gpu, T = c_.model.seq_len;
    double sum = 0;
    std::vector<int64_t> tokens;
    for (int64_t i = 0; i < f_.eval_batches; ++i) {
      SampleBatch(data_.validation, B, T, c_.model.seed ^ 0x5eed, i, 0, comm_->rank(), &tokens);
      torch::Tensor b = ToTensor(tokens, B, T + 1).to(TorchDevice(*device_));
      torch::Tensor logits;
      try {
        logits = engine_->Forward(b.narrow(1, 0, T));
      } catch (const std::exception& e) {
        return Internal(StrCat("validation forward failed: ", e.what()));
      }
      sum += models::LanguageModelLoss(logits, b.narrow(1, 1, T)).item<double>();
    }
    double loss = sum / f_.eval_batches;
    return AllReduceScalar(loss, ReduceOp::kAvg);
  }

  Status Save() {
    // A periodic save of the step the run ends on (or is interrupted after) is not written twice.
    if (f_.save.empty() || saved_step_ == engine_->global_step()) return Status::Ok();
    auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(
        engine_->SaveCheckpoint(f_.save, {{"seed", c_.model.seed}, {"model", ModelShapeJson()}}));
    if (leader() && !f_.json)
      std::fprintf(stderr, "strata-train: checkpoint step %lld saved to %s in %.1f s\n",
                   (long long)engine_->global_step(), f_.save.c_str(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    saved_step_ = engine_->global_step();
    return Status::Ok();
  }

  // Whether to stop after this step: a signal on any rank stops every rank after the same step
  // (a rank that stopped alone would wait in the save's barrier while the others wait in the
  // next step's collectives).
  StatusOr<bool> AgreeToStop() {
    STRATA_ASSIGN_OR_RETURN(double stop,
                            AllReduceScalar(g_stop.load() ? 1.0 : 0.0, ReduceOp::kMax));
    return stop > 0;
  }

  // One double over the ranks, through the memory the communicator takes (NCCL: the device's;
  // a host address there was wrong).
  StatusOr<double> AllReduceScalar(double v, ReduceOp op) {
    STRATA_RETURN_IF_ERROR(AllReduceScalars(*comm_, *device_, &v, 1, op));
    return v;
  }

  void Progress(int64_t done, int64_t total, double elapsed, double loss) {
    if (!leader() || f_.json || !isatty(STDERR_FILENO)) return;
    const int width = 30;
    int filled = total > 0 ? static_cast<int>(width * done / total) : width;
    double eta = done > 0 ? elapsed / done * (total - done) : 0;
    std::string bar(filled, '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "\r[%s] %lld/%lld loss %.4f ETA %s   ", bar.c_str(), (long long)done,
                 (long long)total, loss, Duration(eta).c_str());
    if (done == total) std::fputc('\n', stderr);
    std::fflush(stderr);
  }

  // What Loop gathers over the run for its summary.
  struct RunTotals {
    Series loss{"train loss", "#1f77b4", {}, {}}, val{"validation loss", "#d62728", {}, {}},
        tps{"tokens/s", "#2ca02c", {}, {}};
    double first_loss = NAN, last_loss = NAN, last_val = NAN, time_sum = 0, overlap_sum = 0;
    int64_t measured = 0, overlap_measured = 0;
    uint64_t tokens_total = 0;
  };

  Status Loop() {
    const int64_t accum = c_.gradient_accumulation_steps;
    const int64_t first = engine_->global_step();
    const int64_t last = f_.steps;
    if (last <= first && leader())
      std::fprintf(stderr, "strata-train: already at step %lld of --steps %lld; nothing to do\n",
                   (long long)first, (long long)last);
    const int64_t log_every = f_.log_every > 0 ? f_.log_every : c_.steps_per_print;
    RunTotals t;
    const auto t_start = std::chrono::steady_clock::now();
    // Traced: the steps after the first, which includes warm-up work.
    const int64_t trace_from = first + 1, trace_to = first + 1 + f_.trace_steps;
    bool stop = false;
    for (int64_t step = first; step < last && !stop; ++step) {
      if (!f_.trace.empty() && step == trace_from) engine_->SetTracing(true);
      STRATA_ASSIGN_OR_RETURN(double loss, MicroSteps(step));
      StatusOr<StepReport> stepped = engine_->Step();
      if (!stepped.ok()) return stepped.status().WithContext(StrCat("optimizer step ", step + 1));
      StepReport rep = std::move(stepped).value();
      if (!f_.trace.empty() && (step + 1 == trace_to || (step + 1 == last && step >= trace_from)))
        STRATA_RETURN_IF_ERROR(WriteTrace());
      STRATA_ASSIGN_OR_RETURN(loss, AllReduceScalar(loss, ReduceOp::kAvg));
      if (!std::isfinite(loss))
        return Internal(StrCat("the loss is ", loss, " at step ", step + 1,
                               "; lower optimizer.params.lr or enable gradient_clipping"));
      const uint64_t step_tokens = static_cast<uint64_t>(
          c_.train_micro_batch_size_per_gpu * c_.model.seq_len * accum * comm_->world_size());
      const double tps = step_tokens / std::max(rep.step_time_s, 1e-9);
      t.tokens_total += step_tokens;
      if (std::isnan(t.first_loss)) t.first_loss = loss;
      t.last_loss = loss;
      if (step > first) {  // the first step includes warm-up work
        t.time_sum += rep.step_time_s;
        if (!std::isnan(rep.overlap)) {
          t.overlap_sum += rep.overlap;
          ++t.overlap_measured;
        }
        ++t.measured;
      }
      t.loss.x.push_back(step + 1);
      t.loss.y.push_back(loss);
      t.tps.x.push_back(step + 1);
      t.tps.y.push_back(tps);
      bool eval = f_.eval_batches > 0 && f_.eval_every > 0 &&
                  ((step + 1) % f_.eval_every == 0 || step + 1 == last);
      double val = NAN;
      if (eval) {
        STRATA_ASSIGN_OR_RETURN(val, Validate());
        t.last_val = val;
        t.val.x.push_back(step + 1);
        t.val.y.push_back(val);
      }
      if (leader() && (f_.json || (step + 1) % log_every == 0 || step == first ||
                       step + 1 == last || eval))
        LogStep(step, last, rep, loss, tps, val);
      Progress(step + 1 - first, last - first,
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(),
               loss);
      if (f_.save_every > 0 && (step + 1) % f_.save_every == 0 && step + 1 != last)
        STRATA_RETURN_IF_ERROR(Save());
      STRATA_ASSIGN_OR_RETURN(stop, AgreeToStop());
      interrupted_ = stop;
    }
    if (!f_.trace.empty() && !trace_written_) {
      // Interrupted while tracing: what was recorded. A run that never passed its first step
      // (the trace leaves it out: it holds warm-up work) records nothing, and says so.
      if (engine_->global_step() > first + 1) {
        STRATA_RETURN_IF_ERROR(WriteTrace());
      } else if (leader()) {
        std::fprintf(stderr,
                     "strata-train: --trace %s not written: a trace records the steps after the "
                     "run's first, and this run took %lld step(s)\n",
                     f_.trace.c_str(), (long long)(engine_->global_step() - first));
      }
    }
    STRATA_RETURN_IF_ERROR(Save());
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    if (leader()) Summarize(t, wall);
    return Status::Ok();
  }

  // One step's micro-batches through forward and backward; their mean loss on this rank.
  StatusOr<double> MicroSteps(int64_t step) {
    const int64_t B = c_.train_micro_batch_size_per_gpu, T = c_.model.seq_len;
    const int64_t accum = c_.gradient_accumulation_steps;
    double loss_sum = 0;
    std::vector<int64_t> tokens;
    for (int64_t m = 0; m < accum; ++m) {
      SampleBatch(data_.train, B, T, c_.model.seed, step, m, comm_->rank(), &tokens);
      torch::Tensor b = ToTensor(tokens, B, T + 1).to(TorchDevice(*device_));
      torch::Tensor loss;
      try {
        loss = models::LanguageModelLoss(engine_->Forward(b.narrow(1, 0, T)), b.narrow(1, 1, T));
      } catch (const std::exception& e) {
        return Internal(StrCat("forward of step ", step + 1, " failed: ", e.what()));
      }
      if (Status s = engine_->Backward(loss); !s.ok())
        return s.WithContext(StrCat("backward of step ", step + 1));
      loss_sum += loss.item<double>() / accum;
    }
    return loss_sum;
  }

  // The step's line: JSON with --json, else the human-readable one (val: NAN without one).
  void LogStep(int64_t step, int64_t last, const StepReport& rep, double loss, double tps,
               double val) {
    const bool eval = !std::isnan(val);
    if (f_.json) {
      nlohmann::json j = rep.ToJson();
      j["step"] = step + 1;
      j["loss"] = loss;
      j["tokens_per_s"] = tps;
      if (eval) j["val_loss"] = val;
      std::cout << j.dump() << std::endl;
      return;
    }
    if (isatty(STDERR_FILENO)) std::fputc('\r', stderr);
    std::fprintf(stderr,
                 "step %5lld/%lld | loss %.4f%s | %8.0f tok/s | step %.3f s | compute %.3f "
                 "copy %.3f comm %.3f nvme %.3f optim %.3f s | lanes %.3f s, overlap %.2f, "
                 "compute idle %.0f%% | nvme->host %s host->nvme %s\n",
                 (long long)(step + 1), (long long)last, loss,
                 eval ? StrCat(" (val ", std::to_string(val).substr(0, 6), ")").c_str() : "",
                 tps, rep.step_time_s, rep.compute_s, rep.copy_s, rep.comm_s, rep.nvme_s,
                 rep.optimizer_s, rep.lane_sum_s, rep.overlap,
                 100 * rep.compute_idle_share,
                 FormatBytes(rep.bytes_nvme_to_host).c_str(),
                 FormatBytes(rep.bytes_host_to_nvme).c_str());
  }

  // The run's summary (JSON with --json) and its plot (--plot).
  void Summarize(const RunTotals& t, double wall) {
    nlohmann::json summary = {
        {"summary", true},
        {"steps", engine_->global_step()},
        {"steps_run", static_cast<int64_t>(t.loss.x.size())},
        {"first_loss", t.first_loss},
        {"final_loss", t.last_loss},
        {"val_loss", t.last_val},
        {"parameters", engine_->num_parameters()},
        {"model_state_bytes", engine_->model_state_bytes()},
        {"mean_step_time_s", t.measured ? t.time_sum / t.measured : NAN},
        {"mean_overlap", t.overlap_measured ? t.overlap_sum / t.overlap_measured : NAN},
        {"tokens_per_s", wall > 0 ? t.tokens_total / wall : 0},
        {"wall_s", wall},
        {"host", host_},
        {"peak_rss_bytes", PeakRssBytes()},
        {"interrupted", interrupted_},
        {"engine", engine_->Describe()}};
    if (!f_.plot.empty() && !t.loss.x.empty()) {
      Status ps = WriteTrainingSvg(f_.plot, "strata-train", {t.loss, t.val}, "loss", {t.tps},
                                   "tokens/s");
      if (!ps.ok()) STRATA_LOG(WARN) << ps.ToString();
      else summary["plot"] = f_.plot;
    }
    if (f_.json) {
      std::cout << summary.dump() << std::endl;
      return;
    }
    if (t.loss.x.empty()) {  // resumed at or past --steps (or stopped at once): no losses to show
      std::fprintf(stderr, "\nsummary: no steps run; at step %lld, %s params, peak RSS %s\n",
                   static_cast<long long>(engine_->global_step()),
                   FormatParams(static_cast<double>(engine_->num_parameters())).c_str(),
                   FormatBytes(PeakRssBytes()).c_str());
      return;
    }
    // The first step includes warm-up work and is not timed; a run of one step has no mean.
    char timing[96] = "no step timed after the first (warm-up)";
    if (t.measured) std::snprintf(timing, sizeof timing, "mean step %.3f s", t.time_sum / t.measured);
    char overlap[32] = "";
    if (t.overlap_measured)
      std::snprintf(overlap, sizeof overlap, ", overlap %.2f", t.overlap_sum / t.overlap_measured);
    std::fprintf(stderr,
                 "\nsummary: %lld steps, loss %.4f -> %.4f (%s), %s params, "
                 "model state %s, %s, %.0f tokens/s%s, peak RSS %s%s%s\n",
                 (long long)engine_->global_step(), t.first_loss, t.last_loss,
                 std::isnan(t.last_val) ? "no validation"
                                        : StrCat("validation ", std::to_string(t.last_val).substr(0, 6)).c_str(),
                 FormatParams(static_cast<double>(engine_->num_parameters())).c_str(),
                 FormatBytes(engine_->model_state_bytes()).c_str(),
                 timing, wall > 0 ? t.tokens_total / wall : 0.0, overlap,
                 FormatBytes(PeakRssBytes()).c_str(),
                 summary.contains("plot") ? ", plot " : "",
                 summary.contains("plot") ? f_.plot.c_str() : "");
  }

  // Ends the lane trace and writes it (rank r > 0 appends ".rank<r>" to the name). A trace that
  // cannot be written (a full disk) is a warning, as a plot's is: the run goes on to its save,
  // which a failed diagnostic must not cost.
  Status WriteTrace() {
    engine_->SetTracing(false);
    trace_written_ = true;
    std::string path = f_.trace;
    if (comm_->rank() > 0) path += StrCat(".rank", comm_->rank());
    if (Status s = checkpoint::WriteFileAtomic(path, engine_->TraceJson().dump()); !s.ok()) {
      STRATA_LOG(WARN) << "--trace " << path << " not written: " << s.message()
                       << "; training goes on";
      return Status::Ok();
    }
    if (leader()) std::fprintf(stderr, "strata-train: lane trace written to %s\n", path.c_str());
    return Status::Ok();
  }

  // strata.placement auto without strata.device_reserve: the engine alone would keep a quarter
  // of the device for compute, a rule of thumb a wide model outgrows (the allocator then refuses
  // a gather in step 2). strata-train knows its model, so it asks the estimator's replay of the
  // step (strata-estimate's) for what gathered chunks, gradient buffers and activations need,
  // under the capacities the engine will see. A replay that fails leaves the engine's default.
  Status ReserveForCompute() {
    if (c_.strata.placement != PlacementMode::kAuto || c_.strata.device_reserve != 0) return Status::Ok();
    auto spec = planner::GptModelSpec(c_.model);
    if (!spec.ok()) return Status::Ok();  // the engine reports a bad model itself
    planner::EstimateOptions eo;
    eo.world_size = comm_->world_size();
    eo.device = DeviceKindName(device_->kind());
    eo.device_capacity = device_->capacity() - std::min(device_->capacity(), device_->allocated());
    eo.host_available = ReadHostMemory().available_bytes;
    const std::string nvme = NvmeDirForHost();
    eo.assume_nvme_path = !f_.nvme_path.empty();
    if (!nvme.empty()) eo.disk_free = FreeDiskBytes(nvme);
    auto est = planner::EstimateAutoReserve(c_, *spec, eo);
    if (!est.ok() || est->device_reserve == 0) {
      // Said once the engine has started: a config the replay refuses, the engine refuses too,
      // with its own error, which this line would only precede.
      if (leader() && !f_.json)
        reserve_note_ =
            StrCat("strata-train: placement auto keeps the engine's default device reserve (",
                   est.ok() ? "the replay found none" : est.status().ToString(), ")\n");
      return Status::Ok();
    }
    c_.strata.device_reserve = est->device_reserve;
    if (leader() && !f_.json)
      std::fprintf(stderr,
                   "strata-train: placement auto keeps %s of the device for compute (the replay of this "
                   "model's step, as strata-estimate gives it; strata.device_reserve overrides)\n",
                   FormatBytes(est->device_reserve).c_str());
    return Status::Ok();
  }

  // One micro-batch's activations (strata-estimate's count, Note [activation count]) against
  // all the memory they can live in: the host's available memory on the CPU device, the GPU's
  // on CUDA. Beyond it the forward can only fail, after the model is built: the kernel kills the
  // process, or LibTorch reports a failed allocation that names neither the micro-batch nor the
  // model's size. Only a definite failure is refused: the engine's own state comes on top.
  Status CheckActivationsFit() const {
    const int64_t micro = c_.train_micro_batch_size_per_gpu;
    const int esize = c_.bf16.enabled || c_.fp16.enabled ? 2 : 4;
    const planner::ActivationEstimate a = planner::GptActivations(
        c_.model, micro, esize, c_.activation_checkpointing.cpu_checkpointing);
    const bool on_host = device_->kind() == DeviceKind::kCpu;
    const uint64_t room = on_host ? ReadHostMemory().available_bytes : device_->capacity();
    if (room == 0 || a.saved_bytes <= room) return Status::Ok();
    return ResourceExhausted(StrCat(
        "one micro-batch of ", micro, " x ", c_.model.seq_len, " tokens keeps ~", FormatBytes(a.saved_bytes),
        " of activations for backward (d_model ", c_.model.d_model, ", ", c_.model.n_layers, " layers",
        a.checkpointed ? ", checkpointed" : "", "), more than the ", FormatBytes(room), " the ",
        on_host ? "host has available" : "device has", "; lower train_micro_batch_size_per_gpu (--micro-batch)",
        a.checkpointed ? "" : " or set model.checkpoint_activations", " (strata-estimate --config shows the figure)"));
  }

  // Stage 3 with NVMe parameter offload builds the model under zero::Init, into a staging file.
  bool BuildsUnderZeroInit() const {
    return c_.zero_optimization.stage == 3 && !NvmeDirForHost().empty() &&
           c_.zero_optimization.offload_param.device == OffloadDevice::kNvme;
  }

  // Built otherwise, every parameter is an fp32 tensor in host memory before the engine takes
  // it: a model larger than the host failed inside LibTorch's allocator, with its backtrace.
  Status CheckModelBuildFits() const {
    if (BuildsUnderZeroInit()) return Status::Ok();
    const double params = static_cast<double>(models::GptParameterCount(c_.model));
    const double need = params * 4;
    const uint64_t room = ReadHostMemory().available_bytes;
    if (room == 0 || need <= static_cast<double>(room)) return Status::Ok();
    return ResourceExhausted(StrCat(
        "building the model's ", FormatParams(params), " parameters takes ",
        FormatBytes(static_cast<uint64_t>(std::min(need, 1.8e19))), " of fp32 host memory before the engine places them, more than the ",
        FormatBytes(room), " the host has available; build it on disk with zero_optimization.stage 3 and "
        "offload_param.device nvme (and an nvme_path), or make the \"model\" section smaller"));
  }

  // The directory NVMe swap goes to, if any (for the disk in the host line).
  // The NVMe tier's first directory, where zero::Init stages too: on the disk whose space the
  // engine's start gets back as it writes its blocks there (Note [start's disk]).
  std::string NvmeDirForHost() const {
    if (!f_.nvme_path.empty()) return f_.nvme_path;
    const std::vector<std::string> paths = c_.zero_optimization.NvmeTierPaths();
    return paths.empty() ? "" : paths.front();
  }

  Flags f_;
  Config c_;
  std::string host_;
  std::string reserve_note_;  // ReserveForCompute's, said once the engine has started
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Engine> engine_;
  TextData data_;
  int64_t saved_step_ = -1;  // the step Save last wrote in this run
  bool trace_written_ = false;
  bool interrupted_ = false;  // a signal (on any rank) ended the loop early
};

}  // namespace
}  // namespace strata::train

// Note [passive OpenMP waits]
// LibTorch's intra-op pool is OpenMP, and OpenMP threads spin after each parallel region by
// default. A LibTorch 2.x that calls a pthread OpenBLAS for fp32 matmuls (Debian trixie's 2.6)
// then runs BLAS threads beside spinning OpenMP threads on the same cores: on 2 cores an fp32
// step of a 1.7M-parameter GPT took 0.23-0.37 s, against 0.04 s with OMP_WAIT_POLICY=PASSIVE
// (or one BLAS thread), and bf16 (oneDNN) and LibTorch 1.13 were unchanged by it. The policy is
// read once, when the OpenMP runtime loads, before main: so the process starts itself again
// with it set, unless the caller chose a policy. STRATA_KEEP_OMP_WAIT=1 skips the restart.
static void ExecWithPassiveOmpWait(char** argv) {
  if (strata::GetEnv(strata::kEnvOmpWaitPolicy) != nullptr ||
      strata::GetEnv(strata::kEnvKeepOmpWait) != nullptr)
    return;
  if (setenv(strata::kEnvOmpWaitPolicy.name, "PASSIVE", 1) != 0) return;
  execv("/proc/self/exe", argv);  // returns only on failure: then go on as we are
  unsetenv(strata::kEnvOmpWaitPolicy.name);
}

int main(int argc, char** argv) {
  ExecWithPassiveOmpWait(argv);
  using strata::train::Flags;
  Flags f;
  CLI::App app{
      "strata-train: trains a decoder-only GPT (byte-level tokens) on real text with Strata's ZeRO "
      "engine, placing parameters, gradients and optimizer states on the device, in host memory "
      "or on NVMe as the config says. Without --config it trains the built-in 'tiny' config "
      "(configs/tiny.json) on the fortunes corpus.\n\n"
      "Several ranks: strata-launch --nproc N -- strata-train --config FILE"};
  app.add_option("--config", f.config, "DeepSpeed-style JSON config (see configs/ and the README)")
      ->check(CLI::ExistingFile);
  app.add_option("--steps", f.steps, "optimizer steps to reach (counted from 0, so a resumed run "
                                     "continues to this step); default: 200")
      ->check(strata::train::WholeAtLeast(1));
  app.add_option("--data", f.data, "a text file or a directory of text files")
      ->capture_default_str();
  app.add_option("--nvme-path", f.nvme_path,
                 "directory for NVMe swap files (overrides offload_*.nvme_path)");
  CLI::Option* save = app.add_option(
      "--save", f.save, "checkpoint root: saved at the end (and every --save-every steps)");
  app.add_option("--save-every", f.save_every, "also save every N steps (needs --save)")
      ->check(strata::train::WholeAtLeast(0))
      ->needs(save);
  app.add_option("--resume", f.resume, "resume from a checkpoint root (its 'latest') or a step-* directory");
  app.add_flag("--json", f.json, "print one JSON object per step and a final summary object on stdout");
  app.add_option("--eval-every", f.eval_every, "validation loss every N steps (0: only at the end)")
      ->capture_default_str()->check(strata::train::WholeAtLeast(0));
  app.add_option("--eval-batches", f.eval_batches, "held-out batches per validation (0: no validation)")
      ->capture_default_str()->check(strata::train::WholeAtLeast(0));
  app.add_option("--log-every", f.log_every, "print a step line every N steps (default: steps_per_print)")
      ->check(strata::train::WholeAtLeast(0));
  app.add_option("--plot", f.plot, "SVG plot of loss and throughput written at the end ('' disables)")
      ->capture_default_str();
  app.add_option("--device", f.device, "auto, cpu, cuda or cuda:N (overrides strata.device)");
  app.add_option("--threads", f.threads,
                 "LibTorch compute threads (default: LibTorch's own choice, which the log prints "
                 "beside the optimizer's; updates that overlap compute take the cores it leaves)")
      ->check(strata::train::WholeAtLeast(0));
  CLI::Option* trace = app.add_option(
      "--trace", f.trace,
      "write the engine's lanes (compute, waits, copies, collectives, NVMe, each chunk's "
      "Adam) for --trace-steps steps after the first as Chrome trace-event JSON: open it "
      "in ui.perfetto.dev or chrome://tracing");
  app.add_option("--trace-steps", f.trace_steps, "steps --trace records (needs --trace)")
      ->capture_default_str()
      ->check(strata::train::WholeAtLeast(1))
      ->needs(trace);
  app.add_option("--micro-batch", f.micro_batch,
                 "micro-batch size per rank, used where the config says "
                 "train_micro_batch_size_per_gpu: \"auto\" (default 1)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));  // the config key's range
  app.add_option("--lr", f.lr, "learning rate, used where the config says optimizer.params.lr: \"auto\" "
                               "(default 1e-3)")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            const double x = std::strtod(v.c_str(), nullptr);
            // NaN passes a range check (no comparison with it holds); the config's own range.
            return std::isfinite(x) && x > 0 && x <= 10 ? "" : "must be a number in (0, 10]";
          },
          "(0, 10]"));
  app.add_flag("--print-config", f.print_config,
               "print the effective config (defaults filled in, \"auto\" values resolved for this "
               "machine and WORLD_SIZE) and exit; stderr lists the keys that were \"auto\" and "
               "where each value came from");
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "strata-train: %s\nRun with --help for the options.\n", e.what());
    return 2;
  }
  // An empty value would read as "not given" and the run go on without it.
  for (const char* flag : {"--config", "--data", "--nvme-path", "--save", "--resume", "--device", "--trace"}) {
    const CLI::Option* o = app.get_option(flag);
    if (o->count() > 0 && o->as<std::string>().empty()) {
      std::fprintf(stderr, "strata-train: %s='': needs a value (leave the flag out for the default)\n", flag);
      return 2;
    }
  }

  auto config = f.config.empty()
                    ? strata::Config::FromJsonText(strata::train::kEmbeddedTinyConfig, "<built-in tiny>")
                    : strata::Config::FromFile(f.config);
  if (!config.ok()) {
    std::fprintf(stderr, "strata-train: %s\n", config.status().ToString().c_str());
    return 2;
  }
  if (f.print_config) {
    const char* ws = strata::GetEnv(strata::kEnvWorldSize);
    const int world = ws && std::atoi(ws) > 0 ? std::atoi(ws) : 1;
    strata::Status s = config->ResolveAuto(strata::train::MakeAutoContext(f, *config, world));
    if (!s.ok()) {
      std::fprintf(stderr, "strata-train: %s\n", s.ToString().c_str());
      return 2;
    }
    std::cout << config->ToJsonString() << std::endl;
    for (const std::string& line : config->auto_resolved) std::fprintf(stderr, "auto: %s\n", line.c_str());
    return 0;
  }
  if (f.steps == 0) f.steps = 200;
  if (f.eval_every == 0) f.eval_every = f.steps;
  signal(SIGINT, strata::train::OnSignal);
  signal(SIGTERM, strata::train::OnSignal);
  strata::train::Trainer trainer(f, std::move(config).value());
  return trainer.Run();
}
