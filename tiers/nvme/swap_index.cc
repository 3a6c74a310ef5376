#include "tiers/nvme/swap_index.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unordered_set>

#include "tiers/nvme/crc32c.h"

namespace strata::nvme {
namespace {

constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'I', 'X'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kMaxFiles = 64;
constexpr uint32_t kMaxPathLength = 4096;
constexpr size_t kBlockRecordBytes = 8 + 8 + 8 + 4 + 4;

template <typename T>
void Put(std::string* out, T v) {
  // Little-endian on every platform Strata builds for (x86-64, aarch64).
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out->append(b, sizeof(T));
}

class Reader {
 public:
  Reader(std::string_view bytes, std::string_view source) : b_(bytes), source_(source) {}
  template <typename T>
  Status Get(T* v, const char* what) {
    if (b_.size() - pos_ < sizeof(T)) return Truncated(what);
    std::memcpy(v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return Status::Ok();
  }
  Status GetBytes(size_t n, std::string* out, const char* what) {
    if (b_.size() - pos_ < n) return Truncated(what);
    out->assign(b_.data() + pos_, n);
    pos_ += n;
    return Status::Ok();
  }
  size_t pos() const { return pos_; }
  size_t left() const { return b_.size() - pos_; }
  Status Bad(const std::string& what) const {
    return DataLoss(StrCat("swap index ", source_, " is corrupted at byte ", pos_, ": ", what,
                           "; delete it to start with an empty swap store (its blocks are lost)"));
  }

 private:
  Status Truncated(const char* what) const {
    return DataLoss(StrCat("swap index ", source_, " is truncated: ", b_.size(),
                           " bytes end inside the ", what, " at byte ", pos_,
                           "; delete it to start with an empty swap store (its blocks are lost)"));
  }
  std::string_view b_;
  std::string_view source_;
  size_t pos_ = 0;
};

}  // namespace

std::string SerializeSwapIndex(const SwapIndex& index) {
  std::string out(kMagic, sizeof kMagic);
  Put<uint32_t>(&out, kVersion);
  Put<uint32_t>(&out, index.rank);
  Put<uint32_t>(&out, index.checksums == ChecksumKind::kCrc32c ? 1 : 0);
  Put<uint64_t>(&out, index.stripe_unit);
  Put<uint64_t>(&out, index.capacity);
  Put<uint32_t>(&out, static_cast<uint32_t>(index.files.size()));
  for (const auto& f : index.files) {
    Put<uint32_t>(&out, static_cast<uint32_t>(f.size()));
    out += f;
  }
  Put<uint64_t>(&out, index.blocks.size());
  for (const auto& b : index.blocks) {
    Put<uint64_t>(&out, b.key);
    Put<uint64_t>(&out, b.offset);
    Put<uint64_t>(&out, b.length);
    Put<uint32_t>(&out, b.crc);
    Put<uint32_t>(&out, b.written ? 1u : 0u);
  }
  Put<uint32_t>(&out, Crc32c(out.data(), out.size()));
  return out;
}

StatusOr<SwapIndex> ParseSwapIndex(std::string_view bytes, std::string_view source) {
  Reader r(bytes, source);
  std::string magic;
  STRATA_RETURN_IF_ERROR(r.GetBytes(sizeof kMagic, &magic, "magic"));
  if (std::memcmp(magic.data(), kMagic, sizeof kMagic) != 0) {
    return DataLoss(StrCat(source, " is not a Strata swap index (bad magic); delete it or point "
                                   "the nvme path elsewhere"));
  }
  uint32_t version = 0;
  STRATA_RETURN_IF_ERROR(r.Get(&version, "version"));
  if (version != kVersion) {
    return DataLoss(StrCat("swap index ", source, " has version ", version, "; this build reads ",
                           kVersion));
  }
  if (bytes.size() < r.pos() + 4) return r.Bad("no room for the trailing checksum");
  uint32_t stored;
  std::memcpy(&stored, bytes.data() + bytes.size() - 4, 4);
  const uint32_t actual = Crc32c(bytes.data(), bytes.size() - 4);
  if (stored != actual) {
    return DataLoss(StrCat("swap index ", source, " failed its crc32c check (stored 0x", std::hex,
                           stored, ", computed 0x", actual, std::dec,
                           "): it is corrupted or was cut short; delete it to start with an empty "
                           "swap store (its blocks are lost)"));
  }
  Reader body(bytes.substr(0, bytes.size() - 4), source);
  std::string skip;
  STRATA_RETURN_IF_ERROR(body.GetBytes(sizeof kMagic + 4, &skip, "header"));

  SwapIndex idx;
  uint32_t kind = 0, nfiles = 0;
  STRATA_RETURN_IF_ERROR(body.Get(&idx.rank, "rank"));
  STRATA_RETURN_IF_ERROR(body.Get(&kind, "checksum kind"));
  if (kind > 1) return body.Bad(StrCat("checksum kind ", kind, " is not 0 or 1"));
  idx.checksums = kind == 1 ? ChecksumKind::kCrc32c : ChecksumKind::kNone;
  STRATA_RETURN_IF_ERROR(body.Get(&idx.stripe_unit, "stripe unit"));
  if (idx.stripe_unit == 0 || idx.stripe_unit % kSwapAlignment != 0)
    return body.Bad(StrCat("stripe unit ", idx.stripe_unit, " is not a positive multiple of 4096"));
  STRATA_RETURN_IF_ERROR(body.Get(&idx.capacity, "capacity"));
  STRATA_RETURN_IF_ERROR(body.Get(&nfiles, "file count"));
  if (nfiles == 0 || nfiles > kMaxFiles) return body.Bad(StrCat("file count ", nfiles, " is not 1..64"));
  if (idx.capacity == 0 || idx.capacity % (idx.stripe_unit * nfiles) != 0)
    return body.Bad(StrCat("capacity ", idx.capacity, " is not a positive multiple of stripe unit ",
                           idx.stripe_unit, " x ", nfiles, " files"));
  for (uint32_t i = 0; i < nfiles; ++i) {
    uint32_t len = 0;
    STRATA_RETURN_IF_ERROR(body.Get(&len, "file path length"));
    if (len == 0 || len > kMaxPathLength) return body.Bad(StrCat("file path length ", len));
    std::string path;
    STRATA_RETURN_IF_ERROR(body.GetBytes(len, &path, "file path"));
    if (path.find('\0') != std::string::npos) return body.Bad("file path contains a NUL byte");
    idx.files.push_back(std::move(path));
  }
  uint64_t nblocks = 0;
  STRATA_RETURN_IF_ERROR(body.Get(&nblocks, "block count"));
  if (nblocks > body.left() / kBlockRecordBytes)
    return body.Bad(StrCat("block count ", nblocks, " needs more bytes than the ", body.left(), " left"));
  idx.blocks.reserve(nblocks);
  std::unordered_set<uint64_t> keys;
  for (uint64_t i = 0; i < nblocks; ++i) {
    SwapBlockRecord b;
    uint32_t flags = 0;
    STRATA_RETURN_IF_ERROR(body.Get(&b.key, "block key"));
    STRATA_RETURN_IF_ERROR(body.Get(&b.offset, "block offset"));
    STRATA_RETURN_IF_ERROR(body.Get(&b.length, "block length"));
    STRATA_RETURN_IF_ERROR(body.Get(&b.crc, "block crc"));
    STRATA_RETURN_IF_ERROR(body.Get(&flags, "block flags"));
    if (flags > 1) return body.Bad(StrCat("block ", b.key, " has unknown flags ", flags));
    b.written = flags == 1;
    if (b.offset % kSwapAlignment != 0 || b.length == 0 || b.length > idx.capacity ||
        b.offset > idx.capacity - b.length)
      return body.Bad(StrCat("block ", b.key, " at offset ", b.offset, " length ", b.length,
                             " does not fit capacity ", idx.capacity));
    if (!keys.insert(b.key).second) return body.Bad(StrCat("block ", b.key, " appears twice"));
    idx.blocks.push_back(b);
  }
  if (body.left() != 0) return body.Bad(StrCat(body.left(), " unexpected bytes after the blocks"));
  std::vector<const SwapBlockRecord*> by_offset;
  for (const auto& b : idx.blocks) by_offset.push_back(&b);
  std::sort(by_offset.begin(), by_offset.end(),
            [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const auto* prev = by_offset[i - 1];
    uint64_t prev_end = (prev->offset + prev->length + kSwapAlignment - 1) / kSwapAlignment * kSwapAlignment;
    if (prev_end > by_offset[i]->offset)
      return DataLoss(StrCat("swap index ", source, " is inconsistent: blocks ", prev->key, " and ",
                             by_offset[i]->key, " overlap; delete it to start with an empty swap "
                             "store (its blocks are lost)"));
  }
  return idx;
}

Status WriteFileAtomically(const std::string& path, std::string_view bytes) {
  const std::string tmp = path + ".tmp";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("creating ", tmp));
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t w = write(fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      close(fd);
      unlink(tmp.c_str());
      return ErrnoToStatus(err, StrCat("writing ", tmp));
    }
    if (w == 0) {
      close(fd);
      unlink(tmp.c_str());
      return IoError(StrCat("writing ", tmp, ": no progress at byte ", done));
    }
    done += static_cast<size_t>(w);
  }
  if (fsync(fd) != 0) {
    int err = errno;
    close(fd);
    unlink(tmp.c_str());
    return ErrnoToStatus(err, StrCat("fsync ", tmp));
  }
  if (close(fd) != 0) {
    int err = errno;
    unlink(tmp.c_str());
    return ErrnoToStatus(err, StrCat("closing ", tmp));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    unlink(tmp.c_str());
    return ErrnoToStatus(err, StrCat("renaming ", tmp, " to ", path));
  }
  std::string dir = path.substr(0, path.find_last_of('/'));
  if (dir.empty()) dir = ".";
  int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return ErrnoToStatus(errno, StrCat("opening directory ", dir, " to fsync it"));
  // Without this the rename itself may not survive a crash.
  int rc = fsync(dfd);
  int err = errno;
  close(dfd);
  if (rc != 0 && err != EINVAL) return ErrnoToStatus(err, StrCat("fsync directory ", dir));
  return Status::Ok();
}

StatusOr<std::string> ReadWholeFile(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, StrCat("opening ", path));
  std::string out;
  char buf[65536];
  while (true) {
    ssize_t r = read(fd, buf, sizeof buf);
    if (r < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      close(fd);
      return ErrnoToStatus(err, StrCat("reading ", path));
    }
    if (r == 0) break;
    out.append(buf, static_cast<size_t>(r));
  }
  close(fd);
  return out;
}

}  // namespace strata::nvme
