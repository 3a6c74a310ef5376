#include "runtime/state/start_disk.h"

#include <algorithm>

namespace strata {

uint64_t StartDiskGrowth(const StepPlan& plan, const std::vector<ChunkInfo>& chunks,
                         const std::vector<ChunkStaging>& staged, uint64_t stripe, uint64_t state_bytes,
                         uint64_t files, uint64_t files_here) {
  stripe = std::max<uint64_t>(stripe, 1);
  files = std::max<uint64_t>(files, 1);
  files_here = std::min(std::max<uint64_t>(files_here, 1), files);
  // What this file system's swap files hold for blocks up to `end`: each file whole stripes
  // (aio.block_size) up to its share of them.
  const auto here = [&](uint64_t end) {
    const uint64_t stripes = (end + stripe - 1) / stripe;
    return files_here * ((stripes + files - 1) / files) * stripe;
  };
  uint64_t allocated = 0, given_back = 0, growth = 0;
  for (size_t c = 0; c < staged.size() && c < chunks.size(); ++c) {
    given_back += staged[c].on_read;
    allocated += plan.ChunkNvmeBytes(static_cast<int64_t>(c), chunks[c].shard_numel);
    const uint64_t held = here(allocated);
    growth = std::max(growth, held > given_back ? held - given_back : 0);
    given_back += staged[c].after_blocks;
  }
  // The state's slots made later (cpu_checkpointing's) come after the whole file is given back.
  // One file holds the state itself; several hold their shares of its stripes.
  const uint64_t state_here = files == 1 ? state_bytes : here(state_bytes);
  growth = std::max(growth, state_here > given_back ? state_here - given_back : 0);
  return std::min(growth, state_here);
}

}  // namespace strata
