// StagingBuffer: one reusable host buffer that host-side work fills and a device copy reads.
// With a GPU it is cudaHostAlloc memory, so a copy to the device is a DMA from it with no bounce
// through the driver's own buffers and cudaMemcpyAsync returns at once.
//
// Backing, chosen at each growth (the buffer only grows, to the largest size asked of it; size it
// once up front, since growing frees and allocates page-locked memory):
// - kCudaHost: cudaHostAlloc when the build has CUDA and a GPU is present;
// - kLocked: otherwise anonymous mmap, mlock'd (resident, never swapped out);
// - kPageable: the same mapping when mlock is refused (RLIMIT_MEMLOCK), which only slows a GPU
//   copy down and changes nothing on the CPU device.
// data() is 64-byte aligned (whole SIMD stores) and deliberately not page-aligned: Note [staging
// offset] in staging_buffer.cc.
//
// Thread safety: none; one owner uses it at a time. The owner must not Reserve again while a copy
// still reads the buffer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "runtime/base/status.h"

namespace strata {

class StagingBuffer {
 public:
  StagingBuffer() = default;
  ~StagingBuffer();
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;

  // Makes data() hold at least `bytes` bytes; the previous contents are not kept when it grows.
  // An error naming the size when the memory cannot be mapped (ENOMEM: RESOURCE_EXHAUSTED).
  Status Reserve(size_t bytes);
  void* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  enum class Backing { kNone, kCudaHost, kLocked, kPageable };
  Backing backing() const { return backing_; }
  // True when the bytes are page-locked (kCudaHost or kLocked).
  bool pinned() const { return backing_ == Backing::kCudaHost || backing_ == Backing::kLocked; }

 private:
  void Free();

  void* base_ = nullptr;   // what was allocated
  size_t mapped_ = 0;      // bytes of the mapping (mmap backing only)
  void* data_ = nullptr;   // base_ + the staging offset
  size_t capacity_ = 0;
  Backing backing_ = Backing::kNone;
};

}  // namespace strata
