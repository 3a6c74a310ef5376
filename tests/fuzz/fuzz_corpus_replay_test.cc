// Replays the committed fuzz corpora (tests/fuzz/corpus/<target>/) and a few thousand
// deterministic mutations of them through the untrusted-input readers: the config parser, the
// swap-store index reader, the checkpoint manifest reader and the hardware profile reader. Built with any compiler (CI uses
// g++, which has no libFuzzer): a short, reproducible stand-in for tools/scripts/fuzz.sh.
//
// Every input must either parse and round-trip, or be rejected with a non-OK Status carrying a
// message; an exception, a crash or a sanitizer report fails the test. A failure prints the
// mutation's seed and the input's bytes (hex) so it can be added to the corpus.
//
// STRATA_FUZZ_WRITE_SEEDS=<dir> writes the generated valid seeds (the ones built from the
// serializers) into <dir>/<target>/ — how the binary seeds in the corpus were made.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/fuzz/fuzz_entries.h"
#include "tiers/nvme/crc32c.h"

namespace strata::fuzz {
namespace {

namespace fs = std::filesystem;

using Entry = std::function<Status(std::string_view, std::string*)>;

constexpr int kMutationsPerTarget = 3000;

std::string Hex(std::string_view bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < bytes.size() && i < 512; ++i) {
    out += d[static_cast<uint8_t>(bytes[i]) >> 4];
    out += d[static_cast<uint8_t>(bytes[i]) & 15];
  }
  if (bytes.size() > 512) out += "...";
  return out;
}

std::vector<std::pair<std::string, std::string>> ReadCorpus(const std::string& target) {
  std::vector<std::pair<std::string, std::string>> out;
  fs::path dir = fs::path(STRATA_SOURCE_DIR) / "tests/fuzz/corpus" / target;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    out.emplace_back(e.path().filename().string(), ss.str());
  }
  std::sort(out.begin(), out.end());  // directory order is not deterministic
  return out;
}

// Valid inputs made by the writers themselves, so the mutations start from the real formats.
std::vector<std::string> GeneratedSeeds(const std::string& target) {
  if (target == "swap_index") {
    nvme::SwapIndex idx;
    idx.rank = 1;
    idx.stripe_unit = 1 << 20;
    idx.capacity = 64 << 20;
    idx.files = {"/nvme0/strata/rank1.swap", "/nvme1/strata/rank1.swap"};
    idx.blocks = {{7, 0, 4096, 0x12345678, true}, {9, 8192, 5000, 0, false},
                  {11, 1 << 20, 1 << 20, 0xdeadbeef, true}};
    nvme::SwapIndex empty;
    empty.checksums = ChecksumKind::kNone;
    empty.stripe_unit = 4096;
    empty.capacity = 4096;
    empty.files = {"swap"};
    return {nvme::SerializeSwapIndex(idx), nvme::SerializeSwapIndex(empty)};
  }
  if (target == "manifest") {
    checkpoint::Manifest m;
    m.rank = 1;
    m.world_size = 2;
    m.stage = 3;
    m.dtype = "fp32";
    m.state_dtype = "fp32";
    m.parameters = 1234;
    m.shard_numel = {512, 512, 106};
    m.global_step = 10;
    m.micro_step = 20;
    m.scaler = nlohmann::json::object();
    m.extra = {{"data_position", 42}};
    m.blocks = {{0, "master32", 0, 2048, 1}, {1, "exp_avg", 2048, 2048, 2},
                {2, "exp_avg_sq", 4096, 424, 3}};
    checkpoint::Manifest empty;
    empty.dtype = "bf16";
    empty.state_dtype = "fp32";
    empty.scaler = nlohmann::json::object();
    empty.extra = nlohmann::json::object();
    return {checkpoint::SerializeManifest(m), checkpoint::SerializeManifest(empty)};
  }
  return {};
}

// One deterministic mutation of `in` (`other` for splices), libFuzzer's basic moves.
std::string Mutate(const std::string& in, const std::string& other, std::mt19937_64& rng) {
  std::string s = in;
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : static_cast<size_t>(rng() % n); };
  static const char kInteresting[] = {'\0', '\xff', '\x7f', '\x80', '"', '{', '}', '[', ']',
                                      ',', ':', '-', '9', 'e', '.', '\\', ' ', 'n'};
  const int rounds = 1 + static_cast<int>(rng() % 3);
  for (int r = 0; r < rounds; ++r) {
    switch (rng() % 8) {
      case 0:  // bit flip
        if (!s.empty()) s[pick(s.size())] ^= static_cast<char>(1u << (rng() % 8));
        break;
      case 1:  // interesting byte
        if (!s.empty()) s[pick(s.size())] = kInteresting[pick(sizeof(kInteresting))];
        break;
      case 2:  // truncate
        s.resize(pick(s.size() + 1));
        break;
      case 3: {  // splice: a prefix of this input, a suffix of the other
        size_t a = pick(s.size() + 1), b = pick(other.size() + 1);
        s = s.substr(0, a) + other.substr(b);
        break;
      }
      case 4: {  // insert random bytes
        std::string ins(1 + pick(8), '\0');
        for (char& c : ins) c = static_cast<char>(rng());
        s.insert(pick(s.size() + 1), ins);
        break;
      }
      case 5: {  // erase a range
        if (s.empty()) break;
        size_t at = pick(s.size());
        s.erase(at, 1 + pick(std::min<size_t>(16, s.size() - at)));
        break;
      }
      case 6: {  // duplicate a range
        if (s.empty()) break;
        size_t at = pick(s.size()), n = 1 + pick(std::min<size_t>(32, s.size() - at));
        s.insert(pick(s.size() + 1), s.substr(at, n));
        break;
      }
      case 7: {  // overwrite 4 or 8 bytes with an extreme integer (lengths, counts, offsets)
        static const uint64_t kWords[] = {0, 1, 0x7fffffff, 0xffffffff, 0x80000000,
                                          0xffffffffffffffffull, 0x7fffffffffffffffull, 4096};
        uint64_t w = kWords[pick(8)];
        size_t n = (rng() & 1) ? 4 : 8;
        if (s.size() < n) break;
        size_t at = pick(s.size() - n + 1);
        for (size_t i = 0; i < n; ++i) s[at + i] = static_cast<char>(w >> (8 * i));
        break;
      }
    }
  }
  return s;
}

// The swap index ends in a crc32c of everything before it, so almost every mutation stops at the
// checksum. Re-sealing half of them lets the mutations reach the field checks behind it.
void ResealSwapIndex(std::string* s) {
  if (s->size() < 4) return;
  uint32_t crc = nvme::Crc32c(s->data(), s->size() - 4);
  for (int i = 0; i < 4; ++i) (*s)[s->size() - 4 + i] = static_cast<char>(crc >> (8 * i));
}

struct Tally {
  int accepted = 0;
  int rejected = 0;
};

// Runs one input; a broken property becomes a test failure with the input attached.
void RunOne(const Entry& entry, std::string_view bytes, const std::string& what, Tally* tally) {
  std::string bug;
  Status s = entry(bytes, &bug);
  EXPECT_TRUE(bug.empty()) << what << ": " << bug << "\n  input (" << bytes.size()
                           << " bytes, hex): " << Hex(bytes);
  if (s.ok()) {
    ++tally->accepted;
  } else {
    ++tally->rejected;
    EXPECT_FALSE(s.message().empty()) << what;
  }
}

void ReplayTarget(const std::string& target, const Entry& entry) {
  auto corpus = ReadCorpus(target);
  // The committed corpus must exist and hold both kinds of input, or this test proves nothing.
  ASSERT_GE(corpus.size(), 3u) << "tests/fuzz/corpus/" << target
                               << " is missing or nearly empty: restore it from git";
  Tally committed;
  for (const auto& [name, bytes] : corpus) RunOne(entry, bytes, target + "/" + name, &committed);
  EXPECT_GT(committed.accepted, 0) << target << ": no valid input in the committed corpus";
  EXPECT_GT(committed.rejected, 0) << target << ": no invalid input in the committed corpus";

  std::vector<std::string> seeds;
  for (const auto& c : corpus) seeds.push_back(c.second);
  for (auto& g : GeneratedSeeds(target)) {
    std::string bug;
    EXPECT_TRUE(entry(g, &bug).ok()) << target << ": a seed made by the serializer does not parse";
    seeds.push_back(std::move(g));
  }

  Tally mutated;
  std::mt19937_64 rng(0x5747a7a + target.size());  // fixed: every run sees the same inputs
  for (int i = 0; i < kMutationsPerTarget; ++i) {
    const std::string& a = seeds[i % seeds.size()];
    const std::string& b = seeds[rng() % seeds.size()];
    std::string m = Mutate(a, b, rng);
    if (target == "swap_index" && (i & 1)) ResealSwapIndex(&m);
    RunOne(entry, m, target + " mutation " + std::to_string(i), &mutated);
    if (::testing::Test::HasFailure()) break;  // one reproducer is enough
  }
  std::printf("%s: corpus %zu inputs (%d accepted, %d rejected); %d mutations (%d accepted, "
              "%d rejected)\n",
              target.c_str(), corpus.size(), committed.accepted, committed.rejected,
              kMutationsPerTarget, mutated.accepted, mutated.rejected);
  // Mutations must reach past the first byte check: some of them are still valid inputs (and
  // some not, or the mutator changes nothing that matters).
  EXPECT_GT(mutated.accepted, 0) << target << ": every mutation was rejected; the mutator never "
                                               "gets past the first check";
  EXPECT_GT(mutated.rejected, 0) << target << ": no mutation was rejected";
}

TEST(FuzzCorpusReplay, Config) { ReplayTarget("config", FuzzConfig); }
TEST(FuzzCorpusReplay, SwapIndex) { ReplayTarget("swap_index", FuzzSwapIndex); }
TEST(FuzzCorpusReplay, Manifest) { ReplayTarget("manifest", FuzzManifest); }
TEST(FuzzCorpusReplay, Profile) { ReplayTarget("profile", FuzzProfile); }

TEST(FuzzCorpusReplay, WriteGeneratedSeeds) {
  const char* dir = std::getenv("STRATA_FUZZ_WRITE_SEEDS");
  if (!dir) GTEST_SKIP() << "set STRATA_FUZZ_WRITE_SEEDS=<dir> to write the generated seeds";
  for (const char* target : {"swap_index", "manifest"}) {
    auto seeds = GeneratedSeeds(target);
    fs::create_directories(fs::path(dir) / target);
    for (size_t i = 0; i < seeds.size(); ++i) {
      std::ofstream f(fs::path(dir) / target / ("generated-" + std::to_string(i)), std::ios::binary);
      f << seeds[i];
      ASSERT_TRUE(f.good());
    }
  }
}

}  // namespace
}  // namespace strata::fuzz
