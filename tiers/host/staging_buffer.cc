#include "tiers/host/staging_buffer.h"

#include <sys/mman.h>

#include <cerrno>

#include "runtime/base/units.h"
#include "tiers/host/cuda_host_alloc.h"

namespace strata {

// Note [staging offset]
// The optimizer's new working values go to this buffer while the same Adam loop streams over the
// chunk's master, moments and gradient in the host pool. A buffer starting at a page boundary can
// sit at the same address as one of those modulo a large power of two, which is what made such
// loops run 3-4x slower (Note [block colouring] in pinned_pool.cc). The pool staggers its blocks
// by multiples of 4 KiB, so data() starts half a page into the allocation: never congruent to a
// pool block modulo 4 KiB, and still 64-byte aligned.
constexpr size_t kStagingOffset = 2048;

StagingBuffer::~StagingBuffer() { Free(); }

void StagingBuffer::Free() {
  if (base_ != nullptr) {
    if (backing_ == Backing::kCudaHost) host_internal::CudaHostFree(base_);
    else munmap(base_, mapped_);
  }
  base_ = data_ = nullptr;
  mapped_ = capacity_ = 0;
  backing_ = Backing::kNone;
}

Status StagingBuffer::Reserve(size_t bytes) {
  if (bytes <= capacity_) return Status::Ok();
  Free();
  const size_t total = bytes + kStagingOffset;
  if (host_internal::CudaHostAllocAvailable()) {
    auto got = host_internal::CudaHostAlloc(total);
    if (got.ok()) {
      base_ = *got;
      backing_ = Backing::kCudaHost;
    }
  }
  if (base_ == nullptr) {
    const size_t page = 4096;
    mapped_ = (total + page - 1) / page * page;
    void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      mapped_ = 0;
      return ErrnoToStatus(errno, StrCat("staging buffer: mapping ", FormatBytes(total),
                                         " of host memory"));
    }
    base_ = p;
    // Pageable is slower on a GPU, never wrong.
    backing_ = mlock(base_, mapped_) == 0 ? Backing::kLocked : Backing::kPageable;
  }
  data_ = static_cast<char*>(base_) + kStagingOffset;
  capacity_ = bytes;
  return Status::Ok();
}

}  // namespace strata
