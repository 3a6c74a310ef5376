// `strata-swapbench formats`: the CPU Adam's throughput in each optimizer-state layout
// (optim/compact_step.h), each beside its own streaming roofline and beside fp32, in one run on
// the same n and threads:
//   - Strata: AdamStep for fp32 and bf16 moments with an fp32 master (the fast path), and
//     CompactAdamStep for the layouts with a bf16 master or 8-bit moments;
//   - the layout's roofline: a loop over 256-element blocks that reads the gradient and reads
//     and writes the master and both moments, with their bytes in that layout, vectorized per
//     ISA: the memory traffic of the layout with none of its arithmetic.
// Each figure is the best of its repetitions; the variants are interleaved, their order rotated.
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "optim/compact_step.h"
#include "runtime/base/host_info.h"
#include "tools/swapbench/commands.h"

namespace strata::swapbench {
namespace {

struct FormatsArgs {
  int64_t n = 32 << 20;
  int threads = 0;
  int reps = 5;
  std::string isa = "auto";
  bool json = false;
};

struct Layout {
  const char* name;
  optim::MasterFormat master;
  optim::MomentFormat moments;
};

const Layout kLayouts[] = {
    {"fp32 master, fp32 moments", optim::MasterFormat::kFp32, optim::MomentFormat::kFp32},
    {"fp32 master, bf16 moments", optim::MasterFormat::kFp32, optim::MomentFormat::kBf16},
    {"fp32 master, int8 moments", optim::MasterFormat::kFp32, optim::MomentFormat::kInt8},
    {"bf16 master (nearest), bf16 moments", optim::MasterFormat::kBf16Nearest, optim::MomentFormat::kBf16},
    {"bf16 master (stochastic), bf16 moments", optim::MasterFormat::kBf16Stochastic, optim::MomentFormat::kBf16},
    {"bf16 master (stochastic), int8 moments", optim::MasterFormat::kBf16Stochastic, optim::MomentFormat::kInt8},
};

double Seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The layout's traffic: per 256-element block, read the gradient (fp32) and read-modify-write
// the master and both moments in their sizes (a byte-wise add, so any size is exact).
__attribute__((target_clones("avx512f", "avx2", "default"), optimize("O3"))) void
StreamBlock(uint8_t* __restrict p, size_t pb, const uint32_t* __restrict g, size_t n,
            uint8_t* __restrict m, uint8_t* __restrict v, size_t sb) {
  uint32_t acc = 0;  // an integer reduction, which vectorizes (a float sum would not, in order)
  for (size_t i = 0; i < n; ++i) acc |= g[i];
  const auto k = static_cast<uint8_t>(acc != 0);
  for (size_t i = 0; i < pb; ++i) p[i] = static_cast<uint8_t>(p[i] + k);
  for (size_t i = 0; i < sb; ++i) m[i] = static_cast<uint8_t>(m[i] + k);
  for (size_t i = 0; i < sb; ++i) v[i] = static_cast<uint8_t>(v[i] + k);
}

struct Buffers {
  std::vector<uint8_t> master, m, v;
  std::vector<float> grad;
};

// The Strata step of one layout: AdamStep's fast path for an fp32 master with fp32 or bf16
// moments, CompactAdamStep otherwise.
std::function<void()> StrataStep(Buffers* raw, Layout layout, size_t n, tbb::task_arena* arena,
                                  optim::Isa want, optim::Isa* isa, int64_t* step) {
  return [=] {
    optim::AdamParams p;
    p.weight_decay = 0.01;
    p.step = (*step)++;
    optim::AdamOptions o;
    o.arena = arena;
    o.isa = want;
    o.grad_check = optim::GradCheck::kCallerChecked;
    StatusOr<optim::AdamResult> r = optim::AdamResult{};
    if (layout.master == optim::MasterFormat::kFp32 && layout.moments != optim::MomentFormat::kInt8) {
      optim::AdamBuffers ab;
      ab.master = reinterpret_cast<float*>(raw->master.data());
      ab.grad = raw->grad.data();
      ab.exp_avg = raw->m.data();
      ab.exp_avg_sq = raw->v.data();
      ab.state_dtype = layout.moments == optim::MomentFormat::kBf16 ? optim::DType::kBFloat16
                                                                    : optim::DType::kFloat32;
      ab.n = n;
      r = optim::AdamStep(p, ab, 1.0f, o);
    } else {
      optim::CompactAdamBuffers cb;
      cb.master = raw->master.data();
      cb.master_format = layout.master;
      cb.grad = raw->grad.data();
      cb.exp_avg = raw->m.data();
      cb.exp_avg_sq = raw->v.data();
      cb.moment_format = layout.moments;
      cb.n = n;
      cb.rounding_key = optim::RoundingKey(1, p.step);
      r = optim::CompactAdamStep(p, cb, 1.0f, o);
    }
    if (r.ok()) *isa = r->isa;
  };
}

// The layout's roofline: the same blocks' bytes on the same threads, none of the arithmetic.
std::function<void()> Roofline(Buffers* raw, size_t n, tbb::task_arena* arena) {
  return [=] {
    constexpr size_t kBlocksPerTask = 256;  // 64 Ki elements, as the kernels' grain
    const size_t blocks = (n + optim::kInt8Block - 1) / optim::kInt8Block;
    const size_t pb = raw->master.size() / n, sb = raw->m.size() / n;
    arena->execute([&] {
      tbb::parallel_for(
          tbb::blocked_range<size_t>(0, (blocks + kBlocksPerTask - 1) / kBlocksPerTask, 1),
          [&](const tbb::blocked_range<size_t>& br) {
            for (size_t t = br.begin(); t < br.end(); ++t) {
              const size_t b0 = t * kBlocksPerTask * optim::kInt8Block;
              const size_t b1 = std::min(n, b0 + kBlocksPerTask * optim::kInt8Block);
              StreamBlock(raw->master.data() + b0 * pb, (b1 - b0) * pb,
                          reinterpret_cast<const uint32_t*>(raw->grad.data()) + b0, b1 - b0,
                          raw->m.data() + b0 * sb, raw->v.data() + b0 * sb, (b1 - b0) * sb);
            }
          },
          tbb::static_partitioner());
    });
    // The 8-bit scales after the codes: 4 bytes per block, read and written once.
    for (size_t i = sb * n; i < raw->m.size(); ++i) raw->m[i] = static_cast<uint8_t>(raw->m[i] + 1);
    for (size_t i = sb * n; i < raw->v.size(); ++i) raw->v[i] = static_cast<uint8_t>(raw->v[i] + 1);
  };
}

// Best of `reps` timings each, the variants interleaved with their order rotated; the first
// round is a warm-up.
std::vector<double> BestInterleaved(const std::vector<std::function<void()>>& variants, int reps) {
  std::vector<double> best(variants.size(), 1e30);
  for (int r = 0; r <= reps; ++r) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t i = (k + static_cast<size_t>(r)) % variants.size();
      const double t = Seconds(variants[i]);
      if (r > 0) best[i] = std::min(best[i], t);
    }
  }
  return best;
}

void Report(const FormatsArgs& a, int threads, optim::Isa isa, const nlohmann::json& rows) {
  const std::string host = HostDescription();
  if (a.json) {
    nlohmann::json j{{"host", host}, {"isa", optim::IsaName(isa)}, {"threads", threads},
                     {"n", a.n}, {"layouts", rows}};
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("CPU Adam by optimizer-state layout: %s, isa %s, %d thread(s), n = %lld\n\n",
              host.c_str(), optim::IsaName(isa), threads, static_cast<long long>(a.n));
  std::printf("%-40s %9s %11s %8s %12s %11s %8s\n", "layout", "B moved", "G params/s", "GB/s",
              "roofline G/s", "vs roofline", "vs fp32");
  for (const auto& r : rows)
    std::printf("%-40s %9.2f %11.3f %8.1f %12.3f %11.2f %8.2f\n",
                r["layout"].get<std::string>().c_str(), r["bytes_per_param_moved"].get<double>(),
                r["gparams_s"].get<double>(), r["gbps"].get<double>(),
                r["roofline_gparams_s"].get<double>(), r["vs_roofline"].get<double>(),
                r["vs_fp32"].get<double>());
  std::printf("\nB moved: bytes read and written per parameter (master and moments read and "
              "written, the fp32 gradient read).\nroofline: a loop moving the layout's bytes with "
              "none of its arithmetic, on the same threads.\n");
}

int RunFormats(const FormatsArgs& a) {
  if (Status s = CheckKernelBenchSizes(a.n, a.threads, a.reps); !s.ok()) {
    std::fprintf(stderr, "strata-swapbench formats: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  const StatusOr<optim::Isa> want = optim::ParseIsa(a.isa.c_str());
  if (!want.ok()) {
    std::fprintf(stderr, "strata-swapbench formats: --%s\n", std::string(want.status().message()).c_str());
    return 2;
  }
  if (!optim::IsaSupported(*want)) {
    std::fprintf(stderr, "strata-swapbench formats: --isa=%s: this CPU cannot run it; the best it has is %s\n",
                 a.isa.c_str(), optim::IsaName(optim::DetectIsa()));
    return 2;
  }
  const size_t n = static_cast<size_t>(a.n);
  uint64_t buffers = 0;  // every layout's, held at once (Buffers below)
  for (const Layout& l : kLayouts)
    buffers += optim::MasterBytes(l.master, n) + 2 * optim::MomentBytes(l.moments, n) + 4 * n;
  if (Status s = CheckBuffersFit(a.n, buffers); !s.ok()) {
    std::fprintf(stderr, "strata-swapbench formats: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  const int threads = a.threads > 0 ? a.threads : tbb::info::default_concurrency();
  tbb::task_arena arena(threads);
  std::vector<std::function<void()>> variants;  // per layout: Strata's step, then its roofline
  std::vector<std::unique_ptr<Buffers>> bufs;
  std::vector<double> bytes_per_param;
  optim::Isa isa = optim::Isa::kScalar;
  int64_t step = 1;
  for (const Layout& l : kLayouts) {
    auto b = std::make_unique<Buffers>();
    b->master.assign(optim::MasterBytes(l.master, n), 0);
    b->m.assign(optim::MomentBytes(l.moments, n), 0);
    b->v.assign(optim::MomentBytes(l.moments, n), 0);
    b->grad.assign(n, 1e-3f);
    bytes_per_param.push_back(static_cast<double>(2 * b->master.size() + 4 * n + 2 * b->m.size() +
                                                  2 * b->v.size()) / static_cast<double>(n));
    variants.push_back(StrataStep(b.get(), l, n, &arena, *want, &isa, &step));
    variants.push_back(Roofline(b.get(), n, &arena));
    bufs.push_back(std::move(b));
  }
  const std::vector<double> best = BestInterleaved(variants, a.reps);
  const double gp = static_cast<double>(n) / 1e9;
  nlohmann::json rows = nlohmann::json::array();
  for (size_t l = 0; l < std::size(kLayouts); ++l) {
    const double rate = gp / best[2 * l], roof = gp / best[2 * l + 1];
    rows.push_back({{"layout", kLayouts[l].name},
                    {"master", optim::MasterFormatName(kLayouts[l].master)},
                    {"moments", optim::MomentFormatName(kLayouts[l].moments)},
                    {"bytes_per_param_moved", bytes_per_param[l]},
                    {"gparams_s", rate},
                    {"gbps", rate * bytes_per_param[l]},
                    {"roofline_gparams_s", roof},
                    {"vs_roofline", rate / roof},
                    {"vs_fp32", rate * best[0] / gp}});
  }
  Report(a, threads, isa, rows);
  return 0;
}

}  // namespace

void RegisterFormatsCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<FormatsArgs>();
  CLI::App* cmd = app.add_subcommand(
      "formats",
      "CPU Adam throughput in each optimizer-state layout (fp32 or bf16 master, fp32, bf16 or "
      "8-bit moments, nearest or stochastic rounding), each against a streaming loop that moves "
      "that layout's bytes (its roofline) and against fp32, in one run on the same n and "
      "threads; each the best of --reps runs, interleaved. Exit status: 0 ok, 2 bad arguments.");
  cmd->add_option("--n", args->n, "Parameters, >= 1 (default 33554432 = 32M; needs ~2.5 GB)")
      ->transform(CLI::AsSizeValue(false))  // "32M": 32 x 2^20, as the help writes it
      ->type_name("N");
  cmd->add_option("--threads", args->threads, "Threads, 0 = all cores (default 0)")->type_name("T");
  cmd->add_option("--reps", args->reps, "Timed repetitions; the best is reported (default 5)")
      ->type_name("R");
  cmd->add_option("--isa", args->isa,
                  "Kernels: auto, scalar, avx2, avx512, avx512_bf16 (default auto: the best this CPU has)")
      ->type_name("ISA");
  cmd->add_flag("--json", args->json, "Print one JSON object with every figure and the ratios");
  cmd->callback([args, exit_code] { *exit_code = RunFormats(*args); });
}

}  // namespace strata::swapbench
