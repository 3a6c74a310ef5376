// Checkpoint files: layout, manifest, and the atomic-publication rules that make a crash at any
// moment leave the previous checkpoint loadable.
//
// Layout under a save root R:
//   R/step-00000010/rank-00000.bin    this rank's shards, block after block
//   R/step-00000010/rank-00000.json   its manifest: run identity, counters, and per block
//                                     (chunk, state, offset, bytes, crc32c)
//   R/latest                          the name of the newest complete checkpoint ("step-00000010")
// Publication: every rank writes into R/.step-00000010.tmp/, fsyncs its files, and the ranks meet
// at a barrier; rank 0 then renames the directory to its final name, fsyncs R, and replaces
// `latest` atomically (temporary name, fsync, rename). A crash before that last rename leaves
// `latest` naming the previous checkpoint, which is untouched. Leftover .tmp directories are
// removed by the next save. A step saved again replaces the root's older copy of that step.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/status.h"

namespace strata::checkpoint {

inline constexpr int kFormatVersion = 1;

struct BlockEntry {
  int64_t chunk = 0;
  std::string state;  // "master32", "exp_avg", "exp_avg_sq"
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

// A module buffer (BatchNorm running statistics, ...), saved by name after the blocks.
struct BufferEntry {
  std::string name;
  std::string dtype;  // torch scalar type name, e.g. "Float"
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};

struct Manifest {
  int version = kFormatVersion;
  int rank = 0;
  int world_size = 1;
  int stage = 0;
  std::string dtype;        // working precision
  std::string state_dtype;  // exp_avg / exp_avg_sq
  // Whose states exp_avg and exp_avg_sq hold: "adam" (Adam and AdamW alike), "sgd", "adagrad" or
  // "lion"; empty in checkpoints written before it was kept.
  std::string optimizer;
  int64_t parameters = 0;
  std::vector<int64_t> shard_numel;  // per chunk: identifies the model's layout
  int64_t global_step = 0;
  int64_t micro_step = 0;
  // The steps the saved optimizer states have taken, which their bias corrections count; -1
  // (absent) where that is global_step, as in every run that loaded them whole or not at all.
  int64_t optimizer_steps = -1;
  // The accumulation the run saved with; 0 in checkpoints written before it was kept. A run
  // that accumulates otherwise resumes at the same boundary count (Note [elastic resume]).
  int64_t gradient_accumulation_steps = 0;
  nlohmann::json scaler;  // loss-scaler state (empty without fp16)
  nlohmann::json extra;   // the caller's state (data position, ...)
  // Where each parameter lives, for readers without the engine (strata.zero_to_fp32):
  //   {"shard_offset": [per chunk, the first element of this rank's shard],
  //    "chunk_numel": [per chunk, padded elements],
  //    "params": [{"name", "shape", "chunk", "offset"} in registration order],
  //    "buffers": [{"name", "shape"}], "frozen": [{"name", "shape"}]}
  // Null in checkpoints written before it existed.
  nlohmann::json layout;
  std::vector<BlockEntry> blocks;
  std::vector<BufferEntry> buffers;  // absent in checkpoints of models without buffers
  // The parameters no unit trains (frozen at the start), in rank 0's manifest only: every rank
  // holds them whole, so rank 0 writes them once. Absent where the model has none, where the
  // save excluded them, and in checkpoints written before they were kept.
  std::vector<BufferEntry> frozen;
};

std::string StepDirName(int64_t step);          // "step-00000010"
std::string RankFileStem(int rank);             // "rank-00000"
// The file stem whose manifest rank `rank` loads from checkpoint directory `dir`: its own, or
// rank 0's where the saving run had fewer ranks (Note [elastic resume] in
// runtime/engine/engine_checkpoint.cc). NOT_FOUND when neither manifest exists.
StatusOr<std::string> LoadingStem(const std::string& dir, int rank);

// Serializes / parses a manifest. Parse accepts any bytes and returns DATA_LOSS or
// INVALID_ARGUMENT naming what is wrong for anything that is not a complete, valid manifest.
std::string SerializeManifest(const Manifest& m);
StatusOr<Manifest> ParseManifest(std::string_view bytes, const std::string& source);

// INVALID_ARGUMENT, naming the folder to save to instead, when `root` is one checkpoint (a step
// directory: it holds rank 0's manifest) rather than a save root. Saving into one would nest the
// next checkpoint inside it, where neither its `latest` nor a resume from its root finds it.
Status CheckSaveRoot(const std::string& root);
// Resolves what a user passed to --resume: a save root (uses `latest`) or a step directory.
// NOT_FOUND with the fix when neither holds a checkpoint.
StatusOr<std::string> ResolveCheckpointDir(const std::string& path);

// Writes `bytes` to `path` atomically: path.tmp, then PublishFile.
Status WriteFileAtomic(const std::string& path, std::string_view bytes);
// Creates (or truncates) `path` with `bytes`, fsynced; removed again on failure. The first half
// of WriteFileAtomic, for a caller that publishes the file later.
Status WriteNewFile(const std::string& path, std::string_view bytes);
// Makes the finished file `tmp` appear as `path` and survive a crash: fsync of tmp, rename over
// path, fsync of the directory. On failure tmp is removed and path keeps its old content. For
// files written by another writer (torch.save from Python) that then publish through here.
Status PublishFile(const std::string& tmp, const std::string& path);
Status FsyncDir(const std::string& dir);
// Opens a checkpoint's file for reading: its descriptor (the caller closes it), and its size in
// `size` when given. DATA_LOSS naming the path when it is not a regular file: a FIFO or a device
// in a rank file's place would block the read, a folder fail it with a bare EISDIR.
StatusOr<int> OpenCheckpointFile(const std::string& path, uint64_t* size = nullptr);
// A checkpoint's whole file (OpenCheckpointFile's checks).
StatusOr<std::string> ReadFile(const std::string& path);

// Reads `bytes` bytes at `offset` of a rank's state file (`fd`, opened on `path`) into `out` and
// checks them against `crc32c`, the checksum its manifest recorded. DATA_LOSS naming the file,
// `what` ("chunk 3's master32", "buffer 'bn.running_mean'") and the fix when the file is short
// or the bytes differ. The one reader of saved states: Engine's Load and strata.zero_to_fp32
// (through the Python bindings) both read through it.
Status ReadChecked(int fd, const std::string& path, uint64_t offset, uint64_t bytes,
                   uint32_t crc32c, const std::string& what, void* out);

}  // namespace strata::checkpoint
