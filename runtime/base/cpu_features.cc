#include "runtime/base/cpu_features.h"

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace strata {
namespace {

#if defined(__x86_64__) || defined(__i386__)
uint64_t Xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures Read() {
  CpuFeatures f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.sse42 = (c & (1u << 20)) != 0;
  const bool osxsave = (c & (1u << 27)) != 0;
  const bool avx = (c & (1u << 28)) != 0;
  const uint64_t xcr0 = osxsave ? Xcr0() : 0;
  const bool ymm = avx && (xcr0 & 0x6) == 0x6;       // SSE and AVX state
  const bool zmm = ymm && (xcr0 & 0xe0) == 0xe0;     // opmask, ZMM0-15 upper, ZMM16-31
  f.fma = ymm && (c & (1u << 12)) != 0;
  f.f16c = ymm && (c & (1u << 29)) != 0;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const unsigned max_sub = a;
  f.avx2 = ymm && (b & (1u << 5)) != 0;
  f.avx512f = zmm && (b & (1u << 16)) != 0;
  f.avx512dq = zmm && (b & (1u << 17)) != 0;
  f.avx512bw = zmm && (b & (1u << 30)) != 0;
  f.avx512vl = zmm && (b & (1u << 31)) != 0;
  f.avx512vbmi = zmm && (c & (1u << 1)) != 0;
  if (max_sub >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = f.avx512f && (a & (1u << 5)) != 0;
  }
  return f;
}
#else
CpuFeatures Read() { return {}; }
#endif

}  // namespace

const CpuFeatures& Cpu() {
  static const CpuFeatures features = Read();
  return features;
}

}  // namespace strata
