#include "runtime/state/block_store.h"

#include <chrono>
#include <map>
#include <mutex>

#include "runtime/base/device.h"
#include "tiers/nvme/nvme_tier.h"

namespace strata {

const char* PlacementName(Placement p) {
  switch (p) {
    case Placement::kDevice: return "device";
    case Placement::kHost: return "host";
    case Placement::kNvme: return "nvme";
  }
  return "?";
}

std::string BlockName(const BlockKey& key) {
  return StrCat("chunk ", key.chunk, " ", StateKindName(key.kind));
}

namespace {

class TieredBlockStore final : public BlockStore {
 public:
  TieredBlockStore(Device* device, nvme::NvmeTier* nvme, std::unique_ptr<TierManager> manager)
      : device_(device), nvme_(nvme), manager_(std::move(manager)) {}
  ~TieredBlockStore() override {
    for (auto& [key, b] : device_blocks_) device_->Free(b.memory).IgnoreError();
  }

  Status Register(const BlockKey& key, uint64_t bytes, Placement placement) override {
    if (placement == Placement::kDevice) {
      std::lock_guard<std::mutex> l(mu_);
      if (device_blocks_.count(key)) return InvalidArgument(StrCat(BlockName(key), " registered twice"));
      STRATA_ASSIGN_OR_RETURN(void* p, device_->Allocate(bytes));
      device_blocks_[key] = {p, bytes};
      bytes_device_ += bytes;
      return Status::Ok();
    }
    if (!manager_)
      return FailedPrecondition(StrCat(BlockName(key), " is placed in ", PlacementName(placement),
                                       " but the store was built without a host tier"));
    if (placement == Placement::kNvme && !nvme_)
      return FailedPrecondition(StrCat(BlockName(key), " is placed on NVMe but no nvme_path is set"));
    return manager_->Register(Id(key), bytes,
                              placement == Placement::kNvme ? BlockHome::kNvme : BlockHome::kHostOnly);
  }

  StatusOr<void*> Acquire(const BlockKey& key, Access access) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = device_blocks_.find(key);
      if (it != device_blocks_.end()) return it->second.memory;
    }
    if (!manager_) return NotFound(StrCat(BlockName(key), " was never registered"));
    return manager_->Acquire(Id(key), access);
  }

  Status Release(const BlockKey& key, bool dirty) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (device_blocks_.count(key)) return Status::Ok();
    }
    if (!manager_) return NotFound(StrCat(BlockName(key), " was never registered"));
    return manager_->Release(Id(key), dirty);
  }

  Status Unregister(const BlockKey& key) override {
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = device_blocks_.find(key);
      if (it != device_blocks_.end()) {
        STRATA_RETURN_IF_ERROR(device_->Free(it->second.memory));
        bytes_device_ -= it->second.bytes;
        device_blocks_.erase(it);
        return Status::Ok();
      }
    }
    if (!manager_) return NotFound(StrCat(BlockName(key), " was never registered"));
    return manager_->Unregister(Id(key));
  }

  void Prefetch(const BlockKey& key) override {
    if (manager_ && !IsDevice(key)) manager_->Prefetch(Id(key));
  }
  void BeginIteration() override {
    if (manager_) manager_->BeginIteration().IgnoreError();
  }
  void EndIteration() override {
    if (manager_) manager_->EndIteration().IgnoreError();
  }
  Status Flush() override { return manager_ ? manager_->Flush() : Status::Ok(); }

  BlockStoreStats stats() const override {
    BlockStoreStats s;
    {
      std::lock_guard<std::mutex> l(mu_);
      s.bytes_device = bytes_device_;
    }
    if (manager_) {
      TierManagerStats t = manager_->stats();
      s.bytes_host = t.host_bytes_resident;
      s.peak_bytes_host = t.peak_host_bytes_resident;
      s.bytes_nvme = t.nvme_bytes_reserved;
      s.bytes_nvme_to_host = t.bytes_nvme_to_host;
      s.bytes_host_to_nvme = t.bytes_host_to_nvme;
      s.stall_s = t.stall_seconds;
      s.host_hits = t.host_hits + t.host_inflight_hits;
      s.host_misses = t.host_misses;
    }
    if (nvme_) s.nvme_busy_s = nvme_->stats().busy_seconds;
    return s;
  }

  nlohmann::json StatsJson() const override {
    return manager_ ? manager_->StatsJson() : nlohmann::json::object();
  }

 private:
  struct DeviceBlock {
    void* memory = nullptr;
    uint64_t bytes = 0;
  };
  static BlockId Id(const BlockKey& k) { return BlockId{static_cast<uint32_t>(k.chunk), k.kind}; }
  bool IsDevice(const BlockKey& key) const {
    std::lock_guard<std::mutex> l(mu_);
    return device_blocks_.count(key) > 0;
  }

  Device* device_;
  nvme::NvmeTier* nvme_;
  std::unique_ptr<TierManager> manager_;
  mutable std::mutex mu_;
  std::map<BlockKey, DeviceBlock> device_blocks_;  // GUARDED_BY(mu_)
  uint64_t bytes_device_ = 0;                      // GUARDED_BY(mu_)
};

}  // namespace

StatusOr<std::unique_ptr<BlockStore>> MakeTieredBlockStore(Device* device, nvme::NvmeTier* nvme,
                                                           const TierManagerOptions& manager) {
  std::unique_ptr<TierManager> tm;
  if (manager.host_budget > 0) {
    STRATA_ASSIGN_OR_RETURN(tm, TierManager::Create(manager, nvme));
    if (nvme) STRATA_RETURN_IF_ERROR(tm->RegisterHostPoolWith(*nvme));
  }
  return std::unique_ptr<BlockStore>(std::make_unique<TieredBlockStore>(device, nvme, std::move(tm)));
}

}  // namespace strata
