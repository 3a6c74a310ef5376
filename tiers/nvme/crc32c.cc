#include "tiers/nvme/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include "runtime/base/cpu_features.h"

namespace strata::nvme {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Table {
  std::array<uint32_t, 256> t{};
  constexpr Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[i] = c;
    }
  }
};
constexpr Table kTable;

// Multiplies two polynomials mod the CRC polynomial, in the reflected bit order the CRC
// register uses (bit 31 is x^0).
uint32_t MulModPoly(uint32_t a, uint32_t b) {
  uint32_t prod = 0;
  for (int i = 31; i >= 0; --i) {
    if (a & (1u << i)) prod ^= b;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;  // b *= x
  }
  return prod;
}

// x^(8 * bytes) mod P: what running `bytes` zero bytes through the register multiplies it by.
uint32_t ZeroBytesOperator(size_t bytes) {
  uint32_t r = 1u << 31;  // x^0
  for (size_t i = 0; i < 8 * bytes; ++i) r = (r & 1) ? (r >> 1) ^ kPoly : r >> 1;
  return r;
}

#if defined(__x86_64__)
// Note [three-lane crc]
// The crc32 instruction has a latency of 3 cycles and a throughput of 1, so one dependent chain
// uses a third of the unit. Large inputs are cut into runs of three kLane-byte lanes processed in
// one loop as three independent chains (the second and third starting from 0), then joined:
// crc(A|B|C) = crc(A)·x^(16·kLane) + crc(B)·x^(8·kLane) + crc(C), since a CRC register is linear
// and feeding it n zero bytes multiplies it by x^(8n) mod P.
constexpr size_t kLane = 4096;

// Compiled for SSE4.2 regardless of the build's -march, and only called after the CPU check.
__attribute__((target("sse4.2"))) uint32_t ExtendSse42(uint32_t crc, const uint8_t* p, size_t n) {
  static const uint32_t kShift1 = ZeroBytesOperator(kLane);
  static const uint32_t kShift2 = ZeroBytesOperator(2 * kLane);
  uint64_t c = static_cast<uint32_t>(~crc);
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 3 * kLane) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t v0, v1, v2;
      std::memcpy(&v0, p + i, 8);
      std::memcpy(&v1, p + kLane + i, 8);
      std::memcpy(&v2, p + 2 * kLane + i, 8);
      c = _mm_crc32_u64(c, v0);
      c1 = _mm_crc32_u64(c1, v1);
      c2 = _mm_crc32_u64(c2, v2);
    }
    c = MulModPoly(static_cast<uint32_t>(c), kShift2) ^ MulModPoly(static_cast<uint32_t>(c1), kShift1) ^
        static_cast<uint32_t>(c2);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return ~static_cast<uint32_t>(c);
}

bool DetectSse42() { return Cpu().sse42; }
#endif

}  // namespace

uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) c = kTable.t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return ~c;
}

bool Crc32cIsHardware() {
#if defined(__x86_64__)
  static const bool hw = DetectSse42();
  return hw;
#else
  return false;
#endif
}

uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  if (Crc32cIsHardware()) return ExtendSse42(crc, static_cast<const uint8_t*>(data), n);
#endif
  return Crc32cExtendPortable(crc, data, n);
}

}  // namespace strata::nvme
