// StepPlan (runtime/state/step_plan.h) as a truth table: each row a config, each column a decision
// worked out by hand from the rules in the header, plus the refusals and the tier sizes.
#include "runtime/state/step_plan.h"

#include <cmath>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace strata {
namespace {

// Chunks of 1024 fp32 elements holding parameters of 1000, 24 and 1000 elements: three chunks,
// as each parameter starts on the partitioner's alignment.
Partitioner Chunks(int world = 1) {
  PartitionerOptions po;
  po.chunk_size = 4096;
  po.world_size = world;
  po.element_size = 4;
  auto p = Partitioner::Create(po).value();
  EXPECT_TRUE(p.AddParam("a", 1000).ok());
  EXPECT_TRUE(p.AddParam("b", 24).ok());
  EXPECT_TRUE(p.AddParam("c", 1000).ok());
  EXPECT_TRUE(p.Finalize().ok());
  return p;
}

struct Row {
  const char* name;
  int stage;
  OffloadDevice param, optim;
  double clipping;
  bool fp16;
  OptimizerType optimizer;
  bool sgd_momentum;
  // Expected decisions.
  Placement want_param, want_optim;
  const char* want_overlap;
  bool want_master_is_param, want_staged_publish, want_exp_avg, want_exp_avg_sq, want_full_grads;
};

const Row kRows[] = {
    {"stage0_device", 0, OffloadDevice::kNone, OffloadDevice::kNone, 0, false, OptimizerType::kAdamW, false,
     Placement::kDevice, Placement::kDevice, "backward", false, false, true, true, true},
    {"stage2_cpu_clip", 2, OffloadDevice::kNone, OffloadDevice::kCpu, 1.0, false, OptimizerType::kAdamW, false,
     Placement::kDevice, Placement::kHost, "in-step", false, true, true, true, false},
    {"stage3_cpu_cpu", 3, OffloadDevice::kCpu, OffloadDevice::kCpu, 0, false, OptimizerType::kAdam, false,
     Placement::kHost, Placement::kHost, "backward", true, false, true, true, false},
    {"stage3_nvme_clip", 3, OffloadDevice::kNvme, OffloadDevice::kNvme, 0.5, false, OptimizerType::kAdamW, false,
     Placement::kNvme, Placement::kNvme, "next-forward", true, false, true, true, false},
    {"stage3_device_params_nvme_optim", 3, OffloadDevice::kNone, OffloadDevice::kNvme, 0, false,
     OptimizerType::kAdamW, false, Placement::kDevice, Placement::kNvme, "backward", false, true, true, true,
     false},
    {"stage1_sgd_no_momentum", 1, OffloadDevice::kNone, OffloadDevice::kNone, 0, false, OptimizerType::kSGD, false,
     Placement::kDevice, Placement::kDevice, "backward", false, false, false, false, true},
    {"stage1_sgd_momentum", 1, OffloadDevice::kNone, OffloadDevice::kNone, 0, false, OptimizerType::kSGD, true,
     Placement::kDevice, Placement::kDevice, "backward", false, false, true, false, true},
    {"stage2_adagrad", 2, OffloadDevice::kNone, OffloadDevice::kNone, 0, false, OptimizerType::kAdagrad, false,
     Placement::kDevice, Placement::kDevice, "backward", false, false, false, true, false},
    {"stage3_lion_host", 3, OffloadDevice::kCpu, OffloadDevice::kCpu, 0, false, OptimizerType::kLion, false,
     Placement::kHost, Placement::kHost, "backward", true, false, true, false, false},
};

class StepPlanTable : public ::testing::TestWithParam<Row> {};

TEST_P(StepPlanTable, DecisionsAreTheRulesOnes) {
  const Row& r = GetParam();
  Config c;
  c.zero_optimization.stage = r.stage;
  c.zero_optimization.offload_param.device = r.param;
  c.zero_optimization.offload_optimizer.device = r.optim;
  c.gradient_clipping = r.clipping;
  c.fp16.enabled = r.fp16;
  c.optimizer.type = r.optimizer;
  Partitioner part = Chunks();
  StepPlan::Inputs in;
  in.config = &c;
  in.device_kind = DeviceKind::kCpu;
  in.device_name = "cpu";
  in.sgd_momentum = r.sgd_momentum;
  in.partitioner = &part;
  ASSERT_OK_AND_ASSIGN(StepPlan p, StepPlan::Make(in));
  EXPECT_EQ(p.ParamPlacement(1), r.want_param);
  EXPECT_EQ(p.PlacementOf(1, StateKind::kGrad), r.want_optim);
  EXPECT_STREQ(p.OptimizerOverlapName(), r.want_overlap);
  EXPECT_EQ(p.MasterIsParam(1), r.want_master_is_param);
  EXPECT_EQ(p.StagedPublish(1), r.want_staged_publish);
  EXPECT_EQ(p.HoldsState(StateKind::kExpAvg), r.want_exp_avg);
  EXPECT_EQ(p.HoldsState(StateKind::kExpAvgSq), r.want_exp_avg_sq);
  EXPECT_EQ(p.full_gradients(), r.want_full_grads);
  EXPECT_EQ(p.MasterKey(1).kind, r.want_master_is_param ? StateKind::kParam16 : StateKind::kMaster32);
  EXPECT_EQ(p.DeviceOptimizer(1), r.want_optim == Placement::kDevice);
  EXPECT_FALSE(p.GpuOptimizer(1));
}

INSTANTIATE_TEST_SUITE_P(Rows, StepPlanTable, ::testing::ValuesIn(kRows),
                         [](const auto& info) { return std::string(info.param.name); });

StatusOr<StepPlan> MakeWith(Config c, DeviceKind kind = DeviceKind::kCpu, bool client = false,
                            int world = 1, bool comm_host = true, bool fp16_ops_in_fp32 = false,
                            optim::DType compute = optim::DType::kFloat32) {
  static Partitioner part = Chunks();
  StepPlan::Inputs in;
  in.compute_dtype = compute;
  in.config = &c;
  in.device_kind = kind;
  in.device_name = kind == DeviceKind::kCuda ? "cuda:0" : "cpu";
  in.client_optimizer = client;
  in.world_size = world;
  in.comm_moves_host_memory = comm_host;
  in.comm_backend = "gloo";
  in.fp16_ops_in_fp32 = fp16_ops_in_fp32;
  in.partitioner = &part;
  return StepPlan::Make(in);
}

void ExpectRefused(const StatusOr<StepPlan>& p, const char* names) {
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find(names), std::string::npos) << p.status();
}

TEST(StepPlanRefusals, NameTheSettings) {
  Config c;
  c.zero_optimization.stage = 3;
  ExpectRefused(MakeWith(c, DeviceKind::kCpu, /*client=*/true), "zero_allow_untested_optimizer");
  Config d;
  d.zero_optimization.offload_param.device = OffloadDevice::kCpu;
  d.zero_optimization.stage = 3;
  ExpectRefused(MakeWith(d), "offload_optimizer.device");
  Config f;
  f.fp16.enabled = true;
  ExpectRefused(MakeWith(f), "fp16.enabled=true on the cpu device");
  // A frontend that computes fp16 operators in fp32 (the Python package) runs it, loss-scaled.
  ASSERT_OK_AND_ASSIGN(StepPlan h, MakeWith(f, DeviceKind::kCpu, false, 1, true, /*fp16_ops_in_fp32=*/true));
  EXPECT_TRUE(h.loss_scaling());
  Config s;
  s.optimizer.type = OptimizerType::kSGD;
  s.strata.optimizer_state_dtype = StateDtype::kBf16;
  ExpectRefused(MakeWith(s), "strata.optimizer_state_dtype=bf16");
  ExpectRefused(MakeWith(Config(), DeviceKind::kCuda, false, 2, /*comm_host=*/true), "nccl");
  // fp16 on a GPU is a loss-scaled plan whose updates wait for the overflow flag.
  ASSERT_OK_AND_ASSIGN(StepPlan g, MakeWith(f, DeviceKind::kCuda));
  EXPECT_TRUE(g.loss_scaling());
  EXPECT_FALSE(g.immediate_optimizer());
  EXPECT_TRUE(g.GpuOptimizer(1));
}

// Tier sizes for stage 3 with everything on NVMe: per chunk (1024 elements), on disk grad 4 KiB,
// two moments 4 KiB each and param16 4 KiB (the master is the working copy, so it has no block);
// in the pool's classes every block is 4 KiB, and the default budget is the host-only bytes
// (none) plus all of the NVMe blocks (less than 16 x the largest).
TEST(StepPlanSizes, NvmeBytesAndTheDefaultHostBudget) {
  Config c;
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  ASSERT_OK_AND_ASSIGN(StepPlan p, MakeWith(c));
  ASSERT_EQ(Chunks().chunks().size(), 3u);
  EXPECT_TRUE(p.MasterIsParam(1));
  EXPECT_EQ(p.nvme_bytes(), 3u * (4096 + 2 * 4096 + 4096));
  EXPECT_EQ(p.host_only_bytes(), 0u);
  EXPECT_EQ(p.host_budget(), 3u * 4 * 4096);
  // A budget too small for a working set is refused by its key.
  c.strata.host_memory_budget = 4096;
  ExpectRefused(MakeWith(c), "strata.host_memory_budget=");
  // Nothing offloaded: no pool.
  ASSERT_OK_AND_ASSIGN(StepPlan none, MakeWith(Config()));
  EXPECT_EQ(none.host_budget(), 0u);
  EXPECT_EQ(none.nvme_bytes(), 0u);
}

// Note [compact layouts]: the formats each setting picks, their block sizes (1024-element
// shards: a bf16 master 2 KiB; 8-bit moments 1024 codes + 4 scales = 1040 B), the bf16 master
// shared with the bf16 working shard under stage 3, and the refusals by key.
TEST(StepPlanCompactLayouts, FormatsBlockBytesAndRefusals) {
  Config c;
  c.bf16.enabled = true;
  c.bf16.bf16_master_weights_and_grads = true;
  c.strata.optimizer_state_dtype = StateDtype::kInt8;
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  ASSERT_OK_AND_ASSIGN(StepPlan p, MakeWith(c, DeviceKind::kCpu, false, 1, true, false,
                                            optim::DType::kBFloat16));
  EXPECT_EQ(p.master_format(), optim::MasterFormat::kBf16Stochastic);
  EXPECT_EQ(p.moment_format(), optim::MomentFormat::kInt8);
  EXPECT_TRUE(p.compact_optimizer());
  EXPECT_TRUE(p.MasterIsParam(1));
  EXPECT_EQ(p.BlockBytes(StateKind::kMaster32, 1024), 2048u);
  EXPECT_EQ(p.BlockBytes(StateKind::kExpAvg, 1024), 1040u);
  EXPECT_EQ(p.BlockBytes(StateKind::kParam16, 1024), 2048u);
  // DeepSpeed's key keeps the gradients in bf16 too, for Adam(W); SGD's kernels take fp32.
  EXPECT_EQ(p.grad_dtype(), optim::DType::kBFloat16);
  EXPECT_EQ(p.BlockBytes(StateKind::kGrad, 1024), 2048u);
  Config sgd_master = c;
  sgd_master.optimizer.type = OptimizerType::kSGD;
  sgd_master.strata.optimizer_state_dtype = StateDtype::kFp32;
  ASSERT_OK_AND_ASSIGN(StepPlan m, MakeWith(sgd_master, DeviceKind::kCpu, false, 1, true, false,
                                            optim::DType::kBFloat16));
  EXPECT_EQ(m.grad_dtype(), optim::DType::kFloat32);
  EXPECT_EQ(p.StateLayoutName(), "int8+bf16_master");
  // The smallest layout has nothing left to offer a refusal; the others name what would shrink
  // them, and nothing about moments for an optimizer that keeps none.
  EXPECT_EQ(p.ShrinkHint(), "");
  EXPECT_EQ(m.ShrinkHint(), "");  // SGD without momentum keeps no moments; its master is bf16
  Config wide = c;
  wide.bf16.bf16_master_weights_and_grads = false;
  const auto bf16 = [](const Config& k) {
    return MakeWith(k, DeviceKind::kCpu, false, 1, true, false, optim::DType::kBFloat16);
  };
  ASSERT_OK_AND_ASSIGN(StepPlan w, bf16(wide));
  EXPECT_EQ(w.ShrinkHint(), "a bf16 master (bf16.bf16_master_weights_and_grads)");
  wide.strata.optimizer_state_dtype = StateDtype::kBf16;
  ASSERT_OK_AND_ASSIGN(StepPlan wb, bf16(wide));
  EXPECT_EQ(wb.ShrinkHint(), "8-bit moments (strata.optimizer_state_dtype: int8) or a bf16 master "
                             "(bf16.bf16_master_weights_and_grads)");
  wide.strata.optimizer_state_dtype = StateDtype::kFp32;
  ASSERT_OK_AND_ASSIGN(StepPlan wf, bf16(wide));
  EXPECT_EQ(wf.ShrinkHint(), "8-bit or bf16 moments (strata.optimizer_state_dtype: int8 or bf16) or "
                             "a bf16 master (bf16.bf16_master_weights_and_grads)");
  // fp32 compute: the bf16 master needs bf16 compute too. A client optimizer: nothing of Strata's.
  ASSERT_OK_AND_ASSIGN(StepPlan f32, MakeWith(wide));
  EXPECT_EQ(f32.ShrinkHint(), "8-bit or bf16 moments (strata.optimizer_state_dtype: int8 or bf16) or "
                              "bf16 compute with a bf16 master (bf16.enabled and "
                              "bf16.bf16_master_weights_and_grads)");
  Config client;  // nothing offloaded: a client optimizer runs where the partition lives
  client.zero_allow_untested_optimizer = true;
  ASSERT_OK_AND_ASSIGN(StepPlan cl, MakeWith(client, DeviceKind::kCpu, /*client=*/true));
  EXPECT_EQ(cl.ShrinkHint(), "");
  // On disk per chunk: grad 2 KiB, two 1040-byte moments and the bf16 working shard (it is the
  // master), 2048 B, each rounded to 4 KiB.
  EXPECT_EQ(p.nvme_bytes(), 3u * (4096 + 2 * 4096 + 4096));
  c.strata.stochastic_rounding = false;
  ASSERT_OK_AND_ASSIGN(StepPlan n, MakeWith(c, DeviceKind::kCpu, false, 1, true, false,
                                            optim::DType::kBFloat16));
  EXPECT_EQ(n.master_format(), optim::MasterFormat::kBf16Nearest);
  // Refused: a bf16 master without bf16 compute; SGD without momentum; a client optimizer.
  ExpectRefused(MakeWith(c), "set bf16.enabled=true");
  Config sgd = c;
  sgd.optimizer.type = OptimizerType::kSGD;  // without momentum: no state for int8 to hold
  ExpectRefused(MakeWith(sgd, DeviceKind::kCpu, false, 1, true, false, optim::DType::kBFloat16),
                "SGD without momentum keeps no optimizer state");
  Config gpu = c;
  gpu.zero_optimization.stage = 2;
  gpu.zero_optimization.offload_param.device = OffloadDevice::kNone;
  gpu.zero_optimization.offload_optimizer.device = OffloadDevice::kNone;
  // A GPU updates a compact layout with its own kernels (kernels/cuda_compact_kernels.cu).
  ASSERT_OK_AND_ASSIGN(StepPlan g, MakeWith(gpu, DeviceKind::kCuda, false, 1, true, false,
                                            optim::DType::kBFloat16));
  EXPECT_TRUE(g.compact_optimizer());
  EXPECT_TRUE(g.GpuOptimizer(0));
  ExpectRefused(MakeWith(gpu, DeviceKind::kCpu, true, 1, true, false, optim::DType::kBFloat16),
                "client optimizer");
}

// StateLayout (runtime/state/state_layout.h): names as checkpoints record them, block sizes, and
// a conversion through fp32 that keeps what the narrower format can hold.
TEST(StateLayout, NamesSizesAndConversions) {
  for (const char* name : {"fp32", "bf16", "int8", "fp32+bf16_master", "int8+bf16_master"}) {
    ASSERT_OK_AND_ASSIGN(StateLayout l, StateLayout::Parse(name));
    EXPECT_EQ(l.Name(), name);
  }
  EXPECT_FALSE(StateLayout::Parse("fp16").ok());
  EXPECT_FALSE(StateLayout::Parse("+bf16_master").ok());
  ASSERT_OK_AND_ASSIGN(StateLayout compact, StateLayout::Parse("int8+bf16_master"));
  EXPECT_EQ(compact.Bytes(StateKind::kMaster32, 1000), 2000u);
  EXPECT_EQ(compact.Bytes(StateKind::kExpAvgSq, 1000), 1000u + 16u);  // 4 scales
  const StateLayout plain;
  std::vector<float> x(1000);
  for (size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i)) * 1e-3f;
  std::vector<char> block(compact.Bytes(StateKind::kExpAvg, 1000));
  compact.Encode(StateKind::kExpAvg, x.data(), 1000, block.data());
  std::vector<float> back(1000);
  compact.Decode(StateKind::kExpAvg, block.data(), 1000, back.data());
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_NEAR(back[i], x[i], optim::DynamicMapMaxError(true) * 1e-3f * 1.0001f) << i;
  std::vector<char> master(compact.Bytes(StateKind::kMaster32, 1000));
  compact.Encode(StateKind::kMaster32, x.data(), 1000, master.data());
  std::vector<float> m16(1000), m32(1000);
  compact.Decode(StateKind::kMaster32, master.data(), 1000, m16.data());
  std::vector<char> fp32(plain.Bytes(StateKind::kMaster32, 1000));
  plain.Encode(StateKind::kMaster32, m16.data(), 1000, fp32.data());
  plain.Decode(StateKind::kMaster32, fp32.data(), 1000, m32.data());
  EXPECT_EQ(m16, m32);  // a bf16 master is exact in fp32
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(m16[i], optim::Bf16ToFloat(optim::FloatToBf16(x[i])));
}

// strata.placement auto measures the machine (the inputs' capacities); budgets set above what it
// has, and NVMe needed without a path, are refused by their keys.
TEST(StepPlanAutoPlacement, BudgetsBeyondTheMachineAndAMissingPathAreNamed) {
  static Partitioner part = Chunks();
  auto make = [](const Config& c, uint64_t host_available, uint64_t disk_free, bool path,
                 uint64_t given_back = 0) {
    StepPlan::Inputs in;
    in.disk_given_back = given_back;
    in.config = &c;
    in.device_kind = DeviceKind::kCpu;
    in.device_name = "cpu";
    in.partitioner = &part;
    in.device_capacity = 4 << 20;
    in.host_available = host_available;
    in.disk_free = disk_free;
    in.nvme_path_given = path;
    return StepPlan::Make(in);
  };
  Config c;
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  c.strata.placement = PlacementMode::kAuto;
  c.strata.host_memory_budget = 8ull << 30;
  ExpectRefused(make(c, 4ull << 30, 1ull << 40, true), "strata.host_memory_budget=8.00 GiB is more than");
  c.strata.host_memory_budget = 0;
  c.strata.nvme_capacity = 2ull << 40;
  ExpectRefused(make(c, 4ull << 30, 1ull << 40, true), "strata.nvme_capacity=2.00 TiB is more than");
  // Nothing fits the device (budget 4 KiB, all reserved) nor the host (4 KiB above the 2 GiB
  // margin kept for the process): NVMe is needed, and there is no path.
  c.strata.nvme_capacity = 0;
  c.strata.device_memory_budget = 4096;
  const uint64_t tight = (2ull << 30) + 4096;
  ExpectRefused(make(c, tight, 1ull << 40, false), "no nvme_path");
  // With a path it plans, every block on NVMe, and sizes the disk for them.
  ASSERT_OK_AND_ASSIGN(StepPlan p, make(c, tight, 1ull << 40, true));
  EXPECT_EQ(p.PlacementOf(0, StateKind::kGrad), Placement::kNvme);
  EXPECT_EQ(p.nvme_bytes(), p.placement().TierBytes(Placement::kNvme));
  // The disk's budget is what is free less 1 GiB, and a zero::Init staging file on it that the
  // start gives back counts too (Note [start's disk] in runtime/engine/engine_init.cc): half the
  // state free is refused naming the disk, and with the other half in the file it plans.
  const uint64_t state = p.nvme_bytes();
  ExpectRefused(make(c, tight, (1ull << 30) + state / 2, true), "free more disk at the nvme_path");
  ASSERT_OK_AND_ASSIGN(StepPlan q, make(c, tight, (1ull << 30) + state / 2, true, state / 2 + (1 << 20)));
  EXPECT_EQ(q.nvme_bytes(), state);
  c.strata.nvme_capacity = state;
  ExpectRefused(make(c, tight, state / 2, true, state / 4), "of zero::Init's staging file");
  ASSERT_OK(make(c, tight, state / 2, true, state / 2).status());
  c.strata.nvme_capacity = 0;
  // A client optimizer keeps everything on the device: auto is refused for it.
  ExpectRefused(MakeWith([] {
                  Config a;
                  a.strata.placement = PlacementMode::kAuto;
                  return a;
                }(), DeviceKind::kCpu, /*client=*/true),
                "strata.placement config");
}

}  // namespace
}  // namespace strata
