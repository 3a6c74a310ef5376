#include "runtime/state/partitioner.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace strata {
namespace {

int64_t RoundUp(int64_t v, int64_t unit) { return (v + unit - 1) / unit * unit; }

Partitioner Make(uint64_t chunk_size, int world, int esize = 2) {
  PartitionerOptions o;
  o.chunk_size = chunk_size;
  o.world_size = world;
  o.element_size = esize;
  auto p = Partitioner::Create(o);
  EXPECT_TRUE(p.ok()) << p.status().ToString();
  return std::move(p).value();
}

TEST(PartitionerTest, RejectsBadOptionsWithNamedValue) {
  PartitionerOptions o;
  o.world_size = 0;
  auto p = Partitioner::Create(o);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("world_size=0"), std::string::npos);
  o.world_size = 2;
  o.element_size = 3;
  p = Partitioner::Create(o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("element_size=3"), std::string::npos);
  o.element_size = 2;
  o.shard_alignment = 3000;
  EXPECT_FALSE(Partitioner::Create(o).ok());
}

TEST(PartitionerTest, PacksInRegistrationOrderWithAlignedOffsets) {
  Partitioner p = Make(1 << 20, 1);  // 524288 bf16 elements per chunk
  ASSERT_OK_AND_ASSIGN(int64_t a, p.AddParam("a", 7));
  ASSERT_OK_AND_ASSIGN(int64_t b, p.AddParam("b", 1));
  ASSERT_OK_AND_ASSIGN(int64_t c, p.AddParam("c", 100));
  ASSERT_OK(p.Finalize());
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 1);
  EXPECT_EQ(c, 2);
  ASSERT_EQ(p.chunks().size(), 1u);
  // 64-byte alignment = 32 bf16 elements.
  EXPECT_EQ(p.location(a).offset, 0);
  EXPECT_EQ(p.location(b).offset, 32);
  EXPECT_EQ(p.location(c).offset, 64);
  EXPECT_EQ(p.chunks()[0].used_numel, 164);
  EXPECT_EQ(p.chunks()[0].numel, 2048);  // one 4096-byte shard
  EXPECT_EQ(p.param_numel(), 108);
}

TEST(PartitionerTest, SpillsToNewChunkAndGivesOversizedParamItsOwnChunk) {
  const int world = 3;
  Partitioner p = Make(1 << 20, world);  // capacity 524288 elements
  ASSERT_OK(p.AddParam("w0", 300000).status());
  ASSERT_OK(p.AddParam("w1", 300000).status());   // does not fit after w0
  ASSERT_OK(p.AddParam("big", 1000003).status()); // larger than a chunk
  ASSERT_OK(p.AddParam("tail", 5).status());      // must not join big's chunk
  ASSERT_OK(p.Finalize());
  ASSERT_EQ(p.chunks().size(), 4u);
  const int64_t unit = world * 4096 / 2;
  const int64_t expect_used[] = {300000, 300000, 1000003, 5};
  for (int c = 0; c < 4; ++c) {
    const ChunkInfo& ch = p.chunks()[c];
    EXPECT_EQ(ch.used_numel, expect_used[c]) << c;
    EXPECT_EQ(ch.numel, RoundUp(expect_used[c], unit)) << c;
    EXPECT_EQ(ch.shard_numel * world, ch.numel);
    EXPECT_EQ(ch.shard_numel * 2 % 4096, 0) << "shard bytes must suit O_DIRECT";
    EXPECT_EQ(p.location(c).chunk, c);
    EXPECT_EQ(p.location(c).offset, 0);
  }
  EXPECT_GT(p.chunks()[2].numel, 524288);
}

TEST(PartitionerTest, OwnersAndShardOffsets) {
  Partitioner p = Make(64 << 10, 2, 4);
  ASSERT_OK(p.AddParam("x", 10000).status());
  ASSERT_OK(p.Finalize());
  const ChunkInfo& c = p.chunks()[0];
  EXPECT_EQ(c.numel, 10240);  // 2 ranks x 4096 B / 4 B = 2048-element unit
  EXPECT_EQ(c.shard_numel, 5120);
  EXPECT_EQ(p.OwnerOf(0, 0), 0);
  EXPECT_EQ(p.OwnerOf(0, 5119), 0);
  EXPECT_EQ(p.OwnerOf(0, 5120), 1);
  EXPECT_EQ(p.OwnerOf(0, 10239), 1);
  EXPECT_EQ(p.ShardOffset(0, 1), 5120);
}

TEST(PartitionerTest, AddAfterFinalizeFails) {
  Partitioner p = Make(1 << 20, 1);
  ASSERT_OK(p.AddParam("x", 1).status());
  ASSERT_OK(p.Finalize());
  auto r = p.AddParam("y", 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(p.AddParam("z", 0).ok());
}

TEST(PartitionerTest, AddRejectsEmptyParam) {
  Partitioner p = Make(1 << 20, 1);
  auto r = p.AddParam("empty", 0);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("'empty' numel=0"), std::string::npos);
}

// ZeRO's memory model: with Ψ padded elements, bf16 params and fp32 Adam states, a rank keeps
// stage 0: 16Ψ, stage 1: 4Ψ + 12Ψ/N, stage 2: 2Ψ + 14Ψ/N, stage 3: 16Ψ/N bytes.
TEST(PartitionerTest, StagePlansMatchZeroFormulas) {
  for (int world : {1, 2, 3, 4}) {
    Partitioner p = Make(1 << 20, world);
    ASSERT_OK(p.AddParam("a", 300000).status());
    ASSERT_OK(p.AddParam("b", 77).status());
    ASSERT_OK(p.AddParam("c", 1000003).status());
    ASSERT_OK(p.Finalize());
    const uint64_t psi = p.total_numel();
    ASSERT_EQ(psi % world, 0u);
    const uint64_t per = psi / world;
    const uint64_t expected[4] = {16 * psi, 4 * psi + 12 * per, 2 * psi + 14 * per, 16 * per};
    for (int stage = 0; stage <= 3; ++stage) {
      for (int rank = 0; rank < world; ++rank) {
        ASSERT_OK_AND_ASSIGN(StagePlan plan, p.PlanFor(stage, rank));
        EXPECT_EQ(plan.total_bytes(), expected[stage]) << "stage " << stage << " world " << world;
        EXPECT_EQ(plan.sharded[static_cast<int>(StateKind::kParam16)], stage >= 3);
        EXPECT_EQ(plan.sharded[static_cast<int>(StateKind::kGrad)], stage >= 2);
        EXPECT_EQ(plan.sharded[static_cast<int>(StateKind::kExpAvgSq)], stage >= 1);
      }
    }
  }
}

TEST(PartitionerTest, Fp32ParamsHaveNoSeparateMasterAndBf16StatesHalveMoments) {
  Partitioner p = Make(1 << 20, 2, 4);
  ASSERT_OK(p.AddParam("a", 4096).status());
  ASSERT_OK(p.Finalize());
  ASSERT_OK_AND_ASSIGN(StagePlan plan, p.PlanFor(3, 1, /*optimizer_state_size=*/2));
  const uint64_t per = p.shard_numel_per_rank();
  EXPECT_EQ(plan.bytes[static_cast<int>(StateKind::kMaster32)], 0u);
  EXPECT_EQ(plan.bytes[static_cast<int>(StateKind::kParam16)], 4 * per);
  EXPECT_EQ(plan.bytes[static_cast<int>(StateKind::kExpAvg)], 2 * per);
  EXPECT_FALSE(p.PlanFor(4, 0).ok());
  EXPECT_FALSE(p.PlanFor(1, 2).ok());
}

}  // namespace
}  // namespace strata
