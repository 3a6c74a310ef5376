// One chunk's update (the optimizer lane's unit of work): Adam/AdamW, SGD, Adagrad or Lion over
// this rank's shard of the chunk, as runs of one parameter group (param_groups.h), with the new
// working values written to their home or to a publish slot (publish_lane.h).
#include "kernels/kernels.h"
#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

namespace {

// One run of one parameter group inside a chunk, with each optimizer's view of its buffers.
struct Segment {
  optim::AdamParams ap;
  optim::AdamBuffers bufs;  // Adam's view; the element-wise optimizers take their states from it
  optim::SgdParams sp;
  optim::AdagradParams gp;
  optim::LionParams lp;
};

// SGD, Adagrad or Lion over an Adam segment's buffers (fp32 states: Init refuses bf16 ones for
// them): SGD's momentum buffer and Lion's momentum live in exp_avg, Adagrad's sum in
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

bool IsAdam(OptimizerType t) { return t == OptimizerType::kAdam || t == OptimizerType::kAdamW; }

}  // namespace

Status Engine::Impl::AdamChunk(int64_t c, const OptimizerLane::StepInputs& in,
                               std::optional<PublishLane::Copy>* publish, double* slot_wait_s) {
  publish->reset();
  const float grad_scale = in.grad_scale;
  const int64_t step = in.step;
  const ChunkInfo& ci = partitioner_->chunks()[c];
  const int64_t n = ci.shard_numel;
  const auto& oc = config_.optimizer;
  BlockKey km = plan_.MasterKey(c), ka{c, StateKind::kExpAvg}, kv{c, StateKind::kExpAvgSq},
      kg{c, StateKind::kGrad};
  // A failed acquire (an I/O error reading a state back) releases what was already pinned: the
  // error must leave the tier manager consistent for the caller to report it and shut down.
  // States the optimizer does not keep (HoldsState) have no block: their pointer stays null.
  void* ptrs[4] = {};
  const std::pair<BlockKey, Access> wants[4] = {
      {km, Access::kReadWrite}, {ka, Access::kReadWrite}, {kv, Access::kReadWrite}, {kg, Access::kRead}};
  std::vector<BlockKey> held;  // acquired, to release
  for (int i = 0; i < 4; ++i) {
    if (!plan_.HoldsState(wants[i].first.kind)) continue;
    auto got = store_->Acquire(wants[i].first, wants[i].second);
    if (!got.ok()) {
      for (const BlockKey& k : held) store_->Release(k, false).IgnoreError();
      return got.status().WithContext(StrCat("optimizer step of chunk ", c));
    }
    held.push_back(wants[i].first);
    // A device-placed state is reached at its compute address (Note [device blocks]): only the
    // device's own compute touches it (plan_.device_optimizer() below).
    ptrs[i] = device_->ComputeAddress(*got);
  }
  void* master = ptrs[0];
  void* m = ptrs[1];
  void* v = ptrs[2];
  void* g = ptrs[3];
  // The new working copy goes straight into its home when the optimizer can address it: host
  // memory, or device memory when the optimizer is the device's own compute. A host optimizer
  // never writes device memory, on the CPU device either (Note [strict device memory]): its
  // values go to a staging slot and a copy takes them over (Note [pipelined publish]), the path a
  // GPU takes.
  const int stage = config_.zero_optimization.stage;
  void* out = nullptr;
  BlockKey kp{c, StateKind::kParam16};
  int slot = -1;  // the staging slot taken
  bool param_block_held = false;
  if (plan_.master_is_param()) {
    out = master;  // Note [shared master]: the update writes the working shard in place
  } else if (stage == 3) {
    if (plan_.param_placement() != Placement::kDevice || plan_.device_optimizer()) {
      auto got = store_->Acquire(kp, Access::kWrite);
      if (!got.ok()) {
        for (const BlockKey& k : held) store_->Release(k, false).IgnoreError();
        return got.status().WithContext(StrCat("optimizer step of chunk ", c));
      }
      out = device_->ComputeAddress(*got);
      param_block_held = true;
    }
  } else if (plan_.device_optimizer()) {
    out = WorkingShard(c);
  }
  if (!out) {
    STRATA_DCHECK(plan_.staged_publish(), "chunk ", c, ": new values need the staging slots");
    slot = publish_->AcquireSlot(step, slot_wait_s);
    out = publish_->SlotData(slot);
  }

  // One optimizer call per run of one parameter group (param_groups.h); one group: one call.
  const OptimizerType type = oc.type;
  const bool adam = IsAdam(type);
  std::vector<Segment> segments;
  const size_t state_size = optim::DTypeSize(plan_.state_dtype());
  const size_t work_size = optim::DTypeSize(plan_.compute_dtype());
  for (const ShardSegment& seg : groups_.segments[c]) {
    const GroupHyperparameters& gh = in.groups[seg.group];
    Segment sg;
    sg.ap.lr = gh.lr;
    sg.ap.beta1 = gh.beta1;
    sg.ap.beta2 = gh.beta2;
    sg.ap.eps = gh.eps;
    sg.ap.weight_decay = gh.weight_decay;
    sg.ap.adamw = type == OptimizerType::kAdamW;
    sg.ap.bias_correction = oc.bias_correction;
    sg.ap.step = step;
    sg.sp.lr = gh.lr;
    sg.sp.momentum = gh.momentum;
    sg.sp.dampening = gh.dampening;
    sg.sp.weight_decay = gh.weight_decay;
    sg.sp.nesterov = oc.nesterov;
    sg.sp.first = step == 1;
    sg.gp.lr = gh.lr;
    sg.gp.lr_decay = oc.lr_decay;
    sg.gp.eps = gh.eps;
    sg.gp.weight_decay = gh.weight_decay;
    sg.gp.step = step;
    sg.lp.lr = gh.lr;
    sg.lp.beta1 = gh.beta1;
    sg.lp.beta2 = gh.beta2;
    sg.lp.weight_decay = gh.weight_decay;
    sg.bufs.master = static_cast<float*>(master) + seg.begin;
    sg.bufs.grad = static_cast<char*>(g) + seg.begin * 4;
    sg.bufs.grad_dtype = optim::DType::kFloat32;
    sg.bufs.exp_avg = m ? static_cast<char*>(m) + seg.begin * state_size : nullptr;
    sg.bufs.exp_avg_sq = v ? static_cast<char*>(v) + seg.begin * state_size : nullptr;
    sg.bufs.state_dtype = plan_.state_dtype();
    sg.bufs.n = static_cast<size_t>(seg.size);
    if (plan_.compute_dtype() != optim::DType::kFloat32) {
      sg.bufs.param16 = static_cast<char*>(out) + seg.begin * work_size;
      sg.bufs.param16_dtype = plan_.compute_dtype();
    }
    segments.push_back(sg);
  }
  Status s;
  if (plan_.device_optimizer()) {
    // Device compute on the lane's stream (Stream::LaunchKernel): the GPU Adam (the same IEEE
    // operations as the CPU Adam), or on the CPU device the CPU Adam run by the stream's worker
    // in the optimizer's arena. Either way this thread goes on at once and the one wait below
    // covers the update and the copy into the working shard queued behind it; the blocks stay
    // pinned until then. The gradient's hand-off already waited for the compute that wrote it.
    const bool cuda = device_->kind() == DeviceKind::kCuda;
    tbb::task_arena* arena = streams_.arena.get();
    s = streams_.publish->LaunchKernel([cuda, arena, segments, grad_scale, adam, type](void* native) {
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
    if (s.ok() && plan_.compute_dtype() == optim::DType::kFloat32 && out != master)
      s = streams_.publish->MemcpyAsync(out, master, n * 4, CopyKind::kDeviceToDevice);
    Status w = streams_.publish->Synchronize();
    if (s.ok()) s = w;
  } else {
    optim::AdamOptions ao;
    ao.arena = streams_.arena.get();
    ao.grad_check = optim::GradCheck::kCallerChecked;
    for (const Segment& sg : segments) {
      if (adam) {
        s = optim::AdamStep(sg.ap, sg.bufs, grad_scale, ao).status();
      } else {
        streams_.arena->execute(
            [&] { s = RunElementwise(type, sg, grad_scale, kernels::Backend::kCpu, nullptr); });
      }
      if (!s.ok()) break;
    }
    if (s.ok() && plan_.compute_dtype() == optim::DType::kFloat32 && out != master)
      std::memcpy(out, master, n * 4);
  }
  const bool updated = s.ok();
  for (const BlockKey& k : held) {
    Status rs = store_->Release(k, updated && !(k == kg));  // the gradient is only read
    if (s.ok()) s = rs;
  }
  if (param_block_held) {
    Status ps = store_->Release(kp, updated);
    if (s.ok()) s = ps;
  }
  if (!s.ok()) {
    if (slot >= 0) publish_->FreeSlot(slot);
    return s.WithContext(StrCat("optimizer step of chunk ", c));
  }
  if (slot >= 0) {
    PublishLane::Copy p;
    STRATA_RETURN_IF_ERROR(
        StartPublish(c, slot, &p).WithContext(StrCat("publishing chunk ", c, "'s new values")));
    *publish = p;
  }
  return Status::Ok();
}

}  // namespace strata
