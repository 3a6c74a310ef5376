// NCCL with one rank on the first GPU (label gpu). Skips when no GPU is usable.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <vector>

#include "runtime/comm/backends.h"
#include "tests/test_util.h"

namespace strata {
namespace {

bool HaveGpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

TEST(NcclCommunicatorTest, WithoutGpuCreationFailsClearly) {
  if (HaveGpu()) GTEST_SKIP() << "a GPU is present";
  DistEnv env;
  auto c = CreateNcclCommunicator(env, CreateInProcessStore(5), 5, 0);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(c.status().message().find("needs a CUDA GPU"), std::string::npos);
}

TEST(NcclCommunicatorTest, SingleRankCollectivesOnDeviceMemory) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  DistEnv env;
  ASSERT_OK_AND_ASSIGN(auto comm, CreateNcclCommunicator(env, CreateInProcessStore(10), 10, 0));
  EXPECT_EQ(comm->memory_kind(), MemoryKind::kDevice);
  const int64_t n = 1000003;
  std::vector<float> host(n), back(n);
  for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 1000);
  float *a = nullptr, *b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, n * 4), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(a, host.data(), n * 4, cudaMemcpyHostToDevice), cudaSuccess);
  for (int bucket : {0, 1}) {
    if (bucket) ASSERT_OK(comm->SetBucketSizes({4099, 4099}));
    ASSERT_OK(comm->AllGather(a, b, n, DType::kF32));
    ASSERT_OK(comm->ReduceScatter(b, b, n, DType::kF32, ReduceOp::kAvg));
    ASSERT_OK(comm->AllReduce(b, n, DType::kF32, ReduceOp::kMax));
    ASSERT_OK(comm->Broadcast(b, n, DType::kF32, 0));
    ASSERT_OK(comm->Barrier());
    ASSERT_EQ(cudaMemcpy(back.data(), b, n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(back, host);
  }
  cudaFree(a);
  cudaFree(b);
}

}  // namespace
}  // namespace strata
