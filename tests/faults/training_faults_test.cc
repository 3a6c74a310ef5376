// Faults during training: NVMe errors injected into the real I/O completion path (the engine's
// EngineTestHooks::nvme_fault_hook), a corrupted swap file, and resource bounds over many steps. The model is the
// small GPT of tests/runtime/gpt_training.h on the CPU device, with the optimizer states and the
// parameters on NVMe and the smallest host budget the engine accepts, so that every step evicts
// dirty blocks (swap-out writes) and reads them back (swap-in reads).
//
// What the engine promises, and what these tests hold it to:
// - ENOSPC on a swap-out stops training with an error naming the failure (Forward throws it,
//   Backward / Step return it). The run does not continue past the fault, and no block is torn:
//   once the fault clears, every block reads back with a valid checksum.
// - EIO on a swap-in is reported, never trained on. A failed read may be retried by the I/O layer;
//   then the losses are exactly those of a run without faults.
// - Short reads are completed by the I/O engine (requeued): training is unaffected.
// - A byte flipped in the swap file is caught by the block's crc32c (DATA_LOSS), not trained on.
// - Host memory, file descriptors, threads and the swap file do not grow with the step count.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/runtime/gpt_training.h"
#include "tiers/hbm/device_factory.h"

namespace strata {
namespace {

using testing::TempDir;

// Counts entries of a /proc directory (fds, tasks) other than "." and "..".
int CountDir(const char* path) {
  DIR* d = opendir(path);
  if (!d) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n - (std::string(path) == "/proc/self/fd" ? 1 : 0);  // the DIR's own fd
}

Config NvmeConfig(const std::string& nvme_dir, uint64_t host_budget) {
  Config c = BaseConfig();
  c.zero_optimization.stage = 3;
  c.zero_optimization.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_optimizer.nvme_path = {nvme_dir};
  c.zero_optimization.offload_param.device = OffloadDevice::kNvme;
  c.zero_optimization.offload_param.nvme_path = {nvme_dir};
  c.strata.host_memory_budget = host_budget;
  c.strata.prefetch_lookahead = 0;  // reads happen where the step needs them: deterministic faults
  return c;
}

struct Harness {
  std::unique_ptr<Communicator> comm = CreateSingleCommunicator();
  std::unique_ptr<Device> device = CreateDevice("cpu", 256 << 20).value();
  std::unique_ptr<Engine> engine;
  Config config;
};

// The smallest power-of-two host budget the engine accepts for this model: the tiny budget that
// makes every step swap. Engine::Create says when a budget is too small.
Status MakeEngine(const std::string& nvme_dir, const EngineOptions& opts, Harness* h,
                  int64_t prefetch = 0) {
  Status last;
  for (uint64_t budget = 64 << 10; budget <= (256ull << 20); budget *= 2) {
    h->config = NvmeConfig(nvme_dir, budget);
    h->config.strata.prefetch_lookahead = prefetch;
    torch::manual_seed(h->config.model.seed);
    auto e = Engine::Create(models::BuildGpt(h->config.model), h->config, h->comm.get(),
                            h->device.get(), opts);
    if (e.ok()) {
      h->engine = std::move(e).value();
      return Status();
    }
    last = e.status();
    if (last.code() != StatusCode::kInvalidArgument) return last;
  }
  return last;
}

// One optimizer step; the loss in *loss. Forward's exception becomes a Status.
Status TrainStep(Harness* h, int step, double* loss) {
  const Config& c = h->config;
  try {
    torch::Tensor b = Batch(c, step, 0);
    torch::Tensor l = models::LanguageModelLoss(h->engine->Forward(b.narrow(1, 0, c.model.seq_len)),
                                                b.narrow(1, 1, c.model.seq_len));
    STRATA_RETURN_IF_ERROR(h->engine->Backward(l));
    *loss = l.item<double>();
  } catch (const std::exception& e) {
    return Status(StatusCode::kInternal, std::string("Forward threw: ") + e.what());
  }
  auto rep = h->engine->Step();
  return rep.ok() ? Status() : rep.status();
}

// Losses of `steps` clean steps: the reference every faulty run is compared with.
std::vector<double> CleanLosses(int steps) {
  TempDir dir;
  Harness h;
  EXPECT_OK(MakeEngine(dir.path(), {}, &h));
  std::vector<double> losses;
  for (int s = 0; s < steps && h.engine; ++s) {
    double l = 0;
    EXPECT_OK(TrainStep(&h, s, &l));
    losses.push_back(l);
  }
  return losses;
}

// Every master value gathered back through the tiers (a read of every NVMe block, each checked
// against its crc32c) and finite.
void ExpectBlocksReadable(Harness* h) {
  auto params = h->engine->GatherMasterParams();
  ASSERT_TRUE(params.ok()) << "after the fault cleared, the blocks do not read back: "
                           << params.status();
  for (const auto& p : *params) EXPECT_TRUE(torch::isfinite(p).all().item<bool>());
}

struct Injector {
  std::atomic<bool> armed{false};
  std::atomic<int> fired{0};
  nvme::IoOp op = nvme::IoOp::kWrite;
  std::function<int64_t(const nvme::IoAttempt&, int64_t)> rewrite;
  nvme::IoFaultHook Hook() {
    return [this](const nvme::IoAttempt& a, int64_t result) -> int64_t {
      if (!armed.load() || a.op != op || result <= 0) return result;
      int64_t r = rewrite(a, result);
      if (r != result) fired.fetch_add(1);
      return r;
    };
  }
};

constexpr int kCleanSteps = 2;
constexpr int kFaultSteps = 3;

TEST(TrainingFaults, EnospcOnSwapOutStopsWithAClearErrorAndTearsNoBlock) {
  TempDir dir;
  Injector inj;
  inj.op = nvme::IoOp::kWrite;
  inj.rewrite = [](const nvme::IoAttempt&, int64_t) -> int64_t { return -ENOSPC; };
  EngineOptions opts;
  MutableHooks(&opts).nvme_fault_hook = inj.Hook();
  Harness h;
  ASSERT_OK(MakeEngine(dir.path(), opts, &h));
  for (int s = 0; s < kCleanSteps; ++s) {
    double l;
    ASSERT_OK(TrainStep(&h, s, &l));
  }
  inj.armed = true;
  Status st;
  int s = kCleanSteps;
  for (; s < kCleanSteps + kFaultSteps && st.ok(); ++s) {
    double l;
    st = TrainStep(&h, s, &l);
  }
  ASSERT_GT(inj.fired.load(), 0) << "no swap-out happened: the host budget is not tight enough";
  ASSERT_FALSE(st.ok()) << "training went on through " << inj.fired.load() << " failed swap-outs";
  EXPECT_NE(st.ToString().find("No space left on device"), std::string::npos) << st;
  std::printf("ENOSPC: stopped at step %d after %d injected failures: %s\n", s - 1,
              inj.fired.load(), st.ToString().c_str());
  inj.armed = false;
  ExpectBlocksReadable(&h);
}

TEST(TrainingFaults, EioOnSwapInIsReportedNeverTrainedOn) {
  const std::vector<double> clean = CleanLosses(kCleanSteps + kFaultSteps);
  TempDir dir;
  Injector inj;
  inj.op = nvme::IoOp::kRead;
  inj.rewrite = [](const nvme::IoAttempt&, int64_t) -> int64_t { return -EIO; };
  EngineOptions opts;
  MutableHooks(&opts).nvme_fault_hook = inj.Hook();
  Harness h;
  ASSERT_OK(MakeEngine(dir.path(), opts, &h));
  std::vector<double> losses;
  for (int s = 0; s < kCleanSteps; ++s) {
    double l;
    ASSERT_OK(TrainStep(&h, s, &l));
    losses.push_back(l);
  }
  inj.armed = true;
  Status st;
  for (int s = kCleanSteps; s < kCleanSteps + kFaultSteps && st.ok(); ++s) {
    double l = 0;
    st = TrainStep(&h, s, &l);
    if (st.ok()) losses.push_back(l);
  }
  ASSERT_GT(inj.fired.load(), 0) << "no swap-in happened: the host budget is not tight enough";
  ASSERT_FALSE(st.ok()) << "every read failed, yet training went on";
  EXPECT_NE(st.ToString().find("Input/output error"), std::string::npos) << st;
  // Nothing trained on a failed read: the steps that completed match the clean run exactly.
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i], clean[i]) << "step " << i;
  std::printf("EIO: reported after %zu steps: %s\n", losses.size(), st.ToString().c_str());
}

// With prefetch on (the default), a failed read or write-back was issued again from its own
// completion, which served the prefetch window again: the error was reported, and then the
// engine's teardown waited forever for I/O that never ended (strata-train printed the error and
// spun; under strata-launch the whole job hung). Now the step fails, and the engine ends.
TEST(TrainingFaults, AFailingDiskUnderPrefetchStopsTrainingAndTheEngineEnds) {
  for (nvme::IoOp op : {nvme::IoOp::kRead, nvme::IoOp::kWrite}) {
    const char* what = op == nvme::IoOp::kRead ? "read" : "write";
    TempDir dir;
    Injector inj;
    inj.op = op;
    inj.rewrite = [](const nvme::IoAttempt&, int64_t) -> int64_t { return -EIO; };
    EngineOptions opts;
    MutableHooks(&opts).nvme_fault_hook = inj.Hook();
    Harness h;
    ASSERT_OK(MakeEngine(dir.path(), opts, &h, /*prefetch=*/4));
    for (int s = 0; s < kCleanSteps; ++s) {
      double l;
      ASSERT_OK(TrainStep(&h, s, &l));
    }
    inj.armed = true;
    Status st;
    for (int s = kCleanSteps; s < kCleanSteps + 10 && st.ok(); ++s) {
      double l = 0;
      st = TrainStep(&h, s, &l);
    }
    ASSERT_GT(inj.fired.load(), 0) << what << ": no swap I/O happened";
    ASSERT_FALSE(st.ok()) << what << ": every " << what << " failed, yet training went on";
    std::atomic<bool> ended{false};
    std::thread watchdog([&] {
      for (int i = 0; i < 600 && !ended.load(); ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (!ended.load()) {
        std::fprintf(
            stderr,
            "FAILED: after a failed %s the engine did not end within 60 s (%d failed attempts)\n",
            what, inj.fired.load());
        std::fflush(stderr);
        _exit(1);
      }
    });
    const int fired_at_error = inj.fired.load();
    h.engine.reset();
    ended = true;
    watchdog.join();
    // Bounded: the I/O layer's own retries of what was in flight, not an endless reissue.
    EXPECT_LT(inj.fired.load() - fired_at_error, 1000) << what;
    std::printf("%s EIO under prefetch: %s; engine ended\n", what, st.ToString().c_str());
  }
}

// Runs the fault-free schedule with `rewrite` applied to every swap-in; returns the losses of the
// steps that completed and the status that stopped it (OK when all ran).
struct FaultRun {
  std::vector<double> losses;
  Status status;
  int fired = 0;
};
FaultRun RunWithReadFaults(std::function<int64_t(const nvme::IoAttempt&, int64_t)> rewrite) {
  FaultRun out;
  TempDir dir;
  Injector inj;
  inj.op = nvme::IoOp::kRead;
  inj.rewrite = std::move(rewrite);
  EngineOptions opts;
  MutableHooks(&opts).nvme_fault_hook = inj.Hook();
  Harness h;
  out.status = MakeEngine(dir.path(), opts, &h);
  if (!out.status.ok()) return out;
  inj.armed = true;
  for (int s = 0; s < kCleanSteps + kFaultSteps && out.status.ok(); ++s) {
    double l = 0;
    out.status = TrainStep(&h, s, &l);
    if (out.status.ok()) out.losses.push_back(l);
  }
  out.fired = inj.fired.load();
  return out;
}

// A short read is not an error: the NVMe engine resumes from the block it stopped in (O_DIRECT
// stays aligned), so the run completes and trains exactly as without faults.
TEST(TrainingFaults, ShortReadsAreRetriedAndChangeNothing) {
  const std::vector<double> clean = CleanLosses(kCleanSteps + kFaultSteps);
  const std::vector<std::pair<const char*, std::function<int64_t(const nvme::IoAttempt&, int64_t)>>> cases = {
      // The first attempt of every piece transfers one page less than asked (O_DIRECT-aligned).
      {"short read", [](const nvme::IoAttempt& a, int64_t r) -> int64_t {
         return a.attempt == 0 && r > 4096 ? (r - 1) / 4096 * 4096 : r;
       }},
      // ... or an odd number of bytes (a file system without O_DIRECT, or a bounce buffer).
      {"odd short read", [](const nvme::IoAttempt& a, int64_t r) -> int64_t {
         return a.attempt == 0 && r > 1 ? r / 2 + 1 : r;
       }},
  };
  for (const auto& [name, rewrite] : cases) {
    SCOPED_TRACE(name);
    FaultRun run = RunWithReadFaults(rewrite);
    ASSERT_OK(run.status);
    ASSERT_GT(run.fired, 0) << "no swap-in happened";
    ASSERT_EQ(run.losses.size(), clean.size());
    for (size_t i = 0; i < clean.size(); ++i) EXPECT_EQ(run.losses[i], clean[i]) << "step " << i;
    std::printf("%s: %d short transfers resumed, losses identical to the clean run\n", name, run.fired);
  }
}

// EIO is reported, not retried: an I/O error from the device is not known to be transient, and
// retrying a failing disk hides it. The error names the block, the file and the offset, and the
// steps before it trained exactly as the clean run.
TEST(TrainingFaults, EioIsReportedNamingTheBlockAndFile) {
  const std::vector<double> clean = CleanLosses(kCleanSteps + kFaultSteps);
  FaultRun run = RunWithReadFaults(
      [](const nvme::IoAttempt& a, int64_t r) -> int64_t { return a.attempt == 0 ? -EIO : r; });
  ASSERT_GT(run.fired, 0) << "no swap-in happened";
  ASSERT_FALSE(run.status.ok()) << "an EIO on swap-in went unreported";
  EXPECT_NE(run.status.message().find("IO_ERROR"), std::string::npos) << run.status;
  EXPECT_NE(run.status.message().find("reading swap block"), std::string::npos) << run.status;
  EXPECT_NE(run.status.message().find("strata-rank0.swap"), std::string::npos) << run.status;
  for (size_t i = 0; i < run.losses.size(); ++i) EXPECT_EQ(run.losses[i], clean[i]) << "step " << i;
}

TEST(TrainingFaults, CorruptedSwapBlockIsDataLoss) {
  TempDir dir;
  Harness h;
  ASSERT_OK(MakeEngine(dir.path(), {}, &h));
  for (int s = 0; s < kCleanSteps; ++s) {
    double l;
    ASSERT_OK(TrainStep(&h, s, &l));
  }
  // Flip one byte in every 4 KiB page of the swap file: whichever block the next steps read from
  // NVMe, its stored checksum no longer matches.
  const std::string swap = dir.path() + "/strata-rank0.swap";
  int fd = ::open(swap.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << swap << ": " << std::strerror(errno);
  struct stat sb;
  ASSERT_EQ(::fstat(fd, &sb), 0);
  ASSERT_GT(sb.st_size, 0);
  for (off_t off = 100; off < sb.st_size; off += 4096) {
    unsigned char b;
    ASSERT_EQ(::pread(fd, &b, 1, off), 1);
    b ^= 0x5a;
    ASSERT_EQ(::pwrite(fd, &b, 1, off), 1);
  }
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
  Status st;
  for (int s = kCleanSteps; s < kCleanSteps + kFaultSteps && st.ok(); ++s) {
    double l;
    st = TrainStep(&h, s, &l);
  }
  ASSERT_FALSE(st.ok()) << "trained on a corrupted swap file";
  const std::string text = st.ToString();
  EXPECT_NE(text.find("DATA_LOSS"), std::string::npos) << text;
  std::printf("corruption: %s\n", text.c_str());
}

TEST(TrainingFaults, ResourcesDoNotGrowWithSteps) {
  TempDir dir;
  Harness h;
  ASSERT_OK(MakeEngine(dir.path(), {}, &h));
  const uint64_t budget = h.engine->Describe()["host_budget"].get<uint64_t>();
  ASSERT_GT(budget, 0u);
  const std::string swap = dir.path() + "/strata-rank0.swap";
  int fds = 0, tasks = 0;
  struct stat first {};
  uint64_t peak = 0;
  constexpr int kSteps20 = 20, kWarm = 3;
  for (int s = 0; s < kSteps20; ++s) {
    const Config& c = h.config;
    torch::Tensor b = Batch(c, s, 0);
    torch::Tensor l = models::LanguageModelLoss(h.engine->Forward(b.narrow(1, 0, c.model.seq_len)),
                                                b.narrow(1, 1, c.model.seq_len));
    ASSERT_OK(h.engine->Backward(l));
    auto rep = h.engine->Step();
    ASSERT_TRUE(rep.ok()) << rep.status();
    peak = std::max(peak, rep->peak_host_bytes);
    EXPECT_LE(rep->peak_host_bytes, budget) << "step " << s;
    if (s == kWarm) {  // pools, threads and the swap file reach their steady size in a step or two
      fds = CountDir("/proc/self/fd");
      tasks = CountDir("/proc/self/task");
      ASSERT_EQ(::stat(swap.c_str(), &first), 0) << swap;
    }
  }
  struct stat last {};
  ASSERT_EQ(::stat(swap.c_str(), &last), 0);
  EXPECT_LE(CountDir("/proc/self/fd"), fds) << "file descriptors leak";
  EXPECT_LE(CountDir("/proc/self/task"), tasks) << "threads accumulate";
  EXPECT_EQ(last.st_size, first.st_size) << "the swap file grows with steps";
  EXPECT_LE(last.st_blocks, first.st_blocks) << "the swap file's allocation grows with steps";
  const auto tm = h.engine->Describe()["tier_manager"];
  std::printf("resources over %d steps: host peak %llu of budget %llu, fds %d, threads %d, swap "
              "%lld bytes (%lld blocks of 512)\n  tier manager: %s\n",
              kSteps20, static_cast<unsigned long long>(peak),
              static_cast<unsigned long long>(budget), fds, tasks,
              static_cast<long long>(last.st_size), static_cast<long long>(last.st_blocks),
              tm.dump().c_str());
  EXPECT_GT(h.engine->Describe()["tier_manager"].dump().size(), 2u);
}

}  // namespace
}  // namespace strata
