#include "runtime/state/start_disk.h"

#include <algorithm>

namespace strata {

uint64_t StartDiskGrowth(const StepPlan& plan, const std::vector<ChunkInfo>& chunks,
                         const std::vector<ChunkStaging>& staged, uint64_t stripe, uint64_t state_bytes) {
  stripe = std::max<uint64_t>(stripe, 1);
  uint64_t allocated = 0, given_back = 0, growth = 0;
  for (size_t c = 0; c < staged.size() && c < chunks.size(); ++c) {
    given_back += staged[c].on_read;
    allocated += plan.ChunkNvmeBytes(static_cast<int64_t>(c), chunks[c].shard_numel);
    // The swap file holds whole stripes (aio.block_size) past the last block.
    const uint64_t held = (allocated + stripe - 1) / stripe * stripe;
    growth = std::max(growth, held > given_back ? held - given_back : 0);
    given_back += staged[c].after_blocks;
  }
  // The state's slots made later (cpu_checkpointing's) come after the whole file is given back.
  growth = std::max(growth, state_bytes > given_back ? state_bytes - given_back : 0);
  return std::min(growth, state_bytes);
}

}  // namespace strata
