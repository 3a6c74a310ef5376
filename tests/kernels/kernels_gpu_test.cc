// GPU-vs-CPU conformance of kernels/kernels.h: every CUDA kernel against its CPU twin, bit for
// bit. Built whenever CUDA is; every test skips when no GPU is present (label: gpu).
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/kernels.h"
#include "optim/cpu_adam.h"
#include "optim/dtype.h"
#include "runtime/base/device.h"
#include "tests/kernels/gpu_fixture.h"
#include "tests/kernels/kernel_test_data.h"
#include "tests/test_util.h"
#include "tiers/hbm/device_factory.h"

namespace strata::kernels {
namespace {

using optim::DType;
using testing::CastInputs;
using testing::DoubleBits;
using testing::Encode;
using testing::RandomFloats;

constexpr Backend kCpu = Backend::kCpu;
constexpr Backend kCuda = Backend::kCuda;

// ---- Casts ----

TEST_F(KernelsGpu, CastFp32To16MatchesCpuTwinForEveryRoundingCase) {
  const std::vector<float> in = CastInputs();
  DevBuf d_in(in);
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(optim::DTypeName(t));
    DevBuf d_out(in.size() * 2);
    ASSERT_OK(CastFp32To16(kCuda, d_in.as<float>(), d_out.get(), t, in.size(), stream_));
    Sync();
    std::vector<uint16_t> cpu(in.size());
    ASSERT_OK(CastFp32To16(kCpu, in.data(), cpu.data(), t, in.size()));
    const std::vector<uint16_t> gpu = d_out.Download<uint16_t>();
    size_t mismatches = 0, first = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      if (gpu[i] != cpu[i] && mismatches++ == 0) first = i;
    }
    EXPECT_EQ(mismatches, 0u) << "first at input 0x" << std::hex << optim::FloatBits(in[first])
                              << ": gpu 0x" << gpu[first] << " cpu 0x" << cpu[first];
  }
}

TEST_F(KernelsGpu, Cast16ToFp32MatchesCpuTwinForAllInputs) {
  std::vector<uint16_t> in(65536);
  std::iota(in.begin(), in.end(), uint16_t{0});
  DevBuf d_in(in);
  for (DType t : {DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(optim::DTypeName(t));
    DevBuf d_out(in.size() * 4);
    ASSERT_OK(Cast16ToFp32(kCuda, d_in.get(), t, d_out.as<float>(), in.size(), stream_));
    Sync();
    std::vector<float> cpu(in.size());
    ASSERT_OK(Cast16ToFp32(kCpu, in.data(), t, cpu.data(), in.size()));
    const std::vector<uint32_t> gpu = d_out.Download<uint32_t>();
    for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(gpu[i], optim::FloatBits(cpu[i])) << i;
  }
}

// ---- Gradient statistics ----

class KernelsGpuStats : public KernelsGpu, public ::testing::WithParamInterface<DType> {};

TEST_P(KernelsGpuStats, SumIsBitIdenticalToCpuTwin) {
  const DType dt = GetParam();
  DevBuf d_acc(sizeof(GradStatsAccumulator));
  auto* acc = d_acc.as<GradStatsAccumulator>();
  for (size_t n : {size_t{1}, size_t{255}, size_t{2049}, size_t{100003}, size_t{1024 * 2048 + 77},
                   size_t{20000000}}) {
    SCOPED_TRACE(n);
    const std::vector<uint8_t> grad = Encode(RandomFloats(n, static_cast<uint32_t>(n), 1.0f, 6), dt);
    DevBuf d_grad(grad);
    ASSERT_OK(ResetGradStats(kCuda, acc, stream_));
    ASSERT_OK(AccumulateGradStats(kCuda, d_grad.get(), dt, n, 0.125f, acc, stream_));
    ASSERT_OK_AND_ASSIGN(const optim::GradStats gpu, ReadGradStats(kCuda, acc, stream_));
    ASSERT_OK_AND_ASSIGN(const optim::GradStats cpu, UnscaleCheckNorm(kCpu, grad.data(), dt, n, 0.125f));
    ASSERT_OK_AND_ASSIGN(const optim::GradStats one_shot,
                         UnscaleCheckNorm(kCuda, d_grad.get(), dt, n, 0.125f, stream_));
    EXPECT_FALSE(gpu.found_nonfinite);
    EXPECT_GT(cpu.sum_sq, 0.0);
    EXPECT_EQ(DoubleBits(gpu.sum_sq), DoubleBits(cpu.sum_sq)) << gpu.sum_sq << " vs " << cpu.sum_sq;
    EXPECT_EQ(DoubleBits(one_shot.sum_sq), DoubleBits(cpu.sum_sq));
    EXPECT_EQ(d_grad.Download<uint8_t>(), grad) << "the pass must be read-only";
  }
}

TEST_P(KernelsGpuStats, ShardsAccumulateAndNonFiniteIsFlagged) {
  const DType dt = GetParam();
  std::vector<float> a = RandomFloats(5000, 1), b = RandomFloats(300000, 2);
  DevBuf d_acc(sizeof(GradStatsAccumulator));
  auto* acc = d_acc.as<GradStatsAccumulator>();
  GradStatsAccumulator cpu_acc{};
  {
    const std::vector<uint8_t> ga = Encode(a, dt), gb = Encode(b, dt);
    DevBuf da(ga), db(gb);
    ASSERT_OK(ResetGradStats(kCuda, acc, stream_));
    ASSERT_OK(AccumulateGradStats(kCuda, da.get(), dt, a.size(), 2.0f, acc, stream_));
    ASSERT_OK(AccumulateGradStats(kCuda, db.get(), dt, b.size(), 2.0f, acc, stream_));
    ASSERT_OK_AND_ASSIGN(const optim::GradStats gpu, ReadGradStats(kCuda, acc, stream_));
    ASSERT_OK(ResetGradStats(kCpu, &cpu_acc));
    ASSERT_OK(AccumulateGradStats(kCpu, ga.data(), dt, a.size(), 2.0f, &cpu_acc));
    ASSERT_OK(AccumulateGradStats(kCpu, gb.data(), dt, b.size(), 2.0f, &cpu_acc));
    EXPECT_FALSE(gpu.found_nonfinite);
    EXPECT_EQ(DoubleBits(gpu.sum_sq), DoubleBits(cpu_acc.sum_sq));
  }
  for (float special : {std::numeric_limits<float>::infinity(), std::nanf("")}) {
    std::vector<float> bad = b;
    bad[299999] = special;
    const std::vector<uint8_t> gb = Encode(bad, dt);
    DevBuf db(gb);
    ASSERT_OK(ResetGradStats(kCuda, acc, stream_));
    ASSERT_OK(AccumulateGradStats(kCuda, db.get(), dt, bad.size(), 1.0f, acc, stream_));
    ASSERT_OK_AND_ASSIGN(const optim::GradStats gpu, ReadGradStats(kCuda, acc, stream_));
    EXPECT_TRUE(gpu.found_nonfinite);
  }
  // Overflow of grad * scale in fp32.
  const std::vector<uint8_t> ga = Encode(a, dt);
  DevBuf da(ga);
  ASSERT_OK_AND_ASSIGN(const optim::GradStats gpu,
                       UnscaleCheckNorm(kCuda, da.get(), dt, a.size(), 3e38f, stream_));
  ASSERT_OK_AND_ASSIGN(const optim::GradStats cpu,
                       UnscaleCheckNorm(kCpu, ga.data(), dt, a.size(), 3e38f));
  EXPECT_TRUE(cpu.found_nonfinite);
  EXPECT_EQ(gpu.found_nonfinite, cpu.found_nonfinite);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KernelsGpuStats,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const auto& info) { return std::string(optim::DTypeName(info.param)); });

// ---- Adam ----

struct Shard {
  std::vector<float> master;
  std::vector<uint8_t> grad, m, v, p16;
};

TEST_F(KernelsGpu, AdamMatchesCpuBitForBitOverAllDtypeOptions) {
  const size_t n = 300007;
  for (DType g : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    for (DType s : {DType::kFloat32, DType::kBFloat16}) {
      for (int p = 0; p < 3; ++p) {
        for (bool adamw : {true, false}) {
          const DType p16 = p == 2 ? DType::kFloat16 : DType::kBFloat16;
          SCOPED_TRACE(::testing::Message() << "grad=" << optim::DTypeName(g) << " state="
                                            << optim::DTypeName(s) << " p16="
                                            << (p ? optim::DTypeName(p16) : "none")
                                            << " adamw=" << adamw);
          Shard h;
          h.master = RandomFloats(n, 1, 0.1f, 4);
          h.grad = Encode(RandomFloats(n, 2, 1e-3f, 8), g);
          h.m = Encode(RandomFloats(n, 3, 1e-4f, 4), s);
          std::vector<float> v = RandomFloats(n, 4, 1e-6f, 4);
          for (auto& x : v) x = std::fabs(x);
          h.v = Encode(v, s);
          h.p16.assign(2 * n, 0);
          DevBuf d_master(h.master), d_grad(h.grad), d_m(h.m), d_v(h.v), d_p16(h.p16);

          optim::AdamBuffers cb;
          cb.master = h.master.data();
          cb.grad = h.grad.data();
          cb.grad_dtype = g;
          cb.exp_avg = h.m.data();
          cb.exp_avg_sq = h.v.data();
          cb.state_dtype = s;
          cb.param16 = p ? h.p16.data() : nullptr;
          cb.param16_dtype = p16;
          cb.n = n;
          optim::AdamBuffers gb = cb;
          gb.master = d_master.as<float>();
          gb.grad = d_grad.get();
          gb.exp_avg = d_m.get();
          gb.exp_avg_sq = d_v.get();
          gb.param16 = p ? d_p16.get() : nullptr;

          for (int64_t step = 1; step <= 4; ++step) {
            optim::AdamParams ap;
            ap.lr = 2e-3;
            ap.weight_decay = 0.05;
            ap.adamw = adamw;
            ap.step = step;
            ap.bias_correction = step != 3;  // both branches of the constants
            ASSERT_OK(AdamStep(kCuda, ap, gb, 0.75f, nullptr, stream_));
            ASSERT_OK(AdamStep(kCpu, ap, cb, 0.75f));
          }
          Sync();
          const std::vector<float> gm = d_master.Download<float>();
          EXPECT_EQ(0, std::memcmp(gm.data(), h.master.data(), 4 * n)) << "master differs";
          EXPECT_EQ(d_m.Download<uint8_t>(), h.m) << "exp_avg differs";
          EXPECT_EQ(d_v.Download<uint8_t>(), h.v) << "exp_avg_sq differs";
          if (p) {
            EXPECT_EQ(d_p16.Download<uint8_t>(), h.p16) << "param16 differs";
          }
        }
      }
    }
  }
}

// ---- SGD, Adagrad, Lion ----

// Four steps of each element-wise optimizer on the GPU and on the CPU twin, every case of its
// rule (SGD: plain, momentum with dampening, nesterov; decay on and off; Adagrad with lr_decay;
// Lion with and without decay) and every param16 option: bit-identical masters, states and
// 16-bit copies.
TEST_F(KernelsGpu, SgdAdagradLionMatchCpuBitForBit) {
  const size_t n = 300007;
  for (int opt = 0; opt < 3; ++opt) {
    for (int variant = 0; variant < 3; ++variant) {
      for (int p = 0; p < 3; ++p) {
        const DType p16 = p == 2 ? DType::kFloat16 : DType::kBFloat16;
        SCOPED_TRACE(::testing::Message() << "optimizer " << opt << " variant " << variant
                                          << " p16 " << p);
        std::vector<float> master = RandomFloats(n, 1, 0.1f, 4);
        const std::vector<float> grad = RandomFloats(n, 2, 1e-3f, 8);
        std::vector<float> state = RandomFloats(n, 3, 1e-4f, 4);
        if (opt == 1) {
          for (auto& x : state) x = std::fabs(x);  // Adagrad's sum is never negative
        }
        std::vector<uint16_t> h16(n, 0);
        DevBuf d_master(master), d_grad(grad), d_state(state), d_p16(h16);
        void* cpu16 = p ? h16.data() : nullptr;
        void* gpu16 = p ? d_p16.get() : nullptr;
        for (int64_t step = 1; step <= 4; ++step) {
          if (opt == 0) {
            optim::SgdParams sp;
            sp.lr = 0.05;
            sp.weight_decay = variant == 1 ? 0.0 : 1e-3;
            sp.momentum = variant == 0 ? 0.0 : 0.9;
            sp.dampening = variant == 1 ? 0.2 : 0.0;
            sp.nesterov = variant == 2;
            sp.first = step == 1;
            ASSERT_OK(SgdStep(kCuda, sp, {d_master.as<float>(), d_grad.as<float>(),
                                          d_state.as<float>(), gpu16, p16, n}, 0.75f, stream_));
            ASSERT_OK(SgdStep(kCpu, sp, {master.data(), grad.data(), state.data(), cpu16, p16, n},
                              0.75f));
          } else if (opt == 1) {
            optim::AdagradParams ap;
            ap.lr = 0.05;
            ap.weight_decay = variant == 0 ? 0.0 : 1e-3;
            ap.lr_decay = variant == 2 ? 0.1 : 0.0;
            ap.step = step;
            ASSERT_OK(AdagradStep(kCuda, ap, {d_master.as<float>(), d_grad.as<float>(),
                                              d_state.as<float>(), gpu16, p16, n}, 0.75f, stream_));
            ASSERT_OK(AdagradStep(kCpu, ap, {master.data(), grad.data(), state.data(), cpu16, p16,
                                             n}, 0.75f));
          } else {
            optim::LionParams lp;
            lp.lr = 1e-3;
            lp.weight_decay = variant == 0 ? 0.0 : 0.1;
            lp.beta2 = variant == 2 ? 0.99 : 0.999;
            ASSERT_OK(LionStep(kCuda, lp, {d_master.as<float>(), d_grad.as<float>(),
                                           d_state.as<float>(), gpu16, p16, n}, 0.75f, stream_));
            ASSERT_OK(LionStep(kCpu, lp, {master.data(), grad.data(), state.data(), cpu16, p16, n},
                               0.75f));
          }
        }
        Sync();
        const std::vector<float> gm = d_master.Download<float>();
        EXPECT_EQ(0, std::memcmp(gm.data(), master.data(), 4 * n)) << "master differs";
        if (!(opt == 0 && variant == 0)) {  // plain SGD has no state
          const std::vector<float> gs = d_state.Download<float>();
          EXPECT_EQ(0, std::memcmp(gs.data(), state.data(), 4 * n)) << "state differs";
        }
        if (p) {
          EXPECT_EQ(d_p16.Download<uint16_t>(), h16) << "param16 differs";
        }
      }
    }
  }
}

TEST_F(KernelsGpu, AdamSkipsOnTheDeviceFlagWithoutHostSync) {
  const size_t n = 4096;
  std::vector<float> master = RandomFloats(n, 9);
  std::vector<float> grad = RandomFloats(n, 10, 1e-3f);
  std::vector<float> zeros(n, 0.0f);
  DevBuf d_master(master), d_grad(grad), d_m(zeros), d_v(zeros), d_acc(sizeof(GradStatsAccumulator));
  auto* acc = d_acc.as<GradStatsAccumulator>();
  optim::AdamBuffers b;
  b.master = d_master.as<float>();
  b.grad = d_grad.get();
  b.exp_avg = d_m.get();
  b.exp_avg_sq = d_v.get();
  b.n = n;
  optim::AdamParams ap;
  // A NaN in another shard of the step sets the flag; this shard's update must not run.
  std::vector<float> other = RandomFloats(1000, 11);
  other[500] = std::nanf("");
  DevBuf d_other(other);
  ASSERT_OK(ResetGradStats(kCuda, acc, stream_));
  ASSERT_OK(AccumulateGradStats(kCuda, d_other.get(), DType::kFloat32, other.size(), 1.0f, acc, stream_));
  ASSERT_OK(AccumulateGradStats(kCuda, d_grad.get(), DType::kFloat32, n, 1.0f, acc, stream_));
  ASSERT_OK(AdamStep(kCuda, ap, b, 1.0f, acc, stream_));
  Sync();
  EXPECT_EQ(d_master.Download<float>(), master);
  EXPECT_EQ(d_v.Download<float>(), zeros);
  // With a clean flag it runs and matches the CPU.
  ASSERT_OK(ResetGradStats(kCuda, acc, stream_));
  ASSERT_OK(AdamStep(kCuda, ap, b, 1.0f, acc, stream_));
  Sync();
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  optim::AdamBuffers cb = b;
  cb.master = master.data();
  cb.grad = grad.data();
  cb.exp_avg = m.data();
  cb.exp_avg_sq = v.data();
  ASSERT_OK(AdamStep(kCpu, ap, cb, 1.0f));
  const std::vector<float> gm = d_master.Download<float>();
  EXPECT_EQ(0, std::memcmp(gm.data(), master.data(), 4 * n));
}

// ---- Chunks ----

template <typename T>
void PackUnpackAgainstCpu(cudaStream_t stream) {
  std::mt19937 rng(7);
  const size_t count = 200;  // several launches of 64 segments
  std::vector<std::vector<T>> host(count);
  std::vector<std::unique_ptr<DevBuf>> dev(count);
  std::vector<ChunkSlot> cpu_slots(count), gpu_slots(count);
  size_t offset = 0;
  for (size_t k = 0; k < count; ++k) {
    const size_t numel = k % 23 == 0 ? 0 : 1 + rng() % (k % 7 == 0 ? 100000 : 500);
    offset += rng() % 9;
    host[k].resize(numel);
    for (auto& x : host[k]) x = static_cast<T>(rng());
    dev[k] = std::make_unique<DevBuf>(host[k]);
    cpu_slots[k] = {host[k].data(), numel, offset};
    gpu_slots[k] = {dev[k]->get(), numel, offset};
    offset += numel;
  }
  const size_t chunk_numel = offset + 1001;
  std::vector<T> cpu_chunk(chunk_numel);
  std::memset(cpu_chunk.data(), 0xcd, chunk_numel * sizeof(T));
  DevBuf d_chunk(cpu_chunk);  // garbage the padding must overwrite
  ASSERT_OK(PackChunk(kCpu, cpu_slots, sizeof(T), cpu_chunk.data(), chunk_numel));
  ASSERT_OK(PackChunk(kCuda, gpu_slots, sizeof(T), d_chunk.get(), chunk_numel, stream));
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(d_chunk.Download<T>(), cpu_chunk);

  std::vector<std::unique_ptr<DevBuf>> back(count);
  for (size_t k = 0; k < count; ++k) {
    back[k] = std::make_unique<DevBuf>(host[k].size() * sizeof(T));
    gpu_slots[k].tensor = back[k]->get();
  }
  ASSERT_OK(UnpackChunk(kCuda, d_chunk.get(), chunk_numel, gpu_slots, sizeof(T), stream));
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  for (size_t k = 0; k < count; ++k) ASSERT_EQ(back[k]->Download<T>(), host[k]) << "slot " << k;
}

TEST_F(KernelsGpu, PackUnpackMatchCpuTwinForEveryElementSize) {
  PackUnpackAgainstCpu<uint8_t>(stream_);
  PackUnpackAgainstCpu<uint16_t>(stream_);
  PackUnpackAgainstCpu<uint32_t>(stream_);
  PackUnpackAgainstCpu<uint64_t>(stream_);
}

}  // namespace
}  // namespace strata::kernels
