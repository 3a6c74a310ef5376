// Units' chunks: a unit gathered (each of its chunks held) and released, and the units after it
// gathered ahead (chunk_materializer.h does the chunks' work).
#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

Status Engine::Impl::GatherUnit(int64_t u) {
  if (!plan_.stage3()) return Status::Ok();
  const auto& chunks = units_[u].chunks;
  for (size_t k = 0; k < chunks.size(); ++k) {
    Status s = materializer_->GatherChunk(chunks[k]);
    if (!s.ok()) {
      for (size_t j = 0; j < k; ++j) materializer_->ReleaseChunk(chunks[j], std::numeric_limits<int64_t>::max());
      return s;
    }
  }
  return Status::Ok();
}

void Engine::Impl::ReleaseUnit(int64_t u, int64_t reuse_distance) {
  if (!plan_.stage3()) return;
  for (int64_t c : units_[u].chunks) materializer_->ReleaseChunk(c, reuse_distance);
}

// Note [released parameters]
// A stage-3 parameter is a view of its chunk's storage, whose memory comes and goes. While the
// chunk is installed the parameter has its shape; while it is not, the parameter has 0 elements
// (a view of 0 elements at its offset), as DeepSpeed's partitioned parameters do (ds_shape keeps
// the shape). A parameter with its full shape over a storage without memory would hand any op
// that reads it (norm(), clone(), a state_dict's tensor) an address of nothing: a segfault where
// an empty result or a shape error is due. Views autograd saved keep their own shape and read the
// chunk again once backward has gathered it. Only the compute thread installs and drops chunks,
// so a parameter's shape changes only there (or on autograd's thread during backward, while the
// caller waits in it).
void Engine::Impl::ShowChunkParams(int64_t c, bool gathered) {
  const ChunkTable::Chunk& cs = chunks_[c];
  if (!cs.full.defined()) return;  // the first install, at setup: the views are made after it
  torch::NoGradGuard ng;
  for (int64_t pid : partitioner_->chunks()[c].params) {
    const ParamLocation& loc = partitioner_->location(pid);
    ParamInfo& p = params_[pid];
    p.tensor.set_data(gathered ? cs.full.narrow(0, loc.offset, loc.numel).view(p.shape)
                               : cs.full.narrow(0, loc.offset, 0));
  }
}

// Hints the shards of the units after trace position `pos` (direction +1, forward) or before it
// (-1, backward) until stage3_prefetch_bucket_size elements are on their way.
void Engine::Impl::PrefetchUnits(size_t pos, int direction) {
  if (!plan_.stage3()) return;
  int64_t budget = config_.zero_optimization.stage3_prefetch_bucket_size;
  std::vector<int64_t> next;  // the next unit's chunks are gathered ahead, not only read ahead
  units_.VisitNear(pos, direction, [&](int64_t u, int64_t distance) {
    if (budget <= 0) return false;
    for (int64_t c : units_[u].chunks) {
      if (chunks_.installed(c)) continue;
      if (plan_.ParamPlacement(c) != Placement::kDevice) store_->Prefetch({c, StateKind::kParam16});
      if (distance == 1) next.push_back(c);
      budget -= partitioner_->chunks()[c].shard_numel;
    }
    return true;
  });
  materializer_->PrefetchGathers(next);
}

}  // namespace strata
