#include "tiers/hbm/cpu_device.h"

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "runtime/units.h"

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
  Status Record(Event& event) override;
  Status Wait(Event& event) override;
  Status Synchronize() override;
  bool Query() override;

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
  std::thread worker_;
};

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(uint64_t capacity) : capacity_(capacity) {}
  ~CpuDevice() override {
    for (auto& [addr, size] : allocs_) std::free(reinterpret_cast<void*>(addr));
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
    void* p = std::aligned_alloc(256, (rounded + 255) & ~size_t{255});
    std::lock_guard<std::mutex> l(mu_);
    if (p == nullptr) {
      allocated_ -= rounded;
      return ResourceExhausted(
          StrCat("cpu device: host allocation of ", FormatBytes(bytes), " failed"));
    }
    allocs_[reinterpret_cast<uintptr_t>(p)] = rounded;
    sizes_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return p;
  }

  Status Free(void* ptr) override {
    if (ptr == nullptr) return Status::Ok();
    std::lock_guard<std::mutex> l(mu_);
    auto it = allocs_.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == allocs_.end())
      return InvalidArgument(StrCat("cpu device: Free of ", ptr, " which this device did not allocate"));
    allocated_ -= it->second;
    allocs_.erase(it);
    sizes_.erase(reinterpret_cast<uintptr_t>(ptr));
    std::free(ptr);
    return Status::Ok();
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
  Status Synchronize() override {
    std::vector<Stream*> streams;
    {
      std::lock_guard<std::mutex> l(mu_);
      streams.assign(streams_.begin(), streams_.end());
    }
    for (Stream* s : streams) STRATA_RETURN_IF_ERROR(s->Synchronize());
    return Status::Ok();
  }

  void Unregister(CpuStream* s) {
    std::lock_guard<std::mutex> l(mu_);
    streams_.erase(s);
  }

  // OK when [p, p+bytes) lies inside one live allocation.
  Status CheckRange(const void* p, size_t bytes, const char* what) const {
    std::lock_guard<std::mutex> l(mu_);
    uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = sizes_.upper_bound(a);
    if (it != sizes_.begin()) {
      --it;
      if (a >= it->first && a + bytes <= it->first + it->second) return Status::Ok();
    }
    return InvalidArgument(StrCat("cpu device: ", what, " range [", p, ", +", bytes,
                                  ") is not inside a live allocation of this device"));
  }

 private:
  const uint64_t capacity_;
  mutable std::mutex mu_;
  uint64_t allocated_ = 0;                    // GUARDED_BY(mu_)
  uint64_t peak_ = 0;                         // GUARDED_BY(mu_)
  std::map<uintptr_t, size_t> allocs_;        // GUARDED_BY(mu_): address → rounded bytes
  std::map<uintptr_t, size_t> sizes_;         // GUARDED_BY(mu_): address → requested bytes
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
  if (kind == CopyKind::kHostToDevice || kind == CopyKind::kDeviceToDevice)
    STRATA_RETURN_IF_ERROR(device_->CheckRange(dst, bytes, "copy destination"));
  if (kind == CopyKind::kDeviceToHost || kind == CopyKind::kDeviceToDevice)
    STRATA_RETURN_IF_ERROR(device_->CheckRange(src, bytes, "copy source"));
  Enqueue([dst, src, bytes] { std::memmove(dst, src, bytes); });
  return Status::Ok();
}

Status CpuStream::MemsetAsync(void* dst, int value, size_t bytes) {
  if (bytes == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(device_->CheckRange(dst, bytes, "memset destination"));
  Enqueue([dst, value, bytes] { std::memset(dst, value, bytes); });
  return Status::Ok();
}

Status CpuStream::LaunchHostFunc(std::function<void()> fn) {
  if (!fn) return InvalidArgument("cpu stream: LaunchHostFunc with an empty function");
  Enqueue(std::move(fn));
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

Status CpuStream::Synchronize() {
  std::unique_lock<std::mutex> l(mu_);
  uint64_t target = enqueued_;
  cv_.wait(l, [&] { return done_ >= target; });
  return Status::Ok();
}

bool CpuStream::Query() {
  std::lock_guard<std::mutex> l(mu_);
  return done_ >= enqueued_;
}

}  // namespace

std::unique_ptr<Device> MakeCpuDevice(uint64_t capacity) {
  return std::make_unique<CpuDevice>(capacity);
}

}  // namespace strata
