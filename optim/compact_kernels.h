// Internal to optim/: the per-ISA block functions behind compact_formats.h. Each ISA's file is
// compiled with its flags (optim/CMakeLists.txt) and called only after cpuid says it can run.
// Every vector path performs the scalar reference's operations lane by lane (the same integer
// hash, the same IEEE division and comparisons), so the results are bit-identical.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::optim::internal {

struct CompactKernels {
  // out[i] = FloatToBf16Stochastic(x[i], Hash32(lo + i ^ high)): the caller guarantees that
  // lo + n does not wrap (indices of one call share their upper 32 bits), and passes
  // high = RoundingHigh(key, index_base), lo = low 32 bits of index_base.
  void (*round_sr)(const float* x, uint16_t* out, size_t n, uint32_t high, uint32_t lo);
  // codes[i] = #{k < 255 : mids[k] < x[i] / scale} for scale > 0.
  void (*quantize)(const float* x, size_t n, float scale, const float* mids, uint8_t* codes);
  // out[i] = map[codes[i]] * scale.
  void (*dequantize)(const uint8_t* codes, float scale, size_t n, const float* map, float* out);
  // max |x[i]| (x finite).
  float (*absmax)(const float* x, size_t n);
};

CompactKernels CompactKernelsScalar();
CompactKernels CompactKernelsAvx2();
CompactKernels CompactKernelsAvx512();

}  // namespace strata::optim::internal
