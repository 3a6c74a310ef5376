// libFuzzer target for the swap index reader: any bytes must give a SwapIndex or a Status,
// never a crash, an out-of-bounds read or an unbounded allocation. Built with -DSTRATA_FUZZ=ON
// (clang). A parsed index must serialize back to bytes that parse to the same blocks.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "tiers/nvme/swap_index.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto idx = strata::nvme::ParseSwapIndex(bytes, "<fuzz>");
  if (!idx.ok()) return 0;
  auto again = strata::nvme::ParseSwapIndex(strata::nvme::SerializeSwapIndex(*idx), "<fuzz>");
  if (!again.ok() || again->blocks.size() != idx->blocks.size()) std::abort();
  return 0;
}
