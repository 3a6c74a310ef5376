#include "runtime/state/saved_state_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "runtime/base/check.h"

namespace strata {

// Note [loading another chunk layout]
// A checkpoint stores each rank's shard of each chunk, block after block, and its manifest's layout
// section says where every parameter sat (chunk, offset). A run with other chunks (another
// chunk_size; or 8-bit moments, which start each parameter at a 256-element boundary) cannot take
// those blocks as they are, but every element of a master or a moment belongs to one parameter and
// one position in it, and that is what both runs agree on. So the loader walks its own shards; for
// each parameter piece in a shard it asks this reader for the same elements of the same parameter,
// and the reader finds them in the saved chunk, reads the saving ranks' shards of it that hold them
// (a chunk of a stage-0 run is whole in each file), decodes those to fp32 and copies the piece. A
// shard is read whole (its crc32c covers it whole) and only when asked for, so each rank of a run
// reads about its share of the checkpoint (the shards its own shards overlap), not every rank's.
// Padding stays zero. The result is encoded in the loading run's layout, so a layout change (fp32
// to 8-bit moments) and a chunk change happen in one pass, and every fp32 and bf16 value arrives
// exact. 8-bit moments saved by a run that started each parameter at a block boundary (every 8-bit
// run does: StepPlan::ChunkLayout) are copied block by block, codes and scale, so they arrive exact
// too; older 8-bit checkpoints are decoded and quantized again, which moves a block's scale where
// its largest |value| was negative.

StatusOr<SavedStateReader> SavedStateReader::Open(const std::string& dir,
                                                  const checkpoint::Manifest& self) {
  namespace fs = std::filesystem;
  SavedStateReader r;
  r.dir_ = dir;
  if (self.layout.is_null() || !self.layout.contains("params"))
    return InvalidArgument(StrCat(dir, " predates the layout section of checkpoint manifests, so "
                                  "its states can only load into the same chunks: use the "
                                  "strata.chunk_size and optimizer_state_dtype it was saved with"));
  STRATA_ASSIGN_OR_RETURN(r.layout_, StateLayout::Parse(self.state_dtype));
  r.shard_world_ = self.stage == 0 ? 1 : self.world_size;
  r.shard_numel_ = self.shard_numel;
  try {
    for (const auto& p : self.layout.at("params")) {
      Param q;
      q.name = p.at("name").get<std::string>();
      q.shape = p.at("shape").get<std::vector<int64_t>>();
      q.numel = 1;
      for (const int64_t d : q.shape) q.numel *= d;
      q.chunk = p.at("chunk").get<int64_t>();
      q.offset = p.at("offset").get<int64_t>();
      if (q.chunk < 0 || q.chunk >= static_cast<int64_t>(r.shard_numel_.size()) || q.offset < 0 ||
          q.offset + q.numel > r.shard_numel_[q.chunk] * r.shard_world_)
        return DataLoss(StrCat(dir, ": parameter '", q.name, "' lies outside its saved chunk"));
      r.params_.push_back(std::move(q));
    }
  } catch (const nlohmann::json::exception& e) {
    return DataLoss(StrCat(dir, ": the manifest's layout section is malformed: ", e.what()));
  }
  r.int8_aligned_ = r.layout_.moments == optim::MomentFormat::kInt8;
  for (const Param& p : r.params_)
    if (p.offset % static_cast<int64_t>(optim::kInt8Block) != 0) r.int8_aligned_ = false;
  r.ranks_.resize(static_cast<size_t>(r.shard_world_));
  for (int rank = 0; rank < r.shard_world_; ++rank) {
    if (rank == self.rank) {
      r.ranks_[rank] = self;
      continue;
    }
    const std::string path = (fs::path(dir) / (checkpoint::RankFileStem(rank) + ".json")).string();
    auto text = checkpoint::ReadFile(path);
    if (!text.ok())
      return DataLoss(StrCat(path, " cannot be read (", text.status().message(),
                             "): loading into other chunks reads every saving rank's shards, so "
                             "the whole checkpoint folder must be readable from each rank"));
    STRATA_ASSIGN_OR_RETURN(r.ranks_[rank], checkpoint::ParseManifest(*text, path));
    if (r.ranks_[rank].shard_numel != self.shard_numel || r.ranks_[rank].state_dtype != self.state_dtype)
      return DataLoss(StrCat(path, " disagrees with rank ", self.rank,
                             "'s manifest about the chunks or the state layout"));
  }
  return r;
}

bool SavedStateReader::Has(StateKind kind) const {
  for (const auto& e : ranks_.front().blocks)
    if (e.state == StateKindName(kind)) return true;
  return false;
}

uint64_t SavedStateReader::SavedBytes(StateKind kind) const {
  uint64_t total = 0;
  for (const checkpoint::Manifest& m : ranks_)
    for (const auto& e : m.blocks)
      if (e.state == StateKindName(kind)) total += e.bytes;
  return total;
}

Status SavedStateReader::ReadShard(StateKind kind, int64_t chunk, int rank) {
  namespace fs = std::filesystem;
  const uint64_t bytes = layout_.Bytes(kind, shard_numel_[chunk]);
  const checkpoint::BlockEntry* entry = nullptr;
  for (const auto& e : ranks_[rank].blocks)
    if (e.chunk == chunk && e.state == StateKindName(kind)) entry = &e;
  const std::string bin = (fs::path(dir_) / (checkpoint::RankFileStem(rank) + ".bin")).string();
  const std::string what = StrCat("chunk ", chunk, "'s ", StateKindName(kind));
  if (entry == nullptr || entry->bytes != bytes)
    return DataLoss(StrCat(bin, ": ", what, " is missing or has the wrong size"));
  std::vector<char> raw(bytes);
  STRATA_ASSIGN_OR_RETURN(const int fd, checkpoint::OpenCheckpointFile(bin));
  Status s =
      checkpoint::ReadChecked(fd, bin, entry->offset, bytes, entry->crc32c, what, raw.data());
  ::close(fd);
  STRATA_RETURN_IF_ERROR(s);
  bytes_read_ += bytes;
  raw_[rank] = std::move(raw);  // only once it is whole and checked
  return Status::Ok();
}

Status SavedStateReader::Use(StateKind kind, int64_t chunk, int64_t first, int64_t last,
                             bool decoded) {
  const int64_t n = shard_numel_[chunk];
  if (cached_chunk_ != chunk || cached_kind_ != kind) {
    cached_kind_ = kind;
    cached_chunk_ = chunk;
    raw_.assign(static_cast<size_t>(shard_world_), {});
    decoded_.assign(static_cast<size_t>(shard_world_), false);
    cached_.clear();
  }
  if (last <= first) return Status::Ok();
  for (auto rank = static_cast<int>(first / n); rank <= static_cast<int>((last - 1) / n); ++rank) {
    if (raw_[rank].empty()) STRATA_RETURN_IF_ERROR(ReadShard(kind, chunk, rank));
    if (decoded && !decoded_[rank]) {
      if (cached_.empty()) cached_.assign(static_cast<size_t>(n * shard_world_), 0.0f);
      layout_.Decode(kind, raw_[rank].data(), n, cached_.data() + rank * n);
      decoded_[rank] = true;
    }
  }
  return Status::Ok();
}

Status SavedStateReader::ReadInt8Blocks(StateKind kind, int64_t pid, int64_t begin, int64_t count,
                                        uint8_t* codes, float* scales) {
  constexpr auto kBlock = static_cast<int64_t>(optim::kInt8Block);
  STRATA_DCHECK(int8_aligned_ && kind != StateKind::kMaster32, "8-bit blocks of a ", StateKindName(kind));
  STRATA_DCHECK(pid >= 0 && pid < static_cast<int64_t>(params_.size()), "parameter ", pid);
  const Param& p = params_[pid];
  STRATA_DCHECK(begin % kBlock == 0 && count >= 0 && begin + count <= p.numel, "elements ", begin,
                "+", count, " of '", p.name, "'");
  const int64_t n = shard_numel_[p.chunk];  // a multiple of the block: no block spans two ranks
  const int64_t blocks = (count + kBlock - 1) / kBlock;
  STRATA_RETURN_IF_ERROR(
      Use(kind, p.chunk, p.offset + begin, p.offset + begin + blocks * kBlock, /*decoded=*/false));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = p.offset + begin + b * kBlock;  // in the saved chunk
    const auto& raw = raw_[static_cast<size_t>(at / n)];
    const int64_t j = at % n;
    std::memcpy(codes + b * kBlock, raw.data() + j, static_cast<size_t>(kBlock));
    std::memcpy(&scales[b], raw.data() + optim::Int8ScaleOffset(static_cast<size_t>(n)) + (j / kBlock) * sizeof(float),
                sizeof(float));
  }
  return Status::Ok();
}

Status SavedStateReader::Read(StateKind kind, int64_t pid, int64_t begin, int64_t count, float* out) {
  STRATA_DCHECK(pid >= 0 && pid < static_cast<int64_t>(params_.size()), "parameter ", pid);
  const Param& p = params_[pid];
  STRATA_DCHECK(begin >= 0 && count >= 0 && begin + count <= p.numel, "elements ", begin, "+", count,
               " of '", p.name, "' (", p.numel, ")");
  STRATA_RETURN_IF_ERROR(
      Use(kind, p.chunk, p.offset + begin, p.offset + begin + count, /*decoded=*/true));
  std::copy_n(cached_.data() + p.offset + begin, count, out);
  return Status::Ok();
}

}  // namespace strata
