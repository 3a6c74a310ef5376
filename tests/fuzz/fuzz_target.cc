// One libFuzzer target per entry of fuzz_entries.h (which says what is checked), built from this
// file with STRATA_FUZZ_ENTRY naming the entry (tests/fuzz/CMakeLists.txt: config_fuzz,
// manifest_fuzz, profile_fuzz). Built with -DSTRATA_FUZZ=ON and clang; tools/scripts/fuzz.sh runs
// each on tests/fuzz/corpus/<target>/. A broken property aborts, so the fuzzer keeps the input.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/fuzz/fuzz_entries.h"

#ifndef STRATA_FUZZ_ENTRY
#error "define STRATA_FUZZ_ENTRY as one of fuzz_entries.h's entries, e.g. FuzzConfig"
#endif
#define STRATA_FUZZ_NAME_OF(entry) #entry
#define STRATA_FUZZ_NAME(entry) STRATA_FUZZ_NAME_OF(entry)

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bug;
  (void)strata::fuzz::STRATA_FUZZ_ENTRY(std::string_view(reinterpret_cast<const char*>(data), size), &bug);
  if (!bug.empty()) {
    std::fprintf(stderr, "%s: %s\n", STRATA_FUZZ_NAME(STRATA_FUZZ_ENTRY), bug.c_str());
    std::abort();
  }
  return 0;
}
