#include "runtime/comm/host_reduce.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "runtime/base/check.h"

namespace strata {

float Bf16ToFloat(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

uint16_t FloatToBf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// GCC 12 and later implement _Float16 on x86-64 with correct IEEE conversions. Clang before 15
// has no x86 _Float16 but supports the storage-only __fp16 on every target, with the same
// round-to-nearest-even conversions (the libFuzzer build, tools/scripts/fuzz.sh, uses clang 14).
#if defined(__clang__) && !defined(__FLT16_MANT_DIG__)
using Half = __fp16;
#else
using Half = _Float16;
#endif

float Fp16ToFloat(uint16_t bits) {
  Half h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}

uint16_t FloatToFp16(float value) {
  const Half h = static_cast<Half>(value);
  uint16_t bits;
  std::memcpy(&bits, &h, sizeof(bits));
  return bits;
}

namespace {

template <typename T>
T Combine(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return static_cast<T>(a + b);
    case ReduceOp::kMax: return std::max(a, b);
    case ReduceOp::kMin: return std::min(a, b);
  }
  return a;
}

template <typename T>
void ReduceNative(const void* const* inputs, int n, void* dst, int64_t count, ReduceOp op) {
  T* out = static_cast<T*>(dst);
  const T* first = static_cast<const T*>(inputs[0]);
  if (out != first) std::memmove(out, first, count * sizeof(T));
  for (int k = 1; k < n; ++k) {
    const T* in = static_cast<const T*>(inputs[k]);
    for (int64_t i = 0; i < count; ++i) out[i] = Combine(out[i], in[i], op);
  }
  if (op == ReduceOp::kAvg) {
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(out[i] / static_cast<T>(n));
  }
}

// 16-bit floats: accumulate a block in fp32, round once. Blocks bound the scratch memory.
template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void Reduce16(const void* const* inputs, int n, void* dst, int64_t count, ReduceOp op) {
  constexpr int64_t kBlock = 4096;
  float acc[kBlock];
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t base = 0; base < count; base += kBlock) {
    const int64_t len = std::min(kBlock, count - base);
    const uint16_t* first = static_cast<const uint16_t*>(inputs[0]) + base;
    for (int64_t i = 0; i < len; ++i) acc[i] = ToF(first[i]);
    for (int k = 1; k < n; ++k) {
      const uint16_t* in = static_cast<const uint16_t*>(inputs[k]) + base;
      for (int64_t i = 0; i < len; ++i) acc[i] = Combine(acc[i], ToF(in[i]), op);
    }
    if (op == ReduceOp::kAvg) {
      for (int64_t i = 0; i < len; ++i) acc[i] /= static_cast<float>(n);
    }
    for (int64_t i = 0; i < len; ++i) out[base + i] = FromF(acc[i]);
  }
}

template <typename T>
void DivideNative(void* buf, int64_t count, int divisor) {
  T* p = static_cast<T*>(buf);
  for (int64_t i = 0; i < count; ++i) p[i] = static_cast<T>(p[i] / static_cast<T>(divisor));
}

}  // namespace

void ReduceHostBuffers(const void* const* inputs, int n_inputs, void* dst, int64_t count,
                       DType dtype, ReduceOp op) {
  STRATA_DCHECK(n_inputs >= 1 && count >= 0);
  switch (dtype) {
    case DType::kF32: return ReduceNative<float>(inputs, n_inputs, dst, count, op);
    case DType::kF64: return ReduceNative<double>(inputs, n_inputs, dst, count, op);
    case DType::kI32: return ReduceNative<int32_t>(inputs, n_inputs, dst, count, op);
    case DType::kI64: return ReduceNative<int64_t>(inputs, n_inputs, dst, count, op);
    case DType::kU8: return ReduceNative<uint8_t>(inputs, n_inputs, dst, count, op);
    case DType::kBF16:
      return Reduce16<Bf16ToFloat, FloatToBf16>(inputs, n_inputs, dst, count, op);
    case DType::kF16:
      return Reduce16<Fp16ToFloat, FloatToFp16>(inputs, n_inputs, dst, count, op);
  }
}

void DivideHostBuffer(void* buf, int64_t count, DType dtype, int divisor) {
  STRATA_DCHECK(divisor >= 1);
  if (divisor == 1) return;
  switch (dtype) {
    case DType::kF32: return DivideNative<float>(buf, count, divisor);
    case DType::kF64: return DivideNative<double>(buf, count, divisor);
    case DType::kI32: return DivideNative<int32_t>(buf, count, divisor);
    case DType::kI64: return DivideNative<int64_t>(buf, count, divisor);
    case DType::kU8: return DivideNative<uint8_t>(buf, count, divisor);
    case DType::kBF16:
    case DType::kF16: {
      const bool bf = dtype == DType::kBF16;
      uint16_t* p = static_cast<uint16_t*>(buf);
      for (int64_t i = 0; i < count; ++i) {
        const float v = (bf ? Bf16ToFloat(p[i]) : Fp16ToFloat(p[i])) / static_cast<float>(divisor);
        p[i] = bf ? FloatToBf16(v) : FloatToFp16(v);
      }
      return;
    }
  }
}

}  // namespace strata
