// strata-swapbench subcommands. Each lives in its own file and registers itself on the app;
// the callback it installs runs the measurement and sets *exit_code.
#pragma once

#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "runtime/base/host_info.h"
#include "runtime/base/status.h"
#include "runtime/base/units.h"

namespace strata::swapbench {

void RegisterNvmeCommand(CLI::App& app, int* exit_code);
void RegisterAdamCommand(CLI::App& app, int* exit_code);
void RegisterElementwiseCommands(CLI::App& app, int* exit_code);  // sgd, adagrad, lion
void RegisterTiersCommand(CLI::App& app, int* exit_code);
void RegisterProfileCommand(CLI::App& app, int* exit_code);
void RegisterFormatsCommand(CLI::App& app, int* exit_code);  // Adam by optimizer-state layout

// The sizes every CPU kernel benchmark takes (adam, sgd, adagrad, lion, formats), in the ranges
// adam set first: --n 1..2^31 elements (beyond that, tens of GB of buffers: a typo), --threads
// 0..1024 (0: every core; TBB itself fails far above), --reps 1..1000. The refusal names the
// flag and the value.
inline Status CheckKernelBenchSizes(int64_t n, int64_t threads, int64_t reps) {
  const auto out = [](const char* flag, int64_t v, int64_t lo, int64_t hi) {
    return InvalidArgument(StrCat(flag, "=", v, ": must be in ", lo, "..", hi));
  };
  if (n < 1 || n > (int64_t{1} << 31)) return out("--n", n, 1, int64_t{1} << 31);
  if (threads < 0 || threads > 1024) return out("--threads", threads, 0, 1024);
  if (reps < 1 || reps > 1000) return out("--reps", reps, 1, 1000);
  return Status::Ok();
}

// A benchmark's buffers, `bytes` for --n `n`, against what the host has available: refused
// naming the flag before anything is allocated, where std::bad_alloc would abort the process
// (or the kernel's OOM killer end it).
inline Status CheckBuffersFit(int64_t n, uint64_t bytes) {
  const uint64_t available = ReadHostMemory().available_bytes;
  if (available == 0 || bytes <= available / 10 * 9) return Status::Ok();
  return InvalidArgument(StrCat("--n=", n, ": the benchmark's buffers take about ",
                                FormatBytes(bytes), ", more than the ", FormatBytes(available),
                                " this host has available; give a smaller --n"));
}

}  // namespace strata::swapbench
