// zero::Init: building a model larger than DRAM, unit by unit, straight into the tiers.
//
//   auto init = strata::zero::Init::Create("/nvme/strata").value();  // current on this thread
//   Gpt model(c);          // each unit's constructor ends with strata::zero::Partition(*unit)
//   auto engine = strata::Engine::Create(model, config, comm, device).value();
//   init.reset();          // the staging file goes
//
// While an Init is current on the thread, Partition(unit) writes the unit's freshly initialized
// trainable parameters (in fp32, or bf16 where the run's master is bf16; see Create) to a staging
// file in the Init's directory and leaves each of them with its dtype but no memory and 0
// elements (its shape is kept beside its staged values: StagedShape), so the full model never
// exists in DRAM: at most one unit does.
// Engine::Create reads the staged values chunk by chunk as it writes the shards to their tiers.
// Without a current Init, Partition does nothing (the same model code builds normally). A
// parameter shared by several units (tied) is staged once.
//
// While an Init is alive glibc's mmap threshold is fixed at 1 MiB for the process, so that a freed
// unit's tensors go back to the OS instead of staying in the heap; when the last Init goes it is
// set to 32 MiB, the ceiling of glibc's adaptive threshold, because a 1 MiB threshold makes every
// activation a fresh mapping during training (zero_init.cc says why).
//
// While an Init that stages values lives, a thread of it logs the bytes staged so far every
// 10 s in which that grew (Note [build progress] in zero_init.cc).
//
// Thread-safety: Partition and the engine's reads may run on any thread; an Init is current only
// on the thread that created it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "runtime/base/status.h"

namespace strata::zero {

// What Partition keeps of each parameter.
enum class StageMode {
  kValues,  // its values, in the staging file
  // Nothing: the parameter keeps its dtype (0 elements, as kValues), no file is made, and ReadStaged fills
  // zeros. For a rank whose initial values come from rank 0 (Engine::Create broadcasts every
  // chunk's on several ranks), so that ranks sharing a disk stage the model once, not once each.
  // The model's constructors still run (and draw from the generator as rank 0's do, which keeps
  // the ranks' generators in step); only the disk is spared, and StageGenerated's draws, which
  // are never made there. StageMapped's parameters keep their shapes over scratch memory.
  kShapesOnly,
};

class Init {
 public:
  // Creates the staging file (removed by the destructor, and unlinked at once so that a crash
  // leaves nothing behind) and makes this Init current on the calling thread. Partition stages
  // floating-point parameters as `staged_dtype` (kFloat32 or kBFloat16), converting with
  // LibTorch's round-to-nearest-even. kBFloat16 halves the file for a run whose master is the
  // bf16 working copy (bf16.bf16_master_weights_and_grads): the engine rounds the fp32 values to
  // nearest bf16 at start anyway, so it keeps the same master and working copy either way (a
  // bf16 value converts to fp32 and back unchanged). Other runs keep kFloat32.
  // With StageMode::kShapesOnly, `dir` is not touched and StageMapped gives the parameter
  // scratch memory (see StageMapped).
  static StatusOr<std::unique_ptr<Init>> Create(const std::string& dir,
                                                torch::Dtype staged_dtype = torch::kFloat32,
                                                StageMode mode = StageMode::kValues);
  ~Init();
  Init(const Init&) = delete;
  Init& operator=(const Init&) = delete;

  // The staged values' bytes (the file adds alignment padding); safe to read from another thread
  // while the model is built, to report progress.
  uint64_t staged_bytes() const;
  // The bytes, in the staged dtype, of the parameters StageGenerated registered (nothing is
  // written for them); safe to read from another thread, as staged_bytes.
  uint64_t generated_bytes() const;
  int64_t generated_params() const;
  StageMode mode() const;
  // Partition writes with O_DIRECT (Note [direct staging] in zero_init.cc); false where the
  // file system refused it and the page cache takes the writes.
  bool direct_io() const;
  int64_t staged_params() const;

  class Impl;

 private:
  explicit Init(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Stages `unit`'s trainable parameters under the current Init (see above). Throws
// std::runtime_error on an I/O error, naming the file.
void Partition(torch::nn::Module& unit);

// A parameter's initial values as a function: fills a contiguous fp32 CPU tensor of the
// parameter's elements, with the same values on every call and on any thread.
using Fill = std::function<void(torch::Tensor)>;

// For a model whose large parameters' initial values are a function of a few numbers (a
// counter-based draw: tools/train/parallel_init.h). Under the current Init, registers `param`
// (a trainable floating-point parameter) as staged, with `shape` and `fill`, and writes nothing:
// ReadStaged calls `fill` when the engine reads the parameter, rounding through the staged
// dtype as a value written to the file would be, so the engine starts from the same bits. The
// parameter is left with 0 elements, as Partition leaves one; Partition skips it. Under
// StageMode::kShapesOnly `fill` is never called (the reads give zeros, as for every parameter
// there). This takes the largest parameters out of the staging file, whose size bounded the
// largest model a disk could start (Note [generated parameters] in zero_init.cc).
// Returns false, registering nothing, when no Init is current: the caller fills the parameter
// itself. Throws std::invalid_argument for a parameter that is not floating point or a shape
// with a negative size.
bool StageGenerated(const torch::Tensor& param, std::vector<int64_t> shape, Fill fill);

// For front ends whose models write parameters after constructing their modules (PyTorch models
// initialize weights in a pass at the end of the root's constructor): stages `param` under the
// current Init but keeps it readable and writable. Its values go to the staging file and its
// memory becomes a shared mapping of that place in the file, so its pages are file-backed: the
// kernel writes them back and drops them under memory pressure instead of holding them in
// anonymous memory, and a model larger than DRAM can be built and then initialized in place.
// The engine reads such a parameter like any other (through the mapping); the mapping goes when
// the engine points the parameter at its own memory, and its space in the file goes with it.
// Does nothing without a current Init.
// Under StageMode::kShapesOnly nothing is written: the parameter (of a page or more) keeps its
// shape and stays writable, but its memory becomes a window onto a 32 MiB scratch region that
// every such parameter shares, so a rank whose values are overwritten by rank 0's at the
// engine's start holds neither the model nor a file of it (Note [scratch parameters] in
// zero_init.cc). Its values are meaningless from then on. Where the kernel refuses the mapping
// the parameter keeps its memory and values.
// Throws std::runtime_error on an I/O or mapping error, naming the file.
void StageMapped(const torch::Tensor& param);

// What ReadStaged leaves of a parameter it read.
enum class AfterRead {
  kGiveBack,  // nothing: the parameter is no longer staged, and its space in the file is freed
  // Everything: the parameter stays staged, its values in the file, until GiveBackStaged (the
  // engine's start, so that a start that fails part-way leaves the model as it found it).
  kKeep,
};
// For the engine: when `param` was staged by a live Init, reads its values converted to dst's
// dtype into `dst` (a contiguous CPU tensor of the staged shape's elements), or draws them for
// StageGenerated's, and returns true; with AfterRead::kGiveBack a parameter is read once.
// Returns false for a parameter not staged. An I/O error is returned as a Status, and so is a
// destination of another size or not contiguous on the CPU (INVALID_ARGUMENT; nothing is read).
StatusOr<bool> ReadStaged(const torch::Tensor& param, torch::Tensor dst,
                          AfterRead after = AfterRead::kGiveBack);
// Ends what ReadStaged(kKeep) kept: `param` is no longer staged, and its space in the staging
// file is freed (best effort, as ReadStaged's). Nothing for a parameter not staged.
void GiveBackStaged(const torch::Tensor& param);

// The disk space a staged parameter holds in its Init's staging file until it is given back
// (its range of the file, alignment padding included), and where. Engine::Create counts on it:
// the space comes back chunk by chunk while the engine writes its NVMe blocks, so its NVMe tier
// asks for less free space at open (Note [start's disk] in engine_init.cc).
struct StagedSpace {
  uint64_t bytes = 0;
  uint64_t file_system = 0;  // st_dev of the staging file's file system
  // Partition's parameters give their space back inside ReadStaged; StageMapped's when their
  // mapping goes, i.e. once the engine has pointed the parameter at its own memory and nothing
  // else holds the old one.
  bool given_back_on_read = true;
};
// nullopt for a parameter that holds no space: not staged, read already, StageGenerated's, staged
// under StageMode::kShapesOnly, or in a staging file whose file system cannot punch holes (its
// space stays until the file goes).
std::optional<StagedSpace> StagedDiskSpace(const torch::Tensor& param);
// Whether StageMapped's mapping whose memory starts at `data` (a staged parameter's storage
// address) still lives: after the engine has pointed the parameter at its own memory, true means
// another tensor shares the mapping and its space is not back yet.
bool StagedMappingLive(const void* data);
// True when `param` has been staged and not yet read (it has 0 elements, StagedShape its shape).
bool IsStaged(const torch::Tensor& param);
// The shape `param` had when it was staged; nullopt when it is not staged (or was read).
std::optional<std::vector<int64_t>> StagedShape(const torch::Tensor& param);
// Tests only: false makes Inits created afterwards stage through the page cache, as on a file
// system that refuses O_DIRECT (Note [direct staging]).
void SetDirectStagingForTest(bool enabled);
// Tests only: the interval of the build's progress lines (Note [build progress] in
// zero_init.cc), from each reporter's next wait on; 10 s otherwise.
void SetProgressIntervalForTest(int64_t ms);

}  // namespace strata::zero
