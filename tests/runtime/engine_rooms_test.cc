// The engine's rooms through their own interfaces, without an engine: the chunk table's
// transitions and invariants, the unit coordinator's distances and orders, the optimizer lane's order, errors and step inputs, the reduce
// lane's two ways of running a job. (The engine suites test them together; these pin down each
// contract the headers state.)
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/engine/chunk_table.h"
#include "runtime/engine/lane_trace.h"
#include "runtime/engine/optimizer_lane.h"
#include "runtime/engine/reduce_lane.h"
#include "runtime/engine/unit_coordinator.h"
#include "runtime/engine/unit_rule.h"
#include "tiers/hbm/device_factory.h"

namespace strata {
namespace {

// ---------------------------------------------------------------------------------------------
// ChunkTable

TEST(ChunkTable, LiveElementsFollowInstallAndDrop) {
  ChunkTable t({100, 30, 7});
  int a = 0, b = 0;
  EXPECT_EQ(t.live_elems(), 0);
  t.Installed(0, &a);
  t.Installed(2, &b);
  EXPECT_EQ(t.live_elems(), 107);
  EXPECT_TRUE(t.installed(0));
  EXPECT_FALSE(t.installed(1));
  EXPECT_EQ(t[0].buffer, &a);
  t[0].buffer = nullptr;  // the engine frees the memory, then records the drop
  t.Dropped(0);
  EXPECT_EQ(t.live_elems(), 7);
  t.CheckInvariants();
}

TEST(ChunkTable, HoldersCountUsers) {
  ChunkTable t({4});
  int m = 0;
  t.Installed(0, &m);
  t.Hold(0);
  t.Hold(0);
  EXPECT_EQ(t.holders(0), 2);
  EXPECT_FALSE(t.Release(0));  // one holder left
  EXPECT_TRUE(t.Release(0));   // the last
  EXPECT_EQ(t.holders(0), 0);
}

TEST(ChunkTable, FillSettledReportsTheAllGatherAhead) {
  ChunkTable t({8, 8});
  int m0 = 0, m1 = 0;
  t.Installed(0, &m0);
  t.Installed(1, &m1);
  t.FillStarted(0, /*all_gather=*/true);
  t.FillStarted(1, /*all_gather=*/false);
  EXPECT_TRUE(t.filling(0));
  EXPECT_TRUE(t.all_gather_ahead(0));
  EXPECT_FALSE(t.all_gather_ahead(1));
  t.CheckInvariants();
  EXPECT_TRUE(t.FillSettled(0));
  EXPECT_FALSE(t.FillSettled(1));
  EXPECT_FALSE(t.filling(0));
  EXPECT_FALSE(t.all_gather_ahead(0));
  t.CheckInvariants();
}

TEST(ChunkTable, PersistenceIsFixedPerChunk) {
  ChunkTable t({1, 2});
  t.SetPersistent(1, true);
  EXPECT_FALSE(t.persistent(0));
  EXPECT_TRUE(t.persistent(1));
}

TEST(ChunkTableDeathTest, BrokenTransitionsAbort) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  int m = 0;
  EXPECT_DEATH(
      {
        ChunkTable t({4});
        t.Installed(0, &m);
        t.Installed(0, &m);
      },
      "chunk 0 installed twice");
  EXPECT_DEATH(
      {
        ChunkTable t({4});
        t[0].buffer = nullptr;
        t.Dropped(0);
      },
      "dropped but not installed");
  EXPECT_DEATH(
      {
        ChunkTable t({4});
        t.Installed(0, &m);
        t.Hold(0);
        t[0].buffer = nullptr;
        t.Dropped(0);
      },
      "dropped with 1 holder");
  EXPECT_DEATH(
      {
        ChunkTable t({4});
        t.Installed(0, &m);
        t.FillStarted(0, false);
        t[0].buffer = nullptr;
        t.Dropped(0);
      },
      "copy ahead unsettled");
  EXPECT_DEATH(
      {
        ChunkTable t({4});
        t.Installed(0, &m);
        t.Dropped(0);  // memory still set: the caller forgot to free it
      },
      "dropped with its memory");
  EXPECT_DEATH(
      {
        ChunkTable t({4});
        t.FillStarted(0, false);
      },
      "not installed or already filling");
  EXPECT_DEATH(
      {
        ChunkTable t({4});
        t.Installed(0, &m);
        t.Release(0);
      },
      "released more often than gathered");
}

// ---------------------------------------------------------------------------------------------
// UnitCoordinator

// The root (always live, chunk 0) and three units; unit 1 and 2 share chunk 2.
UnitCoordinator FourUnits() {
  UnitCoordinator units;
  auto unit = [](std::vector<int64_t> params, std::vector<int64_t> chunks, int64_t elems,
                 bool root) {
    UnitCoordinator::Unit u;
    u.params = std::move(params);
    u.chunks = std::move(chunks);
    u.elems = elems;
    u.always_live = root;
    return u;
  };
  EXPECT_EQ(units.Add(unit({0}, {0}, 10, true)), 0);
  EXPECT_EQ(units.Add(unit({1, 2}, {1, 2}, 20, false)), 1);
  EXPECT_EQ(units.Add(unit({3}, {2, 3}, 30, false)), 2);
  EXPECT_EQ(units.Add(unit({4}, {4}, 40, false)), 3);
  return units;
}

TEST(UnitCoordinator, ForwardReuseFollowsThePreviousOrderUntilItDiverges) {
  UnitCoordinator units = FourUnits();
  units.BeginMicroStep();
  for (int64_t u : {1, 2, 3}) units.RecordForward(u);
  // The first micro-step has no previous order: nothing is known to come back.
  EXPECT_EQ(units.ForwardReuseDistance(0), UnitCoordinator::kNever);
  units.EndMicroStep();
  units.BeginMicroStep();
  EXPECT_EQ(units.RecordForward(1), 0u);
  // Unit 1 comes back in backward after units 2 and 3 were gathered twice each: 2*30 + 2*40.
  EXPECT_EQ(units.ForwardReuseDistance(0), 140);
  EXPECT_EQ(units.RecordForward(3), 1u);  // not unit 2: this forward left the previous order
  EXPECT_EQ(units.ForwardReuseDistance(1), UnitCoordinator::kNever);
}

TEST(UnitCoordinator, BackwardReuseCountsOnlyUnitsStillWaitingForGradients) {
  UnitCoordinator units = FourUnits();
  units.BeginMicroStep();
  for (int64_t u : {1, 2, 3}) units.RecordForward(u);
  EXPECT_EQ(units[2].grads_pending, 1);  // BeginMicroStep: every parameter still to come
  // Chunk 2 is unit 2's and unit 1's: next needed by unit 2, after unit 3's 40 elements.
  EXPECT_EQ(units.BackwardReuseDistance(2), 40);
  units[3].grads_pending = 0;  // unit 3's backward is done: it gathers nothing more
  EXPECT_EQ(units.BackwardReuseDistance(2), 0);
  units[2].grads_pending = 0;
  EXPECT_EQ(units.BackwardReuseDistance(2), 0);  // unit 1 still needs it
  EXPECT_EQ(units.BackwardReuseDistance(3), UnitCoordinator::kNever);  // only unit 2's, done
  EXPECT_EQ(units.BackwardReuseDistance(0), UnitCoordinator::kNever);  // the root's: no unit
}

TEST(UnitCoordinator, BackwardWalksTheTraceFromTheEnd) {
  UnitCoordinator units = FourUnits();
  units.BeginMicroStep();
  for (int64_t u : {1, 2, 1}) units.RecordForward(u);  // unit 1 ran twice
  units.BeginBackward();
  EXPECT_EQ(units.ReachedInBackward(1), 2);  // its later run first
  EXPECT_EQ(units.ReachedInBackward(2), 1);
  EXPECT_EQ(units.ReachedInBackward(1), 0);
  EXPECT_EQ(units.ReachedInBackward(3), -1);  // never ran
}

TEST(UnitCoordinator, VisitNearGoesForwardInTheLastOrderAndBackwardInThisOne) {
  UnitCoordinator units = FourUnits();
  units.BeginMicroStep();
  for (int64_t u : {1, 2, 3}) units.RecordForward(u);
  units.EndMicroStep();
  units.BeginMicroStep();
  for (int64_t u : {3, 2}) units.RecordForward(u);
  std::vector<std::pair<int64_t, int64_t>> seen;
  auto record = [&](int64_t u, int64_t d) {
    seen.push_back({u, d});
    return true;
  };
  units.VisitNear(0, +1, record);
  EXPECT_EQ(seen, (std::vector<std::pair<int64_t, int64_t>>{{2, 1}, {3, 2}}));
  seen.clear();
  units.VisitNear(1, -1, record);
  EXPECT_EQ(seen, (std::vector<std::pair<int64_t, int64_t>>{{3, 1}}));
  seen.clear();
  units.VisitNear(0, +1, [&](int64_t u, int64_t d) {
    seen.push_back({u, d});
    return false;  // stop after the first
  });
  EXPECT_EQ(seen.size(), 1u);
}

TEST(UnitCoordinator, ChunkOrderPutsWhatStaysGatheredFirstThenTheTrace) {
  UnitCoordinator units = FourUnits();
  const std::vector<int64_t> order =
      units.ChunkOrder({3, 1}, 6, [](int64_t c) { return c == 5; });
  // The root's chunk, the chunk that stays gathered, unit 3's, unit 1's, then the rest.
  EXPECT_EQ(order, (std::vector<int64_t>{0, 5, 4, 1, 2, 3}));
}

// ---------------------------------------------------------------------------------------------
// OptimizerLane

class OptimizerLaneTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = CreateDevice("cpu");
    ASSERT_TRUE(d.ok()) << d.status();
    device_ = std::move(*d);
  }
  // A lane whose updates record their chunk, then wait until `open` (so a test can queue
  // several while the first runs), and fail for chunk `fail_on`.
  std::unique_ptr<OptimizerLane> MakeLane(int64_t chunks, int64_t fail_on = -1) {
    return std::make_unique<OptimizerLane>(
        chunks, device_.get(), &trace_, /*publish=*/nullptr,
        [this, fail_on](int64_t c, const OptimizerLane::StepInputs& in,
                        std::optional<PublishLane::Copy>*, double*) {
          {
            std::lock_guard<std::mutex> l(mu_);
            order_.push_back(c);
            steps_.push_back(in.step);
          }
          while (!open_.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
          return c == fail_on ? Internal("update failed") : Status::Ok();
        },
        nullptr);
  }
  std::unique_ptr<Device> device_;
  LaneTrace trace_;
  std::mutex mu_;
  std::vector<int64_t> order_, steps_;
  std::atomic<bool> open_{false};
};

TEST_F(OptimizerLaneTest, RunsInQueueOrderAndAWaiterPullsItsChunkForward) {
  auto lane = MakeLane(5);
  OptimizerLane::StepInputs in;
  in.step = 7;
  lane->SetStepInputs(in);
  lane->Start();
  for (int64_t c = 0; c < 5; ++c) lane->Enqueue(c);
  // Chunk 0 is running (held by `open_`); 1..4 are queued. A waiter for 3 moves it ahead of 1.
  while (true) {
    std::lock_guard<std::mutex> l(mu_);
    if (!order_.empty()) break;
  }
  EXPECT_TRUE(lane->Pending(3));
  // This thread promotes 3 as WaitUpdated begins, long before the opener lets chunk 0 finish.
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    open_ = true;
  });
  double waited = 0;
  EXPECT_TRUE(lane->WaitUpdated(3, &waited, /*trace_step=*/-1).ok());
  EXPECT_GT(waited, 0.0);
  opener.join();
  EXPECT_FALSE(lane->Pending(3));
  EXPECT_TRUE(lane->Drain().ok());
  EXPECT_EQ(order_, (std::vector<int64_t>{0, 3, 1, 2, 4}));
  EXPECT_EQ(steps_, (std::vector<int64_t>(5, 7)));  // every update saw the step's inputs
  EXPECT_GE(lane->busy_seconds(), 0.0);
  lane->ResetStats();
  EXPECT_EQ(lane->busy_seconds(), 0.0);
}

TEST_F(OptimizerLaneTest, AFailedUpdateDropsTheStepsLaterOnesAndDrainReportsItOnce) {
  open_ = true;
  auto lane = MakeLane(4, /*fail_on=*/1);
  lane->Start();
  for (int64_t c = 0; c < 4; ++c) lane->Enqueue(c);
  Status s = lane->Drain();
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.ToString().find("update failed"), std::string::npos) << s;
  // Updates queued after the failure did not run: the step is already lost.
  EXPECT_EQ(order_, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(lane->Drain().ok());  // cleared
  for (int64_t c = 0; c < 4; ++c) EXPECT_FALSE(lane->Pending(c));
}

TEST_F(OptimizerLaneTest, StepInputsMayNotChangeUnderPendingUpdates) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        auto lane = MakeLane(2);  // never started: the update stays queued
        lane->Enqueue(0);
        lane->SetStepInputs({});
      },
      "step inputs changed while updates");
}

// ---------------------------------------------------------------------------------------------
// ReduceLane

ReduceJob Job(int64_t c, bool last) {
  ReduceJob job;
  job.c = c;
  job.last_micro = last;
  job.grad_full = torch::zeros({4});
  return job;
}

TEST(ReduceLane, UnthreadedRunsTheJobOnTheCaller) {
  LaneTrace trace;
  std::thread::id ran_on;
  ReduceLane lane(
      3, /*threaded=*/false, &trace,
      [&](ReduceJob& job, bool on_lane, ReduceOutcome* out) {
        EXPECT_FALSE(on_lane);
        ran_on = std::this_thread::get_id();
        out->copy_s = 0.5;
        out->scanned = job.last_micro;
        out->sum_sq = 2.0 * static_cast<double>(job.c);
        out->nonfinite = job.c == 2;
        out->update_ready = true;
        return Status::Ok();
      },
      [](int64_t, int64_t, double*) { return Status::Ok(); }, nullptr);
  lane.Start();
  ReduceOutcome here;
  double stall = 0;
  ASSERT_TRUE(lane.Submit(Job(2, true), &here, &stall, 1).ok());
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(here.copy_s, 0.5);
  EXPECT_TRUE(here.update_ready);           // the caller queues it
  EXPECT_TRUE(lane.TakeUpdateReady().empty());
  EXPECT_EQ(lane.stats().copy_s, 0.0);      // the caller's time, not the lane's
  EXPECT_EQ(lane.grad_stats(2).sum_sq, 4.0);
  EXPECT_TRUE(lane.grad_stats(2).nonfinite);
}

TEST(ReduceLane, ThreadedQueuesCountsAndTurnsAThrowIntoTheStepsError) {
  LaneTrace trace;
  std::thread::id caller = std::this_thread::get_id();
  ReduceLane lane(
      4, /*threaded=*/true, &trace,
      [&](ReduceJob& job, bool on_lane, ReduceOutcome* out) -> Status {
        EXPECT_TRUE(on_lane);
        EXPECT_NE(std::this_thread::get_id(), caller);
        if (job.c == 3) throw std::runtime_error("boom");
        out->comm_s = 0.25;
        out->scanned = job.last_micro;
        out->sum_sq = 1.0;
        out->update_ready = job.last_micro;
        return Status::Ok();
      },
      [](int64_t c, int64_t, double* comm_s) {
        *comm_s += 0.125;
        return c == 1 ? Internal("all-gather failed") : Status::Ok();
      },
      nullptr);
  lane.Start();
  ReduceOutcome unused;
  double stall = 0;
  ASSERT_TRUE(lane.Submit(Job(0, true), &unused, &stall, 1).ok());
  ASSERT_TRUE(lane.Submit(Job(2, false), &unused, &stall, 1).ok());
  lane.QueueAllGather(1, 1);
  lane.WaitIdle(&stall, 1);
  EXPECT_TRUE(lane.TakeError().ok());
  EXPECT_EQ(lane.TakeUpdateReady(), (std::vector<int64_t>{0}));
  EXPECT_EQ(lane.stats().comm_s, 0.25 + 0.25 + 0.125);
  EXPECT_EQ(lane.grad_stats(0).sum_sq, 1.0);
  // An all-gather ahead's failure is its chunk's, reported to whoever waits for it.
  Status g = lane.WaitAllGather(1, &stall, 1);
  EXPECT_NE(g.ToString().find("all-gather failed"), std::string::npos) << g;
  ASSERT_TRUE(lane.Submit(Job(3, true), &unused, &stall, 1).ok());
  lane.WaitIdle(&stall, 1);
  Status e = lane.TakeError();
  EXPECT_NE(e.ToString().find("reducing chunk 3's gradient: boom"), std::string::npos) << e;
  EXPECT_TRUE(lane.TakeError().ok());
  lane.ResetStats();
  EXPECT_EQ(lane.stats().comm_s, 0.0);
}

// The unit rule (runtime/engine/unit_rule.h): trainable children of the root, containers (LibTorch's
// and UnitContainer) looked through, frozen children and the root's own parameters left out, and
// a module reached twice taken once under its first path.
TEST(UnitRule, ChildrenThroughContainersEachModuleOnce) {
  auto root = std::make_shared<torch::nn::Module>("Root");
  root->register_parameter("scale", torch::ones({1}));
  auto shared = torch::nn::Linear(2, 2);
  auto frozen = torch::nn::Linear(2, 2);
  for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  root->register_module("embed", torch::nn::Embedding(4, 2));
  root->register_module("frozen", frozen);
  auto blocks = std::make_shared<UnitContainer>("MyBlocks");
  blocks->register_module("0", torch::nn::Linear(2, 2));
  blocks->register_module("1", shared);
  root->register_module("blocks", blocks);
  torch::nn::Sequential head(torch::nn::ReLU(), torch::nn::Linear(2, 2));
  root->register_module("head", head);
  root->register_module("tied", shared);  // the same module as blocks.1
  std::vector<std::string> names;
  for (const auto& [name, module] : DefaultUnitModules(*root)) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"embed", "blocks.0", "blocks.1", "head.1"}));
  // A plain Module is not a container: it is one unit with all its children.
  auto plain = std::make_shared<torch::nn::Module>("Plain");
  plain->register_module("inner", blocks);
  auto top = std::make_shared<torch::nn::Module>("Top");
  top->register_module("plain", plain);
  names.clear();
  for (const auto& [name, module] : DefaultUnitModules(*top)) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"plain"}));
}

}  // namespace
}  // namespace strata
