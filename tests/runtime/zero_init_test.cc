// zero::Init: a model built under it never holds its full fp32 parameters in DRAM (measured by
// the OS: the process's peak RSS while building), and trains exactly like the same model built
// normally.
#include <signal.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/engine/zero_init.h"
#include "tests/runtime/gpt_training.h"
#include "tests/test_util.h"

namespace strata {
namespace {

// VmHWM / VmRSS of this process in bytes.
uint64_t ProcStatus(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1)) * 1024;
  return 0;
}

// Resets VmHWM to the current RSS (Linux: clear_refs 5).
bool ResetPeakRss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  return static_cast<bool>(f);
}

// The elements of a staged parameter's shape.
int64_t StagedNumel(const torch::Tensor& p) {
  const auto shape = zero::StagedShape(p);
  return shape ? c10::multiply_integers(*shape) : -1;
}

// A staged parameter has no memory and 0 elements (an op that reads it reads nothing, not
// address 0); its shape is kept beside its values.
TEST(ZeroInit, ParametersKeepTheirShapeButNoMemory) {
  testing::TempDir dir;
  Config c = BaseConfig();
  auto plain = models::BuildGpt(c.model);
  const auto plain_params = models::UniqueParameters(*plain);
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path()));
  auto model = models::BuildGpt(c.model);
  const auto params = models::UniqueParameters(*model);
  ASSERT_EQ(params.size(), plain_params.size());
  int64_t numel = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const torch::Tensor& p = params[i];
    EXPECT_EQ(p.storage().nbytes(), 0u);
    EXPECT_EQ(p.numel(), 0);
    EXPECT_EQ(p.sum().item<float>(), 0.0f);
    EXPECT_TRUE(zero::IsStaged(p));
    EXPECT_EQ(zero::StagedShape(p).value_or(std::vector<int64_t>{}), plain_params[i].sizes().vec()) << i;
    numel += StagedNumel(p);
  }
  EXPECT_EQ(numel, models::GptParameterCount(c.model));
  EXPECT_EQ(init->staged_bytes(), static_cast<uint64_t>(numel) * 4);
  // A second Init on the same thread is refused.
  EXPECT_FALSE(zero::Init::Create(dir.path()).ok());
  init.reset();
  // Without a current Init, Partition leaves a module alone.
  auto again = models::BuildGpt(c.model);
  for (const auto& p : models::UniqueParameters(*again)) EXPECT_GT(p.storage().nbytes(), 0u);
}

// The staging directory is the NVMe tier's: a missing one (a mistyped nvme_path) is refused, as
// the engine refuses it, rather than created on whatever disk holds the typo.
TEST(ZeroInit, AMissingDirectoryIsRefusedNotCreated) {
  testing::TempDir dir;
  const std::string typo = dir.path() + "/nvme-typo";
  auto init = zero::Init::Create(typo);
  ASSERT_FALSE(init.ok());
  EXPECT_EQ(init.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(init.status().message().find(typo + " does not exist"), std::string::npos) << init.status();
  EXPECT_FALSE(std::filesystem::exists(typo));
  // Shapes-only ranks write nothing there, so they do not look at it.
  EXPECT_TRUE(zero::Init::Create(typo, torch::kFloat32, zero::StageMode::kShapesOnly).ok());
}

// StageMode::kShapesOnly (a rank > 0's Init): the same shapes with no memory, nothing written
// to the directory, and reads that give zeros (the engine broadcasts rank 0's values over them).
TEST(ZeroInit, ShapesOnlyWritesNothingAndReadsZeros) {
  testing::TempDir dir;
  Config c = BaseConfig();
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path(), torch::kFloat32, zero::StageMode::kShapesOnly));
  EXPECT_EQ(init->mode(), zero::StageMode::kShapesOnly);
  auto model = models::BuildGpt(c.model);
  const auto params = models::UniqueParameters(*model);
  for (const auto& p : params) {
    EXPECT_EQ(p.storage().nbytes(), 0u);
    EXPECT_TRUE(zero::IsStaged(p));
  }
  EXPECT_EQ(init->staged_params(), static_cast<int64_t>(params.size()));
  EXPECT_EQ(init->staged_bytes(), 0u);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "a shapes-only Init makes no staging file";
  torch::Tensor got = torch::full({StagedNumel(params[0])}, 7.0f);
  ASSERT_OK_AND_ASSIGN(bool staged, zero::ReadStaged(params[0], got));
  EXPECT_TRUE(staged);
  EXPECT_EQ(got.count_nonzero().item<int64_t>(), 0);
  EXPECT_FALSE(zero::IsStaged(params[0]));
  // StageMapped keeps a parameter under a page as it is.
  torch::Tensor t = torch::ones({1000});
  zero::StageMapped(t);
  EXPECT_EQ(t.sum().item<float>(), 1000.0f);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// This process's proportional memory (anonymous and shared, /proc/self/smaps_rollup) in bytes:
// a page mapped at several addresses counts once, where RSS counts it at each.
uint64_t PssAnonShmem() {
  std::ifstream f("/proc/self/smaps_rollup");
  std::string line;
  uint64_t total = 0;
  while (std::getline(f, line))
    if (line.rfind("Pss_Anon:", 0) == 0 || line.rfind("Pss_Shmem:", 0) == 0)
      total += std::stoull(line.substr(line.find(':') + 1)) * 1024;
  return total;
}

// Note [registry keys]: a staged unit dropped before the engine reads it leaves its entry, and
// units built after it (whose parameters the allocator would gladly put at its addresses) are
// staged with their own values, each read back as itself.
TEST(ZeroInit, ADroppedStagedUnitLendsItsAddressToNoOne) {
  testing::TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path()));
  std::vector<torch::nn::Linear> kept;
  for (int i = 0; i < 6; ++i) {
    auto unit = torch::nn::Linear(64, 64);
    {
      torch::NoGradGuard ng;
      unit->weight.fill_(static_cast<float>(i));
      unit->bias.fill_(static_cast<float>(-i));
    }
    zero::Partition(*unit);
    if (i % 2 == 1) kept.push_back(unit);  // the even ones die here, staged
  }
  EXPECT_EQ(init->staged_params(), 12);
  for (size_t k = 0; k < kept.size(); ++k) {
    const float want = static_cast<float>(2 * k + 1);
    ASSERT_TRUE(zero::IsStaged(kept[k]->weight)) << k;
    ASSERT_TRUE(zero::IsStaged(kept[k]->bias)) << k;
    torch::Tensor w = torch::empty({64 * 64}), b = torch::empty({64});
    ASSERT_OK_AND_ASSIGN(bool sw, zero::ReadStaged(kept[k]->weight, w));
    ASSERT_OK_AND_ASSIGN(bool sb, zero::ReadStaged(kept[k]->bias, b));
    EXPECT_TRUE(sw && sb);
    EXPECT_TRUE(w.eq(want).all().item<bool>()) << k;
    EXPECT_TRUE(b.eq(-want).all().item<bool>()) << k;
  }
}

// Note [build progress]: while a build stages, its Init logs how far it is; an Init whose build
// is idle, or that builds shapes only, says nothing.
TEST(ZeroInit, ABuildThatStagesReportsItsProgress) {
  testing::TempDir dir;
  zero::SetProgressIntervalForTest(40);
  ::testing::internal::CaptureStderr();
  {
    ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path()));
    for (int i = 0; i < 4; ++i) {
      auto unit = torch::nn::Linear(256, 256);
      zero::Partition(*unit);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  const std::string staging = ::testing::internal::GetCapturedStderr();
  ::testing::internal::CaptureStderr();
  {
    ASSERT_OK_AND_ASSIGN(auto idle, zero::Init::Create(dir.path()));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  {
    ASSERT_OK_AND_ASSIGN(auto shapes, zero::Init::Create(dir.path(), torch::kFloat32, zero::StageMode::kShapesOnly));
    auto unit = torch::nn::Linear(256, 256);
    zero::Partition(*unit);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const std::string quiet = ::testing::internal::GetCapturedStderr();
  zero::SetProgressIntervalForTest(10000);
  // Four units of 257 KiB, lines as they go, and the totals when the Init goes.
  EXPECT_GE(std::count(staging.begin(), staging.end(), '\n'), 2) << staging;
  EXPECT_NE(staging.find("parameters staged in " + dir.path()), std::string::npos) << staging;
  EXPECT_NE(staging.find("of 8 parameters staged"), std::string::npos) << staging;
  EXPECT_EQ(quiet.find("zero::Init:"), std::string::npos) << quiet;
}

// Whether this process maps the scratch region (its memory file's name in /proc/self/maps).
bool MapsScratch() {
  std::ifstream f("/proc/self/maps");
  std::string line;
  while (std::getline(f, line))
    if (line.find("strata-zero-init-scratch") != std::string::npos) return true;
  return false;
}

// A rank > 0's Python parameters (StageMapped under kShapesOnly, Note [scratch parameters]):
// 384 MiB of them keep their shapes and take writes everywhere, while the process's memory (as
// the OS counts it: proportional set, anonymous and shared) grows by the 32 MiB region, not by
// the parameters, and nothing reaches the directory. (RSS counts the region once per window
// written: 384 MiB here, of pages that exist once.) The region is what every one of them maps: a write through one
// is read through another. The mappings go with the last parameter.
TEST(ZeroInit, ShapesOnlyMappedParametersShareOneScratchRegion) {
  testing::TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path(), torch::kFloat32, zero::StageMode::kShapesOnly));
  const uint64_t before = PssAnonShmem();
  ASSERT_GT(before, 0u) << "no /proc/self/smaps_rollup";
  std::vector<torch::Tensor> params;
  constexpr int64_t kRows = 3 * 1024, kCols = 8 * 1024;  // 96 MiB each, three windows
  for (int i = 0; i < 4; ++i) {
    params.push_back(torch::empty({kRows, kCols}));  // never touched: no memory until staged
    zero::StageMapped(params.back());
    ASSERT_EQ(params.back().sizes().vec(), (std::vector<int64_t>{kRows, kCols}));
    params.back().fill_(static_cast<float>(i + 1));  // every element written, as an init pass does
  }
  EXPECT_EQ(init->staged_params(), 4);
  EXPECT_EQ(init->staged_bytes(), 0u);
  const uint64_t grown = PssAnonShmem() - before;
  EXPECT_LE(grown, uint64_t{48} << 20) << "384 MiB of parameters written; the region is 32 MiB";
  EXPECT_GE(grown, uint64_t{30} << 20) << "the region's pages are resident once written";
  // The last fill is what every window of every parameter reads.
  const int64_t window = (int64_t{32} << 20) / 4;  // elements per 32 MiB
  EXPECT_EQ(params[0].view({-1})[0].item<float>(), 4.0f);
  params[3].view({-1})[2 * window + 5] = 9.0f;
  EXPECT_EQ(params[0].view({-1})[5].item<float>(), 9.0f);
  EXPECT_EQ(params[1].view({-1})[window + 5].item<float>(), 9.0f);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  EXPECT_TRUE(MapsScratch());
  init.reset();  // the parameters outlive their Init
  // Its three windows hold the one 9 each.
  EXPECT_EQ(params[2].sum(torch::kFloat64).item<double>(),
            3 * 9.0 + 4.0 * (static_cast<double>(kRows * kCols) - 3.0));
  params.clear();
  EXPECT_FALSE(MapsScratch()) << "the last parameter's release unmaps the region";
}

TEST(ZeroInit, TrainsLikeTheModelBuiltNormally) {
  testing::TempDir dir, swap;
  Config c = BaseConfig();
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  TrainRun ref = Reference(c);
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path()));
  EngineOptions o;
  o.nvme_path = {swap.path()};
  TrainRun got = ThroughEngine(c, o);  // builds its model while the Init is current
  EXPECT_GT(init->staged_params(), 0);
  ExpectMatch(ref, got, 1e-5, 2e-5);
}

// A setup that fails after the model was staged returns its error: the engine gives copies
// back only to parameters it made views of device chunks, not to staged ones, which have no
// memory (cloning them, when they still had their sizes, read from nowhere: a segfault that hid
// the error).
TEST(ZeroInit, AFailedSetupReturnsItsErrorAndLeavesStagedParameters) {
  testing::TempDir dir, swap;
  Config c = BaseConfig();
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNone;  // refused with nvme params
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path()));
  auto model = models::BuildGpt(c.model);
  ASSERT_GT(init->staged_params(), 0);
  std::unique_ptr<Communicator> comm = CreateSingleCommunicator();
  std::unique_ptr<Device> device = CreateDevice(TestDeviceSpec(), 256 << 20).value();
  EngineOptions o;
  o.nvme_path = {swap.path()};
  auto engine = Engine::Create(model, c, comm.get(), device.get(), o);
  ASSERT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("offload_optimizer.device=none"), std::string::npos)
      << engine.status();
  for (const auto& p : models::UniqueParameters(*model)) EXPECT_TRUE(zero::IsStaged(p));
}

// Note [direct staging]: on a disk file system the staging file is written and read with
// O_DIRECT, where the file system refuses it through the page cache; either way each parameter
// reads back as the value the model was built with.
void ExpectStagedValuesReadBack(const std::string& dir, bool want_direct) {
  Config c = BaseConfig();
  c.model.d_model = 96;  // parameters of odd byte counts: 96*3 floats is not a multiple of 4 KiB
  auto plain = models::BuildGpt(c.model);
  std::vector<torch::Tensor> want;
  for (const auto& p : models::UniqueParameters(*plain)) want.push_back(p.detach().reshape({-1}).clone());
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir));
  if (want_direct && !init->direct_io()) GTEST_SKIP() << dir << "'s file system refuses O_DIRECT";
  auto staged = models::BuildGpt(c.model);
  // After the writes: a refused first write would have fallen back (and closed the descriptor).
  EXPECT_EQ(init->direct_io(), want_direct);
  auto params = models::UniqueParameters(*staged);
  ASSERT_EQ(params.size(), want.size());
  // A destination of the wrong size is refused and consumes nothing.
  torch::Tensor small = torch::empty({StagedNumel(params[0]) - 1}, torch::kFloat32);
  EXPECT_EQ(zero::ReadStaged(params[0], small).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(zero::IsStaged(params[0]));
  // Read in reverse order: each read stands on its own offset. Every other one into bf16, which
  // must be the fp32 value rounded to nearest even (what the engine's bf16 path relies on).
  for (size_t i = params.size(); i-- > 0;) {
    const torch::Dtype dtype = i % 2 ? torch::kBFloat16 : torch::kFloat32;
    torch::Tensor got = torch::empty({StagedNumel(params[i])}, dtype);
    ASSERT_OK_AND_ASSIGN(bool was_staged, zero::ReadStaged(params[i], got));
    ASSERT_TRUE(was_staged) << i;
    EXPECT_TRUE(torch::equal(got, want[i].to(dtype))) << i;
    EXPECT_FALSE(zero::IsStaged(params[i]));
  }
}

TEST(ZeroInit, DirectStagingReadsBackEveryValue) {
  testing::TempDir dir;
  ExpectStagedValuesReadBack(dir.path(), /*want_direct=*/true);
}

TEST(ZeroInit, BufferedStagingWhereODirectIsRefused) {
  testing::TempDir dir;
  zero::SetDirectStagingForTest(false);  // as on a file system that refuses O_DIRECT
  ExpectStagedValuesReadBack(dir.path(), /*want_direct=*/false);
  zero::SetDirectStagingForTest(true);
}

// A mapped parameter's range of the file is punched when its mapping goes (Note [mapped release]
// in zero_init.cc). A parameter staged after it, here through the buffered path, which writes at
// the file's end unaligned, must not share its last page, or the punch zeroes its first bytes.
TEST(ZeroInit, AReleasedMappingLeavesTheNextParameterWhole) {
  testing::TempDir dir;
  zero::SetDirectStagingForTest(false);
  {
    ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path()));
    torch::Tensor mapped = torch::ones({1000});  // 4000 bytes: most of one page
    zero::StageMapped(mapped);
    torch::nn::Module unit;
    const torch::Tensor want = torch::arange(1, 1001, torch::kFloat32);
    torch::Tensor filed = unit.register_parameter("w", want.clone());
    zero::Partition(unit);
    ASSERT_TRUE(zero::IsStaged(filed));
    mapped.set_data(torch::empty({0}));  // the last use of the mapping: it goes, and is punched
    torch::Tensor got = torch::empty({1000});
    ASSERT_OK_AND_ASSIGN(bool staged, zero::ReadStaged(filed, got));
    EXPECT_TRUE(staged);
    EXPECT_TRUE(torch::equal(got, want)) << got.narrow(0, 0, 4);
  }
  zero::SetDirectStagingForTest(true);
}

// A disk that fills while staging (RLIMIT_FSIZE stands in for it: writes past the limit fail
// with EFBIG, SIGXFSZ ignored): the unit's construction throws an error naming the staging file,
// on the O_DIRECT path and the buffered one, and nothing crashes.
TEST(ZeroInit, AFullDiskIsAnErrorNamingTheFile) {
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "O_DIRECT" : "buffered");
    testing::TempDir dir;
    zero::SetDirectStagingForTest(direct);
    auto init = zero::Init::Create(dir.path());
    ASSERT_TRUE(init.ok()) << init.status();
    if (direct && !(*init)->direct_io()) continue;  // the file system refuses O_DIRECT
    struct rlimit old {};
    ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
    auto* previous = ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit small = old;
    // A few of the model's parameters fit, then the disk is "full", in the middle of a page:
    // the direct path's short write must still read as a full disk.
    small.rlim_cur = (256 << 10) + 1000;
    ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    std::string what;
    try {
      Config c = BaseConfig();
      c.model.d_model = 128;
      auto model = models::BuildGpt(c.model);
    } catch (const std::exception& e) {
      what = e.what();
    }
    ::setrlimit(RLIMIT_FSIZE, &old);
    ::signal(SIGXFSZ, previous);
    zero::SetDirectStagingForTest(true);
    EXPECT_NE(what.find("write zero::Init staging file"), std::string::npos) << what;
    EXPECT_EQ(what.find("Invalid argument"), std::string::npos) << what;
    EXPECT_NE(what.find(dir.path()), std::string::npos) << what;
  }
}

// A bf16 master (bf16_master_weights_and_grads): staging in bf16 halves the file and trains
// bit for bit like the model built normally, since the engine rounds the fp32 values to nearest
// bf16 at start either way. fp32 staging of the same run gives the same bits too.
TEST(ZeroInit, Bf16StagingHalvesTheFileAndKeepsABf16MasterRunExact) {
  Config c = BaseConfig();
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  c.bf16.enabled = true;
  c.bf16.bf16_master_weights_and_grads = true;
  testing::TempDir swap0;
  EngineOptions o0;
  o0.nvme_path = {swap0.path()};
  TrainRun plain = ThroughEngine(c, o0);
  uint64_t fp32_bytes = 0;
  for (torch::Dtype staged : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(staged));
    testing::TempDir dir, swap;
    ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path(), staged));
    EngineOptions o;
    o.nvme_path = {swap.path()};
    TrainRun got = ThroughEngine(c, o);
    ASSERT_GT(init->staged_params(), 0);
    if (staged == torch::kFloat32) fp32_bytes = init->staged_bytes();
    else EXPECT_EQ(init->staged_bytes() * 2, fp32_bytes);
    ASSERT_EQ(got.losses.size(), plain.losses.size());
    for (size_t i = 0; i < plain.losses.size(); ++i) EXPECT_EQ(got.losses[i], plain.losses[i]) << i;
    ASSERT_EQ(got.params.size(), plain.params.size());
    for (size_t i = 0; i < plain.params.size(); ++i) EXPECT_TRUE(torch::equal(got.params[i], plain.params[i])) << i;
  }
  testing::TempDir dir;
  EXPECT_FALSE(zero::Init::Create(dir.path(), torch::kFloat16).ok());  // fp32 or bf16 only
}

// Note [generated parameters]: a parameter registered with its draw takes no room in the file
// and reads back as the draw would have been written: through the staged dtype. The reference
// is the file path itself, a parameter holding the same values staged by Partition.
TEST(ZeroInit, AGeneratedParameterIsDrawnWhenReadAsTheFileWouldHoldIt) {
  // Values a bf16 rounding changes (1/3 steps), of an odd count.
  const std::vector<int64_t> shape = {37, 101};
  const int64_t numel = 37 * 101;
  const torch::Tensor values = torch::arange(numel, torch::kFloat32).div_(3.0f).sub_(600.0f);
  int draws = 0;
  auto fill = [&](torch::Tensor w) {
    ++draws;
    w.copy_(values);
  };
  auto param = [] { return torch::empty({1, 1}).requires_grad_(); };
  // Without a current Init nothing is registered: the caller fills the parameter.
  torch::Tensor alone = param();
  EXPECT_FALSE(zero::StageGenerated(alone, shape, fill));
  EXPECT_EQ(alone.numel(), 1);
  EXPECT_FALSE(zero::IsStaged(alone));
  for (torch::Dtype staged : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(staged));
    testing::TempDir dir;
    ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path(), staged));
    draws = 0;
    torch::Tensor gen = param();
    ASSERT_TRUE(zero::StageGenerated(gen, shape, fill));
    EXPECT_EQ(gen.numel(), 0);
    EXPECT_EQ(gen.storage().nbytes(), 0u);
    EXPECT_EQ(zero::StagedShape(gen).value_or(std::vector<int64_t>{}), shape);
    EXPECT_EQ(init->staged_bytes(), 0u) << "nothing of it goes to the file";
    EXPECT_EQ(init->generated_params(), 1);
    EXPECT_EQ(init->generated_bytes(), static_cast<uint64_t>(numel) * c10::elementSize(staged));
    // Partition skips it (it has 0 elements), and stages a plain parameter beside it.
    torch::nn::Module unit;
    unit.register_parameter("gen", gen);
    torch::Tensor filed = unit.register_parameter("filed", values.reshape(shape).clone());
    zero::Partition(unit);
    EXPECT_EQ(init->staged_bytes(), static_cast<uint64_t>(numel) * c10::elementSize(staged));
    EXPECT_EQ(draws, 0) << "drawn when read, not when registered";
    // A destination of the wrong size is refused before anything is drawn.
    torch::Tensor small = torch::empty({numel - 1});
    EXPECT_EQ(zero::ReadStaged(gen, small).status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(draws, 0);
    // Each destination dtype: the generated values are the file's, bit for bit.
    for (torch::Dtype dst_dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16}) {
      SCOPED_TRACE(c10::toString(dst_dtype));
      torch::Tensor g = param(), f = param();
      torch::nn::Module u;
      u.register_parameter("g", g);
      f = u.register_parameter("f", values.reshape(shape).clone());
      ASSERT_TRUE(zero::StageGenerated(g, shape, fill));
      zero::Partition(u);
      torch::Tensor got = torch::empty({numel}, dst_dtype), want = torch::empty({numel}, dst_dtype);
      ASSERT_OK_AND_ASSIGN(bool g_staged, zero::ReadStaged(g, got));
      ASSERT_OK_AND_ASSIGN(bool f_staged, zero::ReadStaged(f, want));
      EXPECT_TRUE(g_staged && f_staged);
      EXPECT_TRUE(torch::equal(got, want));
      EXPECT_TRUE(torch::equal(got, values.to(staged).to(dst_dtype)));
      EXPECT_FALSE(zero::IsStaged(g));
    }
    // The first parameters, read once each.
    torch::Tensor got = torch::empty({numel});
    ASSERT_OK_AND_ASSIGN(bool was, zero::ReadStaged(gen, got));
    EXPECT_TRUE(was);
    EXPECT_TRUE(torch::equal(got, values.to(staged).to(torch::kFloat32)));
    ASSERT_OK_AND_ASSIGN(bool again, zero::ReadStaged(gen, got));
    EXPECT_FALSE(again);
    ASSERT_OK_AND_ASSIGN(bool filed_read, zero::ReadStaged(filed, got));
    EXPECT_TRUE(filed_read);
  }
  // A shapes-only rank never draws: its reads give zeros, as every parameter's there.
  testing::TempDir dir;
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path(), torch::kFloat32, zero::StageMode::kShapesOnly));
  draws = 0;
  torch::Tensor gen = param();
  ASSERT_TRUE(zero::StageGenerated(gen, shape, fill));
  torch::Tensor got = torch::full({numel}, 7.0f);
  ASSERT_OK_AND_ASSIGN(bool was, zero::ReadStaged(gen, got));
  EXPECT_TRUE(was);
  EXPECT_EQ(got.count_nonzero().item<int64_t>(), 0);
  EXPECT_EQ(draws, 0);
  EXPECT_EQ(init->generated_params(), 0);
  // Bad input is refused by name.
  EXPECT_THROW(zero::StageGenerated(torch::zeros({2}, torch::kLong), {2}, fill), std::invalid_argument);
  EXPECT_THROW(zero::StageGenerated(param(), {-1, 4}, fill), std::invalid_argument);
}

// gtest runs a file's tests in order: the tests that build larger models come after this one,
// since a build that reuses the heap pages they freed raises no RSS.
// The OS's view: building a 100 MB model under zero::Init raises the peak RSS by about one unit
// (a block: 1/8 of the model), building it normally by the whole model. (The normal build runs
// first, after zero::Init has fixed glibc's mmap threshold, so both see the same allocator.)
TEST(ZeroInit, PeakRssWhileBuildingIsOneUnitNotTheModel) {
  Config c = BaseConfig();
  c.model.n_layers = 8;
  c.model.d_model = 512;
  c.model.n_heads = 8;
  c.model.seq_len = 64;
  c.model.vocab_size = 256;
  const uint64_t model_bytes = static_cast<uint64_t>(models::GptParameterCount(c.model)) * 4;
  const uint64_t block_bytes = model_bytes / 8;
  testing::TempDir dir;
  auto build_peak = [&](bool staged) {
    std::unique_ptr<zero::Init> init;
    if (staged) init = zero::Init::Create(dir.path()).value();
    EXPECT_TRUE(ResetPeakRss());
    const uint64_t before = ProcStatus("VmRSS");
    auto model = models::BuildGpt(c.model);
    const uint64_t peak = ProcStatus("VmHWM");
    return peak > before ? peak - before : 0;
  };
  // An Init made and dropped first: the normal build then runs under the allocator setting a
  // process has after zero::Init (32 MiB mmap threshold), the staged build under the Init's own.
  { auto warm = zero::Init::Create(dir.path()); }
  const uint64_t normal = build_peak(false);
  const uint64_t staged = build_peak(true);
  std::printf("model %.1f MB: peak RSS growth while building %.1f MB normally, %.1f MB under "
              "zero::Init (one block %.1f MB)\n",
              model_bytes / 1e6, normal / 1e6, staged / 1e6, block_bytes / 1e6);
  EXPECT_GE(normal, model_bytes * 9 / 10);
  EXPECT_LE(staged, 2 * block_bytes + (16u << 20));
}

// strata-train's GPT at a width whose fc and out weights are drawn by ParallelNormal
// (kParallelInitMinNumel): under an Init they are registered with their draw, the file holds
// the rest, and every parameter reads back as the model built normally holds it (through the
// staged dtype).
TEST(ZeroInit, TheGptsLargeMatricesAreDrawnNotStaged) {
  Config c = BaseConfig();
  c.model.n_layers = 1;
  c.model.d_model = 2048;  // fc and out: 4 x 2048 x 2048 = 2^24 elements each
  c.model.n_heads = 16;
  auto plain = models::BuildGpt(c.model);
  const auto want = models::UniqueParameters(*plain);
  const int64_t generated_numel = 2 * 4 * c.model.d_model * c.model.d_model;
  for (torch::Dtype staged : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(staged));
    testing::TempDir dir;
    ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path(), staged));
    auto model = models::BuildGpt(c.model);
    const auto params = models::UniqueParameters(*model);
    ASSERT_EQ(params.size(), want.size());
    const uint64_t esize = c10::elementSize(staged);
    EXPECT_EQ(init->generated_params(), 2);
    EXPECT_EQ(init->generated_bytes(), static_cast<uint64_t>(generated_numel) * esize);
    EXPECT_EQ(init->staged_bytes(),
              static_cast<uint64_t>(models::GptParameterCount(c.model) - generated_numel) * esize);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].numel(), 0) << i;
      torch::Tensor got = torch::empty({want[i].numel()});
      ASSERT_OK_AND_ASSIGN(bool was, zero::ReadStaged(params[i], got));
      ASSERT_TRUE(was) << i;
      EXPECT_TRUE(torch::equal(got, want[i].detach().reshape({-1}).to(staged).to(torch::kFloat32))) << i;
    }
  }
}

}  // namespace
}  // namespace strata
