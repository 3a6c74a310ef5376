// The compute dtype a run uses, and why (Note [bf16 by capability] in compute_dtype.cc).
//
// bf16 halves activation and parameter memory, and on CPUs with native bf16 (AVX512_BF16, AMX)
// LibTorch's oneDNN matmuls run several times faster than fp32. On CPUs without it, bf16 matmuls
// are emulated and run an order of magnitude slower than fp32: a 404M-parameter GPT step took
// 472 s in bf16 and 29 s in fp32 on an AVX2-only Zen 3. So "auto" picks bf16 only where it is
// native, and an explicit bf16.enabled=true without it runs as asked with one warning that gives
// the measured rates and the fix.
#pragma once

#include <string>

#include <torch/torch.h>

#include "optim/cpu_adam.h"
#include "runtime/base/config.h"
#include "runtime/base/device.h"
#include "runtime/comm/communicator.h"

namespace strata {

struct ComputeDtypeChoice {
  optim::DType dtype = optim::DType::kFloat32;
  bool slow_bf16 = false;  // bf16 chosen on a CPU device without native bf16 (warn)
};

// fp16.enabled -> fp16; bf16.enabled -> bf16; else fp32. `config` must have had ResolveAuto.
ComputeDtypeChoice ChooseComputeDtype(const Config& config, DeviceKind device, bool native_bf16);

// GFLOP/s of an n x n x n matmul in `dtype` on the CPU with LibTorch's current threads (best of a
// few repetitions, about 0.1 s in all).
double MeasureCpuMatmulGflops(torch::Dtype dtype, int64_t n = 512);

// The one-time warning for ChooseComputeDtype's slow_bf16, with both measured rates and the fix.
std::string SlowBf16Warning(double bf16_gflops, double fp32_gflops);

// The AutoContext fields a device decides: native bf16 (CUDA builds target sm_80+, all with bf16;
// the CPU device asks cpuid, see CpuHasNativeBf16).
bool DeviceHasNativeBf16(DeviceKind device);

// The same dtype as LibTorch and the communicators name it.
inline torch::Dtype TorchDtype(optim::DType d) {
  switch (d) {
    case optim::DType::kFloat32: return torch::kFloat32;
    case optim::DType::kBFloat16: return torch::kBFloat16;
    case optim::DType::kFloat16: return torch::kFloat16;
  }
  return torch::kFloat32;
}

inline strata::DType CommDtype(optim::DType d) {
  switch (d) {
    case optim::DType::kFloat32: return strata::DType::kF32;
    case optim::DType::kBFloat16: return strata::DType::kBF16;
    case optim::DType::kFloat16: return strata::DType::kF16;
  }
  return strata::DType::kF32;
}

}  // namespace strata
