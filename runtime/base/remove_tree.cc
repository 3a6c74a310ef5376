#include "runtime/base/remove_tree.h"

#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>

namespace strata {

namespace {

thread_local std::string failed_entry;
thread_local int failed_errno = 0;

int RemoveEntry(const char* path, const struct stat*, int, struct FTW*) {
  if (::remove(path) != 0 && errno != ENOENT) {
    failed_entry = path;
    failed_errno = errno;
    return 1;  // stop the walk
  }
  return 0;
}

}  // namespace

Status RemoveTree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0)
    return errno == ENOENT ? Status::Ok() : ErrnoToStatus(errno, StrCat("remove ", path));
  failed_entry.clear();
  failed_errno = 0;
  // Depth first, so a directory is empty when its turn comes; FTW_PHYS: links are not followed.
  const int rc = ::nftw(path.c_str(), RemoveEntry, 16, FTW_DEPTH | FTW_PHYS);
  if (failed_errno != 0) return ErrnoToStatus(failed_errno, StrCat("remove ", failed_entry));
  if (rc != 0) return ErrnoToStatus(errno, StrCat("remove ", path));
  return Status::Ok();
}

}  // namespace strata
