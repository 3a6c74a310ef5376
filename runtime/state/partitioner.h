// Partitioner: packs parameters into chunks, shards each chunk over the ranks, and tells what
// every rank holds under ZeRO stages 0..3.
//
// Layout (see Note [chunk layout] in partitioner.cc):
// - Parameters are packed into flat chunks in registration order (≈ execution order). A chunk's
//   nominal capacity is StrataConfig::chunk_size bytes; a parameter that does not fit in the space
//   left starts a new chunk; a parameter larger than the capacity gets a chunk of its own.
// - Every parameter starts at an offset aligned to `param_alignment` bytes (the vector width) so
//   SIMD kernels may use aligned loads on each parameter.
// - Every chunk is padded so that it splits into world_size equal shards whose byte size is a
//   multiple of `shard_alignment` (4096 B, the O_DIRECT block): rank r owns elements
//   [r·shard_numel, (r+1)·shard_numel) of every chunk, so shards can be swapped with O_DIRECT and
//   gathered with equal-sized collectives.
//
// All sizes are in elements of the working precision (`element_size` bytes: 2 for bf16/fp16,
// 4 for fp32) unless a name ends in `_bytes`.
//
// Thread safety: a Partitioner is built by one thread (AddParam, Finalize) and is immutable and
// safe to read from any number of threads after Finalize.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/base/status.h"

namespace strata {

struct PartitionerOptions {
  uint64_t chunk_size = 64ull << 20;  // bytes: nominal chunk capacity before padding
  int world_size = 1;
  int element_size = 2;               // bytes per element of param16/grad: 2 (bf16/fp16) or 4 (fp32)
  uint64_t shard_alignment = 4096;    // bytes: every shard is a multiple (O_DIRECT block)
  uint64_t param_alignment = 64;      // bytes: every parameter starts at a multiple (vector width)
};

// Where one parameter lives.
struct ParamLocation {
  int64_t chunk = 0;   // index into Partitioner::chunks()
  int64_t offset = 0;  // elements from the start of the chunk
  int64_t numel = 0;
};

struct ChunkInfo {
  int64_t numel = 0;        // padded elements; == world_size * shard_numel
  int64_t shard_numel = 0;  // elements per rank
  int64_t used_numel = 0;   // elements up to the end of the last parameter (the rest is padding)
  std::vector<int64_t> params;  // parameter ids in this chunk, in registration order
};

// The five per-chunk states of mixed-precision Adam. Index with static_cast<int>.
// kActivation is not model state: the engine's stash of checkpointed units' saved inputs
// (activation_checkpointing.cpu_checkpointing), one block per checkpoint slot. Stage plans count
// the first kNumStateKinds kinds only.
enum class StateKind : int { kParam16 = 0, kGrad, kMaster32, kExpAvg, kExpAvgSq, kActivation };
inline constexpr int kNumStateKinds = 5;
const char* StateKindName(StateKind kind);  // "param16", "grad", "master32", ...

// What one rank holds of every state under one ZeRO stage.
struct StagePlan {
  int stage = 0;
  int rank = 0;
  // True when the state is split across ranks (each rank keeps its shards), false when every rank
  // keeps every chunk whole.
  std::array<bool, kNumStateKinds> sharded{};
  // SUM: bytes this rank keeps of each state, padding included (what it must allocate).
  std::array<uint64_t, kNumStateKinds> bytes{};
  uint64_t total_bytes() const;
};

class Partitioner {
 public:
  // Validates options: world_size >= 1, element_size 2 or 4, alignments powers of two with
  // shard_alignment a multiple of param_alignment and of element_size, chunk_size >= 1.
  static StatusOr<Partitioner> Create(const PartitionerOptions& options);

  // Registers a parameter of `numel` elements (>= 1) and returns its id (0, 1, 2, ... in order).
  // `name` is used only in messages. Fails after Finalize.
  StatusOr<int64_t> AddParam(const std::string& name, int64_t numel);

  // Closes the last chunk and pads every chunk. Required before the queries below; idempotent.
  Status Finalize();

  const PartitionerOptions& options() const { return options_; }
  bool finalized() const { return finalized_; }
  int64_t num_params() const { return static_cast<int64_t>(locations_.size()); }
  const std::vector<ChunkInfo>& chunks() const { return chunks_; }
  const ParamLocation& location(int64_t param) const;
  const std::string& param_name(int64_t param) const;

  // The rank owning element `offset` of `chunk`.
  int OwnerOf(int64_t chunk, int64_t offset) const;
  // First element of `rank`'s shard of `chunk` (shard length: chunks()[chunk].shard_numel).
  int64_t ShardOffset(int64_t chunk, int rank) const;
  // A parameter's part of one rank's shard of its chunk: `size` elements (0: none) from element
  // `in_shard` of the shard, which are elements `in_param`.. of the parameter.
  struct ShardPiece {
    int64_t param = 0;
    int64_t in_shard = 0;
    int64_t in_param = 0;
    int64_t size = 0;
  };
  ShardPiece PieceOf(int64_t param, int rank) const;
  // The non-empty pieces of `rank`'s shard of `chunk`, in the chunk's parameter order.
  std::vector<ShardPiece> ShardPieces(int64_t chunk, int rank) const;

  // Elements over all chunks, padding included, and per rank (sum of shard_numel).
  int64_t total_numel() const;
  int64_t shard_numel_per_rank() const;
  // Sum of registered parameter sizes (no padding).
  int64_t param_numel() const { return param_numel_; }

  // Per-rank placement of the Adam states under ZeRO `stage` (0..3):
  //   stage 0: everything replicated;
  //   stage 1: master32, exp_avg, exp_avg_sq sharded;
  //   stage 2: grad sharded as well;
  //   stage 3: param16 sharded as well.
  // Bytes per element: param16 and grad use element_size; master32 is 4 B when element_size is
  // 2 and absent (0 B) when the working copy is already fp32; exp_avg/exp_avg_sq use
  // `optimizer_state_size` (4 for fp32 states, 2 for bf16 states).
  StatusOr<StagePlan> PlanFor(int stage, int rank, int optimizer_state_size = 4) const;

 private:
  explicit Partitioner(const PartitionerOptions& options) : options_(options) {}
  void CloseChunk();

  PartitionerOptions options_;
  bool finalized_ = false;
  std::vector<ChunkInfo> chunks_;
  std::vector<ParamLocation> locations_;
  std::vector<std::string> names_;
  int64_t param_numel_ = 0;
  bool chunk_open_ = false;
  int64_t open_used_ = 0;  // elements used in the open chunk (aligned end of its last param)
};

}  // namespace strata
