// strata-launch: environment, output prefixing, failure propagation and teardown.
#include <gtest/gtest.h>

#include <string>

#include "runtime/base/status.h"
#include "tests/runtime/comm/subprocess.h"

namespace strata {
namespace {

using ::strata::testing::RunShell;

std::string Launch(const std::string& args) { return StrCat(STRATA_LAUNCH_BIN, " ", args); }

TEST(LaunchTest, SetsTheRankEnvironmentAndPrefixesEveryLine) {
  const auto r = RunShell(Launch(
      "--nproc 3 --master-port 29999 -- sh -c 'echo \"r=$RANK ws=$WORLD_SIZE lr=$LOCAL_RANK "
      "lws=$LOCAL_WORLD_SIZE addr=$MASTER_ADDR port=$MASTER_PORT\"; echo second; echo err >&2; "
      "printf nonl'"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string p = StrCat("[rank ", rank, "] ");
    EXPECT_NE(r.output.find(StrCat(p, "r=", rank, " ws=3 lr=", rank,
                                   " lws=3 addr=127.0.0.1 port=29999\n")),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find(p + "second\n"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(p + "err\n"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(p + "nonl\n"), std::string::npos) << "unterminated last line";
  }
  // No line escapes without a prefix.
  size_t start = 0, lines = 0;
  while (start < r.output.size()) {
    const size_t nl = r.output.find('\n', start);
    EXPECT_EQ(r.output.compare(start, 6, "[rank "), 0) << r.output.substr(start, nl - start);
    ++lines;
    start = nl == std::string::npos ? r.output.size() : nl + 1;
  }
  EXPECT_EQ(lines, 12u);
}

TEST(LaunchTest, PicksAFreePortWhenAbsentOrZero) {
  const auto r = RunShell(Launch("--nproc 1 --master-port 0 -- sh -c 'echo port=$MASTER_PORT'"));
  EXPECT_EQ(r.exit_code, 0);
  const size_t at = r.output.find("port=");
  ASSERT_NE(at, std::string::npos);
  const int port = std::atoi(r.output.c_str() + at + 5);
  EXPECT_GT(port, 0);
  EXPECT_NE(port, 29500);
}

// Note [an interrupted rank]: a rank that stopped on an interrupt of its own gives the others
// the grace period to stop too (strata-train's ranks stop after the same step), and those still
// running after it are torn down.
TEST(LaunchTest, AnInterruptedRankGivesTheOthersTheGracePeriod) {
  auto r = RunShell(
      Launch("--nproc 2 --grace 10 -- sh -c 'if [ $RANK = 1 ]; then exit 130; fi; sleep 1; "
             "echo finished; exit 130'"));
  EXPECT_EQ(r.exit_code, 130) << r.output;
  EXPECT_NE(r.output.find("[rank 0] finished"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 stopped on an interrupt (exited with code 130)"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("terminating"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 8.0);
  r =
      RunShell(Launch("--nproc 2 --grace 1 -- sh -c 'if [ $RANK = 1 ]; then exit 143; fi; "
                      "exec sleep 60'"));
  EXPECT_EQ(r.exit_code, 143) << r.output;
  EXPECT_NE(r.output.find("did not stop within 1s; terminating them"), std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 10.0);
}

TEST(LaunchTest, FailingRankGivesItsExitCodeAndTearsDownTheOthers) {
  // Rank 1 fails at once; rank 0 would sleep for a minute unless the launcher kills it.
  const auto r = RunShell(Launch(
      "--nproc 2 --grace 1 -- sh -c 'if [ $RANK = 1 ]; then exit 9; fi; exec sleep 60'"));
  EXPECT_EQ(r.exit_code, 9) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 9"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0);
}

TEST(LaunchTest, RankIgnoringSigtermIsKilledAfterGrace) {
  const auto r = RunShell(Launch(
      "--nproc 2 --grace 1 -- sh -c 'if [ $RANK = 0 ]; then sleep 0.3; exit 1; fi; "
      "trap \"\" TERM; while :; do sleep 0.1; done'"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(r.seconds, 10.0);
}

TEST(LaunchTest, KilledRankReportsSignal) {
  const auto r = RunShell(Launch("--nproc 2 -- sh -c 'if [ $RANK = 0 ]; then kill -9 $$; fi; "
                                 "sleep 30'"));
  EXPECT_EQ(r.exit_code, 128 + 9) << r.output;
  EXPECT_NE(r.output.find("killed by signal 9"), std::string::npos) << r.output;
}

TEST(LaunchTest, ForwardsSigtermToRanks) {
  // The launcher itself gets SIGTERM after 0.5 s; ranks must see it (they print and exit 0).
  const auto r = RunShell(StrCat(
      "(", Launch("--nproc 2 -- sh -c 'trap \"echo got-term; exit 0\" TERM; "
                  "while :; do sleep 0.1; done'"),
      ") & pid=$!; sleep 0.5; kill -TERM $pid; wait $pid"));
  EXPECT_EQ(r.exit_code, 128 + 15) << r.output;
  EXPECT_NE(r.output.find("[rank 0] got-term"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] got-term"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0);
}

// A launcher killed outright (SIGKILL, the OOM killer) has no teardown: its ranks went on as
// orphans, holding their memory and waiting in collectives for peers that were gone. They now
// end with it.
TEST(LaunchTest, RanksEndWithALauncherKilledOutright) {
  const auto r = RunShell(StrCat(
      "d=$(mktemp -d); (", Launch("--nproc 2 -- sh -c 'echo $$ > '$d'/pid.$RANK; exec sleep 60'"),
      ") & pid=$!; while [ ! -s $d/pid.0 ] || [ ! -s $d/pid.1 ]; do sleep 0.05; done; "
      "kill -KILL $pid; wait $pid; sleep 1; for r in 0 1; do p=$(cat $d/pid.$r); "
      // A rank killed but not reaped (init in a container may not reap) is a zombie: gone.
      "case \"$(ps -o stat= -p $p)\" in \"\"|Z*) echo rank-$r-gone;; *) echo rank-$r-alive; kill "
      "-KILL $p;; "
      "esac; done; rm -rf $d"));
  EXPECT_NE(r.output.find("rank-0-gone"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank-1-gone"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 20.0);
}

TEST(LaunchTest, UsageErrorsAndHelp) {
  auto r = RunShell(Launch("--nproc 2"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no command given"), std::string::npos) << r.output;
  r = RunShell(Launch("--nproc 0 -- true"));
  EXPECT_NE(r.exit_code, 0);
  r = RunShell(Launch("--help"));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("torchrun"), std::string::npos);
  EXPECT_NE(r.output.find("Slurm"), std::string::npos);
  r = RunShell(Launch("--nproc 1 -- /nonexistent/program"));
  EXPECT_EQ(r.exit_code, 127) << r.output;
  EXPECT_NE(r.output.find("[rank 0] strata-launch: cannot run"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace strata
