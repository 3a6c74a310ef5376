// Element types of optimizer buffers and the scalar conversions every SIMD path must reproduce.
//
// The scalar conversions here are the reference: each vector path of the CPU Adam
// (optim/cpu_adam.h) produces bit-identical 16-bit values for the same float input, so a
// parameter copy written on an AVX-512 machine equals the one written on any other x86-64.
//
// Thread safety: everything here is a pure function.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace strata::optim {

enum class DType : uint8_t {
  kFloat32 = 0,
  kBFloat16 = 1,  // 1 sign, 8 exponent, 7 mantissa bits: fp32's range, 2^-8 relative spacing
  kFloat16 = 2,   // IEEE binary16: 5 exponent, 10 mantissa bits, max 65504
};

// "fp32", "bf16", "fp16".
const char* DTypeName(DType t);
// 4 or 2.
size_t DTypeSize(DType t);

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// bf16 -> fp32 is exact: the 16 bits are fp32's upper half.
inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

// fp32 -> bf16, round to nearest, ties to even. Subnormals are rounded like any other value
// (not flushed). NaN stays NaN: the upper 16 bits with the quiet bit set, which is what the
// AVX-512 BF16 instruction returns for NaN, so every path agrees bit for bit. Overflow past
// bf16's largest finite value rounds to infinity, as IEEE rounding does.
inline uint16_t FloatToBf16(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  // Adding 0x7fff rounds up anything above the halfway point; the extra lsb of the kept part
  // pushes an exact tie up only when the kept part is odd, giving ties-to-even.
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

// fp16 -> fp32, exact for every one of the 65536 inputs (subnormals, infinities, NaN payloads).
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13));
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return BitsToFloat(sign);
  // Subnormal half: normalise so the leading 1 becomes fp32's implicit bit.
  uint32_t e = 113;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return BitsToFloat(sign | (e << 23) | ((mant & 0x3ffu) << 13));
}

// fp32 -> fp16, round to nearest, ties to even, with IEEE overflow to infinity and gradual
// underflow to subnormals: the same results as F16C's vcvtps2ph with rounding mode 0.
// NaN keeps its sign and top payload bits and becomes quiet, as vcvtps2ph does.
inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  // 65520 (0x477ff000) is halfway between 65504 (odd mantissa) and 65536: ties go to the even
  // one, which is infinity.
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a >= 0x38800000u) {  // normal in fp16 (>= 2^-14)
    const uint32_t rebased = a - 0x38000000u;  // exponent bias 127 -> 15
    return static_cast<uint16_t>(sign | ((rebased + 0xfffu + ((rebased >> 13) & 1u)) >> 13));
  }
  // Subnormal or zero in fp16: units of 2^-24. 2^-25 and below round to zero (2^-25 is a tie
  // with the even result 0).
  if (a <= 0x33000000u) return sign;
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - (a >> 23);  // 14..24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal: right
  return static_cast<uint16_t>(sign | q);
}

}  // namespace strata::optim
