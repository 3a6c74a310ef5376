// Failure behaviour: a vanished or crashed rank, an unreachable store and a bad environment all
// become errors within the timeout, never hangs.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include "runtime/comm/backends.h"
#include "tests/runtime/comm/subprocess.h"
#include "tests/test_util.h"

namespace strata {
namespace {

using ::strata::testing::RunShell;

// Sets environment variables for one test and restores them afterwards.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const char* name : {"WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK",
                             "LOCAL_WORLD_SIZE"}) {
      const char* old = std::getenv(name);
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      unsetenv(name);
    }
    for (auto [k, v] : vars) setenv(k, v, 1);
  }
  ~ScopedEnv() {
    for (auto& [k, v] : saved_) {
      if (v) setenv(k.c_str(), v->c_str(), 1); else unsetenv(k.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

int UnusedPort() {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  close(s);
  return ntohs(a.sin_port);
}

TEST(CommFaultTest, VanishedRankMakesPeerFailWithinTimeout) {
  const auto r = RunShell(StrCat(STRATA_LAUNCH_BIN, " --nproc 2 -- ", FAULT_RANK_BIN, " vanish 5"));
  EXPECT_EQ(r.exit_code, 3) << r.output;  // rank 0 saw the error in time and exited 3
  EXPECT_NE(r.output.find("[rank 0] collective failed after"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("next call: FAILED_PRECONDITION"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 20.0);
}

TEST(CommFaultTest, StalledRankMakesPeerTimeOut) {
  const auto r = RunShell(
      StrCat(STRATA_LAUNCH_BIN, " --nproc 2 --grace 1 -- ", FAULT_RANK_BIN, " stall 3"));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("[rank 0] collective failed after"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("DEADLINE_EXCEEDED"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 15.0);
}

TEST(CommFaultTest, ARankThatGivesUpReleasesItsPeerAtOnceWithItsReason) {
  // Rank 1 gives up and stays alive (a script that caught its error): rank 0, waiting in an
  // all-reduce with it, fails within seconds rather than at the 30 s timeout, and names rank 1's
  // reason; rank 1's own next call fails fast naming it too.
  const auto r =
      RunShell(StrCat(STRATA_LAUNCH_BIN, " --nproc 2 --grace 1 -- ", FAULT_RANK_BIN, " abort 30"));
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_NE(r.output.find("[rank 0] collective failed after"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank 1] after giving up, next call: FAILED_PRECONDITION"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("restart every rank of the job; first error: IO_ERROR: injected"),
            std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 15.0) << "rank 0 must not wait for the 30 s comm timeout";
}

TEST(CommFaultTest, CrashedRankTearsDownPeersAndLauncherFails) {
  const auto r = RunShell(
      StrCat(STRATA_LAUNCH_BIN, " --nproc 2 --grace 2 -- ", FAULT_RANK_BIN, " crash 30"));
  // Rank 1 crashes with 7; rank 0's Gloo sees the reset connection within milliseconds and exits
  // with 3. Whichever the launcher reaps first is the failure it reports: both are right, and
  // either way the job must end non-zero, promptly, with the other rank torn down.
  const bool crash_first = r.output.find("rank 1 exited with code 7") != std::string::npos;
  const bool peer_first = r.output.find("rank 0 exited with code 3") != std::string::npos;
  EXPECT_TRUE(crash_first || peer_first) << r.output;
  EXPECT_EQ(r.exit_code, crash_first ? 7 : 3) << r.output;
  EXPECT_LT(r.seconds, 15.0) << "teardown must not wait for the 30 s comm timeout";
}

TEST(CommFaultTest, UnreachableStoreIsAnErrorWithinTimeout) {
  const std::string port = std::to_string(UnusedPort());
  ScopedEnv env({{"WORLD_SIZE", "2"}, {"RANK", "1"}, {"MASTER_ADDR", "127.0.0.1"},
                 {"MASTER_PORT", port.c_str()}});
  CommOptions opts;
  opts.backend = "gloo";
  opts.timeout_s = 2;
  const auto t0 = std::chrono::steady_clock::now();
  auto comm = CreateCommunicator(opts);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(comm.ok());
  EXPECT_NE(comm.status().message().find("TCPStore at 127.0.0.1:" + port), std::string::npos)
      << comm.status().ToString();
  EXPECT_LT(took, 10.0);
}

TEST(CommFaultTest, BadEnvironmentNamesTheVariable) {
  {
    ScopedEnv env({{"WORLD_SIZE", "two"}});
    auto c = CreateCommunicator(CommOptions{});
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("WORLD_SIZE='two'"), std::string::npos);
  }
  {
    ScopedEnv env({{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
    auto c = CreateCommunicator(CommOptions{});
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("RANK is not set"), std::string::npos);
  }
  {
    ScopedEnv env({{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
    auto c = CreateCommunicator(CommOptions{});
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("RANK='2'"), std::string::npos);
  }
  {
    ScopedEnv env({{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_PORT", "29500"}});
    auto c = CreateCommunicator(CommOptions{});
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("MASTER_ADDR"), std::string::npos);
  }
  {
    ScopedEnv env({{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}});
    auto c = CreateCommunicator(CommOptions{});
    ASSERT_FALSE(c.ok());
    EXPECT_NE(c.status().message().find("MASTER_PORT='70000'"), std::string::npos);
  }
}

TEST(CommFactoryTest, AutoIsSingleWithoutWorldSizeAndOptionsAreChecked) {
  ScopedEnv env({});
  ASSERT_OK_AND_ASSIGN(auto comm, CreateCommunicator(CommOptions{}));
  EXPECT_EQ(comm->backend(), "single");
  CommOptions bad;
  bad.backend = "mpi";
  auto c = CreateCommunicator(bad);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("comm_backend='mpi'"), std::string::npos);
  bad.backend = "auto";
  bad.timeout_s = 0;
  EXPECT_FALSE(CreateCommunicator(bad).ok());
  {
    ScopedEnv two({{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}});
    CommOptions single;
    single.backend = "single";
    auto s = CreateCommunicator(single);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("WORLD_SIZE=2"), std::string::npos);
  }
}

}  // namespace
}  // namespace strata
