// `strata-swapbench adam`: CPU Adam throughput against its two references, measured in one run
// on the same data sizes and thread count:
//   - the roofline: an Adam-shaped streaming loop (read p, g, m, v; write p, m, v; fp32) with
//     trivial arithmetic, i.e. what the memory system allows for fp32 Adam. Where buffers sit
//     matters as much as the loop (Note [block colouring] in tiers/host/pinned_pool.cc: streams
//     at one large power-of-two distance run 3-4x slower), so the roofline is the best of several
//     placements, none of them chosen to flatter Strata's, and names the one that won;
//   - LibTorch's torch::optim::AdamW on one flat parameter of n elements.
// Strata's buffers come from a PinnedPool, the host tier's allocator, so the headline figure is
// the layout the engine runs on; the same step on an uncoloured pool shows what colouring buys.
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
#include "runtime/base/host_info.h"
#include "runtime/base/status.h"
#include "runtime/base/units.h"
#include "tiers/host/pinned_pool.h"
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

// An anonymous mapping, optionally backed by transparent huge pages (what the host tier's pinned
// pool uses), so the effect of TLB misses on the streams can be measured.
class Mapping {
 public:
  Mapping(size_t bytes, bool hugepages) : bytes_(std::max<size_t>(bytes, 1)) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("strata-swapbench adam: mmap");
      std::exit(1);
    }
    if (hugepages && madvise(p, bytes_, MADV_HUGEPAGE) != 0) {
      std::perror("strata-swapbench adam: madvise(MADV_HUGEPAGE), continuing without");
    }
    data_ = static_cast<char*>(p);
  }
  ~Mapping() { munmap(data_, bytes_); }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  char* data() { return data_; }

 private:
  size_t bytes_;
  char* data_ = nullptr;
};

// The four fp32 streams of one Adam call (p, g, m, v) under one placement.
struct StreamSet {
  std::string placement;  // how the four buffers were placed, for the report
  float* p = nullptr;
  float* g = nullptr;
  float* m = nullptr;
  float* v = nullptr;
};

// Buffers carved from a PinnedPool exactly as the tier manager carves a chunk's states.
class PoolBuffers {
 public:
  PoolBuffers(size_t n, bool hugepages, uint64_t colour_step, const std::vector<size_t>& elem_sizes) {
    PinnedPoolOptions o;
    o.allow_cuda = false;
    o.huge_pages = hugepages;
    o.colour_step = colour_step;
    uint64_t budget = 0;
    for (size_t e : elem_sizes) budget += RoundUpPow2(n * e);
    o.budget = std::max<uint64_t>(budget, o.min_block);
    StatusOr<std::unique_ptr<PinnedPool>> pool = PinnedPool::Create(o);
    if (!pool.ok()) {
      std::cerr << "strata-swapbench adam: host pool: " << pool.status().ToString() << "\n";
      std::exit(1);
    }
    pool_ = std::move(*pool);
    for (size_t e : elem_sizes) {
      StatusOr<PinnedBlock> b = pool_->Allocate(n * e);
      if (!b.ok()) {
        std::cerr << "strata-swapbench adam: host pool: " << b.status().ToString() << "\n";
        std::exit(1);
      }
      blocks_.push_back(b->ptr);
    }
  }
  void* operator[](size_t i) const { return blocks_[i]; }
  StreamSet Streams(std::string placement) const {
    return {std::move(placement), static_cast<float*>(blocks_[0]), static_cast<float*>(blocks_[1]),
            static_cast<float*>(blocks_[2]), static_cast<float*>(blocks_[3])};
  }

 private:
  static uint64_t RoundUpPow2(uint64_t v) {
    uint64_t p = 4096;
    while (p < v) p <<= 1;
    return p;
  }
  std::unique_ptr<PinnedPool> pool_;
  std::vector<void*> blocks_;
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

// First touch in parallel inside the arena, so pages are spread like the work: every
// placement's fp32 streams, and the bf16 ones zeroed.
void FirstTouch(tbb::task_arena& arena, const std::vector<StreamSet>& placements,
                const std::vector<uint16_t*>& halves, size_t n) {
  for (const StreamSet& set : placements) {
    ParallelRange(arena, n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) {
        const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
        set.p[i] = x;
        set.g[i] = 0.01f * x;
        set.m[i] = 0.0f;
        set.v[i] = 0.0f;
      }
    });
  }
  ParallelRange(arena, n, [&](size_t b, size_t e) {
    for (uint16_t* h : halves)
      for (size_t i = b; i < e; ++i) h[i] = 0;
  });
}

// One untimed pass each (page faults, torch's state allocation, TBB worker start-up), then the
// best of `reps` timed passes, round-robin over the variants.
Status TimeVariants(std::vector<Variant>* variants, int reps) {
  for (Variant& var : *variants) {
    Status st = var.run();
    if (!st.ok()) return st.WithContext(var.name);
  }
  for (int r = 0; r < reps; ++r) {
    for (Variant& var : *variants) {
      Status st;
      const double t = Seconds([&] { st = var.run(); });
      if (!st.ok()) return st.WithContext(var.name);
      var.best_s = std::min(var.best_s, t);
    }
  }
  return Status::Ok();
}

// variants[0, first_strata) are the roofline under each placement (the best is "the" roofline),
// then Strata's variants, LibTorch's last.
void ReportAdam(const AdamArgs& args, const Settings& s, const std::vector<StreamSet>& placements,
                const std::vector<Variant>& variants, size_t first_strata) {
  const size_t n = s.n;
  auto gparams = [&](const Variant& var) { return static_cast<double>(n) / var.best_s / 1e9; };
  size_t roof_i = 0;
  for (size_t i = 1; i < first_strata; ++i)
    if (variants[i].best_s < variants[roof_i].best_s) roof_i = i;
  const double roof = gparams(variants[roof_i]);
  const double torch_rate = gparams(variants.back());
  const double strata_rate = gparams(variants[first_strata]);
  const Isa isa_used = s.isa == Isa::kAuto ? optim::ResolveAutoIsa() : s.isa;

  if (args.json) {
    nlohmann::json j;
    j["host"] = HostDescription();
    j["n"] = n;
    j["threads"] = s.threads;
    j["reps"] = s.reps;
    j["isa"] = optim::IsaName(isa_used);
    j["avx512_prefetch"] = optim::DefaultAvx512Prefetch();
    j["hugepages"] = s.hugepages;
    nlohmann::json places = nlohmann::json::array();
    for (size_t i = 0; i < first_strata; ++i)
      places.push_back({{"placement", placements[i].placement}, {"gparams_s", gparams(variants[i])},
                        {"gbps", gparams(variants[i]) * 28}});
    j["roofline_placements"] = places;
    j["roofline_placement"] = placements[roof_i].placement;
    j["roofline_gparams_s"] = roof;
    j["roofline_gbps"] = roof * 28;
    for (size_t i = first_strata; i < variants.size(); ++i) {
      const Variant& var = variants[i];
      j[var.json_key + "_gparams_s"] = gparams(var);
      j[var.json_key + "_gbps"] = gparams(var) * var.bytes_per_elem;
      j[var.json_key + "_bytes_per_param"] = var.bytes_per_elem;
    }
    j["strata_vs_roofline"] = strata_rate / roof;
    j["strata_vs_libtorch"] = strata_rate / torch_rate;
    j["colouring_speedup"] = strata_rate / gparams(variants[first_strata + 1]);
    std::cout << j.dump(2) << "\n";
    return;
  }
  std::printf("strata-swapbench adam on %s\n", HostDescription().c_str());
  std::printf("n=%zu threads=%d isa=%s avx512_prefetch=%s hugepages=%s, best of %d\n", n, s.threads,
              optim::IsaName(isa_used), optim::DefaultAvx512Prefetch() ? "on" : "off",
              s.hugepages ? "on" : "off", s.reps);
  std::printf("%-42s %10s %8s %8s %12s %12s\n", "variant", "G param/s", "B/param", "GB/s",
              "vs roofline", "vs LibTorch");
  for (size_t i = 0; i < variants.size(); ++i) {
    const Variant& var = variants[i];
    const double rate = gparams(var);
    std::printf("%-42s %10.3f %8.0f %8.1f %12.3f %12.2f%s\n", var.name.c_str(), rate,
                var.bytes_per_elem, rate * var.bytes_per_elem, rate / roof, rate / torch_rate,
                i == roof_i ? "  <- roofline" : "");
  }
  std::printf("roofline = the fastest placement of the streaming loop (%s).\n"
              "B/param: bytes each step moves per parameter (LibTorch's figure counts the same 28 B\n"
              "as fp32 Adam; it makes more passes in reality). GB/s = G param/s x B/param.\n",
              placements[roof_i].placement.c_str());
}

using StrataStep = std::function<Status(const StreamSet& set, void* exp_avg, void* exp_avg_sq,
                                         DType state, void* param16, optim::GradCheck check)>;

// The streaming loop (the memory roofline) under each placement.
std::vector<Variant> RooflineVariants(tbb::task_arena& arena, const std::vector<StreamSet>& placements,
                                      size_t n) {
  std::vector<Variant> variants;
  for (const StreamSet& set : placements) {
    variants.push_back({"stream: " + set.placement, "", 28, [&arena, &set, n] {
                          ParallelRange(arena, n, [&](size_t b, size_t e) {
                            StreamingLoop(set.p, set.g, set.m, set.v, b, e);
                          });
                          return Status::Ok();
                        }});
  }
  return variants;
}

// Strata's Adam in the engine's layout and its variants; halves: m16, v16, p16. `step` must
// outlive the variants.
void AddStrataVariants(std::vector<Variant>* variants, const StrataStep& step,
                       const StreamSet& strata_set, const StreamSet& flat_set,
                       std::vector<uint16_t*> halves) {
  uint16_t *m16 = halves[0], *v16 = halves[1], *p16 = halves[2];
  variants->push_back({"strata fp32 states", "strata", 28, [&] {
                         return step(strata_set, strata_set.m, strata_set.v, DType::kFloat32,
                                     nullptr, optim::GradCheck::kCallerChecked);
                       }});
  variants->push_back({"strata fp32 states, uncoloured pool", "strata_uncoloured", 28, [&] {
                         return step(flat_set, flat_set.m, flat_set.v, DType::kFloat32, nullptr,
                                     optim::GradCheck::kCallerChecked);
                       }});
  variants->push_back({"strata fp32 states + inf/nan pre-scan", "strata_scan_first", 32, [&] {
                         return step(strata_set, strata_set.m, strata_set.v, DType::kFloat32,
                                     nullptr, optim::GradCheck::kScanFirst);
                       }});
  variants->push_back({"strata fp32 states + bf16 param out", "strata_bf16_param", 30, [&, p16] {
                         return step(strata_set, strata_set.m, strata_set.v, DType::kFloat32, p16,
                                     optim::GradCheck::kCallerChecked);
                       }});
  variants->push_back({"strata bf16 states", "strata_bf16_states", 20, [&, m16, v16] {
                         return step(strata_set, m16, v16, DType::kBFloat16, nullptr,
                                     optim::GradCheck::kCallerChecked);
                       }});
}

int RunAdam(const AdamArgs& args) {
  StatusOr<Settings> settings = Validate(args);
  if (!settings.ok()) {
    std::cerr << "strata-swapbench adam: " << settings.status().message() << "\n";
    return 2;
  }
  const Settings s = *settings;
  const size_t n = s.n;
  // The two pools below, the roofline's streams and LibTorch's reference, about 100 bytes per
  // element (--help's 6.5 GB at 64M): refused before the pool, whose own refusal names the
  // engine's keys, not --n.
  if (Status fits = CheckBuffersFit(static_cast<int64_t>(n), static_cast<uint64_t>(n) * 100);
      !fits.ok()) {
    std::cerr << "strata-swapbench adam: " << fits.message() << "\n";
    return 2;
  }
  tbb::task_arena arena(s.threads);
  torch::set_num_threads(s.threads);

  // Strata's buffers: p, g, m, v (fp32) and m16, v16, p16 (bf16) from a coloured pool, the
  // layout the engine runs on; the same four fp32 streams from an uncoloured pool (the layout
  // before colouring). The roofline also gets two placements of its own: separate mappings (what
  // an allocator hands out for large buffers) and one mapping with the streams staggered by odd
  // multiples of 5 pages.
  const size_t bytes = n * sizeof(float);
  PoolBuffers pool(n, s.hugepages, PinnedPoolOptions{}.colour_step, {4, 4, 4, 4, 2, 2, 2});
  PoolBuffers flat_pool(n, s.hugepages, /*colour_step=*/0, {4, 4, 4, 4});
  Mapping sep_p(bytes, s.hugepages), sep_g(bytes, s.hugepages), sep_m(bytes, s.hugepages),
      sep_v(bytes, s.hugepages);
  constexpr size_t kStagger = 5 * 4096;
  const size_t slot = (bytes + 4095) / 4096 * 4096 + kStagger;
  Mapping staggered(4 * slot, s.hugepages);
  auto stag = [&](int k) { return reinterpret_cast<float*>(staggered.data() + k * slot); };
  const std::vector<StreamSet> placements = {
      pool.Streams("pinned pool, coloured (Strata's)"),
      flat_pool.Streams("pinned pool, uncoloured"),
      {"separate mmaps", reinterpret_cast<float*>(sep_p.data()), reinterpret_cast<float*>(sep_g.data()),
       reinterpret_cast<float*>(sep_m.data()), reinterpret_cast<float*>(sep_v.data())},
      {"one mmap, staggered by 20 KiB", stag(0), stag(1), stag(2), stag(3)},
  };
  auto* m16 = static_cast<uint16_t*>(pool[4]);
  auto* v16 = static_cast<uint16_t*>(pool[5]);
  auto* p16 = static_cast<uint16_t*>(pool[6]);
  FirstTouch(arena, placements, {m16, v16, p16}, n);
  const StreamSet& strata_set = placements[0];
  const StreamSet& flat_set = placements[1];
  torch::Tensor tp = torch::from_blob(strata_set.p, {static_cast<int64_t>(n)}, torch::kFloat32).clone();
  tp.set_requires_grad(true);
  tp.mutable_grad() = torch::from_blob(strata_set.g, {static_cast<int64_t>(n)}, torch::kFloat32).clone();
  torch::optim::AdamW torch_adamw(std::vector<torch::Tensor>{tp},
                                  torch::optim::AdamWOptions(1e-3).weight_decay(0.01));

  AdamParams hp;
  hp.lr = 1e-3;
  hp.weight_decay = 0.01;
  hp.adamw = true;
  int64_t step = 0;
  const StrataStep strata_step = [&](const StreamSet& set, void* mm, void* vv, DType state,
                                     void* out16, optim::GradCheck check) {
    AdamBuffers b;
    b.master = set.p;
    b.grad = set.g;
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

  // variants[0..placements) are the roofline under each placement; the best is "the" roofline.
  std::vector<Variant> variants = RooflineVariants(arena, placements, n);
  const size_t first_strata = variants.size();
  AddStrataVariants(&variants, strata_step, strata_set, flat_set, {m16, v16, p16});
  variants.push_back({"grad scan alone (UnscaleCheckNorm, fp32)", "grad_scan", 4, [&] {
                        AdamOptions o;
                        o.isa = s.isa;
                        o.arena = &arena;
                        return optim::UnscaleCheckNorm(strata_set.g, DType::kFloat32, n, 1.0f, o).status();
                      }});
  variants.push_back({"libtorch AdamW", "libtorch_adamw", 28, [&] {
                        torch_adamw.step();
                        return Status::Ok();
                      }});

  if (Status st = TimeVariants(&variants, s.reps); !st.ok()) {
    std::cerr << "strata-swapbench adam: " << st.ToString() << "\n";
    return 1;
  }
  ReportAdam(args, s, placements, variants, first_strata);
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
  cmd->add_option("--n", args->n, "Parameters per buffer, >= 1 (default 67108864 = 64M; needs ~6.5 GB)")
      ->transform(CLI::AsSizeValue(false))  // "32M": 32 x 2^20, as the help writes it
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
                "Print one JSON object: host; <variant>_gparams_s / _gbps for strata, strata_uncoloured, "
                "strata_scan_first, strata_bf16_param, strata_bf16_states, grad_scan, libtorch_adamw, "
                "roofline; roofline_placements (each placement's streaming rate) and the winning "
                "roofline_placement; isa; ratios");
  cmd->callback([args, exit_code] { *exit_code = RunAdam(*args); });
}

}  // namespace strata::swapbench
