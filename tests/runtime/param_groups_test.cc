// ShardSegments against a scalar reference: for every element of every rank's shard, the group
// its segment names is the group of the parameter holding that element, or, for an element of no
// parameter, the group of the last parameter before it in the shard (the first one's when the
// shard starts with padding). Segments cover the shard in order and never repeat a group twice
// in a row.
#include "runtime/state/param_groups.h"

#include <gtest/gtest.h>

#include <random>

namespace strata {
namespace {

struct Case {
  std::vector<int64_t> sizes;
  std::vector<int> groups;
  int world;
  uint64_t chunk_bytes;
};

// The expected group of element `e` of `rank`'s shard of `chunk`, element by element.
std::vector<int> Reference(const Partitioner& part, int64_t chunk, int rank,
                           const std::vector<int>& group_of) {
  const ChunkInfo& ci = part.chunks()[chunk];
  const int64_t lo = part.ShardOffset(chunk, rank);
  std::vector<int> owner(ci.shard_numel, -1);
  for (int64_t p : ci.params) {
    const ParamLocation& loc = part.location(p);
    for (int64_t i = loc.offset; i < loc.offset + loc.numel; ++i)
      if (i >= lo && i < lo + ci.shard_numel) owner[i - lo] = group_of[p];
  }
  int first = -1;
  for (int g : owner)
    if (g >= 0 && first < 0) first = g;
  int last = first < 0 ? 0 : first;
  for (int& g : owner) {
    if (g < 0) g = last;
    last = g;
  }
  return owner;
}

void Check(const Case& c) {
  PartitionerOptions o;
  o.world_size = c.world;
  o.element_size = 4;
  o.chunk_size = c.chunk_bytes;
  auto made = Partitioner::Create(o);
  ASSERT_TRUE(made.ok()) << made.status().message();
  Partitioner& part = *made;
  for (size_t i = 0; i < c.sizes.size(); ++i)
    ASSERT_TRUE(part.AddParam("p" + std::to_string(i), c.sizes[i]).ok());
  ASSERT_TRUE(part.Finalize().ok());
  for (int64_t chunk = 0; chunk < static_cast<int64_t>(part.chunks().size()); ++chunk) {
    for (int rank = 0; rank < c.world; ++rank) {
      const std::vector<int> want = Reference(part, chunk, rank, c.groups);
      const std::vector<ShardSegment> segs = ShardSegments(part, chunk, rank, c.groups);
      int64_t at = 0;
      for (size_t s = 0; s < segs.size(); ++s) {
        ASSERT_EQ(segs[s].begin, at) << "chunk " << chunk << " rank " << rank << " segment " << s;
        ASSERT_GT(segs[s].size, 0);
        if (s > 0) {
          EXPECT_NE(segs[s].group, segs[s - 1].group);
        }
        for (int64_t i = segs[s].begin; i < segs[s].begin + segs[s].size; ++i)
          ASSERT_EQ(segs[s].group, want[i]) << "chunk " << chunk << " rank " << rank << " element " << i;
        at += segs[s].size;
      }
      EXPECT_EQ(at, part.chunks()[chunk].shard_numel);
    }
  }
}

TEST(ShardSegments, OneGroupIsOneSegmentPerShard) {
  Case c{{1000, 3, 70000, 5}, {0, 0, 0, 0}, 2, 64 << 10};
  Check(c);
  PartitionerOptions o;
  o.world_size = 1;
  o.element_size = 4;
  auto made = Partitioner::Create(o);
  ASSERT_TRUE(made.ok());
  Partitioner& part = *made;
  for (int64_t n : c.sizes) ASSERT_TRUE(part.AddParam("p", n).ok());
  ASSERT_TRUE(part.Finalize().ok());
  EXPECT_EQ(ShardSegments(part, 0, 0, c.groups).size(), 1u);
}

TEST(ShardSegments, AlternatingGroupsAcrossRanksAndChunks) {
  // Weights and biases in turn, as a transformer's decay / no-decay split lays them out.
  Case c{{4096, 64, 4096, 64, 16384, 7, 3, 20000, 1}, {0, 1, 0, 1, 0, 1, 1, 0, 1}, 3, 32 << 10};
  Check(c);
}

TEST(ShardSegments, RandomLayoutsMatchTheReference) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    Case c;
    const int n = 1 + static_cast<int>(rng() % 12);
    for (int i = 0; i < n; ++i) {
      c.sizes.push_back(1 + static_cast<int64_t>(rng() % 9000));
      c.groups.push_back(static_cast<int>(rng() % 3));
    }
    c.world = 1 + static_cast<int>(rng() % 4);
    c.chunk_bytes = (16 + rng() % 64) << 10;
    Check(c);
  }
}

TEST(ValidateGroup, NamesTheGroupAndTheValue) {
  GroupHyperparameters g;
  EXPECT_TRUE(ValidateGroup(g, 0).ok());
  g.beta2 = 1.0;
  Status s = ValidateGroup(g, 3);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("parameter group 3: betas[1]=1"), std::string::npos) << s.message();
  g = {};
  g.lr = -1;
  EXPECT_NE(ValidateGroup(g, 0).message().find("lr=-1 must be finite and >= 0"), std::string::npos);
}

}  // namespace
}  // namespace strata
