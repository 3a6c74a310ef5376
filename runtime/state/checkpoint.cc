#include "runtime/state/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <stdexcept>

#include "runtime/base/logging.h"
#include "tiers/nvme/crc32c.h"

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

StatusOr<std::string> LoadingStem(const std::string& dir, int rank) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const std::string& stem : {RankFileStem(rank), RankFileStem(0)}) {
    if (fs::exists(fs::path(dir) / (stem + ".json"), ec)) return stem;
    // A folder this process may not search is not a missing checkpoint: say why.
    if (ec) return ErrnoToStatus(ec.value(), StrCat("looking for ", stem, ".json in ", dir));
  }
  return NotFound(StrCat(dir, " holds no ", RankFileStem(rank), ".json",
                         rank != 0 ? StrCat(" and no ", RankFileStem(0), ".json") : std::string(),
                         ": it is not a Strata checkpoint, or an incomplete one"));
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
  if (!m.layout.is_null()) j["layout"] = m.layout;
  if (!m.optimizer.empty()) j["optimizer"] = m.optimizer;
  if (m.gradient_accumulation_steps > 0) j["gradient_accumulation_steps"] = m.gradient_accumulation_steps;
  if (m.optimizer_steps >= 0 && m.optimizer_steps != m.global_step)
    j["optimizer_steps"] = m.optimizer_steps;
  for (const auto& [key, entries] :
       {std::pair{"buffers", &m.buffers}, std::pair{"frozen", &m.frozen}}) {
    if (entries->empty()) continue;
    nlohmann::json list = nlohmann::json::array();
    for (const auto& b : *entries)
      list.push_back({{"name", b.name},
                      {"dtype", b.dtype},
                      {"offset", b.offset},
                      {"bytes", b.bytes},
                      {"crc32c", b.crc32c}});
    j[key] = list;
  }
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
  // Integers are read through Int: nlohmann's get<int>() on 1e300 converts a double that does
  // not fit, which is undefined behaviour, so every integer field must be an integer first.
  auto Int = [&](const nlohmann::json& v, const char* name, int64_t lo, int64_t hi) -> int64_t {
    if (!v.is_number_integer()) throw std::out_of_range(StrCat(name, " is not an integer"));
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi))
      throw std::out_of_range(StrCat(name, " is out of range"));
    int64_t x = v.get<int64_t>();
    if (x < lo || x > hi) throw std::out_of_range(StrCat(name, " is out of range"));
    return x;
  };
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  try {
    if (!j.is_object() || j.value("format", "") != "strata-checkpoint")
      return bad("no \"format\": \"strata-checkpoint\"");
    Manifest m;
    m.version = static_cast<int>(Int(j.at("version"), "version", 0, 1 << 20));
    if (m.version != kFormatVersion)
      return InvalidArgument(StrCat(source, ": checkpoint format version ", m.version,
                                    " is not supported (this build reads ", kFormatVersion, ")"));
    m.rank = static_cast<int>(Int(j.at("rank"), "rank", 0, 1 << 24));
    m.world_size = static_cast<int>(Int(j.at("world_size"), "world_size", 1, 1 << 24));
    m.stage = static_cast<int>(Int(j.at("stage"), "stage", 0, 3));
    m.dtype = j.at("dtype").get<std::string>();
    m.state_dtype = j.at("state_dtype").get<std::string>();
    m.parameters = Int(j.at("parameters"), "parameters", 0, kMax);
    if (!j.at("shard_numel").is_array() || !j.at("blocks").is_array())
      return bad("shard_numel and blocks must be lists");
    for (const auto& v : j.at("shard_numel")) m.shard_numel.push_back(Int(v, "shard_numel", 0, kMax));
    m.global_step = Int(j.at("global_step"), "global_step", 0, kMax);
    m.micro_step = Int(j.at("micro_step"), "micro_step", 0, kMax);
    if (j.contains("gradient_accumulation_steps"))
      m.gradient_accumulation_steps =
          Int(j.at("gradient_accumulation_steps"), "gradient_accumulation_steps", 1, kMax);
    if (j.contains("optimizer_steps"))
      m.optimizer_steps = Int(j.at("optimizer_steps"), "optimizer_steps", 0, kMax);
    m.scaler = j.at("scaler");
    m.extra = j.at("extra");
    if (j.contains("layout")) m.layout = j.at("layout");
    if (j.contains("optimizer")) {
      if (!j.at("optimizer").is_string()) return bad("optimizer must be a string");
      m.optimizer = j.at("optimizer").get<std::string>();
    }
    if (m.rank < 0 || m.world_size < 1 || m.rank >= m.world_size || m.stage < 0 || m.stage > 3 ||
        m.parameters < 0 || m.global_step < 0 || m.micro_step < 0)
      return bad("a counter is out of range");
    for (const auto& b : j.at("blocks")) {
      BlockEntry e;
      e.chunk = Int(b.at("chunk"), "chunk", 0, kMax);
      e.state = b.at("state").get<std::string>();
      e.offset = static_cast<uint64_t>(Int(b.at("offset"), "offset", 0, kMax));
      e.bytes = static_cast<uint64_t>(Int(b.at("bytes"), "bytes", 0, kMax));
      e.crc32c = static_cast<uint32_t>(Int(b.at("crc32c"), "crc32c", 0, 0xffffffffll));
      if (e.chunk < 0 || e.chunk >= static_cast<int64_t>(m.shard_numel.size()))
        return bad(StrCat("block names chunk ", e.chunk, " of ", m.shard_numel.size()));
      m.blocks.push_back(std::move(e));
    }
    for (const auto& [key, entries] :
         {std::pair{"buffers", &m.buffers}, std::pair{"frozen", &m.frozen}}) {
      if (!j.contains(key)) continue;
      if (!j.at(key).is_array()) return bad(StrCat(key, " must be a list"));
      for (const auto& b : j.at(key)) {
        BufferEntry e;
        e.name = b.at("name").get<std::string>();
        e.dtype = b.at("dtype").get<std::string>();
        e.offset = static_cast<uint64_t>(Int(b.at("offset"), "offset", 0, kMax));
        e.bytes = static_cast<uint64_t>(Int(b.at("bytes"), "bytes", 0, kMax));
        e.crc32c = static_cast<uint32_t>(Int(b.at("crc32c"), "crc32c", 0, 0xffffffffll));
        entries->push_back(std::move(e));
      }
    }
    return m;
  } catch (const std::exception& e) {
    return bad(StrCat("a field is missing or has the wrong type (", e.what(), ")"));
  }
}

Status CheckSaveRoot(const std::string& root) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(fs::path(root) / (RankFileStem(0) + ".json"), ec)) return Status::Ok();
  fs::path step = fs::absolute(root, ec).lexically_normal();
  if (!step.has_filename()) step = step.parent_path();  // a trailing '/'
  return InvalidArgument(StrCat(root, " is one checkpoint (it holds ", RankFileStem(0),
                                ".json), not a folder of them: save to the folder that holds it, ",
                                step.parent_path().string()));
}

StatusOr<std::string> ResolveCheckpointDir(const std::string& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    if (ec && ec != std::errc::no_such_file_or_directory)  // EACCES on a folder above it, say
      return ErrnoToStatus(ec.value(), StrCat("checkpoint directory ", path));
    if (fs::exists(path, ec))  // a rank's manifest or state file, say
      return InvalidArgument(
          StrCat(path,
                 " is a file, not a checkpoint directory; pass the directory that "
                 "holds it, ",
                 fs::absolute(path, ec).parent_path().string()));
    return NotFound(StrCat("checkpoint directory ", path,
                           " does not exist; pass the --save directory of an earlier run"));
  }
  if (fs::exists(fs::path(path) / (RankFileStem(0) + ".json"), ec)) return path;
  fs::path latest = fs::path(path) / "latest";
  if (fs::exists(latest, ec)) {
    // It holds one directory name (save_checkpoint writes a tag or step-N): anything longer than
    // a name can be, or with control bytes, is damage, and is not echoed into the message
    // (bytes from 0x80 up stay allowed: a UTF-8 tag).
    if (!fs::is_regular_file(latest, ec) || fs::file_size(latest, ec) > 256)
      return DataLoss(StrCat(latest.string(), " is not a one-line file naming a checkpoint"));
    STRATA_ASSIGN_OR_RETURN(std::string name, ReadFile(latest.string()));
    // Written as one name and a newline; a hand-edited one may have gained blanks, a CR or a
    // trailing '/' (DeepSpeed strips its `latest` too).
    auto blank = [](char ch) { return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\n'; };
    while (!name.empty() && (blank(name.back()) || name.back() == '/')) name.pop_back();
    size_t lead = 0;
    while (lead < name.size() && blank(name[lead])) ++lead;
    name.erase(0, lead);
    if (name.rfind("./", 0) == 0) name.erase(0, 2);
    const bool printable = std::all_of(name.begin(), name.end(), [](char ch) {
      const auto b = static_cast<unsigned char>(ch);
      return b >= 0x20 && b != 0x7f;
    });
    if (!printable)
      return DataLoss(StrCat(latest.string(), " holds ", name.size(),
                             " bytes that are not a directory name; it does not name a checkpoint"));
    if (name.empty() || name.find('/') != std::string::npos)
      return DataLoss(StrCat(latest.string(), " does not name a checkpoint"));
    fs::path dir = fs::path(path) / name;
    if (!fs::is_directory(dir, ec)) {
      // A save that replaced this step on a file system without RENAME_EXCHANGE, cut short
      // between its two renames, left the step `latest` named under its hidden name (Note
      // [saving over a step]).
      const fs::path old = fs::path(path) / ("." + name + ".old");
      if (fs::exists(old / (RankFileStem(0) + ".json"), ec)) {
        STRATA_LOG(WARN) << latest.string() << " names " << name
                         << ", which a save cut short moved aside; loading it from "
                         << old.string();
        return old.string();
      }
      return DataLoss(StrCat(latest.string(), " names ", name, ", which is missing"));
    }
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

Status WriteNewFile(const std::string& path, std::string_view bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("create ", path));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(path.c_str());
      return ErrnoToStatus(err, StrCat("write ", path));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {  // ENOSPC can wait for this on some file systems
    int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    return ErrnoToStatus(err, StrCat("fsync ", path));
  }
  ::close(fd);
  return Status::Ok();
}

Status WriteFileAtomic(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  STRATA_RETURN_IF_ERROR(WriteNewFile(tmp, bytes));
  return PublishFile(tmp, path);
}

Status PublishFile(const std::string& tmp, const std::string& path) {
  const int fd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("open ", tmp));
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

StatusOr<int> OpenCheckpointFile(const std::string& path, uint64_t* size) {
  // Not blocking in open itself: a FIFO with no writer would wait there.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("open ", path));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoToStatus(err, StrCat("stat ", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "a device";
    return DataLoss(StrCat(path, " is ", kind, ", not a regular file; the checkpoint is damaged"));
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  if (size != nullptr) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

StatusOr<std::string> ReadFile(const std::string& path) {
  uint64_t size = 0;
  STRATA_ASSIGN_OR_RETURN(const int fd, OpenCheckpointFile(path, &size));
  std::string out;
  char buf[1 << 16];
  Status s;
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) s = ErrnoToStatus(errno, StrCat("read ", path));
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  STRATA_RETURN_IF_ERROR(s);
  return out;
}

Status ReadChecked(int fd, const std::string& path, uint64_t offset, uint64_t bytes,
                   uint32_t crc32c, const std::string& what, void* out) {
  uint64_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::pread(fd, static_cast<char*>(out) + got, bytes - got,
                              static_cast<off_t>(offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoToStatus(errno, StrCat("read ", path));
    if (n == 0) break;
    got += static_cast<uint64_t>(n);
  }
  if (got != bytes)
    return DataLoss(StrCat(path, " is truncated: ", what, " needs ", bytes, " bytes at offset ",
                           offset, ", got ", got));
  if (nvme::Crc32c(out, bytes) != crc32c)
    return DataLoss(StrCat(path, ": ", what, " fails its crc32c check; the checkpoint is "
                           "corrupted: resume from an earlier one"));
  return Status::Ok();
}

}  // namespace strata::checkpoint
