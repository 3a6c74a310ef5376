// SavedStateReader (Note [loading another chunk layout]): a checkpoint of two ranks written by
// hand, read back by parameter across the ranks' files (each shard read only when asked for),
// and the faults it must name: a manifest from before the layout section, a missing rank, a
// parameter outside its chunk, a flipped byte. The 8-bit blocks come back as they were stored,
// codes and scale.
#include "runtime/state/saved_state_reader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <numeric>

#include "optim/compact_formats.h"
#include "tests/test_util.h"
#include "tiers/nvme/crc32c.h"

namespace strata {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

constexpr int64_t kShard = 512;  // elements per rank: a chunk of 1024 split over two ranks

// One saved state of chunk 0: each rank's shard as stored bytes.
struct SavedKind {
  StateKind kind;
  std::vector<std::vector<char>> shards;  // by rank
};

// Writes rank-0000R.{bin,json} for two ranks at stage 2: one chunk, parameters "a" (700
// elements at offset 0, so it spans both ranks) and "b" (250 at 768).
std::vector<checkpoint::Manifest> WriteCheckpoint(const std::string& dir, const std::string& layout,
                                                  const std::vector<SavedKind>& kinds) {
  std::vector<checkpoint::Manifest> out;
  for (int rank = 0; rank < 2; ++rank) {
    checkpoint::Manifest m;
    m.rank = rank;
    m.world_size = 2;
    m.stage = 2;
    m.dtype = "bf16";
    m.state_dtype = layout;
    m.parameters = 950;
    m.shard_numel = {kShard};
    m.layout = {{"shard_offset", {rank * kShard}},
                {"chunk_numel", {2 * kShard}},
                {"params", {{{"name", "a"}, {"shape", {7, 100}}, {"chunk", 0}, {"offset", 0}},
                            {{"name", "b"}, {"shape", {250}}, {"chunk", 0}, {"offset", 768}}}},
                {"buffers", nlohmann::json::array()}};
    std::string bin;
    for (const SavedKind& k : kinds) {
      const auto& bytes = k.shards[rank];
      m.blocks.push_back({0, StateKindName(k.kind), bin.size(), bytes.size(),
                          nvme::Crc32c(bytes.data(), bytes.size())});
      bin.append(bytes.begin(), bytes.end());
    }
    const std::string stem = (fs::path(dir) / checkpoint::RankFileStem(rank)).string();
    std::ofstream(stem + ".bin", std::ios::binary) << bin;
    std::ofstream(stem + ".json") << checkpoint::SerializeManifest(m);
    out.push_back(m);
  }
  return out;
}

std::vector<char> FloatBytes(const float* v, int64_t n) {
  const char* p = reinterpret_cast<const char*>(v);
  return {p, p + n * sizeof(float)};
}

TEST(SavedStateReader, ReadsAParameterAcrossTheRanksFiles) {
  testing::TempDir dir;
  std::vector<float> master(2 * kShard);
  std::iota(master.begin(), master.end(), 0.0f);  // element i of the chunk holds i
  const auto ms = WriteCheckpoint(dir.path(), "fp32", {{StateKind::kMaster32,
                                                       {FloatBytes(master.data(), kShard),
                                                        FloatBytes(master.data() + kShard, kShard)}}});
  ASSERT_OK_AND_ASSIGN(SavedStateReader r, SavedStateReader::Open(dir.path(), ms[1]));
  ASSERT_EQ(r.params().size(), 2u);
  EXPECT_EQ(r.params()[0].numel, 700);
  EXPECT_TRUE(r.Has(StateKind::kMaster32));
  EXPECT_FALSE(r.Has(StateKind::kExpAvg));
  std::vector<float> got(200);
  ASSERT_OK(r.Read(StateKind::kMaster32, 0, 450, 200, got.data()));  // 62 on rank 0, 138 on rank 1
  for (int i = 0; i < 200; ++i) ASSERT_EQ(got[i], 450.0f + i);
  ASSERT_OK(r.Read(StateKind::kMaster32, 1, 0, 3, got.data()));
  EXPECT_EQ(got[0], 768.0f);
  EXPECT_EQ(got[2], 770.0f);
  EXPECT_FALSE(r.Int8BlocksAligned());
}

// A rank reads the saved shards holding what it asks for, not the whole checkpoint: at scale,
// each of N loading ranks reading every saving rank's file multiplies the load's reads by N.
TEST(SavedStateReader, ReadsOnlyTheShardsHoldingWhatIsAskedFor) {
  testing::TempDir dir;
  std::vector<float> master(2 * kShard);
  std::iota(master.begin(), master.end(), 0.0f);
  const auto ms = WriteCheckpoint(
      dir.path(), "fp32",
      {{StateKind::kMaster32,
        {FloatBytes(master.data(), kShard), FloatBytes(master.data() + kShard, kShard)}}});
  const uint64_t shard_bytes = kShard * sizeof(float);
  ASSERT_OK_AND_ASSIGN(SavedStateReader r, SavedStateReader::Open(dir.path(), ms[0]));
  EXPECT_EQ(r.SavedBytes(StateKind::kMaster32), 2 * shard_bytes);
  EXPECT_EQ(r.SavedBytes(StateKind::kExpAvg), 0u);
  EXPECT_EQ(r.bytes_read(), 0u);  // opening reads the manifests alone
  // "b" lies in rank 1's shard: rank 0's file is not read.
  std::vector<float> got(250);
  ASSERT_OK(r.Read(StateKind::kMaster32, 1, 0, 250, got.data()));
  EXPECT_EQ(got[249], 768.0f + 249);
  EXPECT_EQ(r.bytes_read(), shard_bytes);
  // The first 100 elements of "a" lie in rank 0's shard: read once, then kept.
  ASSERT_OK(r.Read(StateKind::kMaster32, 0, 0, 100, got.data()));
  ASSERT_OK(r.Read(StateKind::kMaster32, 0, 100, 100, got.data() + 100));
  for (int i = 0; i < 200; ++i) ASSERT_EQ(got[i], static_cast<float>(i)) << i;
  EXPECT_EQ(r.bytes_read(), 2 * shard_bytes);
  ASSERT_OK(r.Read(StateKind::kMaster32, 0, 450, 200, got.data()));  // across both, both kept
  EXPECT_EQ(got[199], 649.0f);
  EXPECT_EQ(r.bytes_read(), 2 * shard_bytes);
  // A damaged shard is refused by the reader that needs it; one that needs only the other
  // shard reads its values whole and checked.
  {
    const std::string bin = (fs::path(dir.path()) / "rank-00000.bin").string();
    std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.put('\x7f');
  }
  ASSERT_OK_AND_ASSIGN(SavedStateReader fresh, SavedStateReader::Open(dir.path(), ms[1]));
  ASSERT_OK(fresh.Read(StateKind::kMaster32, 1, 0, 250, got.data()));
  EXPECT_EQ(got[0], 768.0f);
  EXPECT_THAT(fresh.Read(StateKind::kMaster32, 0, 0, 10, got.data()).message(),
              HasSubstr("crc32c"));
  EXPECT_EQ(fresh.bytes_read(), shard_bytes);  // the damaged shard is not counted as read
}

TEST(SavedStateReader, CopiesAligned8BitBlocksAsStored) {
  testing::TempDir dir;
  // exp_avg as 8-bit blocks: each rank's shard of 512 elements is two blocks; parameter "b"
  // starts at 768, a block boundary, as under StepPlan::ChunkLayout. Every code differs, every
  // scale differs, so a misplaced copy shows.
  const size_t bytes = optim::MomentBytes(optim::MomentFormat::kInt8, kShard);
  std::vector<std::vector<char>> shards(2, std::vector<char>(bytes));
  for (int rank = 0; rank < 2; ++rank) {
    for (int64_t i = 0; i < kShard; ++i) shards[rank][i] = static_cast<char>((rank * kShard + i) * 7);
    auto* scales = reinterpret_cast<float*>(shards[rank].data() + optim::Int8ScaleOffset(kShard));
    for (int b = 0; b < 2; ++b) scales[b] = 1.0f + static_cast<float>(rank * 2 + b);
  }
  const auto ms = WriteCheckpoint(dir.path(), "int8", {{StateKind::kExpAvg, shards}});
  ASSERT_OK_AND_ASSIGN(SavedStateReader r, SavedStateReader::Open(dir.path(), ms[0]));
  ASSERT_TRUE(r.Int8BlocksAligned());  // both offsets are multiples of the block
  // "a" from its element 256: blocks at chunk 256 (rank 0's second) and 512 (rank 1's first).
  std::vector<uint8_t> codes(512);
  float scales[2];
  ASSERT_OK(r.ReadInt8Blocks(StateKind::kExpAvg, 0, 256, 444, codes.data(), scales));
  for (int64_t i = 0; i < 512; ++i) ASSERT_EQ(codes[i], static_cast<uint8_t>((256 + i) * 7)) << i;
  EXPECT_EQ(scales[0], 2.0f);
  EXPECT_EQ(scales[1], 3.0f);
  // "b": one block, its last 6 codes the padding after it, as stored.
  ASSERT_OK(r.ReadInt8Blocks(StateKind::kExpAvg, 1, 0, 250, codes.data(), scales));
  for (int64_t i = 0; i < 256; ++i) ASSERT_EQ(codes[i], static_cast<uint8_t>((768 + i) * 7)) << i;
  EXPECT_EQ(scales[0], 4.0f);
  // Decoded, the same block is map[code] x scale.
  std::vector<float> values(250);
  ASSERT_OK(r.Read(StateKind::kExpAvg, 1, 0, 250, values.data()));
  EXPECT_EQ(values[5], optim::DynamicMap(true)[static_cast<uint8_t>((768 + 5) * 7)] * 4.0f);
}

TEST(SavedStateReader, NamesWhatIsWrong) {
  testing::TempDir dir;
  std::vector<float> master(2 * kShard, 1.0f);
  auto ms = WriteCheckpoint(dir.path(), "fp32", {{StateKind::kMaster32,
                                                 {FloatBytes(master.data(), kShard),
                                                  FloatBytes(master.data() + kShard, kShard)}}});
  // A manifest from before the layout section.
  checkpoint::Manifest old = ms[0];
  old.layout = nullptr;
  EXPECT_THAT(SavedStateReader::Open(dir.path(), old).status().message(), HasSubstr("predates"));
  // A parameter past its chunk's end.
  checkpoint::Manifest bad = ms[0];
  bad.layout["params"][1]["offset"] = 800;  // 800 + 250 > 1024
  EXPECT_THAT(SavedStateReader::Open(dir.path(), bad).status().message(),
              HasSubstr("'b' lies outside its saved chunk"));
  // A flipped byte in rank 1's file: refused when the piece there is read.
  {
    const std::string bin = (fs::path(dir.path()) / "rank-00001.bin").string();
    std::fstream f(bin, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x7f');
  }
  ASSERT_OK_AND_ASSIGN(SavedStateReader r, SavedStateReader::Open(dir.path(), ms[0]));
  std::vector<float> got(10);
  EXPECT_THAT(r.Read(StateKind::kMaster32, 1, 0, 10, got.data()).message(), HasSubstr("crc32c"));
  // A rank's manifest missing: every saving rank's shards may be needed.
  fs::remove(fs::path(dir.path()) / "rank-00001.json");
  EXPECT_THAT(SavedStateReader::Open(dir.path(), ms[0]).status().message(),
              HasSubstr("whole checkpoint folder must be readable"));
}

}  // namespace
}  // namespace strata
