// What this x86-64 CPU can run, read once from CPUID and XGETBV: the one place that asks, for
// every compiler (GCC's __builtin_cpu_supports lacks some names in one version, clang's others).
// A vector extension counts only when the OS also saves its registers (XCR0): AVX needs the
// YMM state, AVX-512 the opmask and ZMM states. Thread-safe (computed once, then read-only).
#pragma once

namespace strata {

struct CpuFeatures {
  bool sse42 = false;
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false;
  bool avx512vbmi = false;  // byte permutes across a whole register (vpermb, vpermi2b)
};

const CpuFeatures& Cpu();

}  // namespace strata
