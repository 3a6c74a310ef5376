// StateLayout: how the optimizer's states of a run are stored (Note [compact layouts] in
// step_plan.h): the master as fp32 or bf16, the moments as fp32, bf16 or 8-bit blocks. It names
// the layout as checkpoints record it, sizes a shard's master and moment blocks, and converts a
// block between layouts through fp32 (a checkpoint saved under one layout, loaded under another).
//
// A value; no LibTorch. Thread-safety: const methods are pure.
#pragma once

#include <cstdint>
#include <string>

#include "optim/compact_step.h"
#include "runtime/base/config.h"
#include "runtime/base/status.h"
#include "runtime/state/partitioner.h"

namespace strata {

struct StateLayout {
  bool bf16_master = false;
  optim::MomentFormat moments = optim::MomentFormat::kFp32;

  // "fp32", "bf16" or "int8" (the moments), with "+bf16_master" for a bf16 master: what
  // checkpoints record as their state_dtype (older checkpoints wrote "fp32" or "bf16").
  std::string Name() const;
  // Parses Name()'s forms; INVALID_ARGUMENT naming the value otherwise.
  static StatusOr<StateLayout> Parse(const std::string& name);

  // Bytes of a master (kMaster32) or moment (kExpAvg, kExpAvgSq) block of a shard of n elements.
  uint64_t Bytes(StateKind kind, int64_t n) const;
  // A master or moment block of n elements as fp32 values, and back. 8-bit moments use blocks of
  // optim::kInt8Block from the shard's start, as optim::CompactAdamStep does; a bf16 master is
  // rounded to nearest.
  void Decode(StateKind kind, const void* block, int64_t n, float* out) const;
  void Encode(StateKind kind, const float* values, int64_t n, void* block) const;

  // The moments' format strata.optimizer_state_dtype names.
  static optim::MomentFormat MomentsOf(StateDtype dtype);

  bool operator==(const StateLayout& o) const { return bf16_master == o.bf16_master && moments == o.moments; }
  bool operator!=(const StateLayout& o) const { return !(*this == o); }
};

}  // namespace strata
