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

// The most the disk's use grows by while the start allocates `plan`'s NVMe blocks chunk by chunk
// (in whole `stripe` units of the swap file) and gets `staged` back (one entry per chunk of
// `chunks`), and at the end `state_bytes` of NVMe state less the whole file; at most
// `state_bytes`.
uint64_t StartDiskGrowth(const StepPlan& plan, const std::vector<ChunkInfo>& chunks,
                         const std::vector<ChunkStaging>& staged, uint64_t stripe, uint64_t state_bytes);

}  // namespace strata
