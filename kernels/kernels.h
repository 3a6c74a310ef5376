// Element-wise kernels of the training step, each with two implementations behind one call:
// CUDA kernels (kernels/cuda_kernels.cu, built when CUDA is on) and CPU twins
// (kernels/cpu_kernels.cc, always built). The CPU twins are the reference the CUDA kernels are
// tested against (tests/kernels/), and the path the CPU device runs.
//
// Kernels:
//   CastFp32To16 / Cast16ToFp32   fp32 <-> bf16 / fp16 (round to nearest even, as optim/dtype.h)
//   AccumulateGradStats           fused unscale + inf/NaN flag + squared L2 norm, read-only
//   AdamStep                      Adam/AdamW on states kept in the backend's memory
//   SgdStep / AdagradStep / LionStep   the element-wise optimizers, fp32 states
//   CompactAdamStep / CompactElementwiseStep   the same optimizers over the compact layouts
//                                 (bf16 master, bf16 or 8-bit moments: optim/compact_step.h)
//   PackChunk / UnpackChunk       gather tensors into a flat, zero-padded chunk and scatter back
//
// Backends, memory and ordering:
// - Backend::kCpu: every pointer is host memory. The call runs in the calling thread (AdamStep
//   and AccumulateGradStats also on oneTBB's workers, in the caller's current arena) and has
//   finished when it returns. The `stream` argument is ignored.
// - Backend::kCuda: every data pointer is memory the current CUDA device of the calling thread
//   can access (cudaMalloc, managed or mapped pinned memory). `stream` is a cudaStream_t passed
//   as void* (nullptr: the legacy default stream). Calls are ASYNCHRONOUS: they validate their
//   arguments, enqueue kernels on the stream and return; the buffers must stay valid and
//   untouched by other streams until the work completes (synchronize the stream or record an
//   event after the call). A non-OK status reports invalid arguments or a failed launch; faults
//   during execution surface at the next synchronization, as with any CUDA kernel. Host-side
//   arguments (parameter structs, slot lists) are consumed before the call returns.
//   In a build without CUDA every kCuda call returns UNIMPLEMENTED; with CUDA but without a
//   GPU it returns the driver's error (UNAVAILABLE), never crashes.
// - Invalid arguments (null pointers with n > 0, unsupported dtypes, out-of-range hyper-
//   parameters, slots outside the chunk) are INVALID_ARGUMENT with nothing written, for both
//   backends alike: validation is shared and runs before dispatch.
//
// Agreement between backends (tested in tests/kernels/kernels_gpu_test.cc):
// - Casts: bit-identical for every input, NaN included (the CUDA code does the rounding with
//   integer operations instead of cvt.rn, whose NaN results differ from the reference).
// - AccumulateGradStats: the flag is identical; sum_sq is bit-identical too, because the CPU
//   twin reduces in exactly the order the GPU's fixed block/tree layout does (Note [stats order]
//   in kernels/internal.h). Against optim::UnscaleCheckNorm the sum differs only in order
//   (relative ~1e-15).
// - AdamStep: bit-identical to optim::AdamStep for finite results: the CUDA kernel performs the
//   same IEEE operations per element (fmaf, correctly rounded sqrtf and division; compiled with
//   --fmad=false so nvcc fuses nothing on its own) on constants computed the same way. NaN
//   results are NaN on both, but their payload bits may differ (GPUs return a canonical NaN).
// - CompactAdamStep / CompactElementwiseStep: bit-identical to optim's for finite results, the
//   stochastic rounding and the 8-bit codes and scales included: the same per-element update,
//   the counter-based rounding bits of optim/rounding_bits.h, the same block absmax (a maximum,
//   whatever the order), the same IEEE division by the scale and the same binary search over
//   the map's midpoints.
//
// Thread safety: calls on disjoint buffers may run concurrently from any thread. Calls that
// share a GradStatsAccumulator must be ordered (one stream, or events): they share its
// workspace.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/grad_stats.h"
#include "optim/compact_step.h"
#include "optim/cpu_adagrad.h"
#include "optim/cpu_adam.h"
#include "optim/cpu_lion.h"
#include "optim/cpu_sgd.h"
#include "optim/dtype.h"
#include "runtime/base/status.h"

namespace strata::kernels {

using optim::DType;

enum class Backend : uint8_t {
  kCpu = 0,   // the CPU twins, always built
  kCuda = 1,  // CUDA kernels; UNIMPLEMENTED in builds without CUDA
};

// "cpu", "cuda".
const char* BackendName(Backend backend);
// True when this build contains the CUDA kernels (not whether a GPU is present: see
// strata::CudaDeviceCount()).
bool CudaKernelsBuilt();

// A cudaStream_t for Backend::kCuda, kept opaque so this header needs no CUDA headers.
using StreamHandle = void*;

// ---- Casts ----------------------------------------------------------------------------------

// dst[i] = round_to_nearest_even(src[i]) as `dst_dtype` (kBFloat16 or kFloat16), for i < n:
// exactly optim::FloatToBf16 / optim::FloatToHalf, overflow to infinity, subnormals kept,
// NaN stays NaN. src and dst must not overlap.
Status CastFp32To16(Backend backend, const float* src, void* dst, DType dst_dtype, size_t n,
                    StreamHandle stream = nullptr);

// dst[i] = src[i] widened to fp32, exact (optim::Bf16ToFloat / optim::HalfToFloat).
Status Cast16ToFp32(Backend backend, const void* src, DType src_dtype, float* dst, size_t n,
                    StreamHandle stream = nullptr);

// ---- Gradient statistics --------------------------------------------------------------------

// Sets acc's sum_sq and found_nonfinite to zero (stream-ordered for kCuda).
Status ResetGradStats(Backend backend, GradStatsAccumulator* acc, StreamHandle stream = nullptr);

// The fused, read-only gradient pass of optim::UnscaleCheckNorm for one shard: with
// x = grad[i] * scale (in fp32, so an overflow of the product counts as non-finite), sets
// acc->found_nonfinite when some x is inf or NaN and adds sum(x*x), accumulated in double, to
// acc->sum_sq. `grad` is never written. Calls for the shards of one step accumulate into one
// accumulator without any host synchronization; read it with ReadGradStats, or hand it to
// AdamStep as the skip flag. The sum is deterministic for a given sequence of shard sizes.
// Errors: INVALID_ARGUMENT for a null acc, a null grad with n > 0, a grad dtype other than
// fp32/bf16/fp16, or a scale that is not finite.
Status AccumulateGradStats(Backend backend, const void* grad, DType grad_dtype, size_t n,
                           float scale, GradStatsAccumulator* acc, StreamHandle stream = nullptr);

// Waits for the work on `stream` (kCuda: cudaStreamSynchronize) and returns acc's totals with
// optim's convention: sum_sq = 0 when found_nonfinite.
StatusOr<optim::GradStats> ReadGradStats(Backend backend, const GradStatsAccumulator* acc,
                                         StreamHandle stream = nullptr);

// One-shot, blocking form with optim::UnscaleCheckNorm's contract: reset + accumulate + read
// on a temporary accumulator (kCuda: cudaMallocAsync'd on `stream`, freed before returning).
StatusOr<optim::GradStats> UnscaleCheckNorm(Backend backend, const void* grad, DType grad_dtype,
                                            size_t n, float scale, StreamHandle stream = nullptr);

// ---- Adam -----------------------------------------------------------------------------------

// One Adam/AdamW update of `bufs` with optim::AdamStep's formula, buffers and dtype options
// (optim/cpu_adam.h): fp32 master; fp32/bf16/fp16 grads; fp32/bf16 moments; an optional bf16 or
// fp16 param16 copy. All buffers live in the backend's memory.
// The grads are trusted (optim's GradCheck::kCallerChecked): scanning them would cost a host
// synchronization on the GPU. Instead, when `skip_if_nonfinite` is non-null, the update reads
// that accumulator's found_nonfinite when it runs (stream order) and, if set, writes nothing:
// run AccumulateGradStats over every shard of the step first, then every shard's AdamStep with
// the same accumulator, and an overflowed fp16 step is skipped without the host waiting.
// Errors (INVALID_ARGUMENT, nothing written): as optim::AdamStep (null buffers with n > 0, fp16
// states, bad param16 dtype, hyperparameters out of range, grad_scale not finite or negative).
Status AdamStep(Backend backend, const optim::AdamParams& params, const optim::AdamBuffers& bufs,
                float grad_scale = 1.0f, const GradStatsAccumulator* skip_if_nonfinite = nullptr,
                StreamHandle stream = nullptr);

// ---- SGD, Adagrad, Lion --------------------------------------------------------------------

// One update of `bufs` with optim's formula and buffers (optim/cpu_sgd.h, cpu_adagrad.h,
// cpu_lion.h): fp32 master, grads and state, an optional bf16/fp16 param16 copy, all in the
// backend's memory. kCpu runs optim's SIMD loops in the caller's current arena and returns when
// done; kCuda enqueues one kernel on `stream`. The grads are trusted (no scan for inf/NaN: the
// engine checks a step's gradients before any update). Errors (INVALID_ARGUMENT, nothing
// written): those of optim's Check*Arguments.
Status SgdStep(Backend backend, const optim::SgdParams& params, const optim::SgdBuffers& bufs,
               float grad_scale = 1.0f, StreamHandle stream = nullptr);
Status AdagradStep(Backend backend, const optim::AdagradParams& params,
                   const optim::AdagradBuffers& bufs, float grad_scale = 1.0f,
                   StreamHandle stream = nullptr);
Status LionStep(Backend backend, const optim::LionParams& params, const optim::LionBuffers& bufs,
                float grad_scale = 1.0f, StreamHandle stream = nullptr);

// ---- Compact layouts ----------------------------------------------------------------------

// optim::CompactAdamStep (GradCheck::kCallerChecked) and optim::CompactElementwiseStep on the
// backend: `runs` and the formats as there, every buffer of `bufs` in the backend's memory
// (8-bit states laid out as optim::Int8StateBytes says, their scales after the codes). With
// `skip_if_nonfinite` (CompactAdamStep only) the update writes nothing when that accumulator's
// flag is set when it runs, as AdamStep above. Errors (INVALID_ARGUMENT, nothing written): those
// of optim::CheckCompactAdam / CheckCompactElementwise, in their words.
Status CompactAdamStep(Backend backend, const std::vector<optim::AdamRun>& runs,
                       const optim::CompactAdamBuffers& bufs, float grad_scale = 1.0f,
                       const GradStatsAccumulator* skip_if_nonfinite = nullptr,
                       StreamHandle stream = nullptr);
Status CompactElementwiseStep(Backend backend, optim::ElementwiseKind kind,
                              const std::vector<optim::ElementwiseRun>& runs,
                              const optim::CompactAdamBuffers& bufs, float grad_scale = 1.0f,
                              StreamHandle stream = nullptr);

// ---- Chunk pack / unpack --------------------------------------------------------------------

// One tensor's place in a flat chunk. Offsets and sizes count elements of the chunk's element
// size.
struct ChunkSlot {
  void* tensor = nullptr;  // PackChunk reads it, UnpackChunk writes it (backend memory)
  size_t numel = 0;
  size_t offset = 0;       // first element of the tensor inside the chunk
};

// chunk[s.offset, s.offset + s.numel) = s.tensor for every slot; every other element of
// chunk[0, chunk_numel) is set to zero bytes, so a chunk's padding is deterministic (it is
// checksummed and written to NVMe). Slots may come in any order.
// Errors (INVALID_ARGUMENT, nothing written): elem_size not 1, 2, 4 or 8; a null chunk with
// chunk_numel > 0; a slot with a null tensor and numel > 0, reaching past chunk_numel, or
// overlapping another slot. Tensors must not overlap the chunk (not checked).
Status PackChunk(Backend backend, const std::vector<ChunkSlot>& slots, size_t elem_size,
                 void* chunk, size_t chunk_numel, StreamHandle stream = nullptr);

// s.tensor = chunk[s.offset, s.offset + s.numel) for every slot; the padding is not read.
// Same errors as PackChunk. Tensors must not overlap one another or the chunk (not checked).
Status UnpackChunk(Backend backend, const void* chunk, size_t chunk_numel,
                   const std::vector<ChunkSlot>& slots, size_t elem_size,
                   StreamHandle stream = nullptr);

}  // namespace strata::kernels
