#include "optim/loss_scaler.h"

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
