// Byte-level text data for strata-train: files read whole, a held-out split, and batches drawn
// deterministically from (seed, step) so that a resumed run sees exactly the batches the
// uninterrupted run would have seen, with no data-loader state to checkpoint.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/base/status.h"

namespace strata::train {

struct TextData {
  std::vector<uint8_t> train;
  std::vector<uint8_t> validation;
  std::vector<std::string> files;    // what was read, in order
  std::vector<std::string> skipped;  // a directory's entries left out (links, folders, *.dat)
};

// Reads `path`: a file, or every regular file of a directory in name order (symbolic links,
// folders and *.dat files skipped, and listed in `skipped` unless a *.dat is fortune's binary
// index of the file beside it or a link leads to a file of the same directory). The last `holdout`
// fraction (at least one window) becomes the validation split. Errors name the path and what to
// pass instead.
StatusOr<TextData> LoadText(const std::string& path, int64_t seq_len, double holdout = 0.05);

// Fills `tokens` with `batch` windows of seq_len + 1 bytes from `data`, starting at offsets drawn
// from a generator seeded by (seed, step, micro, rank): the same arguments give the same batch.
void SampleBatch(const std::vector<uint8_t>& data, int64_t batch, int64_t seq_len, uint64_t seed,
                 int64_t step, int64_t micro, int rank, std::vector<int64_t>* tokens);

// The default corpus: the text files of Debian's fortunes packages.
inline constexpr const char* kDefaultData = "/usr/share/games/fortunes";

}  // namespace strata::train
