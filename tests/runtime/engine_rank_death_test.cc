// A rank that vanishes in the middle of a training step must make the others fail with an error
// within the communication timeout, never hang. The test runs this same binary as two ranks
// under strata-launch; rank 1 exits with status 0 between its forward and its backward (so the
// launcher, which tears the job down only on a failing rank, leaves rank 0 alone), and rank 0
// must notice on its own, in the gradient reduction of that backward.
#include <cstdlib>
#include <cstdio>
#include <string>

#include <gtest/gtest.h>

#include "runtime/comm/backends.h"
#include "tests/runtime/comm/subprocess.h"
#include "tests/runtime/gpt_training.h"
#include "tiers/hbm/device_factory.h"

namespace strata {
namespace {

constexpr double kCommTimeoutS = 5;

// The rank's life: a few steps of stage-3 training over Gloo, rank 1 dying mid-step 2.
int RankMain() {
  CommOptions co;
  co.timeout_s = kCommTimeoutS;
  auto comm = CreateCommunicator(co);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank setup failed: %s\n", comm.status().ToString().c_str());
    return 2;
  }
  Config c = BaseConfig();
  c.zero_optimization.stage = 3;
  c.strata.comm_timeout_s = kCommTimeoutS;
  auto device = CreateDevice("cpu", 256 << 20).value();
  auto engine = Engine::Create(models::BuildGpt(c.model), c, comm->get(), device.get());
  if (!engine.ok()) {
    std::fprintf(stderr, "engine failed: %s\n", engine.status().ToString().c_str());
    return 2;
  }
  const int rank = (*comm)->rank();
  for (int s = 0; s < 4; ++s) {
    torch::Tensor b = Batch(c, s, 0).chunk(2, 0)[rank].contiguous();
    torch::Tensor loss;
    try {
      loss = models::LanguageModelLoss((*engine)->Forward(b.narrow(1, 0, c.model.seq_len)),
                                       b.narrow(1, 1, c.model.seq_len));
    } catch (const std::exception& e) {
      std::printf("rank %d: forward failed: %s\n", rank, e.what());
      return 3;
    }
    if (rank == 1 && s == 2) {
      std::printf("rank 1: vanishing mid-step\n");
      std::fflush(stdout);
      std::_Exit(0);
    }
    Status st = (*engine)->Backward(loss);
    if (st.ok()) st = (*engine)->Step().status();
    if (!st.ok()) {
      std::printf("rank %d: step %d failed: %s\n", rank, s + 1, st.ToString().c_str());
      return 3;
    }
  }
  std::printf("rank %d: finished without noticing\n", rank);
  return 0;
}

TEST(RankDeath, SurvivorFailsWithinTheTimeout) {
  const std::string self = STRATA_SELF_BIN;
  auto r = testing::RunShell(StrCat("STRATA_RANK_DEATH_CHILD=1 ", STRATA_LAUNCH_BIN,
                                    " --nproc 2 --grace 2 -- ", self));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1: vanishing mid-step"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 0: step 3 failed"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("finished without noticing"), std::string::npos) << r.output;
  // Setup and two steps take a few seconds; the failure must come within the timeout after.
  EXPECT_LT(r.seconds, 10 + 3 * kCommTimeoutS) << r.output;
  std::printf("survivor failed after %.1f s in all:\n%s\n", r.seconds, r.output.c_str());
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  if (const char* child = std::getenv("STRATA_RANK_DEATH_CHILD"); child && *child == '1')
    return strata::RankMain();
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
