// Inputs shared by the kernel suites (CPU twins and GPU-vs-CPU).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "optim/dtype.h"

namespace strata::kernels::testing {

// Floats that exercise every rounding case of fp32 -> bf16 / fp16: each of the 65536 upper
// halves (every sign, exponent and upper mantissa, NaN and infinity included) combined with
// low halves at and around both formats' halfway points.
inline std::vector<float> CastInputs() {
  const uint16_t lows[] = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x2fff, 0x3000, 0x3001,
                           0x7fff, 0x8000, 0x8001, 0xefff, 0xf000, 0xffff, 0x5a5a, 0xa5a5};
  std::vector<float> out;
  out.reserve(65536 * (sizeof(lows) / sizeof(lows[0])));
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint16_t lo : lows) out.push_back(optim::BitsToFloat((hi << 16) | lo));
  }
  return out;
}

// Values whose magnitudes spread over `decades` powers of ten around 1, with random signs.
inline std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale = 1.0f,
                                       int decades = 6) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(1.0f, 10.0f);
  std::uniform_int_distribution<int> exp10(-decades / 2, decades / 2);
  std::bernoulli_distribution neg(0.5);
  std::vector<float> out(n);
  for (auto& x : out) {
    x = mant(rng) * std::pow(10.0f, static_cast<float>(exp10(rng))) * scale;
    if (neg(rng)) x = -x;
  }
  return out;
}

// `values` stored as `t` (fp32 as is, 16-bit formats rounded with the scalar reference).
inline std::vector<uint8_t> Encode(const std::vector<float>& values, optim::DType t) {
  std::vector<uint8_t> out(values.size() * optim::DTypeSize(t));
  for (size_t i = 0; i < values.size(); ++i) {
    if (t == optim::DType::kFloat32) {
      std::memcpy(out.data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = t == optim::DType::kBFloat16 ? optim::FloatToBf16(values[i])
                                                      : optim::FloatToHalf(values[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

inline uint64_t DoubleBits(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof(u));
  return u;
}

}  // namespace strata::kernels::testing
