// The optimizer arena's width (ChooseOptimizerThreads): beside compute it takes the cores
// LibTorch leaves, alone it takes every core, and strata.optimizer_threads wins.
#include "runtime/base/host_info.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

TEST(OptimizerThreads, BesideComputeTakesTheCoresLibTorchLeaves) {
  std::string why;
  EXPECT_EQ(ChooseOptimizerThreads(2, 1, 0, true, &why), 1);
  EXPECT_NE(why.find("less LibTorch's 1 compute thread"), std::string::npos) << why;
  EXPECT_EQ(ChooseOptimizerThreads(32, 24, 0, true), 8);
  // Compute already takes every core: one update thread, never zero.
  EXPECT_EQ(ChooseOptimizerThreads(2, 2, 0, true), 1);
  EXPECT_EQ(ChooseOptimizerThreads(4, 8, 0, true), 1);
}

TEST(OptimizerThreads, AloneTakesEveryCoreAndTheConfigWins) {
  std::string why;
  EXPECT_EQ(ChooseOptimizerThreads(2, 1, 0, false, &why), 2);
  EXPECT_NE(why.find("run alone"), std::string::npos) << why;
  EXPECT_EQ(ChooseOptimizerThreads(2, 1, 3, true, &why), 3);
  EXPECT_EQ(why, "strata.optimizer_threads");
}

}  // namespace
}  // namespace strata
