// The CUDA device on a real GPU: allocation accounting, stream-ordered copies through pinned and
// pageable host memory, events across streams, host callbacks. Label gpu; skips without a GPU.
// (The device conformance suite also runs on every cuda:N that AvailableDevices() lists.)
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/base/device.h"
#include "tests/test_util.h"
#include "tiers/hbm/device_factory.h"

namespace strata {
namespace {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
    auto d = CreateDevice("cuda:0", 256 << 20);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(d).value();
  }
  std::unique_ptr<Device> device_;
};

TEST_F(CudaDeviceTest, PinnedAndPageableCopiesRoundTripOnPrioritizedStreams) {
  EXPECT_EQ(device_->kind(), DeviceKind::kCuda);
  constexpr size_t kBytes = 8 << 20;
  ASSERT_OK_AND_ASSIGN(void* dev, device_->Allocate(kBytes));
  ASSERT_OK_AND_ASSIGN(auto h2d, device_->CreateStream(StreamPriority::kHigh));
  ASSERT_OK_AND_ASSIGN(auto d2h, device_->CreateStream(StreamPriority::kNormal));
  ASSERT_OK_AND_ASSIGN(auto copied, device_->CreateEvent());
  void* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(&pinned, kBytes, cudaHostAllocDefault), cudaSuccess);
  std::vector<uint8_t> pageable(kBytes);
  for (size_t i = 0; i < kBytes; ++i) static_cast<uint8_t*>(pinned)[i] = static_cast<uint8_t>(i * 7);
  ASSERT_OK(h2d->MemcpyAsync(dev, pinned, kBytes, CopyKind::kHostToDevice));
  ASSERT_OK(h2d->Record(*copied));
  ASSERT_OK(d2h->Wait(*copied));
  ASSERT_OK(d2h->MemcpyAsync(pageable.data(), dev, kBytes, CopyKind::kDeviceToHost));
  std::atomic<bool> callback_ran{false};
  ASSERT_OK(d2h->LaunchHostFunc([&] { callback_ran = true; }));
  ASSERT_OK(d2h->Synchronize());
  EXPECT_TRUE(callback_ran.load());
  EXPECT_EQ(0, std::memcmp(pageable.data(), pinned, kBytes));
  cudaFreeHost(pinned);
  ASSERT_OK(device_->Free(dev));
  EXPECT_EQ(device_->allocated(), 0u);
}

TEST_F(CudaDeviceTest, ExhaustionIsAStatusAndStickyErrorsAreCleared) {
  auto big = device_->Allocate(size_t{1} << 40);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  // A later allocation still works: no error was left behind.
  ASSERT_OK_AND_ASSIGN(void* p, device_->Allocate(4096));
  ASSERT_OK(device_->Free(p));
}

}  // namespace
}  // namespace strata
