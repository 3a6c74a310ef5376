// A start that fails on one rank of two (Note [a start that fails on one rank] in
// runtime/engine/engine.cc). The failing rank stays alive, as a script that catches the error
// would; the other must fail within seconds, not at the 60 s communication timeout, with an
// error that names the failing rank and its reason. Then neither rank's communicator starts
// another engine, and each says to restart every rank. The test runs this same binary as two
// ranks under strata-launch, once per way of failing:
// - refused: rank 1's device is too small for the largest unit, which its start refuses after
//   the buffers' broadcasts, while rank 0 goes on into the first chunk's;
// - partway: rank 1's start throws (as a LibTorch error would) once it has written two chunks,
//   with rank 0 in the third chunk's broadcast.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

#include "runtime/comm/backends.h"
#include "tests/runtime/comm/subprocess.h"
#include "tests/runtime/gpt_training.h"
#include "tiers/hbm/device_factory.h"

namespace strata {
namespace {

constexpr double kCommTimeoutS = 60;

int RankMain(const std::string& mode) {
  CommOptions co;
  co.timeout_s = kCommTimeoutS;
  auto comm = CreateCommunicator(co);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank setup failed: %s\n", comm.status().ToString().c_str());
    return 2;
  }
  const int rank = (*comm)->rank();
  Config c = BaseConfig();
  c.zero_optimization.stage = 3;
  c.strata.comm_timeout_s = kCommTimeoutS;
  const bool fails = rank == 1;
  // Rank 1's device in `refused`: 64 KiB, below its largest unit gathered.
  auto device = CreateDevice("cpu", fails && mode == "refused" ? 64 << 10 : 256 << 20).value();
  EngineOptions opts;
  if (fails && mode == "partway") {
    MutableHooks(&opts).initial_chunk_hook = [written = 0](int64_t chunk) mutable {
      if (++written == 2)
        throw std::runtime_error("injected start fault after chunk " + std::to_string(chunk));
    };
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto engine = Engine::Create(models::BuildGpt(c.model), c, comm->get(), device.get(), opts);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (engine.ok()) {
    std::printf("rank %d: started\n", rank);
    return 5;
  }
  std::printf("rank %d: start failed after %.1f s: %s\n", rank, took,
              engine.status().ToString().c_str());
  auto again = Engine::Create(models::BuildGpt(c.model), c, comm->get(), device.get(), {});
  std::printf("rank %d: again: %s\n", rank,
              again.ok() ? "started" : again.status().ToString().c_str());
  std::fflush(stdout);
  if (fails) {
    sleep(static_cast<unsigned>(2 * kCommTimeoutS));  // alive until the launcher ends the job
    return 0;
  }
  return 3;
}

void ExpectReleasedWithTheReason(const std::string& mode, const std::string& reason) {
  const std::string self = STRATA_SELF_BIN;
  auto r = testing::RunShell(StrCat("STRATA_START_FAULT_CHILD=", mode, " ", STRATA_LAUNCH_BIN,
                                    " --nproc 2 --grace 1 -- ", self));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find(StrCat("[rank 1] rank 1: start failed after")), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find(reason), std::string::npos) << r.output;
  EXPECT_NE(
      r.output.find(
          "this rank gave up the job's collectives, and the other ranks' starts fail naming this "
          "error: restart every rank"),
      std::string::npos)
      << r.output;
  // Rank 0's error is CANCELLED and carries rank 1's reason.
  const size_t line = r.output.find("[rank 0] rank 0: start failed after");
  ASSERT_NE(line, std::string::npos) << r.output;
  const std::string zero = r.output.substr(line, r.output.find('\n', line) - line);
  EXPECT_NE(zero.find(": CANCELLED: "), std::string::npos) << zero;
  EXPECT_NE(zero.find(StrCat("rank 1 of 2 gave up the job's collectives: ", reason)),
            std::string::npos)
      << zero;
  EXPECT_NE(zero.find("restart every rank once that rank's cause is fixed"), std::string::npos)
      << zero;
  // Neither communicator serves another start.
  for (const char* rank : {"[rank 0] rank 0: again: FAILED_PRECONDITION",
                           "[rank 1] rank 1: again: FAILED_PRECONDITION"})
    EXPECT_NE(r.output.find(rank), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restart every rank of the job"), std::string::npos) << r.output;
  // The setup takes a few seconds; waiting for the timeout would take 60 more.
  EXPECT_LT(r.seconds, kCommTimeoutS / 2) << r.output;
  std::printf("%s: the job ended after %.1f s:\n%s\n", mode.c_str(), r.seconds, r.output.c_str());
}

TEST(MultiRankStartFaults, ADeviceTooSmallOnOneRankEndsTheOthersStartsNamingIt) {
  ExpectReleasedWithTheReason("refused", "RESOURCE_EXHAUSTED: stage 3 gathers each unit whole");
}

TEST(MultiRankStartFaults, AStartThatFailsPartWayOnOneRankEndsTheOthersStartsNamingIt) {
  ExpectReleasedWithTheReason("partway",
                              "INTERNAL: engine start: injected start fault after chunk 1");
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  if (const char* child = std::getenv("STRATA_START_FAULT_CHILD"); child && *child != '\0')
    return strata::RankMain(child);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
