// The test-only PoisoningStore (poisoning_store.h) does what the engine tests rely on: a block's
// bytes are usable inside a pin and poison outside it, and nothing written inside a pin is lost.
#include "tests/runtime/poisoning_store.h"

#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/base/device.h"
#include "tiers/hbm/cpu_device.h"

namespace strata {
namespace {

constexpr uint64_t kBytes = 4096 * 3 + 100;  // not a multiple of the page

class PoisoningStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = MakeCpuDevice(64 << 20, CpuDeviceMemory::kStrict);
    TierManagerOptions o;
    o.host_budget = 8 << 20;
    auto inner = MakeTieredBlockStore(device_.get(), nullptr, o);
    ASSERT_TRUE(inner.ok()) << inner.status();
    store_ = std::make_unique<testing::PoisoningStore>(std::move(inner).value());
    ASSERT_TRUE(store_->Register(kHost, kBytes, Placement::kHost).ok());
    ASSERT_TRUE(store_->Register(kDev, kBytes, Placement::kDevice).ok());
  }

  // Writes `value` into every byte of the host block through a kWrite pin.
  void Fill(unsigned char value) {
    auto p = store_->Acquire(kHost, Access::kWrite);
    ASSERT_TRUE(p.ok()) << p.status();
    std::memset(*p, value, kBytes);
    ASSERT_TRUE(store_->Release(kHost, true).ok());
  }

  static bool AllBytes(const void* p, unsigned char value) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (uint64_t i = 0; i < kBytes; ++i)
      if (b[i] != value) return false;
    return true;
  }

  const BlockKey kHost{0, StateKind::kMaster32};
  const BlockKey kDev{1, StateKind::kMaster32};
  std::unique_ptr<Device> device_;
  std::unique_ptr<BlockStore> store_;
};

TEST_F(PoisoningStoreTest, BytesWrittenInAPinAreReadInTheNext) {
  Fill(0x11);
  auto p = store_->Acquire(kHost, Access::kRead);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(AllBytes(*p, 0x11));
  ASSERT_TRUE(store_->Release(kHost, false).ok());
}

TEST_F(PoisoningStoreTest, AReleasedBlockReadsAsPoison) {
  Fill(0x22);
  auto p = store_->Acquire(kHost, Access::kRead);
  ASSERT_TRUE(p.ok()) << p.status();
  const void* kept = *p;
  ASSERT_TRUE(store_->Release(kHost, false).ok());
  EXPECT_TRUE(AllBytes(kept, 0xFF));  // what a late reader of the pointer sees
}

TEST_F(PoisoningStoreTest, AWriteAfterReleaseIsLost) {
  Fill(0x33);
  auto p = store_->Acquire(kHost, Access::kReadWrite);
  ASSERT_TRUE(p.ok()) << p.status();
  void* kept = *p;
  ASSERT_TRUE(store_->Release(kHost, true).ok());
  std::memset(kept, 0x44, kBytes);
  auto again = store_->Acquire(kHost, Access::kRead);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(AllBytes(*again, 0x33));
  ASSERT_TRUE(store_->Release(kHost, false).ok());
}

TEST_F(PoisoningStoreTest, AWritePinStartsAsPoison) {
  Fill(0x55);
  auto p = store_->Acquire(kHost, Access::kWrite);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(AllBytes(*p, 0xFF));  // kWrite promises to overwrite: old bytes are not handed out
  std::memset(*p, 0x66, kBytes);
  ASSERT_TRUE(store_->Release(kHost, true).ok());
}

TEST_F(PoisoningStoreTest, NestedPinsShareOneCopyUntilTheLastRelease) {
  Fill(0x77);
  auto a = store_->Acquire(kHost, Access::kRead);
  auto b = store_->Acquire(kHost, Access::kReadWrite);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);
  std::memset(*b, 0x78, kBytes);
  ASSERT_TRUE(store_->Release(kHost, true).ok());
  EXPECT_TRUE(AllBytes(*a, 0x78));  // still pinned by the first holder
  ASSERT_TRUE(store_->Release(kHost, false).ok());
  EXPECT_TRUE(AllBytes(*a, 0xFF));
  auto c = store_->Acquire(kHost, Access::kRead);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(AllBytes(*c, 0x78));
  ASSERT_TRUE(store_->Release(kHost, false).ok());
}

TEST_F(PoisoningStoreTest, DeviceBlocksPassThrough) {
  auto p = store_->Acquire(kDev, Access::kWrite);
  ASSERT_TRUE(p.ok()) << p.status();
  auto q = store_->Acquire(kDev, Access::kRead);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(*p, *q);
  // Device memory, not a host copy: the strict CPU device maps it at a second, readable address
  // (a host pointer would come back unchanged).
  EXPECT_NE(device_->ComputeAddress(*p), *p);
  ASSERT_TRUE(store_->Release(kDev, false).ok());
  ASSERT_TRUE(store_->Release(kDev, false).ok());
}

TEST_F(PoisoningStoreTest, ARefusedReleaseLeavesThePinsAlone) {
  EXPECT_FALSE(store_->Release(kHost, false).ok());  // never pinned: the inner store refuses
  Fill(0x12);
  auto p = store_->Acquire(kHost, Access::kRead);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(AllBytes(*p, 0x12));
  ASSERT_TRUE(store_->Release(kHost, false).ok());
}

}  // namespace
}  // namespace strata
