// Compact state formats: stochastic rounding to bf16 and 8-bit blockwise moments. The scalar
// functions here are the reference; the vector paths (compact_kernel_*.cc, chosen at run time
// like the Adam kernels) give bit-identical results on every ISA.
//
// Note [stochastic rounding]
// A bf16 master weight updated with round-to-nearest loses every update smaller than half its
// ulp (2^-9 of the weight): late in training, most of them. Stochastic rounding rounds x up with
// probability (x - down) / (up - down), so the expected stored value is x and small updates
// survive on average. Here: add 16 random bits to x's fp32 bit pattern and truncate to the upper
// 16. NaN stays NaN (quiet, as FloatToBf16); inf stays inf; a finite value within one bf16 ulp
// of the largest finite bf16 may round up to inf (probability below 2^-8 for those values only).
//
// The random bits are a counter-based function of (seed, step, element index), not a stream:
// the same element at the same step gets the same bits whatever the chunk size, the thread
// count, the rank count or the device, so runs that split the work differently stay equal.
// Hash32 and the bits' recipe live in optim/rounding_bits.h, which the CUDA kernels share.
//
// Note [8-bit moments]
// exp_avg and exp_avg_sq stored as one byte per element in blocks of kInt8Block elements, each
// block with an fp32 scale (its largest |value|), as in Dettmers et al., "8-bit Optimizers via
// Block-wise Quantization" (arXiv 2110.02861). A byte indexes a 256-entry dynamic map of
// values in [-1, 1] (signed, for exp_avg) or [0, 1] (unsigned, for exp_avg_sq): the values are
// spread over seven decades (1 down to 1e-6) with more codes for the larger decades, so the
// relative error stays bounded across the range Adam's moments span. Quantizing picks the
// nearest map value of x / scale (ties to the lower code); dequantizing is map[code] * scale.
//
// Block size 256: small enough that one large gradient raises the scale of only 255 neighbours
// (the error of a value is bounded by its block's largest, not the chunk's), large enough that
// the scales cost 4/256 of a byte per element (2.03 bytes per parameter for both moments), and
// a block of every stream (fp32 scratch for master, m and v: 3 KB) stays in L1 while the
// optimizer updates it.
//
// Thread safety: pure functions; buffers are the caller's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/cpu_adam.h"
#include "optim/dtype.h"
#include "optim/rounding_bits.h"

namespace strata::optim {

// --- stochastic rounding ---------------------------------------------------------------------

// fp32 -> bf16 rounded stochastically with `bits` (its low 16 are used).
inline uint16_t FloatToBf16Stochastic(float f, uint32_t bits) {
  return Bf16StochasticOfBits(FloatBits(f), bits);
}

// Writes out[i] = FloatToBf16Stochastic(x[i], RoundingBits(key, index_base + i)) for i < n.
void RoundToBf16Stochastic(const float* x, uint16_t* out, size_t n, uint32_t key,
                           uint64_t index_base, Isa isa = Isa::kAuto);

// --- 8-bit blockwise moments -----------------------------------------------------------------

inline constexpr size_t kInt8Block = 256;

// Bytes of an 8-bit state of n elements: the codes, padded to 4, then one fp32 scale per block.
inline size_t Int8StateBytes(size_t n) {
  return (n + 3) / 4 * 4 + 4 * ((n + kInt8Block - 1) / kInt8Block);
}
// Where the scales of an 8-bit state of n elements start in its buffer.
inline size_t Int8ScaleOffset(size_t n) { return (n + 3) / 4 * 4; }

// The 256 map values, ascending: signed spans [-1, 1] (exp_avg), unsigned [0, 1] (exp_avg_sq).
// Both hold 0 and 1 exactly.
const float* DynamicMap(bool is_signed);
// The 255 midpoints between consecutive map values (what quantizing compares against).
const float* DynamicMapMidpoints(bool is_signed);
// The code of 0.
uint8_t DynamicMapZero(bool is_signed);

// Quantizes one block (n <= kInt8Block values): *scale = max |x| over the values that are not
// NaN, codes[i] = the nearest map value's index for x[i] / *scale (all zero codes when the scale
// is 0). A NaN (x[i] NaN, or an infinite scale over an infinite x[i]) gets code 0; every ISA gives
// the same bytes for those too.
void QuantizeBlock(const float* x, size_t n, bool is_signed, uint8_t* codes, float* scale,
                   Isa isa = Isa::kAuto);
// out[i] = map[codes[i]] * scale for one block.
void DequantizeBlock(const uint8_t* codes, float scale, size_t n, bool is_signed, float* out,
                     Isa isa = Isa::kAuto);

// The largest error quantizing can make relative to a block's scale: half the widest gap of
// the map (the format's stated error bound; tests hold QuantizeBlock to it).
float DynamicMapMaxError(bool is_signed);

}  // namespace strata::optim
