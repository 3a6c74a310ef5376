// Device-side conversions shared by the CUDA sources of kernels/: integer twins of
// optim/dtype.h's rounding, so that every kernel stores the bits the CPU reference stores.
// The cvt.rn instructions (__float2bfloat16_rn, __float2half_rn) round finite values the same
// way but return a canonical NaN, where the reference keeps the NaN's sign and payload.
// Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "optim/dtype.h"

namespace strata::kernels::internal {

using optim::DType;

__device__ __forceinline__ uint16_t DevFloatToBf16(float f) {
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

__device__ __forceinline__ uint16_t DevFloatToHalf(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a >= 0x38800000u) {
    const uint32_t rebased = a - 0x38000000u;
    return static_cast<uint16_t>(sign | ((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) return sign;
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - (a >> 23);  // 14..24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

__device__ __forceinline__ float DevBf16ToFloat(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

// Exact for all inputs, NaN payloads included (cvt.f32.f16 would canonicalize NaNs).
__device__ __forceinline__ float DevHalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return __uint_as_float(sign | ((exp + 112u) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24, exact in fp32 (both factors and the product are exact).
  const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return __uint_as_float(sign | __float_as_uint(magnitude));
}

template <DType T>
__device__ __forceinline__ float Load(const void* base, size_t i) {
  if constexpr (T == DType::kFloat32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (T == DType::kBFloat16) {
    return DevBf16ToFloat(static_cast<const uint16_t*>(base)[i]);
  } else {
    return DevHalfToFloat(static_cast<const uint16_t*>(base)[i]);
  }
}

template <DType T>
__device__ __forceinline__ void Store(void* base, size_t i, float x) {
  if constexpr (T == DType::kFloat32) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (T == DType::kBFloat16) {
    static_cast<uint16_t*>(base)[i] = DevFloatToBf16(x);
  } else {
    static_cast<uint16_t*>(base)[i] = DevFloatToHalf(x);
  }
}

}  // namespace strata::kernels::internal
