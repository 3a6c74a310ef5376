#include "tools/planner/output_paths.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

namespace strata::planner {
namespace fs = std::filesystem;

bool SamePath(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) return fs::equivalent(a, b, ec) && !ec;
  const fs::path ca = fs::weakly_canonical(fs::absolute(a, ec), ec);
  if (ec) return false;
  const fs::path cb = fs::weakly_canonical(fs::absolute(b, ec), ec);
  return !ec && ca == cb;
}

std::string InputNamedBy(const std::string& path, const NamedPaths& inputs) {
  for (const auto& [in_flag, in_path] : inputs)
    if (SamePath(path, in_path)) return in_flag;
  return "";
}

namespace {

Status NotAnInput(const std::string& flag, const std::string& path, const NamedPaths& inputs) {
  const std::string input = InputNamedBy(path, inputs);
  if (!input.empty())
    return InvalidArgument(StrCat(flag, " ", path, " is also ", input, ": writing it would replace that "
                                  "input; pass another path"));
  return Status::Ok();
}

// Creates and removes a probe file in `dir`: whether this process can create files there (a
// read-only mount, /proc, permissions; root passes mode checks, so access() cannot tell).
Status CanCreateIn(const std::string& flag, const std::string& path, const std::string& dir) {
  const std::string probe = (fs::path(dir) / StrCat(".strata-write-check.", getpid())).string();
  const int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return InvalidArgument(StrCat(flag, " ", path, ": cannot create a file in ", dir, " (", std::strerror(errno),
                                  "); pass a writable path"));
  close(fd);
  unlink(probe.c_str());
  return Status::Ok();
}

}  // namespace

Status CheckOutputFile(const std::string& flag, const std::string& path, const NamedPaths& inputs) {
  STRATA_RETURN_IF_ERROR(NotAnInput(flag, path, inputs));
  struct stat st;
  if (stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    return InvalidArgument(StrCat(flag, " ", path, " is a directory; pass a file name"));
  std::string dir = fs::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return InvalidArgument(StrCat(flag, " ", path, ": its directory ", dir, " does not exist; create it first"));
  return CanCreateIn(flag, path, dir);
}

Status PrepareOutputDir(const std::string& flag, const std::string& path, const NamedPaths& inputs) {
  STRATA_RETURN_IF_ERROR(NotAnInput(flag, path, inputs));
  std::error_code ec;
  if (fs::exists(path, ec) && !fs::is_directory(path, ec))
    return InvalidArgument(StrCat(flag, " ", path, " is a file, not a directory; pass a directory"));
  fs::create_directories(path, ec);
  if (ec) return InvalidArgument(StrCat(flag, " ", path, ": cannot create it (", ec.message(), "); pass a writable path"));
  return CanCreateIn(flag, path, path);
}

}  // namespace strata::planner
