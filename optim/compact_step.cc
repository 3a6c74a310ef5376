#include "optim/compact_step.h"

#include <algorithm>
#include <cmath>

#include "optim/adam_kernels.h"
#include "optim/blockwise.h"
#include "optim/compact_kernels.h"
#include "optim/cpu_adagrad.h"
#include "optim/cpu_lion.h"
#include "optim/cpu_sgd.h"

namespace strata::optim {

const char* MasterFormatName(MasterFormat f) {
  switch (f) {
    case MasterFormat::kFp32: return "fp32";
    case MasterFormat::kBf16Nearest: return "bf16";
    case MasterFormat::kBf16Stochastic: return "bf16_sr";
  }
  return "?";
}

const char* MomentFormatName(MomentFormat f) {
  switch (f) {
    case MomentFormat::kFp32: return "fp32";
    case MomentFormat::kBf16: return "bf16";
    case MomentFormat::kInt8: return "int8";
  }
  return "?";
}

size_t MasterBytes(MasterFormat f, size_t n) { return f == MasterFormat::kFp32 ? 4 * n : 2 * n; }

size_t MomentBytes(MomentFormat f, size_t n) {
  switch (f) {
    case MomentFormat::kFp32: return 4 * n;
    case MomentFormat::kBf16: return 2 * n;
    case MomentFormat::kInt8: return Int8StateBytes(n);
  }
  return 0;
}

namespace {

// One moment buffer seen block by block: fp32 in place, or widened into scratch and narrowed
// back after the update.
class MomentView {
 public:
  MomentView(void* base, MomentFormat format, size_t n, bool is_signed,
             const internal::CompactKernels& k)
      : base_(base), format_(format), n_(n), signed_(is_signed), k_(k),
        tables_(internal::CodeTablesOf(is_signed)) {}

  // fp32 values of [off, off + len) (off a multiple of kInt8Block), valid until Store; null for a
  // state the optimizer does not keep (no buffer).
  float* Load(size_t off, size_t len) {
    if (base_ == nullptr) return nullptr;
    switch (format_) {
      case MomentFormat::kFp32:
        return static_cast<float*>(base_) + off;
      case MomentFormat::kBf16:
        k_.widen_bf16(static_cast<const uint16_t*>(base_) + off, scratch_, len);
        return scratch_;
      case MomentFormat::kInt8:
        k_.dequantize(Codes() + off, Scales()[off / kInt8Block], len, tables_, scratch_);
        return scratch_;
    }
    return nullptr;
  }

  void Store(size_t off, size_t len) {
    if (base_ == nullptr) return;
    switch (format_) {
      case MomentFormat::kFp32:
        return;
      case MomentFormat::kBf16:
        k_.narrow_bf16(scratch_, static_cast<uint16_t*>(base_) + off, len);
        return;
      case MomentFormat::kInt8: {
        // QuantizeBlock's steps with this call's kernels.
        float& scale = Scales()[off / kInt8Block];
        scale = k_.absmax(scratch_, len);
        if (std::isinf(scale)) {  // Note [an infinite moment] (compact_formats.cc)
          internal::ClampInfinities(scratch_, len);
          scale = k_.absmax(scratch_, len);
        }
        if (scale == 0.0f) {
          std::fill(Codes() + off, Codes() + off + len, DynamicMapZero(signed_));
        } else {
          k_.quantize(scratch_, len, scale, tables_, Codes() + off);
        }
        return;
      }
    }
  }

 private:
  uint8_t* Codes() { return static_cast<uint8_t*>(base_); }
  float* Scales() { return reinterpret_cast<float*>(Codes() + Int8ScaleOffset(n_)); }

  void* base_;
  MomentFormat format_;
  size_t n_;
  bool signed_;
  const internal::CompactKernels& k_;
  const internal::CodeTables& tables_;
  alignas(64) float scratch_[kInt8Block];
};

Status Validate(const CompactAdamBuffers& b, bool need_exp_avg = true, bool need_exp_avg_sq = true) {
  if (b.n == 0) return Status::Ok();
  if (!b.master || !b.grad || (need_exp_avg && !b.exp_avg) || (need_exp_avg_sq && !b.exp_avg_sq))
    return InvalidArgument(StrCat("compact step: a null buffer with n=", b.n));
  if (b.param16 && b.master_format != MasterFormat::kFp32)
    return InvalidArgument(StrCat("CompactAdamStep: param16 with a ", MasterFormatName(b.master_format),
                                  " master; the bf16 master is the 16-bit copy itself"));
  if (b.param16 && b.param16_dtype == DType::kFloat32)
    return InvalidArgument("CompactAdamStep: param16 must be bf16 or fp16");
  return Status::Ok();
}

}  // namespace

namespace {

// Where a run lies in the shard and where its rounding bits start.
struct RunSpan {
  size_t begin;
  size_t size;
  uint64_t index_base;
};

// The walk every compact step shares: the shard in 8-bit blocks, each widened into L1 scratch,
// update(run, p, g, m, v, n) called on each run's part of it (fp32 master p, the gradient at g in
// its own dtype, the moments m and v or null), then narrowed back.
template <class Update>
void WalkBlocks(const std::vector<RunSpan>& runs, const CompactAdamBuffers& bufs, Isa isa,
                size_t grain_option, tbb::task_arena* arena, const Update& update) {
  const internal::CompactKernels kernels = internal::CompactKernelsFor(isa);
  const size_t grad_size = DTypeSize(bufs.grad_dtype);
  const bool bf16_master = bufs.master_format != MasterFormat::kFp32;
  // Tasks cover whole 8-bit blocks.
  const size_t grain = std::max<size_t>(
      kInt8Block, ((grain_option ? grain_option : internal::kDefaultBlockGrain) / kInt8Block) * kInt8Block);
  internal::ForEachBlock(bufs.n, grain, arena, [&](size_t begin, size_t end) {
    MomentView m(bufs.exp_avg, bufs.moment_format, bufs.n, /*is_signed=*/true, kernels);
    MomentView v(bufs.exp_avg_sq, bufs.moment_format, bufs.n, /*is_signed=*/false, kernels);
    alignas(64) float master[kInt8Block];
    // The first run that may reach this task's range.
    size_t r0 = std::lower_bound(runs.begin(), runs.end(), begin,
                                 [](const RunSpan& r, size_t at) { return r.begin + r.size <= at; }) -
                runs.begin();
    for (size_t off = begin; off < end; off += kInt8Block) {
      const size_t len = std::min(kInt8Block, end - off);
      while (r0 < runs.size() && runs[r0].begin + runs[r0].size <= off) ++r0;
      if (r0 == runs.size() || runs[r0].begin >= off + len) continue;  // no run in this block
      float* p = nullptr;
      uint16_t* master16 = nullptr;
      if (!bf16_master) {
        p = static_cast<float*>(bufs.master) + off;
      } else {
        master16 = static_cast<uint16_t*>(bufs.master) + off;
        kernels.widen_bf16(master16, master, len);
        p = master;
      }
      float* mp = m.Load(off, len);
      float* vp = v.Load(off, len);
      // Each run's part of the block; a bf16 master narrowed by its rounding.
      size_t done = 0;  // block elements narrowed so far
      for (size_t r = r0; r < runs.size() && runs[r].begin < off + len; ++r) {
        const size_t lo = std::max(runs[r].begin, off) - off;
        const size_t hi = std::min(runs[r].begin + runs[r].size, off + len) - off;
        update(r, p + lo, static_cast<const char*>(bufs.grad) + (off + lo) * grad_size,
               mp ? mp + lo : nullptr, vp ? vp + lo : nullptr, off + lo, hi - lo);
        if (!bf16_master) continue;
        kernels.narrow_bf16(master + done, master16 + done, lo - done);  // unchanged values
        if (bufs.master_format == MasterFormat::kBf16Nearest) {
          kernels.narrow_bf16(master + lo, master16 + lo, hi - lo);
        } else {
          const uint64_t index = runs[r].index_base + (off + lo - runs[r].begin);
          internal::RoundSrSplit(kernels, master + lo, master16 + lo, hi - lo, bufs.rounding_key, index);
        }
        done = hi;
      }
      if (bf16_master) kernels.narrow_bf16(master + done, master16 + done, len - done);  // unchanged
      m.Store(off, len);
      v.Store(off, len);
    }
  });
}

Status CheckRuns(const std::vector<RunSpan>& runs, size_t n) {
  size_t covered = 0;
  for (const RunSpan& r : runs) {
    if (r.begin < covered || r.begin + r.size > n)
      return InvalidArgument(StrCat("compact step: run [", r.begin, ", ", r.begin + r.size,
                                    ") overlaps the previous one or ends past n=", n));
    covered = r.begin + r.size;
  }
  return Status::Ok();
}

}  // namespace

StatusOr<AdamResult> CheckCompactAdam(const std::vector<AdamRun>& runs, const CompactAdamBuffers& bufs,
                                      float grad_scale, const AdamOptions& options) {
  STRATA_RETURN_IF_ERROR(Validate(bufs));
  std::vector<RunSpan> spans;
  for (const AdamRun& r : runs) spans.push_back({r.begin, r.size, r.index_base});
  STRATA_RETURN_IF_ERROR(CheckRuns(spans, bufs.n));
  // AdamStep with no elements checks each run's hyperparameters, the scale and the ISA, as for
  // itself.
  AdamBuffers none;
  none.grad_dtype = bufs.grad_dtype;
  AdamOptions resolve = options;
  resolve.grad_check = GradCheck::kCallerChecked;
  AdamResult result;
  for (const AdamRun& r : runs) {
    STRATA_ASSIGN_OR_RETURN(result, AdamStep(r.params, none, grad_scale, resolve));
  }
  return result;
}

StatusOr<AdamResult> CompactAdamStep(const std::vector<AdamRun>& runs, const CompactAdamBuffers& bufs,
                                     float grad_scale, const AdamOptions& options) {
  STRATA_ASSIGN_OR_RETURN(AdamResult result, CheckCompactAdam(runs, bufs, grad_scale, options));
  std::vector<RunSpan> spans;
  std::vector<internal::AdamConsts> consts;
  for (const AdamRun& r : runs) {
    if (r.size == 0) continue;  // it touches no block
    spans.push_back({r.begin, r.size, r.index_base});
    consts.push_back(internal::MakeAdamConsts(r.params, grad_scale));
  }
  if (bufs.n == 0 || spans.empty()) return result;
  if (options.grad_check == GradCheck::kScanFirst) {
    AdamOptions scan = options;
    scan.isa = result.isa;
    STRATA_ASSIGN_OR_RETURN(const GradStats stats,
                            UnscaleCheckNorm(bufs.grad, bufs.grad_dtype, bufs.n, grad_scale, scan));
    if (stats.found_nonfinite) {
      result.skipped = true;
      return result;
    }
  }
  internal::P16 p16 = internal::P16::kNone;
  if (bufs.param16) p16 = bufs.param16_dtype == DType::kBFloat16 ? internal::P16::kBf16 : internal::P16::kFp16;
  const internal::AdamKernelFn kernel =
      internal::PickAdamKernel(result.isa, bufs.grad_dtype, DType::kFloat32, p16, false);
  WalkBlocks(spans, bufs, result.isa, options.grain, options.arena,
             [&](size_t r, float* p, const void* g, float* m, float* v, size_t at, size_t n) {
               internal::AdamKernelArgs args{};
               args.c = consts[r];
               args.master = p;
               args.grad = g;
               args.exp_avg = m;
               args.exp_avg_sq = v;
               args.param16 = bufs.param16 ? static_cast<char*>(bufs.param16) + at * 2 : nullptr;
               kernel(args, 0, n);
             });
  return result;
}

StatusOr<Isa> CheckCompactElementwise(ElementwiseKind kind, const std::vector<ElementwiseRun>& runs,
                                      const CompactAdamBuffers& bufs, float grad_scale,
                                      const ElementwiseOptions& options) {
  STRATA_RETURN_IF_ERROR(Validate(bufs, /*need_exp_avg=*/kind != ElementwiseKind::kAdagrad &&
                                           !(kind == ElementwiseKind::kSgd && bufs.exp_avg == nullptr),
                                  /*need_exp_avg_sq=*/kind == ElementwiseKind::kAdagrad));
  if (bufs.grad_dtype != DType::kFloat32)
    return InvalidArgument("CompactElementwiseStep: the gradient must be fp32");
  std::vector<RunSpan> spans;
  for (const ElementwiseRun& r : runs) spans.push_back({r.begin, r.size, r.index_base});
  STRATA_RETURN_IF_ERROR(CheckRuns(spans, bufs.n));
  // Each optimizer's own step with no elements checks the run's hyperparameters and the ISA.
  if (kind == ElementwiseKind::kSgd && bufs.n > 0 && bufs.exp_avg == nullptr)
    for (const ElementwiseRun& r : runs)
      if (r.sgd.momentum != 0)
        return InvalidArgument(StrCat("CompactElementwiseStep: SGD momentum=", r.sgd.momentum,
                                      " needs its buffer (exp_avg), which is null"));
  Isa isa = Isa::kScalar;
  for (const ElementwiseRun& r : runs) {
    switch (kind) {
      case ElementwiseKind::kSgd: {
        SgdBuffers none;
        STRATA_ASSIGN_OR_RETURN(isa, SgdStep(r.sgd, none, grad_scale, options));
        break;
      }
      case ElementwiseKind::kAdagrad: {
        AdagradBuffers none;
        STRATA_ASSIGN_OR_RETURN(isa, AdagradStep(r.adagrad, none, grad_scale, options));
        break;
      }
      case ElementwiseKind::kLion: {
        LionBuffers none;
        STRATA_ASSIGN_OR_RETURN(isa, LionStep(r.lion, none, grad_scale, options));
        break;
      }
    }
  }
  return isa;
}

StatusOr<Isa> CompactElementwiseStep(ElementwiseKind kind, const std::vector<ElementwiseRun>& runs,
                                     const CompactAdamBuffers& bufs, float grad_scale,
                                     const ElementwiseOptions& options) {
  STRATA_ASSIGN_OR_RETURN(const Isa isa, CheckCompactElementwise(kind, runs, bufs, grad_scale, options));
  std::vector<RunSpan> spans;
  std::vector<internal::SgdConsts> sgd;
  std::vector<internal::AdagradConsts> adagrad;
  std::vector<internal::LionConsts> lion;
  for (const ElementwiseRun& r : runs) {
    if (r.size == 0) continue;  // it touches no block
    spans.push_back({r.begin, r.size, r.index_base});
    switch (kind) {
      case ElementwiseKind::kSgd: sgd.push_back(internal::MakeSgdConsts(r.sgd, grad_scale)); break;
      case ElementwiseKind::kAdagrad: adagrad.push_back(internal::MakeAdagradConsts(r.adagrad, grad_scale)); break;
      case ElementwiseKind::kLion: lion.push_back(internal::MakeLionConsts(r.lion, grad_scale)); break;
    }
  }
  if (bufs.n == 0 || spans.empty()) return isa;
  auto* sgd_block = internal::PickBlock(isa, &internal::SgdBlockScalar, &internal::SgdBlockAvx2,
                                        &internal::SgdBlockAvx512);
  auto* adagrad_block = internal::PickBlock(isa, &internal::AdagradBlockScalar,
                                            &internal::AdagradBlockAvx2, &internal::AdagradBlockAvx512);
  auto* lion_block = internal::PickBlock(isa, &internal::LionBlockScalar, &internal::LionBlockAvx2,
                                         &internal::LionBlockAvx512);
  WalkBlocks(spans, bufs, isa, options.grain, options.arena,
             [&](size_t r, float* p, const void* g, float* m, float* v, size_t at, size_t n) {
               const auto* grad = static_cast<const float*>(g);
               switch (kind) {
                 case ElementwiseKind::kSgd: sgd_block(sgd[r], p, grad, m, n); break;
                 case ElementwiseKind::kAdagrad: adagrad_block(adagrad[r], p, grad, v, n); break;
                 case ElementwiseKind::kLion: lion_block(lion[r], p, grad, m, n); break;
               }
               if (bufs.param16)
                 internal::StoreParam16(p, static_cast<uint16_t*>(bufs.param16) + at,
                                        bufs.param16_dtype, n);
             });
  return isa;
}

StatusOr<AdamResult> CompactAdamStep(const AdamParams& params, const CompactAdamBuffers& bufs,
                                     float grad_scale, const AdamOptions& options) {
  return CompactAdamStep(std::vector<AdamRun>{{0, bufs.n, params, bufs.index_base}}, bufs,
                         grad_scale, options);
}

}  // namespace strata::optim
