// CRC-32C (Castagnoli), the checksum every swap block and the swap index carry.
//
// Uses the SSE4.2 crc32 instruction when the CPU has it (checked once at run time), a table
// otherwise; both give identical results. Thread-safe, no allocation.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata::nvme {

// Extends `crc` (the value returned by a previous call, or 0 to start) over `data[0, n)`.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);

inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }

// True when the hardware path is in use.
bool Crc32cIsHardware();

// The portable table implementation, exposed so tests can compare both paths.
uint32_t Crc32cExtendPortable(uint32_t crc, const void* data, size_t n);

}  // namespace strata::nvme
