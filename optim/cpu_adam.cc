// Validation, ISA dispatch and threading for the CPU Adam. Compiled for baseline x86-64: the
// vector kernels live in their own files and run only after the cpuid checks here.
#include "optim/cpu_adam.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/parallel_reduce.h>
#include <tbb/partitioner.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "optim/adam_kernels.h"
#include "runtime/base/check.h"
#include "runtime/base/env_vars.h"
#include "runtime/base/cpu_features.h"
#include "runtime/base/logging.h"

namespace strata::optim {

// STRATA_ADAM_ISA: force a kernel ("scalar", "avx2", "avx512", "avx512_bf16") for kAuto.
constexpr const char* kIsaEnv = kEnvAdamIsa.name;
// STRATA_ADAM_PREFETCH: "0" or "1" overrides DefaultAvx512Prefetch.
constexpr const char* kPrefetchEnv = kEnvAdamPrefetch.name;

// Note [grain]
// 64 Ki elements per task: with fp32 everything a task streams ~1.8 MB, so TBB's per-task cost
// (~1 us) is < 0.1 % of the task, while a 64M-element step still splits into ~1000 tasks. The
// static partitioner hands each thread one contiguous run of tasks, which keeps every stream
// sequential for the hardware prefetchers. Task boundaries are multiples of 64 elements, i.e.
// whole cache lines for both 4- and 2-byte buffers.
constexpr size_t kDefaultGrain = 64 * 1024;
constexpr size_t kGrainAlign = 64;

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kFloat32: return "fp32";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat16: return "fp16";
  }
  return "unknown";
}

size_t DTypeSize(DType t) { return t == DType::kFloat32 ? 4 : 2; }

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAuto: return "auto";
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
  }
  return "unknown";
}

StatusOr<Isa> ParseIsa(const char* name) {
  for (Isa isa : {Isa::kAuto, Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (name != nullptr && std::strcmp(name, IsaName(isa)) == 0) return isa;
  }
  return InvalidArgument(StrCat("isa=\"", name ? name : "(null)",
                                "\": expected auto, scalar, avx2, avx512 or avx512_bf16"));
}

bool IsaSupported(Isa isa) {
  // Cpu() also checks that the OS saves the wider registers (XCR0).
  const CpuFeatures& f = Cpu();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  const bool avx512 = f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq;
  switch (isa) {
    case Isa::kAuto:
    case Isa::kScalar: return true;
    case Isa::kAvx2: return avx2;
    case Isa::kAvx512: return avx512;
    case Isa::kAvx512Bf16: return avx512 && f.avx512_bf16;
  }
  return false;
}

Isa DetectIsa() {
  for (Isa isa : {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2}) {
    if (IsaSupported(isa)) return isa;
  }
  return Isa::kScalar;
}

bool DefaultAvx512Prefetch() {
  static const bool use = [] {
    if (const char* e = GetEnv(kEnvAdamPrefetch); e != nullptr && *e != '\0') {
      if ((e[0] == '0' || e[0] == '1') && e[1] == '\0') return e[0] == '1';
      STRATA_LOG(WARN) << kPrefetchEnv << "=" << e << ": expected 0 or 1; ignoring it";
    }
    __builtin_cpu_init();
    // Family 19h is Zen 3 and Zen 4; only Zen 4 has AVX-512, so only it reaches this kernel.
    return !__builtin_cpu_is("amdfam19h");
  }();
  return use;
}

Isa ResolveAutoIsa() {
  static const Isa resolved = [] {
    const char* env = GetEnv(kEnvAdamIsa);
    if (env != nullptr && *env != '\0') {
      StatusOr<Isa> parsed = ParseIsa(env);
      if (!parsed.ok()) {
        STRATA_LOG(WARN) << kIsaEnv << ": " << parsed.status().message() << "; ignoring it";
      } else if (*parsed != Isa::kAuto && !IsaSupported(*parsed)) {
        STRATA_LOG(WARN) << kIsaEnv << "=" << env << ": this CPU cannot run it; using "
                         << IsaName(DetectIsa());
      } else if (*parsed != Isa::kAuto) {
        return *parsed;
      }
    }
    return DetectIsa();
  }();
  return resolved;
}

namespace {

StatusOr<Isa> ResolveIsa(Isa requested) {
  if (requested == Isa::kAuto) return ResolveAutoIsa();
  if (!IsaSupported(requested)) {
    return InvalidArgument(StrCat("isa=", IsaName(requested), ": this CPU does not support it (best: ",
                                  IsaName(DetectIsa()), "); pass Isa::kAuto"));
  }
  return requested;
}

size_t GrainOf(const AdamOptions& o) {
  const size_t g = o.grain == 0 ? kDefaultGrain : o.grain;
  return (g + kGrainAlign - 1) / kGrainAlign * kGrainAlign;
}

template <typename F>
void InArena(tbb::task_arena* arena, F&& f) {
  if (arena != nullptr) {
    arena->execute(f);
  } else {
    f();
  }
}

// Calls body(begin, end) over [0, n) in grain-sized pieces, in parallel when there is more
// than one piece.
template <typename Body>
void ParallelBlocks(size_t n, size_t grain, tbb::task_arena* arena, const Body& body) {
  const size_t blocks = (n + grain - 1) / grain;
  if (blocks <= 1) {
    body(size_t{0}, n);
    return;
  }
  InArena(arena, [&] {
    tbb::parallel_for(
        tbb::blocked_range<size_t>(0, blocks, 1),
        [&](const tbb::blocked_range<size_t>& r) {
          body(r.begin() * grain, std::min(n, r.end() * grain));
        },
        tbb::static_partitioner());
  });
}

internal::GradStatsFn StatsKernel(Isa isa, DType grad) {
  switch (isa) {
    case Isa::kAvx512:
    case Isa::kAvx512Bf16: return internal::GetGradStatsAvx512(grad);
    case Isa::kAvx2: return internal::GetGradStatsAvx2(grad);
    default: return internal::GetGradStatsScalar(grad);
  }
}

Status CheckGradDtype(DType t) {
  STRATA_CHECK(t == DType::kFloat32 || t == DType::kBFloat16 || t == DType::kFloat16,
               "grad dtype=", static_cast<int>(t), ": must be fp32, bf16 or fp16");
  return Status::Ok();
}

StatusOr<GradStats> RunStats(Isa isa, const void* grad, DType grad_dtype, size_t n, float scale,
                             size_t grain, tbb::task_arena* arena) {
  GradStats out;
  if (n == 0) return out;
  internal::GradStatsFn fn = StatsKernel(isa, grad_dtype);
  STRATA_DCHECK(fn != nullptr, "no grad-stats kernel for ", DTypeName(grad_dtype));
  const size_t blocks = (n + grain - 1) / grain;
  internal::GradPartial total;
  if (blocks <= 1) {
    total = fn(grad, scale, 0, n);
  } else {
    InArena(arena, [&] {
      // Deterministic reduce: the split tree depends only on the block count, so the sum is
      // the same from run to run whatever the thread timing.
      total = tbb::parallel_deterministic_reduce(
          tbb::blocked_range<size_t>(0, blocks, 1), internal::GradPartial{},
          [&](const tbb::blocked_range<size_t>& r, internal::GradPartial acc) {
            for (size_t b = r.begin(); b < r.end(); ++b) {
              const internal::GradPartial p = fn(grad, scale, b * grain, std::min(n, (b + 1) * grain));
              acc.sum_sq += p.sum_sq;
              acc.nonfinite = acc.nonfinite || p.nonfinite;
            }
            return acc;
          },
          [](internal::GradPartial a, const internal::GradPartial& b) {
            a.sum_sq += b.sum_sq;
            a.nonfinite = a.nonfinite || b.nonfinite;
            return a;
          });
    });
  }
  out.found_nonfinite = total.nonfinite;
  out.sum_sq = total.nonfinite ? 0.0 : total.sum_sq;
  return out;
}

bool Finite(double x) { return std::isfinite(x); }

Status ValidateParams(const AdamParams& p, float grad_scale) {
  STRATA_CHECK(Finite(p.lr) && p.lr >= 0, "adam lr=", p.lr, ": must be finite and >= 0");
  STRATA_CHECK(Finite(p.beta1) && p.beta1 >= 0 && p.beta1 < 1, "adam beta1=", p.beta1,
               ": must be in [0, 1), e.g. 0.9");
  STRATA_CHECK(Finite(p.beta2) && p.beta2 >= 0 && p.beta2 < 1, "adam beta2=", p.beta2,
               ": must be in [0, 1), e.g. 0.999");
  STRATA_CHECK(Finite(p.eps) && p.eps > 0, "adam eps=", p.eps, ": must be finite and > 0, e.g. 1e-8");
  STRATA_CHECK(Finite(p.weight_decay) && p.weight_decay >= 0, "adam weight_decay=",
               p.weight_decay, ": must be finite and >= 0");
  STRATA_CHECK(!p.bias_correction || p.step >= 1, "adam step=", p.step,
               ": must be >= 1 (the first update is step 1) when bias_correction is on");
  STRATA_CHECK(std::isfinite(grad_scale) && grad_scale >= 0, "adam grad_scale=", grad_scale,
               ": must be finite and >= 0 (it is clip_coef / loss_scale)");
  return Status::Ok();
}

Status ValidateBuffers(const AdamBuffers& b) {
  STRATA_RETURN_IF_ERROR(CheckGradDtype(b.grad_dtype));
  STRATA_CHECK(b.state_dtype == DType::kFloat32 || b.state_dtype == DType::kBFloat16,
               "adam state dtype=", DTypeName(b.state_dtype),
               ": exp_avg/exp_avg_sq must be fp32 or bf16 (fp16's range is too small for exp_avg_sq)");
  if (b.param16 != nullptr) {
    STRATA_CHECK(b.param16_dtype == DType::kBFloat16 || b.param16_dtype == DType::kFloat16,
                 "adam param16 dtype=", DTypeName(b.param16_dtype),
                 ": must be bf16 or fp16 (pass param16=nullptr for no 16-bit copy)");
  }
  if (b.n == 0) return Status::Ok();
  STRATA_CHECK(b.master != nullptr, "adam master is null with n=", b.n);
  STRATA_CHECK(b.grad != nullptr, "adam grad is null with n=", b.n);
  STRATA_CHECK(b.exp_avg != nullptr, "adam exp_avg is null with n=", b.n);
  STRATA_CHECK(b.exp_avg_sq != nullptr, "adam exp_avg_sq is null with n=", b.n);
  return Status::Ok();
}

}  // namespace

internal::AdamConsts internal::MakeAdamConsts(const AdamParams& p, float grad_scale) {
  internal::AdamConsts c{};
  double bc1 = 1.0, bc2 = 1.0;
  if (p.bias_correction) {
    bc1 = 1.0 - std::pow(p.beta1, static_cast<double>(p.step));
    bc2 = 1.0 - std::pow(p.beta2, static_cast<double>(p.step));
  }
  c.grad_scale = grad_scale;
  c.beta1 = static_cast<float>(p.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - p.beta1);
  c.beta2 = static_cast<float>(p.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - p.beta2);
  c.eps = static_cast<float>(p.eps);
  c.neg_step_size = static_cast<float>(-p.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.has_l2 = !p.adamw && p.weight_decay != 0;
  c.l2 = c.has_l2 ? static_cast<float>(p.weight_decay) : 0.0f;
  c.has_decay = p.adamw && p.weight_decay != 0;
  c.decay = c.has_decay ? static_cast<float>(1.0 - p.lr * p.weight_decay) : 1.0f;
  return c;
}

StatusOr<GradStats> UnscaleCheckNorm(const void* grad, DType grad_dtype, size_t n, float scale,
                                     const AdamOptions& options) {
  STRATA_RETURN_IF_ERROR(CheckGradDtype(grad_dtype));
  STRATA_CHECK(n == 0 || grad != nullptr, "grad is null with n=", n);
  STRATA_CHECK(std::isfinite(scale), "grad scale=", scale, ": must be finite");
  STRATA_ASSIGN_OR_RETURN(const Isa isa, ResolveIsa(options.isa));
  return RunStats(isa, grad, grad_dtype, n, scale, GrainOf(options), options.arena);
}

float CombinedGradScale(double global_sum_sq, double max_norm, double inv_loss_scale) {
  if (max_norm <= 0) return static_cast<float>(inv_loss_scale);
  const double clip = (std::sqrt(global_sum_sq) + 1e-6) / max_norm;
  return static_cast<float>(clip > 1 ? inv_loss_scale / clip : inv_loss_scale);
}

namespace internal {

AdamKernelFn PickAdamKernel(Isa isa, DType grad, DType state, P16 p16, bool prefetch) {
  switch (isa) {
    case Isa::kAvx512Bf16:
    case Isa::kAvx512:
      return GetAdamKernelAvx512(grad, state, p16, isa == Isa::kAvx512Bf16, prefetch);
    case Isa::kAvx2:
      return GetAdamKernelAvx2(grad, state, p16);
    default:
      return GetAdamKernelScalar(grad, state, p16);
  }
}

}  // namespace internal

StatusOr<AdamResult> AdamStep(const AdamParams& params, const AdamBuffers& bufs, float grad_scale,
                              const AdamOptions& options) {
  STRATA_RETURN_IF_ERROR(ValidateParams(params, grad_scale));
  STRATA_RETURN_IF_ERROR(ValidateBuffers(bufs));
  AdamResult result;
  STRATA_ASSIGN_OR_RETURN(result.isa, ResolveIsa(options.isa));
  if (bufs.n == 0) return result;
  const size_t grain = GrainOf(options);

  if (options.grad_check == GradCheck::kScanFirst) {
    STRATA_ASSIGN_OR_RETURN(const GradStats stats, RunStats(result.isa, bufs.grad, bufs.grad_dtype,
                                                            bufs.n, grad_scale, grain, options.arena));
    if (stats.found_nonfinite) {
      result.skipped = true;
      return result;
    }
  }

  internal::P16 p16 = internal::P16::kNone;
  if (bufs.param16 != nullptr) {
    p16 = bufs.param16_dtype == DType::kBFloat16 ? internal::P16::kBf16 : internal::P16::kFp16;
  }
  if (result.isa == Isa::kAvx512 || result.isa == Isa::kAvx512Bf16)
    result.prefetch = options.prefetch == SoftwarePrefetch::kAuto
                          ? DefaultAvx512Prefetch()
                          : options.prefetch == SoftwarePrefetch::kOn;
  const internal::AdamKernelFn kernel =
      internal::PickAdamKernel(result.isa, bufs.grad_dtype, bufs.state_dtype, p16, result.prefetch);
  STRATA_DCHECK(kernel != nullptr, "no adam kernel for grad=", DTypeName(bufs.grad_dtype),
                " state=", DTypeName(bufs.state_dtype));

  internal::AdamKernelArgs args{};
  args.c = internal::MakeAdamConsts(params, grad_scale);
  args.master = bufs.master;
  args.grad = bufs.grad;
  args.exp_avg = bufs.exp_avg;
  args.exp_avg_sq = bufs.exp_avg_sq;
  args.param16 = bufs.param16;
  ParallelBlocks(bufs.n, grain, options.arena,
                 [&](size_t begin, size_t end) { kernel(args, begin, end); });
  return result;
}

}  // namespace strata::optim
