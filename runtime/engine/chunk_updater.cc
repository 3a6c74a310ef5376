// ChunkUpdater (chunk_updater.h): one chunk's update, split along its phases: the states
// acquired, the output chosen, the optimizer run per parameter-group segment on the device or the
// host, the blocks released and the new values published.
#include "runtime/engine/chunk_updater.h"

#include <cstring>
#include <utility>
#include <vector>

#include "kernels/kernels.h"
#include "runtime/engine/optimizer_segment.h"
#include "runtime/base/check.h"

namespace strata {

namespace {

// SGD, Adagrad or Lion over an Adam segment's buffers (fp32 states; other formats go through
// RunCompact): SGD's momentum buffer and Lion's momentum live in exp_avg, Adagrad's sum in
// exp_avg_sq. kCpu runs in the caller's current arena; kCuda enqueues on `stream`.
Status RunElementwise(OptimizerType type, const Segment& sg, float grad_scale,
                      kernels::Backend backend, void* stream) {
  const optim::AdamBuffers& b = sg.bufs;
  const auto* grad = static_cast<const float*>(b.grad);
  auto* exp_avg = static_cast<float*>(b.exp_avg);
  switch (type) {
    case OptimizerType::kSGD:
      return kernels::SgdStep(backend, sg.sp,
                              {b.master, grad, exp_avg, b.param16, b.param16_dtype, b.n},
                              grad_scale, stream);
    case OptimizerType::kAdagrad:
      return kernels::AdagradStep(backend, sg.gp,
                                  {b.master, grad, static_cast<float*>(b.exp_avg_sq), b.param16,
                                   b.param16_dtype, b.n},
                                  grad_scale, stream);
    case OptimizerType::kLion:
      return kernels::LionStep(backend, sg.lp,
                               {b.master, grad, exp_avg, b.param16, b.param16_dtype, b.n},
                               grad_scale, stream);
    case OptimizerType::kAdam:
    case OptimizerType::kAdamW:
      break;
  }
  return Internal(StrCat("RunElementwise called for ", OptimizerTypeName(type)));
}


}  // namespace


StatusOr<std::unique_ptr<ChunkUpdater>> ChunkUpdater::Create(Parts parts) {
  std::unique_ptr<ChunkUpdater> u(new ChunkUpdater(std::move(parts)));
  // A host optimizer's new values for device-resident parameters go through the staging slots.
  // Sized once, here: growing them later would free and allocate page-locked memory, which on a
  // GPU waits for the device.
  if (u->p_.plan->any_staged_publish()) {
    int64_t most = 0;
    const auto& chunks = u->p_.partitioner->chunks();
    for (size_t c = 0; c < chunks.size(); ++c)
      if (u->p_.plan->StagedPublish(static_cast<int64_t>(c))) most = std::max(most, chunks[c].shard_numel);
    ChunkUpdater* self = u.get();
    u->publish_ = std::make_unique<PublishLane>(
        u->p_.device, u->p_.streams->publish.get(), u->p_.trace,
        [self](const PublishLane::Copy& copy, Status s) { self->OnPublished(copy, std::move(s)); });
    STRATA_RETURN_IF_ERROR(u->publish_->Reserve(most * optim::DTypeSize(u->p_.plan->compute_dtype())));
  }
  if (u->p_.plan->compact_optimizer()) {
    uint64_t at = 0;
    for (int64_t pid = 0; pid < u->p_.partitioner->num_params(); ++pid) {
      u->model_offset_.push_back(at);
      at += static_cast<uint64_t>(u->p_.partitioner->location(pid).numel);
    }
    u->rounding_seed_ = u->p_.rounding_seed;
  }
  return u;
}

void* ChunkUpdater::WorkingShard(int64_t c) const {
  return static_cast<char*>((*p_.chunks)[c].full.data_ptr()) +
         p_.partitioner->ShardOffset(c, p_.plan->shard_rank()) * optim::DTypeSize(p_.plan->compute_dtype());
}

Status ChunkUpdater::Update(int64_t c, const OptimizerLane::StepInputs& in,
                            std::optional<PublishLane::Copy>* publish, double* slot_wait_s) {
  publish->reset();
  Held held;
  STRATA_RETURN_IF_ERROR(AcquireStates(c, &held));
  Status s = ChooseOutput(c, in.step, &held, slot_wait_s);
  if (s.ok()) {
    const int64_t n = p_.partitioner->chunks()[c].shard_numel;
    if (p_.plan->compact_optimizer() && !p_.plan->DeviceOptimizer(c)) {
      p_.streams->arena->execute([&] { s = RunCompact(in, held, n, kernels::Backend::kCpu, nullptr); });
      if (s.ok() && CompactCopiesMaster(held))
        std::memcpy(held.out, held.ptrs[0], n * optim::DTypeSize(p_.plan->compute_dtype()));
    } else {
      s = p_.plan->DeviceOptimizer(c) ? RunOnDevice(in, held, n) : RunOnHost(in, held, n);
    }
  }
  return Finish(c, in.step, std::move(s), &held, publish);
}

// A failed acquire (an I/O error reading a state back) releases what was already pinned: the
// error must leave the tier manager consistent for the caller to report it and shut down.
// States the optimizer does not keep (HoldsState) have no block: their pointer stays null.
Status ChunkUpdater::AcquireStates(int64_t c, Held* h) {
  h->keys[0] = p_.plan->MasterKey(c);
  h->keys[1] = {c, StateKind::kExpAvg};
  h->keys[2] = {c, StateKind::kExpAvgSq};
  h->keys[3] = {c, StateKind::kGrad};
  const Access access[4] = {Access::kReadWrite, Access::kReadWrite, Access::kReadWrite, Access::kRead};
  for (int i = 0; i < 4; ++i) {
    if (!p_.plan->HoldsState(h->keys[i].kind)) continue;
    auto got = p_.store->Acquire(h->keys[i], access[i]);
    if (!got.ok()) {
      for (const BlockKey& k : h->held) p_.store->Release(k, false).IgnoreError();
      return got.status().WithContext(StrCat("optimizer step of chunk ", c));
    }
    h->held.push_back(h->keys[i]);
    // A device-placed state is reached at its compute address (Note [device blocks]): only the
    // device's own compute touches it (device_optimizer below).
    h->ptrs[i] = p_.device->ComputeAddress(*got);
  }
  return Status::Ok();
}

// The new working copy goes straight into its home when the optimizer can address it: host
// memory, or device memory when the optimizer is the device's own compute. A host optimizer
// never writes device memory, on the CPU device either (Note [strict device memory]): its values
// go to a staging slot and a copy takes them over (Note [pipelined publish]), the path a GPU
// takes.
Status ChunkUpdater::ChooseOutput(int64_t c, int64_t step, Held* h, double* slot_wait_s) {
  const StepPlan& plan = *p_.plan;
  if (plan.MasterIsParam(c)) {
    h->out = h->ptrs[0];  // Note [shared master]: the update writes the working shard in place
  } else if (plan.stage3()) {
    if (plan.ParamPlacement(c) != Placement::kDevice || plan.DeviceOptimizer(c)) {
      auto got = p_.store->Acquire({c, StateKind::kParam16}, Access::kWrite);
      if (!got.ok()) return got.status();
      h->out = p_.device->ComputeAddress(*got);
      h->param_block_held = true;
    }
  } else if (plan.DeviceOptimizer(c)) {
    h->out = WorkingShard(c);
  }
  if (!h->out) {
    STRATA_DCHECK(plan.StagedPublish(c), "chunk ", c, ": new values need the staging slots");
    h->slot = publish_->AcquireSlot(step, slot_wait_s);
    h->out = publish_->SlotData(h->slot);
  }
  return Status::Ok();
}

namespace {
// One optimizer call per run of one parameter group (param_groups.h); one group: one call.
std::vector<Segment> Segments(const OptimizerConfig& oc, const StepPlan& plan,
                              const std::vector<ShardSegment>& runs,
                              const OptimizerLane::StepInputs& in, void* const ptrs[4], void* out) {
  std::vector<Segment> segments;
  const size_t state_size = optim::DTypeSize(plan.state_dtype());
  const size_t work_size = optim::DTypeSize(plan.compute_dtype());
  for (const ShardSegment& seg : runs) {
    Segment sg = MakeSegment(oc, in.groups[seg.group], in.optimizer_step);
    sg.bufs.master = static_cast<float*>(ptrs[0]) + seg.begin;
    sg.bufs.grad = static_cast<char*>(ptrs[3]) + seg.begin * 4;
    sg.bufs.grad_dtype = optim::DType::kFloat32;
    sg.bufs.exp_avg = ptrs[1] ? static_cast<char*>(ptrs[1]) + seg.begin * state_size : nullptr;
    sg.bufs.exp_avg_sq = ptrs[2] ? static_cast<char*>(ptrs[2]) + seg.begin * state_size : nullptr;
    sg.bufs.state_dtype = plan.state_dtype();
    sg.bufs.n = static_cast<size_t>(seg.size);
    if (plan.compute_dtype() != optim::DType::kFloat32) {
      sg.bufs.param16 = static_cast<char*>(out) + seg.begin * work_size;
      sg.bufs.param16_dtype = plan.compute_dtype();
    }
    segments.push_back(sg);
  }
  return segments;
}
}  // namespace

// Device compute on the optimizer's stream (Stream::LaunchKernel): the GPU kernels (the same IEEE
// operations as the CPU's), or on the CPU device the CPU kernels run by the stream's worker in
// the optimizer's arena. Either way this thread goes on at once and the one wait below covers the
// update and the copy into the working shard queued behind it; the blocks stay pinned until then.
// The gradient's hand-off already waited for the compute that wrote it.
Status ChunkUpdater::RunOnDevice(const OptimizerLane::StepInputs& in, const Held& h, int64_t n) {
  if (p_.plan->compact_optimizer()) {
    const bool cuda = p_.device->kind() == DeviceKind::kCuda;
    Stream* stream = p_.streams->publish.get();
    tbb::task_arena* arena = p_.streams->arena.get();
    Status s = stream->LaunchKernel([this, &in, &h, n, arena, cuda](void* native) {
      if (cuda) return RunCompact(in, h, n, kernels::Backend::kCuda, native);
      Status r;
      arena->execute([&] { r = RunCompact(in, h, n, kernels::Backend::kCpu, nullptr); });
      return r;
    });
    if (s.ok() && CompactCopiesMaster(h))
      s = stream->MemcpyAsync(h.out, h.ptrs[0], n * optim::DTypeSize(p_.plan->compute_dtype()),
                              CopyKind::kDeviceToDevice);
    Status w = stream->Synchronize();
    return s.ok() ? w : s;
  }
  const int64_t c = h.keys[0].chunk;
  std::vector<Segment> segments = Segments(*p_.optimizer, *p_.plan, p_.groups->segments[c], in, h.ptrs, h.out);
  const OptimizerType type = p_.optimizer->type;
  const bool adam = IsAdam(type), cuda = p_.device->kind() == DeviceKind::kCuda;
  const float grad_scale = in.grad_scale;
  tbb::task_arena* arena = p_.streams->arena.get();
  Stream* stream = p_.streams->publish.get();
  Status s = stream->LaunchKernel([cuda, arena, segments, grad_scale, adam, type](void* native) {
    const kernels::Backend backend = cuda ? kernels::Backend::kCuda : kernels::Backend::kCpu;
    Status r;
    for (const Segment& sg : segments) {
      auto run = [&] {
        r = adam ? kernels::AdamStep(backend, sg.ap, sg.bufs, grad_scale, nullptr, native)
                 : RunElementwise(type, sg, grad_scale, backend, native);
      };
      if (cuda) {
        run();
      } else {
        arena->execute(run);
      }
      if (!r.ok()) break;
    }
    return r;
  });
  if (s.ok() && p_.plan->compute_dtype() == optim::DType::kFloat32 && h.out != h.ptrs[0])
    s = stream->MemcpyAsync(h.out, h.ptrs[0], n * 4, CopyKind::kDeviceToDevice);
  Status w = stream->Synchronize();
  return s.ok() ? w : s;
}

Status ChunkUpdater::RunOnHost(const OptimizerLane::StepInputs& in, const Held& h, int64_t n) {
  const int64_t c = h.keys[0].chunk;
  const std::vector<Segment> segments =
      Segments(*p_.optimizer, *p_.plan, p_.groups->segments[c], in, h.ptrs, h.out);
  const OptimizerType type = p_.optimizer->type;
  const bool adam = IsAdam(type);
  optim::AdamOptions ao;
  ao.arena = p_.streams->arena.get();
  ao.grad_check = optim::GradCheck::kCallerChecked;
  Status s;
  for (const Segment& sg : segments) {
    if (adam) {
      s = optim::AdamStep(sg.ap, sg.bufs, in.grad_scale, ao).status();
    } else {
      p_.streams->arena->execute(
          [&] { s = RunElementwise(type, sg, in.grad_scale, kernels::Backend::kCpu, nullptr); });
    }
    if (!s.ok()) break;
  }
  if (s.ok() && p_.plan->compute_dtype() == optim::DType::kFloat32 && h.out != h.ptrs[0])
    std::memcpy(h.out, h.ptrs[0], n * 4);
  return s;
}

Status ChunkUpdater::Finish(int64_t c, int64_t step, Status s, Held* h,
                            std::optional<PublishLane::Copy>* publish) {
  const bool updated = s.ok();
  const BlockKey kg{c, StateKind::kGrad};
  for (const BlockKey& k : h->held) {
    Status rs = p_.store->Release(k, updated && !(k == kg));  // the gradient is only read
    if (s.ok()) s = rs;
  }
  if (h->param_block_held) {
    Status ps = p_.store->Release({c, StateKind::kParam16}, updated);
    if (s.ok()) s = ps;
  }
  if (!s.ok()) {
    if (h->slot >= 0) publish_->FreeSlot(h->slot);
    return s.WithContext(StrCat("optimizer step of chunk ", c));
  }
  if (h->slot >= 0) {
    PublishLane::Copy copy;
    STRATA_RETURN_IF_ERROR(StartPublish(c, h->slot, step, &copy)
                               .WithContext(StrCat("publishing chunk ", c, "'s new values")));
    *publish = copy;
  }
  return Status::Ok();
}

Status ChunkUpdater::StartPublish(int64_t c, int slot, int64_t step, PublishLane::Copy* copy) {
  const ChunkInfo& ci = p_.partitioner->chunks()[c];
  *copy = {c, slot, p_.plan->stage3(), step, ci.shard_numel * optim::DTypeSize(p_.plan->compute_dtype())};
  void* dst;
  if (copy->held) {
    auto got = p_.store->Acquire({c, StateKind::kParam16}, Access::kWrite);
    if (!got.ok()) {
      publish_->FreeSlot(slot);
      return got.status();
    }
    dst = *got;
  } else {
    dst = WorkingShard(c);
  }
  Status s = publish_->StartCopy(*copy, dst);
  if (!s.ok() && copy->held) p_.store->Release({c, StateKind::kParam16}, false).IgnoreError();
  return s;
}

// The block is released before the chunk counts as updated: a reader that waits for the update
// then finds the new values in the block (Note [pipelined publish]).
void ChunkUpdater::OnPublished(const PublishLane::Copy& copy, Status s) {
  if (copy.held) {
    Status r = p_.store->Release({copy.chunk, StateKind::kParam16}, s.ok());
    if (s.ok()) s = r;
  }
  p_.finished(copy.chunk, std::move(s));
}

Status ChunkUpdater::PublishParams(int64_t c, const void* shard_values, optim::DType dtype) {
  const ChunkInfo& ci = p_.partitioner->chunks()[c];
  const size_t bytes = ci.shard_numel * optim::DTypeSize(dtype);
  void* dst;
  bool held = false;
  if (p_.plan->stage3()) {
    STRATA_ASSIGN_OR_RETURN(dst, p_.store->Acquire({c, StateKind::kParam16}, Access::kWrite));
    held = true;
  } else {
    dst = WorkingShard(c);
  }
  if (held && p_.plan->ParamPlacement(c) != Placement::kDevice) {  // a host buffer: no device copy
    std::memcpy(dst, shard_values, bytes);
    return p_.store->Release({c, StateKind::kParam16}, true);
  }
  Stream* stream = p_.streams->publish.get();
  Status s = stream->MemcpyAsync(dst, shard_values, bytes, CopyKind::kHostToDevice);
  if (s.ok()) s = stream->Synchronize();
  if (held) {
    Status r = p_.store->Release({c, StateKind::kParam16}, true);
    if (s.ok()) s = r;
  }
  return s;
}

}  // namespace strata
