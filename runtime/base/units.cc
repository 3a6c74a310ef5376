#include "runtime/base/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace strata {

StatusOr<uint64_t> ParseBytes(std::string_view text) {
  std::string s(text);
  auto bad = [&](const char* why) {
    return InvalidArgument(StrCat("'", text, "' is not a byte size (", why,
                                  "); write e.g. 4096, 5e8, 64KiB, 8MiB or 2GiB"));
  };
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  if (i == s.size()) return bad("empty");
  if (s[i] == '-') return bad("negative");
  const char* start = s.c_str() + i;
  char* end = nullptr;
  double value = std::strtod(start, &end);
  if (end == start) return bad("no number");
  std::string unit(end);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.erase(0, 1);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) unit.pop_back();
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib") mult = 1024.0;
  else if (unit == "m" || unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "kb") mult = 1e3;
  else if (unit == "mb") mult = 1e6;
  else if (unit == "gb") mult = 1e9;
  else if (unit == "tb") mult = 1e12;
  else return bad("unknown unit");
  if (!std::isfinite(value) || value < 0) return bad("not a finite non-negative number");
  double bytes = value * mult;
  if (bytes >= 18446744073709551616.0) return bad("too large");
  if (bytes != std::floor(bytes)) return bad("not a whole number of bytes");
  return static_cast<uint64_t>(bytes);
}

std::string FormatBytes(uint64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  else std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[u]);
  return buf;
}

}  // namespace strata
