// Checks of a CLI's output paths, made before its work starts: a run that trains for an hour and
// then cannot write its checkpoint, or writes its plot over its own config, loses that hour or
// that file. Each check names the flag, the path and the fix.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "runtime/base/status.h"

namespace strata::planner {

// The inputs an output must not replace: (flag, path) pairs; empty paths are skipped.
using NamedPaths = std::vector<std::pair<std::string, std::string>>;

// True when `a` and `b` name one file or directory: the same inode where both exist, else the
// same absolute path with "." and ".." resolved and symlinks followed as far as they exist.
bool SamePath(const std::string& a, const std::string& b);

// The flag of the input `path` names, or "" when it names none of `inputs`.
std::string InputNamedBy(const std::string& path, const NamedPaths& inputs);

// `path`, given as `flag`, is a file this run may write at its end: not one of `inputs`, not a
// directory, and in an existing directory where a file can be created (checked by creating and
// removing a probe; an existing file is not touched).
Status CheckOutputFile(const std::string& flag, const std::string& path, const NamedPaths& inputs);

// `path`, given as `flag`, is a directory this run may write into: not one of `inputs`, not a
// file, and created now if missing (with its parents), so that a bad path fails at the start.
Status PrepareOutputDir(const std::string& flag, const std::string& path, const NamedPaths& inputs);

}  // namespace strata::planner
