// One parameter's share of the engine's states, read and written between steps: the values a
// writable gather (GatheredParameters with a modifier rank) writes back, and DeepSpeed's
// per-parameter accessors (safe_get_full_fp32_param and its kin, a ZeRO-3 parameter's ds_status
// and ds_tensor). A parameter lies in one chunk; each rank holds its shard of every chunk's
// states, so a parameter's full value is the chunk's shards gathered, and a write patches the
// part of the parameter that falls in this rank's shard.
#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>

#include "runtime/engine/engine_impl.h"

namespace strata {

using namespace engine_detail;

StatusOr<std::vector<int64_t>> Engine::Impl::ParamIds(
    const std::vector<torch::Tensor>& tensors) const {
  std::unordered_map<const c10::TensorImpl*, int64_t> id_of;
  for (size_t p = 0; p < params_.size(); ++p) id_of[params_[p].tensor.unsafeGetTensorImpl()] = p;
  std::vector<int64_t> ids;
  ids.reserve(tensors.size());
  for (const torch::Tensor& t : tensors) {
    auto it = id_of.find(t.unsafeGetTensorImpl());
    if (it == id_of.end())
      return InvalidArgument(StrCat("a tensor of shape ", t.sizes(), " is not a parameter the "
                                    "engine trains"));
    ids.push_back(it->second);
  }
  return ids;
}

namespace {

// The block of chunk c that holds state `kind` and the dtype of its elements.
struct StateBlock {
  BlockKey key;
  optim::DType dtype;
  bool blocks8 = false;  // 8-bit moments: decoded and encoded through the run's StateLayout
};

StatusOr<StateBlock> BlockOf(const StepPlan& plan, int64_t c, StateKind kind) {
  switch (kind) {
    case StateKind::kMaster32:
      return StateBlock{plan.MasterKey(c), plan.master_dtype()};
    case StateKind::kParam16:
      if (!plan.stage3())
        return FailedPrecondition("a parameter's shard of the working copy exists under ZeRO "
                                  "stage 3 only (below it every rank holds the whole copy)");
      return StateBlock{{c, kind}, plan.compute_dtype()};
    case StateKind::kExpAvg:
    case StateKind::kExpAvgSq:
      if (!plan.HoldsState(kind))
        return FailedPrecondition(StrCat("the optimizer keeps no ", StateKindName(kind),
                                         " state (Note [states the optimizer uses])"));
      return StateBlock{{c, kind}, plan.state_dtype(), plan.moment_format() == optim::MomentFormat::kInt8};
    default:
      return InvalidArgument(StrCat("no per-parameter access to the ", StateKindName(kind),
                                    " state"));
  }
}

void ToFloat(const void* src, optim::DType dtype, int64_t n, float* dst) {
  if (dtype == optim::DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  const auto* h = static_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i)
    dst[i] = dtype == optim::DType::kBFloat16 ? optim::Bf16ToFloat(h[i]) : optim::HalfToFloat(h[i]);
}

void FromFloat(const float* src, optim::DType dtype, int64_t n, void* dst) {
  if (dtype == optim::DType::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  auto* h = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i)
    h[i] = dtype == optim::DType::kBFloat16 ? optim::FloatToBf16(src[i]) : optim::FloatToHalf(src[i]);
}

}  // namespace

Status Engine::Impl::ReadShard(int64_t c, StateKind kind, float* out) {
  STRATA_ASSIGN_OR_RETURN(StateBlock b, BlockOf(plan_, c, kind));
  STRATA_RETURN_IF_ERROR(CheckBlockResident(b.key, kind));
  const int64_t n = partitioner_->chunks()[c].shard_numel;
  std::vector<char> raw(b.blocks8 ? plan_.BlockBytes(kind, n) : n * optim::DTypeSize(b.dtype));
  STRATA_ASSIGN_OR_RETURN(void* block, store_->Acquire(b.key, Access::kRead));
  Status read = ReadBlockBytes(raw.data(), block, raw.size(), plan_.PlacementOf(c, b.key.kind));
  STRATA_RETURN_IF_ERROR(store_->Release(b.key, false));
  STRATA_RETURN_IF_ERROR(read.WithContext(StrCat("reading chunk ", c, "'s ", StateKindName(kind))));
  if (b.blocks8) {
    plan_.layout().Decode(kind, raw.data(), n, out);
  } else {
    ToFloat(raw.data(), b.dtype, n, out);
  }
  return Status::Ok();
}

Status Engine::Impl::PatchShard(int64_t c, StateKind kind,
                                const std::vector<std::pair<int64_t, torch::Tensor>>& values,
                                std::vector<float>* shard_out) {
  STRATA_ASSIGN_OR_RETURN(StateBlock b, BlockOf(plan_, c, kind));
  STRATA_RETURN_IF_ERROR(CheckBlockResident(b.key, kind));
  const int64_t n = partitioner_->chunks()[c].shard_numel;
  const Placement where = plan_.PlacementOf(c, b.key.kind);
  std::vector<float> shard(n);
  std::vector<char> raw(b.blocks8 ? plan_.BlockBytes(kind, n) : n * optim::DTypeSize(b.dtype));
  STRATA_ASSIGN_OR_RETURN(void* block, store_->Acquire(b.key, Access::kReadWrite));
  Status s = ReadBlockBytes(raw.data(), block, raw.size(), where);
  if (s.ok()) {
    // 8-bit moments: the shard is decoded and encoded whole (a write requantizes its blocks).
    if (b.blocks8) {
      plan_.layout().Decode(kind, raw.data(), n, shard.data());
    } else {
      ToFloat(raw.data(), b.dtype, n, shard.data());
    }
    for (const auto& [pid, value] : values) {
      const Partitioner::ShardPiece pc = partitioner_->PieceOf(pid, plan_.shard_rank());
      std::memcpy(shard.data() + pc.in_shard, value.data_ptr<float>() + pc.in_param, pc.size * sizeof(float));
    }
    if (b.blocks8) {
      plan_.layout().Encode(kind, shard.data(), n, raw.data());
    } else {
      FromFloat(shard.data(), b.dtype, n, raw.data());
    }
    s = WriteBlockBytes(block, raw.data(), raw.size(), where);
  }
  Status r = store_->Release(b.key, s.ok());
  STRATA_RETURN_IF_ERROR(s.WithContext(StrCat("writing chunk ", c, "'s ", StateKindName(kind))));
  STRATA_RETURN_IF_ERROR(r);
  if (shard_out) *shard_out = std::move(shard);
  return Status::Ok();
}

Status Engine::Impl::PublishMaster(int64_t c, const std::vector<float>& master) {
  std::vector<char> work(master.size() * optim::DTypeSize(plan_.compute_dtype()));
  FromFloat(master.data(), plan_.compute_dtype(), static_cast<int64_t>(master.size()), work.data());
  return updater_->PublishParams(c, work.data(), plan_.compute_dtype());
}

Status Engine::Impl::WriteMasters(
    const std::map<int64_t, std::vector<std::pair<int64_t, torch::Tensor>>>& by_chunk) {
  for (const auto& [c, written] : by_chunk) {
    // The master shard, patched where a written parameter overlaps it. With a shared master
    // (fp32 compute) it is the working shard itself; otherwise the working copy is the master
    // rounded to the working precision, as after an update.
    std::vector<float> master;
    STRATA_RETURN_IF_ERROR(PatchShard(c, StateKind::kMaster32, written, &master));
    if (!plan_.MasterIsParam(c)) STRATA_RETURN_IF_ERROR(PublishMaster(c, master));
  }
  // Every rank's shards to the others (replicated working copies), and what is gathered now
  // refreshed from them, as after an optimizer step.
  STRATA_RETURN_IF_ERROR(ShareUpdatedShards());
  return materializer_->RefreshChunks();
}

Status Engine::Impl::WriteParameters(const std::vector<torch::Tensor>& tensors) {
  STRATA_RETURN_IF_ERROR(CheckBetweenSteps("WriteParameters"));
  STRATA_RETURN_IF_ERROR(FinishUpdates());
  STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> ids, ParamIds(tensors));
  // Each written parameter's full value in fp32 on the host, read through LibTorch (the device's
  // own compute reads a gathered parameter; the host never touches device memory directly).
  std::map<int64_t, std::vector<std::pair<int64_t, torch::Tensor>>> by_chunk;
  torch::NoGradGuard ng;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const torch::Tensor& t = tensors[i];
    const int64_t pid = ids[i];
    const ParamLocation& loc = partitioner_->location(pid);
    const bool gathered = !plan_.stage3() || chunks_.installed(loc.chunk);
    if (gathered && t.numel() != loc.numel) {
      return InvalidArgument(StrCat(
          "parameter '", partitioner_->param_name(pid), "' of shape ", c10::IntArrayRef(params_[pid].shape),
          " now holds ", t.numel(), " elements (shape ", t.sizes(), "): write values into it "
          "(p.data.copy_(v), p[...] = v) instead of assigning a tensor of another shape"));
    }
    if (t.numel() != loc.numel || (t.numel() > 0 && !t.has_storage()) ||
        (t.numel() > 0 && t.data_ptr() == nullptr)) {
      return FailedPrecondition(StrCat("parameter '", partitioner_->param_name(pid),
                                       "' is not gathered: write it inside GatheredParameters"));
    }
    torch::Tensor host = t.detach().to(torch::kCPU, torch::kFloat32).contiguous().view({-1});
    by_chunk[partitioner_->location(pid).chunk].push_back({pid, host});
  }
  return WriteMasters(by_chunk);
}

StatusOr<std::vector<torch::Tensor>> Engine::Impl::GatherParamState(
    StateKind kind, const std::vector<torch::Tensor>& tensors) {
  std::vector<int64_t> ids;
  if (tensors.empty()) {
    for (size_t p = 0; p < params_.size(); ++p) ids.push_back(static_cast<int64_t>(p));
  } else {
    STRATA_ASSIGN_OR_RETURN(ids, ParamIds(tensors));
  }
  QuietLanes();
  std::map<int64_t, std::vector<size_t>> wanted;  // chunk -> positions in `ids`
  for (size_t i = 0; i < ids.size(); ++i) wanted[partitioner_->location(ids[i]).chunk].push_back(i);
  std::vector<torch::Tensor> out(ids.size());
  for (const auto& [c, positions] : wanted) {
    const ChunkInfo& ci = partitioner_->chunks()[c];
    torch::Tensor full = torch::zeros({ci.numel}, torch::kFloat32);
    const int64_t off = partitioner_->ShardOffset(c, plan_.shard_rank());
    STRATA_RETURN_IF_ERROR(ReadShard(c, kind, full.data_ptr<float>() + off));
    if (plan_.shard_world() > 1) {
      STRATA_RETURN_IF_ERROR(OnCommMemory(full, [&](void* p) {
        return comm_->AllGather(static_cast<float*>(p) + off, p, ci.shard_numel,
                                strata::DType::kF32);
      }));
    }
    for (size_t i : positions) {
      const ParamLocation& loc = partitioner_->location(ids[i]);
      out[i] = full.narrow(0, loc.offset, loc.numel).view(params_[ids[i]].shape).clone();
    }
  }
  return out;
}

StatusOr<std::vector<torch::Tensor>> Engine::Impl::GatherMasterParams() {
  return GatherParamState(StateKind::kMaster32, {});
}

StatusOr<std::vector<torch::Tensor>> Engine::Impl::LocalParamState(
    StateKind kind, const std::vector<torch::Tensor>& tensors) {
  STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> ids, ParamIds(tensors));
  STRATA_ASSIGN_OR_RETURN(StateBlock b, BlockOf(plan_, 0, kind));
  QuietLanes();
  std::vector<torch::Tensor> out;
  for (int64_t pid : ids) {
    const int64_t chunk = partitioner_->location(pid).chunk;
    const Partitioner::ShardPiece pc = partitioner_->PieceOf(pid, plan_.shard_rank());
    std::vector<float> shard(partitioner_->chunks()[chunk].shard_numel);
    STRATA_RETURN_IF_ERROR(ReadShard(chunk, kind, shard.data()));
    torch::Tensor part = torch::empty({pc.size}, torch::kFloat32);
    std::memcpy(part.data_ptr<float>(), shard.data() + pc.in_shard, pc.size * sizeof(float));
    out.push_back(kind == StateKind::kParam16 ? part.to(TorchDtype(b.dtype)) : part);
  }
  return out;
}

Status Engine::Impl::WriteParamState(StateKind kind, const std::vector<torch::Tensor>& tensors,
                                     const std::vector<torch::Tensor>& values) {
  if (step_.step_open)
    return CheckBetweenSteps(StrCat("writing the ", StateKindName(kind), " state").c_str());
  if (tensors.size() != values.size())
    return InvalidArgument(StrCat(tensors.size(), " parameters but ", values.size(), " values"));
  if (kind == StateKind::kParam16)
    return InvalidArgument("the working copy follows the master: write the fp32 master");
  STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> ids, ParamIds(tensors));
  STRATA_RETURN_IF_ERROR(BlockOf(plan_, 0, kind).status());
  STRATA_RETURN_IF_ERROR(FinishUpdates());
  std::map<int64_t, std::vector<std::pair<int64_t, torch::Tensor>>> by_chunk;
  torch::NoGradGuard ng;
  for (size_t i = 0; i < ids.size(); ++i) {
    const ParamLocation& loc = partitioner_->location(ids[i]);
    if (values[i].numel() != loc.numel)
      return InvalidArgument(StrCat("a value of ", values[i].numel(), " elements for parameter '",
                                    partitioner_->param_name(ids[i]), "' of ", loc.numel));
    by_chunk[loc.chunk].push_back(
        {ids[i], values[i].detach().to(torch::kCPU, torch::kFloat32).contiguous().view({-1})});
  }
  if (kind == StateKind::kMaster32) return WriteMasters(by_chunk);
  for (const auto& [c, written] : by_chunk)
    STRATA_RETURN_IF_ERROR(PatchShard(c, kind, written, nullptr));
  return Status::Ok();
}

StatusOr<std::vector<Engine::Residency>> Engine::Impl::ParamResidency(
    const std::vector<torch::Tensor>& tensors) const {
  STRATA_ASSIGN_OR_RETURN(std::vector<int64_t> ids, ParamIds(tensors));
  std::vector<Engine::Residency> out;
  for (int64_t pid : ids) {
    const int64_t c = partitioner_->location(pid).chunk;
    if (!plan_.stage3() || (chunks_.installed(c) && !chunks_.filling(c)))
      out.push_back(Engine::Residency::kAvailable);
    else
      out.push_back(chunks_.filling(c) ? Engine::Residency::kInflight
                                       : Engine::Residency::kNotAvailable);
  }
  return out;
}

}  // namespace strata
