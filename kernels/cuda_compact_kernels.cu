// The compact layouts' optimizer step on the GPU (kernels.h: CompactAdamStep,
// CompactElementwiseStep), bit for bit the CPU's optim::CompactAdamStep /
// CompactElementwiseStep (optim/compact_step.cc).
//
// One thread block of kCompactBlock threads owns one 8-bit block of the shard at a time, one
// thread per element, and does what the CPU's block walk does to it:
// - a block that no run reaches is not touched (its 8-bit codes are not quantized again);
// - every element is widened to fp32: a bf16 master exactly, an 8-bit moment as
//   map[code] * scale;
// - each element of a run is updated with its run's constants, by the very per-element rule the
//   CPU runs (DevAdamElement, or optim/elementwise_rules.h);
// - the block is narrowed back:
//   - a fp32 master and fp32 moments are written where a run is, as the CPU updates them in
//     place;
//   - a bf16 master is written everywhere: a run's elements stochastically with
//     optim::RoundingBits(key, index_base + offset in the run), or to nearest; the others to
//     nearest, as the CPU's narrow of its scratch does;
//   - bf16 moments: to nearest, everywhere;
//   - 8-bit moments: the block's largest |value| is the scale (a maximum is the same in any
//     order); each code is the number of midpoints below value / scale, by the scalar
//     reference's binary search, and is the code of zero when the scale is 0.
// The runs, and the maps of 8-bit moments, go to the device in one stream-ordered allocation
// per call, freed on the stream after the kernel.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/cuda_adam_element.cuh"
#include "kernels/cuda_convert.cuh"
#include "kernels/internal.h"
#include "optim/rounding_bits.h"
#include "runtime/base/cuda_check.h"

namespace strata::kernels::internal {
namespace {

constexpr int kT = static_cast<int>(kCompactBlock);
constexpr size_t kMaxGrid = 65536;
constexpr int kMapSize = 256;

enum Format : int { kF32 = 0, kBf16 = 1, kInt8 = 2 };

// The device copy of a launch's fixed tables; the runs follow it in the same allocation.
struct Tables {
  float maps[2][kMapSize];
  float mids[2][kMapSize];  // 255 midpoints; the last slot is never read
};

__device__ __forceinline__ float LoadGrad(const void* g, DType t, size_t i) {
  if (t == DType::kFloat32) return Load<DType::kFloat32>(g, i);
  if (t == DType::kBFloat16) return Load<DType::kBFloat16>(g, i);
  return Load<DType::kFloat16>(g, i);
}

// The count of midpoints below y, as compact_kernel_scalar.cc's Code.
__device__ __forceinline__ uint32_t CodeOf(float y, const float* mids) {
  uint32_t idx = 0;
  for (uint32_t step = 128; step >= 1; step >>= 1)
    if (mids[idx + step - 1] < y) idx += step;
  return idx;
}

// The largest x over the block's threads (x >= 0), handed to every thread. `red` holds one
// value per warp and is free again when this returns.
__device__ __forceinline__ float BlockMax(float x, float* red) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = x;
  __syncthreads();
  float m = red[0];
  for (int w = 1; w < kT / 32; ++w) m = fmaxf(m, red[w]);
  __syncthreads();
  return m;
}

template <int F>
__device__ __forceinline__ float LoadMoment(const void* base, size_t i, float scale, const float* map) {
  if constexpr (F == kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (F == kBf16) {
    return DevBf16ToFloat(static_cast<const uint16_t*>(base)[i]);
  } else {
    return map[static_cast<const uint8_t*>(base)[i]] * scale;
  }
}

// Narrows one moment of the block back (the whole block calls it: the 8-bit scale is a
// block-wide maximum).
template <int F>
__device__ __forceinline__ void StoreMoment(void* base, size_t i, size_t blk, bool live, bool in_run,
                                            float x, const CompactLaunch& a, const float* mids,
                                            uint8_t zero_code, float* red) {
  if constexpr (F == kF32) {
    if (in_run) static_cast<float*>(base)[i] = x;
  } else if constexpr (F == kBf16) {
    if (live) static_cast<uint16_t*>(base)[i] = DevFloatToBf16(x);
  } else {
    // An infinite moment counts as the largest finite float of its sign, as on the CPU (Note [an
    // infinite moment], compact_formats.cc); fmaxf(0, NaN) is 0: a NaN is skipped, as the CPU's
    // absmax skips it.
    if (isinf(x)) x = copysignf(FLT_MAX, x);
    const float scale = BlockMax(live ? fmaxf(0.0f, fabsf(x)) : 0.0f, red);
    if (live) {
      static_cast<uint8_t*>(base)[i] =
          scale == 0.0f ? zero_code : static_cast<uint8_t>(CodeOf(x / scale, mids));
    }
    if (threadIdx.x == 0)
      reinterpret_cast<float*>(static_cast<char*>(base) + a.int8_scale_offset)[blk] = scale;
  }
}

template <int F>
__device__ __forceinline__ float BlockScale(const void* base, const CompactLaunch& a, size_t blk) {
  if constexpr (F == kInt8) {
    return reinterpret_cast<const float*>(static_cast<const char*>(base) + a.int8_scale_offset)[blk];
  } else {
    return 1.0f;
  }
}

template <CompactRule R, int F>
__global__ void __launch_bounds__(kT)
    CompactKernel(CompactLaunch a, const Tables* __restrict__ tables, const CompactRun* __restrict__ runs) {
  // The flag was written by earlier work on this stream. One vote per block, so that no thread
  // can leave while others wait at a barrier, whatever it read.
  if (__syncthreads_or(a.skip_if_nonfinite != nullptr && a.skip_if_nonfinite->found_nonfinite != 0)) return;
  __shared__ float map_s[2][kMapSize];
  __shared__ float mid_s[2][kMapSize];
  __shared__ float red[kT / 32];
  if constexpr (F == kInt8) {
    for (int s = 0; s < 2; ++s) {
      map_s[s][threadIdx.x] = tables->maps[s][threadIdx.x];
      mid_s[s][threadIdx.x] = tables->mids[s][threadIdx.x];
    }
    __syncthreads();
  }
  const size_t blocks = (a.n + kT - 1) / kT;
  for (size_t blk = blockIdx.x; blk < blocks; blk += gridDim.x) {
    const size_t i = blk * kT + threadIdx.x;
    const bool live = i < a.n;
    // The run holding i: the last one that begins at or before it, if i is inside it.
    size_t lo = 0, hi = a.num_runs;
    while (lo < hi) {
      const size_t mid = (lo + hi) / 2;
      if (runs[mid].begin <= i) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    const bool in_run = live && lo > 0 && i < runs[lo - 1].begin + runs[lo - 1].size;
    if (!__syncthreads_or(in_run)) continue;  // a block no run reaches stays as it is
    const CompactRun* run = in_run ? &runs[lo - 1] : nullptr;

    float p = 0.0f, m = 0.0f, v = 0.0f;
    if (live) {
      p = a.master_format == kF32 ? static_cast<const float*>(a.master)[i]
                                  : DevBf16ToFloat(static_cast<const uint16_t*>(a.master)[i]);
      if (a.exp_avg != nullptr) m = LoadMoment<F>(a.exp_avg, i, BlockScale<F>(a.exp_avg, a, blk), map_s[0]);
      if (a.exp_avg_sq != nullptr)
        v = LoadMoment<F>(a.exp_avg_sq, i, BlockScale<F>(a.exp_avg_sq, a, blk), map_s[1]);
    }
    if (in_run) {
      const float g = LoadGrad(a.grad, a.grad_dtype, i);
      if constexpr (R == CompactRule::kAdam) {
        DevAdamElement(run->adam, p, g, m, v);
      } else if constexpr (R == CompactRule::kSgd) {
        optim::internal::SgdElement(run->sgd, p, g, m);
      } else if constexpr (R == CompactRule::kAdagrad) {
        optim::internal::AdagradElement(run->adagrad, p, g, v);
      } else {
        optim::internal::LionElement(run->lion, p, g, m);
      }
    }
    if (live) {
      if (a.master_format == kF32) {
        if (in_run) static_cast<float*>(a.master)[i] = p;
      } else if (in_run && a.master_format == 2) {
        const uint32_t bits = optim::RoundingBits(a.rounding_key, run->index_base + (i - run->begin));
        static_cast<uint16_t*>(a.master)[i] = optim::Bf16StochasticOfBits(__float_as_uint(p), bits);
      } else {
        static_cast<uint16_t*>(a.master)[i] = DevFloatToBf16(p);
      }
      if (in_run && a.param16 != nullptr) {
        if (a.param16_dtype == DType::kBFloat16) {
          Store<DType::kBFloat16>(a.param16, i, p);
        } else {
          Store<DType::kFloat16>(a.param16, i, p);
        }
      }
    }
    if (a.exp_avg != nullptr)
      StoreMoment<F>(a.exp_avg, i, blk, live, in_run, m, a, mid_s[0], a.zero_code[0], red);
    if (a.exp_avg_sq != nullptr)
      StoreMoment<F>(a.exp_avg_sq, i, blk, live, in_run, v, a, mid_s[1], a.zero_code[1], red);
  }
}

template <CompactRule R>
void LaunchFormat(const CompactLaunch& a, const Tables* t, const CompactRun* runs, unsigned grid,
                  cudaStream_t s) {
  switch (a.moment_format) {
    case kF32: CompactKernel<R, kF32><<<grid, kT, 0, s>>>(a, t, runs); break;
    case kBf16: CompactKernel<R, kBf16><<<grid, kT, 0, s>>>(a, t, runs); break;
    default: CompactKernel<R, kInt8><<<grid, kT, 0, s>>>(a, t, runs); break;
  }
}

}  // namespace

Status CudaCompactStep(const CompactLaunch& a, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // The host image of the device tables: the maps and midpoints, then the runs.
  Tables t{};
  for (int k = 0; k < 2; ++k) {
    std::memcpy(t.maps[k], a.maps[k], sizeof(float) * kMapSize);
    std::memcpy(t.mids[k], a.mids[k], sizeof(float) * (kMapSize - 1));
  }
  std::vector<unsigned char> host(sizeof(Tables) + a.num_runs * sizeof(CompactRun));
  std::memcpy(host.data(), &t, sizeof(Tables));
  std::memcpy(host.data() + sizeof(Tables), a.runs, a.num_runs * sizeof(CompactRun));
  void* dev = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&dev, host.size(), s));
  // From pageable memory the copy is staged before the call returns, so `host` may go when
  // this function does.
  cudaError_t e = cudaMemcpyAsync(dev, host.data(), host.size(), cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess) {
    const auto* tables = static_cast<const Tables*>(dev);
    const auto* runs = reinterpret_cast<const CompactRun*>(static_cast<const char*>(dev) + sizeof(Tables));
    const size_t blocks = (a.n + kT - 1) / kT;
    const unsigned grid = static_cast<unsigned>(blocks < kMaxGrid ? blocks : kMaxGrid);
    switch (a.rule) {
      case CompactRule::kAdam: LaunchFormat<CompactRule::kAdam>(a, tables, runs, grid, s); break;
      case CompactRule::kSgd: LaunchFormat<CompactRule::kSgd>(a, tables, runs, grid, s); break;
      case CompactRule::kAdagrad: LaunchFormat<CompactRule::kAdagrad>(a, tables, runs, grid, s); break;
      case CompactRule::kLion: LaunchFormat<CompactRule::kLion>(a, tables, runs, grid, s); break;
    }
    e = cudaGetLastError();
  }
  const cudaError_t freed = cudaFreeAsync(dev, s);
  STRATA_RETURN_IF_ERROR(CudaToStatus(e, "CompactAdamStep/CompactElementwiseStep kernel launch"));
  return CudaToStatus(freed, "CompactAdamStep/CompactElementwiseStep table free");
}

}  // namespace strata::kernels::internal
