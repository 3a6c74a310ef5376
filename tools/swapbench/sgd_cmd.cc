// `strata-swapbench sgd`: CPU SGD (momentum) throughput against its two references, in one run
// on the same n and thread count:
//   - the roofline: an SGD-shaped streaming loop (read p, g, buf; write p, buf; fp32, 20 B per
//     parameter) with the same arithmetic count, vectorized by the compiler per ISA;
//   - LibTorch's torch::optim::SGD (momentum 0.9) on one flat parameter of n elements.
// Each figure is the best of its repetitions, the variants interleaved and their order rotated.
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "optim/cpu_sgd.h"
#include "runtime/host_info.h"
#include "tools/swapbench/commands.h"

namespace strata::swapbench {
namespace {

struct SgdArgs {
  int64_t n = 64 << 20;
  int threads = 0;
  int reps = 5;
  bool json = false;
};

// Plain C++ moving SGD's bytes with SGD's operations; O3 clones per ISA, as adam_cmd.cc's
// roofline, so the reference is memory-bound rather than instruction-bound.
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void SgdStreamingLoop(
    float* __restrict p, const float* __restrict g, float* __restrict m, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float b = 0.9f * m[i] + g[i];
    m[i] = b;
    p[i] = p[i] - 1e-7f * b;
  }
}

double Seconds(const std::function<void()>& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int RunSgd(const SgdArgs& a) {
  if (a.n < 1 || a.reps < 1 || a.threads < 0) {
    std::cerr << "strata-swapbench sgd: --n and --reps must be >= 1 and --threads >= 0\n";
    return 2;
  }
  const size_t n = static_cast<size_t>(a.n);
  const int threads = a.threads > 0 ? a.threads : tbb::info::default_concurrency();
  tbb::task_arena arena(threads);
  torch::set_num_threads(threads);
  std::vector<float> p(n), g(n), m(n), rp(n), rg(n), rm(n);
  for (size_t i = 0; i < n; ++i) {
    const float x = static_cast<float>((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
    p[i] = rp[i] = x;
    g[i] = rg[i] = 0.01f * x;
  }
  torch::Tensor tp = torch::from_blob(p.data(), {a.n}, torch::kFloat32).clone();
  tp.set_requires_grad(true);
  tp.mutable_grad() = torch::from_blob(g.data(), {a.n}, torch::kFloat32).clone();
  torch::optim::SGD torch_sgd(std::vector<torch::Tensor>{tp},
                              torch::optim::SGDOptions(1e-3).momentum(0.9));
  optim::SgdParams sp;
  sp.lr = 1e-3;
  sp.momentum = 0.9;
  optim::SgdOptions so;
  so.arena = &arena;
  optim::Isa isa = optim::Isa::kScalar;
  std::vector<std::function<void()>> variants = {
      [&] {
        auto got = optim::SgdStep(sp, {p.data(), g.data(), m.data(), nullptr,
                                       optim::DType::kBFloat16, n}, 1.0f, so);
        if (got.ok()) isa = *got;
        sp.first = false;
      },
      [&] {
        constexpr size_t kGrain = 64 * 1024;
        const size_t blocks = (n + kGrain - 1) / kGrain;
        arena.execute([&] {
          tbb::parallel_for(tbb::blocked_range<size_t>(0, blocks, 1),
                            [&](const tbb::blocked_range<size_t>& br) {
                              SgdStreamingLoop(rp.data(), rg.data(), rm.data(), br.begin() * kGrain,
                                               std::min(n, br.end() * kGrain));
                            },
                            tbb::static_partitioner());
        });
      },
      [&] { torch_sgd.step(); },
  };
  // Best of --reps per variant. Which variant runs first in a repetition was measured to matter
  // (about 20 % on a 2-core VM), so the order rotates from one repetition to the next; the
  // first repetition warms up and is not counted.
  std::vector<double> best(variants.size(), 1e30);
  const int rounds = (a.reps + 1) * static_cast<int>(variants.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = (k + r) % variants.size();
      const double t = Seconds(variants[v]);
      if (r >= static_cast<int>(variants.size())) best[v] = std::min(best[v], t);
    }
  }
  const double strata_s = best[0], roof_s = best[1], torch_s = best[2];
  const double gp = static_cast<double>(n) / 1e9;
  const std::string host = HostDescription();
  if (a.json) {
    nlohmann::json j{{"host", host},
                     {"isa", optim::IsaName(isa)},
                     {"threads", threads},
                     {"n", a.n},
                     {"strata_gparams_s", gp / strata_s},
                     {"roofline_gparams_s", gp / roof_s},
                     {"libtorch_sgd_gparams_s", gp / torch_s},
                     {"strata_over_roofline", roof_s / strata_s},
                     {"strata_over_libtorch", torch_s / strata_s}};
    std::cout << j.dump() << "\n";
  } else {
    std::printf("%s; %d thread(s); n=%lld; SGD momentum 0.9, fp32, 20 B/param\n", host.c_str(),
                threads, static_cast<long long>(a.n));
    std::printf("  strata SGD (%s)   %7.3f G params/s  %6.1f GB/s\n", optim::IsaName(isa),
                gp / strata_s, gp * 20 / strata_s);
    std::printf("  roofline stream   %7.3f G params/s  %6.1f GB/s\n", gp / roof_s, gp * 20 / roof_s);
    std::printf("  LibTorch SGD      %7.3f G params/s\n", gp / torch_s);
    std::printf("  strata / roofline %.2f, strata / LibTorch %.2f\n", roof_s / strata_s,
                torch_s / strata_s);
  }
  return 0;
}

}  // namespace

void RegisterSgdCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<SgdArgs>();
  CLI::App* cmd = app.add_subcommand(
      "sgd",
      "CPU SGD (momentum 0.9) throughput in billions of parameters per second: Strata's SgdStep "
      "against an SGD-shaped fp32 streaming loop (the memory-bandwidth roofline) and LibTorch's "
      "torch::optim::SGD, in one run on the same n and threads; each the best of --reps runs. "
      "Exit status: 0 ok, 2 bad arguments.");
  cmd->add_option("--n", args->n, "Parameters, >= 1 (default 67108864 = 64M; needs ~2 GB)")
      ->type_name("N");
  cmd->add_option("--threads", args->threads, "Threads, 0 = all cores (default 0)")->type_name("T");
  cmd->add_option("--reps", args->reps, "Timed repetitions; the best is reported (default 5)")
      ->type_name("R");
  cmd->add_flag("--json", args->json, "Print one JSON object with every figure and the ratios");
  cmd->callback([args, exit_code] { *exit_code = RunSgd(*args); });
}

}  // namespace strata::swapbench
