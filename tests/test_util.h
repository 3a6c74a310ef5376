// Helpers shared by the test suites.
#pragma once

#include <gtest/gtest.h>

#include "runtime/base/status.h"

#define ASSERT_OK(expr)                                      \
  do {                                                       \
    const ::strata::Status strata_t_s_ = (expr);             \
    ASSERT_TRUE(strata_t_s_.ok()) << strata_t_s_.ToString(); \
  } while (0)

#define EXPECT_OK(expr)                                      \
  do {                                                       \
    const ::strata::Status strata_t_s_ = (expr);             \
    EXPECT_TRUE(strata_t_s_.ok()) << strata_t_s_.ToString(); \
  } while (0)

// Asserts a StatusOr is OK and binds its value: ASSERT_OK_AND_ASSIGN(auto x, MakeX());
#define ASSERT_OK_AND_ASSIGN(lhs, expr) \
  ASSERT_OK_AND_ASSIGN_IMPL(STRATA_STATUS_CONCAT(strata_t_sor_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr)             \
  auto tmp = (expr);                                          \
  ASSERT_TRUE(tmp.ok()) << tmp.status().ToString();           \
  lhs = std::move(tmp).value()

namespace strata::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A tmpfs of its own mounted over `dir` (mount options `opts`, e.g. "size=8M") for a test that
// needs a file system of a known size; unmounted on destruction, lazily (MNT_DETACH), because a
// closed io_uring ring may still hold a file on the mount for a moment. mounted() is false where
// the process may not mount (not root, or a container without CAP_SYS_ADMIN); errno says why.
class TmpfsMount {
 public:
  TmpfsMount(const std::string& dir, const char* opts);
  ~TmpfsMount();
  TmpfsMount(const TmpfsMount&) = delete;
  TmpfsMount& operator=(const TmpfsMount&) = delete;
  bool mounted() const { return mounted_; }

 private:
  std::string dir_;
  bool mounted_ = false;
};

// Runs `cmd` through the shell and returns its exit status (-1 when it did not exit normally) and
// its stdout, with stderr too when `with_stderr`.
struct CommandResult {
  int rc = -1;
  std::string out;
};
CommandResult RunCommand(const std::string& cmd, bool with_stderr = true);

}  // namespace strata::testing
