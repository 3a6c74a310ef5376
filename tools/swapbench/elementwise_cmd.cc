// `strata-swapbench sgd|adagrad|lion`: a CPU element-wise optimizer's throughput against its two
// references, in one run on the same n and thread count:
//   - the roofline: a streaming loop of the optimizer's shape (read p, g, state; write p, state;
//     fp32, 20 B per parameter) with the same arithmetic, vectorized by the compiler per ISA;
//   - LibTorch: torch::optim::SGD / torch::optim::Adagrad on one flat parameter of n elements,
//     and for Lion (torch ships none) the update as a LibTorch script writes it from tensor ops.
// Each figure is the best of its repetitions, the variants interleaved and their order rotated.
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "optim/cpu_adagrad.h"
#include "optim/cpu_lion.h"
#include "optim/cpu_sgd.h"
#include "runtime/base/host_info.h"
#include "tools/swapbench/commands.h"

namespace strata::swapbench {
namespace {

enum class Kind { kSgd, kAdagrad, kLion };

struct BenchArgs {
  Kind kind = Kind::kSgd;
  int64_t n = 64 << 20;
  int threads = 0;
  int reps = 5;
  bool json = false;
};

const char* NameOf(Kind k) { return k == Kind::kSgd ? "SGD" : k == Kind::kAdagrad ? "Adagrad" : "Lion"; }
const char* SettingsOf(Kind k) {
  return k == Kind::kSgd       ? "momentum 0.9"
         : k == Kind::kAdagrad ? "weight decay 0.01"
                               : "betas (0.9, 0.99), weight decay 0.01";
}

// Plain C++ moving the optimizer's bytes with its operations; O3 clones per ISA, as adam_cmd.cc's
// roofline, so the reference is memory-bound rather than instruction-bound.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void
StreamingLoop(int kind, float* __restrict p, const float* __restrict g, float* __restrict s,
              size_t begin, size_t end) {
  if (kind == 0) {
    for (size_t i = begin; i < end; ++i) {
      const float b = 0.9f * s[i] + g[i];
      s[i] = b;
      p[i] = p[i] - 1e-7f * b;
    }
  } else if (kind == 1) {
    for (size_t i = begin; i < end; ++i) {
      const float d = g[i] + 0.01f * p[i];
      s[i] = s[i] + d * d;
      p[i] = p[i] - 1e-7f * (d / (sqrtf(s[i]) + 1e-10f));
    }
  } else {
    for (size_t i = begin; i < end; ++i) {
      const float c = 0.9f * s[i] + 0.1f * g[i];
      p[i] = p[i] * 0.9999f - 1e-7f * (c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f));
      s[i] = 0.99f * s[i] + 0.01f * g[i];
    }
  }
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Best of `reps` per variant. Which variant runs first in a repetition was measured to matter
// (about 20 % on a 2-core VM), so the order rotates from one repetition to the next; the first
// repetition warms up and is not counted.
std::vector<double> BestOfRotated(const std::vector<std::function<void()>>& variants, int reps) {
  std::vector<double> best(variants.size(), 1e30);
  const int rounds = (reps + 1) * static_cast<int>(variants.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = (k + r) % variants.size();
      const double t = Seconds(variants[v]);
      if (r >= static_cast<int>(variants.size())) best[v] = std::min(best[v], t);
    }
  }
  return best;
}

void Report(const BenchArgs& a, size_t n, int threads, optim::Isa isa, double strata_s,
            double roof_s, double torch_s) {
  const char* name = NameOf(a.kind);
  const double gp = static_cast<double>(n) / 1e9;
  const std::string host = HostDescription();
  const std::string torch_label = a.kind == Kind::kLion ? "LibTorch Lion (tensor ops)"
                                                        : std::string("LibTorch ") + name;
  if (a.json) {
    nlohmann::json j{{"host", host},
                     {"optimizer", name},
                     {"isa", optim::IsaName(isa)},
                     {"threads", threads},
                     {"n", a.n},
                     {"strata_gparams_s", gp / strata_s},
                     {"roofline_gparams_s", gp / roof_s},
                     {"libtorch_gparams_s", gp / torch_s},
                     {"strata_over_roofline", roof_s / strata_s},
                     {"strata_over_libtorch", torch_s / strata_s}};
    std::cout << j.dump() << "\n";
  } else {
    std::printf("%s; %d thread(s); n=%lld; %s %s, fp32, 20 B/param\n", host.c_str(), threads,
                static_cast<long long>(a.n), name, SettingsOf(a.kind));
    std::printf("  strata %s (%s)   %7.3f G params/s  %6.1f GB/s\n", name, optim::IsaName(isa),
                gp / strata_s, gp * 20 / strata_s);
    std::printf("  roofline stream   %7.3f G params/s  %6.1f GB/s\n", gp / roof_s, gp * 20 / roof_s);
    std::printf("  %s  %7.3f G params/s\n", torch_label.c_str(), gp / torch_s);
    std::printf("  strata / roofline %.2f, strata / LibTorch %.2f\n", roof_s / strata_s,
                torch_s / strata_s);
  }
}

int RunBench(const BenchArgs& a) {
  const char* name = NameOf(a.kind);
  // Six fp32 arrays here, and LibTorch's parameter, gradient and up to two states.
  Status fits = CheckKernelBenchSizes(a.n, a.threads, a.reps);
  if (fits.ok()) fits = CheckBuffersFit(a.n, static_cast<uint64_t>(a.n) * 4 * 10);
  if (!fits.ok()) {
    std::cerr << "strata-swapbench " << name << ": " << fits.message() << "\n";
    return 2;
  }
  const size_t n = static_cast<size_t>(a.n);
  const int threads = a.threads > 0 ? a.threads : tbb::info::default_concurrency();
  tbb::task_arena arena(threads);
  torch::set_num_threads(threads);
  std::vector<float> p(n), g(n), s(n), rp(n), rg(n), rs(n);
  for (size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    p[i] = rp[i] = x;
    g[i] = rg[i] = 0.01f * x;
  }
  torch::Tensor tp = torch::from_blob(p.data(), {a.n}, torch::kFloat32).clone();
  tp.set_requires_grad(true);
  tp.mutable_grad() = torch::from_blob(g.data(), {a.n}, torch::kFloat32).clone();
  const torch::Tensor tg = tp.grad();
  torch::Tensor tm = torch::zeros({a.n});
  std::unique_ptr<torch::optim::Optimizer> torch_opt;
  if (a.kind == Kind::kSgd) {
    torch_opt = std::make_unique<torch::optim::SGD>(std::vector<torch::Tensor>{tp},
                                                    torch::optim::SGDOptions(1e-3).momentum(0.9));
  } else if (a.kind == Kind::kAdagrad) {
    torch_opt = std::make_unique<torch::optim::Adagrad>(
        std::vector<torch::Tensor>{tp}, torch::optim::AdagradOptions(1e-3).weight_decay(0.01));
  }
  optim::ElementwiseOptions eo;
  eo.arena = &arena;
  optim::Isa isa = optim::Isa::kScalar;
  optim::SgdParams sp;
  sp.lr = 1e-3;
  sp.momentum = 0.9;
  optim::AdagradParams ap;
  ap.lr = 1e-3;
  ap.weight_decay = 0.01;
  optim::LionParams lp;
  lp.lr = 1e-3;
  lp.beta2 = 0.99;
  lp.weight_decay = 0.01;
  auto strata_step = [&] {
    StatusOr<optim::Isa> got = optim::Isa::kScalar;
    if (a.kind == Kind::kSgd) {
      got = optim::SgdStep(sp, {p.data(), g.data(), s.data(), nullptr, optim::DType::kBFloat16, n},
                           1.0f, eo);
      sp.first = false;
    } else if (a.kind == Kind::kAdagrad) {
      got = optim::AdagradStep(
          ap, {p.data(), g.data(), s.data(), nullptr, optim::DType::kBFloat16, n}, 1.0f, eo);
      ++ap.step;
    } else {
      got = optim::LionStep(lp, {p.data(), g.data(), s.data(), nullptr, optim::DType::kBFloat16, n},
                            1.0f, eo);
    }
    if (got.ok()) isa = *got;
  };
  auto roofline = [&] {
    constexpr size_t kGrain = 64 * 1024;
    const size_t blocks = (n + kGrain - 1) / kGrain;
    arena.execute([&] {
      tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 1),
                        [&](const tbb::blocked_range<size_t>& br) {
                          StreamingLoop(static_cast<int>(a.kind), rp.data(), rg.data(), rs.data(),
                                        br.begin() * kGrain, std::min(n, br.end() * kGrain));
                        },
                        tbb::static_partitioner());
    });
  };
  auto libtorch = [&] {
    if (torch_opt) {
      torch_opt->step();
      return;
    }
    torch::NoGradGuard no_grad;  // Lion from tensor ops, as a LibTorch script writes it
    const torch::Tensor c = tm.mul(0.9).add_(tg, 0.1);
    tp.mul_(1 - 1e-3 * 0.01).add_(c.sign_(), -1e-3);
    tm.mul_(0.99).add_(tg, 0.01);
  };
  std::vector<std::function<void()>> variants = {strata_step, roofline, libtorch};
  const std::vector<double> best = BestOfRotated(variants, a.reps);
  Report(a, n, threads, isa, best[0], best[1], best[2]);
  return 0;
}

void Register(CLI::App& app, int* exit_code, Kind kind, const char* command) {
  auto args = std::make_shared<BenchArgs>();
  args->kind = kind;
  const std::string torch_ref = kind == Kind::kLion
                                    ? "Lion written from LibTorch tensor ops (torch has none)"
                                    : std::string("LibTorch's torch::optim::") + NameOf(kind);
  CLI::App* cmd = app.add_subcommand(
      command,
      std::string("CPU ") + NameOf(kind) + " (" + SettingsOf(kind) +
          ") throughput in billions of parameters per second: Strata's kernel against a " +
          NameOf(kind) + "-shaped fp32 streaming loop (the memory-bandwidth roofline) and " +
          torch_ref + ", in one run on the same n and threads; each the best of --reps runs. "
          "Exit status: 0 ok, 2 bad arguments.");
  cmd->add_option("--n", args->n, "Parameters, >= 1 (default 67108864 = 64M; needs ~2 GB)")
      ->transform(CLI::AsSizeValue(false))  // "32M": 32 x 2^20, as the help writes it
      ->type_name("N");
  cmd->add_option("--threads", args->threads, "Threads, 0 = all cores (default 0)")->type_name("T");
  cmd->add_option("--reps", args->reps, "Timed repetitions; the best is reported (default 5)")
      ->type_name("R");
  cmd->add_flag("--json", args->json, "Print one JSON object with every figure and the ratios");
  cmd->callback([args, exit_code] { *exit_code = RunBench(*args); });
}

}  // namespace

void RegisterElementwiseCommands(CLI::App& app, int* exit_code) {
  Register(app, exit_code, Kind::kSgd, "sgd");
  Register(app, exit_code, Kind::kAdagrad, "adagrad");
  Register(app, exit_code, Kind::kLion, "lion");
}

}  // namespace strata::swapbench
