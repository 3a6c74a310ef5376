#include "tiers/hbm/device_factory.h"
#include "runtime/base/env_vars.h"

#include <cstdlib>

#include "tiers/hbm/cpu_device.h"
#include "tiers/hbm/cuda_device.h"

namespace strata {

int CudaDeviceCount() { return CudaDeviceCountImpl(); }

namespace {

// "cuda" and "auto" mean this rank's GPU: LOCAL_RANK's, as launchers (strata-launch, torchrun)
// set it and as the NCCL communicator binds, or GPU 0 when it is unset.
int LocalCudaIndex() {
  const char* v = GetEnv(kEnvLocalRank);
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const long i = std::strtol(v, &end, 10);
  return *end == '\0' && i >= 0 && i < 1024 ? static_cast<int>(i) : 0;
}

}  // namespace

StatusOr<std::unique_ptr<Device>> CreateDevice(const std::string& spec, uint64_t capacity) {
  if (spec == "cpu") return MakeCpuDevice(capacity == 0 ? kCpuDeviceDefaultCapacity : capacity);
  if (spec == "auto") {
    if (CudaDeviceCount() > 0) return MakeCudaDevice(LocalCudaIndex(), capacity);
    return MakeCpuDevice(capacity == 0 ? kCpuDeviceDefaultCapacity : capacity);
  }
  if (spec == "cuda") return MakeCudaDevice(LocalCudaIndex(), capacity);
  if (spec.rfind("cuda:", 0) == 0) {
    const std::string idx = spec.substr(5);
    char* end = nullptr;
    long i = std::strtol(idx.c_str(), &end, 10);
    if (!idx.empty() && *end == '\0' && i >= 0 && i < 1024)
      return MakeCudaDevice(static_cast<int>(i), capacity);
  }
  return InvalidArgument(StrCat("device '", spec, "' is not one of auto, cpu, cuda, cuda:N"));
}

std::vector<std::string> AvailableDevices() {
  std::vector<std::string> out{"cpu"};
  for (int i = 0, n = CudaDeviceCount(); i < n; ++i) out.push_back(StrCat("cuda:", i));
  return out;
}

}  // namespace strata
