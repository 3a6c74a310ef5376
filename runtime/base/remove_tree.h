// RemoveTree: deletes a file or a whole directory tree, as `rm -rf` does.
//
// Every recursive delete in Strata goes through this instead of std::filesystem::remove_all. A
// pip LibTorch 2.x exports the std::filesystem it links statically (pytorch/pytorch#133437); a
// remove_all call that binds to that copy crashed (seen with torch 2.11: every test's temporary
// directory). nftw comes from libc alone.
#pragma once

#include <string>

#include "runtime/base/status.h"

namespace strata {

// OK when `path` no longer exists afterwards (a missing path is OK). Symbolic links are removed,
// never followed. On failure the error names the first entry that could not be removed.
Status RemoveTree(const std::string& path);

}  // namespace strata
