// Validation and dispatch: every public call checks its arguments here, once, then hands them
// to the CPU twin or the CUDA launcher, so both backends share one contract and one set of
// error messages.
#include "kernels/kernels.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kernels/internal.h"
#include "optim/compact_formats.h"
#include "runtime/base/check.h"

namespace strata::kernels {

const char* BackendName(Backend backend) {
  switch (backend) {
    case Backend::kCpu: return "cpu";
    case Backend::kCuda: return "cuda";
  }
  return "unknown";
}

namespace {

Status CheckBackend(Backend backend) {
  STRATA_CHECK(backend == Backend::kCpu || backend == Backend::kCuda, "kernels backend=",
               static_cast<int>(backend), ": must be Backend::kCpu or Backend::kCuda");
  return Status::Ok();
}

bool Is16(DType t) { return t == DType::kBFloat16 || t == DType::kFloat16; }

Status CheckGradDtype(DType t) {
  STRATA_CHECK(t == DType::kFloat32 || Is16(t), "grad dtype=", static_cast<int>(t),
               ": must be fp32, bf16 or fp16");
  return Status::Ok();
}

bool Finite(double x) { return std::isfinite(x); }

// The same rules, in the same words, as optim::AdamStep (optim/cpu_adam.cc).
Status ValidateAdam(const optim::AdamParams& p, const optim::AdamBuffers& b, float grad_scale) {
  STRATA_CHECK(Finite(p.lr) && p.lr >= 0, "adam lr=", p.lr, ": must be finite and >= 0");
  STRATA_CHECK(Finite(p.beta1) && p.beta1 >= 0 && p.beta1 < 1, "adam beta1=", p.beta1,
               ": must be in [0, 1), e.g. 0.9");
  STRATA_CHECK(Finite(p.beta2) && p.beta2 >= 0 && p.beta2 < 1, "adam beta2=", p.beta2,
               ": must be in [0, 1), e.g. 0.999");
  STRATA_CHECK(Finite(p.eps) && p.eps > 0, "adam eps=", p.eps,
               ": must be finite and > 0, e.g. 1e-8");
  STRATA_CHECK(Finite(p.weight_decay) && p.weight_decay >= 0, "adam weight_decay=",
               p.weight_decay, ": must be finite and >= 0");
  STRATA_CHECK(!p.bias_correction || p.step >= 1, "adam step=", p.step,
               ": must be >= 1 (the first update is step 1) when bias_correction is on");
  STRATA_CHECK(std::isfinite(grad_scale) && grad_scale >= 0, "adam grad_scale=", grad_scale,
               ": must be finite and >= 0 (it is clip_coef / loss_scale)");
  STRATA_RETURN_IF_ERROR(CheckGradDtype(b.grad_dtype));
  STRATA_CHECK(b.state_dtype == DType::kFloat32 || b.state_dtype == DType::kBFloat16,
               "adam state dtype=", optim::DTypeName(b.state_dtype),
               ": exp_avg/exp_avg_sq must be fp32 or bf16 (fp16's range is too small for "
               "exp_avg_sq)");
  if (b.param16 != nullptr) {
    STRATA_CHECK(Is16(b.param16_dtype), "adam param16 dtype=", optim::DTypeName(b.param16_dtype),
                 ": must be bf16 or fp16 (pass param16=nullptr for no 16-bit copy)");
  }
  if (b.n == 0) return Status::Ok();
  STRATA_CHECK(b.master != nullptr, "adam master is null with n=", b.n);
  STRATA_CHECK(b.grad != nullptr, "adam grad is null with n=", b.n);
  STRATA_CHECK(b.exp_avg != nullptr, "adam exp_avg is null with n=", b.n);
  STRATA_CHECK(b.exp_avg_sq != nullptr, "adam exp_avg_sq is null with n=", b.n);
  return Status::Ok();
}

// Turns a slot list into byte copies (and, for a pack, zero fills of the gaps), after checking
// that every slot lies inside the chunk and no two overlap.
StatusOr<std::vector<internal::CopySegment>> PlanChunk(const std::vector<ChunkSlot>& slots,
                                                       size_t elem_size, const void* chunk,
                                                       size_t chunk_numel, bool pack) {
  STRATA_CHECK(elem_size == 1 || elem_size == 2 || elem_size == 4 || elem_size == 8,
               "chunk elem_size=", elem_size, ": must be 1, 2, 4 or 8 bytes");
  STRATA_CHECK(chunk_numel <= std::numeric_limits<size_t>::max() / elem_size, "chunk_numel=",
               chunk_numel, " with elem_size=", elem_size, ": the byte size overflows");
  STRATA_CHECK(chunk_numel == 0 || chunk != nullptr, "chunk is null with chunk_numel=",
               chunk_numel);
  for (size_t k = 0; k < slots.size(); ++k) {
    const ChunkSlot& s = slots[k];
    STRATA_CHECK(s.numel == 0 || s.tensor != nullptr, "chunk slot ", k, ": tensor is null with numel=",
                 s.numel);
    STRATA_CHECK(s.offset <= chunk_numel && s.numel <= chunk_numel - s.offset, "chunk slot ", k,
                 ": elements [", s.offset, ", ", s.offset + s.numel,
                 ") reach past the chunk's ", chunk_numel, " elements");
  }
  std::vector<size_t> order(slots.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return slots[a].offset < slots[b].offset; });

  auto* base = static_cast<unsigned char*>(const_cast<void*>(chunk));
  std::vector<internal::CopySegment> segs;
  segs.reserve(2 * slots.size() + 1);
  size_t cursor = 0;  // first element not yet covered, in offset order
  size_t prev = 0;    // slot that ended at cursor (for the overlap message)
  for (size_t k : order) {
    const ChunkSlot& s = slots[k];
    if (s.numel == 0) continue;
    STRATA_CHECK(s.offset >= cursor, "chunk slot ", k, " (elements [", s.offset, ", ",
                 s.offset + s.numel, ")) overlaps slot ", prev, " which ends at ", cursor);
    if (pack && s.offset > cursor) {
      segs.push_back({nullptr, base + cursor * elem_size, (s.offset - cursor) * elem_size});
    }
    unsigned char* in_chunk = base + s.offset * elem_size;
    if (pack) {
      segs.push_back({s.tensor, in_chunk, s.numel * elem_size});
    } else {
      segs.push_back({in_chunk, s.tensor, s.numel * elem_size});
    }
    cursor = s.offset + s.numel;
    prev = k;
  }
  if (pack && cursor < chunk_numel) {
    segs.push_back({nullptr, base + cursor * elem_size, (chunk_numel - cursor) * elem_size});
  }
  return segs;
}

Status RunSegments(Backend backend, const std::vector<internal::CopySegment>& segs,
                   StreamHandle stream) {
  if (segs.empty()) return Status::Ok();
  if (backend == Backend::kCpu) {
    internal::CpuCopySegments(segs.data(), segs.size());
    return Status::Ok();
  }
  return internal::CudaCopySegments(segs.data(), segs.size(), stream);
}

}  // namespace

Status CastFp32To16(Backend backend, const float* src, void* dst, DType dst_dtype, size_t n,
                    StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_CHECK(Is16(dst_dtype), "cast dst dtype=", optim::DTypeName(dst_dtype),
               ": must be bf16 or fp16");
  STRATA_CHECK(n == 0 || (src != nullptr && dst != nullptr), "cast with n=", n,
               " has a null src or dst");
  if (n == 0) return Status::Ok();
  if (backend == Backend::kCpu) {
    internal::CpuCastFp32To16(src, dst, dst_dtype, n);
    return Status::Ok();
  }
  return internal::CudaCastFp32To16(src, dst, dst_dtype, n, stream);
}

Status Cast16ToFp32(Backend backend, const void* src, DType src_dtype, float* dst, size_t n,
                    StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_CHECK(Is16(src_dtype), "cast src dtype=", optim::DTypeName(src_dtype),
               ": must be bf16 or fp16");
  STRATA_CHECK(n == 0 || (src != nullptr && dst != nullptr), "cast with n=", n,
               " has a null src or dst");
  if (n == 0) return Status::Ok();
  if (backend == Backend::kCpu) {
    internal::CpuCast16ToFp32(src, src_dtype, dst, n);
    return Status::Ok();
  }
  return internal::CudaCast16ToFp32(src, src_dtype, dst, n, stream);
}

Status ResetGradStats(Backend backend, GradStatsAccumulator* acc, StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_CHECK(acc != nullptr, "grad stats accumulator is null");
  if (backend == Backend::kCpu) {
    acc->sum_sq = 0.0;
    acc->found_nonfinite = 0;
    return Status::Ok();
  }
  return internal::CudaResetGradStats(acc, stream);
}

Status AccumulateGradStats(Backend backend, const void* grad, DType grad_dtype, size_t n,
                           float scale, GradStatsAccumulator* acc, StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_RETURN_IF_ERROR(CheckGradDtype(grad_dtype));
  STRATA_CHECK(acc != nullptr, "grad stats accumulator is null");
  STRATA_CHECK(n == 0 || grad != nullptr, "grad is null with n=", n);
  STRATA_CHECK(std::isfinite(scale), "grad scale=", scale, ": must be finite");
  if (n == 0) return Status::Ok();
  if (backend == Backend::kCpu) {
    internal::CpuAccumulateGradStats(grad, grad_dtype, n, scale, acc);
    return Status::Ok();
  }
  return internal::CudaAccumulateGradStats(grad, grad_dtype, n, scale, acc, stream);
}

StatusOr<optim::GradStats> ReadGradStats(Backend backend, const GradStatsAccumulator* acc,
                                         StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_CHECK(acc != nullptr, "grad stats accumulator is null");
  double sum_sq = 0.0;
  uint32_t flag = 0;
  if (backend == Backend::kCpu) {
    sum_sq = acc->sum_sq;
    flag = acc->found_nonfinite;
  } else {
    STRATA_RETURN_IF_ERROR(internal::CudaReadGradStats(acc, &sum_sq, &flag, stream));
  }
  optim::GradStats out;
  out.found_nonfinite = flag != 0;
  out.sum_sq = out.found_nonfinite ? 0.0 : sum_sq;
  return out;
}

StatusOr<optim::GradStats> UnscaleCheckNorm(Backend backend, const void* grad, DType grad_dtype,
                                            size_t n, float scale, StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  if (backend == Backend::kCpu) {
    GradStatsAccumulator acc;
    STRATA_RETURN_IF_ERROR(ResetGradStats(backend, &acc));
    STRATA_RETURN_IF_ERROR(AccumulateGradStats(backend, grad, grad_dtype, n, scale, &acc));
    return ReadGradStats(backend, &acc);
  }
  // Validate before allocating so bad arguments cost no device memory.
  STRATA_RETURN_IF_ERROR(CheckGradDtype(grad_dtype));
  STRATA_CHECK(n == 0 || grad != nullptr, "grad is null with n=", n);
  STRATA_CHECK(std::isfinite(scale), "grad scale=", scale, ": must be finite");
  if (n == 0) return optim::GradStats{};
  GradStatsAccumulator* acc = nullptr;
  STRATA_RETURN_IF_ERROR(internal::CudaAllocAccumulator(&acc, stream));
  Status s = ResetGradStats(backend, acc, stream);
  if (s.ok()) s = AccumulateGradStats(backend, grad, grad_dtype, n, scale, acc, stream);
  StatusOr<optim::GradStats> result = s.ok() ? ReadGradStats(backend, acc, stream) : s;
  const Status freed = internal::CudaFreeAccumulator(acc, stream);
  if (result.ok() && !freed.ok()) return freed;
  return result;
}

Status AdamStep(Backend backend, const optim::AdamParams& params, const optim::AdamBuffers& bufs,
                float grad_scale, const GradStatsAccumulator* skip_if_nonfinite,
                StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_RETURN_IF_ERROR(ValidateAdam(params, bufs, grad_scale));
  if (bufs.n == 0) return Status::Ok();
  if (backend == Backend::kCpu) {
    return internal::CpuAdamStep(params, bufs, grad_scale, skip_if_nonfinite);
  }
  internal::AdamLaunch launch{};
  launch.c = optim::internal::MakeAdamConsts(params, grad_scale);
  launch.master = bufs.master;
  launch.grad = bufs.grad;
  launch.grad_dtype = bufs.grad_dtype;
  launch.exp_avg = bufs.exp_avg;
  launch.exp_avg_sq = bufs.exp_avg_sq;
  launch.state_dtype = bufs.state_dtype;
  launch.param16 = bufs.param16;
  launch.param16_dtype = bufs.param16_dtype;
  launch.n = bufs.n;
  launch.skip_if_nonfinite = skip_if_nonfinite;
  return internal::CudaAdamStep(launch, stream);
}

Status PackChunk(Backend backend, const std::vector<ChunkSlot>& slots, size_t elem_size,
                 void* chunk, size_t chunk_numel, StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_ASSIGN_OR_RETURN(const std::vector<internal::CopySegment> segs,
                          PlanChunk(slots, elem_size, chunk, chunk_numel, /*pack=*/true));
  return RunSegments(backend, segs, stream);
}

Status UnpackChunk(Backend backend, const void* chunk, size_t chunk_numel,
                   const std::vector<ChunkSlot>& slots, size_t elem_size, StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_ASSIGN_OR_RETURN(const std::vector<internal::CopySegment> segs,
                          PlanChunk(slots, elem_size, chunk, chunk_numel, /*pack=*/false));
  return RunSegments(backend, segs, stream);
}

namespace {
internal::ElementwiseLaunch ElementwiseOf(internal::ElementwiseRule rule, float* master,
                                          const float* grad, float* state, void* param16,
                                          DType param16_dtype, size_t n) {
  internal::ElementwiseLaunch a{};
  a.rule = rule;
  a.master = master;
  a.grad = grad;
  a.state = state;
  a.param16 = param16;
  a.param16_dtype = param16_dtype;
  a.n = n;
  return a;
}
}  // namespace

Status SgdStep(Backend backend, const optim::SgdParams& params, const optim::SgdBuffers& bufs,
               float grad_scale, StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_RETURN_IF_ERROR(optim::CheckSgdArguments(params, bufs, grad_scale));
  if (bufs.n == 0) return Status::Ok();
  if (backend == Backend::kCpu) return optim::SgdStep(params, bufs, grad_scale).status();
  auto a = ElementwiseOf(internal::ElementwiseRule::kSgd, bufs.master, bufs.grad,
                         params.momentum != 0 ? bufs.momentum : nullptr, bufs.param16,
                         bufs.param16_dtype, bufs.n);
  a.sgd = optim::internal::MakeSgdConsts(params, grad_scale);
  return internal::CudaElementwiseStep(a, stream);
}

Status AdagradStep(Backend backend, const optim::AdagradParams& params,
                   const optim::AdagradBuffers& bufs, float grad_scale, StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_RETURN_IF_ERROR(optim::CheckAdagradArguments(params, bufs, grad_scale));
  if (bufs.n == 0) return Status::Ok();
  if (backend == Backend::kCpu) return optim::AdagradStep(params, bufs, grad_scale).status();
  auto a = ElementwiseOf(internal::ElementwiseRule::kAdagrad, bufs.master, bufs.grad, bufs.sum,
                         bufs.param16, bufs.param16_dtype, bufs.n);
  a.adagrad = optim::internal::MakeAdagradConsts(params, grad_scale);
  return internal::CudaElementwiseStep(a, stream);
}

Status LionStep(Backend backend, const optim::LionParams& params, const optim::LionBuffers& bufs,
                float grad_scale, StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_RETURN_IF_ERROR(optim::CheckLionArguments(params, bufs, grad_scale));
  if (bufs.n == 0) return Status::Ok();
  if (backend == Backend::kCpu) return optim::LionStep(params, bufs, grad_scale).status();
  auto a = ElementwiseOf(internal::ElementwiseRule::kLion, bufs.master, bufs.grad, bufs.exp_avg,
                         bufs.param16, bufs.param16_dtype, bufs.n);
  a.lion = optim::internal::MakeLionConsts(params, grad_scale);
  return internal::CudaElementwiseStep(a, stream);
}

namespace {

static_assert(internal::kCompactBlock == optim::kInt8Block, "the GPU walks optim's 8-bit blocks");
static_assert(static_cast<int>(optim::MasterFormat::kBf16Stochastic) == 2 &&
                  static_cast<int>(optim::MomentFormat::kInt8) == 2,
              "CompactLaunch carries optim's format values");

// What both compact launches share: the buffers, the formats and the maps.
internal::CompactLaunch CompactLaunchOf(internal::CompactRule rule, const optim::CompactAdamBuffers& b) {
  internal::CompactLaunch a{};
  a.rule = rule;
  a.master_format = static_cast<int>(b.master_format);
  a.moment_format = static_cast<int>(b.moment_format);
  a.master = b.master;
  a.grad = b.grad;
  a.grad_dtype = b.grad_dtype;
  a.exp_avg = b.exp_avg;
  a.exp_avg_sq = b.exp_avg_sq;
  a.param16 = b.param16;
  a.param16_dtype = b.param16_dtype;
  a.n = b.n;
  a.int8_scale_offset = optim::Int8ScaleOffset(b.n);
  a.rounding_key = b.rounding_key;
  for (int s = 0; s < 2; ++s) {
    a.maps[s] = optim::DynamicMap(s == 0);
    a.mids[s] = optim::DynamicMapMidpoints(s == 0);
    a.zero_code[s] = optim::DynamicMapZero(s == 0);
  }
  return a;
}

// The scalar ISA for validation only: the GPU runs no CPU kernel, so the CPU's ISA must not
// refuse a GPU update.
optim::AdamOptions CheckOnlyAdam() {
  optim::AdamOptions o;
  o.isa = optim::Isa::kScalar;
  o.grad_check = optim::GradCheck::kCallerChecked;
  return o;
}

// The GPU's record of each non-empty run (an empty one touches no block, on the CPU either),
// its constants set by `consts(run, &record)`; then one launch, unless no run is left.
template <class Run, class Consts>
Status LaunchCompact(internal::CompactLaunch a, const std::vector<Run>& runs, const Consts& consts,
                     StreamHandle stream) {
  std::vector<internal::CompactRun> dev;
  for (const Run& r : runs) {
    if (r.size == 0) continue;
    internal::CompactRun d{};
    d.begin = r.begin;
    d.size = r.size;
    d.index_base = r.index_base;
    consts(r, &d);
    dev.push_back(d);
  }
  if (dev.empty()) return Status::Ok();
  a.runs = dev.data();
  a.num_runs = dev.size();
  return internal::CudaCompactStep(a, stream);
}

}  // namespace

Status CompactAdamStep(Backend backend, const std::vector<optim::AdamRun>& runs,
                       const optim::CompactAdamBuffers& bufs, float grad_scale,
                       const GradStatsAccumulator* skip_if_nonfinite, StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  STRATA_RETURN_IF_ERROR(optim::CheckCompactAdam(runs, bufs, grad_scale, CheckOnlyAdam()).status());
  if (bufs.n == 0 || runs.empty()) return Status::Ok();
  if (backend == Backend::kCpu) {
    if (skip_if_nonfinite != nullptr && skip_if_nonfinite->found_nonfinite != 0) return Status::Ok();
    optim::AdamOptions o;
    o.grad_check = optim::GradCheck::kCallerChecked;
    return optim::CompactAdamStep(runs, bufs, grad_scale, o).status();
  }
  internal::CompactLaunch a = CompactLaunchOf(internal::CompactRule::kAdam, bufs);
  a.skip_if_nonfinite = skip_if_nonfinite;
  return LaunchCompact(a, runs, [grad_scale](const optim::AdamRun& r, internal::CompactRun* d) {
    d->adam = optim::internal::MakeAdamConsts(r.params, grad_scale);
  }, stream);
}

Status CompactElementwiseStep(Backend backend, optim::ElementwiseKind kind,
                              const std::vector<optim::ElementwiseRun>& runs,
                              const optim::CompactAdamBuffers& bufs, float grad_scale,
                              StreamHandle stream) {
  STRATA_RETURN_IF_ERROR(CheckBackend(backend));
  optim::ElementwiseOptions check;
  check.isa = optim::Isa::kScalar;
  STRATA_RETURN_IF_ERROR(optim::CheckCompactElementwise(kind, runs, bufs, grad_scale, check).status());
  if (bufs.n == 0 || runs.empty()) return Status::Ok();
  if (backend == Backend::kCpu) return optim::CompactElementwiseStep(kind, runs, bufs, grad_scale).status();
  const internal::CompactRule rule = kind == optim::ElementwiseKind::kSgd       ? internal::CompactRule::kSgd
                                     : kind == optim::ElementwiseKind::kAdagrad ? internal::CompactRule::kAdagrad
                                                                                : internal::CompactRule::kLion;
  return LaunchCompact(CompactLaunchOf(rule, bufs), runs,
                       [kind, grad_scale](const optim::ElementwiseRun& r, internal::CompactRun* d) {
                         switch (kind) {
                           case optim::ElementwiseKind::kSgd: d->sgd = optim::internal::MakeSgdConsts(r.sgd, grad_scale); break;
                           case optim::ElementwiseKind::kAdagrad:
                             d->adagrad = optim::internal::MakeAdagradConsts(r.adagrad, grad_scale);
                             break;
                           case optim::ElementwiseKind::kLion: d->lion = optim::internal::MakeLionConsts(r.lion, grad_scale); break;
                         }
                       }, stream);
}

}  // namespace strata::kernels
