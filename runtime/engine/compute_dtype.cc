#include "runtime/engine/compute_dtype.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "runtime/base/host_info.h"

namespace strata {

// Note [bf16 by capability]
// The decision itself is made once, by Config::ResolveAuto (bf16.enabled "auto" -> native bf16),
// so strata-train, strata-estimate, strata-tune and the engine agree on it. This file applies it:
// the engine casts the model to the chosen dtype, and a bf16 run on an emulating CPU says what it
// costs. The warning measures rather than quotes a ratio because the gap depends on the CPU
// (AVX2 parts emulate through fp32 with conversions; AVX-512 parts without BF16 do better).

ComputeDtypeChoice ChooseComputeDtype(const Config& config, DeviceKind device, bool native_bf16) {
  ComputeDtypeChoice c;
  if (config.fp16.enabled) {
    c.dtype = optim::DType::kFloat16;
  } else if (config.bf16.enabled) {
    c.dtype = optim::DType::kBFloat16;
    c.slow_bf16 = device == DeviceKind::kCpu && !native_bf16;
  }
  return c;
}

double MeasureCpuMatmulGflops(torch::Dtype dtype, int64_t n) {
  torch::NoGradGuard no_grad;
  auto opts = torch::TensorOptions().dtype(dtype);
  torch::Tensor a = torch::rand({n, n}).to(opts), b = torch::rand({n, n}).to(opts);
  torch::Tensor c = torch::matmul(a, b);  // warm-up: oneDNN primitive creation, page faults
  double best = 1e30;
  double spent = 0;
  for (int i = 0; i < 20 && spent < 0.1; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    c = torch::matmul(a, b);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
    spent += s;
  }
  return 2.0 * static_cast<double>(n) * n * n / best / 1e9;
}

std::string SlowBf16Warning(double bf16_gflops, double fp32_gflops) {
  const HostInfo h = ReadHostInfo();
  char buf[640];
  const bool slower = bf16_gflops < fp32_gflops;
  std::snprintf(buf, sizeof buf,
                "bf16.enabled=true on a CPU without native bf16 (%s, %s): a 512^3 matmul runs at "
                "%.1f GFLOP/s in bf16 against %.1f GFLOP/s in fp32 (%.1fx %s). %s",
                h.cpu_model.empty() ? "unknown CPU" : h.cpu_model.c_str(), h.isa.c_str(), bf16_gflops,
                fp32_gflops, slower ? fp32_gflops / bf16_gflops : bf16_gflops / fp32_gflops,
                slower ? "slower" : "faster",
                slower ? "Set bf16.enabled to false, or to \"auto\" (fp32 here, bf16 on CPUs with "
                         "AVX512_BF16/AMX and on GPUs), for full speed; bf16 only saves memory here."
                       : "The emulation keeps up with fp32 in this measurement, so bf16 costs no "
                         "speed at this size; larger layers may differ, and \"auto\" picks fp32 "
                         "here.");
  return buf;
}

bool DeviceHasNativeBf16(DeviceKind device) {
  return device == DeviceKind::kCpu ? CpuHasNativeBf16() : true;
}

}  // namespace strata
