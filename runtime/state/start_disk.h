// The start's disk: how much a run's NVMe blocks add to the disk while the engine's start reads
// a staging file (zero::Init's) on the same file system back and gives its space up, chunk by
// chunk (Note [start's disk] in runtime/engine/engine_init.cc). The engine asks its NVMe tier
// for this much free space; strata-estimate bounds the start's disk by the file plus this.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/state/partitioner.h"
#include "runtime/state/step_plan.h"

namespace strata {

// A chunk's staged space on the NVMe path's file system, by when the start gives it back.
struct ChunkStaging {
  uint64_t on_read = 0;       // before the chunk's blocks are allocated (read back, punched)
  uint64_t after_blocks = 0;  // once they are written (a mapping that goes with the parameter)
};

// The most one file system's use grows by while the start allocates `plan`'s NVMe blocks chunk by
// chunk and gets `staged` back there (one entry per chunk of `chunks`), and at the end its part of
// the `state_bytes` of NVMe state less the whole file; at most that part. The blocks are striped
// in whole `stripe` units over `files` swap files (one per nvme path), `files_here` of them on this
// file system (the swap store's layout: each file holds whole stripes up to its share of the end).
uint64_t StartDiskGrowth(const StepPlan& plan, const std::vector<ChunkInfo>& chunks,
                         const std::vector<ChunkStaging>& staged, uint64_t stripe, uint64_t state_bytes,
                         uint64_t files = 1, uint64_t files_here = 1);

}  // namespace strata
