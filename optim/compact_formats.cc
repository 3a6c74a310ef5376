#include "optim/compact_formats.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "optim/compact_kernels.h"

namespace strata::optim {
namespace {

struct Map {
  std::array<float, 256> values;
  std::array<float, 255> mids;
  uint8_t zero = 0;
  float max_error = 0;
};

// Note [8-bit moments]: seven decades, 10^-6 .. 10^0; the decade at 10^(d-6) holds 2^d values
// per sign (signed) or 2^(d+1) (unsigned), each the centre of an equal slice of [0.1, 1] times
// the decade's scale; then 0 and 1.
Map BuildMap(bool is_signed) {
  std::vector<double> v;
  for (int d = 0; d < 7; ++d) {
    const int count = is_signed ? 1 << d : 1 << (d + 1);
    const double decade = std::pow(10.0, d - 6);
    for (int j = 0; j < count; ++j) {
      const double value = (0.1 + 0.9 * (j + 0.5) / count) * decade;
      v.push_back(value);
      if (is_signed) v.push_back(-value);
    }
  }
  v.push_back(0.0);
  v.push_back(1.0);
  std::sort(v.begin(), v.end());
  Map m;
  for (size_t i = 0; i < 256; ++i) m.values[i] = static_cast<float>(v[i]);
  for (size_t i = 0; i < 255; ++i) {
    m.mids[i] = static_cast<float>((static_cast<double>(m.values[i]) + m.values[i + 1]) / 2);
    m.max_error = std::max(m.max_error, (m.values[i + 1] - m.values[i]) / 2);
    if (m.values[i] == 0.0f) m.zero = static_cast<uint8_t>(i);
  }
  if (is_signed) m.max_error = std::max(m.max_error, m.values[0] + 1.0f);  // -1 to the lowest
  return m;
}

const Map& GetMap(bool is_signed) {
  static const Map s = BuildMap(true), u = BuildMap(false);
  return is_signed ? s : u;
}

internal::CompactKernels Kernels(Isa isa) {
  if (isa == Isa::kAuto) isa = ResolveAutoIsa();
  switch (isa) {
    case Isa::kAvx512:
    case Isa::kAvx512Bf16:
      if (IsaSupported(isa)) return internal::CompactKernelsAvx512();
      break;
    case Isa::kAvx2:
      if (IsaSupported(isa)) return internal::CompactKernelsAvx2();
      break;
    default:
      break;
  }
  return internal::CompactKernelsScalar();
}

}  // namespace

const float* DynamicMap(bool is_signed) { return GetMap(is_signed).values.data(); }
const float* DynamicMapMidpoints(bool is_signed) { return GetMap(is_signed).mids.data(); }
uint8_t DynamicMapZero(bool is_signed) { return GetMap(is_signed).zero; }
float DynamicMapMaxError(bool is_signed) { return GetMap(is_signed).max_error; }

void RoundToBf16Stochastic(const float* x, uint16_t* out, size_t n, uint32_t key,
                           uint64_t index_base, Isa isa) {
  const internal::CompactKernels k = Kernels(isa);
  // Split where the index's upper 32 bits change, so each piece has one RoundingHigh.
  while (n > 0) {
    const uint64_t to_wrap = (uint64_t{1} << 32) - (index_base & 0xffffffffu);
    const size_t piece = static_cast<size_t>(std::min<uint64_t>(n, to_wrap));
    k.round_sr(x, out, piece, RoundingHigh(key, index_base), static_cast<uint32_t>(index_base));
    x += piece;
    out += piece;
    n -= piece;
    index_base += piece;
  }
}

void QuantizeBlock(const float* x, size_t n, bool is_signed, uint8_t* codes, float* scale,
                   Isa isa) {
  const internal::CompactKernels k = Kernels(isa);
  *scale = k.absmax(x, n);
  if (*scale == 0.0f) {
    std::fill(codes, codes + n, DynamicMapZero(is_signed));
    return;
  }
  k.quantize(x, n, *scale, DynamicMapMidpoints(is_signed), codes);
}

void DequantizeBlock(const uint8_t* codes, float scale, size_t n, bool is_signed, float* out,
                     Isa isa) {
  Kernels(isa).dequantize(codes, scale, n, DynamicMap(is_signed), out);
}

}  // namespace strata::optim
