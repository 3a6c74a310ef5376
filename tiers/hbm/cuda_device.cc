// The CUDA device: a stream-ordered pool (cudaMallocAsync on the device's default memory pool,
// with Strata's own capacity accounting on top), prioritized streams, events without timing,
// and host callbacks through cudaLaunchHostFunc.
#include "tiers/hbm/cuda_device.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "runtime/base/units.h"
#include "runtime/base/cuda_check.h"

namespace strata {
namespace {

class CudaEvent final : public Event {
 public:
  CudaEvent(int device, cudaEvent_t e) : device_(device), event_(e) {}
  ~CudaEvent() override {
    cudaSetDevice(device_);
    cudaEventDestroy(event_);
  }
  bool Query() override {
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) return false;
    if (err != cudaSuccess) (void)cudaGetLastError();
    return true;
  }
  Status Synchronize() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventSynchronize(event_));
    return Status::Ok();
  }
  cudaEvent_t get() const { return event_; }

 private:
  int device_;
  cudaEvent_t event_;
};

class CudaDevice;

class CudaStream final : public Stream {
 public:
  CudaStream(CudaDevice* d, int device, cudaStream_t s) : dev_(d), device_(device), stream_(s) {}
  ~CudaStream() override;

  Status MemcpyAsync(void* dst, const void* src, size_t bytes, CopyKind kind) override {
    if (bytes == 0) return Status::Ok();
    cudaMemcpyKind k = kind == CopyKind::kHostToDevice   ? cudaMemcpyHostToDevice
                       : kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost
                       : kind == CopyKind::kDeviceToDevice ? cudaMemcpyDeviceToDevice
                                                           : cudaMemcpyHostToHost;
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, k, stream_));
    return Status::Ok();
  }
  Status MemsetAsync(void* dst, int value, size_t bytes) override {
    if (bytes == 0) return Status::Ok();
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, value, bytes, stream_));
    return Status::Ok();
  }
  Status LaunchHostFunc(std::function<void()> fn) override {
    if (!fn) return InvalidArgument("cuda stream: LaunchHostFunc with an empty function");
    auto* heap = new std::function<void()>(std::move(fn));
    cudaError_t err = cudaLaunchHostFunc(
        stream_,
        [](void* p) {
          auto* f = static_cast<std::function<void()>*>(p);
          (*f)();
          delete f;
        },
        heap);
    if (err != cudaSuccess) delete heap;
    STRATA_CUDA_RETURN_IF_ERROR(err);
    return Status::Ok();
  }
  Status LaunchKernel(std::function<Status(void*)> kernel) override {
    if (!kernel) return InvalidArgument("cuda stream: LaunchKernel with an empty function");
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    return kernel(stream_);
  }
  Status Record(Event& event) override {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    if (e == nullptr) return InvalidArgument("cuda stream: Record of an event from another device");
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(e->get(), stream_));
    return Status::Ok();
  }
  Status Wait(Event& event) override {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    if (e == nullptr) return InvalidArgument("cuda stream: Wait on an event from another device");
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(stream_, e->get(), 0));
    return Status::Ok();
  }
  Status Synchronize() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }
  bool Query() override {
    cudaError_t err = cudaStreamQuery(stream_);
    if (err == cudaErrorNotReady) return false;
    if (err != cudaSuccess) (void)cudaGetLastError();
    return true;
  }
  cudaStream_t get() const { return stream_; }

 private:
  CudaDevice* dev_;
  int device_;
  cudaStream_t stream_;
};

class CudaDevice final : public Device {
 public:
  CudaDevice(int index, uint64_t capacity, std::string name, cudaStream_t alloc_stream)
      : index_(index), capacity_(capacity), name_(std::move(name)), alloc_stream_(alloc_stream) {}
  ~CudaDevice() override {
    cudaSetDevice(index_);
    for (auto& [p, size] : allocs_) cudaFreeAsync(p, alloc_stream_);
    cudaStreamSynchronize(alloc_stream_);
    cudaStreamDestroy(alloc_stream_);
  }

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  int index() const override { return index_; }
  std::string name() const override { return name_; }
  uint64_t capacity() const override { return capacity_; }
  uint64_t allocated() const override {
    std::lock_guard<std::mutex> l(mu_);
    return allocated_;
  }
  uint64_t peak_allocated() const override {
    std::lock_guard<std::mutex> l(mu_);
    return peak_;
  }

  StatusOr<void*> Allocate(size_t bytes) override {
    size_t rounded = (std::max<size_t>(bytes, 1) + 255) & ~size_t{255};
    {
      std::lock_guard<std::mutex> l(mu_);
      if (allocated_ + rounded > capacity_)
        return ResourceExhausted(StrCat(name_, ": cannot allocate ", FormatBytes(bytes), " (",
                                        FormatBytes(allocated_), " of ", FormatBytes(capacity_),
                                        " in use); raise strata.device_memory_budget or offload "
                                        "more state"));
      allocated_ += rounded;
      peak_ = std::max(peak_, allocated_);
    }
    void* p = nullptr;
    Status s = CudaToStatus(cudaSetDevice(index_), "cudaSetDevice");
    if (s.ok()) s = CudaToStatus(cudaMallocAsync(&p, rounded, alloc_stream_), "cudaMallocAsync");
    // Allocation is stream-ordered; synchronizing the allocation stream makes the memory usable
    // from any stream without the caller tracking the allocation stream.
    if (s.ok()) s = CudaToStatus(cudaStreamSynchronize(alloc_stream_), "cudaStreamSynchronize");
    std::lock_guard<std::mutex> l(mu_);
    if (!s.ok()) {
      allocated_ -= rounded;
      return s;
    }
    allocs_[p] = rounded;
    return p;
  }

  Status Free(void* ptr) override {
    if (ptr == nullptr) return Status::Ok();
    size_t size;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = allocs_.find(ptr);
      if (it == allocs_.end())
        return InvalidArgument(StrCat(name_, ": Free of ", ptr, " which this device did not allocate"));
      size = it->second;
      allocs_.erase(it);
      allocated_ -= size;
    }
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(index_));
    STRATA_CUDA_RETURN_IF_ERROR(cudaFreeAsync(ptr, alloc_stream_));
    return Status::Ok();
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority priority) override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(index_));
    int least = 0, greatest = 0;
    STRATA_CUDA_RETURN_IF_ERROR(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    cudaStream_t s;
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithPriority(
        &s, cudaStreamNonBlocking, priority == StreamPriority::kHigh ? greatest : least));
    auto stream = std::make_unique<CudaStream>(this, index_, s);
    std::lock_guard<std::mutex> l(mu_);
    streams_.insert(stream.get());
    return std::unique_ptr<Stream>(std::move(stream));
  }

  StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(index_));
    cudaEvent_t e;
    STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return std::unique_ptr<Event>(std::make_unique<CudaEvent>(index_, e));
  }

  Status Synchronize() override {
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(index_));
    STRATA_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    return Status::Ok();
  }

  Status OrderForeignStream(void* native_stream, Event& event) override {
    auto* e = dynamic_cast<CudaEvent*>(&event);
    if (e == nullptr) return InvalidArgument("cuda device: an event from another device");
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(index_));
    // Null names the legacy default stream explicitly, whatever the per-thread default is.
    cudaStream_t s = native_stream ? static_cast<cudaStream_t>(native_stream) : cudaStreamLegacy;
    STRATA_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, e->get(), 0));
    return Status::Ok();
  }

  void Unregister(CudaStream* s) {
    std::lock_guard<std::mutex> l(mu_);
    streams_.erase(s);
  }

 private:
  const int index_;
  const uint64_t capacity_;
  const std::string name_;
  cudaStream_t alloc_stream_;
  mutable std::mutex mu_;
  uint64_t allocated_ = 0;           // GUARDED_BY(mu_)
  uint64_t peak_ = 0;                // GUARDED_BY(mu_)
  std::map<void*, size_t> allocs_;   // GUARDED_BY(mu_)
  std::set<CudaStream*> streams_;    // GUARDED_BY(mu_)
};

CudaStream::~CudaStream() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
  dev_->Unregister(this);
}

}  // namespace

int CudaDeviceCountImpl() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int index, uint64_t capacity) {
  int n = CudaDeviceCountImpl();
  if (index < 0 || index >= n)
    return Unavailable(StrCat("cuda:", index, " does not exist (", n,
                              " CUDA device(s) visible); use cpu or a smaller index"));
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(index));
  cudaDeviceProp prop{};
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, index));
  size_t free_bytes = 0, total_bytes = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (capacity == 0) capacity = free_bytes;
  if (capacity > total_bytes)
    return InvalidArgument(StrCat("device budget ", FormatBytes(capacity), " exceeds cuda:", index,
                                  "'s ", FormatBytes(total_bytes),
                                  "; lower strata.device_memory_budget"));
  cudaStream_t alloc_stream;
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&alloc_stream, cudaStreamNonBlocking));
  return std::unique_ptr<Device>(std::make_unique<CudaDevice>(
      index, capacity, StrCat("cuda:", index, " (", prop.name, ")"), alloc_stream));
}

}  // namespace strata
