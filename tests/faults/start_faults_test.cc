// Faults during the engine's start: the disk fills (ENOSPC, injected at the block store through
// EngineTestHooks::wrap_store) after the start has taken part of the model into its tiers. What
// the engine promises (runtime/engine/start_rollback.h):
// - The start fails with the fault's error, and says what became of the model.
// - The model is as the start found it: every parameter and buffer has its own dtype, device,
//   memory and values back, and a model built under zero::Init is still staged, its staging file
//   whole; the same model then starts and trains exactly as a fresh one.
// - A start that succeeds gives the staging file's space back.
// - Where the disk cannot hold the NVMe state beside the whole staging file, the start gives the
//   staged space back as it reads it (as it must, to fit), a failure loses those parameters, the
//   error says so, and the next start on that model refuses it instead of training empty
//   parameters.
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/engine/zero_init.h"
#include "tests/runtime/forwarding_store.h"
#include "tests/runtime/gpt_training.h"
#include "tiers/hbm/device_factory.h"

namespace strata {
namespace {

using testing::TempDir;
using testing::TmpfsMount;

Config NvmeConfig(const std::string& nvme_dir, int stage) {
  Config c = BaseConfig();
  c.zero_optimization.stage = stage;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.nvme_path = {nvme_dir};
  if (stage == 3) {
    c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
    c.zero_optimization.offload_param.nvme_path = {nvme_dir};
  }
  // bf16 compute: a stage 0-2 start turns the parameters into bf16 views of its chunks, so the
  // fp32 values given back are told apart from the working copy's.
  c.bf16.enabled = true;
  return c;
}

// The engine's block store on a disk that fills while the start runs (another writer took the
// space): registering an NVMe-placed block after the first `after` fails with ENOSPC, as the swap
// store's growth of its files then does.
class FillingDiskStore final : public testing::ForwardingStore {
 public:
  FillingDiskStore(std::unique_ptr<BlockStore> inner, int after, std::atomic<int>* failed)
      : ForwardingStore(std::move(inner)), after_(after), failed_(failed) {}
  Status Register(const BlockKey& key, uint64_t bytes, Placement placement) override {
    if (placement == Placement::kNvme && registered_++ >= after_) {
      failed_->fetch_add(1);
      return ErrnoToStatus(ENOSPC, "growing the swap file for a block (injected: the disk filled)");
    }
    return ForwardingStore::Register(key, bytes, placement);
  }

 private:
  const int after_;
  int registered_ = 0;  // Register runs on the start's thread
  std::atomic<int>* failed_;
};

struct Snapshot {
  std::vector<torch::Tensor> values;
  std::vector<const void*> data;
};
Snapshot Take(const std::vector<torch::Tensor>& ts) {
  Snapshot s;
  for (const auto& t : ts) {
    s.values.push_back(t.detach().clone());
    s.data.push_back(t.data_ptr());
  }
  return s;
}

void ExpectAsBefore(const std::vector<torch::Tensor>& ts, const Snapshot& s, const char* what) {
  ASSERT_EQ(ts.size(), s.values.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    SCOPED_TRACE(std::string(what) + " " + std::to_string(i));
    EXPECT_EQ(ts[i].scalar_type(), s.values[i].scalar_type());
    EXPECT_EQ(ts[i].sizes(), s.values[i].sizes());
    EXPECT_EQ(ts[i].device(), s.values[i].device());
    EXPECT_EQ(ts[i].data_ptr(), s.data[i]) << "not its own memory";
    EXPECT_TRUE(torch::equal(ts[i].detach(), s.values[i]));
  }
}

// Two steps' losses through an engine on `model`.
std::vector<double> TrainTwoSteps(const torch::nn::AnyModule& model, const Config& c) {
  auto comm = CreateSingleCommunicator();
  auto dev = CreateDevice("cpu", 256 << 20).value();
  auto engine = Engine::Create(model, c, comm.get(), dev.get(), {});
  EXPECT_TRUE(engine.ok()) << engine.status();
  std::vector<double> losses;
  if (!engine.ok()) return losses;
  for (int s = 0; s < 2; ++s) {
    torch::Tensor b = Batch(c, s, 0);
    torch::Tensor l = models::LanguageModelLoss((*engine)->Forward(b.narrow(1, 0, c.model.seq_len)),
                                                b.narrow(1, 1, c.model.seq_len));
    EXPECT_OK((*engine)->Backward(l));
    losses.push_back(l.item<double>());
    auto rep = (*engine)->Step();
    EXPECT_TRUE(rep.ok()) << rep.status();
  }
  return losses;
}

// Starts an engine on `model` on a disk that fills after the start has registered `after` NVMe
// blocks; returns its error. *chunks: the chunks whose initial blocks were written before it
// failed.
Status FailingStart(const torch::nn::AnyModule& model, const Config& c, int after, int* chunks) {
  std::atomic<int> failed{0};
  EngineOptions opts;
  MutableHooks(&opts).wrap_store =
      [after, &failed](std::unique_ptr<BlockStore> inner) -> std::unique_ptr<BlockStore> {
    return std::make_unique<FillingDiskStore>(std::move(inner), after, &failed);
  };
  *chunks = 0;
  MutableHooks(&opts).initial_chunk_hook = [chunks](int64_t) { ++*chunks; };
  auto comm = CreateSingleCommunicator();
  auto dev = CreateDevice("cpu", 256 << 20).value();
  auto engine = Engine::Create(model, c, comm.get(), dev.get(), opts);
  EXPECT_GT(failed.load(), 0) << "no block's registration failed";
  return engine.ok() ? Status() : engine.status();
}

// The allocated bytes of the open staging file (unlinked at creation) under `dir`, found
// through /proc/self/fd; -1 when there is none.
int64_t StagingFileBlocks(const std::string& dir) {
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    char target[PATH_MAX];
    const ssize_t n = ::readlink(e.path().c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    const std::string t(target, static_cast<size_t>(n));
    if (t.rfind(dir + "/", 0) != 0 || t.find("(deleted)") == std::string::npos) continue;
    struct stat st {};
    if (::stat(e.path().c_str(), &st) == 0) return static_cast<int64_t>(st.st_blocks) * 512;
  }
  return -1;
}

TEST(StartFaults, AFailedStartGivesAModelInMemoryBackAsItFoundIt) {
  for (int stage : {3, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    TempDir dir;
    Config c = NvmeConfig(dir.path(), stage);
    const auto build = [&c] {
      torch::manual_seed(c.model.seed);
      models::Gpt gpt = models::BuildGpt(c.model);
      // A floating buffer and a frozen parameter, which the start moves to the compute dtype.
      gpt->register_buffer("scale", torch::randn({7}));
      for (auto& item : gpt->named_parameters())
        if (item.key().find("pos") != std::string::npos) item.value().requires_grad_(false);
      return torch::nn::AnyModule(gpt);
    };
    auto model = build();
    const Snapshot params = Take(model.ptr()->parameters());
    const Snapshot buffers = Take(model.ptr()->buffers());
    int chunks = 0;
    const Status failed = FailingStart(model, c, /*after=*/10, &chunks);
    ASSERT_FALSE(failed.ok()) << "the start went through its failed writes";
    EXPECT_NE(failed.message().find("No space left on device"), std::string::npos) << failed;
    EXPECT_NE(failed.message().find("the model is as the start found it"), std::string::npos)
        << failed;
    EXPECT_GT(chunks, 0) << "the start failed before it took any chunk: " << failed;
    EXPECT_NE(failed.message().find(std::to_string(chunks) + " chunk(s) of them written"),
              std::string::npos)
        << failed;
    std::printf("stage %d, failed after %d chunks: %s\n", stage, chunks, failed.ToString().c_str());
    ExpectAsBefore(model.ptr()->parameters(), params, "parameter");
    ExpectAsBefore(model.ptr()->buffers(), buffers, "buffer");
    // The same model starts and trains exactly as a fresh one.
    EXPECT_EQ(TrainTwoSteps(model, c), TrainTwoSteps(build(), c));
  }
}

TEST(StartFaults, AFailedStartLeavesAZeroInitModelStagedAndItsFileWhole) {
  TempDir dir;
  Config c = NvmeConfig(dir.path(), 3);
  const auto build = [&c] {
    torch::manual_seed(c.model.seed);
    return torch::nn::AnyModule(models::BuildGpt(c.model));
  };
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(dir.path(), torch::kFloat32));
  auto model = build();
  for (const auto& p : model.ptr()->parameters()) ASSERT_TRUE(zero::IsStaged(p));
  const int64_t staged_blocks = StagingFileBlocks(dir.path());
  ASSERT_GE(staged_blocks, static_cast<int64_t>(init->staged_bytes()));
  int chunks = 0;
  const Status failed = FailingStart(model, c, /*after=*/10, &chunks);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.message().find("the model is as the start found it"), std::string::npos)
      << failed;
  EXPECT_GT(chunks, 0) << failed;
  for (const auto& p : model.ptr()->parameters()) {
    EXPECT_TRUE(zero::IsStaged(p));
    EXPECT_EQ(p.numel(), 0);
  }
  EXPECT_EQ(StagingFileBlocks(dir.path()), staged_blocks)
      << "the failed start gave staged space back";

  // The same model starts from its staging file as a fresh build under another Init does, and
  // a start that goes through gives the file's space back.
  const std::vector<double> again = TrainTwoSteps(model, c);
  EXPECT_LT(StagingFileBlocks(dir.path()), staged_blocks / 8) << "the start kept the staging file";
  init.reset();
  TempDir other;
  ASSERT_OK_AND_ASSIGN(auto fresh_init, zero::Init::Create(other.path(), torch::kFloat32));
  EXPECT_EQ(again, TrainTwoSteps(build(), c));
}

// The bytes the files under `dir` take on disk.
uint64_t DiskBytesUnder(const std::string& dir) {
  uint64_t total = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    struct stat st {};
    if (::stat(e.path().c_str(), &st) == 0) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

// A tmpfs that holds the NVMe state and the staging file together only with the staged space given
// back during the start: the start counts on it, and a failure loses the parameters it had read.
TEST(StartFaults, ATightDiskLosesWhatTheStartReadAndTheNextStartRefusesIt) {
  TempDir dir;
  Config c = NvmeConfig(dir.path(), 3);
  c.aio.block_size = 4096;  // stripes no coarser than the chunks, so that the give-back counts
  const auto build = [&c] {
    torch::manual_seed(c.model.seed);
    return torch::nn::AnyModule(models::BuildGpt(c.model));
  };
  const auto on = [&c](const std::string& path) {
    Config r = c;
    r.zero_optimization.offload_optimizer.nvme_path = {path};
    r.zero_optimization.offload_param.nvme_path = {path};
    return r;
  };
  // What the state and the staging file take on a tmpfs, measured on a roomy one.
  uint64_t state = 0;
  int64_t file = 0;
  {
    const std::string probe = dir.path() + "/probe";
    std::filesystem::create_directory(probe);
    TmpfsMount roomy(probe, "size=64M");
    if (!roomy.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
    {
      auto comm = CreateSingleCommunicator();
      auto dev = CreateDevice("cpu", 256 << 20).value();
      ASSERT_OK_AND_ASSIGN(auto engine,
                           Engine::Create(build(), on(probe), comm.get(), dev.get(), {}));
      state = DiskBytesUnder(probe);
    }
    ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(probe, torch::kFloat32));
    auto staged_model = build();
    file = StagingFileBlocks(probe);
  }
  ASSERT_GT(state, 0u);
  ASSERT_GT(file, 0);
  const std::string mnt = dir.path() + "/disk";
  std::filesystem::create_directory(mnt);
  const std::string size =
      "size=" + std::to_string((state + static_cast<uint64_t>(file) / 2) / 4096 * 4096);
  TmpfsMount tight(mnt, size.c_str());
  ASSERT_TRUE(tight.mounted());
  c = on(mnt);
  ASSERT_OK_AND_ASSIGN(auto init, zero::Init::Create(mnt, torch::kFloat32));
  auto model = build();
  int chunks = 0;
  const Status failed = FailingStart(model, c, /*after=*/10, &chunks);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.message().find("No space left on device"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("went with the start"), std::string::npos) << failed;
  EXPECT_GT(chunks, 0) << failed;
  std::printf("tight disk, failed after %d chunks: %s\n", chunks, failed.ToString().c_str());
  // The next start says what happened rather than training parameters with nothing in them.
  auto comm = CreateSingleCommunicator();
  auto dev = CreateDevice("cpu", 256 << 20).value();
  auto again = Engine::Create(model, c, comm.get(), dev.get(), {});
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("failed part-way"), std::string::npos) << again.status();
}

}  // namespace
}  // namespace strata
