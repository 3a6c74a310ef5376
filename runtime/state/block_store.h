// BlockStore: where the engine keeps each (chunk, state) shard between uses.
//
// The engine asks for a block's bytes with Acquire and gives them back with Release; where they
// live in between is the store's business. Placement is fixed at Register:
// - kDevice: device memory from the Device allocator (counted against the device budget). The
//   pointer Acquire returns is device memory (host-addressable only on the CPU device).
// - kHost:   host DRAM (pinned where possible), counted against the host budget.
// - kNvme:   a swap block on the NVMe tier; Acquire stages it in host memory.
// Contract:
// - Acquire returns a pointer valid until the matching Release; the block cannot be evicted or
//   moved meanwhile. kWrite promises the caller overwrites every byte (the store may skip the
//   read). A block may be acquired by one holder at a time.
// - Release(dirty=true) means the bytes changed: a store that keeps a copy elsewhere must write
//   them back before it drops them. A write-back failure is reported (from Release or Flush) and
//   the data stays in memory: nothing is lost silently.
// - Prefetch is a hint that the block will be acquired soon.
// - Flush writes back every dirty block (checkpoints call it).
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "runtime/base/status.h"
#include "runtime/state/partitioner.h"
#include "runtime/state/tier_manager.h"

namespace strata {

class Device;
namespace nvme {
class NvmeTier;
}

enum class Placement { kDevice, kHost, kNvme };

const char* PlacementName(Placement p);

struct BlockKey {
  int64_t chunk = 0;
  StateKind kind = StateKind::kParam16;
  bool operator<(const BlockKey& o) const {
    return chunk != o.chunk ? chunk < o.chunk : static_cast<int>(kind) < static_cast<int>(o.kind);
  }
  bool operator==(const BlockKey& o) const { return chunk == o.chunk && kind == o.kind; }
};

std::string BlockName(const BlockKey& key);  // "chunk 3 master32"

struct BlockStoreStats {
  uint64_t bytes_device = 0;       // GAUGE: registered bytes placed on the device
  uint64_t bytes_host = 0;         // GAUGE: bytes resident in host memory now (staging included)
  uint64_t peak_bytes_host = 0;    // MAX
  uint64_t bytes_nvme = 0;         // GAUGE: registered bytes placed on NVMe
  uint64_t bytes_nvme_to_host = 0; // SUM
  uint64_t bytes_host_to_nvme = 0; // SUM
  double nvme_busy_s = 0;          // SUM: from the NVMe tier's stats
  double stall_s = 0;              // SUM: time Acquire waited for a read
  uint64_t host_hits = 0;          // COUNT: acquires served from host memory
  uint64_t host_misses = 0;        // COUNT: acquires that had to read NVMe
};

class BlockStore {
 public:
  virtual ~BlockStore() = default;
  virtual Status Register(const BlockKey& key, uint64_t bytes, Placement placement) = 0;
  virtual StatusOr<void*> Acquire(const BlockKey& key, Access access) = 0;
  virtual Status Release(const BlockKey& key, bool dirty) = 0;
  // Forgets a block (not pinned). The tier manager then records a new trace.
  virtual Status Unregister(const BlockKey& key) = 0;
  virtual void Prefetch(const BlockKey&) {}
  virtual void BeginIteration() {}
  virtual void EndIteration() {}
  virtual Status Flush() = 0;
  virtual BlockStoreStats stats() const = 0;
  virtual nlohmann::json StatsJson() const = 0;  // the tier manager's full statistics
};

// The engine's store: device blocks live in Device memory; host and NVMe blocks are placed by a
// TierManager (pinned pool under `manager` options' budget, next-use eviction and trace-driven
// prefetch over `nvme`). `nvme` may be null when nothing is placed on NVMe; with no host or NVMe
// placement at all, pass manager.host_budget = 0 and no TierManager is created. `device` and
// `nvme` must outlive the store.
StatusOr<std::unique_ptr<BlockStore>> MakeTieredBlockStore(Device* device, nvme::NvmeTier* nvme,
                                                           const TierManagerOptions& manager);

}  // namespace strata
