// StartRollback: what an engine start that fails part-way gives back, so that the model is as
// the start found it.
//
// The start takes the model over tensor by tensor: it moves the buffers and frozen parameters to
// the engine's device (PlaceBuffers), then points each trainable parameter at a chunk of the
// engine's own memory, chunk by chunk (WriteInitialBlocks), and at stage 3 leaves it with 0
// elements. A failure after that (a disk filling at chunk 900 of 1000, an I/O error, the device
// out of memory) used to leave the taken parameters with nothing: the values had gone to tiers
// that died with the engine, and the model had to be built again. StartRollback holds each taken
// tensor's data from before until the start ends: Undo gives it back to the tensor, Commit (the
// start succeeded) lets it go.
//
// What holding costs, and when it is not done:
// - A model in memory keeps its own memory until the start ends. The start's budgets were
//   measured with that memory in use (placement auto's host and device figures, the host-state
//   check), so the start's peak is the one they allowed for.
// - A parameter staged by zero::Init keeps its range of the staging file (Partition's and
//   StageGenerated's registry entry, read with AfterRead::kKeep; StageMapped's mapping, held by
//   its data) until Commit gives it back. Where the NVMe tier counted on that space coming back
//   during the start (Note [start's disk] in engine_init.cc: the disk cannot hold the state beside
//   the whole file, or several ranks may share it), the file system is named with
//   CountsOnStagedSpace, and the parameters staged there are given back as they are read, as
//   before: a failure loses them, and Undo counts them.
//
// Not thread-safe: the start's thread calls it, and the engine's destructor.
#pragma once

#include <cstdint>
#include <set>
#include <vector>

#include <torch/torch.h>

#include "runtime/engine/zero_init.h"

namespace strata {

class StartRollback {
 public:
  // The NVMe tier counts on zero::Init's staged space on file system `file_system` (st_dev) coming
  // back during the start. Before the first TakeParameter.
  void CountsOnStagedSpace(uint64_t file_system);

  // Before the start reads trainable `param`'s initial values and points it at its chunk: keeps
  // what giving it back needs, unless its staged space is counted on. Returns how zero::ReadStaged
  // must leave it.
  zero::AfterRead TakeParameter(const torch::Tensor& param);
  // Before the start replaces `t`'s data (a buffer or a frozen parameter it moves).
  void Take(const torch::Tensor& t);
  // The start has written a chunk's blocks and pointed its parameters at the engine's memory. The
  // StageMapped mappings held for them leave the process's memory (madvise; their pages stay in
  // the file, which a restore maps again): a model larger than DRAM keeps no more of it resident
  // than a start that gave each mapping up.
  void ChunkTaken();
  int64_t chunks_taken() const { return chunks_taken_; }
  // Whether the NVMe tier counts on the staged space of `file_system` (CountsOnStagedSpace).
  bool Counts(uint64_t file_system) const { return counted_file_systems_.count(file_system) > 0; }

  // The start succeeded: the data held goes, and the staged parameters' space in the staging file
  // with it. Returns the bytes of StageMapped mappings that stay on disk all the same, because
  // another tensor still shares them (a .data or a view kept from before initialize). Idempotent.
  uint64_t Commit();

  // The start failed: every tensor taken gets its data back, the last taken first (a tensor taken
  // twice ends with its first data). Idempotent; nothing after Commit.
  struct Outcome {
    int64_t restored = 0;  // tensors given their data back (each once)
    // Trainable parameters whose values went with the start (their staged space was counted on).
    std::vector<torch::Tensor> lost;
  };
  Outcome Undo();

  // Whether anything was taken (a start that failed before its first tensor changed nothing).
  bool took_any() const { return !taken_.empty() || !lost_.empty(); }

 private:
  struct Taken {
    torch::Tensor tensor;  // the model's tensor (its TensorImpl is what the model holds)
    torch::Tensor data;    // its data before the start: the same storage, sizes and dtype
    bool staged = false;   // zero::Init's registry still holds it (ReadStaged with kKeep)
    // A StageMapped mapping's address and the file space it holds (goes when the mapping does).
    const void* mapping = nullptr;
    uint64_t mapping_bytes = 0;
  };
  std::set<uint64_t> counted_file_systems_;
  std::vector<Taken> taken_;
  std::vector<torch::Tensor> lost_;
  size_t paged_out_ = 0;  // taken_[0, paged_out_) had their mappings' pages dropped
  int64_t chunks_taken_ = 0;
  bool done_ = false;
};

}  // namespace strata
