// Unit coordinator: gathering and releasing units' parameters, the unit protocol, forward.
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
  const size_t bytes = static_cast<size_t>(ci.numel) * optim::DTypeSize(compute_dtype_);
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
  const size_t esize = optim::DTypeSize(compute_dtype_);
  char* dst = static_cast<char*>(chunks_[c].buffer) + partitioner_->ShardOffset(c, shard_rank()) * esize;
  const size_t bytes = ci.shard_numel * esize;
  BlockKey key{c, StateKind::kParam16};
  void* src = nullptr;
  {
    LaneTimer t(&stall_s_, &lane_trace_, Lane::kWait, "shard read", trace_step(), c);
    STRATA_ASSIGN_OR_RETURN(src, store_->Acquire(key, Access::kRead));
  }
  LaneTimer t(&copy_s_, &lane_trace_, Lane::kCopy, "shard to device", trace_step(), c);
  CopyKind kind = param_placement_ == Placement::kDevice ? CopyKind::kDeviceToDevice
                                                         : CopyKind::kHostToDevice;
  Status s = copy_stream_->MemcpyAsync(dst, src, bytes, kind);
  if (s.ok()) s = copy_stream_->Synchronize();
  Status r = store_->Release(key, false);
  STRATA_RETURN_IF_ERROR(s);
  STRATA_RETURN_IF_ERROR(r);
  if (kind == CopyKind::kHostToDevice) bytes_h2d_ += bytes;
  return Status::Ok();
}

Status Engine::Impl::AllGatherChunk(int64_t c) {
  if (comm_->world_size() < 2) return Status::Ok();
  // Reductions queued before this all-gather run before it on every rank (Note [reduce lane]).
  STRATA_RETURN_IF_ERROR(DrainReductions());
  LaneTimer t(&comm_s_, &lane_trace_, Lane::kComm, "all-gather", trace_step(), c);
  return AllGatherShards(c);
}

Status Engine::Impl::AllGatherShards(int64_t c) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t esize = optim::DTypeSize(compute_dtype_);
  // Collectives take the address compute uses, as NCCL takes a tensor's data pointer.
  char* base = static_cast<char*>(device_->ComputeAddress(chunks_[c].buffer));
  char* mine = base + partitioner_->ShardOffset(c, shard_rank()) * esize;
  return comm_->AllGather(mine, base, ci.shard_numel, CommDtype(compute_dtype_));
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
  if (!stage3()) return Status::Ok();
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
  if (!stage3()) return Status::Ok();
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
  if (!stage3()) return;
  for (int64_t c : units_[u].chunks) ReleaseChunk(c, reuse_distance);
}

// In forward, a unit at trace position i is next needed by its backward, after every later unit
// of the trace has been gathered twice (its forward and its backward).
int64_t Engine::Impl::ForwardReuseDistance(size_t pos) const {
  if (pos >= last_trace_.size() || pos >= trace_.size() || last_trace_[pos] != trace_[pos])
    return std::numeric_limits<int64_t>::max();
  return last_trace_after_[pos];
}

// A chunk spanning two units (their parameters meet inside it) or holding a tied weight is
// used again in the same backward by an earlier unit of the trace; releasing it as if its next
// use were after the step would drop it and gather it again at once.
int64_t Engine::Impl::BackwardReuseDistance(int64_t c) const {
  int64_t distance = 0;
  for (size_t k = trace_.size(); k-- > 0;) {
    const UnitInfo& unit = units_[trace_[k]];
    if (unit.grads_pending == 0) continue;  // its backward is done
    if (std::find(unit.chunks.begin(), unit.chunks.end(), c) != unit.chunks.end()) return distance;
    distance += unit.elems;
  }
  return std::numeric_limits<int64_t>::max();
}

// Hints the shards of the units after trace position `pos` (direction +1, forward) or before it
// (-1, backward) until stage3_prefetch_bucket_size elements are on their way.
void Engine::Impl::PrefetchUnits(size_t pos, int direction) {
  if (!stage3()) return;
  const std::vector<int64_t>& trace = direction > 0 ? last_trace_ : trace_;
  int64_t budget = config_.zero_optimization.stage3_prefetch_bucket_size;
  std::vector<int64_t> next;  // the next unit's chunks are gathered ahead, not only read ahead
  for (int64_t k = static_cast<int64_t>(pos) + direction;
       k >= 0 && k < static_cast<int64_t>(trace.size()) && budget > 0; k += direction) {
    for (int64_t c : units_[trace[k]].chunks) {
      if (chunks_.installed(c)) continue;
      if (param_placement_ != Placement::kDevice) store_->Prefetch({c, StateKind::kParam16});
      if (std::abs(k - static_cast<int64_t>(pos)) == 1) next.push_back(c);
      budget -= partitioner_->chunks()[c].shard_numel;
    }
  }
  PrefetchGathers(next);
}

void Engine::Impl::OpenMicroStep() {
  if (!parked_.empty()) Throw(CheckStatesResident("a training forward"));
  if (!step_open_) {
    step_open_ = true;
    // The first step's window opens here; later ones opened when the previous Step returned.
    if (!window_open_) ResetLanes();
    if (!iteration_open_ && !defer_updates()) {
      store_->BeginIteration();
      iteration_open_ = true;
    }
  }
  micro_open_ = true;
  forward_start_ = Clock::now();
  waits_at_forward_start_ = WaitsSoFar();
  trace_.clear();
  stash_->BeginMicroStep();
  for (auto& p : params_) {
    p.plain_use = false;
    p.checkpointed_uses = 0;
    p.arrivals = 0;
    p.grad_in = false;
  }
  for (auto& u : units_) {
    u.grads_pending = static_cast<int>(u.params.size());
    u.backward_held = false;
  }
  for (size_t c = 0; c < chunks_.size(); ++c)
    chunks_[c].pending = static_cast<int>(partitioner_->chunks()[c].params.size());
}

void Engine::Impl::BeginUnit(int64_t u, bool checkpointed) {
  if (u < 0 || u >= num_units()) Throw(InvalidArgument(StrCat("no unit ", u)));
  UnitInfo& unit = units_[u];
  if (unit.forward_depth > 0)
    Throw(FailedPrecondition(StrCat("unit '", unit.name, "' runs inside itself; units may nest only "
                                    "when they are different modules")));
  if (in_backward_) {
    // Backward recomputes a checkpointed unit: gather it and hold it until its gradients are in.
    if (!unit.backward_held && unit.grads_pending > 0) {
      Status s = GatherUnit(u);
      if (!s.ok()) Throw(s.WithContext(StrCat("gathering unit '", unit.name, "' to recompute it")));
      unit.backward_held = true;
    }
    ++unit.forward_depth;
    unit.open_checkpointed = false;
    return;
  }
  // Under torch::NoGradGuard (evaluation) nothing is recorded for backward and no step opens; a
  // checkpointed forward runs without grad but is training.
  const bool training = torch::GradMode::is_enabled() || checkpointed;
  if (training && !micro_open_) OpenMicroStep();
  Status s = GatherUnit(u);
  if (!s.ok()) Throw(s.WithContext(StrCat("gathering unit '", unit.name, "' for forward")));
  ++unit.forward_depth;
  unit.open_checkpointed = checkpointed;
  if (training) {
    trace_.push_back(u);
    PrefetchUnits(trace_.size() - 1, +1);
    for (int64_t pid : unit.params) {
      if (checkpointed) ++params_[pid].checkpointed_uses;
      else params_[pid].plain_use = true;
    }
  }
}

void Engine::Impl::EndUnit(int64_t u, const std::vector<torch::Tensor>& outputs) {
  if (u < 0 || u >= num_units() || units_[u].forward_depth == 0)
    Throw(FailedPrecondition(StrCat("EndUnit(", u, ") without its BeginUnit")));
  UnitInfo& unit = units_[u];
  --unit.forward_depth;
  if (in_backward_) return;  // a recomputation: released when its gradients are in
  const bool checkpointed = unit.open_checkpointed;
  unit.open_checkpointed = false;
  const bool training = torch::GradMode::is_enabled() || checkpointed;
  if (training && !checkpointed && stage3()) {
    for (const torch::Tensor& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      torch::Tensor t = out;  // register_hook is not const; the hook lands on the shared node
      t.register_hook([this, u](const torch::Tensor&) { OnUnitBackwardReach(u); });
    }
  }
  ReleaseUnit(u, training ? ForwardReuseDistance(trace_.size() - 1)
                          : std::numeric_limits<int64_t>::max());
}

torch::Tensor Engine::Impl::Forward(const torch::Tensor& input) {
  auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(model_.get());
  if (!seq && !any_)
    Throw(FailedPrecondition(
        "Engine::Forward needs a Sequential or a model given with its forward (AnyModule); call "
        "the model's own forward instead, which runs its units through strata::RunUnit"));
  // A training forward's compute is the micro-step's span up to Backward (forward_start_), not
  // timed here twice.
  if (!seq) return any_->forward(input);
  torch::Tensor x = input;
  for (size_t k = 0; k < seq->size(); ++k) {
    // A child holding no trainable parameter is no unit: its scope does nothing.
    unit_detail::UnitScope scope(unit_detail::FindUnit(*seq->ptr(k)), /*checkpointed=*/false);
    x = (seq->begin() + static_cast<std::ptrdiff_t>(k))->forward(x);
    scope.Done({x});
  }
  return x;
}

void Engine::Impl::OnUnitBackwardReach(int64_t u) {
  if (!in_backward_)
    Throw(FailedPrecondition("backward reached a unit outside Engine::Backward: call "
                             "engine->Backward(loss) instead of loss.backward()"));
  if (!backward_error_.ok()) return;
  UnitInfo& unit = units_[u];
  if (unit.backward_held || unit.grads_pending == 0) return;
  Status s = GatherUnit(u);
  if (!s.ok()) {
    backward_error_ = s.WithContext(StrCat("gathering unit '", unit.name, "' for backward"));
    // Autograd cannot be cancelled from a hook without unwinding through it: throw, and
    // Backward turns the exception back into this Status.
    Throw(backward_error_);
  }
  unit.backward_held = true;
  // Prefetch the units that ran before this one.
  size_t pos = std::min(backward_cursor_, trace_.size());
  while (pos > 0 && trace_[pos - 1] != u) --pos;
  if (pos > 0) {
    backward_cursor_ = pos - 1;
    PrefetchUnits(pos - 1, -1);
  }
}

}  // namespace strata
