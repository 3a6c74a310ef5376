#include "runtime/state/partitioner.h"

#include <algorithm>

#include "runtime/base/check.h"

namespace strata {

// Note [chunk layout]
// Chunks are trimmed, not fixed-size: a chunk is padded only up to the next multiple of
// world_size·shard_alignment bytes past its last parameter. A full chunk therefore has (about)
// chunk_size bytes, the last chunk and an oversized parameter's chunk have what they need. This
// keeps small models small (a 10-parameter test model does not cost 64 MiB per state) while every
// shard still satisfies O_DIRECT and has the same length on every rank, which equal-count
// all-gather and reduce-scatter need. Buffer pools that want one size can size by the largest
// chunk.

namespace {

bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

int64_t RoundUp(int64_t v, int64_t unit) { return (v + unit - 1) / unit * unit; }

}  // namespace

const char* StateKindName(StateKind kind) {
  switch (kind) {
    case StateKind::kParam16: return "param16";
    case StateKind::kGrad: return "grad";
    case StateKind::kMaster32: return "master32";
    case StateKind::kExpAvg: return "exp_avg";
    case StateKind::kExpAvgSq: return "exp_avg_sq";
    case StateKind::kActivation: return "activation";
  }
  return "unknown";
}

uint64_t StagePlan::total_bytes() const {
  uint64_t sum = 0;
  for (uint64_t b : bytes) sum += b;
  return sum;
}

StatusOr<Partitioner> Partitioner::Create(const PartitionerOptions& o) {
  STRATA_CHECK(o.world_size >= 1, "partitioner world_size=", o.world_size, ": must be >= 1");
  STRATA_CHECK(o.element_size == 2 || o.element_size == 4, "partitioner element_size=",
               o.element_size, ": must be 2 (bf16/fp16) or 4 (fp32)");
  STRATA_CHECK(IsPowerOfTwo(o.shard_alignment), "partitioner shard_alignment=", o.shard_alignment,
               ": must be a power of two (4096 for O_DIRECT)");
  STRATA_CHECK(IsPowerOfTwo(o.param_alignment), "partitioner param_alignment=", o.param_alignment,
               ": must be a power of two (the vector width, e.g. 64)");
  STRATA_CHECK(o.param_alignment >= static_cast<uint64_t>(o.element_size) &&
                   o.shard_alignment >= o.param_alignment,
               "partitioner alignments: need element_size (", o.element_size,
               ") <= param_alignment (", o.param_alignment, ") <= shard_alignment (",
               o.shard_alignment, ")");
  STRATA_CHECK(o.chunk_size >= static_cast<uint64_t>(o.element_size), "strata.chunk_size=",
               o.chunk_size, ": must hold at least one element (e.g. 64MiB)");
  return Partitioner(o);
}

StatusOr<int64_t> Partitioner::AddParam(const std::string& name, int64_t numel) {
  if (finalized_) {
    return FailedPrecondition(StrCat("AddParam(", name, "): the partitioner is finalized; register ",
                                     "every parameter before Finalize()"));
  }
  STRATA_CHECK(numel >= 1, "parameter '", name, "' numel=", numel, ": must be >= 1");
  const int64_t capacity = static_cast<int64_t>(options_.chunk_size / options_.element_size);
  const int64_t palign = static_cast<int64_t>(options_.param_alignment / options_.element_size);

  int64_t start = RoundUp(open_used_, palign);
  if (!chunk_open_ || start + numel > capacity) {
    if (chunk_open_) CloseChunk();
    chunks_.emplace_back();
    chunk_open_ = true;
    open_used_ = 0;
    start = 0;
  }
  const int64_t id = num_params();
  const int64_t chunk = static_cast<int64_t>(chunks_.size()) - 1;
  locations_.push_back({chunk, start, numel});
  names_.push_back(name);
  chunks_.back().params.push_back(id);
  open_used_ = start + numel;
  param_numel_ += numel;
  // An oversized parameter owns its chunk: nothing may be packed after it.
  if (numel > capacity) CloseChunk();
  return id;
}

void Partitioner::CloseChunk() {
  STRATA_DCHECK(chunk_open_);
  const int64_t unit = static_cast<int64_t>(options_.shard_alignment / options_.element_size) *
                       options_.world_size;
  ChunkInfo& c = chunks_.back();
  c.used_numel = open_used_;
  c.numel = RoundUp(open_used_, unit);
  c.shard_numel = c.numel / options_.world_size;
  chunk_open_ = false;
  open_used_ = 0;
}

Status Partitioner::Finalize() {
  if (finalized_) return Status::Ok();
  if (chunk_open_) CloseChunk();
  finalized_ = true;
  return Status::Ok();
}

const ParamLocation& Partitioner::location(int64_t param) const {
  STRATA_DCHECK(param >= 0 && param < num_params(), "param=", param);
  return locations_[param];
}

const std::string& Partitioner::param_name(int64_t param) const {
  STRATA_DCHECK(param >= 0 && param < num_params(), "param=", param);
  return names_[param];
}

int Partitioner::OwnerOf(int64_t chunk, int64_t offset) const {
  STRATA_DCHECK(finalized_ && chunk >= 0 && chunk < static_cast<int64_t>(chunks_.size()));
  const ChunkInfo& c = chunks_[chunk];
  STRATA_DCHECK(offset >= 0 && offset < c.numel, "offset=", offset, " numel=", c.numel);
  return static_cast<int>(offset / c.shard_numel);
}

int64_t Partitioner::ShardOffset(int64_t chunk, int rank) const {
  STRATA_DCHECK(finalized_ && chunk >= 0 && chunk < static_cast<int64_t>(chunks_.size()));
  STRATA_DCHECK(rank >= 0 && rank < options_.world_size, "rank=", rank);
  return chunks_[chunk].shard_numel * rank;
}

Partitioner::ShardPiece Partitioner::PieceOf(int64_t param, int rank) const {
  const ParamLocation& loc = location(param);
  const int64_t lo = ShardOffset(loc.chunk, rank), hi = lo + chunks_[loc.chunk].shard_numel;
  const int64_t from = std::max(lo, loc.offset), to = std::min(hi, loc.offset + loc.numel);
  if (from >= to) return {param, 0, 0, 0};
  return {param, from - lo, from - loc.offset, to - from};
}

std::vector<Partitioner::ShardPiece> Partitioner::ShardPieces(int64_t chunk, int rank) const {
  std::vector<ShardPiece> out;
  for (int64_t p : chunks_[chunk].params) {
    const ShardPiece piece = PieceOf(p, rank);
    if (piece.size > 0) out.push_back(piece);
  }
  return out;
}

int64_t Partitioner::total_numel() const {
  int64_t sum = 0;
  for (const ChunkInfo& c : chunks_) sum += c.numel;
  return sum;
}

int64_t Partitioner::shard_numel_per_rank() const {
  int64_t sum = 0;
  for (const ChunkInfo& c : chunks_) sum += c.shard_numel;
  return sum;
}

StatusOr<StagePlan> Partitioner::PlanFor(int stage, int rank, int optimizer_state_size) const {
  if (!finalized_) return FailedPrecondition("Partitioner::PlanFor before Finalize()");
  STRATA_CHECK(stage >= 0 && stage <= 3, "zero_optimization.stage=", stage, ": must be 0, 1, 2 or 3");
  STRATA_CHECK(rank >= 0 && rank < options_.world_size, "rank=", rank, ": must be in [0, ",
               options_.world_size, ")");
  STRATA_CHECK(optimizer_state_size == 2 || optimizer_state_size == 4, "optimizer state size ",
               optimizer_state_size, " B: must be 4 (fp32) or 2 (bf16)");
  StagePlan plan;
  plan.stage = stage;
  plan.rank = rank;
  const uint64_t full = static_cast<uint64_t>(total_numel());
  const uint64_t shard = static_cast<uint64_t>(shard_numel_per_rank());
  const uint64_t esize = static_cast<uint64_t>(options_.element_size);
  const std::array<uint64_t, kNumStateKinds> elem_bytes = {
      esize, esize, esize == 4 ? 0u : 4u, static_cast<uint64_t>(optimizer_state_size),
      static_cast<uint64_t>(optimizer_state_size)};
  // The stage at which each state starts being sharded (ZeRO's definition of the stages).
  const std::array<int, kNumStateKinds> sharded_from = {3, 2, 1, 1, 1};
  for (int k = 0; k < kNumStateKinds; ++k) {
    plan.sharded[k] = stage >= sharded_from[k];
    plan.bytes[k] = (plan.sharded[k] ? shard : full) * elem_bytes[k];
  }
  return plan;
}

}  // namespace strata
