// ChunkUpdater::RunCompact (chunk_updater.h): a chunk's update in the compact layouts (Note
// [compact layouts] in runtime/state/step_plan.h), one run per parameter piece of the shard, on
// the host's CPU kernels or the GPU's (kernels/kernels.h: the same bits either way).
#include <algorithm>
#include <vector>

#include "kernels/kernels.h"
#include "optim/compact_step.h"
#include "runtime/engine/chunk_updater.h"
#include "runtime/engine/optimizer_segment.h"

namespace strata {

Status ChunkUpdater::RunCompact(const OptimizerLane::StepInputs& in, const Held& h, int64_t n,
                               kernels::Backend backend, void* native) {
  const int64_t c = h.keys[0].chunk;
  const StepPlan& plan = *p_.plan;
  const Partitioner& part = *p_.partitioner;
  const int64_t lo = part.ShardOffset(c, plan.shard_rank());
  // One run per parameter piece in the shard, with its group's hyperparameters.
  const OptimizerType type = p_.optimizer->type;
  const bool adam = IsAdam(type);
  std::vector<optim::AdamRun> runs;          // Adam and AdamW
  std::vector<optim::ElementwiseRun> eruns;  // SGD, Adagrad, Lion
  for (int64_t pid : part.chunks()[c].params) {
    const ParamLocation& loc = part.location(pid);
    const int64_t from = std::max(lo, loc.offset), to = std::min(lo + n, loc.offset + loc.numel);
    if (from >= to) continue;
    const Segment sg =
        MakeSegment(*p_.optimizer, in.groups[p_.groups->of_param[pid]], in.optimizer_step);
    const auto begin = static_cast<size_t>(from - lo), size = static_cast<size_t>(to - from);
    const uint64_t index = model_offset_[pid] + static_cast<uint64_t>(from - loc.offset);
    if (adam) {
      runs.push_back({begin, size, sg.ap, index});
      continue;
    }
    optim::ElementwiseRun er;
    er.begin = begin;
    er.size = size;
    er.index_base = index;
    er.sgd = sg.sp;
    er.adagrad = sg.gp;
    er.lion = sg.lp;
    eruns.push_back(er);
  }
  optim::CompactAdamBuffers b;
  b.master = h.ptrs[0];
  b.master_format = plan.master_format();
  b.grad = h.ptrs[3];
  b.grad_dtype = p_.plan->grad_dtype();
  b.exp_avg = h.ptrs[1];
  b.exp_avg_sq = h.ptrs[2];
  b.moment_format = plan.moment_format();
  b.n = static_cast<size_t>(n);
  b.rounding_key = optim::RoundingKey(rounding_seed_, in.step);
  // An fp32 master writes the working copy as it goes (param16); a bf16 master is copied after
  // (CompactCopiesMaster).
  const bool bf16_master = plan.master_dtype() != optim::DType::kFloat32;
  if (!bf16_master && plan.compute_dtype() != optim::DType::kFloat32) {
    b.param16 = h.out;
    b.param16_dtype = plan.compute_dtype();
  }
  if (adam) return kernels::CompactAdamStep(backend, runs, b, in.grad_scale, nullptr, native);
  const optim::ElementwiseKind kind = type == OptimizerType::kSGD       ? optim::ElementwiseKind::kSgd
                                      : type == OptimizerType::kAdagrad ? optim::ElementwiseKind::kAdagrad
                                                                        : optim::ElementwiseKind::kLion;
  return kernels::CompactElementwiseStep(backend, kind, eruns, b, in.grad_scale, native);
}

bool ChunkUpdater::CompactCopiesMaster(const Held& h) const {
  const StepPlan& plan = *p_.plan;
  return h.out != h.ptrs[0] &&
         (plan.master_dtype() != optim::DType::kFloat32 || plan.compute_dtype() == optim::DType::kFloat32);
}

}  // namespace strata
