// A rank program for the fault tests, run under strata-launch.
//   fault_rank vanish <timeout_s>: rank 1 leaves with _exit(0) after one collective (a rank that
//     disappears without reporting failure); rank 0's next collective must fail within the
//     timeout. Rank 0 exits 3 when it saw the error in time, 4 when it did not, 5 on no error.
//   fault_rank stall <timeout_s>: rank 1 stays alive but stops calling collectives (a hung
//     peer); rank 0 must get DEADLINE_EXCEEDED from the timeout, with the same exit codes.
//   fault_rank crash <timeout_s>: rank 1 leaves with _exit(7); rank 0 blocks in a collective and
//     is expected to be torn down by the launcher.
//   fault_rank abort <timeout_s>: rank 1 gives up (Communicator::Abort) and stays alive; rank 0
//     must fail at once, CANCELLED with rank 1's reason: exit 3 when it did within a third of
//     the timeout, 4 when later or with another error, 5 on no error.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "runtime/comm/backends.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: fault_rank vanish|stall|crash|abort <timeout_s>\n");
    return 2;
  }
  const std::string mode = argv[1];
  strata::CommOptions opts;
  opts.backend = "gloo";
  opts.timeout_s = std::atof(argv[2]);
  auto comm_or = strata::CreateCommunicator(opts);
  if (!comm_or.ok()) {
    std::fprintf(stderr, "setup failed: %s\n", comm_or.status().ToString().c_str());
    return 1;
  }
  strata::Communicator& comm = **comm_or;
  float x = 1.0f;
  if (!comm.AllReduce(&x, 1, strata::DType::kF32, strata::ReduceOp::kSum).ok()) return 1;
  std::printf("first all_reduce ok: %g\n", x);
  std::fflush(stdout);
  if (comm.rank() == 1) {
    if (mode == "abort") {
      comm.Abort(strata::IoError("injected: rank 1's disk failed"));
      std::printf("after giving up, next call: %s\n", comm.Barrier().ToString().c_str());
      std::fflush(stdout);
    }
    if (mode == "stall" || mode == "abort") {
      for (;;) pause();  // until the launcher tears this rank down
    }
    _exit(mode == "crash" ? 7 : 0);
  }

  const auto t0 = std::chrono::steady_clock::now();
  std::vector<float> big(1 << 20, 1.0f);
  strata::Status s;
  for (int i = 0; i < 100 && s.ok(); ++i) {
    s = comm.AllReduce(big.data(), static_cast<int64_t>(big.size()), strata::DType::kF32,
                       strata::ReduceOp::kSum);
  }
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (s.ok()) {
    std::printf("no error after the peer left\n");
    return 5;
  }
  std::printf("collective failed after %.2f s: %s\n", took, s.ToString().c_str());
  // The communicator must stay failed rather than hang on the next call.
  const strata::Status again = comm.Barrier();
  std::printf("next call: %s\n", again.ToString().c_str());
  std::fflush(stdout);
  // _exit: destroying a Gloo group whose peer vanished can block in its destructor.
  if (mode == "abort") {
    // Rank 1 reports its own next call after its Abort returns; the launcher ends it as soon as
    // this rank exits, so give it time to print (it races otherwise, and lost under LibTorch 2.14).
    sleep(2);
    const bool named = s.code() == strata::StatusCode::kCancelled &&
                       s.message().find(
                           "rank 1 of 2 gave up the job's collectives: IO_ERROR: "
                           "injected: rank 1's disk failed") != std::string::npos;
    _exit(took <= opts.timeout_s / 3 && named && !again.ok() ? 3 : 4);
  }
  _exit(took <= opts.timeout_s + 2.0 && !again.ok() ? 3 : 4);
}
