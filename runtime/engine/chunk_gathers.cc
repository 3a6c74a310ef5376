// Chunk gathers (stage 3): a chunk's memory installed and filled (its shard from its tier, the
// all-gather), held and released by units, dropped or refreshed after a step, and prefetched.
#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

// ---------------------------------------------------------------------------------------------
// Materialization (stage 3).

// Note [stage-3 live set]
// A gathered chunk stays on the device after its unit is done when it is small enough to
// persist (all of it below stage3_param_persistence_threshold elements: it then stays gathered
// across steps and is refilled after each update) or when it will be used again before
// stage3_max_reuse_distance more elements are gathered (the last units of forward are needed
// again at once by backward), as long as the gathered total stays within
// stage3_max_live_parameters; gathering a chunk that would exceed that cap first drops chunks
// nobody holds. The reuse distance and prefetching follow the order units ran in the previous
// forward (the trace); the first forward has none and keeps nothing it does not have to. In
// backward a chunk is next needed after the step (whose update changes it) unless an earlier
// unit still to run its backward holds it too (BackwardReuseDistance).
Status Engine::Impl::InstallChunk(int64_t c) {
  ChunkTable::Chunk& cs = chunks_[c];
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t bytes = static_cast<size_t>(ci.numel) * optim::DTypeSize(plan_.compute_dtype());
  ReapFrees(/*wait=*/false);
  StatusOr<void*> got = device_->Allocate(bytes);
  if (!got.ok() && got.status().code() == StatusCode::kResourceExhausted) {
    ReapFrees(/*wait=*/true);  // memory still read by queued compute comes back first
    got = device_->Allocate(bytes);
  }
  STRATA_ASSIGN_OR_RETURN(void* p, std::move(got));
  c10::StorageImpl* impl = cs.storage.unsafeGetStorageImpl();
  // The views compute reads are at the device's compute address (Note [device blocks]).
  impl->set_data_ptr_noswap(
      c10::DataPtr(device_->ComputeAddress(p), DeviceOptions(torch::kFloat32).device()));
  impl->set_nbytes(bytes);
  chunks_.Installed(c, p);
  return Status::Ok();
}

void Engine::Impl::FreeChunkMemory(int64_t c) {
  ChunkTable::Chunk& cs = chunks_[c];
  if (!cs.buffer) return;
  // Leave the storage empty first: every view (the parameters, what autograd saved) now reads
  // as unallocated instead of pointing at freed memory.
  c10::StorageImpl* impl = cs.storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, DeviceOptions(torch::kFloat32).device()));
  impl->set_nbytes(0);
  {
    std::lock_guard<std::mutex> l(frees_mu_);
    pending_frees_.push_back({cs.buffer, ComputeFence::Mark(*device_)});
  }
  cs.buffer = nullptr;
  ReapFrees(/*wait=*/false);
}

// Note [ordered frees]
// On a GPU, compute that reads a chunk may still be queued when its unit is done and the chunk
// is dropped; memory freed then could be reallocated and overwritten by the next gather's copy
// under those kernels. A dropped chunk's memory therefore waits with a fence on the compute
// enqueued so far and goes back to the device once that has run (as record_stream does for
// LibTorch's allocator). On the CPU device the fence is done at once and nothing waits.
void Engine::Impl::ReapFrees(bool wait) {
  std::vector<void*> ready;
  {
    std::lock_guard<std::mutex> l(frees_mu_);
    auto keep = pending_frees_.begin();
    for (auto& pf : pending_frees_) {
      if (wait) pf.second.Wait();
      if (pf.second.Done()) ready.push_back(pf.first);
      else *keep++ = std::move(pf);
    }
    pending_frees_.erase(keep, pending_frees_.end());
  }
  for (void* p : ready) device_->Free(p).IgnoreError();
}

Status Engine::Impl::FillChunk(int64_t c) {
  STRATA_RETURN_IF_ERROR(CopyShardIn(c));
  return AllGatherChunk(c);
}

Status Engine::Impl::CopyShardIn(int64_t c) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t esize = optim::DTypeSize(plan_.compute_dtype());
  char* dst = static_cast<char*>(chunks_[c].buffer) + partitioner_->ShardOffset(c, plan_.shard_rank()) * esize;
  const size_t bytes = ci.shard_numel * esize;
  BlockKey key{c, StateKind::kParam16};
  void* src = nullptr;
  {
    LaneTimer t(&meter_.stall_s, &meter_.trace, Lane::kWait, "shard read", trace_step(), c);
    STRATA_ASSIGN_OR_RETURN(src, store_->Acquire(key, Access::kRead));
  }
  LaneTimer t(&meter_.copy_s, &meter_.trace, Lane::kCopy, "shard to device", trace_step(), c);
  CopyKind kind = plan_.param_placement() == Placement::kDevice ? CopyKind::kDeviceToDevice
                                                         : CopyKind::kHostToDevice;
  Status s = streams_.copy->MemcpyAsync(dst, src, bytes, kind);
  if (s.ok()) s = streams_.copy->Synchronize();
  Status r = store_->Release(key, false);
  STRATA_RETURN_IF_ERROR(s);
  STRATA_RETURN_IF_ERROR(r);
  if (kind == CopyKind::kHostToDevice) meter_.bytes_h2d += bytes;
  return Status::Ok();
}

Status Engine::Impl::AllGatherChunk(int64_t c) {
  if (comm_->world_size() < 2) return Status::Ok();
  // Reductions queued before this all-gather run before it on every rank (Note [reduce lane]).
  STRATA_RETURN_IF_ERROR(DrainReductions());
  LaneTimer t(&meter_.comm_s, &meter_.trace, Lane::kComm, "all-gather", trace_step(), c);
  return AllGatherShards(c);
}

Status Engine::Impl::AllGatherShards(int64_t c) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t esize = optim::DTypeSize(plan_.compute_dtype());
  // Collectives take the address compute uses, as NCCL takes a tensor's data pointer.
  char* base = static_cast<char*>(device_->ComputeAddress(chunks_[c].buffer));
  char* mine = base + partitioner_->ShardOffset(c, plan_.shard_rank()) * esize;
  return comm_->AllGather(mine, base, ci.shard_numel, CommDtype(plan_.compute_dtype()));
}

Status Engine::Impl::GatherChunk(int64_t c) {
  chunks_.Hold(c);
  if (chunks_.installed(c)) {
    if (!chunks_.filling(c)) return Status::Ok();
    Status s = FinishFill(c);
    if (!s.ok()) {
      chunks_.Release(c);
      DropChunk(c);
    }
    return s;
  }
  const ChunkInfo& ci = partitioner_->chunks()[c];
  // Its shard may still be being updated (Note [deferred optimizer]).
  if (Status w = WaitChunkUpdated(c); !w.ok()) {
    chunks_.Release(c);
    return w;
  }
  const int64_t max_live = config_.zero_optimization.stage3_max_live_parameters;
  for (int64_t k = 0; k < static_cast<int64_t>(chunks_.size()) &&
                      chunks_.live_elems() + ci.numel > max_live; ++k)
    if (chunks_.holders(k) == 0 && chunks_.installed(k)) DropChunk(k);
  Status s = InstallChunk(c);
  if (s.ok()) s = FillChunk(c);
  if (!s.ok()) {
    chunks_.Release(c);
    DropChunk(c);
  }
  return s;
}

void Engine::Impl::ReleaseChunk(int64_t c, int64_t reuse_distance) {
  if (!chunks_.Release(c)) return;
  const auto& z = config_.zero_optimization;
  if (chunks_.persistent(c)) return;
  if (reuse_distance <= z.stage3_max_reuse_distance &&
      chunks_.live_elems() <= z.stage3_max_live_parameters)
    return;
  DropChunk(c);
}

void Engine::Impl::DropChunk(int64_t c) {
  if (!chunks_.installed(c)) return;
  // Gathered ahead but not used (the trace changed, the cap needs room): the lane's copy, and
  // its all-gather, must be done before the memory goes back.
  SettleFill(c).IgnoreError();
  FreeChunkMemory(c);
  chunks_.Dropped(c);
}

Status Engine::Impl::RefreshChunksAfterStep() {
  if (!plan_.stage3()) return Status::Ok();
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const int64_t c64 = static_cast<int64_t>(c);
    if (!chunks_.installed(c64)) continue;
    if (chunks_.holders(c64) > 0 || chunks_.persistent(c64)) {
      // Still held (the root's own parameters) or persistent: readable between steps, so same
      // memory, new values, before Step returns. Their updates are queued first.
      STRATA_RETURN_IF_ERROR(WaitChunkUpdated(c64));
      SettleFill(c64).IgnoreError();  // a gather ahead still in flight is superseded
      ComputeFence::Mark(*device_).Wait();  // queued compute may still read the old values
      STRATA_RETURN_IF_ERROR(FillChunk(c64));
    } else {
      DropChunk(c64);
    }
  }
  return Status::Ok();
}

Status Engine::Impl::GatherUnit(int64_t u) {
  if (!plan_.stage3()) return Status::Ok();
  const auto& chunks = units_[u].chunks;
  for (size_t k = 0; k < chunks.size(); ++k) {
    Status s = GatherChunk(chunks[k]);
    if (!s.ok()) {
      for (size_t j = 0; j < k; ++j) ReleaseChunk(chunks[j], std::numeric_limits<int64_t>::max());
      return s;
    }
  }
  return Status::Ok();
}

void Engine::Impl::ReleaseUnit(int64_t u, int64_t reuse_distance) {
  if (!plan_.stage3()) return;
  for (int64_t c : units_[u].chunks) ReleaseChunk(c, reuse_distance);
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
      if (plan_.param_placement() != Placement::kDevice) store_->Prefetch({c, StateKind::kParam16});
      if (distance == 1) next.push_back(c);
      budget -= partitioner_->chunks()[c].shard_numel;
    }
    return true;
  });
  PrefetchGathers(next);
}

}  // namespace strata
