#include "tiers/memory_tier.h"

#include <chrono>
#include <cstring>

#include "runtime/base/units.h"

namespace strata {

MemoryTier::MemoryTier(std::string name, uint64_t capacity)
    : name_(std::move(name)), capacity_(capacity), worker_([this] { Run(); }) {}

MemoryTier::~MemoryTier() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

StatusOr<TierRegion> MemoryTier::Allocate(uint64_t bytes) {
  std::lock_guard<std::mutex> l(mu_);
  if (stats_.bytes_allocated + bytes > capacity_)
    return ResourceExhausted(StrCat(name_, ": cannot allocate ", FormatBytes(bytes), " (",
                                    FormatBytes(stats_.bytes_allocated), " of ",
                                    FormatBytes(capacity_), " in use)"));
  uint64_t id = next_id_++;
  regions_[id].resize(bytes);
  stats_.bytes_allocated += bytes;
  stats_.peak_bytes_allocated = std::max(stats_.peak_bytes_allocated, stats_.bytes_allocated);
  return TierRegion{id, bytes};
}

Status MemoryTier::Free(const TierRegion& region) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = regions_.find(region.id);
  if (it == regions_.end() || it->second.size() != region.size)
    return InvalidArgument(StrCat(name_, ": Free of unknown region ", region.id));
  stats_.bytes_allocated -= region.size;
  regions_.erase(it);
  return Status::Ok();
}

StatusOr<std::vector<uint8_t>*> MemoryTier::Find(const TierRegion& region) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = regions_.find(region.id);
  if (it == regions_.end() || it->second.size() != region.size)
    return InvalidArgument(StrCat(name_, ": I/O on unknown region ", region.id));
  // std::map nodes are stable: the pointer stays valid until Free, which must not race with I/O.
  return &it->second;
}

void MemoryTier::Submit(std::function<Status()> op, bool is_write, uint64_t bytes, IoCallback done) {
  auto task = [this, op = std::move(op), is_write, bytes, done = std::move(done)] {
    auto t0 = std::chrono::steady_clock::now();
    Status s = op();
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> l(mu_);
      stats_.busy_seconds += secs;
      if (!s.ok()) {
        ++stats_.errors;
      } else if (is_write) {
        ++stats_.writes;
        stats_.bytes_written += bytes;
      } else {
        ++stats_.reads;
        stats_.bytes_read += bytes;
      }
    }
    done(std::move(s));
  };
  {
    std::lock_guard<std::mutex> l(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void MemoryTier::WriteAsync(const TierRegion& region, const void* src, IoCallback done) {
  Submit(
      [this, region, src]() -> Status {
        STRATA_ASSIGN_OR_RETURN(std::vector<uint8_t> * buf, Find(region));
        if (region.size) std::memcpy(buf->data(), src, region.size);
        return Status::Ok();
      },
      true, region.size, std::move(done));
}

void MemoryTier::ReadAsync(const TierRegion& region, void* dst, IoCallback done) {
  Submit(
      [this, region, dst]() -> Status {
        STRATA_ASSIGN_OR_RETURN(std::vector<uint8_t> * buf, Find(region));
        if (region.size) std::memcpy(dst, buf->data(), region.size);
        return Status::Ok();
      },
      false, region.size, std::move(done));
}

TierStats MemoryTier::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  return stats_;
}

void MemoryTier::Run() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;
    auto task = std::move(queue_.front());
    queue_.pop_front();
    l.unlock();
    task();
    l.lock();
  }
}

}  // namespace strata
