// Checkpoint and resume under offload: 2N steps equal N steps + save + resume + N steps, bit for
// bit; a crash in the middle of a save leaves the previous checkpoint loadable; damaged or
// mismatched checkpoints are clear errors that overwrite nothing.
#include <signal.h>
#include <sys/stat.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/state/checkpoint.h"
#include "tests/runtime/gpt_training.h"
#include "tiers/hbm/device_factory.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

// Armed by SaveThenDieBeforePublish: the engine's crash point "checkpoint:before_publish" exits.
std::atomic<bool> crash_before_publish{false};
// Run at the same point when set (a test fills the disk there).
std::function<void()> before_publish;

struct Trainer {
  std::unique_ptr<Communicator> comm = CreateSingleCommunicator();
  std::unique_ptr<Device> device = CreateDevice("cpu", 256 << 20).value();
  std::unique_ptr<Engine> engine;
  Config config;

  Trainer(const Config& c, const std::string& nvme_dir) : config(c) {
    EngineOptions o;
    if (!nvme_dir.empty()) o.nvme_path = {nvme_dir};
    // Dies where a crash hurts most (every file of a checkpoint written, nothing published) once
    // a test arms it.
    MutableHooks(&o).crash_point = [](std::string_view point) {
      if (point != "checkpoint:before_publish") return;
      if (crash_before_publish) ::_exit(137);
      if (before_publish) before_publish();
    };
    auto e = Engine::Create(models::BuildGpt(c.model), c, comm.get(), device.get(), o);
    if (!e.ok()) {
      ADD_FAILURE() << e.status();
      std::abort();  // nothing below can run without an engine
    }
    engine = std::move(e).value();
  }

  // Runs steps [from, to) and returns their losses.
  std::vector<double> Train(int from, int to) {
    std::vector<double> losses;
    for (int s = from; s < to; ++s) {
      torch::Tensor b = Batch(config, s, 0);
      torch::Tensor loss = models::LanguageModelLoss(
          engine->Forward(b.narrow(1, 0, config.model.seq_len)), b.narrow(1, 1, config.model.seq_len));
      EXPECT_OK(engine->Backward(loss));
      EXPECT_TRUE(engine->Step().ok());
      losses.push_back(loss.item<double>());
    }
    return losses;
  }
};

Config ResumeConfig(int stage, OffloadDevice where) {
  Config c = BaseConfig();
  c.zero_optimization.stage = stage;
  c.zero_optimization.offload_optimizer.device = where;
  if (stage == 3) c.zero_optimization.offload_param.device = where;
  c.gradient_clipping = 1.0;
  c.scheduler.type = SchedulerType::kWarmupDecayLR;
  c.scheduler.warmup_num_steps = 2;
  c.scheduler.total_num_steps = 20;
  c.scheduler.warmup_max_lr = 3e-3;
  return c;
}

void ExpectBitwiseEqual(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

class Resume : public ::testing::TestWithParam<std::tuple<int, OffloadDevice>> {};

TEST_P(Resume, TwoNStepsEqualNPlusSavePlusResumePlusN) {
  auto [stage, where] = GetParam();
  Config c = ResumeConfig(stage, where);
  constexpr int kN = 3;
  testing::TempDir dir;
  const std::string swap_a = dir.path() + "/swap-a", swap_b = dir.path() + "/swap-b",
                    swap_c = dir.path() + "/swap-c", ckpt = dir.path() + "/ckpt";
  for (const auto& d : {swap_a, swap_b, swap_c}) fs::create_directories(d);
  const bool nvme = where == OffloadDevice::kNvme;

  Trainer straight(c, nvme ? swap_a : "");
  std::vector<double> ref = straight.Train(0, 2 * kN);
  auto ref_params = straight.engine->GatherMasterParams().value();

  std::vector<double> resumed;
  {
    Trainer first(c, nvme ? swap_b : "");
    resumed = first.Train(0, kN);
    ASSERT_OK(first.engine->SaveCheckpoint(ckpt, {{"next_step", kN}}));
  }
  Trainer second(c, nvme ? swap_c : "");
  auto extra = second.engine->LoadCheckpoint(ckpt);
  ASSERT_TRUE(extra.ok()) << extra.status();
  EXPECT_EQ((*extra)["next_step"], kN);
  EXPECT_EQ(second.engine->global_step(), kN);
  for (double l : second.Train(kN, 2 * kN)) resumed.push_back(l);

  ASSERT_EQ(resumed.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(resumed[i], ref[i]) << "step " << i;
  ExpectBitwiseEqual(second.engine->GatherMasterParams().value(), ref_params);
}

INSTANTIATE_TEST_SUITE_P(Placements, Resume,
                         ::testing::Values(std::make_tuple(1, OffloadDevice::kNone),
                                           std::make_tuple(2, OffloadDevice::kCpu),
                                           std::make_tuple(3, OffloadDevice::kNvme)));

// A placement split over device, host and NVMe (strata.placement auto under small budgets)
// resumes bit-exact, and so does a resume under another placement: everything on NVMe, or more
// device memory. The update is the same IEEE operations wherever a chunk's group lives, and the
// checkpoint does not record where.
TEST(ResumeAcrossPlacements, SplitPlacementsResumeBitExactUnderAnyPlacement) {
  auto split = [](uint64_t device_budget) {
    Config c = ResumeConfig(3, OffloadDevice::kNvme);
    c.strata.placement = PlacementMode::kAuto;
    c.strata.device_memory_budget = device_budget;
    c.strata.host_memory_budget = 320 << 10;
    c.strata.chunk_size = 4 << 10;
    return c;
  };
  const Config three_tiers = split(320 << 10);
  Config all_nvme = three_tiers;
  all_nvme.strata.placement = PlacementMode::kConfig;
  all_nvme.strata.host_memory_budget = 0;
  const Config more_device = split(1 << 20);
  constexpr int kN = 3;
  testing::TempDir dir;
  const std::string ckpt = dir.path() + "/ckpt";
  auto swap = [&](const std::string& name) {
    const std::string d = dir.path() + "/" + name;
    fs::create_directories(d);
    return d;
  };
  Trainer straight(three_tiers, swap("straight"));
  const nlohmann::json plan = straight.engine->Describe()["placement"];
  for (const char* tier : {"device", "host", "nvme"})
    ASSERT_GT(plan[tier]["total"].get<uint64_t>(), 0u) << tier << ": " << plan.dump();
  std::vector<double> ref = straight.Train(0, 2 * kN);
  auto ref_params = straight.engine->GatherMasterParams().value();
  std::vector<double> first_losses;
  {
    Trainer first(three_tiers, swap("first"));
    first_losses = first.Train(0, kN);
    ASSERT_OK(first.engine->SaveCheckpoint(ckpt, {{"next_step", kN}}));
  }
  int i = 0;
  for (const Config& then : {three_tiers, all_nvme, more_device}) {
    Trainer second(then, swap("second" + std::to_string(i++)));
    ASSERT_TRUE(second.engine->LoadCheckpoint(ckpt).ok());
    std::vector<double> resumed = first_losses;
    for (double l : second.Train(kN, 2 * kN)) resumed.push_back(l);
    ASSERT_EQ(resumed.size(), ref.size());
    for (size_t s = 0; s < ref.size(); ++s) EXPECT_EQ(resumed[s], ref[s]) << "placement " << i << " step " << s;
    ExpectBitwiseEqual(second.engine->GatherMasterParams().value(), ref_params);
  }
}

TEST(ResumeErrors, MismatchesAndDamageAreClearAndOverwriteNothing) {
  testing::TempDir dir;
  Config c = ResumeConfig(2, OffloadDevice::kCpu);
  const std::string ckpt = dir.path() + "/ckpt";
  std::vector<torch::Tensor> saved_master;
  {
    Trainer t(c, "");
    t.Train(0, 1);
    ASSERT_OK(t.engine->SaveCheckpoint(ckpt, {}));
    saved_master = t.engine->GatherMasterParams().value();
  }
  ASSERT_OK_AND_ASSIGN(std::string step_dir, checkpoint::ResolveCheckpointDir(ckpt));
  EXPECT_EQ(fs::path(step_dir).filename(), "step-00000001");
  // A hand-edited `latest` still names its step through blanks, a CR and a trailing '/', as
  // DeepSpeed strips its own (leading blanks once named "  step-00000001", missing); a path
  // anywhere else is still refused.
  for (const char* text : {"  step-00000001  \n", "step-00000001\r\n", "./step-00000001/\n"}) {
    std::ofstream(ckpt + "/latest", std::ios::trunc) << text;
    ASSERT_OK_AND_ASSIGN(std::string named, checkpoint::ResolveCheckpointDir(ckpt));
    EXPECT_EQ(fs::path(named).filename(), "step-00000001") << text;
  }
  std::ofstream(ckpt + "/latest", std::ios::trunc) << dir.path() << "/elsewhere\n";
  EXPECT_EQ(checkpoint::ResolveCheckpointDir(ckpt).status().code(), StatusCode::kDataLoss);
  std::ofstream(ckpt + "/latest", std::ios::trunc) << "step-00000001\n";
  // A FIFO in a state file's place is refused, where its read blocked for ever.
  {
    const std::string fifo = dir.path() + "/fifo.bin";
    ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
    auto opened = checkpoint::OpenCheckpointFile(fifo);
    EXPECT_EQ(opened.status().code(), StatusCode::kDataLoss);
    EXPECT_NE(opened.status().message().find("is a FIFO, not a regular file"), std::string::npos)
        << opened.status();
  }

  auto missing = checkpoint::ResolveCheckpointDir(dir.path() + "/nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);

  Config other = c;
  other.model.d_model = 48;
  other.model.n_heads = 4;
  Trainer wrong_model(other, "");
  auto r1 = wrong_model.engine->LoadCheckpoint(ckpt);
  ASSERT_FALSE(r1.ok());
  EXPECT_NE(r1.status().message().find("another model"), std::string::npos) << r1.status();

  // Another stage and another accumulation load (Note [elastic resume]): the master as saved,
  // and the micro-step at the same count of boundaries in this run's windows.
  Config stage1 = c;
  stage1.zero_optimization.stage = 1;
  stage1.gradient_accumulation_steps = c.gradient_accumulation_steps + 2;
  Trainer other_stage(stage1, "");
  ASSERT_OK(other_stage.engine->LoadCheckpoint(ckpt).status());
  ExpectBitwiseEqual(other_stage.engine->GatherMasterParams().value(), saved_master);
  EXPECT_EQ(other_stage.engine->global_step(), 1);
  EXPECT_EQ(other_stage.engine->micro_step(), stage1.gradient_accumulation_steps);

  // A step directory is one checkpoint, not a folder of them: a save into it (which went inside
  // it, where no resume from the folder found it) is refused, naming the folder.
  auto into_step = other_stage.engine->SaveCheckpoint(step_dir, {});
  ASSERT_FALSE(into_step.ok());
  EXPECT_EQ(into_step.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(into_step.message().find("save to the folder that holds it, " + fs::absolute(ckpt).string()),
            std::string::npos)
      << into_step;
  EXPECT_FALSE(fs::exists(fs::path(step_dir) / "step-00000001"));

  // Note [another optimizer's states]: an SGD run does not take this AdamW run's exp_avg as its
  // momentum buffer; it loads the weights and the step count, its momentum starting from zero.
  // Adam takes AdamW's moments as they are (the same two).
  {
    Config sgd = c;
    sgd.optimizer.type = OptimizerType::kSGD;
    sgd.optimizer.momentum = 0.9;
    Trainer other_opt(sgd, "");
    ASSERT_OK(other_opt.engine->LoadCheckpoint(ckpt).status());
    ExpectBitwiseEqual(other_opt.engine->GatherMasterParams().value(), saved_master);
    EXPECT_EQ(other_opt.engine->global_step(), 1);
    ASSERT_OK_AND_ASSIGN(auto momentum, other_opt.engine->GatherParamState(StateKind::kExpAvg, {}));
    for (const auto& m : momentum) EXPECT_EQ(m.abs().max().item<float>(), 0.0f);
    // SGD without momentum keeps no exp_avg: a resume with momentum was refused as a damaged
    // checkpoint. It loads the weights and the count, the momentum from zero.
    {
      Config plain_sgd = c;
      plain_sgd.optimizer.type = OptimizerType::kSGD;
      plain_sgd.optimizer.momentum = 0.0;
      const std::string sgd_ckpt = dir.path() + "/sgd";
      std::vector<torch::Tensor> sgd_master;
      {
        Trainer t(plain_sgd, "");
        t.Train(0, 1);
        ASSERT_OK(t.engine->SaveCheckpoint(sgd_ckpt, {}));
        sgd_master = t.engine->GatherMasterParams().value();
      }
      Trainer with_momentum(sgd, "");
      ASSERT_OK(with_momentum.engine->LoadCheckpoint(sgd_ckpt).status());
      ExpectBitwiseEqual(with_momentum.engine->GatherMasterParams().value(), sgd_master);
      EXPECT_EQ(with_momentum.engine->global_step(), 1);
      ASSERT_OK_AND_ASSIGN(auto buf,
                           with_momentum.engine->GatherParamState(StateKind::kExpAvg, {}));
      for (const auto& b : buf) EXPECT_EQ(b.abs().max().item<float>(), 0.0f);
      EXPECT_EQ(with_momentum.Train(1, 2).size(), 1u);
    }
    Config adam = c;
    adam.optimizer.type = OptimizerType::kAdam;
    Trainer same_states(adam, "");
    ASSERT_OK(same_states.engine->LoadCheckpoint(ckpt).status());
    ASSERT_OK_AND_ASSIGN(auto moments, same_states.engine->GatherParamState(StateKind::kExpAvg, {}));
    float largest = 0;
    for (const auto& m : moments) largest = std::max(largest, m.abs().max().item<float>());
    EXPECT_GT(largest, 0.0f) << "AdamW's moments did not load into Adam";
  }

  // Flip one byte of the shard file: DATA_LOSS naming the block, and the live state is untouched.
  const std::string bin = step_dir + "/rank-00000.bin";
  std::string bytes = checkpoint::ReadFile(bin).value();
  std::string original = bytes;
  bytes[bytes.size() / 2] ^= 0x01;
  std::ofstream(bin, std::ios::binary | std::ios::trunc) << bytes;
  Trainer victim(c, "");
  auto before = victim.engine->GatherMasterParams().value();
  auto r3 = victim.engine->LoadCheckpoint(ckpt);
  ASSERT_FALSE(r3.ok());
  EXPECT_EQ(r3.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r3.status().message().find("crc32c"), std::string::npos) << r3.status();
  ExpectBitwiseEqual(victim.engine->GatherMasterParams().value(), before);

  // A truncated file and a garbled manifest are DATA_LOSS too.
  std::ofstream(bin, std::ios::binary | std::ios::trunc) << original.substr(0, original.size() / 3);
  auto r4 = victim.engine->LoadCheckpoint(ckpt);
  ASSERT_FALSE(r4.ok());
  EXPECT_EQ(r4.status().code(), StatusCode::kDataLoss);
  std::ofstream(step_dir + "/rank-00000.json", std::ios::trunc) << "{\"format\": \"strata-chec";
  auto r5 = victim.engine->LoadCheckpoint(ckpt);
  ASSERT_FALSE(r5.ok());
  EXPECT_EQ(r5.status().code(), StatusCode::kDataLoss);
}

// Note [a load cut short]: the last block of a checkpoint damaged, so its load fails after
// every other block has overwritten the state. A training forward, Backward, Step and a save are
// then refused, naming the checkpoint; a load of the repaired checkpoint makes the state whole,
// and training goes on from it as from an undamaged load.
TEST(ResumeErrors, ALoadCutShortRefusesTrainingAndSavesUntilALoadCompletes) {
  testing::TempDir dir;
  Config c = ResumeConfig(2, OffloadDevice::kCpu);
  const std::string ckpt = dir.path() + "/ckpt";
  std::vector<torch::Tensor> saved_master;
  {
    Trainer t(c, "");
    t.Train(0, 2);
    ASSERT_OK(t.engine->SaveCheckpoint(ckpt, {}));
    saved_master = t.engine->GatherMasterParams().value();
  }
  ASSERT_OK_AND_ASSIGN(std::string step_dir, checkpoint::ResolveCheckpointDir(ckpt));
  ASSERT_OK_AND_ASSIGN(std::string text, checkpoint::ReadFile(step_dir + "/rank-00000.json"));
  ASSERT_OK_AND_ASSIGN(checkpoint::Manifest m, checkpoint::ParseManifest(text, "manifest"));
  ASSERT_GE(m.blocks.size(), 4u) << "too few blocks for a load cut short";
  const checkpoint::BlockEntry last = m.blocks.back();
  const std::string bin = step_dir + "/rank-00000.bin";
  const std::string original = checkpoint::ReadFile(bin).value();
  std::string damaged = original;
  damaged[last.offset + last.bytes / 2] ^= 0x10;
  std::ofstream(bin, std::ios::binary | std::ios::trunc) << damaged;

  Trainer victim(c, "");
  auto cut = victim.engine->LoadCheckpoint(ckpt);
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.status().code(), StatusCode::kDataLoss) << cut.status();
  // Part of the state is the checkpoint's now: the first chunk's master is as saved.
  ASSERT_OK_AND_ASSIGN(auto mixed, victim.engine->GatherMasterParams());
  bool some_loaded = false;
  for (size_t i = 0; i < mixed.size(); ++i) some_loaded |= torch::equal(mixed[i], saved_master[i]);
  EXPECT_TRUE(some_loaded) << "the damaged block was read before any other";

  auto expect_refused = [&](const Status& s, const char* what) {
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << what << ": " << s;
    EXPECT_NE(s.message().find("after a load of " + step_dir + " failed part way"),
              std::string::npos)
        << what << ": " << s;
  };
  torch::Tensor b = Batch(c, 2, 0);
  try {
    victim.engine->Forward(b.narrow(1, 0, c.model.seq_len));
    ADD_FAILURE() << "a training forward ran on the torn state";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("failed part way"), std::string::npos) << e.what();
  }
  expect_refused(victim.engine->Step().status(), "Step");
  expect_refused(victim.engine->SaveCheckpoint(dir.path() + "/other", {}), "SaveCheckpoint");
  EXPECT_FALSE(fs::exists(dir.path() + "/other/latest"));
  // An evaluation forward reads the state without training on it.
  {
    torch::NoGradGuard ng;
    EXPECT_NO_THROW(victim.engine->Forward(b.narrow(1, 0, c.model.seq_len)));
  }

  std::ofstream(bin, std::ios::binary | std::ios::trunc) << original;
  ASSERT_OK(victim.engine->LoadCheckpoint(ckpt).status());
  ExpectBitwiseEqual(victim.engine->GatherMasterParams().value(), saved_master);
  const std::vector<double> resumed = victim.Train(2, 3);
  // The same step from an engine that loaded the undamaged checkpoint at once.
  Trainer clean(c, "");
  ASSERT_OK(clean.engine->LoadCheckpoint(ckpt).status());
  EXPECT_EQ(clean.Train(2, 3), resumed);
  ExpectBitwiseEqual(victim.engine->GatherMasterParams().value(),
                     clean.engine->GatherMasterParams().value());
}

// The crash tests run their victim job in a fresh process: this test binary started again with
// only one of the ResumeCrashChild tests selected. Not fork(): LibTorch 2.x refuses autograd in a
// forked child of a process that has already run a backward pass, and the parent here has.
constexpr char kChildDirEnv[] = "STRATA_RESUME_CHILD_DIR";

pid_t SpawnChild(const std::string& test, const std::string& dir) {
  const std::string exe = fs::read_symlink("/proc/self/exe").string();
  const std::string filter = "--gtest_filter=ResumeCrashChild." + test;
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::string_view(*e).rfind("GTEST_", 0) != 0) env.emplace_back(*e);  // no sharding, no output file
  }
  env.push_back(std::string(kChildDirEnv) + "=" + dir);
  std::vector<char*> envp, argv = {const_cast<char*>(exe.c_str()), const_cast<char*>(filter.c_str()),
                                   nullptr};
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv.data(), envp.data());
  if (rc != 0) {
    ADD_FAILURE() << "posix_spawn " << exe << ": " << std::strerror(rc);
    return -1;
  }
  return pid;
}

int WaitFor(pid_t pid) {
  int status = 0;
  if (pid > 0) waitpid(pid, &status, 0);
  return status;
}

// The directory a ResumeCrashChild test works in, or null when it was not started by a parent.
const char* ChildDir() { return std::getenv(kChildDirEnv); }

Config PublishCrashConfig() { return ResumeConfig(3, OffloadDevice::kNvme); }

Config SigkillConfig() {
  Config c = ResumeConfig(3, OffloadDevice::kNvme);
  c.model.d_model = 64;
  return c;
}
constexpr int kSigkillTarget = 60;

// Child of DeathBeforePublishKeepsThePreviousCheckpoint: saves step 1, then dies inside the save
// of step 2 just before it would be published.
TEST(ResumeCrashChild, SaveThenDieBeforePublish) {
  if (ChildDir() == nullptr) GTEST_SKIP() << "runs only as the child of a ResumeCrash test";
  const std::string dir = ChildDir();
  Trainer t(PublishCrashConfig(), dir + "/swap");
  t.Train(0, 1);
  if (!t.engine->SaveCheckpoint(dir + "/ckpt", {{"next_step", 1}}).ok()) _exit(3);
  t.Train(1, 2);
  crash_before_publish = true;
  (void)t.engine->SaveCheckpoint(dir + "/ckpt", {{"next_step", 2}});
  _exit(4);  // not reached: the hook exits with 137
}

// Child of SigkillAtRandomMoments...: resumes if it can, trains, saves after every step, then
// waits for the kill like an idle job.
TEST(ResumeCrashChild, TrainAndSaveEveryStep) {
  if (ChildDir() == nullptr) GTEST_SKIP() << "runs only as the child of a ResumeCrash test";
  const std::string dir = ChildDir(), ckpt = dir + "/ckpt";
  Trainer t(SigkillConfig(), dir + "/swap");
  std::ofstream(dir + "/ready").put('1');  // the parent's clock for the random moment starts here
  int start = 0;
  if (checkpoint::ResolveCheckpointDir(ckpt).ok()) {
    if (!t.engine->LoadCheckpoint(ckpt).ok()) _exit(4);
    start = static_cast<int>(t.engine->global_step());
  }
  for (int s = start; s < kSigkillTarget; ++s) {
    t.Train(s, s + 1);
    if (!t.engine->SaveCheckpoint(ckpt, {{"next_step", s + 1}}).ok()) _exit(3);
  }
  for (;;) pause();
}

TEST(ResumeCrash, DeathBeforePublishKeepsThePreviousCheckpoint) {
  testing::TempDir dir;
  Config c = PublishCrashConfig();
  const std::string ckpt = dir.path() + "/ckpt", swap = dir.path() + "/swap";
  fs::create_directories(swap);
  const int status = WaitFor(SpawnChild("SaveThenDieBeforePublish", dir.path()));
  ASSERT_TRUE(WIFEXITED(status)) << "status " << status;
  ASSERT_EQ(WEXITSTATUS(status), 137);
  ASSERT_OK_AND_ASSIGN(std::string step_dir, checkpoint::ResolveCheckpointDir(ckpt));
  EXPECT_EQ(fs::path(step_dir).filename(), "step-00000001");
  Trainer t(c, swap);
  auto extra = t.engine->LoadCheckpoint(ckpt);
  ASSERT_TRUE(extra.ok()) << extra.status();
  EXPECT_EQ((*extra)["next_step"], 1);
}

// Writes into `path` until the file system is full.
void FillDisk(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << std::strerror(errno);
  std::setvbuf(f, nullptr, _IONBF, 0);
  const std::vector<char> page(4096, 'x');
  while (std::fwrite(page.data(), 1, page.size(), f) == page.size()) {
  }
  std::fclose(f);
}

// A disk that fills between the step's files and its publication refuses the save with the root
// as it was: no step stands without `latest` naming it (a first save once left a root that a
// resume called empty), and an older checkpoint stays the one `latest` names.
TEST(ResumeDiskFull, AFullDiskAtPublicationLeavesTheRootAsItWas) {
  testing::TempDir dir;
  const std::string root = dir.path() + "/ckpt";
  fs::create_directories(root);
  testing::TmpfsMount tmpfs(root, "size=64M");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
  Trainer t(ResumeConfig(2, OffloadDevice::kCpu), "");
  t.Train(0, 1);

  before_publish = [&] { FillDisk(root + "/filler"); };
  Status full = t.engine->SaveCheckpoint(root, {});
  EXPECT_FALSE(full.ok());
  EXPECT_NE(full.ToString().find("No space left"), std::string::npos) << full;
  EXPECT_FALSE(fs::exists(root + "/step-00000001"));
  EXPECT_FALSE(fs::exists(root + "/latest"));
  EXPECT_EQ(checkpoint::ResolveCheckpointDir(root).status().code(), StatusCode::kNotFound);

  fs::remove(root + "/filler");
  before_publish = nullptr;
  ASSERT_OK(t.engine->SaveCheckpoint(root, {{"next_step", 1}}));
  std::vector<torch::Tensor> step1 = t.engine->GatherMasterParams().value();
  t.Train(1, 2);
  before_publish = [&] { FillDisk(root + "/filler"); };
  EXPECT_FALSE(t.engine->SaveCheckpoint(root, {}).ok());
  before_publish = nullptr;
  fs::remove(root + "/filler");
  EXPECT_FALSE(fs::exists(root + "/step-00000002"));
  ASSERT_OK_AND_ASSIGN(std::string latest, checkpoint::ResolveCheckpointDir(root));
  EXPECT_EQ(fs::path(latest).filename(), "step-00000001");
  for (const auto& e : fs::directory_iterator(root))  // no leftover of the refused saves
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();

  Trainer fresh(ResumeConfig(2, OffloadDevice::kCpu), "");
  auto extra = fresh.engine->LoadCheckpoint(root);
  ASSERT_TRUE(extra.ok()) << extra.status();
  EXPECT_EQ((*extra)["next_step"], 1);
  ExpectBitwiseEqual(fresh.engine->GatherMasterParams().value(), step1);
}

// A replacement cut short between its two renames (the fallback for a file system without
// RENAME_EXCHANGE) leaves the step `latest` names as .step-N.old: a load reads it there, and the
// next save gives it its name back.
TEST(ResumeCrash, AReplacementCutShortIsLoadedFromTheCopyMovedAside) {
  testing::TempDir dir;
  const std::string root = dir.path() + "/ckpt";
  Config c = ResumeConfig(2, OffloadDevice::kCpu);
  Trainer t(c, "");
  t.Train(0, 1);
  ASSERT_OK(t.engine->SaveCheckpoint(root, {{"next_step", 1}}));
  std::vector<torch::Tensor> step1 = t.engine->GatherMasterParams().value();
  fs::rename(root + "/step-00000001", root + "/.step-00000001.old");  // where the crash left it

  ASSERT_OK_AND_ASSIGN(std::string found, checkpoint::ResolveCheckpointDir(root));
  EXPECT_EQ(fs::path(found).filename(), ".step-00000001.old");
  Trainer resumed(c, "");
  auto extra = resumed.engine->LoadCheckpoint(root);
  ASSERT_TRUE(extra.ok()) << extra.status();
  EXPECT_EQ((*extra)["next_step"], 1);
  ExpectBitwiseEqual(resumed.engine->GatherMasterParams().value(), step1);

  // The next save, of another step, restores the old copy's name before it publishes.
  resumed.Train(1, 2);
  ASSERT_OK(resumed.engine->SaveCheckpoint(root, {{"next_step", 2}}));
  EXPECT_TRUE(fs::exists(root + "/step-00000001/rank-00000.json"));
  EXPECT_FALSE(fs::exists(root + "/.step-00000001.old"));
  ASSERT_OK_AND_ASSIGN(std::string latest, checkpoint::ResolveCheckpointDir(root));
  EXPECT_EQ(fs::path(latest).filename(), "step-00000002");
}

// A job that is SIGKILLed at random moments (mid-step, mid-save) and restarted from its last
// checkpoint each time ends exactly where an uninterrupted run ends.
TEST(ResumeCrash, SigkillAtRandomMomentsThenResumeMatchesAnUninterruptedRun) {
  testing::TempDir dir;
  Config c = SigkillConfig();
  const std::string ckpt = dir.path() + "/ckpt", swap = dir.path() + "/swap",
                    ref_swap = dir.path() + "/ref-swap";
  fs::create_directories(swap);
  fs::create_directories(ref_swap);
  std::vector<torch::Tensor> reference;
  {
    Trainer r(c, ref_swap);
    r.Train(0, kSigkillTarget);
    reference = r.engine->GatherMasterParams().value();
  }
  std::mt19937 rng(7);
  for (int round = 0; round < 3; ++round) {
    fs::remove(dir.path() + "/ready");
    const pid_t pid = SpawnChild("TrainAndSaveEveryStep", dir.path());
    ASSERT_GT(pid, 0);
    // A fresh process spends a while loading LibTorch; the random moment counts from its engine.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    int status = 0;
    pid_t done = 0;
    while (!fs::exists(dir.path() + "/ready") && std::chrono::steady_clock::now() < deadline &&
           (done = waitpid(pid, &status, WNOHANG)) == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (done == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(40 + rng() % 160));
      kill(pid, SIGKILL);
      status = WaitFor(pid);
    }
    ASSERT_TRUE(WIFSIGNALED(status)) << "the job failed on its own: status " << status;
    auto latest = checkpoint::ResolveCheckpointDir(ckpt);
    std::printf("round %d: killed; latest checkpoint %s\n", round,
                latest.ok() ? fs::path(*latest).filename().c_str() : "none yet");
  }
  Trainer t(c, swap);
  int64_t resumed_at = 0;
  if (checkpoint::ResolveCheckpointDir(ckpt).ok()) {
    auto extra = t.engine->LoadCheckpoint(ckpt);
    ASSERT_TRUE(extra.ok()) << extra.status();
    resumed_at = t.engine->global_step();
    EXPECT_EQ((*extra)["next_step"].get<int64_t>(), resumed_at);
  }
  t.Train(static_cast<int>(resumed_at), kSigkillTarget);
  ExpectBitwiseEqual(t.engine->GatherMasterParams().value(), reference);
  std::printf("killed 3 times; the last checkpoint was step %lld of %d\n",
              static_cast<long long>(resumed_at), kSigkillTarget);
}

}  // namespace
}  // namespace strata
