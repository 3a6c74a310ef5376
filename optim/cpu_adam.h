// The CPU Adam/AdamW step: one fused pass over raw buffers, SIMD chosen at run time, threads
// from oneTBB. No LibTorch: buffers are plain pointers so the tier manager can hand in pinned
// staging memory, NVMe read buffers or anything else that holds the bytes.
//
// What one AdamStep does, per element i, in fp32 arithmetic (torch.optim.Adam / AdamW as of
// PyTorch 1.13, and DeepSpeed's DeepSpeedCPUAdam; t = params.step, starting at 1):
//
//   g    = grad[i] * grad_scale                    (grad_scale = clip_coef / loss_scale)
//   Adam : g = g + weight_decay * p                (L2 penalty folded into the gradient)
//   AdamW: p = p * (1 - lr * weight_decay)         (decoupled decay, before the update)
//   m    = beta1 * m + (1 - beta1) * g
//   v    = beta2 * v + (1 - beta2) * g * g
//   bc1  = 1 - beta1^t,  bc2 = 1 - beta2^t         (both 1 when bias_correction is false)
//   p    = p - (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//   param16[i] = round_to_nearest_even(p)          (bf16 or fp16; only when param16 is set)
//
// The scalar constants (bc1, bc2, lr / bc1, 1 / sqrt(bc2), 1 - lr * wd) are computed in double
// and rounded to float once, as torch does. Per element the same sequence of IEEE operations
// (multiply, fused multiply-add, sqrt, divide) runs on every ISA, so the scalar path, AVX2 and
// AVX-512 give bit-identical results; against torch the difference is a few ulps (torch rounds
// between the multiply and the add where this kernel fuses them).
//
// Note [bf16 optimizer states]
// exp_avg / exp_avg_sq may be stored in bf16, which halves the optimizer's NVMe and DRAM
// traffic (master stays fp32). The cost is precision: each store rounds to 8 significant bits
// (relative error <= 2^-9). For exp_avg (beta1 = 0.9) the per-step change is ~10 % of the
// value and survives rounding, so m tracks its fp32 twin within a few bf16 ulps. For
// exp_avg_sq with beta2 = 0.999 the per-step change is 0.1 % of the value, below half a bf16
// ulp (0.2 % to 0.4 %): 0.999 * v rounds back to v, so v never decreases (even with g = 0), and
// it grows only when g*g exceeds about 3 * v, in jumps. v then behaves like a running maximum
// of g*g (AMSGrad-like): steps shrink rather than blow up, but results drift from fp32 states
// by percents after tens of steps (tests/optim/cpu_adam_test.cc measures it). Use bf16 states
// when NVMe bandwidth is the bottleneck and the model tolerates it; keep fp32 states (the
// default) for parity with torch.
//
// Note [inf/nan handling]
// A step whose scaled gradients hold an inf or NaN must change nothing (fp16 overflow skips
// the step). With GradCheck::kScanFirst, AdamStep first reads the gradients once (read-only, in
// parallel) and returns skipped = true before any buffer is written. That scan costs one extra
// read of the gradients: 4 more bytes on top of 28 per element with fp32 everything, but reads
// are what limits a core here, so the measured cost is ~20-30 % of the step (strata-swapbench
// adam, "pre-scan" row). No single pass can do better: until the last gradient is read, a
// write may have to be undone. The engine
// usually knows already: it must run UnscaleCheckNorm over all gradients of the step anyway
// (global-norm clipping and fp16 overflow span chunks), and then passes
// GradCheck::kCallerChecked to skip the repeated scan.
#pragma once

#include <cstddef>
#include <cstdint>

#include <tbb/task_arena.h>

#include "optim/dtype.h"
#include "runtime/base/status.h"

namespace strata::optim {

// Instruction sets with a kernel. Ordered from least to most capable.
enum class Isa : uint8_t {
  kAuto = 0,     // the best this CPU supports (DetectIsa), unless STRATA_ADAM_ISA overrides it
  kScalar,       // portable C++; the reference every other path must match bit for bit
  kAvx2,         // AVX2 + FMA + F16C
  kAvx512,       // AVX-512 F/BW/VL/DQ; bf16 conversion done with integer instructions
  kAvx512Bf16,   // kAvx512 plus AVX512_BF16's vcvtneps2bf16 for the bf16 stores
};

// The best ISA this CPU and OS support (cpuid + the OS's saved vector state). Never kAuto.
Isa DetectIsa();
// True when this CPU can run `isa` (kAuto and kScalar: always).
bool IsaSupported(Isa isa);
// "auto", "scalar", "avx2", "avx512", "avx512_bf16".
const char* IsaName(Isa isa);
// Parses the names IsaName returns. Unknown names are INVALID_ARGUMENT listing the accepted ones.
StatusOr<Isa> ParseIsa(const char* name);
// What kAuto resolves to: STRATA_ADAM_ISA (when set, valid and supported; otherwise a warning
// is logged once and it is ignored), else DetectIsa().
Isa ResolveAutoIsa();

struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;            // true: decoupled decay (AdamW); false: L2 in the gradient (Adam)
  bool bias_correction = true;  // false: bc1 = bc2 = 1 (DeepSpeed's bias_correction=False)
  int64_t step = 1;             // 1-based count of this update, including it
};

// The buffers of one contiguous shard. None are owned; all hold `n` elements and must not
// overlap one another (except that nothing here is written when n == 0).
struct AdamBuffers {
  float* master = nullptr;            // fp32 master parameters, updated in place
  const void* grad = nullptr;         // gradients, read only
  DType grad_dtype = DType::kFloat32; // fp32, bf16 or fp16
  void* exp_avg = nullptr;            // first moment, updated in place
  void* exp_avg_sq = nullptr;         // second moment, updated in place
  DType state_dtype = DType::kFloat32;  // fp32 or bf16 for both moments (Note [bf16 optimizer states])
  void* param16 = nullptr;            // optional 16-bit copy of the new master for the device
  DType param16_dtype = DType::kBFloat16;  // bf16 or fp16; ignored when param16 is null
  size_t n = 0;
};

enum class GradCheck : uint8_t {
  kScanFirst,      // scan grads for inf/NaN before writing anything (Note [inf/nan handling])
  kCallerChecked,  // the caller ran UnscaleCheckNorm on these grads and scale; no scan here
};

// Software prefetch in the AVX-512 kernel (Note [prefetch], adam_kernel_avx512.cc): it helps on
// some cores and costs on others, so kAuto asks DefaultAvx512Prefetch. Other ISAs ignore it.
enum class SoftwarePrefetch : uint8_t { kAuto, kOn, kOff };

// kAuto's choice for this CPU: off on AMD family 19h (Zen 4, where it was measured to cost), on
// elsewhere (measured to help on Zen 5). STRATA_ADAM_PREFETCH=0 or 1 overrides it.
bool DefaultAvx512Prefetch();

struct AdamOptions {
  Isa isa = Isa::kAuto;
  SoftwarePrefetch prefetch = SoftwarePrefetch::kAuto;
  // Threads: the step runs inside this arena (so it can share the machine with compute at a
  // chosen width); null runs in the calling thread's current arena.
  tbb::task_arena* arena = nullptr;
  GradCheck grad_check = GradCheck::kScanFirst;
  // Elements per parallel task. 0 picks the default (64 Ki elements, ~1.8 MB of traffic with
  // fp32 everything, enough to amortise scheduling and keep each thread's streams sequential).
  size_t grain = 0;
};

struct AdamResult {
  bool skipped = false;  // scaled grads held an inf or NaN: nothing was written
  Isa isa = Isa::kScalar;  // the kernel that ran (or would have run)
  bool prefetch = false;   // it used software prefetch (AVX-512 only)
};

// Performs one Adam/AdamW update of `bufs` (formula above), multiplying every gradient by
// `grad_scale` first.
//
// Errors (INVALID_ARGUMENT, nothing written): null buffers with n > 0, fp16 states, a param16
// dtype other than bf16/fp16, hyperparameters out of range (lr < 0, beta outside [0, 1),
// eps <= 0, weight_decay < 0, step < 1 with bias correction, non-finite values), grad_scale
// not finite or negative, or an `isa` this CPU cannot run.
// With GradCheck::kScanFirst and a non-finite scaled gradient: OK with skipped = true and no
// buffer touched. With kCallerChecked the grads are trusted; a non-finite one then poisons the
// elements it touches (as in torch).
// Thread safety: concurrent calls on disjoint buffers are safe. Blocks until done.
StatusOr<AdamResult> AdamStep(const AdamParams& params, const AdamBuffers& bufs,
                              float grad_scale = 1.0f, const AdamOptions& options = {});

// Statistics of scaled gradients (x = grad[i] * scale).
struct GradStats {
  bool found_nonfinite = false;  // some x is inf or NaN (sum_sq is then meaningless)
  double sum_sq = 0.0;           // sum of x*x, accumulated in double
};

// The fused, read-only pass the engine runs over every gradient shard of a step: unscale
// (multiply by `scale`, e.g. 1 / loss_scale), detect inf/NaN, and accumulate the squared L2
// norm for global-norm clipping. The grads are not modified: AdamStep applies the scale in
// its own pass, so the gradient is read from memory once per use. sqrt of the sum over all
// shards is the global norm; clip_coef = min(1, max_norm / (norm + 1e-6)) then enters
// AdamStep's grad_scale as clip_coef * scale.
// The sum is deterministic for a given n, dtype and grain (the reduction tree does not
// depend on thread timing); ISAs differ only in summation order (relative ~1e-15).
// Errors: INVALID_ARGUMENT for a null grad with n > 0, scale not finite, or an unsupported isa.
StatusOr<GradStats> UnscaleCheckNorm(const void* grad, DType grad_dtype, size_t n, float scale,
                                     const AdamOptions& options = {});

// The grad_scale AdamStep needs after global-norm clipping, with DeepSpeed's rule:
// norm = sqrt(global_sum_sq) is the norm of the unscaled gradients (the sum of
// UnscaleCheckNorm's sum_sq over every shard, each called with scale = inv_loss_scale);
// clip = (norm + 1e-6) / max_norm; the result is inv_loss_scale / clip when clip > 1, else
// inv_loss_scale. max_norm <= 0 means no clipping (DeepSpeed's gradient_clipping = 0).
float CombinedGradScale(double global_sum_sq, double max_norm, double inv_loss_scale);

}  // namespace strata::optim
