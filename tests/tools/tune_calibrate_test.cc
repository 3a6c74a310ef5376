// strata-tune's compute calibration: the extrapolation arithmetic, both measuring methods on a
// small GPT, and the CLI choosing and reporting it.
#include <gtest/gtest.h>

#include <cmath>

#include "runtime/base/config.h"
#include "tests/test_util.h"
#include "tools/planner/model_spec.h"
#include "tools/tune/calibrate.h"

namespace strata::tune {
namespace {

TEST(ExtrapolateTest, SplitsBlocksFromTheRest) {
  ComputeCalibration c;
  Extrapolate(0.030, 0.050, 12, &c);  // block 20 ms, rest 10 ms
  EXPECT_NEAR(c.block_s, 0.020, 1e-12);
  EXPECT_NEAR(c.rest_s, 0.010, 1e-12);
  EXPECT_NEAR(c.micro_batch_s, 0.010 + 12 * 0.020, 1e-12);
}

TEST(ExtrapolateTest, BlocksDominatingLeaveNoNegativeRest) {
  ComputeCalibration c;
  Extrapolate(1.4, 3.0, 40, &c);  // t2 - t1 > t1: the rest is clamped at zero
  EXPECT_NEAR(c.block_s, 1.6, 1e-12);
  EXPECT_EQ(c.rest_s, 0.0);
  EXPECT_NEAR(c.micro_batch_s, 40 * 1.6, 1e-9);
}

TEST(ExtrapolateTest, NoiseThatInvertsTheTimesCostsOnePass) {
  ComputeCalibration c;
  Extrapolate(0.05, 0.04, 8, &c);
  EXPECT_EQ(c.block_s, 0.0);
  EXPECT_EQ(c.micro_batch_s, 0.05);
}

Config SmallGpt(bool bf16) {
  Config c;
  c.train_micro_batch_size_per_gpu = 2;
  c.bf16.enabled = bf16;
  c.model.n_layers = 6;
  c.model.d_model = 64;
  c.model.n_heads = 4;
  c.model.seq_len = 32;
  c.model.vocab_size = 128;
  return c;
}

TEST(CalibrationBytesTest, GrowsWithLayers) {
  const Config c = SmallGpt(false);
  EXPECT_GT(CalibrationBytes(c, 2), CalibrationBytes(c, 1));
  EXPECT_GT(CalibrationBytes(c, 6), CalibrationBytes(c, 2));
  // At least the fp32 parameters and gradients.
  EXPECT_GE(CalibrationBytes(c, 6), static_cast<uint64_t>(8 * 6 * 12 * 64 * 64));
}

TEST(CalibrateComputeTest, TimesTheWholeModelWhenItFits) {
  const Config c = SmallGpt(false);
  ASSERT_OK_AND_ASSIGN(ComputeCalibration cal, CalibrateCompute(c, 2, uint64_t{1} << 40));
  EXPECT_TRUE(cal.whole_model);
  EXPECT_GT(cal.micro_batch_s, 0.0);
  EXPECT_DOUBLE_EQ(cal.flops, planner::GptFlopsPerMicroBatch(c.model, 2));
  EXPECT_NEAR(cal.gflops, cal.flops / cal.micro_batch_s / 1e9, 1e-9 * cal.gflops);
}

TEST(CalibrateComputeTest, ExtrapolatesFromTwoBlocksWhenTheModelIsTooBig) {
  for (bool bf16 : {false, true}) {
    const Config c = SmallGpt(bf16);
    ASSERT_OK_AND_ASSIGN(ComputeCalibration cal, CalibrateCompute(c, 3, /*whole_model_limit=*/0));
    EXPECT_FALSE(cal.whole_model);
    EXPECT_GT(cal.one_layer_s, 0.0);
    EXPECT_GT(cal.two_layer_s, 0.0);
    EXPECT_NEAR(cal.micro_batch_s, cal.rest_s + 6 * cal.block_s, 1e-12);
    EXPECT_GE(cal.micro_batch_s, cal.one_layer_s);
    EXPECT_GT(cal.gflops, 0.0);
    EXPECT_TRUE(std::isfinite(cal.gflops));
  }
}

TEST(CalibrateComputeTest, RejectsZeroRepetitions) {
  EXPECT_EQ(CalibrateCompute(SmallGpt(false), 0, 0).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::tune
