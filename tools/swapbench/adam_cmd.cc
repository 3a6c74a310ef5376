// `strata-swapbench adam`: CPU Adam throughput against its two references, measured in one run
// on the same data sizes and thread count:
//   - the roofline: an Adam-shaped streaming loop (read p, g, m, v; write p, m, v; fp32) with
//     trivial arithmetic, i.e. what the memory system allows for fp32 Adam;
//   - LibTorch's torch::optim::AdamW on one flat parameter of n elements.
// Variants of Strata's step: fp32 states (the headline figure), the same with the inf/NaN
// pre-scan (GradCheck::kScanFirst), with a bf16 parameter copy written, and with bf16 states.
// Each figure is the best of --reps repetitions; variants are interleaved within a repetition
// so machine noise spreads over all of them.
#include <sys/mman.h>

#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "optim/cpu_adam.h"
#include "runtime/status.h"
#include "tools/swapbench/commands.h"

namespace strata::swapbench {
namespace {

using optim::AdamBuffers;
using optim::AdamOptions;
using optim::AdamParams;
using optim::DType;
using optim::Isa;

struct AdamArgs {
  // On by default: Strata's optimizer states live in the host tier's pinned pool, which asks for
  // transparent huge pages, so this is the configuration the engine actually runs.
  bool hugepages = true;
  std::string n = "67108864";
  std::string threads = "0";
  std::string reps = "5";
  std::string isa = "auto";
  bool json = false;
};

struct Settings {
  bool hugepages = false;
  size_t n = 0;
  int threads = 0;
  int reps = 0;
  Isa isa = Isa::kAuto;
};

StatusOr<int64_t> ParseInt(const std::string& flag, const std::string& text, int64_t lo, int64_t hi,
                           const char* hint) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || *end != '\0' || v < lo || v > hi) {
    return InvalidArgument(StrCat(flag, "=", text, ": must be an integer in ", lo, "..", hi, " (", hint, ")"));
  }
  return static_cast<int64_t>(v);
}

StatusOr<Settings> Validate(const AdamArgs& a) {
  Settings s;
  // 2^31 elements of fp32 p, g, m, v plus LibTorch's copies would need ~60 GB; beyond that the
  // benchmark is certainly a typo.
  STRATA_ASSIGN_OR_RETURN(const int64_t n, ParseInt("--n", a.n, 1, int64_t{1} << 31,
                                                    "elements per buffer, e.g. 67108864"));
  STRATA_ASSIGN_OR_RETURN(const int64_t threads, ParseInt("--threads", a.threads, 0, 1024,
                                                          "0 = every core TBB sees"));
  STRATA_ASSIGN_OR_RETURN(const int64_t reps, ParseInt("--reps", a.reps, 1, 1000, "best of this many runs"));
  StatusOr<Isa> isa = optim::ParseIsa(a.isa.c_str());
  if (!isa.ok()) return InvalidArgument(StrCat("--", isa.status().message()));
  s.isa = *isa;
  if (!optim::IsaSupported(s.isa)) {
    return InvalidArgument(StrCat("--isa=", a.isa, ": this CPU cannot run it; the best it has is ",
                                  optim::IsaName(optim::DetectIsa())));
  }
  s.n = static_cast<size_t>(n);
  s.hugepages = a.hugepages;
  s.threads = threads == 0 ? tbb::info::default_concurrency() : static_cast<int>(threads);
  s.reps = static_cast<int>(reps);
  return s;
}

// An anonymous mapping of n elements, optionally backed by transparent huge pages (what the
// host tier's pinned pool uses), so the effect of TLB misses on the streams can be measured.
template <typename T>
class Buffer {
 public:
  Buffer(size_t n, bool hugepages) : bytes_(std::max<size_t>(n * sizeof(T), 1)) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("strata-swapbench adam: mmap");
      std::exit(1);
    }
    if (hugepages && madvise(p, bytes_, MADV_HUGEPAGE) != 0) {
      std::perror("strata-swapbench adam: madvise(MADV_HUGEPAGE), continuing without");
    }
    data_ = static_cast<T*>(p);
  }
  ~Buffer() { munmap(data_, bytes_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() { return data_; }
  T& operator[](size_t i) { return data_[i]; }

 private:
  size_t bytes_;
  T* data_ = nullptr;
};

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The roofline loop. Deliberately plain C++: it must move the same bytes as fp32 Adam with no
// cleverness, so Strata's kernel cannot beat it by doing less. The arithmetic keeps the values
// bounded over any number of runs. It has to be limited by memory, not by instructions, or the
// "roofline" would be too low: the build's -O2 leaves this loop scalar (GCC's very-cheap
// vectoriser cost model), so it is compiled at O3 in a clone per vector ISA, picked at load
// time like the kernels are (one binary still runs on any x86-64).
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void StreamingLoop(float* __restrict p, const float* __restrict g, float* __restrict m,
                   float* __restrict v, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float gi = g[i];
    const float mi = 0.5f * m[i] + gi;
    const float vi = 0.5f * v[i] + gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] - 1e-7f * mi;
  }
}

// Runs body over [0, n) in the arena the way AdamStep does (contiguous per-thread runs of
// 64 Ki-element blocks), so the roofline and the kernel differ only in the loop body.
void ParallelRange(tbb::task_arena& arena, size_t n, const std::function<void(size_t, size_t)>& body) {
  constexpr size_t kGrain = 64 * 1024;
  const size_t blocks = (n + kGrain - 1) / kGrain;
  arena.execute([&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, blocks, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          body(r.begin() * kGrain, std::min(n, r.end() * kGrain));
        },
        tbb::static_partitioner());
  });
}

struct Variant {
  std::string name;
  std::string json_key;
  double bytes_per_elem;
  std::function<Status()> run;
  double best_s = 1e30;
};

int RunAdam(const AdamArgs& args) {
  StatusOr<Settings> settings = Validate(args);
  if (!settings.ok()) {
    std::cerr << "strata-swapbench adam: " << settings.status().message() << "\n";
    return 2;
  }
  const Settings s = *settings;
  const size_t n = s.n;
  tbb::task_arena arena(s.threads);
  torch::set_num_threads(s.threads);

  // Buffers, first touched in parallel inside the arena so pages are spread like the work.
  Buffer<float> p(n, s.hugepages), g(n, s.hugepages), m(n, s.hugepages), v(n, s.hugepages);
  Buffer<uint16_t> m16(n, s.hugepages), v16(n, s.hugepages), p16(n, s.hugepages);
  ParallelRange(arena, n, [&](size_t b, size_t e) {
    for (size_t i = b; i < e; ++i) {
      const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
      p[i] = x;
      g[i] = 0.01f * x;
      m[i] = 0.0f;
      v[i] = 0.0f;
      m16[i] = v16[i] = p16[i] = 0;
    }
  });
  torch::Tensor tp = torch::from_blob(p.data(), {static_cast<int64_t>(n)}, torch::kFloat32).clone();
  tp.set_requires_grad(true);
  tp.mutable_grad() = torch::from_blob(g.data(), {static_cast<int64_t>(n)}, torch::kFloat32).clone();
  torch::optim::AdamW torch_adamw(std::vector<torch::Tensor>{tp},
                                  torch::optim::AdamWOptions(1e-3).weight_decay(0.01));

  AdamParams hp;
  hp.lr = 1e-3;
  hp.weight_decay = 0.01;
  hp.adamw = true;
  int64_t step = 0;
  auto strata_step = [&](void* mm, void* vv, DType state, void* out16, optim::GradCheck check) {
    AdamBuffers b;
    b.master = p.data();
    b.grad = g.data();
    b.exp_avg = mm;
    b.exp_avg_sq = vv;
    b.state_dtype = state;
    b.param16 = out16;
    b.param16_dtype = DType::kBFloat16;
    b.n = n;
    hp.step = ++step;
    AdamOptions o;
    o.isa = s.isa;
    o.arena = &arena;
    o.grad_check = check;
    return AdamStep(hp, b, 1.0f, o).status();
  };

  std::vector<Variant> variants;
  variants.push_back({"roofline: fp32 stream (r p,g,m,v; w p,m,v)", "roofline", 28, [&] {
                        ParallelRange(arena, n, [&](size_t b, size_t e) {
                          StreamingLoop(p.data(), g.data(), m.data(), v.data(), b, e);
                        });
                        return Status::Ok();
                      }});
  variants.push_back({"strata fp32 states", "strata", 28, [&] {
                        return strata_step(m.data(), v.data(), DType::kFloat32, nullptr,
                                           optim::GradCheck::kCallerChecked);
                      }});
  variants.push_back({"strata fp32 states + inf/nan pre-scan", "strata_scan_first", 32, [&] {
                        return strata_step(m.data(), v.data(), DType::kFloat32, nullptr,
                                           optim::GradCheck::kScanFirst);
                      }});
  variants.push_back({"strata fp32 states + bf16 param out", "strata_bf16_param", 30, [&] {
                        return strata_step(m.data(), v.data(), DType::kFloat32, p16.data(),
                                           optim::GradCheck::kCallerChecked);
                      }});
  variants.push_back({"strata bf16 states", "strata_bf16_states", 20, [&] {
                        return strata_step(m16.data(), v16.data(), DType::kBFloat16, nullptr,
                                           optim::GradCheck::kCallerChecked);
                      }});
  variants.push_back({"grad scan alone (UnscaleCheckNorm, fp32)", "grad_scan", 4, [&] {
                        AdamOptions o;
                        o.isa = s.isa;
                        o.arena = &arena;
                        return optim::UnscaleCheckNorm(g.data(), DType::kFloat32, n, 1.0f, o).status();
                      }});
  variants.push_back({"libtorch AdamW", "libtorch_adamw", 28, [&] {
                        torch_adamw.step();
                        return Status::Ok();
                      }});

  // One untimed pass each: page faults, torch's state allocation, TBB worker start-up.
  for (Variant& var : variants) {
    const Status st = var.run();
    if (!st.ok()) {
      std::cerr << "strata-swapbench adam: " << var.name << ": " << st.ToString() << "\n";
      return 1;
    }
  }
  for (int r = 0; r < s.reps; ++r) {
    for (Variant& var : variants) {
      Status st;
      const double t = Seconds([&] { st = var.run(); });
      if (!st.ok()) {
        std::cerr << "strata-swapbench adam: " << var.name << ": " << st.ToString() << "\n";
        return 1;
      }
      var.best_s = std::min(var.best_s, t);
    }
  }

  auto gparams = [&](const Variant& var) { return static_cast<double>(n) / var.best_s / 1e9; };
  const double roof = gparams(variants[0]);
  const double torch_rate = gparams(variants.back());
  const Isa isa_used = s.isa == Isa::kAuto ? optim::ResolveAutoIsa() : s.isa;

  if (args.json) {
    nlohmann::json j;
    j["n"] = n;
    j["threads"] = s.threads;
    j["reps"] = s.reps;
    j["isa"] = optim::IsaName(isa_used);
    j["hugepages"] = s.hugepages;
    for (const Variant& var : variants) {
      j[var.json_key + "_gparams_s"] = gparams(var);
      j[var.json_key + "_gbps"] = gparams(var) * var.bytes_per_elem;
      j[var.json_key + "_bytes_per_param"] = var.bytes_per_elem;
    }
    j["strata_vs_roofline"] = gparams(variants[1]) / roof;
    j["strata_vs_libtorch"] = gparams(variants[1]) / torch_rate;
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::printf("strata-swapbench adam: n=%zu threads=%d isa=%s hugepages=%s, best of %d\n", n,
              s.threads, optim::IsaName(isa_used), s.hugepages ? "on" : "off", s.reps);
  std::printf("%-42s %10s %8s %8s %12s %12s\n", "variant", "G param/s", "B/param", "GB/s",
              "vs roofline", "vs LibTorch");
  for (const Variant& var : variants) {
    const double rate = gparams(var);
    std::printf("%-42s %10.3f %8.0f %8.1f %12.3f %12.2f\n", var.name.c_str(), rate,
                var.bytes_per_elem, rate * var.bytes_per_elem, rate / roof, rate / torch_rate);
  }
  std::printf("B/param: bytes each step moves per parameter (LibTorch's figure counts the same 28 B\n"
              "as fp32 Adam; it makes more passes in reality). GB/s = G param/s x B/param.\n");
  return 0;
}

}  // namespace

void RegisterAdamCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<AdamArgs>();
  CLI::App* cmd = app.add_subcommand(
      "adam",
      "CPU Adam throughput in billions of parameters per second: Strata's AdamW step (fp32 "
      "states; with the inf/NaN pre-scan; with a bf16 parameter copy; with bf16 states) against "
      "an Adam-shaped fp32 streaming loop (the memory-bandwidth roofline) and LibTorch's "
      "torch::optim::AdamW, all in one run on the same n and threads. Each figure is the best of "
      "--reps runs. Exit status: 0 ok, 1 a step failed, 2 bad arguments.");
  cmd->add_option("--n", args->n, "Parameters per buffer, >= 1 (default 67108864 = 64M; needs ~3.5 GB)")
      ->type_name("N");
  cmd->add_option("--threads", args->threads,
                  "Threads for Strata (a TBB arena of this width), the roofline and LibTorch; 0 = all "
                  "cores (default 0)")
      ->type_name("T");
  cmd->add_option("--reps", args->reps, "Timed repetitions per variant; the best is reported (default 5)")
      ->type_name("R");
  cmd->add_option("--isa", args->isa, "Kernel: auto, scalar, avx2, avx512, avx512_bf16 (default auto: the best this CPU has)")
      ->type_name("ISA");
  cmd->add_flag_callback(
      "--no-hugepages", [args] { args->hugepages = false; },
      "Back Strata's and the roofline's buffers with 4 KiB pages. By default they use transparent "
      "huge pages (madvise), as the host tier's pinned pool does; LibTorch keeps its own "
      "allocator either way");
  cmd->add_flag_callback(
      "--hugepages", [args] { args->hugepages = true; },
      "The default; kept so older command lines still parse");
  cmd->add_flag("--json", args->json,
                "Print one JSON object: <variant>_gparams_s / _gbps for strata, strata_scan_first, "
                "strata_bf16_param, strata_bf16_states, grad_scan, libtorch_adamw, roofline; isa; ratios");
  cmd->callback([args, exit_code] { *exit_code = RunAdam(*args); });
}

}  // namespace strata::swapbench
