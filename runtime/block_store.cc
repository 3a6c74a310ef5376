#include "runtime/block_store.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "runtime/device.h"
#include "tiers/tier.h"

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

constexpr uint64_t kAlign = 4096;

void* AlignedHost(uint64_t bytes) {
  return std::aligned_alloc(kAlign, (std::max<uint64_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign);
}

class DirectBlockStore final : public BlockStore {
 public:
  DirectBlockStore(Device* device, Tier* nvme) : device_(device), nvme_(nvme) {}
  ~DirectBlockStore() override {
    for (auto& [key, b] : blocks_) {
      if (b.placement == Placement::kDevice) device_->Free(b.memory).IgnoreError();
      if (b.placement == Placement::kNvme && b.memory) std::free(b.memory);
      if (b.placement == Placement::kHost) std::free(b.memory);
      if (b.placement == Placement::kNvme) nvme_->Free(b.region).IgnoreError();
    }
  }

  Status Register(const BlockKey& key, uint64_t bytes, Placement placement) override {
    std::lock_guard<std::mutex> l(mu_);
    if (blocks_.count(key)) return InvalidArgument(StrCat(BlockName(key), " registered twice"));
    Block b;
    b.bytes = bytes;
    b.placement = placement;
    switch (placement) {
      case Placement::kDevice: {
        STRATA_ASSIGN_OR_RETURN(b.memory, device_->Allocate(bytes));
        stats_.bytes_device += bytes;
        break;
      }
      case Placement::kHost:
        b.memory = AlignedHost(bytes);
        if (!b.memory) return ResourceExhausted(StrCat("host allocation for ", BlockName(key), " failed"));
        std::memset(b.memory, 0, bytes);
        AddHost(bytes);
        break;
      case Placement::kNvme: {
        if (!nvme_)
          return FailedPrecondition(StrCat(BlockName(key), " is placed on NVMe but no nvme_path is set"));
        STRATA_ASSIGN_OR_RETURN(b.region, nvme_->Allocate(bytes));
        stats_.bytes_nvme += bytes;
        break;
      }
    }
    blocks_.emplace(key, b);
    return Status::Ok();
  }

  StatusOr<void*> Acquire(const BlockKey& key, Access access) override {
    Block* b;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = blocks_.find(key);
      if (it == blocks_.end()) return NotFound(StrCat(BlockName(key), " was never registered"));
      b = &it->second;
      if (b->held) return FailedPrecondition(StrCat(BlockName(key), " acquired twice"));
      b->held = true;
      if (b->placement != Placement::kNvme) return b->memory;
      b->memory = AlignedHost(b->bytes);
      if (!b->memory) {
        b->held = false;
        return ResourceExhausted(StrCat("host staging for ", BlockName(key), " failed"));
      }
      AddHost(b->bytes);
    }
    if (access == Access::kWrite) return b->memory;
    auto t0 = std::chrono::steady_clock::now();
    Status s = nvme_->Read(b->region, b->memory);
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::lock_guard<std::mutex> l(mu_);
    stats_.stall_s += dt;
    if (!s.ok()) {
      std::free(b->memory);
      b->memory = nullptr;
      stats_.bytes_host -= b->bytes;
      b->held = false;
      return s.WithContext(StrCat("reading ", BlockName(key)));
    }
    stats_.bytes_nvme_to_host += b->bytes;
    return b->memory;
  }

  Status Release(const BlockKey& key, bool dirty) override {
    Block* b;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = blocks_.find(key);
      if (it == blocks_.end() || !it->second.held)
        return FailedPrecondition(StrCat(BlockName(key), " released without being acquired"));
      b = &it->second;
      if (b->placement != Placement::kNvme) {
        b->held = false;
        return Status::Ok();
      }
    }
    if (dirty) {
      Status s = nvme_->Write(b->region, b->memory);
      if (!s.ok()) {
        // Keep the staged bytes: the block stays held so nothing is lost, and the error says why.
        return s.WithContext(StrCat("writing back ", BlockName(key)));
      }
    }
    std::lock_guard<std::mutex> l(mu_);
    if (dirty) stats_.bytes_host_to_nvme += b->bytes;
    std::free(b->memory);
    b->memory = nullptr;
    stats_.bytes_host -= b->bytes;
    b->held = false;
    return Status::Ok();
  }

  Status Flush() override { return Status::Ok(); }  // nothing dirty outlives a Release here

  BlockStoreStats stats() const override {
    std::lock_guard<std::mutex> l(mu_);
    BlockStoreStats s = stats_;
    if (nvme_) s.nvme_busy_s = nvme_->stats().busy_seconds;
    return s;
  }

 private:
  struct Block {
    uint64_t bytes = 0;
    Placement placement = Placement::kHost;
    void* memory = nullptr;  // device/host storage, or the NVMe block's staging while held
    TierRegion region;       // kNvme
    bool held = false;
  };
  void AddHost(uint64_t bytes) {
    stats_.bytes_host += bytes;
    stats_.peak_bytes_host = std::max(stats_.peak_bytes_host, stats_.bytes_host);
  }

  Device* device_;
  Tier* nvme_;
  mutable std::mutex mu_;
  std::map<BlockKey, Block> blocks_;  // GUARDED_BY(mu_); nodes are stable
  BlockStoreStats stats_;             // GUARDED_BY(mu_)
};

}  // namespace

std::unique_ptr<BlockStore> MakeDirectBlockStore(Device* device, Tier* nvme) {
  return std::make_unique<DirectBlockStore>(device, nvme);
}

}  // namespace strata
