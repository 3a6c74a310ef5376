// What the GPU kernel suites share: device buffers with synchronous copies, and a fixture that
// skips without a GPU and gives each test its own stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/kernels.h"
#include "tiers/hbm/device_factory.h"

namespace strata::kernels {

// Device memory for one test; the copies are synchronous (legacy default stream).
class DevBuf {
 public:
  explicit DevBuf(size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&ptr_, bytes == 0 ? 1 : bytes) != cudaSuccess) {
      ptr_ = nullptr;
      ADD_FAILURE() << "cudaMalloc(" << bytes << ") failed";
    }
  }
  template <typename T>
  explicit DevBuf(const std::vector<T>& host) : DevBuf(host.size() * sizeof(T)) {
    Upload(host.data());
  }
  ~DevBuf() { cudaFree(ptr_); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  void Upload(const void* host) {
    EXPECT_EQ(cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice), cudaSuccess);
  }
  template <typename T>
  std::vector<T> Download() const {
    std::vector<T> out(bytes_ / sizeof(T));
    EXPECT_EQ(cudaMemcpy(out.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

class KernelsGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(CudaKernelsBuilt());
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void Sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }
  cudaStream_t stream_ = nullptr;
};

}  // namespace strata::kernels
