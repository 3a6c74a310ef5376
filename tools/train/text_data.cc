#include "tools/train/text_data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <new>
#include <random>

#include "runtime/base/host_info.h"
#include "runtime/base/units.h"

namespace strata::train {

namespace fs = std::filesystem;

StatusOr<TextData> LoadText(const std::string& path, int64_t seq_len, double holdout) {
  std::error_code ec;
  fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st))
    return NotFound(StrCat("--data ", path, " does not exist; pass a text file or a directory of "
                           "text files (the default corpus comes with Debian's fortunes package)"));
  std::vector<fs::path> files;
  TextData data;
  if (fs::is_directory(st)) {
    for (const auto& e : fs::directory_iterator(path, ec)) {
      // fortune's index of a file beside it: binary, left out without a word.
      fs::path base = e.path();
      if (e.path().extension() == ".dat" && fs::is_regular_file(base.replace_extension(), ec))
        continue;
      // A link to a file of this directory (fortune's *.u8 names) would read that file twice.
      if (e.is_symlink() && fs::equivalent(fs::canonical(e.path(), ec).parent_path(), path, ec))
        continue;
      if (e.is_symlink() || !e.is_regular_file() || e.path().extension() == ".dat") {
        data.skipped.push_back(e.path().filename().string());
        continue;
      }
      files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    std::sort(data.skipped.begin(), data.skipped.end());
  } else {
    files.push_back(path);
  }
  std::vector<uint8_t> all;
  // The corpus is held in memory, and copied once into its two splits: an eighth of what the
  // host has free leaves room for both and for a growing buffer's doubling (a device such as
  // /dev/zero has no size to check first, and never ends).
  const uint64_t available = ReadHostMemory().available_bytes;
  const uint64_t limit = available > 0 ? available / 8 : uint64_t{1} << 40;
  const auto too_large = [&] {
    return ResourceExhausted(StrCat("--data ", path, " holds more than ", FormatBytes(limit),
                                    ", an eighth of the host's available memory; strata-train holds "
                                    "its corpus whole, so pass a part of it"));
  };
  uint64_t sized = 0;
  for (const auto& f : files)
    if (fs::is_regular_file(f, ec)) sized += fs::file_size(f, ec);
  if (sized > limit) return too_large();
  try {
    all.reserve(sized);
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      if (!in) return ErrnoToStatus(errno, StrCat("cannot read --data file ", f.string()));
      char buf[1 << 16];
      while (in.read(buf, sizeof buf) || in.gcount() > 0) {
        all.insert(all.end(), buf, buf + in.gcount());
        if (all.size() > limit) return too_large();
      }
      if (in.bad()) return ErrnoToStatus(errno, StrCat("cannot read --data file ", f.string()));
      data.files.push_back(f.string());
    }
  } catch (const std::bad_alloc&) {
    return too_large();
  }
  const int64_t window = seq_len + 1;
  if (static_cast<int64_t>(all.size()) < 4 * window)
    return InvalidArgument(StrCat("--data ", path, " holds ", all.size(), " bytes, fewer than the ",
                                  4 * window, " needed for seq_len=", seq_len,
                                  " with a held-out split; give more text or a shorter seq_len"));
  int64_t held = std::max<int64_t>(window, static_cast<int64_t>(all.size() * holdout));
  data.train.assign(all.begin(), all.end() - held);
  data.validation.assign(all.end() - held, all.end());
  return data;
}

void SampleBatch(const std::vector<uint8_t>& data, int64_t batch, int64_t seq_len, uint64_t seed,
                 int64_t step, int64_t micro, int rank, std::vector<int64_t>* tokens) {
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                    static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32),
                    static_cast<uint32_t>(micro), static_cast<uint32_t>(rank)};
  std::mt19937_64 rng(seq);
  const int64_t window = seq_len + 1;
  std::uniform_int_distribution<int64_t> start(0, static_cast<int64_t>(data.size()) - window);
  tokens->resize(batch * window);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t s = start(rng);
    for (int64_t t = 0; t < window; ++t) (*tokens)[b * window + t] = data[s + t];
  }
}

}  // namespace strata::train
