// Note [bf16 by capability] (runtime/engine/compute_dtype.cc): "auto" picks bf16 only where the device
// computes it natively; an explicit bf16 on an emulating CPU runs, flagged for the warning.
#include "runtime/engine/compute_dtype.h"

#include <cstdlib>

#include <gtest/gtest.h>

#include "runtime/base/host_info.h"
#include "tests/test_util.h"

namespace strata {
namespace {

Config Resolved(const char* text, bool native_bf16) {
  auto c = Config::FromJsonText(text);
  EXPECT_TRUE(c.ok()) << c.status();
  AutoContext ctx;
  ctx.native_bf16 = native_bf16;
  EXPECT_OK(c->ResolveAuto(ctx));
  return *c;
}

TEST(ComputeDtype, AutoPicksBf16OnlyWhereItIsNative) {
  const char* auto_bf16 = R"({"bf16": {"enabled": "auto"}})";
  ComputeDtypeChoice emulated = ChooseComputeDtype(Resolved(auto_bf16, false), DeviceKind::kCpu, false);
  EXPECT_EQ(emulated.dtype, optim::DType::kFloat32);
  EXPECT_FALSE(emulated.slow_bf16);
  ComputeDtypeChoice native = ChooseComputeDtype(Resolved(auto_bf16, true), DeviceKind::kCpu, true);
  EXPECT_EQ(native.dtype, optim::DType::kBFloat16);
  EXPECT_FALSE(native.slow_bf16);
}

TEST(ComputeDtype, ExplicitBf16OnAnEmulatingCpuRunsAndIsFlagged) {
  const char* on = R"({"bf16": {"enabled": true}})";
  ComputeDtypeChoice cpu = ChooseComputeDtype(Resolved(on, false), DeviceKind::kCpu, false);
  EXPECT_EQ(cpu.dtype, optim::DType::kBFloat16);
  EXPECT_TRUE(cpu.slow_bf16);
  // A GPU is never flagged (the build targets sm_80+, which all compute bf16).
  EXPECT_FALSE(ChooseComputeDtype(Resolved(on, false), DeviceKind::kCuda, false).slow_bf16);
  EXPECT_EQ(ChooseComputeDtype(Resolved("{}", true), DeviceKind::kCpu, true).dtype, optim::DType::kFloat32);
  EXPECT_EQ(ChooseComputeDtype(Resolved(R"({"fp16": {"enabled": true}})", true), DeviceKind::kCuda, true).dtype,
            optim::DType::kFloat16);
}

TEST(ComputeDtype, CapabilityOverrideAndWarningText) {
  ASSERT_EQ(setenv("STRATA_CPU_BF16", "0", 1), 0);
  EXPECT_FALSE(CpuHasNativeBf16());
  EXPECT_FALSE(DeviceHasNativeBf16(DeviceKind::kCpu));
  ASSERT_EQ(setenv("STRATA_CPU_BF16", "1", 1), 0);
  EXPECT_TRUE(CpuHasNativeBf16());
  unsetenv("STRATA_CPU_BF16");
  EXPECT_TRUE(DeviceHasNativeBf16(DeviceKind::kCuda));
  const std::string w = SlowBf16Warning(5.0, 50.0);
  EXPECT_NE(w.find("5.0 GFLOP/s in bf16 against 50.0 GFLOP/s in fp32 (10.0x slower)"), std::string::npos) << w;
  EXPECT_NE(w.find("Set bf16.enabled to false, or to \"auto\""), std::string::npos) << w;
  EXPECT_NE(w.find(ReadHostInfo().isa), std::string::npos) << w;
  // When the emulation measures faster, the warning does not claim fp32 would be faster.
  const std::string f = SlowBf16Warning(60.0, 50.0);
  EXPECT_NE(f.find("(1.2x faster)"), std::string::npos) << f;
  EXPECT_EQ(f.find("for full speed"), std::string::npos) << f;
  // The measurement itself is real: both dtypes report a positive rate.
  EXPECT_GT(MeasureCpuMatmulGflops(torch::kFloat32, 128), 0.0);
  EXPECT_GT(MeasureCpuMatmulGflops(torch::kBFloat16, 128), 0.0);
}

}  // namespace
}  // namespace strata
