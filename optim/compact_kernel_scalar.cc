// The scalar reference of the compact-format block functions (compact_kernels.h).
#include <cmath>

#include "optim/compact_formats.h"
#include "optim/compact_kernels.h"

namespace strata::optim::internal {
namespace {

void RoundSr(const float* x, uint16_t* out, size_t n, uint32_t high, uint32_t lo) {
  for (size_t i = 0; i < n; ++i)
    out[i] = FloatToBf16Stochastic(x[i], Hash32((lo + static_cast<uint32_t>(i)) ^ high));
}

// The count of midpoints below y, by binary search over the 255 sorted midpoints. The vector
// paths count the same set through the bucket table; a count is a count, so they agree.
inline uint8_t Code(float y, const float* mids) {
  uint32_t idx = 0;
  for (uint32_t step = 128; step >= 1; step >>= 1)
    if (mids[idx + step - 1] < y) idx += step;
  return static_cast<uint8_t>(idx);
}

void Quantize(const float* x, size_t n, float scale, const CodeTables& t, uint8_t* codes) {
  for (size_t i = 0; i < n; ++i) codes[i] = Code(x[i] / scale, t.mids);
}

void Dequantize(const uint8_t* codes, float scale, size_t n, const CodeTables& t, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = t.values[codes[i]] * scale;
}

float Absmax(const float* x, size_t n) {
  float m = 0.0f;
  // A NaN, quiet or signalling, is skipped: no comparison with it holds. (std::fmax skips a
  // quiet NaN but may return NaN for a signalling one, and the next value then replaced the
  // running maximum: a block's scale below its largest value, which the vector paths, the GPU
  // and this loop now all keep.)
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (a > m) m = a;
  }
  return m;
}

void WidenBf16(const uint16_t* h, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(h[i]);
}

void NarrowBf16(const float* x, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = FloatToBf16(x[i]);
}

}  // namespace

CompactKernels CompactKernelsScalar() {
  return {&RoundSr, &Quantize, &Dequantize, &Absmax, &WidenBf16, &NarrowBf16};
}

}  // namespace strata::optim::internal
