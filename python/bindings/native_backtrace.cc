#include "python/bindings/native_backtrace.h"
#include "runtime/base/env_vars.h"

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

namespace strata::python {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
struct sigaction previous[sizeof(kSignals) / sizeof(kSignals[0])];

void WriteText(const char* s) {
  // write(2) only: the handler may run with the allocator's lock held by the crashing thread.
  ssize_t unused = write(STDERR_FILENO, s, strlen(s));
  (void)unused;
}

void OnFatalSignal(int sig, siginfo_t* info, void* context) {
  WriteText("\nstrata: fatal signal ");
  WriteText(strsignal(sig));  // a static table in glibc
  WriteText("; native frames of the crashing thread (STRATA_NATIVE_BACKTRACE):\n");
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  WriteText("strata: end of native frames\n");
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
    if (kSignals[i] != sig) continue;
    const struct sigaction& old = previous[i];
    if (old.sa_flags & SA_SIGINFO) {
      if (old.sa_sigaction) {
        old.sa_sigaction(sig, info, context);
        return;
      }
    } else if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN) {
      old.sa_handler(sig);
      return;
    }
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

bool MaybeInstallNativeBacktrace() {
  const char* env = GetEnv(kEnvNativeBacktrace);
  if (env == nullptr || *env == '\0' || std::strcmp(env, "0") == 0) return false;
  // backtrace() loads libgcc_s on its first call; call it once here, not first inside a handler.
  void* warm[1];
  backtrace(warm, 1);
  for (size_t i = 0; i < sizeof(kSignals) / sizeof(kSignals[0]); ++i) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = OnFatalSignal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(kSignals[i], &sa, &previous[i]);
  }
  return true;
}

}  // namespace strata::python
