// Core pieces without processes: dtype conversions, host reductions, the single communicator,
// bucketing arithmetic and the environment reader.
#include "runtime/comm/host_reduce.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "runtime/comm/communicator.h"
#include "tests/test_util.h"

namespace strata {
namespace {

TEST(HostReduceTest, Bf16AndFp16ConversionsRoundToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3F80);
  EXPECT_EQ(Bf16ToFloat(0x3F80), 1.0f);
  // 1 + 2^-8 is halfway between two bf16 values: ties go to even (1.0).
  EXPECT_EQ(FloatToBf16(1.00390625f), 0x3F80);
  EXPECT_EQ(FloatToBf16(1.01171875f), 0x3F82);  // 1 + 3·2^-8 rounds up to even
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
  EXPECT_EQ(FloatToFp16(1.0f), 0x3C00);
  EXPECT_EQ(Fp16ToFloat(0x3C00), 1.0f);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(Fp16ToFloat(FloatToFp16(1e6f))));
}

TEST(HostReduceTest, ReducesEveryDtypeAndOp) {
  std::vector<float> a = {1, -2, 3}, b = {4, 5, -6}, c = {7, 8, 9}, out(3);
  const void* in[] = {a.data(), b.data(), c.data()};
  ReduceHostBuffers(in, 3, out.data(), 3, DType::kF32, ReduceOp::kSum);
  EXPECT_EQ(out, (std::vector<float>{12, 11, 6}));
  ReduceHostBuffers(in, 3, out.data(), 3, DType::kF32, ReduceOp::kAvg);
  EXPECT_EQ(out, (std::vector<float>{4, 11.0f / 3, 2}));
  ReduceHostBuffers(in, 3, out.data(), 3, DType::kF32, ReduceOp::kMax);
  EXPECT_EQ(out, (std::vector<float>{7, 8, 9}));
  ReduceHostBuffers(in, 3, out.data(), 3, DType::kF32, ReduceOp::kMin);
  EXPECT_EQ(out, (std::vector<float>{1, -2, -6}));

  // bf16 accumulates in fp32: 256 + 1 + 1 is 258 (exact in bf16), not 256 as chained bf16 adds.
  std::vector<uint16_t> x = {FloatToBf16(256)}, y = {FloatToBf16(1)}, z = {FloatToBf16(1)}, o(1);
  const void* in16[] = {x.data(), y.data(), z.data()};
  ReduceHostBuffers(in16, 3, o.data(), 1, DType::kBF16, ReduceOp::kSum);
  EXPECT_EQ(Bf16ToFloat(o[0]), 258.0f);
  std::vector<int64_t> i1 = {5, -3}, i2 = {2, 10}, io(2);
  const void* ini[] = {i1.data(), i2.data()};
  ReduceHostBuffers(ini, 2, io.data(), 2, DType::kI64, ReduceOp::kSum);
  EXPECT_EQ(io, (std::vector<int64_t>{7, 7}));
  // In place over the first input, and a long fp16 buffer crossing the internal block size.
  std::vector<uint16_t> h1(10000, FloatToFp16(1.5f)), h2(10000, FloatToFp16(2.5f));
  const void* inh[] = {h1.data(), h2.data()};
  ReduceHostBuffers(inh, 2, h1.data(), 10000, DType::kF16, ReduceOp::kAvg);
  for (uint16_t v : h1) ASSERT_EQ(Fp16ToFloat(v), 2.0f);
  DivideHostBuffer(h1.data(), 10000, DType::kF16, 4);
  EXPECT_EQ(Fp16ToFloat(h1[9999]), 0.5f);
}

TEST(SingleCommunicatorTest, CollectivesAreIdentityAndCopyOnlyWhenNeeded) {
  auto comm = CreateSingleCommunicator();
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->backend(), "single");
  std::vector<float> src = {1, 2, 3, 4, 5}, dst(5, 0);
  ASSERT_OK(comm->AllGather(src.data(), dst.data(), 5, DType::kF32));
  EXPECT_EQ(dst, src);
  std::fill(dst.begin(), dst.end(), 0);
  ASSERT_OK(comm->ReduceScatter(src.data(), dst.data(), 5, DType::kF32, ReduceOp::kAvg));
  EXPECT_EQ(dst, src);
  ASSERT_OK(comm->AllGather(src.data(), src.data(), 5, DType::kF32));  // in place
  ASSERT_OK(comm->AllReduce(src.data(), 5, DType::kF32, ReduceOp::kSum));
  ASSERT_OK(comm->Broadcast(src.data(), 5, DType::kF32, 0));
  ASSERT_OK(comm->Barrier());
  EXPECT_EQ(src, (std::vector<float>{1, 2, 3, 4, 5}));
  EXPECT_FALSE(comm->Broadcast(src.data(), 5, DType::kF32, 1).ok());
  EXPECT_FALSE(comm->AllGather(src.data(), dst.data(), -1, DType::kF32).ok());
}

TEST(SingleCommunicatorTest, BucketsSplitCalls) {
  auto comm = CreateSingleCommunicator();
  ASSERT_OK(comm->SetBucketSizes({3, 4}));
  std::vector<float> src(10), dst(10, 0);
  for (int i = 0; i < 10; ++i) src[i] = static_cast<float>(i);
  const int64_t c0 = comm->backend_calls();
  ASSERT_OK(comm->AllGather(src.data(), dst.data(), 10, DType::kF32));
  EXPECT_EQ(comm->backend_calls() - c0, 4);  // 3+3+3+1
  EXPECT_EQ(dst, src);
  const int64_t c1 = comm->backend_calls();
  ASSERT_OK(comm->AllReduce(dst.data(), 10, DType::kF32, ReduceOp::kSum));
  EXPECT_EQ(comm->backend_calls() - c1, 3);  // 4+4+2
  const auto bad = comm->SetBucketSizes({0, 4});
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("allgather_bucket_size=0"), std::string::npos);
}

TEST(DistEnvTest, DefaultsToOneRankAndParsesLaunchers) {
  for (const char* v : {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE"}) {
    unsetenv(v);
  }
  ASSERT_OK_AND_ASSIGN(DistEnv one, ReadDistEnv());
  EXPECT_EQ(one.world_size, 1);
  EXPECT_FALSE(one.from_env);
  setenv("WORLD_SIZE", "4", 1);
  setenv("RANK", "3", 1);
  setenv("MASTER_ADDR", "node0", 1);
  setenv("MASTER_PORT", "1234", 1);
  setenv("LOCAL_RANK", "1", 1);
  ASSERT_OK_AND_ASSIGN(DistEnv e, ReadDistEnv());
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 1234);
  setenv("LOCAL_RANK", "x1", 1);
  auto bad = ReadDistEnv();
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("LOCAL_RANK='x1'"), std::string::npos);
  for (const char* v : {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"}) {
    unsetenv(v);
  }
}

}  // namespace
}  // namespace strata
