// The device conformance suite: every device this machine can create runs the same cases.
// A new device adds nothing here; it is picked up from AvailableDevices().
#include "runtime/base/device.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/kernels.h"
#include "optim/dtype.h"
#include "tests/test_util.h"
#include "tiers/hbm/cpu_device.h"
#include "tiers/hbm/device_factory.h"
#include "tiers/host/staging_buffer.h"

namespace strata {
namespace {

class DeviceConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto d = CreateDevice(GetParam(), 64ull << 20);
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(d).value();
  }
  std::unique_ptr<Device> device_;
};

TEST_P(DeviceConformance, AccountsCapacityAndRefusesWhatDoesNotFit) {
  EXPECT_EQ(device_->capacity(), 64ull << 20);
  ASSERT_OK_AND_ASSIGN(void* a, device_->Allocate(40 << 20));
  EXPECT_GE(device_->allocated(), 40u << 20);
  auto b = device_->Allocate(40 << 20);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("cannot allocate"), std::string::npos);
  ASSERT_OK(device_->Free(a));
  EXPECT_EQ(device_->allocated(), 0u);
  EXPECT_GE(device_->peak_allocated(), 40u << 20);
  ASSERT_OK_AND_ASSIGN(void* c, device_->Allocate(40 << 20));  // the space came back
  ASSERT_OK(device_->Free(c));
  int local = 0;
  EXPECT_EQ(device_->Free(&local).code(), StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(void* z, device_->Allocate(0));
  EXPECT_NE(z, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(z) % 256, 0u);
  ASSERT_OK(device_->Free(z));
}

TEST_P(DeviceConformance, CopiesOfOddSizesAndOffsetsRoundTrip) {
  constexpr size_t kBuf = 1 << 20;
  ASSERT_OK_AND_ASSIGN(void* dev, device_->Allocate(kBuf));
  ASSERT_OK_AND_ASSIGN(void* dev2, device_->Allocate(kBuf));
  ASSERT_OK_AND_ASSIGN(auto stream, device_->CreateStream());
  std::mt19937 rng(42);
  std::vector<uint8_t> src(kBuf), back(kBuf);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  for (size_t size : {size_t{1}, size_t{3}, size_t{7}, size_t{4095}, size_t{4097}, size_t{65537},
                      kBuf - 13}) {
    for (size_t off : {size_t{0}, size_t{1}, size_t{5}, size_t{13}}) {
      if (off + size > kBuf) continue;
      std::fill(back.begin(), back.end(), 0xEE);
      auto* d = static_cast<uint8_t*>(dev) + off;
      auto* d2 = static_cast<uint8_t*>(dev2) + (kBuf - size - off);
      ASSERT_OK(stream->MemcpyAsync(d, src.data() + off, size, CopyKind::kHostToDevice));
      ASSERT_OK(stream->MemcpyAsync(d2, d, size, CopyKind::kDeviceToDevice));
      ASSERT_OK(stream->MemcpyAsync(back.data() + off, d2, size, CopyKind::kDeviceToHost));
      ASSERT_OK(stream->Synchronize());
      ASSERT_EQ(0, std::memcmp(back.data() + off, src.data() + off, size))
          << "size=" << size << " off=" << off;
      EXPECT_EQ(back[off + size - 1 + (off + size < kBuf ? 1 : 0)],
                off + size < kBuf ? 0xEE : src[kBuf - 1])
          << "copy wrote past its end";
    }
  }
  ASSERT_OK(stream->MemsetAsync(dev, 0x7f, 4099));
  ASSERT_OK(stream->MemcpyAsync(back.data(), dev, 4100, CopyKind::kDeviceToHost));
  ASSERT_OK(stream->Synchronize());
  for (int i = 0; i < 4099; ++i) ASSERT_EQ(back[i], 0x7f) << i;
  ASSERT_OK(device_->Free(dev));
  ASSERT_OK(device_->Free(dev2));
}

TEST_P(DeviceConformance, WorkOnOneStreamRunsInOrder) {
  ASSERT_OK_AND_ASSIGN(auto stream, device_->CreateStream());
  std::vector<int> order;
  for (int i = 0; i < 200; ++i) ASSERT_OK(stream->LaunchHostFunc([&order, i] { order.push_back(i); }));
  ASSERT_OK(stream->Synchronize());
  ASSERT_EQ(order.size(), 200u);
  for (int i = 0; i < 200; ++i) EXPECT_EQ(order[i], i);
  EXPECT_TRUE(stream->Query());
}

TEST_P(DeviceConformance, EventsOrderWorkAcrossStreams) {
  ASSERT_OK_AND_ASSIGN(auto producer, device_->CreateStream(StreamPriority::kNormal));
  ASSERT_OK_AND_ASSIGN(auto consumer, device_->CreateStream(StreamPriority::kHigh));
  ASSERT_OK_AND_ASSIGN(auto ready, device_->CreateEvent());
  EXPECT_TRUE(ready->Query()) << "an event never recorded is complete";

  std::atomic<bool> release{false};
  std::atomic<int> value{0};
  int seen = -1;
  ASSERT_OK(producer->LaunchHostFunc([&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    value.store(42);
  }));
  ASSERT_OK(producer->Record(*ready));
  ASSERT_OK(consumer->Wait(*ready));
  ASSERT_OK(consumer->LaunchHostFunc([&] { seen = value.load(); }));

  // Wait() must not block the host thread, and the consumer must not run ahead.
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(ready->Query());
  EXPECT_FALSE(consumer->Query());
  release.store(true);
  ASSERT_OK(ready->Synchronize());
  EXPECT_TRUE(ready->Query());
  ASSERT_OK(consumer->Synchronize());
  EXPECT_EQ(seen, 42);

  // Re-recording moves the event to the newer point.
  std::atomic<bool> second{false};
  ASSERT_OK(producer->LaunchHostFunc([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    second.store(true);
  }));
  ASSERT_OK(producer->Record(*ready));
  ASSERT_OK(ready->Synchronize());
  EXPECT_TRUE(second.load());
  ASSERT_OK(device_->Synchronize());
}

// Stream::LaunchKernel: device compute queued between copies runs in their order, on every
// device, and the caller does not wait for it: the kernel (a bf16 cast of what the first copy
// brought in) must see the copy before it and be seen by the copy after it.
TEST_P(DeviceConformance, KernelsRunInStreamOrderWithCopiesAndDoNotBlockTheCaller) {
  constexpr size_t n = 100000;
  const kernels::Backend backend =
      device_->kind() == DeviceKind::kCuda ? kernels::Backend::kCuda : kernels::Backend::kCpu;
  ASSERT_OK_AND_ASSIGN(void* f32, device_->Allocate(n * 4));
  ASSERT_OK_AND_ASSIGN(void* b16, device_->Allocate(n * 2));
  ASSERT_OK_AND_ASSIGN(auto stream, device_->CreateStream());
  // Host ends in page-locked memory: from pageable memory a CUDA copy returns only once it has
  // run, which the held stream below would never let happen.
  StagingBuffer in_buf, out_buf;
  ASSERT_OK(in_buf.Reserve(n * 4));
  ASSERT_OK(out_buf.Reserve(n * 2));
  auto* in = static_cast<float*>(in_buf.data());
  auto* out = static_cast<uint16_t*>(out_buf.data());
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (size_t i = 0; i < n; ++i) in[i] = normal(rng);
  std::fill(out, out + n, uint16_t{0xFFFF});

  std::atomic<bool> release{false};
  ASSERT_OK(stream->LaunchHostFunc([&] {
    while (!release.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }));
  ASSERT_OK(stream->MemcpyAsync(f32, in, n * 4, CopyKind::kHostToDevice));
  // Kernels take compute addresses (on the strict CPU device, the readable alias).
  const float* src = static_cast<const float*>(device_->ComputeAddress(f32));
  void* dst = device_->ComputeAddress(b16);
  ASSERT_OK(stream->LaunchKernel([backend, src, dst](void* native) {
    return kernels::CastFp32To16(backend, src, dst, kernels::DType::kBFloat16, n, native);
  }));
  ASSERT_OK(stream->MemcpyAsync(out, b16, n * 2, CopyKind::kDeviceToHost));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(stream->Query()) << "everything queues behind the held host function";
  EXPECT_EQ(out[0], 0xFFFF);
  release.store(true);
  ASSERT_OK(stream->Synchronize());
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], optim::FloatToBf16(in[i])) << "element " << i;
  ASSERT_OK(device_->Free(f32));
  ASSERT_OK(device_->Free(b16));
}

// A kernel's failure is reported once: by the launch where the device knows it then (CUDA's
// launch errors), or by the next Synchronize where the kernel runs later (the CPU device).
TEST_P(DeviceConformance, AKernelFailureIsReportedOnce) {
  ASSERT_OK_AND_ASSIGN(auto stream, device_->CreateStream());
  const Status launched =
      stream->LaunchKernel([](void*) { return InvalidArgument("kernel refused its arguments"); });
  const Status synced = stream->Synchronize();
  EXPECT_NE(launched.ok(), synced.ok()) << "launch: " << launched << "; sync: " << synced;
  const Status& failure = launched.ok() ? synced : launched;
  EXPECT_EQ(failure.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(failure.message().find("kernel refused its arguments"), std::string::npos);
  EXPECT_OK(stream->Synchronize());
  // Work after a failed kernel still runs.
  int ran = 0;
  ASSERT_OK(stream->LaunchKernel([&ran](void*) {
    ++ran;
    return Status::Ok();
  }));
  ASSERT_OK(stream->Synchronize());
  EXPECT_EQ(ran, 1);
}

TEST_P(DeviceConformance, CopyOutsideAnAllocationIsAnErrorOnTheCpuDevice) {
  if (device_->kind() != DeviceKind::kCpu) GTEST_SKIP() << "only the CPU device can check ranges";
  ASSERT_OK_AND_ASSIGN(void* dev, device_->Allocate(4096));
  ASSERT_OK_AND_ASSIGN(auto stream, device_->CreateStream());
  std::vector<uint8_t> host(8192);
  Status s = stream->MemcpyAsync(dev, host.data(), 4097, CopyKind::kHostToDevice);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not inside a live allocation"), std::string::npos);
  EXPECT_EQ(stream->MemcpyAsync(host.data(), host.data() + 10, 10, CopyKind::kDeviceToHost).code(),
            StatusCode::kInvalidArgument);
  ASSERT_OK(device_->Free(dev));
}

INSTANTIATE_TEST_SUITE_P(AllDevices, DeviceConformance, ::testing::ValuesIn(AvailableDevices()),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (c == ':') c = '_';
                           return n;
                         });

// Strict CPU memory (tiers/hbm/cpu_device.h): the handed-out address faults on a host access, as
// a GPU pointer does, while copies, fills and the compute address reach the same bytes.
TEST(StrictCpuDevice, HostDereferenceOfDeviceMemoryCrashes) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto dev = MakeCpuDevice(64 << 20, CpuDeviceMemory::kStrict);
  ASSERT_OK_AND_ASSIGN(void* p, dev->Allocate(1000));
  EXPECT_DEATH(static_cast<volatile char*>(p)[0] = 1, "");
  EXPECT_DEATH((void)static_cast<volatile char*>(p)[999], "");
  // The same store through the compute address is fine: it is how tensor views reach memory.
  static_cast<volatile char*>(dev->ComputeAddress(p))[0] = 1;
  ASSERT_OK(dev->Free(p));
  // Plain memory is host memory, as before.
  auto plain = MakeCpuDevice(64 << 20, CpuDeviceMemory::kPlain);
  ASSERT_OK_AND_ASSIGN(void* q, plain->Allocate(1000));
  EXPECT_EQ(plain->ComputeAddress(q), q);
  static_cast<volatile char*>(q)[0] = 1;
  ASSERT_OK(plain->Free(q));
}

TEST(StrictCpuDevice, CopiesFillsAndComputeSeeTheSameBytes) {
  auto dev = MakeCpuDevice(64 << 20, CpuDeviceMemory::kStrict);
  ASSERT_OK_AND_ASSIGN(auto stream, dev->CreateStream());
  const size_t n = 3 * 4096 + 123;
  ASSERT_OK_AND_ASSIGN(void* a, dev->Allocate(n));
  ASSERT_OK_AND_ASSIGN(void* b, dev->Allocate(n));
  EXPECT_NE(dev->ComputeAddress(a), a);
  std::vector<uint8_t> src(n), back(n, 0);
  std::iota(src.begin(), src.end(), 7);
  // Host -> device at the handed-out address, device -> device from the compute alias (a
  // tensor view's data pointer) into the other allocation, fill a tail, device -> host.
  ASSERT_OK(stream->MemcpyAsync(a, src.data(), n, CopyKind::kHostToDevice));
  ASSERT_OK(stream->MemcpyAsync(b, dev->ComputeAddress(a), n, CopyKind::kDeviceToDevice));
  ASSERT_OK(stream->MemsetAsync(static_cast<char*>(b) + n - 5, 0xAB, 5));
  ASSERT_OK(stream->MemcpyAsync(back.data(), b, n, CopyKind::kDeviceToHost));
  ASSERT_OK(stream->Synchronize());
  for (size_t i = 0; i < n - 5; ++i) ASSERT_EQ(back[i], src[i]) << i;
  for (size_t i = n - 5; i < n; ++i) ASSERT_EQ(back[i], 0xAB) << i;
  // What compute sees at the alias is what the copy wrote.
  EXPECT_EQ(std::memcmp(dev->ComputeAddress(a), src.data(), n), 0);
  // Interior pointers translate by their offset; a host pointer comes back unchanged.
  EXPECT_EQ(dev->ComputeAddress(static_cast<char*>(a) + 100),
            static_cast<char*>(dev->ComputeAddress(a)) + 100);
  EXPECT_EQ(dev->ComputeAddress(src.data()), src.data());
  // Past the end of an allocation is still an error, by either address.
  EXPECT_EQ(stream->MemcpyAsync(dev->ComputeAddress(a), src.data(), n + 1, CopyKind::kHostToDevice)
                .code(),
            StatusCode::kInvalidArgument);
  // Accounting is by the requested size (64-byte rounded), as in plain mode.
  EXPECT_EQ(dev->allocated(), 2 * ((n + 63) / 64 * 64));
  ASSERT_OK(dev->Free(a));
  ASSERT_OK(dev->Free(b));
  EXPECT_EQ(dev->allocated(), 0u);
  EXPECT_EQ(dev->Free(a).code(), StatusCode::kInvalidArgument);
}

// VmRSS of this process (memfd pages count there, as RssShmem).
uint64_t ResidentBytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  return 0;
}

// Freed strict memory goes back to the OS: the process's resident memory does not grow when
// the same large allocation is made, touched and freed many times.
TEST(StrictCpuDevice, FreeReturnsTheMemory) {
  auto dev = MakeCpuDevice(uint64_t{1} << 30, CpuDeviceMemory::kStrict);
  ASSERT_OK_AND_ASSIGN(auto stream, dev->CreateStream());
  const size_t n = 64 << 20;
  const uint64_t before = ResidentBytes();
  for (int i = 0; i < 8; ++i) {
    ASSERT_OK_AND_ASSIGN(void* p, dev->Allocate(n));
    ASSERT_OK(stream->MemsetAsync(p, i, n));
    ASSERT_OK(stream->Synchronize());
    ASSERT_OK(dev->Free(p));
  }
  const uint64_t after = ResidentBytes();
  EXPECT_LT(after, before + 2 * n) << "8 x 64 MiB touched and freed; RSS grew by "
                                   << (after - before);
}

TEST(DeviceRegistry, CpuAlwaysAvailableAndBadSpecsAreClear) {
  auto devices = AvailableDevices();
  ASSERT_FALSE(devices.empty());
  EXPECT_EQ(devices[0], "cpu");
  EXPECT_GE(CudaDeviceCount(), 0);  // never throws, never negative, even without a driver
  ASSERT_OK_AND_ASSIGN(auto dev, CreateDevice("auto", 1 << 20));
  EXPECT_EQ(dev->kind(), CudaDeviceCount() > 0 ? DeviceKind::kCuda : DeviceKind::kCpu);
  auto bad = CreateDevice("tpu");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("'tpu'"), std::string::npos);
  if (CudaDeviceCount() == 0) {
    auto cuda = CreateDevice("cuda:0");
    ASSERT_FALSE(cuda.ok());
    EXPECT_TRUE(cuda.status().code() == StatusCode::kUnavailable ||
                cuda.status().code() == StatusCode::kUnimplemented)
        << cuda.status();
  }
}

}  // namespace
}  // namespace strata
