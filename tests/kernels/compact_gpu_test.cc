// GPU-vs-CPU conformance of the compact layouts' optimizer step (kernels.h: CompactAdamStep,
// CompactElementwiseStep): Adam, AdamW, SGD with momentum, Adagrad and Lion, over every master
// format (fp32, bf16 nearest, bf16 stochastic) and moment format (fp32, bf16, 8-bit), the
// gradient dtypes and the 16-bit copies, on a shard whose runs leave gaps, share 8-bit blocks,
// skip a whole block and cross a 2^32 boundary of the rounding counter: bit for bit after each
// of three steps. Built whenever CUDA is; every test skips without a GPU (label: gpu).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "optim/compact_formats.h"
#include "optim/compact_step.h"
#include "tests/kernels/gpu_fixture.h"
#include "tests/kernels/kernel_test_data.h"
#include "tests/test_util.h"

namespace strata::kernels {
namespace {

using optim::DType;
using optim::ElementwiseKind;
using optim::MasterFormat;
using optim::MomentFormat;
using testing::Encode;
using testing::RandomFloats;

constexpr Backend kCpu = Backend::kCpu;
constexpr Backend kCuda = Backend::kCuda;

// Five 8-bit blocks and a partial sixth (elements 1280-1356). Runs: two that meet inside block
// 0 (elements 0-255); one inside block 2 that leaves gaps on both sides; an empty one, which
// touches nothing; none in block 3; one from block 4 into the last block, stopping 10 short of
// its end, whose rounding counter crosses 2^32. Block 4's gradient and moments are zero, so its
// 8-bit scales are 0 before and after.
constexpr size_t kN = 5 * 256 + 77;
constexpr size_t kZeroBlock = 4;
struct Span {
  size_t begin, size;
  uint64_t index_base;
};
const Span kSpans[] = {{0, 100, 0},     {100, 200, 100},
                       {530, 170, 5000}, {800, 0, 9000},
                       {1030, kN - 1030 - 10, (1ull << 32) - 100}};

// A valid moment state of n elements in `f`: 8-bit ones quantized block by block; block 4 is
// zero.
std::vector<uint8_t> MomentState(MomentFormat f, bool is_signed, uint32_t seed) {
  std::vector<float> x = RandomFloats(kN, seed, 1e-3f, 4);
  if (!is_signed)
    for (float& e : x) e = e * e;
  for (size_t i = kZeroBlock * 256; i < (kZeroBlock + 1) * 256; ++i) x[i] = 0.0f;
  if (f == MomentFormat::kFp32) return Encode(x, DType::kFloat32);
  if (f == MomentFormat::kBf16) return Encode(x, DType::kBFloat16);
  std::vector<uint8_t> out(optim::Int8StateBytes(kN));
  auto* scales = reinterpret_cast<float*>(out.data() + optim::Int8ScaleOffset(kN));
  for (size_t b = 0; b * 256 < kN; ++b) {
    const size_t len = std::min<size_t>(256, kN - b * 256);
    optim::QuantizeBlock(x.data() + b * 256, len, is_signed, out.data() + b * 256, &scales[b]);
  }
  return out;
}

struct Case {
  // 0 Adam (L2), 1 AdamW, 2 SGD momentum, 3 SGD nesterov, 4 Adagrad, 5 Lion, 6 SGD without
  // momentum (no state)
  int rule;
  MasterFormat master;
  MomentFormat moments;
  DType grad;
  int p16;  // 0 none, 1 bf16, 2 fp16 (fp32 master only)
};

std::string Name(const Case& c) {
  return "rule " + std::to_string(c.rule) + " master " + optim::MasterFormatName(c.master) + " moments " +
         optim::MomentFormatName(c.moments) + " grad " + optim::DTypeName(c.grad) + " p16 " +
         std::to_string(c.p16);
}

// One shard's buffers on the host and on the device; after each step the device's are compared
// with the host's byte for byte.
class Shard {
 public:
  explicit Shard(const Case& c) : c_(c) {
    const bool fp32_master = c.master == MasterFormat::kFp32;
    const std::vector<float> w = RandomFloats(kN, 11, 0.1f, 4);
    master_ = Encode(w, fp32_master ? DType::kFloat32 : DType::kBFloat16);
    const bool adam = c.rule <= 1, adagrad = c.rule == 4;
    if (!adagrad && c.rule != 6) m_ = MomentState(c.moments, true, 12);
    if (adam || adagrad) v_ = MomentState(c.moments, false, 13);
    if (c.p16 != 0) p16_.assign(2 * kN, 0);
    d_master_ = std::make_unique<DevBuf>(master_);
    if (!m_.empty()) d_m_ = std::make_unique<DevBuf>(m_);
    if (!v_.empty()) d_v_ = std::make_unique<DevBuf>(v_);
    if (!p16_.empty()) d_p16_ = std::make_unique<DevBuf>(p16_);
  }

  optim::CompactAdamBuffers Buffers(bool device, const void* grad, int64_t step) {
    optim::CompactAdamBuffers b;
    b.master = device ? d_master_->get() : master_.data();
    b.master_format = c_.master;
    b.grad = grad;
    b.grad_dtype = c_.grad;
    b.exp_avg = m_.empty() ? nullptr : device ? d_m_->get() : m_.data();
    b.exp_avg_sq = v_.empty() ? nullptr : device ? d_v_->get() : v_.data();
    b.moment_format = c_.moments;
    if (c_.p16 != 0) {
      b.param16 = device ? d_p16_->get() : p16_.data();
      b.param16_dtype = c_.p16 == 1 ? DType::kBFloat16 : DType::kFloat16;
    }
    b.n = kN;
    b.rounding_key = optim::RoundingKey(1234, step);
    return b;
  }

  void ExpectEqual() {
    EXPECT_EQ(d_master_->Download<uint8_t>(), master_) << "master differs";
    if (d_m_) {
      EXPECT_EQ(d_m_->Download<uint8_t>(), m_) << "exp_avg differs";
    }
    if (d_v_) {
      EXPECT_EQ(d_v_->Download<uint8_t>(), v_) << "exp_avg_sq differs";
    }
    if (d_p16_) {
      EXPECT_EQ(d_p16_->Download<uint8_t>(), p16_) << "param16 differs";
    }
  }

  const std::vector<uint8_t>& master() const { return master_; }

 private:
  Case c_;
  std::vector<uint8_t> master_, m_, v_, p16_;
  std::unique_ptr<DevBuf> d_master_, d_m_, d_v_, d_p16_;
};

// Steps `c` on both backends; returns after comparing every buffer after every step. With
// `overflow`, one gradient of step 2 is 1e25, whose square overflows fp32: an infinite moment
// (Note [an infinite moment]), clamped alike on both, and an fp32 master that stays finite.
void RunCase(const Case& c, cudaStream_t stream, bool overflow = false) {
  SCOPED_TRACE(Name(c));
  Shard shard(c);
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<float> g = RandomFloats(kN, 100 + static_cast<uint32_t>(step), 1e-2f, 4);
    for (size_t i = kZeroBlock * 256; i < (kZeroBlock + 1) * 256; ++i) g[i] = 0.0f;
    if (overflow && step == 2) g[7] = 1e25f;
    const std::vector<uint8_t> grad = Encode(g, c.grad);
    DevBuf d_grad(grad);
    const float grad_scale = 0.5f;
    if (c.rule <= 1) {
      std::vector<optim::AdamRun> runs;
      for (size_t r = 0; r < std::size(kSpans); ++r) {
        optim::AdamParams ap;
        ap.lr = 1e-3 * static_cast<double>(r + 1);
        ap.weight_decay = 0.01 * static_cast<double>(r);
        ap.adamw = c.rule == 1;
        ap.bias_correction = r != 1;
        ap.step = step;
        runs.push_back({kSpans[r].begin, kSpans[r].size, ap, kSpans[r].index_base});
      }
      ASSERT_OK(CompactAdamStep(kCuda, runs, shard.Buffers(true, d_grad.get(), step), grad_scale, nullptr, stream));
      ASSERT_OK(CompactAdamStep(kCpu, runs, shard.Buffers(false, grad.data(), step), grad_scale));
    } else {
      const ElementwiseKind kind = c.rule <= 3 || c.rule == 6 ? ElementwiseKind::kSgd
                                   : c.rule == 4 ? ElementwiseKind::kAdagrad
                                                 : ElementwiseKind::kLion;
      std::vector<optim::ElementwiseRun> runs;
      for (size_t r = 0; r < std::size(kSpans); ++r) {
        optim::ElementwiseRun er;
        er.begin = kSpans[r].begin;
        er.size = kSpans[r].size;
        er.index_base = kSpans[r].index_base;
        er.sgd.lr = 1e-2 * static_cast<double>(r + 1);
        er.sgd.momentum = c.rule == 6 ? 0.0 : 0.9;
        er.sgd.dampening = c.rule == 2 ? 0.1 : 0.0;
        er.sgd.nesterov = c.rule == 3;
        er.sgd.weight_decay = 1e-3 * static_cast<double>(r);
        er.sgd.first = step == 1;
        er.adagrad.lr = 1e-2;
        er.adagrad.lr_decay = 0.01 * static_cast<double>(r);
        er.adagrad.weight_decay = 1e-3 * static_cast<double>(r);
        er.adagrad.step = step;
        er.lion.lr = 1e-4 * static_cast<double>(r + 1);
        er.lion.weight_decay = 0.1 * static_cast<double>(r);
        runs.push_back(er);
      }
      ASSERT_OK(CompactElementwiseStep(kCuda, kind, runs, shard.Buffers(true, d_grad.get(), step), grad_scale, stream));
      ASSERT_OK(CompactElementwiseStep(kCpu, kind, runs, shard.Buffers(false, grad.data(), step), grad_scale));
    }
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    SCOPED_TRACE(step);
    shard.ExpectEqual();
    if (overflow && c.master == MasterFormat::kFp32) {
      std::vector<float> w(kN);
      std::memcpy(w.data(), shard.master().data(), kN * sizeof(float));
      EXPECT_TRUE(std::all_of(w.begin(), w.end(), [](float x) { return std::isfinite(x); }));
    }
  }
}

TEST_F(KernelsGpu, CompactAdamMatchesCpuBitForBitInEveryLayout) {
  for (int rule : {0, 1})
    for (MasterFormat mf : {MasterFormat::kFp32, MasterFormat::kBf16Nearest, MasterFormat::kBf16Stochastic})
      for (MomentFormat f : {MomentFormat::kFp32, MomentFormat::kBf16, MomentFormat::kInt8})
        for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16})
          for (int p16 = 0; p16 < (mf == MasterFormat::kFp32 ? 3 : 1); ++p16) RunCase({rule, mf, f, g, p16}, stream_);
}

TEST_F(KernelsGpu, AnOverflowingMomentIsClampedAsOnTheCpu) {
  for (int rule : {1, 4})  // AdamW and Adagrad keep a squared moment
    for (MomentFormat f : {MomentFormat::kFp32, MomentFormat::kInt8})
      RunCase({rule, MasterFormat::kFp32, f, DType::kFloat32, 0}, stream_, /*overflow=*/true);
}

TEST_F(KernelsGpu, CompactSgdAdagradLionMatchCpuBitForBitInEveryLayout) {
  for (int rule : {2, 3, 4, 5, 6})
    for (MasterFormat mf : {MasterFormat::kFp32, MasterFormat::kBf16Nearest, MasterFormat::kBf16Stochastic})
      for (MomentFormat f : {MomentFormat::kFp32, MomentFormat::kBf16, MomentFormat::kInt8})
        for (int p16 = 0; p16 < (mf == MasterFormat::kFp32 ? 3 : 1); ++p16)
          RunCase({rule, mf, f, DType::kFloat32, p16}, stream_);
}

// More 8-bit blocks than the grid has thread blocks, so each thread block walks several: the
// stochastic master and 8-bit moments still equal the CPU's.
TEST_F(KernelsGpu, CompactAdamOnALargeShardMatchesCpu) {
  const size_t n = 65536 * 256 * 2 + 999;
  const std::vector<float> w = RandomFloats(n, 21, 0.1f, 4);
  std::vector<uint8_t> master = Encode(w, DType::kBFloat16);
  std::vector<uint8_t> m(optim::Int8StateBytes(n), 0), v(optim::Int8StateBytes(n), 0);
  for (size_t i = 0; i < n; ++i) m[i] = optim::DynamicMapZero(true), v[i] = optim::DynamicMapZero(false);
  const std::vector<uint8_t> grad = Encode(RandomFloats(n, 22, 1e-2f, 4), DType::kBFloat16);
  DevBuf d_master(master), d_m(m), d_v(v), d_grad(grad);
  std::vector<optim::AdamRun> runs = {{0, n / 2, {}, 0}, {n / 2 + 300, n - n / 2 - 300, {}, n / 2 + 300}};
  for (int64_t step = 1; step <= 2; ++step) {
    for (auto& r : runs) r.params.step = step;
    optim::CompactAdamBuffers b;
    b.master_format = MasterFormat::kBf16Stochastic;
    b.moment_format = MomentFormat::kInt8;
    b.grad_dtype = DType::kBFloat16;
    b.n = n;
    b.rounding_key = optim::RoundingKey(7, step);
    optim::CompactAdamBuffers gb = b;
    gb.master = d_master.get();
    gb.grad = d_grad.get();
    gb.exp_avg = d_m.get();
    gb.exp_avg_sq = d_v.get();
    b.master = master.data();
    b.grad = grad.data();
    b.exp_avg = m.data();
    b.exp_avg_sq = v.data();
    ASSERT_OK(CompactAdamStep(kCuda, runs, gb, 1.0f, nullptr, stream_));
    ASSERT_OK(CompactAdamStep(kCpu, runs, b, 1.0f));
    Sync();
  }
  EXPECT_EQ(d_master.Download<uint8_t>(), master);
  EXPECT_EQ(d_m.Download<uint8_t>(), m);
  EXPECT_EQ(d_v.Download<uint8_t>(), v);
}

// A set non-finite flag skips the update on the device (nothing written); a clear one runs it.
TEST_F(KernelsGpu, CompactAdamSkipsOnTheNonFiniteFlag) {
  Case c{1, MasterFormat::kBf16Stochastic, MomentFormat::kInt8, DType::kFloat32, 0};
  Shard shard(c);
  const std::vector<uint8_t> before = shard.master();
  const std::vector<uint8_t> grad = Encode(RandomFloats(kN, 5, 1e-2f, 4), DType::kFloat32);
  DevBuf d_grad(grad);
  DevBuf d_acc(sizeof(GradStatsAccumulator));
  auto* acc = d_acc.as<GradStatsAccumulator>();
  ASSERT_OK(ResetGradStats(kCuda, acc, stream_));
  const float inf = std::numeric_limits<float>::infinity();
  DevBuf d_bad(std::vector<float>{inf});
  ASSERT_OK(AccumulateGradStats(kCuda, d_bad.get(), DType::kFloat32, 1, 1.0f, acc, stream_));
  std::vector<optim::AdamRun> runs = {{0, kN, {}, 0}};
  ASSERT_OK(CompactAdamStep(kCuda, runs, shard.Buffers(true, d_grad.get(), 1), 1.0f, acc, stream_));
  Sync();
  shard.ExpectEqual();  // the host copy was not stepped either
  ASSERT_OK(ResetGradStats(kCuda, acc, stream_));
  ASSERT_OK(CompactAdamStep(kCuda, runs, shard.Buffers(true, d_grad.get(), 1), 1.0f, acc, stream_));
  ASSERT_OK(CompactAdamStep(kCpu, runs, shard.Buffers(false, grad.data(), 1), 1.0f));
  Sync();
  shard.ExpectEqual();
  EXPECT_NE(shard.master(), before);
}

}  // namespace
}  // namespace strata::kernels
