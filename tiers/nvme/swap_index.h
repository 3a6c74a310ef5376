// The swap store's persistent index: which block lives where, with which checksum.
//
// On-disk format (version 1, little-endian), written atomically by WriteFileAtomically:
//   "STRATAIX" | u32 version | u32 rank | u32 checksum kind (0 none, 1 crc32c)
//   | u64 stripe_unit | u64 capacity | u32 file count | per file: u32 length, path bytes
//   | u64 block count | per block: u64 key, u64 offset, u64 length, u32 crc, u32 flags
//   | u32 crc32c of every preceding byte
// `offset` is in the store's striped logical space; flags bit 0 = the block's contents were
// completely written (its crc is meaningful).
//
// ParseSwapIndex takes untrusted bytes (a fuzz target points at it): it never reads out of
// bounds, never allocates more than the input could describe, and returns DATA_LOSS naming the
// source and the byte offset for truncated, corrupted or inconsistent input.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/base/config.h"
#include "runtime/base/status.h"

namespace strata::nvme {

constexpr uint64_t kSwapAlignment = 4096;  // O_DIRECT granularity of every offset and length

struct SwapBlockRecord {
  uint64_t key = 0;
  uint64_t offset = 0;  // logical, multiple of kSwapAlignment
  uint64_t length = 0;  // bytes as allocated by the user (not rounded)
  uint32_t crc = 0;
  bool written = false;
};

struct SwapIndex {
  uint32_t rank = 0;
  ChecksumKind checksums = ChecksumKind::kCrc32c;
  uint64_t stripe_unit = 0;
  uint64_t capacity = 0;           // logical bytes across all files
  std::vector<std::string> files;  // swap file paths, in stripe order
  std::vector<SwapBlockRecord> blocks;
};

std::string SerializeSwapIndex(const SwapIndex& index);
// `source` names the input in messages (a path).
StatusOr<SwapIndex> ParseSwapIndex(std::string_view bytes, std::string_view source);

// Writes `bytes` to `path` so that a reader sees either the old file or the complete new one:
// write to path.tmp, fsync, rename over path, fsync the directory.
Status WriteFileAtomically(const std::string& path, std::string_view bytes);
// Reads a whole file; NOT_FOUND when it does not exist.
StatusOr<std::string> ReadWholeFile(const std::string& path);

}  // namespace strata::nvme
