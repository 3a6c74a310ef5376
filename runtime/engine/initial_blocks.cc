// Init's placing steps: which chunks persist and where the buffers live, then every block
// registered and written, and the parameters turned into views of their chunks.
#include "runtime/engine/engine_impl.h"

#include <algorithm>
#include <chrono>

namespace strata {

using namespace engine_detail;

// Which chunks persist, and the model's buffers on the engine's device.
Status Engine::Impl::PlaceBuffers() {
  const auto& z = config_.zero_optimization;
  const auto& chunk_infos = partitioner_->chunks();
  for (size_t c = 0; c < chunk_infos.size(); ++c)
    chunks_.SetPersistent(static_cast<int64_t>(c), chunk_infos[c].used_numel < z.stage3_param_persistence_threshold);

  // Buffers live on the engine's device and start from rank 0's values too. Under 16-bit compute
  // the floating ones take the compute dtype, and so do frozen parameters (which no unit
  // manages): as DeepSpeed's module.half()/bfloat16() does, so that a frozen layer or a
  // BatchNorm's running statistics meet 16-bit activations in their own type.
  const torch::Dtype work = TorchDtype(plan_.compute_dtype());
  std::vector<std::pair<std::string, torch::Tensor>> placed = buffers_;
  placed.insert(placed.end(), frozen_.begin(), frozen_.end());
  for (auto& [name, b] : placed) {
    torch::NoGradGuard ng;
    const torch::Dtype dtype =
        b.is_floating_point() && work != torch::kFloat32 ? work : b.scalar_type();
    const torch::Device dev = DeviceOptions(dtype).device();
    if (b.device() != dev || b.scalar_type() != dtype) {
      rollback_.Take(b);
      b.set_data(b.to(dev, dtype));
    }
    if (comm_->world_size() > 1 && b.numel() > 0) {
      // Rank 0 sends its own values. The others receive into memory of the tensor's own, which
      // then replaces theirs: a frozen parameter built under a Python zero.Init of several ranks
      // is a window onto a scratch region that every such parameter shares (Note [scratch
      // parameters] in zero_init.cc), and receiving in place would leave each holding the last
      // one received.
      torch::Tensor t = comm_->rank() == 0 ? b.contiguous() : torch::empty_like(b, at::MemoryFormat::Contiguous);
      ComputeFence::Mark(*device_).Wait();  // the move above and contiguous() are queued compute
      STRATA_RETURN_IF_ERROR(comm_->Broadcast(t.data_ptr(), static_cast<int64_t>(t.nbytes()),
                                              strata::DType::kU8, 0)
                                 .WithContext(StrCat("broadcasting buffer ", name)));
      if (comm_->rank() != 0) {
        rollback_.Take(b);
        b.set_data(t);
      } else if (!t.is_same(b)) {
        b.copy_(t);
      }
    }
  }
  return Status::Ok();
}

// Note [initial block buffers]
// Each chunk's values are gathered in one fp32 and one working-dtype buffer, allocated once for
// the largest chunk and reused: a fresh pair per chunk faulted in (and zeroed) six bytes a
// parameter anew, as a model built under zero::Init runs with glibc's mmap threshold at 1 MiB;
// on a 20B model, 120 GB of page faults. A bf16 master on one rank needs no fp32 values at all:
// they are read straight into the working dtype (LibTorch rounds to nearest even, as the fp32
// detour did). Every block's write copies out of the buffers before the next chunk refills them
// (WriteBlockBytes waits for a device copy).

// Every block registered and written, and the parameters turned into views of their chunks.
Status Engine::Impl::WriteInitialBlocks() {
  const auto& z = config_.zero_optimization;
  const auto& chunk_infos = partitioner_->chunks();
  // Register every block and write its initial contents, chunk by chunk.
  const int stage = z.stage;
  const size_t esize = optim::DTypeSize(plan_.compute_dtype());
  const torch::Dtype tdtype = TorchDtype(plan_.compute_dtype());
  // One chunk's values at a time, in buffers allocated once for the largest chunk (Note
  // [initial block buffers]).
  int64_t max_numel = 0;
  for (const ChunkInfo& ci : chunk_infos) max_numel = std::max(max_numel, ci.numel);
  torch::Tensor buf32, buf16;
  // A line every 10 s on rank 0: a large model's blocks take minutes to write.
  const auto t0 = std::chrono::steady_clock::now();
  auto reported = t0;
  bool warned_held = false;
  for (size_t c = 0; c < chunk_infos.size(); ++c) {
    if (const auto now = std::chrono::steady_clock::now();
        comm_->rank() == 0 && now - reported >= std::chrono::seconds(10)) {
      reported = now;
      STRATA_LOG(INFO) << "engine start: initial blocks of " << c << " of " << chunk_infos.size()
                       << " chunks written ("
                       << static_cast<int>(100.0 * static_cast<double>(c) / static_cast<double>(chunk_infos.size()))
                       << "%), " << static_cast<int>(std::chrono::duration<double>(now - t0).count()) << " s";
    }
    const ChunkInfo& ci = chunk_infos[c];
    const int64_t n = ci.shard_numel;
    const int64_t c64 = static_cast<int64_t>(c);
    // The chunk's initial values: from the parameters, or from zero::Init's staging file for a
    // model built there (its parameters have 0 elements). In fp32 where an fp32 master keeps them
    // or ranks broadcast them; otherwise straight in the working dtype, which is what the fp32
    // values would round to (round to nearest even either way); a bf16 master stored apart
    // from the working copy takes the working copy's bits.
    const bool fp32_master =
        plan_.Stored(c64, StateKind::kMaster32) && plan_.master_dtype() == optim::DType::kFloat32;
    const bool need32 = comm_->world_size() > 1 || tdtype == torch::kFloat32 || fp32_master;
    if (need32 && !buf32.defined()) buf32 = torch::empty({max_numel}, torch::kFloat32);
    if (tdtype != torch::kFloat32 && !buf16.defined()) buf16 = torch::empty({max_numel}, tdtype);
    torch::Tensor full32 = need32 ? buf32.narrow(0, 0, ci.numel) : torch::Tensor();
    torch::Tensor work = tdtype == torch::kFloat32 ? full32 : buf16.narrow(0, 0, ci.numel);
    torch::Tensor read_into = need32 ? full32 : work;
    read_into.zero_();  // the chunk's padding
    // StageMapped's parameters whose space the NVMe tier counted on getting back once this chunk
    // is written (Note [start's disk] in engine_init.cc): by their mappings' addresses.
    std::vector<std::pair<const void*, uint64_t>> mapped;
    if (nvme_counts_on_staging_) {
      for (int64_t pid : ci.params) {
        const std::optional<zero::StagedSpace> space = zero::StagedDiskSpace(params_[pid].tensor);
        if (space && !space->given_back_on_read && rollback_.Counts(space->file_system))
          mapped.emplace_back(params_[pid].tensor.storage().data(), space->bytes);
      }
    }
    for (int64_t pid : ci.params) {
      const ParamLocation& loc = partitioner_->location(pid);
      torch::Tensor dst = read_into.narrow(0, loc.offset, loc.numel);
      // Held until the start has gone through, so that a failure gives it back (start_rollback.h).
      const zero::AfterRead after = rollback_.TakeParameter(params_[pid].tensor);
      STRATA_ASSIGN_OR_RETURN(bool staged, zero::ReadStaged(params_[pid].tensor, dst, after));
      if (!staged) dst.copy_(params_[pid].tensor.detach().reshape({-1}));
    }
    // Every rank starts from rank 0's initial values.
    if (comm_->world_size() > 1)
      STRATA_RETURN_IF_ERROR(
          OnCommMemory(full32, [&](void* p) {
            return comm_->Broadcast(p, ci.numel, strata::DType::kF32, 0);
          }).WithContext(StrCat("broadcasting chunk ", c, "'s initial values")));
    if (need32 && tdtype != torch::kFloat32) work.copy_(full32);
    torch::Tensor shard32 =
        need32 ? full32.narrow(0, partitioner_->ShardOffset(c64, plan_.shard_rank()), n).contiguous()
               : torch::Tensor();
    auto put = [&](StateKind kind, uint64_t bytes, Placement where, const void* src) -> Status {
      BlockKey key{c64, kind};
      STRATA_RETURN_IF_ERROR(store_->Register(key, bytes, where));
      STRATA_ASSIGN_OR_RETURN(void* dst, store_->Acquire(key, Access::kWrite));
      Status written = WriteBlockBytes(dst, src, bytes, where);
      Status released = store_->Release(key, /*dirty=*/true);
      return written.ok() ? released : written;
    };
    // The master: the fp32 values, or a bf16 master's bits (the working copy's own: Note
    // [compact layouts] in step_plan.h).
    torch::Tensor master = plan_.master_dtype() == optim::DType::kFloat32
                               ? shard32
                               : work.narrow(0, partitioner_->ShardOffset(c64, plan_.shard_rank()), n)
                                     .contiguous();
    if (plan_.Stored(c64, StateKind::kMaster32))
      STRATA_RETURN_IF_ERROR(put(StateKind::kMaster32, plan_.BlockBytes(StateKind::kMaster32, n),
                                 plan_.PlacementOf(c64, StateKind::kMaster32), master.data_ptr()));
    // Zero bytes are zero moments in every format (an 8-bit block with scale 0).
    for (StateKind k : {StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kGrad})
      if (plan_.Stored(c64, k))
        STRATA_RETURN_IF_ERROR(put(k, plan_.BlockBytes(k, n), plan_.PlacementOf(c64, k), nullptr));
    torch::NoGradGuard ng;
    if (stage == 3) {
      torch::Tensor shard16 =
          work.narrow(0, partitioner_->ShardOffset(c64, plan_.shard_rank()), n).contiguous();
      STRATA_RETURN_IF_ERROR(put(StateKind::kParam16, n * esize, plan_.ParamPlacement(c64), shard16.data_ptr()));
      // The parameters become views of the chunk's storage for good; its memory comes and goes.
      ChunkTable::Chunk& cs = chunks_[c];
      const torch::Device dev = DeviceOptions(tdtype).device();
      cs.storage = c10::Storage(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, dev),
                                /*allocator=*/nullptr, /*resizable=*/false);
      STRATA_RETURN_IF_ERROR(materializer_->InstallChunk(c64));
      cs.full = torch::empty({0}, DeviceOptions(tdtype)).set_(cs.storage, 0, {ci.numel}, {1});
      ShowChunkParams(c64, /*gathered=*/true);
      materializer_->DropChunk(c64);  // and 0 elements until gathered (Note [released parameters])
    } else {
      // Stages 0-2 keep the whole working copy on the device for the whole run.
      STRATA_ASSIGN_OR_RETURN(chunks_[c].full, DeviceTensor(ci.numel, tdtype));
      chunks_[c].full.copy_(work);
      for (int64_t pid : ci.params) {
        const ParamLocation& loc = partitioner_->location(pid);
        params_[pid].tensor.set_data(
            chunks_[c].full.narrow(0, loc.offset, loc.numel).view(params_[pid].shape));
      }
    }
    uint64_t held = 0;
    for (const auto& [data, bytes] : mapped)
      if (zero::StagedMappingLive(data)) held += bytes;
    if (held > 0 && !warned_held) {
      warned_held = true;  // once a start
      STRATA_LOG(WARN) << "engine start: " << FormatBytes(held) << " of zero::Init's staging file stays on disk "
                       << "after chunk " << c << ": another tensor still shares a staged parameter's memory (a "
                       << ".data or a view kept from before initialize). The NVMe tier counted on that space "
                       << "coming back, so a disk near full may run out during the start; drop such references "
                       << "before initialize";
    }
    rollback_.ChunkTaken();
    if (hooks_.initial_chunk_hook) hooks_.initial_chunk_hook(c64);
  }
  return Status::Ok();
}

}  // namespace strata
