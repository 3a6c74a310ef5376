#include "runtime/base/remove_tree.h"

#include <sys/stat.h>

#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace strata {
namespace {

bool Exists(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0;
}

void Touch(const std::string& p) { std::ofstream(p) << "x"; }

TEST(RemoveTree, RemovesNestedTreesAndNeverFollowsLinks) {
  testing::TempDir dir;
  const std::string root = dir.path() + "/tree";
  const std::string keep = dir.path() + "/keep";
  ASSERT_EQ(::mkdir(keep.c_str(), 0755), 0);
  Touch(keep + "/precious");
  ASSERT_EQ(::mkdir(root.c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((root + "/a").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((root + "/a/b").c_str(), 0755), 0);
  Touch(root + "/f");
  Touch(root + "/a/b/g");
  ASSERT_EQ(::symlink(keep.c_str(), (root + "/a/link").c_str()), 0);
  ASSERT_OK(RemoveTree(root));
  EXPECT_FALSE(Exists(root));
  // The link went, not what it pointed at.
  EXPECT_TRUE(Exists(keep + "/precious"));
  // A single file, and a path that does not exist.
  ASSERT_OK(RemoveTree(keep + "/precious"));
  EXPECT_FALSE(Exists(keep + "/precious"));
  EXPECT_OK(RemoveTree(dir.path() + "/never-was"));
}

TEST(RemoveTree, AFailureNamesTheEntry) {
  // procfs refuses unlink even to root, so this fails the same way for every user.
  Status s = RemoveTree("/proc/self/comm");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("/proc/self/comm"), std::string::npos) << s;
}

}  // namespace
}  // namespace strata
