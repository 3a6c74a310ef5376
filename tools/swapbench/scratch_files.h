// ScratchFiles: the files and folders a benchmark makes for itself (a swap file, its index, a
// temporary folder), removed when SIGINT or SIGTERM ends the run before the benchmark's own
// cleanup could: an interrupted sweep must not leave gigabytes on the disk it measured. The
// benchmark still removes them itself on every other path; --keep registers nothing.
#pragma once

#include <string>

namespace strata::swapbench {

// Handlers for SIGINT and SIGTERM that remove every registered path (files first, then folders,
// which must then be empty), then end the process as the signal would have (exit status 128 +
// signal number, as the shell reports it). Called once, from main.
void InstallScratchCleanup();

// Registers a file, or a folder (`is_dir`), to be removed on an interrupt. At most 16 paths are
// kept (a benchmark makes a few); later ones are not registered. Safe to call for a path that is
// removed later or never made.
void RemoveOnInterrupt(const std::string& path, bool is_dir = false);

}  // namespace strata::swapbench
