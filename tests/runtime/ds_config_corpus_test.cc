// Real DeepSpeed configs, kept verbatim under tests/data/ds-configs/ (SOURCES.tsv names each
// file's repository, path and commit). The rule (runtime/base/config.h): what DeepSpeed accepts loads
// here, and every "auto" in it resolves; the few files that do not load are listed below with
// the reason, which the error must name.
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "runtime/base/config.h"
#include "tests/test_util.h"

namespace strata {
namespace {

const std::string kDir = std::string(STRATA_SOURCE_DIR) + "/tests/data/ds-configs";

// file -> a piece of the error it must raise.
const std::map<std::string, std::string> kRejected = {
    // A template with placeholders such as CONFIG_BATCH_SIZE; json.load rejects it in DeepSpeed.
    {"microsoft__Megatron-DeepSpeed__examples__data_efficiency__gpt__pretrain_random_ltd__ds_config_gpt_TEMPLATE.json",
     "not valid JSON"},
    // "stage3_param_persitance_threshold": a misspelling that DeepSpeed's pydantic ZeRO model
    // (extra keys forbidden) rejects today; it dates from before that model.
    {"microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_3_config_release.json",
     "did you mean zero_optimization.stage3_param_persistence_threshold?"},
    {"microsoft__DeepSpeedExamples__Megatron-LM-v1.1.5-ZeRO3__examples__ds_zero_stage_infinity_config.json",
     "did you mean zero_optimization.stage3_param_persistence_threshold?"},
    // Features Strata does not implement: refused by name rather than run as something else.
    {"microsoft__DeepSpeedExamples__bing_bert__deepspeed_bsz64k_lamb_config_seq128.json",
     "optimizer.type=\"Lamb\""},
    {"microsoft__DeepSpeedExamples__bing_bert__deepspeed_bsz4k_onebit_config_seq128.json",
     "optimizer.type=\"OneBitAdam\""},
};

struct Source {
  std::string file, repo, path, commit;
};

std::vector<Source> ReadSources() {
  std::ifstream in(kDir + "/SOURCES.tsv");
  std::vector<Source> out;
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream fields(line);
    Source s;
    std::getline(fields, s.file, '\t');
    std::getline(fields, s.repo, '\t');
    std::getline(fields, s.path, '\t');
    std::getline(fields, s.commit, '\t');
    out.push_back(s);
  }
  return out;
}

TEST(DeepSpeedCorpus, EveryFileHasAProvenance) {
  std::vector<Source> sources = ReadSources();
  std::set<std::string> listed, repos;
  for (const Source& s : sources) {
    listed.insert(s.file);
    repos.insert(s.repo);
    EXPECT_EQ(s.commit.size(), 40u) << s.file;
    EXPECT_FALSE(s.path.empty()) << s.file;
  }
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(kDir)) {
    if (e.path().extension() != ".json") continue;
    ++files;
    EXPECT_TRUE(listed.count(e.path().filename().string())) << e.path() << " has no SOURCES.tsv row";
  }
  EXPECT_EQ(static_cast<size_t>(files), sources.size());
  EXPECT_GE(files, 30);
  EXPECT_GE(repos.size(), 10u);
}

// The world size the file was written for, where its three batch keys say (DeepSpeed checks
// train = micro x accumulation x world); 1 otherwise.
int WorldSizeOf(const Config& c) {
  if (!(c.train_batch_size_given && c.micro_batch_given && c.accumulation_given)) return 1;
  const int64_t per = c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps;
  return per > 0 && c.train_batch_size % per == 0 ? static_cast<int>(c.train_batch_size / per) : 1;
}

TEST(DeepSpeedCorpus, EachFileLoadsOrIsRejectedForItsReason) {
  int accepted = 0, rejected = 0, with_auto = 0;
  for (const Source& s : ReadSources()) {
    SCOPED_TRACE(s.repo + "/" + s.path);
    auto c = Config::FromFile(kDir + "/" + s.file);
    auto it = kRejected.find(s.file);
    if (it != kRejected.end()) {
      ASSERT_FALSE(c.ok()) << "expected a rejection naming: " << it->second;
      EXPECT_NE(c.status().message().find(it->second), std::string::npos) << c.status();
      ++rejected;
      continue;
    }
    ASSERT_TRUE(c.ok()) << c.status();
    ++accepted;
    for (const std::string& w : c->warnings) EXPECT_FALSE(w.empty());
    AutoContext ctx;
    ctx.world_size = WorldSizeOf(*c);
    ctx.hidden_size = 1024;
    ASSERT_OK(c->ResolveAuto(ctx));
    EXPECT_EQ(c->auto_resolved.size(), c->auto_keys.size()) << "every auto key is resolved once";
    if (!c->auto_keys.empty()) ++with_auto;
    EXPECT_EQ(c->train_batch_size,
              c->train_micro_batch_size_per_gpu * c->gradient_accumulation_steps * ctx.world_size);
    // The resolved config is concrete: it prints and reads back to the same values.
    auto again = Config::FromJsonText(c->ToJsonString());
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->auto_keys.empty());
    EXPECT_EQ(again->ToJsonString(), c->ToJsonString());
  }
  EXPECT_EQ(rejected, static_cast<int>(kRejected.size()));
  EXPECT_GE(accepted, 40);
  EXPECT_GE(with_auto, 25);
  std::printf("DeepSpeed corpus: %d accepted (%d with \"auto\"), %d rejected\n", accepted, with_auto, rejected);
}

}  // namespace
}  // namespace strata
