// libFuzzer target for the hardware profile reader (tests/fuzz/fuzz_entries.h says what is checked).
// Built with -DSTRATA_FUZZ=ON and clang; tools/scripts/fuzz.sh runs it on tests/fuzz/corpus/profile.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/fuzz/fuzz_entries.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bug;
  (void)strata::fuzz::FuzzProfile(std::string_view(reinterpret_cast<const char*>(data), size), &bug);
  if (!bug.empty()) {
    std::fprintf(stderr, "profile_fuzz: %s\n", bug.c_str());
    std::abort();
  }
  return 0;
}
