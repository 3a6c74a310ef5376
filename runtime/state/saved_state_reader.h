// SavedStateReader: a checkpoint's master and moment states read by parameter, as fp32, whatever
// chunk layout wrote them. A run whose chunks differ from the saved ones (another
// strata.chunk_size, or a parameter alignment the 8-bit moments ask for) loads through it: each
// of its shards is filled parameter piece by parameter piece from the saved chunks, then encoded
// in its own layout (Note [loading another chunk layout] in saved_state_reader.cc).
//
// Every saving rank's manifest is read (a shard of a parameter may sit in another rank's file),
// so the checkpoint folder must be complete and readable from this rank; of the saved states,
// only the shards holding elements asked for are read (bytes_read() counts them), so a rank of a
// larger run reads about its share of the checkpoint, not all of it.
// A value; no LibTorch. Thread safety: one thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/base/status.h"
#include "runtime/state/checkpoint.h"
#include "runtime/state/partitioner.h"
#include "runtime/state/state_layout.h"

namespace strata {

class SavedStateReader {
 public:
  // Reads every rank's manifest in `dir`; `self` is the one this rank already read (its layout
  // section names every parameter's saved chunk and offset). INVALID_ARGUMENT when the
  // checkpoint predates the layout section, DATA_LOSS when a rank's manifest is missing or
  // disagrees with `self`.
  static StatusOr<SavedStateReader> Open(const std::string& dir, const checkpoint::Manifest& self);

  // Parameters, in registration order, as saved: name, element count.
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
    int64_t numel = 0;
    int64_t chunk = 0;
    int64_t offset = 0;
  };
  const std::vector<Param>& params() const { return params_; }
  const StateLayout& layout() const { return layout_; }
  // Whether `kind` was saved (a state the saving optimizer kept).
  bool Has(StateKind kind) const;

  // Elements [begin, begin + count) of parameter `pid`'s saved `kind` (kMaster32, kExpAvg,
  // kExpAvgSq) as fp32 into `out`: each saved shard holding some of them is read from its rank's
  // file, checked against its crc32c and decoded from the saved layout (kept until another chunk
  // or state is asked for, so parameters read in chunk order read each shard once).
  Status Read(StateKind kind, int64_t pid, int64_t begin, int64_t count, float* out);

  // The saved moments are 8-bit with every parameter at a block boundary (as StepPlan::ChunkLayout
  // lays out 8-bit runs), so a parameter's blocks can be copied as they are: decoding and
  // quantizing again is not exact (the signed map's lowest value is above -1, so a block whose
  // largest |value| is negative would get a smaller scale).
  bool Int8BlocksAligned() const { return int8_aligned_; }
  // Int8BlocksAligned: the codes of elements [begin, begin + count) of parameter `pid`'s saved
  // moment `kind`, rounded up to whole blocks (the padding after a parameter is in its last
  // block), into `codes`, and their blocks' scales into `scales`. `begin` is a block boundary.
  Status ReadInt8Blocks(StateKind kind, int64_t pid, int64_t begin, int64_t count, uint8_t* codes,
                        float* scales);

  // Bytes of saved state read from the ranks' files so far, and the size of every saved block
  // of `kind` over all ranks (what reading the whole checkpoint's `kind` would take).
  uint64_t bytes_read() const { return bytes_read_; }
  uint64_t SavedBytes(StateKind kind) const;

 private:
  // Makes elements [first, last) of saved chunk `chunk` of `kind` available: the shards holding
  // them read (raw_), and decoded into cached_ when `decoded`.
  Status Use(StateKind kind, int64_t chunk, int64_t first, int64_t last, bool decoded);
  // Reads and checks saving rank `rank`'s shard of `chunk`'s `kind` into raw_[rank].
  Status ReadShard(StateKind kind, int64_t chunk, int rank);

  std::string dir_;
  std::vector<checkpoint::Manifest> ranks_;  // by rank of the saving run
  int shard_world_ = 1;                      // ranks a chunk is split over when saved
  std::vector<int64_t> shard_numel_;         // per saved chunk
  std::vector<Param> params_;
  StateLayout layout_;
  bool int8_aligned_ = false;
  // The chunk last asked for: the saving ranks' shards read so far, as stored, and those decoded.
  StateKind cached_kind_ = StateKind::kMaster32;
  int64_t cached_chunk_ = -1;
  std::vector<std::vector<char>> raw_;  // by rank; empty when not read
  std::vector<bool> decoded_;           // by rank
  std::vector<float> cached_;           // the whole saved chunk's elements, where decoded
  uint64_t bytes_read_ = 0;
};

}  // namespace strata
