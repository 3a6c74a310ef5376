// Runs a command line through /bin/sh and captures its combined output, for tests that drive
// strata-launch. Test-only; aborts the test on fork/pipe errors.
#pragma once

#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace strata::testing {

struct ProcessResult {
  int exit_code = -1;  // 128+signal when killed
  std::string output;  // stdout and stderr, interleaved
  double seconds = 0;
};

inline ProcessResult RunShell(const std::string& command) {
  ProcessResult res;
  const auto t0 = std::chrono::steady_clock::now();
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return res;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) res.output.append(buf, n);
  const int status = pclose(p);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (WIFEXITED(status)) res.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) res.exit_code = 128 + WTERMSIG(status);
  return res;
}

}  // namespace strata::testing
