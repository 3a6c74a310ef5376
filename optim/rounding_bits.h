// The counter-based random bits of stochastic rounding (Note [stochastic rounding] in
// optim/compact_formats.h) and the rounding itself, on integers only: one definition that the
// CPU paths and the CUDA kernels (kernels/cuda_compact_kernels.cu) both call, so that a bf16
// master rounds to the same bits on every ISA and on the GPU. No LibTorch, no oneTBB: nvcc
// includes this header.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define STRATA_BITS_HD __host__ __device__
#else
#define STRATA_BITS_HD
#endif

namespace strata::optim {

// A 32-bit integer mixer (xorshift-multiply, two rounds; constants from Chris Wellons' hash
// prospector, "lowbias32"). Every operation has a 32-bit SIMD form on AVX2 and AVX-512.
STRATA_BITS_HD inline uint32_t Hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The per-step key: a mix of the run's seed and the optimizer step.
STRATA_BITS_HD inline uint32_t RoundingKey(uint64_t seed, int64_t step) {
  const uint64_t s = static_cast<uint64_t>(step);
  uint32_t k = Hash32(static_cast<uint32_t>(seed) ^ 0x9e3779b9u);
  k = Hash32(k ^ static_cast<uint32_t>(seed >> 32));
  k = Hash32(k ^ static_cast<uint32_t>(s));
  return Hash32(k ^ static_cast<uint32_t>(s >> 32));
}

// The upper-index part of RoundingBits, constant over 2^32 consecutive indices (the vector
// paths compute it once per block).
STRATA_BITS_HD inline uint32_t RoundingHigh(uint32_t key, uint64_t index) {
  return Hash32(static_cast<uint32_t>(index >> 32) ^ key);
}

// 32 random bits for element `index` under `key`.
STRATA_BITS_HD inline uint32_t RoundingBits(uint32_t key, uint64_t index) {
  return Hash32(static_cast<uint32_t>(index) ^ RoundingHigh(key, index));
}

// The bf16 bits of the fp32 value whose bit pattern is `u`, rounded stochastically with `bits`
// (its low 16 are used): NaN stays NaN (made quiet, as FloatToBf16 does), the rest adds the
// random bits and truncates.
STRATA_BITS_HD inline uint16_t Bf16StochasticOfBits(uint32_t u, uint32_t bits) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + (bits & 0xffffu)) >> 16);
}

}  // namespace strata::optim
