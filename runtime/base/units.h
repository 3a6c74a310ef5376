// Byte sizes and human-readable figures.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "runtime/base/status.h"

namespace strata {

// Parses a byte count: "4096", "5e8", "1.5e9", "64KiB", "8MiB", "2GiB", "1TiB" (binary), "10MB",
// "2GB" (decimal), "512K"/"8M"/"2G" (binary, as dd and fio read them). Case-insensitive suffixes;
// spaces between number and unit allowed. Rejects negatives, fractions of a byte and overflow
// with a message naming the text.
StatusOr<uint64_t> ParseBytes(std::string_view text);

// "1.50 GiB", "512 B": binary units, for people.
std::string FormatBytes(uint64_t bytes);

constexpr uint64_t operator""_KiB(unsigned long long v) { return v << 10; }
constexpr uint64_t operator""_MiB(unsigned long long v) { return v << 20; }
constexpr uint64_t operator""_GiB(unsigned long long v) { return v << 30; }

}  // namespace strata
