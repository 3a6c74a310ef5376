#include "tests/test_util.h"

#include <sys/mount.h>
#include <sys/wait.h>

#include <cstdio>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "runtime/base/remove_tree.h"

namespace strata::testing {

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string tmpl = std::string(base && *base ? base : "/tmp") + "/strata_test_XXXXXX";
  char* made = mkdtemp(tmpl.data());
  if (made == nullptr) std::abort();
  path_ = made;
}

TempDir::~TempDir() { RemoveTree(path_).IgnoreError(); }  // runtime/base/remove_tree.h says why

TmpfsMount::TmpfsMount(const std::string& dir, const char* opts) : dir_(dir) {
  mounted_ = mount("tmpfs", dir.c_str(), "tmpfs", 0, opts) == 0;
}

TmpfsMount::~TmpfsMount() {
  if (mounted_) umount2(dir_.c_str(), MNT_DETACH);
}

CommandResult RunCommand(const std::string& cmd, bool with_stderr) {
  CommandResult r;
  FILE* p = popen((cmd + (with_stderr ? " 2>&1" : " 2>/dev/null")).c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

}  // namespace strata::testing
