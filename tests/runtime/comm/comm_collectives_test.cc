// Collectives over whatever communicator the environment selects: run directly it tests
// `single`; run under strata-launch (ctest: comm_collectives_{2,3}ranks, label multiproc) it
// tests `gloo` over loopback with every rank running the same sequence.
//
// Every rank fills its inputs from (rank, index) so each rank can compute the exact expected
// result locally. Values are small integers, exact in bf16/fp16/fp32, so sums compare exactly.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "runtime/comm/backends.h"
#include "runtime/comm/host_reduce.h"
#include "runtime/state/partitioner.h"
#include "tests/test_util.h"

namespace strata {
namespace {

Communicator* g_comm = nullptr;

class CommEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    CommOptions opts;
    opts.backend = "auto";
    opts.timeout_s = 30;
    auto comm = CreateCommunicator(opts);
    ASSERT_TRUE(comm.ok()) << comm.status().ToString();
    comm_ = std::move(comm).value();
    g_comm = comm_.get();
  }
  void TearDown() override {
    if (comm_) EXPECT_OK(comm_->Barrier());
    g_comm = nullptr;
    comm_.reset();
  }

 private:
  std::unique_ptr<Communicator> comm_;
};

// A value exact in every dtype (|v| <= 255 keeps bf16 exact), distinct per rank and index.
float Value(int rank, int64_t i) { return static_cast<float>((i * 7 + rank * 13) % 64 + rank); }

// Typed storage with conversions, so one test body covers f32, bf16 and f16.
struct Buf {
  DType dtype;
  std::vector<char> bytes;
  Buf(DType d, int64_t n) : dtype(d), bytes(n * DTypeSize(d), 0) {}
  void* data() { return bytes.data(); }
  int64_t size() const { return static_cast<int64_t>(bytes.size() / DTypeSize(dtype)); }
  void Set(int64_t i, float v) {
    if (dtype == DType::kF32) {
      std::memcpy(&bytes[i * 4], &v, 4);
    } else {
      const uint16_t h = dtype == DType::kBF16 ? FloatToBf16(v) : FloatToFp16(v);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  float Get(int64_t i) const {
    if (dtype == DType::kF32) {
      float v;
      std::memcpy(&v, &bytes[i * 4], 4);
      return v;
    }
    uint16_t h;
    std::memcpy(&h, &bytes[i * 2], 2);
    return dtype == DType::kBF16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
  }
};

// Rounds like the reduction does: fp32 accumulate, then one rounding to the dtype.
float RoundTo(DType d, float v) {
  if (d == DType::kBF16) return Bf16ToFloat(FloatToBf16(v));
  if (d == DType::kF16) return Fp16ToFloat(FloatToFp16(v));
  return v;
}

struct Case {
  DType dtype;
  int64_t count;
};

class CollectiveTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    ASSERT_NE(g_comm, nullptr);
    // A previous test may have shrunk the buckets.
    ASSERT_OK(g_comm->SetBucketSizes(BucketSizes{}));
  }
};

TEST_P(CollectiveTest, AllGather) {
  const auto [dtype, count] = GetParam();
  Communicator& c = *g_comm;
  const int n = c.world_size(), me = c.rank();
  Buf shard(dtype, count), full(dtype, count * n);
  for (int64_t i = 0; i < count; ++i) shard.Set(i, Value(me, i));
  ASSERT_OK(c.AllGather(shard.data(), full.data(), count, dtype));
  int64_t bad = 0;
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < count; ++i) bad += full.Get(r * count + i) != Value(r, i);
  }
  EXPECT_EQ(bad, 0);
}

TEST_P(CollectiveTest, AllGatherInPlace) {
  const auto [dtype, count] = GetParam();
  Communicator& c = *g_comm;
  const int n = c.world_size(), me = c.rank();
  Buf full(dtype, count * n);
  for (int64_t i = 0; i < count; ++i) full.Set(me * count + i, Value(me, i));
  char* shard = static_cast<char*>(full.data()) + me * count * DTypeSize(dtype);
  ASSERT_OK(c.AllGather(shard, full.data(), count, dtype));
  int64_t bad = 0;
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < count; ++i) bad += full.Get(r * count + i) != Value(r, i);
  }
  EXPECT_EQ(bad, 0);
}

TEST_P(CollectiveTest, ReduceScatterAvgAndSum) {
  const auto [dtype, count] = GetParam();
  Communicator& c = *g_comm;
  const int n = c.world_size(), me = c.rank();
  Buf full(dtype, count * n), shard(dtype, count);
  for (int64_t i = 0; i < count * n; ++i) full.Set(i, Value(me, i));
  for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kSum, ReduceOp::kMax}) {
    ASSERT_OK(c.ReduceScatter(full.data(), shard.data(), count, dtype, op));
    int64_t bad = 0;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t g = me * count + i;
      float sum = 0, mx = -1e30f;
      for (int r = 0; r < n; ++r) {
        sum += Value(r, g);
        mx = std::max(mx, Value(r, g));
      }
      const float want = op == ReduceOp::kAvg   ? RoundTo(dtype, sum / n)
                         : op == ReduceOp::kSum ? RoundTo(dtype, sum)
                                                : mx;
      bad += shard.Get(i) != want;
    }
    EXPECT_EQ(bad, 0) << ReduceOpName(op);
  }
}

TEST_P(CollectiveTest, AllReduceSumAndMax) {
  const auto [dtype, count] = GetParam();
  Communicator& c = *g_comm;
  const int n = c.world_size(), me = c.rank();
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
    Buf buf(dtype, count);
    for (int64_t i = 0; i < count; ++i) buf.Set(i, Value(me, i));
    ASSERT_OK(c.AllReduce(buf.data(), count, dtype, op));
    int64_t bad = 0;
    for (int64_t i = 0; i < count; ++i) {
      float sum = 0, mx = -1e30f;
      for (int r = 0; r < n; ++r) {
        sum += Value(r, i);
        mx = std::max(mx, Value(r, i));
      }
      bad += buf.Get(i) != (op == ReduceOp::kSum ? RoundTo(dtype, sum) : mx);
    }
    EXPECT_EQ(bad, 0) << ReduceOpName(op);
  }
}

TEST_P(CollectiveTest, BroadcastFromLastRank) {
  const auto [dtype, count] = GetParam();
  Communicator& c = *g_comm;
  const int n = c.world_size(), me = c.rank();
  const int root = n - 1;
  Buf buf(dtype, count);
  for (int64_t i = 0; i < count; ++i) buf.Set(i, Value(me, i));
  ASSERT_OK(c.Broadcast(buf.data(), count, dtype, root));
  int64_t bad = 0;
  for (int64_t i = 0; i < count; ++i) bad += buf.Get(i) != Value(root, i);
  EXPECT_EQ(bad, 0);
}

INSTANTIATE_TEST_SUITE_P(
    OddSizes, CollectiveTest,
    ::testing::Values(Case{DType::kF32, 1}, Case{DType::kF32, 7}, Case{DType::kF32, 1000003},
                      Case{DType::kBF16, 1}, Case{DType::kBF16, 7},
                      Case{DType::kBF16, 1000003}, Case{DType::kF16, 7},
                      Case{DType::kF16, 100003}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return StrCat(DTypeName(info.param.dtype), "_", info.param.count);
    });

TEST(CommTest, TinyBucketsSplitCallsAndKeepResults) {
  Communicator& c = *g_comm;
  const int n = c.world_size(), me = c.rank();
  ASSERT_OK(c.SetBucketSizes({/*allgather=*/5 * n, /*reduce=*/3 * n}));
  const int64_t count = 1001;
  Buf shard(DType::kF32, count), full(DType::kF32, count * n), back(DType::kF32, count);
  for (int64_t i = 0; i < count; ++i) shard.Set(i, Value(me, i));
  const int64_t calls0 = c.backend_calls();
  ASSERT_OK(c.AllGather(shard.data(), full.data(), count, DType::kF32));
  EXPECT_EQ(c.backend_calls() - calls0, (count + 4) / 5);  // 5 elements of each shard per call
  int64_t bad = 0;
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < count; ++i) bad += full.Get(r * count + i) != Value(r, i);
  }
  EXPECT_EQ(bad, 0);
  // Every rank holds the same gathered buffer; the averaged reduce-scatter returns my shard.
  const int64_t calls1 = c.backend_calls();
  ASSERT_OK(c.ReduceScatter(full.data(), back.data(), count, DType::kF32, ReduceOp::kAvg));
  EXPECT_EQ(c.backend_calls() - calls1, (count + 2) / 3);
  bad = 0;
  for (int64_t i = 0; i < count; ++i) bad += back.Get(i) != Value(me, i);
  EXPECT_EQ(bad, 0);
  // All-reduce in reduce-bucket pieces.
  std::vector<int32_t> flags(17, me == 0 ? 1 : 0);
  ASSERT_OK(c.AllReduce(flags.data(), 17, DType::kI32, ReduceOp::kMax));
  for (int32_t f : flags) EXPECT_EQ(f, 1);
  ASSERT_OK(c.SetBucketSizes(BucketSizes{}));
  EXPECT_FALSE(c.SetBucketSizes({0, 1}).ok());
}

// Partition round trip: each rank keeps only its shards of every chunk; gathering them rebuilds
// every parameter bit for bit, through tiny buckets as well.
TEST(CommTest, PartitionRoundTripRebuildsParameters) {
  Communicator& c = *g_comm;
  const int n = c.world_size(), me = c.rank();
  PartitionerOptions o;
  o.chunk_size = 256 << 10;
  o.world_size = n;
  o.element_size = 2;
  ASSERT_OK_AND_ASSIGN(Partitioner p, Partitioner::Create(o));
  const std::vector<int64_t> sizes = {1, 7, 1000003, 4095, 33, 131072, 5};
  for (size_t k = 0; k < sizes.size(); ++k) {
    ASSERT_OK(p.AddParam(StrCat("p", k), sizes[k]).status());
  }
  ASSERT_OK(p.Finalize());
  // Original tensors, identical on every rank (bf16 bit patterns).
  std::vector<std::vector<uint16_t>> params(sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k) {
    params[k].resize(sizes[k]);
    for (int64_t i = 0; i < sizes[k]; ++i) {
      params[k][i] = FloatToBf16(static_cast<float>((k * 31 + i) % 251) - 125.0f);
    }
  }
  for (int bucket : {0, 1}) {
    if (bucket) ASSERT_OK(c.SetBucketSizes({1000 * n, 1000 * n}));
    for (size_t ch = 0; ch < p.chunks().size(); ++ch) {
      const ChunkInfo& info = p.chunks()[ch];
      // The shard this rank would keep: the slice of the packed chunk it owns.
      std::vector<uint16_t> packed(info.numel, 0), shard(info.shard_numel);
      for (int64_t id : info.params) {
        const ParamLocation& loc = p.location(id);
        std::memcpy(&packed[loc.offset], params[id].data(), loc.numel * 2);
      }
      std::memcpy(shard.data(), &packed[p.ShardOffset(ch, me)], info.shard_numel * 2);
      std::vector<uint16_t> rebuilt(info.numel, 0xFFFF);
      ASSERT_OK(c.AllGather(shard.data(), rebuilt.data(), info.shard_numel, DType::kBF16));
      EXPECT_EQ(rebuilt, packed) << "chunk " << ch;
      for (int64_t id : info.params) {
        const ParamLocation& loc = p.location(id);
        EXPECT_EQ(0, std::memcmp(&rebuilt[loc.offset], params[id].data(), loc.numel * 2))
            << p.param_name(id);
      }
    }
  }
  ASSERT_OK(c.SetBucketSizes(BucketSizes{}));
}

// Per-rank bytes of stages 1/2/3 equal ZeRO's formulas, and every rank computes the same.
TEST(CommTest, StageMemoryPerRankMatchesExpectedBytes) {
  Communicator& c = *g_comm;
  const int n = c.world_size(), me = c.rank();
  PartitionerOptions o;
  o.chunk_size = 1 << 20;
  o.world_size = n;
  o.element_size = 2;
  ASSERT_OK_AND_ASSIGN(Partitioner p, Partitioner::Create(o));
  for (int64_t s : {300000, 300000, 1000003, 7}) ASSERT_OK(p.AddParam("w", s).status());
  ASSERT_OK(p.Finalize());
  const int64_t unit = n * 4096 / 2;
  auto round_up = [&](int64_t v) { return (v + unit - 1) / unit * unit; };
  // Hand layout: 300000 | 300000 (spills) | 1000003 (oversized, alone) | 7 (own chunk).
  const int64_t psi = round_up(300000) * 2 + round_up(1000003) + round_up(7);
  ASSERT_EQ(p.total_numel(), psi);
  const int64_t per = psi / n;
  const int64_t expected[4] = {16 * psi, 4 * psi + 12 * per, 2 * psi + 14 * per, 16 * per};
  for (int stage = 1; stage <= 3; ++stage) {
    ASSERT_OK_AND_ASSIGN(StagePlan plan, p.PlanFor(stage, me));
    EXPECT_EQ(static_cast<int64_t>(plan.total_bytes()), expected[stage]) << "stage " << stage;
    // Allocate what the plan says and check the shards tile the chunks exactly.
    std::vector<int64_t> mine(n, 0), all(n * 1, 0);
    mine[0] = static_cast<int64_t>(plan.total_bytes());
    std::vector<int64_t> gathered(n);
    ASSERT_OK(c.AllGather(mine.data(), gathered.data(), 1, DType::kI64));
    for (int r = 0; r < n; ++r) EXPECT_EQ(gathered[r], expected[stage]) << "rank " << r;
  }
  // Stage 3: the sharded bytes over all ranks add up to the whole model's 16Ψ.
  ASSERT_OK_AND_ASSIGN(StagePlan s3, p.PlanFor(3, me));
  int64_t total = static_cast<int64_t>(s3.total_bytes());
  ASSERT_OK(c.AllReduce(&total, 1, DType::kI64, ReduceOp::kSum));
  EXPECT_EQ(total, 16 * psi);
}

TEST(CommTest, BarrierAndCountZeroAreFine) {
  Communicator& c = *g_comm;
  ASSERT_OK(c.Barrier());
  ASSERT_OK(c.AllGather(nullptr, nullptr, 0, DType::kF32));
  EXPECT_FALSE(c.Broadcast(nullptr, 1, DType::kF32, 0).ok());
  float x = 1;
  EXPECT_FALSE(c.Broadcast(&x, 1, DType::kF32, c.world_size()).ok());
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new strata::CommEnvironment);
  return RUN_ALL_TESTS();
}
