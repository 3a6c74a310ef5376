// Optimizer lane: the optimizer thread, its queue and order, Step (chunk_update.cc is one
// chunk's update; publish_lane.cc takes the new values to the device).
#include "runtime/engine_impl.h"

namespace strata {

using namespace engine_detail;

// ---------------------------------------------------------------------------------------------
// Optimizer.

// Note [deferred optimizer]
// Without a global condition (gradient clipping, fp16 overflow) a chunk's update starts as soon
// as its gradient is reduced, during backward. With one, no update may start before every
// gradient is in: the reductions compute each chunk's share of the norm and its overflow flag as
// they land, and Step combines them. Under stage 3 Step then queues every update in the order the
// next forward gathers the chunks (UpdateOrder), refills the chunks that stay gathered between
// steps (the root's own, persistent ones: queued first, so that wait is short) and returns. The
// next forward waits only for the chunk it is about to gather (WaitChunkUpdated, which also
// moves that chunk to the head of the queue), so the updates, their NVMe reads and write-backs
// run beside it. Nothing else can see the values in between: a stage-3 parameter outside its
// unit has no storage. The updates take the same inputs (gradient, clip factor, lr, step) as a
// step that waited, so the values are bit-identical. Everything else that reads the states
// finishes the updates first: checkpoints, GatherMasterParams, the next Step, and the reduction
// of a chunk's next gradient. Below stage 3 the parameters are plain views of the working copy
// that a caller may read right after Step, so Step waits for the updates there.
void Engine::Impl::StartOptimizerLane() {
  opt_thread_ = std::thread([this] {
    // The current device is per thread: the GPU Adam's kernels go to the engine's device.
    c10::DeviceGuard on_device(TorchDevice(*device_));
    std::unique_lock<std::mutex> l(opt_mu_);
    for (;;) {
      opt_cv_.wait(l, [&] { return opt_stop_ || !opt_queue_.empty(); });
      if (opt_queue_.empty()) return;
      int64_t c = opt_queue_.front();
      opt_queue_.pop_front();
      ++opt_busy_;
      bool failed = !opt_error_.ok();
      l.unlock();
      double dt = 0;
      Status s;
      std::optional<PublishLane::Copy> publish;
      opt_slot_wait_s_ = 0;
      if (!failed) {
        if (optimizer_delay_hook_) optimizer_delay_hook_(c);
        LaneTimer t(&dt, &lane_trace_, Lane::kOptimizer, "adam", opt_step_, c);
        s = AdamChunk(c, opt_grad_scale_, opt_step_, &publish);
      }
      l.lock();
      // A wait for a staging slot is a wait for the copy lane, not optimizer work.
      opt_s_ += std::max(0.0, dt - opt_slot_wait_s_);
      if (!s.ok() && opt_error_.ok()) opt_error_ = s;
      if (publish) {
        // The publish lane finishes the chunk; submitted here, with this update's time already
        // counted, so that an idle lane means its step's figures are complete.
        publish_->Submit(*publish);
      } else {
        update_pending_[c] = 0;
        --opt_busy_;
      }
      opt_cv_.notify_all();
    }
  });
}

void Engine::Impl::StopOptimizerLane() {
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    opt_stop_ = true;
  }
  opt_cv_.notify_all();
  if (opt_thread_.joinable()) opt_thread_.join();
}

void Engine::Impl::EnqueueOptimizer(int64_t c) {
  WaitFillLanded(c);  // a copy gathered ahead still reads the block the update writes
  // Start reading the chunk's states now; the lane picks it up in order.
  store_->Prefetch(MasterKey(c));
  for (StateKind k : {StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    if (HoldsState(k)) store_->Prefetch({c, k});
  }
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    update_pending_[c] = 1;
    opt_queue_.push_back(c);
  }
  opt_cv_.notify_all();
}

Status Engine::Impl::DrainOptimizer() {
  std::unique_lock<std::mutex> l(opt_mu_);
  WaitOptimizerIdle(l);
  Status s = opt_error_;
  opt_error_ = Status::Ok();
  return s;
}

Status Engine::Impl::WaitChunkUpdated(int64_t c, double* waited) {
  std::unique_lock<std::mutex> l(opt_mu_);
  if (!update_pending_[c]) return opt_error_;
  PromoteUpdate(c);
  const Clock::time_point t0 = Clock::now();
  opt_cv_.wait(l, [&] { return !update_pending_[c]; });
  const Clock::time_point t1 = Clock::now();
  const double dt = std::chrono::duration<double>(t1 - t0).count();
  if (waited != nullptr) {
    *waited += dt;
  } else {
    stall_s_ += dt;
    update_wait_s_ += dt;
  }
  lane_trace_.Add(Lane::kWait, "wait for update", t0, t1, trace_step(), c);
  return opt_error_;
}

void Engine::Impl::PromoteUpdate(int64_t c) {
  auto it = std::find(opt_queue_.begin(), opt_queue_.end(), c);
  if (it != opt_queue_.end() && it != opt_queue_.begin()) {
    opt_queue_.erase(it);
    opt_queue_.push_front(c);
  }
}

std::vector<int64_t> Engine::Impl::UpdateOrder(const std::vector<int64_t>& trace) const {
  std::vector<int64_t> order;
  std::vector<bool> seen(chunks_.size(), false);
  auto add = [&](int64_t u) {
    for (int64_t c : units_[u].chunks)
      if (!seen[c]) {
        seen[c] = true;
        order.push_back(c);
      }
  };
  for (size_t u = 0; u < units_.size(); ++u)
    if (units_[u].always_live) add(static_cast<int64_t>(u));
  for (size_t c = 0; c < chunks_.size(); ++c)
    if (stage3() && persistent_[c] && !seen[c]) {
      seen[c] = true;
      order.push_back(static_cast<int64_t>(c));
    }
  for (int64_t u : trace) add(u);
  for (size_t c = 0; c < chunks_.size(); ++c)
    if (!seen[c]) order.push_back(static_cast<int64_t>(c));
  return order;
}

void Engine::Impl::PrefetchStatesForUpdates() {
  if (optim_placement_ != Placement::kNvme) return;
  if (state_prefetch_next_ < state_prefetch_order_.size()) {
    const int64_t c = state_prefetch_order_[state_prefetch_next_];
    const uint64_t bytes = 3ull * partitioner_->chunks()[c].shard_numel * 4;
    if (state_prefetch_bytes_ + bytes <= host_budget_ / 2) {
      ++state_prefetch_next_;
      state_prefetch_bytes_ += bytes;
    }
  }
  // A prefetch that found no room without waiting only started a write-back: ask again for the
  // earlier chunks too (a no-op for blocks already read or on their way).
  for (size_t i = 0; i < state_prefetch_next_; ++i) {
    const int64_t c = state_prefetch_order_[i];
    store_->Prefetch(MasterKey(c));
    for (StateKind k : {StateKind::kExpAvg, StateKind::kExpAvgSq}) {
      if (HoldsState(k)) store_->Prefetch({c, k});
    }
  }
}

Status Engine::Impl::StartPublish(int64_t c, int slot, PublishLane::Copy* copy) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  *copy = {c, slot, stage3(), opt_step_, ci.shard_numel * optim::DTypeSize(compute_dtype_)};
  void* dst;
  if (copy->held) {
    auto got = store_->Acquire({c, StateKind::kParam16}, Access::kWrite);
    if (!got.ok()) {
      publish_->FreeSlot(slot);
      return got.status();
    }
    dst = *got;
  } else {
    dst = WorkingShard(c);
  }
  Status s = publish_->StartCopy(*copy, dst);
  if (!s.ok() && copy->held) store_->Release({c, StateKind::kParam16}, false).IgnoreError();
  return s;
}

// The block is released before the chunk counts as updated: a reader that waits for the update
// then finds the new values in the block (Note [pipelined publish]).
void Engine::Impl::OnPublished(const PublishLane::Copy& copy, Status s) {
  if (copy.held) {
    Status r = store_->Release({copy.chunk, StateKind::kParam16}, s.ok());
    if (s.ok()) s = r;
  }
  std::lock_guard<std::mutex> l(opt_mu_);
  if (!s.ok() && opt_error_.ok())
    opt_error_ = s.WithContext(StrCat("publishing chunk ", copy.chunk, "'s new values"));
  update_pending_[copy.chunk] = 0;
  --opt_busy_;
  opt_cv_.notify_all();
}

// Stages 1-2: every rank updated its shard of the replicated working copy; share them.
Status Engine::Impl::ShareUpdatedShards() {
  if (stage3() || shard_world() < 2) return Status::Ok();
  const size_t esize = optim::DTypeSize(compute_dtype_);
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const ChunkInfo& ci = partitioner_->chunks()[c];
    char* full = static_cast<char*>(chunks_[c].full.data_ptr());
    STRATA_RETURN_IF_ERROR(comm_->AllGather(
        full + partitioner_->ShardOffset(static_cast<int64_t>(c), shard_rank()) * esize, full,
        ci.shard_numel, CommDtype(compute_dtype_)));
  }
  return Status::Ok();
}

void Engine::Impl::ResetLanes() {
  window_open_ = true;
  step_start_ = Clock::now();
  compute_s_ = copy_s_ = comm_s_ = stall_s_ = waits_in_compute_s_ = update_wait_s_ = 0;
  bytes_h2d_ = bytes_d2h_ = 0;
  stash_->TakeBytesStashed();  // the window starts from zero
  store_at_step_start_ = store_->stats();
  {
    std::lock_guard<std::mutex> l(gather_mu_);
    gather_copy_s_ = gather_read_s_ = 0;
    gather_h2d_ = 0;
  }
  {
    std::lock_guard<std::mutex> l(reduce_mu_);
    reduce_comm_s_ = reduce_copy_s_ = 0;
    reduce_d2h_ = 0;
  }
  std::lock_guard<std::mutex> l(opt_mu_);
  opt_s_ = 0;
  if (publish_) publish_->ResetStats();
}

StatusOr<StepReport> Engine::Impl::Step() {
  STRATA_RETURN_IF_ERROR(CheckStatesResident("Step"));
  if (micro_step_ == 0 || micro_step_ % config_.gradient_accumulation_steps != 0)
    return FailedPrecondition(StrCat("Step after ", micro_step_ % config_.gradient_accumulation_steps,
                                     " of ", config_.gradient_accumulation_steps,
                                     " micro-steps; run Forward/Backward until the accumulation "
                                     "boundary"));
  StepReport rep;
  rep.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  bool overflow = false;
  // The previous step's updates (deferred ones, or those that started in backward) have all
  // been waited for by now (this step's forward and reductions needed them); a failure among
  // them surfaces here. Copies gathered ahead land before any update may write their blocks.
  STRATA_RETURN_IF_ERROR(FinishUpdates());
  // Global conditions first: the squared norm and the overflow flag over every shard, from the
  // per-chunk parts the reductions computed, summed in chunk order.
  double sum_sq = 0;
  bool nonfinite = false;
  for (size_t c = 0; c < chunks_.size(); ++c) {
    nonfinite |= chunk_nonfinite_[c] != 0;
    sum_sq += chunk_sum_sq_[c];
  }
  if (comm_->world_size() > 1 && config_.zero_optimization.stage > 0) {
    LaneTimer t(&comm_s_, &lane_trace_, Lane::kComm, "norm all-reduce", trace_step());
    torch::Tensor flags = torch::tensor({sum_sq, nonfinite ? 1.0 : 0.0}, torch::kFloat64);
    STRATA_RETURN_IF_ERROR(OnCommMemory(flags, [&](void* p) {
      auto* f = static_cast<double*>(p);
      Status s = comm_->AllReduce(f, 1, strata::DType::kF64, ReduceOp::kSum);
      return s.ok() ? comm_->AllReduce(f + 1, 1, strata::DType::kF64, ReduceOp::kMax) : s;
    }));
    sum_sq = flags[0].item<double>();
    nonfinite = flags[1].item<double>() > 0;
  }
  const double norm = std::sqrt(sum_sq);
  if (immediate_optimizer()) {
    rep.lr = opt_lr_;
    rep.grad_norm = norm;  // reported only: nothing waits on it
  } else {
    overflow = nonfinite;
    rep.grad_norm = overflow ? 0.0 : norm;
    if (!overflow) {
      double clip = 1.0;
      if (config_.gradient_clipping > 0)
        clip = std::min(1.0, config_.gradient_clipping / (norm + 1e-6));
      const double inv = scaler_ ? scaler_->inv_scale() : 1.0;
      opt_grad_scale_ = static_cast<float>(clip * inv);
      opt_step_ = global_step_ + 1;
      FixStepHyperparameters();
      rep.lr = opt_lr_;
      if (defer_updates()) {
        // The next iteration starts with these updates (see iteration_open_).
        if (iteration_open_) store_->EndIteration();
        store_->BeginIteration();
        iteration_open_ = true;
      }
      for (int64_t c : UpdateOrder(last_trace_)) EnqueueOptimizer(c);
      if (!defer_updates()) STRATA_RETURN_IF_ERROR(DrainOptimizer());
    }
  }
  if (scaler_) STRATA_RETURN_IF_ERROR(scaler_->Update(overflow));
  if (!overflow) {
    ++global_step_;
    if (!stage3() && shard_world() > 1) {
      LaneTimer t(&comm_s_, &lane_trace_, Lane::kComm, "share updated shards", global_step_);
      STRATA_RETURN_IF_ERROR(ShareUpdatedShards());
    }
  }
  std::fill(chunk_ready_.begin(), chunk_ready_.end(), false);
  if (!overflow) STRATA_RETURN_IF_ERROR(RefreshChunksAfterStep());  // the working copy changed
  if (iteration_open_ && !(defer_updates() && !overflow)) {
    store_->EndIteration();
    iteration_open_ = false;
  }

  rep.step = global_step_;
  rep.skipped = overflow;
  rep.step_time_s = Since(step_start_);
  rep.compute_s = std::max(0.0, compute_s_ - waits_in_compute_s_);
  rep.copy_s = copy_s_;
  rep.comm_s = comm_s_;
  {
    std::lock_guard<std::mutex> l(gather_mu_);
    rep.copy_s += gather_copy_s_;
    bytes_h2d_ += gather_h2d_;
  }
  {
    std::lock_guard<std::mutex> l(reduce_mu_);  // the reduce lane is idle: Backward drained it
    rep.comm_s += reduce_comm_s_;
    rep.copy_s += reduce_copy_s_;
    bytes_d2h_ += reduce_d2h_;
  }
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    rep.optimizer_s = opt_s_;
    if (publish_) {  // idle too: every submitted copy was done before opt_busy_ reached 0
      rep.copy_s += publish_->copy_seconds();
      bytes_h2d_ += publish_->bytes_to_device();
    }
  }
  BlockStoreStats now = store_->stats();
  rep.nvme_s = now.nvme_busy_s - store_at_step_start_.nvme_busy_s;
  rep.stall_s = stall_s_;  // the compute lane's waits; the optimizer lane's are in optimizer_s
  rep.update_wait_s = update_wait_s_;
  rep.bytes_host_to_device = bytes_h2d_;
  rep.bytes_device_to_host = bytes_d2h_;
  rep.bytes_nvme_to_host = now.bytes_nvme_to_host - store_at_step_start_.bytes_nvme_to_host;
  rep.bytes_host_to_nvme = now.bytes_host_to_nvme - store_at_step_start_.bytes_host_to_nvme;
  rep.peak_device_bytes = device_->peak_allocated();
  rep.peak_host_bytes = now.peak_bytes_host;
  rep.bytes_activations_stashed = stash_->TakeBytesStashed();
  rep.FillOverlap();
  step_open_ = false;
  ResetLanes();  // the next window starts now: deferred updates run in it
  return rep;
}

}  // namespace strata
