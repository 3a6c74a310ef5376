// Optimizer lane: the optimizer thread, Adam per chunk, publishing new values, Step.
#include "runtime/engine_impl.h"

namespace strata {

using namespace engine_detail;

// ---------------------------------------------------------------------------------------------
// Optimizer.

void Engine::Impl::StartOptimizerLane() {
  opt_thread_ = std::thread([this] {
    std::unique_lock<std::mutex> l(opt_mu_);
    for (;;) {
      opt_cv_.wait(l, [&] { return opt_stop_ || !opt_queue_.empty(); });
      if (opt_queue_.empty()) return;
      int64_t c = opt_queue_.front();
      opt_queue_.pop_front();
      ++opt_busy_;
      bool failed = !opt_error_.ok();
      l.unlock();
      auto t0 = Clock::now();
      Status s = failed ? Status::Ok() : AdamChunk(c, opt_grad_scale_, opt_lr_, opt_step_);
      double dt = Since(t0);
      l.lock();
      opt_s_ += dt;
      if (!s.ok() && opt_error_.ok()) opt_error_ = s;
      --opt_busy_;
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
  // Start reading the chunk's states now; the lane picks it up in order.
  for (StateKind k : {StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq})
    store_->Prefetch({c, k});
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    opt_queue_.push_back(c);
  }
  opt_cv_.notify_all();
}

Status Engine::Impl::DrainOptimizer() {
  std::unique_lock<std::mutex> l(opt_mu_);
  opt_cv_.wait(l, [&] { return opt_queue_.empty() && opt_busy_ == 0; });
  Status s = opt_error_;
  opt_error_ = Status::Ok();
  return s;
}

Status Engine::Impl::AdamChunk(int64_t c, float grad_scale, double lr, int64_t step) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const int64_t n = ci.shard_numel;
  const auto& oc = config_.optimizer;
  BlockKey km{c, StateKind::kMaster32}, ka{c, StateKind::kExpAvg}, kv{c, StateKind::kExpAvgSq},
      kg{c, StateKind::kGrad};
  // A failed acquire (an I/O error reading a state back) releases what was already pinned: the
  // error must leave the tier manager consistent for the caller to report it and shut down.
  void* ptrs[4] = {};
  const std::pair<BlockKey, Access> wants[4] = {
      {km, Access::kReadWrite}, {ka, Access::kReadWrite}, {kv, Access::kReadWrite}, {kg, Access::kRead}};
  for (int i = 0; i < 4; ++i) {
    auto got = store_->Acquire(wants[i].first, wants[i].second);
    if (!got.ok()) {
      for (int j = 0; j < i; ++j) store_->Release(wants[j].first, false).IgnoreError();
      return got.status().WithContext(StrCat("optimizer step of chunk ", c));
    }
    ptrs[i] = *got;
  }
  void* master = ptrs[0];
  void* m = ptrs[1];
  void* v = ptrs[2];
  void* g = ptrs[3];
  // The new working copy goes straight into its home when the CPU can address it.
  const int stage = config_.zero_optimization.stage;
  const size_t esize = optim::DTypeSize(compute_dtype_);
  void* out = nullptr;
  BlockKey kp{c, StateKind::kParam16};
  std::vector<char> staging;
  bool param_block_held = false;
  if (stage == 3) {
    if (param_placement_ != Placement::kDevice || device_->kind() == DeviceKind::kCpu) {
      auto got = store_->Acquire(kp, Access::kWrite);
      if (!got.ok()) {
        for (const auto& w : wants) store_->Release(w.first, false).IgnoreError();
        return got.status().WithContext(StrCat("optimizer step of chunk ", c));
      }
      out = *got;
      param_block_held = true;
    }
  } else if (device_->kind() == DeviceKind::kCpu) {
    out = static_cast<char*>(chunks_[c].full.data_ptr()) +
          partitioner_->ShardOffset(c, shard_rank()) * esize;
  }
  if (!out) {
    staging.resize(n * esize);
    out = staging.data();
  }

  optim::AdamParams ap;
  ap.lr = lr;
  ap.beta1 = oc.beta1;
  ap.beta2 = oc.beta2;
  ap.eps = oc.eps;
  ap.weight_decay = oc.weight_decay;
  ap.adamw = oc.type == OptimizerType::kAdamW;
  ap.bias_correction = oc.bias_correction;
  ap.step = step;
  optim::AdamBuffers bufs;
  bufs.master = static_cast<float*>(master);
  bufs.grad = g;
  bufs.grad_dtype = optim::DType::kFloat32;
  bufs.exp_avg = m;
  bufs.exp_avg_sq = v;
  bufs.state_dtype = state_dtype_;
  bufs.n = static_cast<size_t>(n);
  if (compute_dtype_ != optim::DType::kFloat32) {
    bufs.param16 = out;
    bufs.param16_dtype = compute_dtype_;
  }
  optim::AdamOptions ao;
  ao.arena = arena_.get();
  ao.grad_check = optim::GradCheck::kCallerChecked;
  auto r = optim::AdamStep(ap, bufs, grad_scale, ao);
  if (r.ok() && compute_dtype_ == optim::DType::kFloat32) std::memcpy(out, master, n * 4);

  Status s = r.status();
  for (const BlockKey& k : {km, ka, kv}) {
    Status rs = store_->Release(k, r.ok());
    if (s.ok()) s = rs;
  }
  Status gs = store_->Release(kg, false);
  if (s.ok()) s = gs;
  if (param_block_held) {
    Status ps = store_->Release(kp, r.ok());
    if (s.ok()) s = ps;
  }
  if (!s.ok()) return s.WithContext(StrCat("optimizer step of chunk ", c));
  if (!staging.empty()) return PublishParams(c, staging.data(), compute_dtype_);
  return Status::Ok();
}

// Copies a shard of new working values from host memory to where the device reads it.
Status Engine::Impl::PublishParams(int64_t c, const void* shard_values, optim::DType dtype) {
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const size_t bytes = ci.shard_numel * optim::DTypeSize(dtype);
  void* dst;
  bool held = false;
  if (config_.zero_optimization.stage == 3) {
    STRATA_ASSIGN_OR_RETURN(dst, store_->Acquire({c, StateKind::kParam16}, Access::kWrite));
    held = true;
  } else {
    dst = static_cast<char*>(chunks_[c].full.data_ptr()) +
          partitioner_->ShardOffset(c, shard_rank()) * optim::DTypeSize(dtype);
  }
  if (held && param_placement_ != Placement::kDevice) {  // a host buffer: no device copy
    std::memcpy(dst, shard_values, bytes);
    return store_->Release({c, StateKind::kParam16}, true);
  }
  // A dedicated stream: this runs on the optimizer lane, concurrently with compute.
  STRATA_ASSIGN_OR_RETURN(auto stream, device_->CreateStream());
  Status s = stream->MemcpyAsync(dst, shard_values, bytes, CopyKind::kHostToDevice);
  if (s.ok()) s = stream->Synchronize();
  if (held) {
    Status r = store_->Release({c, StateKind::kParam16}, true);
    if (s.ok()) s = r;
  }
  return s;
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

StatusOr<StepReport> Engine::Impl::Step() {
  if (micro_step_ == 0 || micro_step_ % config_.gradient_accumulation_steps != 0)
    return FailedPrecondition(StrCat("Step after ", micro_step_ % config_.gradient_accumulation_steps,
                                     " of ", config_.gradient_accumulation_steps,
                                     " micro-steps; run Forward/Backward until the accumulation "
                                     "boundary"));
  StepReport rep;
  rep.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  bool overflow = false;
  if (immediate_optimizer()) {
    STRATA_RETURN_IF_ERROR(DrainOptimizer());
    rep.lr = opt_lr_;
  } else {
    // Global conditions first: the squared norm and the overflow flag over every shard.
    double sum_sq = 0;
    bool nonfinite = false;
    const double inv = scaler_ ? scaler_->inv_scale() : 1.0;
    for (size_t c = 0; c < chunks_.size(); ++c) {
      const int64_t c64 = static_cast<int64_t>(c);
      auto t0 = Clock::now();
      STRATA_ASSIGN_OR_RETURN(void* g, store_->Acquire({c64, StateKind::kGrad}, Access::kRead));
      stall_s_ += Since(t0);
      auto st = optim::UnscaleCheckNorm(g, optim::DType::kFloat32,
                                        partitioner_->chunks()[c].shard_numel,
                                        static_cast<float>(inv));
      STRATA_RETURN_IF_ERROR(store_->Release({c64, StateKind::kGrad}, false));
      STRATA_RETURN_IF_ERROR(st.status());
      nonfinite |= st->found_nonfinite;
      sum_sq += st->sum_sq;
    }
    if (comm_->world_size() > 1 && config_.zero_optimization.stage > 0) {
      LaneTimer t(&comm_s_);
      double flags[2] = {sum_sq, nonfinite ? 1.0 : 0.0};
      STRATA_RETURN_IF_ERROR(comm_->AllReduce(&flags[0], 1, strata::DType::kF64, ReduceOp::kSum));
      STRATA_RETURN_IF_ERROR(comm_->AllReduce(&flags[1], 1, strata::DType::kF64, ReduceOp::kMax));
      sum_sq = flags[0];
      nonfinite = flags[1] > 0;
    }
    overflow = nonfinite;
    double norm = std::sqrt(sum_sq);
    rep.grad_norm = overflow ? 0.0 : norm;
    if (!overflow) {
      double clip = 1.0;
      if (config_.gradient_clipping > 0)
        clip = std::min(1.0, config_.gradient_clipping / (norm + 1e-6));
      opt_grad_scale_ = static_cast<float>(clip * inv);
      opt_step_ = global_step_ + 1;
      opt_lr_ = LearningRate(config_, opt_step_);
      rep.lr = opt_lr_;
      // Backward order is the order the states were last touched; update in it.
      for (int64_t c : ready_order_) EnqueueOptimizer(c);
      STRATA_RETURN_IF_ERROR(DrainOptimizer());
    }
  }
  if (scaler_) STRATA_RETURN_IF_ERROR(scaler_->Update(overflow));
  if (!overflow) {
    ++global_step_;
    LaneTimer t(&comm_s_);
    STRATA_RETURN_IF_ERROR(ShareUpdatedShards());
  }
  std::fill(chunk_ready_.begin(), chunk_ready_.end(), false);
  if (!overflow) STRATA_RETURN_IF_ERROR(RefreshChunksAfterStep());  // the working copy changed
  store_->EndIteration();

  rep.step = global_step_;
  rep.skipped = overflow;
  rep.step_time_s = Since(step_start_);
  rep.compute_s = std::max(0.0, compute_s_ - waits_in_compute_s_);
  rep.copy_s = copy_s_;
  rep.comm_s = comm_s_;
  {
    std::lock_guard<std::mutex> l(opt_mu_);
    rep.optimizer_s = opt_s_;
  }
  BlockStoreStats now = store_->stats();
  rep.nvme_s = now.nvme_busy_s - store_at_step_start_.nvme_busy_s;
  rep.stall_s = stall_s_;  // the compute lane's waits; the optimizer lane's are in optimizer_s
  rep.bytes_host_to_device = bytes_h2d_;
  rep.bytes_device_to_host = bytes_d2h_;
  rep.bytes_nvme_to_host = now.bytes_nvme_to_host - store_at_step_start_.bytes_nvme_to_host;
  rep.bytes_host_to_nvme = now.bytes_host_to_nvme - store_at_step_start_.bytes_host_to_nvme;
  rep.peak_device_bytes = device_->peak_allocated();
  rep.peak_host_bytes = now.peak_bytes_host;
  rep.bytes_activations_stashed = bytes_stashed_;
  double longest = std::max({rep.compute_s, rep.copy_s, rep.comm_s, rep.nvme_s, rep.optimizer_s});
  rep.overlap_efficiency = rep.step_time_s > 0 ? std::min(1.0, longest / rep.step_time_s) : 0;
  step_open_ = false;
  return rep;
}

}  // namespace strata
