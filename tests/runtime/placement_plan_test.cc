// PlacementPlan (runtime/state/placement_plan.h) as tables: budgets and knobs in, the tier of
// every chunk's working shard and optimizer group out, worked out by hand from the header's
// rules; the refusals name the tiers, the budgets and the fix.
#include "runtime/state/placement_plan.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/test_util.h"

namespace strata {
namespace {

constexpr uint64_t kMiB = 1ull << 20, kGiB = 1ull << 30;
constexpr uint64_t kPage = 4096;  // a host-placed block here takes one page more (PoolResidentBytes)
constexpr int64_t kChunk = int64_t{1} << 26;  // elements per chunk shard

// Four chunks of 64 Mi elements; a 16-bit working shard (128 MiB) and four fp32 optimizer
// blocks (256 MiB each: a group is 1 GiB).
PlacementPlan::Inputs Base() {
  PlacementPlan::Inputs in;
  in.shard_numel.assign(4, kChunk);
  in.block_bytes = [](StateKind k, int64_t n) {
    return static_cast<uint64_t>(n) * (k == StateKind::kParam16 ? 2 : 4);
  };
  in.stage3 = true;
  for (StateKind k : {StateKind::kGrad, StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq})
    in.kept[static_cast<int>(k)] = true;
  in.master_shares_param = false;
  in.device_budget_source = "strata.device_memory_budget";
  in.host_budget_source = "strata.host_memory_budget";
  in.nvme_budget_source = "strata.nvme_capacity";
  return in;
}

// "DDHN": the tier of each chunk, D(evice), H(ost) or N(vme).
std::string Tiers(const PlacementPlan& p, bool param) {
  std::string s;
  for (int64_t c = 0; c < p.num_chunks(); ++c) {
    const Placement t = param ? p.ParamOf(c) : p.OptimOf(c);
    s += t == Placement::kDevice ? 'D' : t == Placement::kHost ? 'H' : 'N';
  }
  return s;
}

struct Row {
  const char* name;
  PlacementMode mode;
  Placement param_floor, optim_floor;
  double ratio;
  int64_t max_in_cpu;
  uint64_t device, host, nvme;
  const char* want_param;
  const char* want_optim;
};

const Row kRows[] = {
    // The sections as written.
    {"config_cpu", PlacementMode::kConfig, Placement::kHost, Placement::kHost, 1.0, -1, 0, 0, 0, "HHHH", "HHHH"},
    {"config_nvme", PlacementMode::kConfig, Placement::kNvme, Placement::kNvme, 1.0, -1, 0, 0, 0, "NNNN", "NNNN"},
    // ratio 0.5: half of the elements' groups (and their shards) stay on the device.
    {"ratio_half", PlacementMode::kConfig, Placement::kDevice, Placement::kHost, 0.5, -1, 0, 0, 0, "DDDD", "DDHH"},
    {"ratio_quarter_nvme", PlacementMode::kConfig, Placement::kNvme, Placement::kNvme, 0.75, -1, 0, 0, 0, "DNNN",
     "DNNN"},
    {"ratio_zero", PlacementMode::kConfig, Placement::kDevice, Placement::kHost, 0.0, -1, 0, 0, 0, "DDDD", "DDDD"},
    // max_in_cpu: shards up to 2.5 chunks' elements stay in host memory (two whole chunks).
    {"max_in_cpu", PlacementMode::kConfig, Placement::kNvme, Placement::kNvme, 1.0, kChunk * 5 / 2, 0, 0, 0,
     "HHNN", "NNNN"},
    {"max_in_cpu_zero", PlacementMode::kConfig, Placement::kNvme, Placement::kNvme, 1.0, 0, 0, 0, 0, "NNNN",
     "NNNN"},
    // auto: the device takes every shard (512 MiB), then chunk 0's group (1 GiB); the host holds
    // the other three groups whole, so nothing goes to NVMe.
    {"auto_device_then_host", PlacementMode::kAuto, Placement::kNvme, Placement::kNvme, 1.0, -1, 1536 * kMiB,
     6 * kGiB, 100 * kGiB, "DDDD", "DHHH"},
    // A 2 GiB host cannot hold the 3 GiB below the device, and its NVMe working set (16 of the
    // 256 MiB blocks, capped at what goes to NVMe) takes all of it.
    {"auto_spills_to_nvme", PlacementMode::kAuto, Placement::kNvme, Placement::kNvme, 1.0, -1, 1536 * kMiB,
     2 * kGiB, 100 * kGiB, "DDDD", "DNNN"},
    // A floor of cpu keeps the groups off NVMe; the device still takes what it can.
    {"auto_floor_cpu", PlacementMode::kAuto, Placement::kHost, Placement::kHost, 1.0, -1, 1 * kGiB, 8 * kGiB, 0,
     "DDDD", "HHHH"},
    // No device room, and 4.5 GiB below it: the host keeps a 4 GiB working set for NVMe blocks
    // and fills the 0.25 GiB (and a page per block) left in chunk order, shards first.
    {"auto_host_only", PlacementMode::kAuto, Placement::kNvme, Placement::kNvme, 1.0, -1, 0,
     4 * kGiB + 256 * kMiB + 2 * kPage, 100 * kGiB, "HHNN", "NNNN"},
    // The same less one byte: the second shard no longer fits.
    {"auto_host_only_a_byte_less", PlacementMode::kAuto, Placement::kNvme, Placement::kNvme, 1.0, -1, 0,
     4 * kGiB + 256 * kMiB + 2 * kPage - 1, 100 * kGiB, "HNNN", "NNNN"},
};

class PlacementTable : public ::testing::TestWithParam<Row> {};

TEST_P(PlacementTable, TiersAreTheRulesOnes) {
  const Row& r = GetParam();
  PlacementPlan::Inputs in = Base();
  in.mode = r.mode;
  in.param_floor = r.param_floor;
  in.optim_floor = r.optim_floor;
  in.ratio = r.ratio;
  in.max_in_cpu = r.max_in_cpu;
  in.device_budget = r.device;
  in.host_budget = r.host;
  in.nvme_budget = r.nvme;
  in.nvme_available = true;
  ASSERT_OK_AND_ASSIGN(PlacementPlan p, PlacementPlan::Make(in));
  EXPECT_EQ(Tiers(p, true), r.want_param);
  EXPECT_EQ(Tiers(p, false), r.want_optim);
  // The bytes per tier are the blocks' sizes summed where the tiers say.
  uint64_t sum = 0;
  for (Placement t : {Placement::kDevice, Placement::kHost, Placement::kNvme}) sum += p.TierBytes(t);
  EXPECT_EQ(sum, 4 * (128 * kMiB + kGiB));
  int device_groups = 0;
  for (char ch : std::string(r.want_optim)) device_groups += ch == 'D';
  EXPECT_EQ(p.Bytes(Placement::kDevice, StateKind::kExpAvg), device_groups * 256 * kMiB);
  if (r.mode == PlacementMode::kAuto) {
    EXPECT_LE(p.TierBytes(Placement::kDevice), r.device);
    EXPECT_LE(p.TierBytes(Placement::kHost), r.host);
    EXPECT_LE(p.TierBytes(Placement::kNvme), r.nvme);
  }
  EXPECT_EQ(p.ToJson()["device"]["optimizer_chunks"], device_groups);
}

INSTANTIATE_TEST_SUITE_P(Rows, PlacementTable, ::testing::ValuesIn(kRows),
                         [](const auto& info) { return std::string(info.param.name); });

// Note [shared master]: a chunk whose shard and group share a tier stores no master block; split
// across tiers, it does.
TEST(PlacementPlan, SharedMasterTakesNoBytes) {
  PlacementPlan::Inputs in = Base();
  in.master_shares_param = true;
  in.param_floor = in.optim_floor = Placement::kHost;
  in.ratio = 0.5;
  ASSERT_OK_AND_ASSIGN(PlacementPlan p, PlacementPlan::Make(in));
  EXPECT_TRUE(p.MasterSharesParam(0));  // shard and group on the device
  EXPECT_TRUE(p.MasterSharesParam(3));  // both on the host
  EXPECT_EQ(p.Bytes(Placement::kDevice, StateKind::kMaster32), 0u);
  EXPECT_EQ(p.Bytes(Placement::kHost, StateKind::kMaster32), 0u);
  EXPECT_EQ(p.Bytes(Placement::kDevice, StateKind::kExpAvg), 2 * 256 * kMiB);
  EXPECT_EQ(p.Lines().size(), 2u);
  // Shards on the host, groups on NVMe: every master is a block of its own.
  in.optim_floor = Placement::kNvme;
  in.ratio = 1;
  in.nvme_available = true;
  ASSERT_OK_AND_ASSIGN(PlacementPlan q, PlacementPlan::Make(in));
  EXPECT_FALSE(q.MasterSharesParam(0));
  EXPECT_EQ(q.Bytes(Placement::kNvme, StateKind::kMaster32), 4 * 256 * kMiB);
}

// Note [whole chunks]: where the master can be the working shard, auto lifts a chunk's shard
// only with its group. The device (1.5 GiB) takes chunk 0 whole (896 MiB: its master is its
// shard), not chunk 1 too (1.75 GiB); the host (6 GiB, everything below fits) takes the rest
// whole, where the masters are the shards as well.
TEST(PlacementPlan, AutoMovesWholeChunksWhereTheMasterIsTheShard) {
  PlacementPlan::Inputs in = Base();
  in.master_shares_param = true;
  in.mode = PlacementMode::kAuto;
  in.param_floor = in.optim_floor = Placement::kNvme;
  in.device_budget = 1536 * kMiB;
  in.host_budget = 6 * kGiB;
  in.nvme_budget = 100 * kGiB;
  in.nvme_available = true;
  ASSERT_OK_AND_ASSIGN(PlacementPlan p, PlacementPlan::Make(in));
  EXPECT_EQ(Tiers(p, true), "DHHH");
  EXPECT_EQ(Tiers(p, false), "DHHH");
  EXPECT_EQ(p.Bytes(Placement::kHost, StateKind::kMaster32), 0u);
  EXPECT_EQ(p.Bytes(Placement::kDevice, StateKind::kMaster32), 0u);
  EXPECT_EQ(p.Bytes(Placement::kDevice, StateKind::kExpAvg), 256 * kMiB);
  // Eight chunks and a host with room for two whole ones (896 MiB and a page per block each)
  // after the 4 GiB NVMe working set: whole chunks or none, the others on NVMe, sharing there.
  in.shard_numel.assign(8, kChunk);
  in.host_budget = 4 * kGiB + 2 * (896 * kMiB + 4 * kPage);
  ASSERT_OK_AND_ASSIGN(PlacementPlan q, PlacementPlan::Make(in));
  EXPECT_EQ(Tiers(q, true), "DHHNNNNN");
  EXPECT_EQ(Tiers(q, false), "DHHNNNNN");
  EXPECT_EQ(q.Bytes(Placement::kNvme, StateKind::kMaster32), 0u);
}

// Note [resident region] in tiers/host/pinned_pool.cc: on the host a block takes its size and a
// page, not a power-of-two class. Chunks of 48 Mi elements have 96 MiB shards and 192 MiB fp32
// blocks (classes 128 and 256 MiB): a host of exactly their sizes holds all of them, where the
// classes would have held three chunks of four.
TEST(PlacementPlan, HostBlocksTakeTheirSizeNotAClass) {
  PlacementPlan::Inputs in = Base();
  in.shard_numel.assign(4, 3 * (int64_t{1} << 24));
  in.mode = PlacementMode::kAuto;
  in.param_floor = in.optim_floor = Placement::kNvme;
  in.device_budget = 0;
  in.nvme_budget = 100 * kGiB;
  in.nvme_available = true;
  const uint64_t chunk = 96 * kMiB + 4 * 192 * kMiB + 5 * kPage;
  in.host_budget = 4 * chunk;
  ASSERT_OK_AND_ASSIGN(PlacementPlan p, PlacementPlan::Make(in));
  EXPECT_EQ(Tiers(p, true), "HHHH");
  EXPECT_EQ(Tiers(p, false), "HHHH");
  EXPECT_EQ(p.TierBytes(Placement::kHost), 4 * (96 * kMiB + 4 * 192 * kMiB));
  EXPECT_EQ(in.host_budget / (128 * kMiB + 4 * 256 * kMiB), 3u);  // chunks the classes would hold
}

void ExpectRefused(const StatusOr<PlacementPlan>& p, std::initializer_list<const char*> pieces) {
  ASSERT_FALSE(p.ok());
  for (const char* piece : pieces)
    EXPECT_NE(p.status().message().find(piece), std::string::npos) << p.status().message();
}

TEST(PlacementPlan, RefusalsNameTheTiersAndTheFix) {
  PlacementPlan::Inputs in = Base();
  in.mode = PlacementMode::kAuto;
  in.param_floor = in.optim_floor = Placement::kNvme;
  in.device_budget = 1 * kGiB;
  in.host_budget = 1 * kGiB;
  in.nvme_budget = 1 * kGiB;
  in.nvme_available = true;
  // 4.5 GiB of state against 3 GiB of tiers: more disk is the fix, or what the layout has left
  // to shrink; a layout with nothing left offers only the disk.
  in.shrink_hint = "8-bit moments (strata.optimizer_state_dtype: int8)";
  ExpectRefused(PlacementPlan::Make(in), {"4.50 GiB", "device 1.00 GiB", "host 1.00 GiB",
                                          "nvme 1.00 GiB", "raise strata.nvme_capacity",
                                          "or shrink the state: 8-bit moments"});
  in.shrink_hint.clear();
  const auto smallest = PlacementPlan::Make(in);
  ExpectRefused(smallest, {"raise strata.nvme_capacity by"});
  EXPECT_EQ(smallest.status().message().find("shrink"), std::string::npos) << smallest.status().message();
  in.nvme_available = false;
  ExpectRefused(PlacementPlan::Make(in), {"no nvme_path"});
  // Device floors that do not fit the device.
  PlacementPlan::Inputs d = Base();
  d.mode = PlacementMode::kAuto;
  d.device_budget = 1 * kGiB;
  d.host_budget = 100 * kGiB;
  ExpectRefused(PlacementPlan::Make(d), {"device is none", "raise strata.device_memory_budget"});
  // Host floors that do not fit the host, and nothing may spill.
  PlacementPlan::Inputs h = Base();
  h.mode = PlacementMode::kAuto;
  h.param_floor = h.optim_floor = Placement::kHost;
  h.host_budget = 1 * kGiB;
  ExpectRefused(PlacementPlan::Make(h), {"device is cpu", "raise strata.host_memory_budget"});
  // ratio outside [0, 1].
  PlacementPlan::Inputs r = Base();
  r.optim_floor = Placement::kHost;
  r.ratio = 1.5;
  ExpectRefused(PlacementPlan::Make(r), {"ratio=1.5", "[0, 1]"});
  // A device optimizer with offloaded parameters.
  PlacementPlan::Inputs o = Base();
  o.param_floor = Placement::kHost;
  ExpectRefused(PlacementPlan::Make(o), {"offload_optimizer.device=none"});
}

}  // namespace
}  // namespace strata
