// A client optimizer's step (EngineOptions::client_optimizer, DeepSpeed's
// zero_allow_untested_optimizer): the engine reduces the gradients, takes the global norm and
// the overflow check as for its own optimizers, and hands this rank's fp32 master and gradient
// shards to the caller, whose optimizer updates the master in place on the device; the new values
// then go to the working copy and, at stages 1-2, to the other ranks (ShareUpdatedShards).
//
// Why only stages 0-2 without offload: there every block stays in device memory at a fixed
// address for the engine's life, so the shards can be lent as plain device tensors for the
// length of the step. A caller's optimizer keeps its own state (torch allocations, outside the
// device budget the engine accounts); the engine keeps no moments.
#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

void ClientStepSession::Open(double norm, bool skipped, size_t chunks) {
  open_ = true;
  skipped_ = skipped;
  norm_ = norm;
  masters_.assign(chunks, torch::Tensor());
}

StatusOr<torch::Tensor> ClientStepSession::Lend(const BlockKey& key, int64_t numel) {
  STRATA_ASSIGN_OR_RETURN(void* p, store_->Acquire(key, Access::kReadWrite));
  held_.push_back(key);
  return torch::from_blob(device_->ComputeAddress(p), {numel}, fp32_);
}

Status ClientStepSession::Close() {
  Status s;
  for (const BlockKey& key : held_) {
    Status r = store_->Release(key, /*dirty=*/true);
    if (s.ok()) s = r;
  }
  held_.clear();
  masters_.clear();
  open_ = false;
  return s;
}

std::vector<std::vector<int64_t>> Engine::Impl::ClientSegments() const {
  std::vector<std::vector<int64_t>> out(groups_.hyper.size());
  for (size_t c = 0; c < chunks_.size(); ++c)
    for (const ShardSegment& seg : groups_.segments[c]) out[seg.group].push_back(seg.size);
  return out;
}

StatusOr<Engine::ClientStep> Engine::Impl::BeginClientStep() {
  if (!plan_.client_optimizer())
    return FailedPrecondition("BeginClientStep: the engine runs its own optimizer (make it with "
                              "EngineOptions::client_optimizer for a client optimizer); call Step");
  if (client_->open())
    return FailedPrecondition("BeginClientStep twice: finish the open step with FinishClientStep");
  STRATA_RETURN_IF_ERROR(CheckStepBoundary());
  STRATA_RETURN_IF_ERROR(FinishUpdates());  // nothing is queued: the lanes are quiet
  Engine::ClientStep out;
  bool nonfinite = false;
  double norm = 0;
  STRATA_RETURN_IF_ERROR(GlobalGradStats(&norm, &nonfinite));
  client_->Open(norm, nonfinite, chunks_.size());
  out.skipped = nonfinite;
  out.grad_norm = nonfinite ? 0.0 : norm;
  if (nonfinite) return out;
  out.grad_scale = GradScale(norm);
  out.groups.resize(groups_.hyper.size());
  torch::NoGradGuard ng;
  auto lend = [&](int64_t c, StateKind kind) {
    const BlockKey key = kind == StateKind::kMaster32 ? plan_.MasterKey(c) : BlockKey{c, kind};
    return client_->Lend(key, partitioner_->chunks()[c].shard_numel);
  };
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const auto c64 = static_cast<int64_t>(c);
    auto master = lend(c64, StateKind::kMaster32);
    auto grad = master.ok() ? lend(c64, StateKind::kGrad) : master;
    if (!grad.ok()) {
      FinishClientStep(/*apply=*/false).status().IgnoreError();  // releases what was lent
      return grad.status().WithContext(StrCat("lending chunk ", c, "'s shards to the optimizer"));
    }
    if (out.grad_scale != 1.0f) grad->mul_(out.grad_scale);
    client_->SetMaster(c, *master);
    for (const ShardSegment& seg : groups_.segments[c])
      out.groups[seg.group].push_back(
          {master->narrow(0, seg.begin, seg.size), grad->narrow(0, seg.begin, seg.size)});
  }
  return out;
}

StatusOr<StepReport> Engine::Impl::FinishClientStep(bool apply) {
  if (!client_->open())
    return FailedPrecondition("FinishClientStep without BeginClientStep");
  Status s;
  const bool skipped = client_->skipped();
  const double norm = client_->norm();
  if (apply && !skipped) {
    // The working copy (this rank's shard of it) takes the new master values, in the compute
    // dtype; at stages 1-2 CompleteStep shares the shards.
    torch::NoGradGuard ng;
    try {
      for (size_t c = 0; c < chunks_.size(); ++c) {
        const auto c64 = static_cast<int64_t>(c);
        chunks_[c64]
            .full.narrow(0, partitioner_->ShardOffset(c64, plan_.shard_rank()),
                         partitioner_->chunks()[c].shard_numel)
            .copy_(client_->master(c));
      }
      ComputeFence::Mark(*device_).Wait();  // landed before the blocks go back
    } catch (const std::exception& e) {
      s = Internal(StrCat("writing the client optimizer's values to the working copy: ", e.what()));
    }
  }
  Status r = client_->Close();
  if (s.ok()) s = r;
  STRATA_RETURN_IF_ERROR(s);
  if (!apply) return StepReport{};
  StepReport rep;
  rep.loss_scale = step_.scaler ? step_.scaler->scale() : 1.0;
  rep.grad_norm = skipped ? 0.0 : norm;
  // The lr the caller's groups held (SetGroupHyperparameters), else the config's schedule.
  rep.lr = groups_.override_hyper
               ? groups_.override_hyper->front().lr
               : GroupLearningRate(config_, step_.global_step + 1, groups_.hyper.front().lr);
  return CompleteStep(rep, skipped);
}

}  // namespace strata
