// ChunkMaterializer (chunk_materializer.h): stage 3's chunks installed, filled, held, released,
// refreshed after a step and gathered ahead (the gather lane's side is gather_lane.cc, with Note
// [prefetched gathers]).
#include "runtime/engine/chunk_materializer.h"

#include <c10/core/DeviceGuard.h>

#include <chrono>
#include <limits>

#include "runtime/base/logging.h"
#include "runtime/engine/comm_memory.h"
#include "runtime/engine/compute_dtype.h"
#include "runtime/engine/engine.h"

namespace strata {

ChunkMaterializer::ChunkMaterializer(Parts p)
    : config_(*p.config), plan_(*p.plan), comm_(p.comm), device_(p.device), streams_(*p.streams),
      store_(p.store), partitioner_(p.partitioner), chunks_(*p.chunks), meter_(*p.meter),
      step_(p.step), hooks_(*p.hooks), wait_updated_(std::move(p.wait_updated)),
      show_params_(std::move(p.show_params)) {}

ChunkMaterializer::~ChunkMaterializer() { Close(); }

namespace {
// The deleters of a closed chunk's empty storage: never called (the storage holds no pointer),
// they only mark the storage, the second for an engine whose start failed part-way.
void ClosedChunkStorage(void*) {}
void FailedStartChunkStorage(void*) {}
}  // namespace

void ChunkMaterializer::Close(bool start_failed) {
  if (closed_) return;  // the destructor's call after the engine's keeps the engine's mark
  closed_ = true;
  StopLane();
  for (size_t c = 0; c < chunks_.size(); ++c) FreeChunkMemory(static_cast<int64_t>(c));
  ReapFrees(/*wait=*/true);
  show_params_ = nullptr;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    c10::Storage& st = chunks_[c].storage;
    if (st.unsafeGetStorageImpl() == nullptr) continue;  // stages 0-2, or not reached by setup
    st.unsafeGetStorageImpl()->set_data_ptr_noswap(
        c10::DataPtr(nullptr, nullptr, start_failed ? &FailedStartChunkStorage : &ClosedChunkStorage, TorchDev()));
  }
}

ChunkMaterializer::ClosedChunk ChunkMaterializer::ClosedChunkOf(const torch::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return ClosedChunk::kNone;
  const c10::DeleterFnPtr d = t.storage().data_ptr().get_deleter();
  return d == &ClosedChunkStorage ? ClosedChunk::kClosed
         : d == &FailedStartChunkStorage ? ClosedChunk::kStartFailed
                                         : ClosedChunk::kNone;
}

void ChunkMaterializer::MarkStartFailed(const torch::Tensor& param) {
  c10::Storage marked(c10::Storage::use_byte_size_t(), 0,
                      c10::DataPtr(nullptr, nullptr, &FailedStartChunkStorage, param.device()),
                      /*allocator=*/nullptr, /*resizable=*/false);
  torch::NoGradGuard ng;
  torch::Tensor(param).set_data(
      torch::empty({0}, torch::TensorOptions().dtype(param.dtype()).device(param.device()))
          .set_(marked, 0, {0}, {1}));
}

torch::Device ChunkMaterializer::TorchDev() const { return TorchDevice(*device_); }

Status ChunkMaterializer::MakeLanes(GradientReducer* reducer, OptimizerLane* opt_lane) {
  reducer_ = reducer;
  opt_lane_ = opt_lane;
  if (!plan_.stage3()) return Status::Ok();
  // With several ranks a chunk is gathered ahead whatever its update's state (Note
  // [prefetched gathers]): the lane waits for the update before it reads the shard.
  std::function<void(int64_t)> before_read;
  if (comm_->world_size() > 1) {
    before_read = [opt_lane](int64_t c) {
      double waited = 0;  // the lane traces its own wait
      opt_lane->WaitUpdated(c, &waited, /*trace_step=*/-1).IgnoreError();
    };
  }
  STRATA_ASSIGN_OR_RETURN(
      gather_, GatherLane::Create(
                   device_, static_cast<int64_t>(chunks_.size()), store_, &meter_.trace,
                   [this](int64_t c) {
                     const size_t esize = optim::DTypeSize(plan_.compute_dtype());
                     GatherLane::ShardCopy to;
                     to.dst = static_cast<char*>(chunks_[c].buffer) +
                              partitioner_->ShardOffset(c, plan_.shard_rank()) * esize;
                     to.bytes = partitioner_->chunks()[c].shard_numel * esize;
                     to.kind = plan_.ParamPlacement(c) == Placement::kDevice ? CopyKind::kDeviceToDevice
                                                                             : CopyKind::kHostToDevice;
                     return to;
                   },
                   std::move(before_read)));
  return Status::Ok();
}

void ChunkMaterializer::StartLane() {
  if (gather_) gather_->Start();
}

void ChunkMaterializer::StopLane() {
  if (gather_) gather_->Stop();
}

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
Status ChunkMaterializer::InstallChunk(int64_t c) {
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
      c10::DataPtr(device_->ComputeAddress(p), TorchDev()));
  impl->set_nbytes(bytes);
  chunks_.Installed(c, p);
  if (show_params_) show_params_(c, true);
  return Status::Ok();
}

void ChunkMaterializer::FreeChunkMemory(int64_t c) {
  ChunkTable::Chunk& cs = chunks_[c];
  if (!cs.buffer) return;
  // Leave the storage empty first: every view (what autograd saved) now reads as unallocated
  // instead of pointing at freed memory, and the parameters get 0 elements (Note [released
  // parameters]).
  c10::StorageImpl* impl = cs.storage.unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, TorchDev()));
  impl->set_nbytes(0);
  if (show_params_) show_params_(c, false);
  {
    MutexLock l(&frees_mu_);
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
void ChunkMaterializer::ReapFrees(bool wait) {
  std::vector<void*> ready;
  {
    MutexLock l(&frees_mu_);
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

Status ChunkMaterializer::FillChunk(int64_t c) {
  STRATA_RETURN_IF_ERROR(CopyShardIn(c));
  return AllGatherChunk(c);
}

Status ChunkMaterializer::CopyShardIn(int64_t c) {
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
  CopyKind kind = plan_.ParamPlacement(c) == Placement::kDevice ? CopyKind::kDeviceToDevice
                                                         : CopyKind::kHostToDevice;
  Status s = streams_.copy->MemcpyAsync(dst, src, bytes, kind);
  if (s.ok()) s = streams_.copy->Synchronize();
  Status r = store_->Release(key, false);
  STRATA_RETURN_IF_ERROR(s);
  STRATA_RETURN_IF_ERROR(r);
  if (kind == CopyKind::kHostToDevice) meter_.bytes_h2d += bytes;
  return Status::Ok();
}

Status ChunkMaterializer::AllGatherChunk(int64_t c) {
  if (comm_->world_size() < 2) return Status::Ok();
  // Reductions queued before this all-gather run before it on every rank (Note [reduce lane]).
  STRATA_RETURN_IF_ERROR(reducer_->Drain(&meter_, trace_step()));
  LaneTimer t(&meter_.comm_s, &meter_.trace, Lane::kComm, "all-gather", trace_step(), c);
  return AllGatherShards(c);
}

Status ChunkMaterializer::AllGatherShards(int64_t c) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t esize = optim::DTypeSize(plan_.compute_dtype());
  // Collectives take the address compute uses, as NCCL takes a tensor's data pointer.
  char* base = static_cast<char*>(device_->ComputeAddress(chunks_[c].buffer));
  char* mine = base + partitioner_->ShardOffset(c, plan_.shard_rank()) * esize;
  return comm_->AllGather(mine, base, ci.shard_numel, CommDtype(plan_.compute_dtype()));
}

Status ChunkMaterializer::GatherChunk(int64_t c) {
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
  if (Status w = wait_updated_(c); !w.ok()) {
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

void ChunkMaterializer::ReleaseChunk(int64_t c, int64_t reuse_distance) {
  if (!chunks_.Release(c)) return;
  const auto& z = config_.zero_optimization;
  if (chunks_.persistent(c)) return;
  if (reuse_distance <= z.stage3_max_reuse_distance &&
      chunks_.live_elems() <= z.stage3_max_live_parameters)
    return;
  DropChunk(c);
}

void ChunkMaterializer::DropChunk(int64_t c) {
  if (!chunks_.installed(c)) return;
  // Gathered ahead but not used (the trace changed, the cap needs room): the lane's copy, and
  // its all-gather, must be done before the memory goes back.
  SettleFill(c).IgnoreError();
  FreeChunkMemory(c);
  chunks_.Dropped(c);
}

Status ChunkMaterializer::RefreshChunks() {
  if (!plan_.stage3()) return Status::Ok();
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const int64_t c64 = static_cast<int64_t>(c);
    if (!chunks_.installed(c64)) continue;
    if (chunks_.holders(c64) > 0 || chunks_.persistent(c64)) {
      // Still held (the root's own parameters) or persistent: readable between steps, so same
      // memory, new values, before Step returns. Their updates are queued first.
      STRATA_RETURN_IF_ERROR(wait_updated_(c64));
      SettleFill(c64).IgnoreError();  // a gather ahead still in flight is superseded
      ComputeFence::Mark(*device_).Wait();  // queued compute may still read the old values
      STRATA_RETURN_IF_ERROR(FillChunk(c64));
    } else {
      DropChunk(c64);
    }
  }
  return Status::Ok();
}

void ChunkMaterializer::PrefetchGathers(const std::vector<int64_t>& next) {
  if (!gather_) return;
  const bool ranks = comm_->world_size() > 1;
  const int64_t max_live = config_.zero_optimization.stage3_max_live_parameters;
  std::vector<int64_t> chosen;
  int64_t live = chunks_.live_elems();  // with the chunks chosen so far
  for (int64_t c : next) {
    if (chunks_.installed(c)) continue;
    const int64_t numel = partitioner_->chunks()[c].numel;
    if (live + numel > max_live) continue;
    if (!ranks && opt_lane_->Pending(c)) continue;
    chosen.push_back(c);
    live += numel;
  }
  if (chosen.empty()) return;
  // Install what fits; with several ranks, keep only what every rank installed.
  std::vector<double> failed(chosen.size(), 0.0);
  for (size_t i = 0; i < chosen.size(); ++i)
    if (!InstallChunk(chosen[i]).ok()) failed[i] = 1;
  if (ranks) {
    reducer_->WaitIdle(&meter_, trace_step());
    torch::Tensor flags = torch::tensor(failed, torch::kFloat64);
    Status s;
    {
      LaneTimer t(&meter_.comm_s, &meter_.trace, Lane::kComm, "agree on gathers ahead", trace_step());
      s = OnCommMemory(*comm_, *device_, flags, [&](void* p) {
        return comm_->AllReduce(p, static_cast<size_t>(flags.numel()), strata::DType::kF64,
                                ReduceOp::kMax);
      });
    }
    // Without an agreement nothing is gathered ahead; the failure shows at the next collective.
    const double* f = flags.data_ptr<double>();
    for (size_t i = 0; i < chosen.size(); ++i) {
      const bool installed = failed[i] == 0;
      failed[i] = s.ok() ? f[i] : 1;
      if (installed && failed[i] != 0) DropChunk(chosen[i]);
    }
  }
  for (size_t i = 0; i < chosen.size(); ++i) {
    if (failed[i] != 0) continue;  // no device room now: gathered when used
    const int64_t c = chosen[i];
    chunks_.FillStarted(c, /*all_gather=*/ranks);
    gather_->Enqueue(c);
    if (ranks) reducer_->QueueAllGather(c, trace_step());
  }
}

Status ChunkMaterializer::AllGatherAhead(int64_t c, int64_t step, double* comm_s) {
  c10::DeviceGuard on_device(TorchDevice(*device_));
  gather_->WaitLanded(c);
  Status s = gather_->status(c);
  // Delay injection here, after the copy landed, when compute may already be waiting to read.
  if (hooks_.reduce_delay_hook) hooks_.reduce_delay_hook(c);
  Status g;
  {
    LaneTimer t(comm_s, &meter_.trace, Lane::kComm, "all-gather (ahead)", step, c);
    g = AllGatherShards(c);
  }
  return s.ok() ? g : s;
}

Status ChunkMaterializer::FinishFill(int64_t c) {
  // With several ranks an all-gather follows, and collectives run from the host: the shard must
  // be in place, not just ordered. With one rank only compute reads the chunk.
  const bool ordered_only = comm_->world_size() == 1;
  Status s = gather_->WaitEnqueued(c, /*take=*/ordered_only, &meter_.stall_s, trace_step());
  if (!ordered_only || !s.ok()) {
    // Waits for the copy (and the all-gather issued ahead); a failed copy's status carries
    // "gathering chunk c ahead".
    const bool all_gathered = chunks_.all_gather_ahead(c);
    STRATA_RETURN_IF_ERROR(SettleFill(c));
    // Several ranks always all-gather ahead today (PrefetchGathers); kept for a chunk queued
    // without it. (With one rank AllGatherChunk does nothing.)
    return all_gathered ? Status::Ok() : AllGatherChunk(c);
  }
  chunks_.FillSettled(c);  // one rank: no all-gather ahead
  // On a GPU this thread goes on while the copy runs. Waits that cost nothing are not traced.
  const StepMeter::Clock::time_point t0 = StepMeter::Clock::now();
  Status w = ComputeWaitFor(*device_, gather_->event(c));
  const StepMeter::Clock::time_point t1 = StepMeter::Clock::now();
  meter_.stall_s += std::chrono::duration<double>(t1 - t0).count();
  if (t1 - t0 > std::chrono::microseconds(20))
    meter_.trace.Add(Lane::kWait, "shard ahead (copy)", t0, t1, trace_step(), c);
  return w;
}

void ChunkMaterializer::WaitFillLanded(int64_t c) {
  if (gather_) gather_->WaitLanded(c);
}

Status ChunkMaterializer::SettleFill(int64_t c) {
  // After FinishFill the lane may still hold the block (a GPU's copy in flight): wait anyway.
  WaitFillLanded(c);
  if (!chunks_.filling(c)) return Status::Ok();
  Status s = gather_->status(c);
  if (chunks_.FillSettled(c)) {
    Status g = reducer_->WaitAllGather(c, &meter_.stall_s, trace_step());
    if (s.ok()) s = g;
  }
  return s;
}

void ChunkMaterializer::FinishAllFills() {
  if (gather_) gather_->WaitAllLanded();
}

Status ChunkMaterializer::TakeGatherError() { return gather_ ? gather_->TakeError() : Status::Ok(); }

}  // namespace strata
