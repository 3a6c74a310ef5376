// Tier: one level of memory that holds blocks (chunk shards of some state) under a byte budget.
//
// Contract
// - Allocate reserves `bytes` of the budget and returns a region handle; it fails with
//   RESOURCE_EXHAUSTED (never aborts) when the budget or the backing store cannot hold it.
//   Sizes are rounded up to alignment() inside the tier; region.size stays what was asked.
// - I/O is per region and asynchronous: ReadAsync / WriteAsync start the transfer of the whole
//   region (region.size bytes) and return at once; `done` is called exactly once, on any thread,
//   with OK only when every byte has been transferred (a write is durable in the tier's own sense:
//   for NVMe, on the device, not in a page cache). A failed write leaves the region's previous
//   contents undefined but never reports success; a failed read never reports success either.
// - Buffers passed to I/O must stay valid until `done` runs and be aligned to alignment().
// - The caller serializes I/O on one region (the tier manager owns each block's state machine);
//   I/O on different regions may run concurrently from any threads.
// - Free returns the region's bytes to the budget; it must not race with I/O on that region.
// - Destruction drains in-flight I/O before returning.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "runtime/base/status.h"

namespace strata {

// A region a tier handed out. `id` means something only to the tier that issued it.
struct TierRegion {
  uint64_t id = 0;
  uint64_t size = 0;  // bytes, as requested
};

struct TierStats {
  uint64_t bytes_read = 0;         // SUM: bytes transferred out of the tier
  uint64_t bytes_written = 0;      // SUM: bytes transferred into the tier
  uint64_t reads = 0;              // COUNT: completed read requests
  uint64_t writes = 0;             // COUNT: completed write requests
  uint64_t errors = 0;             // COUNT: requests completed with a non-OK status
  double busy_seconds = 0;         // SUM: wall time with at least one request in flight
  uint64_t bytes_allocated = 0;    // GAUGE: bytes of budget held by live regions
  uint64_t peak_bytes_allocated = 0;  // MAX: highest bytes_allocated seen
};

using IoCallback = std::function<void(Status)>;

class Tier {
 public:
  virtual ~Tier() = default;

  virtual std::string_view name() const = 0;
  // Budget in bytes; Allocate never lets bytes_allocated exceed it.
  virtual uint64_t capacity() const = 0;
  // Required alignment of buffers passed to I/O (1 for memory tiers, 4096 for O_DIRECT files).
  virtual uint64_t alignment() const { return 1; }

  virtual StatusOr<TierRegion> Allocate(uint64_t bytes) = 0;
  virtual Status Free(const TierRegion& region) = 0;

  virtual void WriteAsync(const TierRegion& region, const void* src, IoCallback done) = 0;
  virtual void ReadAsync(const TierRegion& region, void* dst, IoCallback done) = 0;

  virtual TierStats stats() const = 0;

  // Blocking conveniences over the async calls.
  Status Write(const TierRegion& region, const void* src);
  Status Read(const TierRegion& region, void* dst);
};

}  // namespace strata
