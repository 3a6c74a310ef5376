#include "tiers/nvme/nvme_tier.h"

#include <algorithm>

#include "runtime/base/check.h"
#include "runtime/base/units.h"

namespace strata::nvme {

NvmeTierOptions NvmeTierOptionsFromConfig(const Config& config, uint32_t rank) {
  NvmeTierOptions o;
  for (const auto* list : {&config.zero_optimization.offload_param.nvme_path,
                           &config.zero_optimization.offload_optimizer.nvme_path}) {
    for (const auto& p : *list)
      if (std::find(o.paths.begin(), o.paths.end(), p) == o.paths.end()) o.paths.push_back(p);
  }
  o.rank = rank;
  o.capacity = config.strata.nvme_capacity;
  o.aio = config.aio;
  o.checksums = config.strata.checksums;
  return o;
}

StatusOr<std::unique_ptr<NvmeTier>> NvmeTier::Create(const NvmeTierOptions& options) {
  SwapStoreOptions so;
  so.paths = options.paths;
  so.rank = options.rank;
  so.capacity = options.capacity;
  so.needed_bytes = options.needed_bytes;
  so.needed_free_on_device = options.needed_free_on_device;
  so.needed_free_why = options.needed_free_why;
  so.shrink_hint = options.shrink_hint;
  so.aio = options.aio;
  so.checksums = options.checksums;
  so.mode = SwapOpenMode::kCreate;
  so.remove_on_close = options.remove_on_close;
  so.force_fallback = options.force_fallback;
  so.fault_hook = options.fault_hook;
  std::unique_ptr<NvmeTier> t(new NvmeTier);
  STRATA_ASSIGN_OR_RETURN(t->store_, SwapStore::Open(so));
  // 0 means what the file systems have free, which the store worked out.
  t->capacity_ = options.capacity > 0 ? options.capacity : t->store_->capacity();
  return t;
}

NvmeTier::~NvmeTier() = default;  // the store drains and saves its index

StatusOr<TierRegion> NvmeTier::Allocate(uint64_t bytes) {
  STRATA_CHECK(bytes > 0, "nvme tier: cannot allocate a region of 0 bytes");
  const uint64_t charged = (bytes + kSwapAlignment - 1) / kSwapAlignment * kSwapAlignment;
  uint64_t id;
  {
    MutexLock lock(&mu_);
    if (stats_.bytes_allocated + charged > capacity_)
      return ResourceExhausted(StrCat("nvme tier budget: ", FormatBytes(charged), " requested, ",
                                      FormatBytes(capacity_ - stats_.bytes_allocated), " of ",
                                      FormatBytes(capacity_), " left; raise strata.nvme_capacity"));
    id = next_id_++;
    stats_.bytes_allocated += charged;
    stats_.peak_bytes_allocated = std::max(stats_.peak_bytes_allocated, stats_.bytes_allocated);
  }
  Status s = store_->Allocate(id, bytes);
  if (!s.ok()) {
    MutexLock lock(&mu_);
    stats_.bytes_allocated -= charged;
    return s;
  }
  return TierRegion{id, bytes};
}

Status NvmeTier::Free(const TierRegion& region) {
  STRATA_RETURN_IF_ERROR(store_->Free(region.id));
  const uint64_t charged = (region.size + kSwapAlignment - 1) / kSwapAlignment * kSwapAlignment;
  MutexLock lock(&mu_);
  stats_.bytes_allocated -= std::min(charged, stats_.bytes_allocated);
  return Status::Ok();
}

IoDone NvmeTier::Track(bool read, uint64_t bytes, IoCallback done) {
  {
    MutexLock lock(&mu_);
    if (inflight_++ == 0) busy_since_ = std::chrono::steady_clock::now();
  }
  return [this, read, bytes, done = std::move(done)](Status s) {
    std::shared_ptr<const BusyObserver> observer;
    std::chrono::steady_clock::time_point begin, end;
    {
      MutexLock lock(&mu_);
      if (--inflight_ == 0) {
        end = std::chrono::steady_clock::now();
        begin = busy_since_;
        stats_.busy_seconds += std::chrono::duration<double>(end - begin).count();
        observer = observer_;
      }
      if (!s.ok()) {
        ++stats_.errors;
      } else if (read) {
        ++stats_.reads;
        stats_.bytes_read += bytes;
      } else {
        ++stats_.writes;
        stats_.bytes_written += bytes;
      }
    }
    if (observer) (*observer)(begin, end);
    done(std::move(s));
  };
}

void NvmeTier::WriteAsync(const TierRegion& region, const void* src, IoCallback done) {
  store_->WriteAsync(region.id, src, Track(false, region.size, std::move(done)));
}

void NvmeTier::ReadAsync(const TierRegion& region, void* dst, IoCallback done) {
  store_->ReadAsync(region.id, dst, Track(true, region.size, std::move(done)));
}

void NvmeTier::SetBusyObserver(BusyObserver observer) {
  MutexLock lock(&mu_);
  observer_ = observer ? std::make_shared<const BusyObserver>(std::move(observer)) : nullptr;
}

TierStats NvmeTier::stats() const {
  MutexLock lock(&mu_);
  TierStats s = stats_;
  if (inflight_ > 0)
    s.busy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - busy_since_).count();
  return s;
}

}  // namespace strata::nvme
