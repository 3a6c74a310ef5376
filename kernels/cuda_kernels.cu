// The CUDA kernels behind kernels/kernels.h. Arguments arrive validated (kernels.cc); every
// launch is asynchronous on the caller's stream and only launch errors are reported here.
//
// Bit-exactness with the CPU twins is the point of these kernels, so they avoid anything whose
// rounding differs from the host reference:
// - fp32 -> bf16/fp16 rounding is done with integer operations mirroring optim/dtype.h. The
//   cvt.rn instructions (__float2bfloat16_rn, __float2half_rn) round finite values the same
//   way but return a canonical NaN, where the reference keeps the NaN's sign and payload
//   (kernels/cuda_convert.cuh).
// - The Adam update uses the same IEEE operations per element as optim's AdamElement: fmaf,
//   sqrtf and '/' (correctly rounded: this target never uses --use_fast_math, and is compiled
//   with --fmad=false so nvcc does not fuse a multiply and an add on its own, the device twin
//   of optim's -ffp-contract=off; kernels/cuda_adam_element.cuh).
// - SGD, Adagrad and Lion run the per-element rules of optim/elementwise_rules.h themselves
//   (unfused multiply and add, correctly rounded sqrtf and division).
// - The gradient statistics use the reduction layout of Note [stats order] (internal.h).
// The compact layouts' update has its own file, cuda_compact_kernels.cu.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda_adam_element.cuh"
#include "kernels/cuda_convert.cuh"
#include "kernels/internal.h"
#include "runtime/base/cuda_check.h"

namespace strata::kernels {

bool CudaKernelsBuilt() { return true; }

namespace internal {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops cover any n; more blocks than this only add scheduling overhead.
constexpr size_t kMaxBlocks = 65536;

unsigned int BlocksFor(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

Status LaunchStatus(const char* what) { return CudaToStatus(cudaGetLastError(), what); }

__device__ __forceinline__ size_t GlobalThread() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t GridThreads() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

// ---- Casts ----

template <DType T>
__global__ void CastTo16Kernel(const float* __restrict__ src, void* __restrict__ dst, size_t n) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) Store<T>(dst, i, src[i]);
}

template <DType T>
__global__ void CastFrom16Kernel(const void* __restrict__ src, float* __restrict__ dst, size_t n) {
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) dst[i] = Load<T>(src, i);
}

// ---- Gradient statistics (Note [stats order]) ----

constexpr int kStatsT = kGradStatsThreads;

// Folds s[0..kStatsT) into s[0] with the halving tree every backend uses.
__device__ __forceinline__ void TreeFold(double* s) {
  for (int w = kStatsT / 2; w > 0; w >>= 1) {
    if (static_cast<int>(threadIdx.x) < w) s[threadIdx.x] += s[threadIdx.x + w];
    __syncthreads();
  }
}

template <DType G>
__global__ void __launch_bounds__(kStatsT)
    StatsBlocksKernel(const void* __restrict__ grad, size_t n, float scale,
                      GradStatsAccumulator* acc) {
  __shared__ double s[kStatsT];
  const size_t lanes = static_cast<size_t>(gridDim.x) * kStatsT;
  double sum = 0.0;
  int bad = 0;
  for (size_t i = static_cast<size_t>(blockIdx.x) * kStatsT + threadIdx.x; i < n; i += lanes) {
    const float x = Load<G>(grad, i) * scale;
    bad |= !isfinite(x);
    sum += static_cast<double>(x) * static_cast<double>(x);
  }
  s[threadIdx.x] = sum;
  __syncthreads();
  TreeFold(s);
  const int any_bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) {
    acc->partial[blockIdx.x] = s[0];
    if (any_bad) atomicOr(&acc->found_nonfinite, 1u);
  }
}

__global__ void __launch_bounds__(kStatsT) StatsFinalKernel(GradStatsAccumulator* acc, int blocks) {
  __shared__ double s[kStatsT];
  double sum = 0.0;
  for (int b = threadIdx.x; b < blocks; b += kStatsT) sum += acc->partial[b];
  s[threadIdx.x] = sum;
  __syncthreads();
  TreeFold(s);
  if (threadIdx.x == 0) acc->sum_sq += s[0];
}

// ---- Adam ----

enum P16 : int { kP16None = 0, kP16Bf16 = 1, kP16Fp16 = 2 };

template <DType G, DType S, int P>
__global__ void AdamKernel(AdamConsts c, float* __restrict__ master, const void* __restrict__ grad,
                           void* __restrict__ exp_avg, void* __restrict__ exp_avg_sq,
                           void* __restrict__ param16, size_t n,
                           const GradStatsAccumulator* skip_if_nonfinite) {
  // The flag was written by earlier work on this stream; every thread reads the same value.
  if (skip_if_nonfinite != nullptr && skip_if_nonfinite->found_nonfinite != 0) return;
  for (size_t i = GlobalThread(); i < n; i += GridThreads()) {
    float p = master[i];
    float m = Load<S>(exp_avg, i);
    float v = Load<S>(exp_avg_sq, i);
    DevAdamElement(c, p, Load<G>(grad, i), m, v);
    master[i] = p;
    Store<S>(exp_avg, i, m);
    Store<S>(exp_avg_sq, i, v);
    if constexpr (P == kP16Bf16) Store<DType::kBFloat16>(param16, i, p);
    if constexpr (P == kP16Fp16) Store<DType::kFloat16>(param16, i, p);
  }
}

template <DType G, DType S, int P>
void LaunchAdam(const AdamLaunch& a, cudaStream_t stream) {
  AdamKernel<G, S, P><<<BlocksFor(a.n), kThreads, 0, stream>>>(
      a.c, a.master, a.grad, a.exp_avg, a.exp_avg_sq, a.param16, a.n, a.skip_if_nonfinite);
}

template <DType G, DType S>
void LaunchAdamP16(const AdamLaunch& a, cudaStream_t stream) {
  if (a.param16 == nullptr) {
    LaunchAdam<G, S, kP16None>(a, stream);
  } else if (a.param16_dtype == DType::kBFloat16) {
    LaunchAdam<G, S, kP16Bf16>(a, stream);
  } else {
    LaunchAdam<G, S, kP16Fp16>(a, stream);
  }
}

template <DType G>
void LaunchAdamState(const AdamLaunch& a, cudaStream_t stream) {
  if (a.state_dtype == DType::kBFloat16) {
    LaunchAdamP16<G, DType::kBFloat16>(a, stream);
  } else {
    LaunchAdamP16<G, DType::kFloat32>(a, stream);
  }
}

// ---- SGD, Adagrad, Lion ----
// One kernel over the per-element rule of optim/elementwise_rules.h, the very function the CPU
// references call, so the two backends differ only in who runs it.

struct SgdRule {
  __device__ void operator()(const ElementwiseLaunch& a, float& p, float g, float& s) const {
    optim::internal::SgdElement(a.sgd, p, g, s);
  }
};
struct AdagradRule {
  __device__ void operator()(const ElementwiseLaunch& a, float& p, float g, float& s) const {
    optim::internal::AdagradElement(a.adagrad, p, g, s);
  }
};
struct LionRule {
  __device__ void operator()(const ElementwiseLaunch& a, float& p, float g, float& s) const {
    optim::internal::LionElement(a.lion, p, g, s);
  }
};

template <class Rule, int P>
__global__ void ElementwiseKernel(ElementwiseLaunch a) {
  const Rule rule;
  for (size_t i = GlobalThread(); i < a.n; i += GridThreads()) {
    float p = a.master[i];
    float s = a.state != nullptr ? a.state[i] : 0.0f;
    rule(a, p, a.grad[i], s);
    a.master[i] = p;
    if (a.state != nullptr) a.state[i] = s;
    if constexpr (P == kP16Bf16) Store<DType::kBFloat16>(a.param16, i, p);
    if constexpr (P == kP16Fp16) Store<DType::kFloat16>(a.param16, i, p);
  }
}

template <class Rule>
void LaunchElementwise(const ElementwiseLaunch& a, cudaStream_t stream) {
  if (a.param16 == nullptr) {
    ElementwiseKernel<Rule, kP16None><<<BlocksFor(a.n), kThreads, 0, stream>>>(a);
  } else if (a.param16_dtype == DType::kBFloat16) {
    ElementwiseKernel<Rule, kP16Bf16><<<BlocksFor(a.n), kThreads, 0, stream>>>(a);
  } else {
    ElementwiseKernel<Rule, kP16Fp16><<<BlocksFor(a.n), kThreads, 0, stream>>>(a);
  }
}

// ---- Chunk copies ----

// Segments per launch travel in the kernel's parameter block (64 * 24 bytes, well under the
// 4 KiB limit), so no device-side table has to be allocated, filled and kept alive.
constexpr int kSegmentsPerLaunch = 64;
struct SegmentBatch {
  CopySegment seg[kSegmentsPerLaunch];
};

template <typename W>
__device__ __forceinline__ void CopyWords(const CopySegment& s) {
  const size_t words = s.bytes / sizeof(W);
  W* dst = static_cast<W*>(s.dst);
  const W* src = static_cast<const W*>(s.src);
  if (src == nullptr) {
    W zero{};
    for (size_t i = GlobalThread(); i < words; i += GridThreads()) dst[i] = zero;
  } else {
    for (size_t i = GlobalThread(); i < words; i += GridThreads()) dst[i] = src[i];
  }
}

// blockIdx.y picks the segment; blocks along x share it. The widest access that the segment's
// pointers and size allow keeps large, aligned tensors at full bandwidth.
__global__ void CopySegmentsKernel(SegmentBatch batch) {
  const CopySegment s = batch.seg[blockIdx.y];
  const uintptr_t align =
      reinterpret_cast<uintptr_t>(s.src) | reinterpret_cast<uintptr_t>(s.dst) | s.bytes;
  if ((align & 15u) == 0) {
    CopyWords<uint4>(s);
  } else if ((align & 3u) == 0) {
    CopyWords<uint32_t>(s);
  } else if ((align & 1u) == 0) {
    CopyWords<uint16_t>(s);
  } else {
    CopyWords<uint8_t>(s);
  }
}

}  // namespace

Status CudaCastFp32To16(const float* src, void* dst, DType dst_dtype, size_t n, void* stream) {
  if (dst_dtype == DType::kBFloat16) {
    CastTo16Kernel<DType::kBFloat16><<<BlocksFor(n), kThreads, 0, AsStream(stream)>>>(src, dst, n);
  } else {
    CastTo16Kernel<DType::kFloat16><<<BlocksFor(n), kThreads, 0, AsStream(stream)>>>(src, dst, n);
  }
  return LaunchStatus("CastFp32To16 kernel launch");
}

Status CudaCast16ToFp32(const void* src, DType src_dtype, float* dst, size_t n, void* stream) {
  if (src_dtype == DType::kBFloat16) {
    CastFrom16Kernel<DType::kBFloat16><<<BlocksFor(n), kThreads, 0, AsStream(stream)>>>(src, dst, n);
  } else {
    CastFrom16Kernel<DType::kFloat16><<<BlocksFor(n), kThreads, 0, AsStream(stream)>>>(src, dst, n);
  }
  return LaunchStatus("Cast16ToFp32 kernel launch");
}

Status CudaResetGradStats(GradStatsAccumulator* acc, void* stream) {
  // sum_sq, found_nonfinite and reserved; the workspace needs no clearing.
  STRATA_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(acc, 0, offsetof(GradStatsAccumulator, partial), AsStream(stream)));
  return Status::Ok();
}

Status CudaAccumulateGradStats(const void* grad, DType grad_dtype, size_t n, float scale,
                               GradStatsAccumulator* acc, void* stream) {
  const int blocks = StatsBlocks(n);
  const cudaStream_t s = AsStream(stream);
  switch (grad_dtype) {
    case DType::kFloat32:
      StatsBlocksKernel<DType::kFloat32><<<blocks, kStatsT, 0, s>>>(grad, n, scale, acc);
      break;
    case DType::kBFloat16:
      StatsBlocksKernel<DType::kBFloat16><<<blocks, kStatsT, 0, s>>>(grad, n, scale, acc);
      break;
    case DType::kFloat16:
      StatsBlocksKernel<DType::kFloat16><<<blocks, kStatsT, 0, s>>>(grad, n, scale, acc);
      break;
  }
  STRATA_RETURN_IF_ERROR(LaunchStatus("AccumulateGradStats block kernel launch"));
  StatsFinalKernel<<<1, kStatsT, 0, s>>>(acc, blocks);
  return LaunchStatus("AccumulateGradStats final kernel launch");
}

Status CudaReadGradStats(const GradStatsAccumulator* acc, double* sum_sq, uint32_t* flag,
                         void* stream) {
  struct {
    double sum_sq;
    uint32_t found_nonfinite;
    uint32_t reserved;
  } head;
  static_assert(sizeof(head) == offsetof(GradStatsAccumulator, partial), "accumulator layout");
  STRATA_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&head, acc, sizeof(head), cudaMemcpyDeviceToHost, AsStream(stream)));
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(AsStream(stream)));
  *sum_sq = head.sum_sq;
  *flag = head.found_nonfinite;
  return Status::Ok();
}

Status CudaAllocAccumulator(GradStatsAccumulator** acc, void* stream) {
  void* p = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&p, sizeof(GradStatsAccumulator), AsStream(stream)));
  *acc = static_cast<GradStatsAccumulator*>(p);
  return Status::Ok();
}

Status CudaFreeAccumulator(GradStatsAccumulator* acc, void* stream) {
  STRATA_CUDA_RETURN_IF_ERROR(cudaFreeAsync(acc, AsStream(stream)));
  return Status::Ok();
}

Status CudaAdamStep(const AdamLaunch& a, void* stream) {
  const cudaStream_t s = AsStream(stream);
  switch (a.grad_dtype) {
    case DType::kFloat32: LaunchAdamState<DType::kFloat32>(a, s); break;
    case DType::kBFloat16: LaunchAdamState<DType::kBFloat16>(a, s); break;
    case DType::kFloat16: LaunchAdamState<DType::kFloat16>(a, s); break;
  }
  return LaunchStatus("AdamStep kernel launch");
}

Status CudaElementwiseStep(const ElementwiseLaunch& a, void* stream) {
  const cudaStream_t s = AsStream(stream);
  switch (a.rule) {
    case ElementwiseRule::kSgd: LaunchElementwise<SgdRule>(a, s); break;
    case ElementwiseRule::kAdagrad: LaunchElementwise<AdagradRule>(a, s); break;
    case ElementwiseRule::kLion: LaunchElementwise<LionRule>(a, s); break;
  }
  return LaunchStatus("SgdStep/AdagradStep/LionStep kernel launch");
}

Status CudaCopySegments(const CopySegment* segs, size_t count, void* stream) {
  for (size_t first = 0; first < count; first += kSegmentsPerLaunch) {
    const size_t batch_count =
        count - first < static_cast<size_t>(kSegmentsPerLaunch) ? count - first : kSegmentsPerLaunch;
    SegmentBatch batch{};
    size_t max_bytes = 0;
    for (size_t k = 0; k < batch_count; ++k) {
      batch.seg[k] = segs[first + k];
      if (segs[first + k].bytes > max_bytes) max_bytes = segs[first + k].bytes;
    }
    // Sized for the largest segment at 16 bytes per thread; smaller ones leave threads idle.
    const unsigned int blocks_x = BlocksFor((max_bytes + 15) / 16);
    const dim3 grid(blocks_x == 0 ? 1 : blocks_x, static_cast<unsigned int>(batch_count));
    CopySegmentsKernel<<<grid, kThreads, 0, AsStream(stream)>>>(batch);
    STRATA_RETURN_IF_ERROR(LaunchStatus("PackChunk/UnpackChunk copy kernel launch"));
  }
  return Status::Ok();
}

}  // namespace internal
}  // namespace strata::kernels
