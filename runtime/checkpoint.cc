#include "runtime/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace strata::checkpoint {

namespace fs = std::filesystem;

std::string StepDirName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string RankFileStem(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank-%05d", rank);
  return buf;
}

std::string SerializeManifest(const Manifest& m) {
  nlohmann::json blocks = nlohmann::json::array();
  for (const auto& b : m.blocks)
    blocks.push_back({{"chunk", b.chunk}, {"state", b.state}, {"offset", b.offset},
                      {"bytes", b.bytes}, {"crc32c", b.crc32c}});
  nlohmann::json j = {{"format", "strata-checkpoint"},
                      {"version", m.version},
                      {"rank", m.rank},
                      {"world_size", m.world_size},
                      {"stage", m.stage},
                      {"dtype", m.dtype},
                      {"state_dtype", m.state_dtype},
                      {"parameters", m.parameters},
                      {"shard_numel", m.shard_numel},
                      {"global_step", m.global_step},
                      {"micro_step", m.micro_step},
                      {"scaler", m.scaler},
                      {"extra", m.extra},
                      {"blocks", blocks}};
  return j.dump(1);
}

StatusOr<Manifest> ParseManifest(std::string_view bytes, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    return DataLoss(StrCat(source, ": the manifest is not valid JSON (", e.what(),
                           "); the checkpoint is damaged: resume from an earlier one"));
  }
  auto bad = [&](const std::string& what) {
    return DataLoss(StrCat(source, ": ", what, "; the checkpoint is damaged or not a Strata checkpoint"));
  };
  try {
    if (!j.is_object() || j.value("format", "") != "strata-checkpoint")
      return bad("no \"format\": \"strata-checkpoint\"");
    Manifest m;
    m.version = j.at("version").get<int>();
    if (m.version != kFormatVersion)
      return InvalidArgument(StrCat(source, ": checkpoint format version ", m.version,
                                    " is not supported (this build reads ", kFormatVersion, ")"));
    m.rank = j.at("rank").get<int>();
    m.world_size = j.at("world_size").get<int>();
    m.stage = j.at("stage").get<int>();
    m.dtype = j.at("dtype").get<std::string>();
    m.state_dtype = j.at("state_dtype").get<std::string>();
    m.parameters = j.at("parameters").get<int64_t>();
    m.shard_numel = j.at("shard_numel").get<std::vector<int64_t>>();
    m.global_step = j.at("global_step").get<int64_t>();
    m.micro_step = j.at("micro_step").get<int64_t>();
    m.scaler = j.at("scaler");
    m.extra = j.at("extra");
    if (m.rank < 0 || m.world_size < 1 || m.rank >= m.world_size || m.stage < 0 || m.stage > 3 ||
        m.parameters < 0 || m.global_step < 0 || m.micro_step < 0)
      return bad("a counter is out of range");
    for (const auto& b : j.at("blocks")) {
      BlockEntry e;
      e.chunk = b.at("chunk").get<int64_t>();
      e.state = b.at("state").get<std::string>();
      e.offset = b.at("offset").get<uint64_t>();
      e.bytes = b.at("bytes").get<uint64_t>();
      e.crc32c = b.at("crc32c").get<uint32_t>();
      if (e.chunk < 0 || e.chunk >= static_cast<int64_t>(m.shard_numel.size()))
        return bad(StrCat("block names chunk ", e.chunk, " of ", m.shard_numel.size()));
      m.blocks.push_back(std::move(e));
    }
    return m;
  } catch (const std::exception& e) {
    return bad(StrCat("a field is missing or has the wrong type (", e.what(), ")"));
  }
}

StatusOr<std::string> ResolveCheckpointDir(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec))
    return NotFound(StrCat("checkpoint directory ", path,
                           " does not exist; pass the --save directory of an earlier run"));
  if (fs::exists(fs::path(path) / (RankFileStem(0) + ".json"), ec)) return path;
  fs::path latest = fs::path(path) / "latest";
  if (fs::exists(latest, ec)) {
    STRATA_ASSIGN_OR_RETURN(std::string name, ReadFile(latest.string()));
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (name.empty() || name.find('/') != std::string::npos)
      return DataLoss(StrCat(latest.string(), " does not name a checkpoint"));
    fs::path dir = fs::path(path) / name;
    if (!fs::is_directory(dir, ec))
      return DataLoss(StrCat(latest.string(), " names ", name, ", which is missing"));
    return dir.string();
  }
  return NotFound(StrCat(path, " holds no checkpoint (no 'latest' file and no ",
                         RankFileStem(0), ".json); pass a --save directory or a step-* directory"));
}

Status FsyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("open directory ", dir));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoToStatus(err, StrCat("fsync directory ", dir));
  return Status::Ok();
}

Status WriteFileAtomic(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("create ", tmp));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return ErrnoToStatus(err, StrCat("write ", tmp));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, StrCat("fsync ", tmp));
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, StrCat("rename ", tmp, " to ", path));
  }
  return FsyncDir(fs::path(path).parent_path().empty() ? "." : fs::path(path).parent_path().string());
}

StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoToStatus(errno, StrCat("open ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return ErrnoToStatus(errno, StrCat("read ", path));
  return ss.str();
}

}  // namespace strata::checkpoint
