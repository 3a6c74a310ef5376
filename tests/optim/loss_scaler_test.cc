#include "optim/loss_scaler.h"

#include <cmath>
#include <iterator>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace strata::optim {
namespace {

LossScalerOptions Dynamic(int64_t power, int64_t window, int64_t hysteresis, double min_scale) {
  LossScalerOptions o;
  o.initial_scale_power = power;
  o.loss_scale_window = window;
  o.hysteresis = hysteresis;
  o.min_loss_scale = min_scale;
  return o;
}

TEST(LossScalerTest, StartsAtTwoToThePower) {
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler s, DynamicLossScaler::Create(Dynamic(16, 1000, 2, 1)));
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.inv_scale(), 1.0 / 65536.0);
  EXPECT_EQ(s.hysteresis_left(), 2);
}

TEST(LossScalerTest, HysteresisDelaysTheFirstHalving) {
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler s, DynamicLossScaler::Create(Dynamic(10, 1000, 2, 1)));
  ASSERT_OK(s.Update(true));  // uses up one unit of hysteresis
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_EQ(s.hysteresis_left(), 1);
  ASSERT_OK(s.Update(true));  // budget exhausted: halve
  EXPECT_EQ(s.scale(), 512.0);
  ASSERT_OK(s.Update(true));  // stays at 1 until a window completes: halves again
  EXPECT_EQ(s.scale(), 256.0);
  // A good step does not restore hysteresis (DeepSpeed's non-consecutive default).
  ASSERT_OK(s.Update(false));
  EXPECT_EQ(s.hysteresis_left(), 1);
  EXPECT_EQ(s.scale(), 256.0);
}

TEST(LossScalerTest, GrowsAfterWindowOfGoodSteps) {
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler s, DynamicLossScaler::Create(Dynamic(4, 3, 1, 1)));
  ASSERT_OK(s.Update(false));
  ASSERT_OK(s.Update(false));
  EXPECT_EQ(s.scale(), 16.0);
  ASSERT_OK(s.Update(false));  // third good step since the start
  EXPECT_EQ(s.scale(), 32.0);
  ASSERT_OK(s.Update(true));  // hysteresis 1: halve at once
  EXPECT_EQ(s.scale(), 16.0);
  ASSERT_OK(s.Update(false));
  ASSERT_OK(s.Update(false));
  EXPECT_EQ(s.scale(), 16.0);
  ASSERT_OK(s.Update(false));  // three good steps after the overflow
  EXPECT_EQ(s.scale(), 32.0);
  EXPECT_EQ(s.iteration(), 7);
}

TEST(LossScalerTest, WindowRestoresHysteresis) {
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler s, DynamicLossScaler::Create(Dynamic(8, 2, 3, 1)));
  ASSERT_OK(s.Update(true));
  ASSERT_OK(s.Update(true));
  EXPECT_EQ(s.hysteresis_left(), 1);
  EXPECT_EQ(s.scale(), 256.0);
  ASSERT_OK(s.Update(false));
  ASSERT_OK(s.Update(false));  // window complete: grow and restore
  EXPECT_EQ(s.scale(), 512.0);
  EXPECT_EQ(s.hysteresis_left(), 3);
}

TEST(LossScalerTest, ConsecutiveHysteresisRestoresOnEveryGoodStep) {
  LossScalerOptions o = Dynamic(8, 100, 2, 1);
  o.consecutive_hysteresis = true;
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler s, DynamicLossScaler::Create(o));
  ASSERT_OK(s.Update(true));
  EXPECT_EQ(s.hysteresis_left(), 1);
  ASSERT_OK(s.Update(false));
  EXPECT_EQ(s.hysteresis_left(), 2);
  ASSERT_OK(s.Update(true));
  EXPECT_EQ(s.scale(), 256.0);  // tolerated again
}

TEST(LossScalerTest, ClampsAtMinAndFailsWhenStuck) {
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler s, DynamicLossScaler::Create(Dynamic(2, 1000, 1, 2)));
  ASSERT_OK(s.Update(true));  // 4 -> 2
  EXPECT_EQ(s.scale(), 2.0);
  Status st = s.Update(true);  // already at the minimum
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("min_loss_scale=2"), std::string::npos) << st.message();
  EXPECT_EQ(s.scale(), 2.0);

  LossScalerOptions lenient = Dynamic(2, 1000, 1, 2);
  lenient.fail_at_min_scale = false;
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler t, DynamicLossScaler::Create(lenient));
  ASSERT_OK(t.Update(true));
  ASSERT_OK(t.Update(true));
  EXPECT_EQ(t.scale(), 2.0);
}

// A scaler restored from another's state goes on exactly as the original: the same scale after
// every later step, whatever mix of overflows follows (what a resumed fp16 run needs).
TEST(LossScalerTest, ARestoredScalerGoesOnAsTheOriginal) {
  const bool outcomes[] = {false, true, false, false, true, true, false, false, false, false, true,
                           false, false, false, false, false};
  for (size_t cut = 0; cut <= std::size(outcomes); ++cut) {
    ASSERT_OK_AND_ASSIGN(DynamicLossScaler a, DynamicLossScaler::Create(Dynamic(12, 3, 2, 1)));
    for (size_t i = 0; i < cut; ++i) ASSERT_OK(a.Update(outcomes[i]));
    ASSERT_OK_AND_ASSIGN(DynamicLossScaler b, DynamicLossScaler::Create(Dynamic(12, 3, 2, 1)));
    ASSERT_OK(b.Restore(a.state()));
    for (size_t i = cut; i < std::size(outcomes); ++i) {
      ASSERT_OK(a.Update(outcomes[i]));
      ASSERT_OK(b.Update(outcomes[i]));
      EXPECT_EQ(a.scale(), b.scale()) << "cut " << cut << ", step " << i;
      EXPECT_EQ(a.hysteresis_left(), b.hysteresis_left()) << "cut " << cut << ", step " << i;
    }
    EXPECT_EQ(a.iteration(), b.iteration());
  }
  // A fresh scaler differs from the restored one after the first overflows (the check above
  // could not pass with a Restore that did nothing).
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler a, DynamicLossScaler::Create(Dynamic(12, 3, 2, 1)));
  for (bool o : {true, true, true}) ASSERT_OK(a.Update(o));
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler fresh, DynamicLossScaler::Create(Dynamic(12, 3, 2, 1)));
  EXPECT_NE(fresh.scale(), a.scale());
}

TEST(LossScalerTest, RestoreRefusesAStateNoScalerCanBeIn) {
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler s, DynamicLossScaler::Create(Dynamic(12, 3, 2, 1)));
  using State = DynamicLossScaler::State;
  for (const State& bad : {State{0.0, 1, 4, 2}, State{-8.0, 1, 4, 2}, State{std::nan(""), 1, 4, 2},
                           State{INFINITY, 1, 4, 2}, State{8.0, 0, 4, 2}, State{8.0, 1, -1, -1},
                           State{8.0, 1, 4, 4}, State{8.0, 1, 4, -2}}) {
    EXPECT_EQ(s.Restore(bad).code(), StatusCode::kInvalidArgument) << bad.scale << " " << bad.iteration;
    EXPECT_EQ(s.scale(), 4096.0);  // left as it was
    EXPECT_EQ(s.iteration(), 0);
  }
  // A budget above this config's hysteresis (lowered since the save) is capped.
  ASSERT_OK(s.Restore({8.0, 5, 4, 2}));
  EXPECT_EQ(s.hysteresis_left(), 2);
  EXPECT_EQ(s.scale(), 8.0);
  // A static scaler keeps its scale and takes the counts.
  LossScalerOptions fixed;
  fixed.loss_scale = 128;
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler st, DynamicLossScaler::Create(fixed));
  ASSERT_OK(st.Restore({8.0, 1, 4, 2}));
  EXPECT_EQ(st.scale(), 128.0);
  EXPECT_EQ(st.iteration(), 4);
}

TEST(LossScalerTest, StaticScaleNeverChanges) {
  LossScalerOptions o;
  o.loss_scale = 128;
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler s, DynamicLossScaler::Create(o));
  EXPECT_FALSE(s.dynamic());
  for (int i = 0; i < 5; ++i) ASSERT_OK(s.Update(i % 2 == 0));
  EXPECT_EQ(s.scale(), 128.0);
}

TEST(LossScalerTest, FromConfigAndValidation) {
  Fp16Config fp16;
  fp16.initial_scale_power = 12;
  ASSERT_OK_AND_ASSIGN(DynamicLossScaler s, DynamicLossScaler::FromConfig(fp16));
  EXPECT_EQ(s.scale(), 4096.0);
  fp16.hysteresis = 0;
  StatusOr<DynamicLossScaler> bad = DynamicLossScaler::FromConfig(fp16);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("fp16.hysteresis=0"), std::string::npos);
  EXPECT_FALSE(DynamicLossScaler::Create(Dynamic(200, 1000, 2, 1)).ok());
  EXPECT_FALSE(DynamicLossScaler::Create(Dynamic(16, 0, 2, 1)).ok());
  EXPECT_FALSE(DynamicLossScaler::Create(Dynamic(16, 1000, 2, 0)).ok());
  LossScalerOptions neg;
  neg.loss_scale = -1;
  EXPECT_FALSE(DynamicLossScaler::Create(neg).ok());
}

}  // namespace
}  // namespace strata::optim
