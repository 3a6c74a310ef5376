#include "tiers/hbm/cpu_device.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <string_view>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <utility>

#include <sys/mman.h>
#include <unistd.h>

#include "runtime/base/units.h"
#include "runtime/base/env_vars.h"
#include "runtime/base/logging.h"

namespace strata {
namespace {

// Shared between an event object and the stream tasks that complete it, so a task may outlive
// neither. `recorded` counts Record calls; `completed` is the highest record reached.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;
  uint64_t completed = 0;
};

class CpuEvent final : public Event {
 public:
  CpuEvent() : state_(std::make_shared<EventState>()) {}
  bool Query() override {
    std::lock_guard<std::mutex> l(state_->mu);
    return state_->completed >= state_->recorded;
  }
  Status Synchronize() override {
    std::unique_lock<std::mutex> l(state_->mu);
    uint64_t target = state_->recorded;
    state_->cv.wait(l, [&] { return state_->completed >= target; });
    return Status::Ok();
  }
  const std::shared_ptr<EventState>& state() const { return state_; }

 private:
  std::shared_ptr<EventState> state_;
};

class CpuDevice;

class CpuStream final : public Stream {
 public:
  explicit CpuStream(CpuDevice* device);
  ~CpuStream() override;

  Status MemcpyAsync(void* dst, const void* src, size_t bytes, CopyKind kind) override;
  Status MemsetAsync(void* dst, int value, size_t bytes) override;
  Status LaunchHostFunc(std::function<void()> fn) override;
  Status LaunchKernel(std::function<Status(void*)> kernel) override;
  Status Record(Event& event) override;
  Status Wait(Event& event) override;
  Status Synchronize() override;
  bool Query() override;
  // Waits for the work enqueued so far, leaving a kernel failure for Synchronize to report.
  void Drain();

 private:
  void Enqueue(std::function<void()> task);
  void Run();

  CpuDevice* device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // GUARDED_BY(mu_)
  uint64_t enqueued_ = 0;                    // GUARDED_BY(mu_)
  uint64_t done_ = 0;                        // GUARDED_BY(mu_)
  bool stop_ = false;                        // GUARDED_BY(mu_)
  Status kernel_error_;                      // GUARDED_BY(mu_): for the next Synchronize
  std::thread worker_;
};

// One live allocation. `address` is what Allocate handed out; `alias` is where the bytes are
// reachable from the host: the same address for plain memory, a second mapping of the same memfd
// for strict memory (Note [strict device memory]).
struct CpuAllocation {
  size_t rounded = 0;    // counted against capacity
  size_t requested = 0;  // the range copies may touch
  char* alias = nullptr;
  size_t mapped = 0;     // strict memory: bytes of each of the two mappings
};

class CpuDevice final : public Device {
 public:
  CpuDevice(uint64_t capacity, CpuDeviceMemory memory) : capacity_(capacity), memory_(memory) {}
  ~CpuDevice() override {
    for (auto& [addr, a] : allocs_) Release(addr, a);
  }

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  int index() const override { return 0; }
  std::string name() const override { return "cpu"; }
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
    size_t rounded = (std::max<size_t>(bytes, 1) + 63) & ~size_t{63};
    {
      std::lock_guard<std::mutex> l(mu_);
      if (allocated_ + rounded > capacity_)
        return ResourceExhausted(StrCat("cpu device: cannot allocate ", FormatBytes(bytes), " (",
                                        FormatBytes(allocated_), " of ", FormatBytes(capacity_),
                                        " in use); raise strata.device_memory_budget or offload "
                                        "more state"));
      allocated_ += rounded;
      peak_ = std::max(peak_, allocated_);
    }
    CpuAllocation a;
    a.rounded = rounded;
    a.requested = bytes;
    void* address = nullptr;
    const Status mapped = memory_ == CpuDeviceMemory::kStrict ? MapStrict(&a, &address)
                                                                : MapPlain(&a, &address);
    std::lock_guard<std::mutex> l(mu_);
    if (!mapped.ok()) {
      allocated_ -= rounded;
      return mapped;
    }
    allocs_[reinterpret_cast<uintptr_t>(address)] = a;
    if (a.alias != address) aliases_[reinterpret_cast<uintptr_t>(a.alias)] = a.requested;
    return address;
  }

  Status Free(void* ptr) override {
    if (ptr == nullptr) return Status::Ok();
    CpuAllocation a;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = allocs_.find(reinterpret_cast<uintptr_t>(ptr));
      if (it == allocs_.end())
        return InvalidArgument(
            StrCat("cpu device: Free of ", ptr, " which this device did not allocate"));
      a = it->second;
      allocated_ -= a.rounded;
      allocs_.erase(it);
      aliases_.erase(reinterpret_cast<uintptr_t>(a.alias));
    }
    Release(reinterpret_cast<uintptr_t>(ptr), a);
    return Status::Ok();
  }

  void* ComputeAddress(void* ptr) const override {
    if (memory_ != CpuDeviceMemory::kStrict || ptr == nullptr) return ptr;
    std::lock_guard<std::mutex> l(mu_);
    char* alias = AliasOf(reinterpret_cast<uintptr_t>(ptr), 0);
    return alias != nullptr ? alias : ptr;
  }

  StatusOr<std::unique_ptr<Stream>> CreateStream(StreamPriority) override {
    auto s = std::make_unique<CpuStream>(this);
    std::lock_guard<std::mutex> l(mu_);
    streams_.insert(s.get());
    return std::unique_ptr<Stream>(std::move(s));
  }
  StatusOr<std::unique_ptr<Event>> CreateEvent() override {
    return std::unique_ptr<Event>(std::make_unique<CpuEvent>());
  }
  Status OrderForeignStream(void*, Event& event) override { return event.Synchronize(); }
  Status Synchronize() override {
    std::vector<CpuStream*> streams;
    {
      std::lock_guard<std::mutex> l(mu_);
      streams.assign(streams_.begin(), streams_.end());
    }
    // Every stream, and a kernel's failure stays with its stream's owner (Stream::Synchronize).
    for (CpuStream* s : streams) s->Drain();
    return Status::Ok();
  }

  void Unregister(CpuStream* s) {
    std::lock_guard<std::mutex> l(mu_);
    streams_.erase(s);
  }

  // When [p, p+bytes) lies inside one live allocation, its host-reachable address. A device
  // range may be named by the address Allocate returned or by its compute alias (a tensor
  // view's data_ptr), as a CUDA copy accepts any pointer into device memory.
  StatusOr<void*> Resolve(const void* p, size_t bytes, const char* what) const {
    std::lock_guard<std::mutex> l(mu_);
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    if (char* alias = AliasOf(a, bytes)) return static_cast<void*>(alias);
    auto al = aliases_.upper_bound(a);
    if (al != aliases_.begin()) {
      --al;
      if (a >= al->first && a + bytes <= al->first + al->second) return const_cast<void*>(p);
    }
    return InvalidArgument(StrCat("cpu device: ", what, " range [", p, ", +", bytes,
                                  ") is not inside a live allocation of this device"));
  }

 private:
  // The host-reachable address of [a, a+bytes) when that range lies in one allocation named by
  // its handed-out address; bytes 0 asks only that `a` point into one (an empty allocation's
  // own address counts). Null otherwise.
  char* AliasOf(uintptr_t a, size_t bytes) const {  // REQUIRES(mu_)
    auto it = allocs_.upper_bound(a);
    if (it == allocs_.begin()) return nullptr;
    --it;
    const uintptr_t base = it->first;
    const size_t n = it->second.requested;
    const bool inside = bytes == 0 ? a < base + std::max<size_t>(n, 1) : a + bytes <= base + n;
    return a >= base && inside ? it->second.alias + (a - base) : nullptr;
  }

  static Status MapPlain(CpuAllocation* a, void** address) {
    void* p = std::aligned_alloc(256, (a->rounded + 255) & ~size_t{255});
    if (p == nullptr)
      return ResourceExhausted(
          StrCat("cpu device: host allocation of ", FormatBytes(a->requested), " failed"));
    a->alias = static_cast<char*>(p);
    *address = p;
    return Status::Ok();
  }

  // Note [strict device memory]
  // A GPU's memory is not the host's: a host load or store through a device pointer faults. To
  // make the CPU device fail the same way, strict memory maps each allocation twice from one
  // memfd. The address handed out is the PROT_NONE mapping, so a host dereference of it dies
  // with SIGSEGV exactly where a GPU run would; the device's copies, fills and compute
  // (ComputeAddress: tensor views, kernels) use the readable mapping of the same bytes. Pages
  // are the memfd's, so they exist once, and both mappings go away at Free.
  static Status MapStrict(CpuAllocation* a, void** address) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    a->mapped = (a->rounded + page - 1) / page * page;
    const int fd = memfd_create("strata-cpu-device", MFD_CLOEXEC);
    if (fd < 0) return Internal(StrCat("cpu device: memfd_create failed: ", std::strerror(errno)));
    Status st = Status::Ok();
    void* hidden = MAP_FAILED;
    void* open = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(a->mapped)) != 0) {
      st = ResourceExhausted(StrCat("cpu device: cannot size a ", FormatBytes(a->mapped),
                                    " strict allocation: ", std::strerror(errno)));
    } else {
      hidden = mmap(nullptr, a->mapped, PROT_NONE, MAP_SHARED, fd, 0);
      open = mmap(nullptr, a->mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (hidden == MAP_FAILED || open == MAP_FAILED)
        st = ResourceExhausted(StrCat("cpu device: cannot map a ", FormatBytes(a->mapped),
                                      " strict allocation: ", std::strerror(errno)));
    }
    close(fd);
    if (!st.ok()) {
      if (hidden != MAP_FAILED) munmap(hidden, a->mapped);
      if (open != MAP_FAILED) munmap(open, a->mapped);
      return st;
    }
    a->alias = static_cast<char*>(open);
    *address = hidden;
    return Status::Ok();
  }

  static void Release(uintptr_t address, const CpuAllocation& a) {
    if (a.mapped == 0) {
      std::free(reinterpret_cast<void*>(address));
      return;
    }
    munmap(reinterpret_cast<void*>(address), a.mapped);
    munmap(a.alias, a.mapped);
  }

  const uint64_t capacity_;
  const CpuDeviceMemory memory_;
  mutable std::mutex mu_;
  uint64_t allocated_ = 0;                    // GUARDED_BY(mu_)
  uint64_t peak_ = 0;                         // GUARDED_BY(mu_)
  std::map<uintptr_t, CpuAllocation> allocs_; // GUARDED_BY(mu_): handed-out address → allocation
  std::map<uintptr_t, size_t> aliases_;       // GUARDED_BY(mu_): strict alias → requested bytes
  std::set<CpuStream*> streams_;              // GUARDED_BY(mu_)
};

CpuStream::CpuStream(CpuDevice* device) : device_(device), worker_([this] { Run(); }) {}

CpuStream::~CpuStream() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
  device_->Unregister(this);
}

void CpuStream::Enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(std::move(task));
    ++enqueued_;
  }
  cv_.notify_all();
}

void CpuStream::Run() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ set and drained
    auto task = std::move(queue_.front());
    queue_.pop_front();
    l.unlock();
    task();
    l.lock();
    ++done_;
    cv_.notify_all();
  }
}

Status CpuStream::MemcpyAsync(void* dst, const void* src, size_t bytes, CopyKind kind) {
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr)
    return InvalidArgument("cpu stream: MemcpyAsync with a null pointer");
  if (kind == CopyKind::kHostToDevice || kind == CopyKind::kDeviceToDevice) {
    STRATA_ASSIGN_OR_RETURN(dst, device_->Resolve(dst, bytes, "copy destination"));
  }
  if (kind == CopyKind::kDeviceToHost || kind == CopyKind::kDeviceToDevice) {
    STRATA_ASSIGN_OR_RETURN(src, device_->Resolve(src, bytes, "copy source"));
  }
  Enqueue([dst, src, bytes] { std::memmove(dst, src, bytes); });
  return Status::Ok();
}

Status CpuStream::MemsetAsync(void* dst, int value, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(dst, device_->Resolve(dst, bytes, "memset destination"));
  Enqueue([dst, value, bytes] { std::memset(dst, value, bytes); });
  return Status::Ok();
}

Status CpuStream::LaunchHostFunc(std::function<void()> fn) {
  if (!fn) return InvalidArgument("cpu stream: LaunchHostFunc with an empty function");
  Enqueue(std::move(fn));
  return Status::Ok();
}

Status CpuStream::LaunchKernel(std::function<Status(void*)> kernel) {
  if (!kernel) return InvalidArgument("cpu stream: LaunchKernel with an empty function");
  Enqueue([this, kernel = std::move(kernel)] {
    Status s = kernel(nullptr);
    if (s.ok()) return;
    std::lock_guard<std::mutex> l(mu_);
    if (kernel_error_.ok()) kernel_error_ = std::move(s);
  });
  return Status::Ok();
}

Status CpuStream::Record(Event& event) {
  auto* e = dynamic_cast<CpuEvent*>(&event);
  if (e == nullptr) return InvalidArgument("cpu stream: Record of an event from another device");
  std::shared_ptr<EventState> st = e->state();
  uint64_t seq;
  {
    std::lock_guard<std::mutex> l(st->mu);
    seq = ++st->recorded;
  }
  Enqueue([st, seq] {
    {
      std::lock_guard<std::mutex> l(st->mu);
      st->completed = std::max(st->completed, seq);
    }
    st->cv.notify_all();
  });
  return Status::Ok();
}

Status CpuStream::Wait(Event& event) {
  auto* e = dynamic_cast<CpuEvent*>(&event);
  if (e == nullptr) return InvalidArgument("cpu stream: Wait on an event from another device");
  std::shared_ptr<EventState> st = e->state();
  uint64_t target;
  {
    std::lock_guard<std::mutex> l(st->mu);
    target = st->recorded;
  }
  // Blocking this stream's own worker is the CPU analogue of a GPU stream waiting on an event.
  Enqueue([st, target] {
    std::unique_lock<std::mutex> l(st->mu);
    st->cv.wait(l, [&] { return st->completed >= target; });
  });
  return Status::Ok();
}

void CpuStream::Drain() {
  std::unique_lock<std::mutex> l(mu_);
  uint64_t target = enqueued_;
  cv_.wait(l, [&] { return done_ >= target; });
}

Status CpuStream::Synchronize() {
  Drain();
  std::lock_guard<std::mutex> l(mu_);
  return std::exchange(kernel_error_, Status::Ok());
}

bool CpuStream::Query() {
  std::lock_guard<std::mutex> l(mu_);
  return done_ >= enqueued_;
}

}  // namespace

CpuDeviceMemory DefaultCpuDeviceMemory() {
  const char* v = GetEnv(kEnvCpuDevice);
  if (v == nullptr || *v == '\0') return CpuDeviceMemory::kPlain;
  if (std::string_view(v) == "strict") return CpuDeviceMemory::kStrict;
  // Another value ("Strict", "1") would otherwise turn the strict device off without a word.
  static std::once_flag warned;
  std::call_once(warned, [v] {
    STRATA_LOG(WARN) << kEnvCpuDevice.name << "=" << v
                     << ": expected strict (or unset); the CPU device runs plain";
  });
  return CpuDeviceMemory::kPlain;
}

std::unique_ptr<Device> MakeCpuDevice(uint64_t capacity, CpuDeviceMemory memory) {
  return std::make_unique<CpuDevice>(capacity, memory);
}

}  // namespace strata
