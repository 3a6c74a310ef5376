#include "tools/swapbench/scratch_files.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace strata::swapbench {
namespace {

// Fixed storage, so the handler reads nothing that allocation could be changing under it: an
// entry is written whole before `count` makes it visible.
constexpr int kMaxPaths = 16;
constexpr size_t kMaxPath = 4096;
struct Entry {
  char path[kMaxPath];
  bool is_dir;
};
Entry g_entries[kMaxPaths];
std::atomic<int> g_count{0};

void OnInterrupt(int sig) {
  const int n = g_count.load();
  for (int pass = 0; pass < 2; ++pass)  // files, then the folders that held them
    for (int i = n - 1; i >= 0; --i)
      if (g_entries[i].is_dir == (pass == 1)) {
        if (pass == 0)
          unlink(g_entries[i].path);
        else
          rmdir(g_entries[i].path);
      }
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void InstallScratchCleanup() {
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = OnInterrupt;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

void RemoveOnInterrupt(const std::string& path, bool is_dir) {
  const int i = g_count.load();
  if (i >= kMaxPaths || path.size() >= kMaxPath) return;
  std::memcpy(g_entries[i].path, path.c_str(), path.size() + 1);
  g_entries[i].is_dir = is_dir;
  g_count.store(i + 1);
}

}  // namespace strata::swapbench
