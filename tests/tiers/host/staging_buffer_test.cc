// StagingBuffer: growth, alignment off the pool's 4 KiB colours, and "pinned" checked against the
// locked memory the kernel reports for the process.
#include "tiers/host/staging_buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

namespace strata {
namespace {

// VmLck from /proc/self/status, in bytes; -1 when it cannot be read.
int64_t LockedBytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmLck:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return -1;
}

TEST(StagingBuffer, StartsEmptyAndGrowsOnlyWhenAskedForMore) {
  StagingBuffer b;
  EXPECT_EQ(b.data(), nullptr);
  EXPECT_EQ(b.capacity(), 0u);
  ASSERT_TRUE(b.Reserve(1000).ok());
  void* first = b.data();
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(b.capacity(), 1000u);
  ASSERT_TRUE(b.Reserve(500).ok());
  EXPECT_EQ(b.data(), first);  // smaller requests reuse the buffer
  EXPECT_EQ(b.capacity(), 1000u);
  ASSERT_TRUE(b.Reserve(3 << 20).ok());
  EXPECT_EQ(b.capacity(), size_t{3} << 20);
  // Every byte of the new capacity is writable and keeps what was written.
  auto* p = static_cast<unsigned char*>(b.data());
  for (size_t i = 0; i < b.capacity(); i += 4093) p[i] = static_cast<unsigned char>(i * 7);
  p[b.capacity() - 1] = 0xA5;
  for (size_t i = 0; i < b.capacity(); i += 4093)
    ASSERT_EQ(p[i], static_cast<unsigned char>(i * 7)) << "byte " << i;
  EXPECT_EQ(p[b.capacity() - 1], 0xA5);
}

TEST(StagingBuffer, IsCacheLineAlignedButNeverOnAPoolColour) {
  for (size_t bytes : {size_t{64}, size_t{4096}, size_t{1} << 20, size_t{33} << 20}) {
    StagingBuffer b;
    ASSERT_TRUE(b.Reserve(bytes).ok());
    const auto a = reinterpret_cast<uintptr_t>(b.data());
    EXPECT_EQ(a % 64, 0u) << bytes;
    // The host pool's blocks start at multiples of 4 KiB; the staging buffer must not.
    EXPECT_NE(a % 4096, 0u) << bytes;
  }
}

// (cudaHostAlloc's pages are locked by the driver, which VmLck does not count.)
TEST(StagingBuffer, MlockedMeansTheKernelCountsItsPagesAsLocked) {
  const int64_t before = LockedBytes();
  if (before < 0) GTEST_SKIP() << "no VmLck in /proc/self/status";
  const size_t bytes = size_t{4} << 20;
  {
    StagingBuffer b;
    ASSERT_TRUE(b.Reserve(bytes).ok());
    const int64_t during = LockedBytes();
    switch (b.backing()) {
      case StagingBuffer::Backing::kLocked:
        EXPECT_TRUE(b.pinned());
        EXPECT_GE(during - before, static_cast<int64_t>(bytes));
        break;
      case StagingBuffer::Backing::kPageable:
        EXPECT_FALSE(b.pinned());
        EXPECT_EQ(during, before);  // a refused mlock locks nothing
        break;
      case StagingBuffer::Backing::kCudaHost:
        EXPECT_TRUE(b.pinned());
        GTEST_SKIP() << "cudaHostAlloc backing: VmLck does not count it";
      case StagingBuffer::Backing::kNone:
        FAIL() << "Reserve succeeded but nothing backs the buffer";
    }
  }
  EXPECT_EQ(LockedBytes(), before);  // freeing the buffer unlocks its pages
}

}  // namespace
}  // namespace strata
