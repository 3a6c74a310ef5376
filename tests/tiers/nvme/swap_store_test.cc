// SwapStore: round trips through striped preallocated files, checksums that catch corruption,
// an index that survives a restart and rejects damage, and clear errors for bad directories,
// full file systems and injected I/O faults.
#include "tiers/nvme/swap_store.h"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <set>
#include <filesystem>
#include <random>
#include <thread>
#include <string>
#include <vector>

#include "runtime/base/host_info.h"
#include "tests/test_util.h"
#include "tiers/nvme/crc32c.h"
#include "tiers/nvme/swap_index.h"

namespace strata::nvme {
namespace {

using strata::testing::TempDir;
using strata::testing::TmpfsMount;

std::vector<char> Pattern(size_t n, uint32_t seed) {
  std::vector<char> v(n);
  std::mt19937 rng(seed);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

struct Aligned {
  explicit Aligned(size_t n) {
    void* q = nullptr;
    if (posix_memalign(&q, 4096, n ? n : 1) != 0) std::abort();
    p = static_cast<char*>(q);
  }
  ~Aligned() { std::free(p); }
  char* p;
};

void FlipByte(const std::string& path, uint64_t offset) {
  int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  char c;
  ASSERT_EQ(pread(fd, &c, 1, static_cast<off_t>(offset)), 1);
  c ^= 0x40;
  ASSERT_EQ(pwrite(fd, &c, 1, static_cast<off_t>(offset)), 1);
  fsync(fd);
  close(fd);
}

SwapStoreOptions Opts(std::vector<std::string> paths, bool fallback, uint64_t capacity = 16 << 20) {
  SwapStoreOptions o;
  o.paths = std::move(paths);
  o.capacity = capacity;
  o.aio.block_size = 64 * 1024;
  o.aio.queue_depth = 8;
  o.force_fallback = fallback;
  return o;
}

class SwapStoreTest : public ::testing::TestWithParam<bool> {
 protected:
  bool fallback() const { return GetParam(); }
  TempDir dir_;
};

TEST_P(SwapStoreTest, OddSizesAlignedAndUnalignedBuffersRoundTrip) {
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({dir_.path()}, fallback())));
  EXPECT_EQ(store->stats().engine, fallback() ? "fallback" : "io_uring");
  const std::vector<uint64_t> sizes = {1, 100, 4095, 4096, 4097, 65536 + 13, 300000};
  for (size_t i = 0; i < sizes.size(); ++i) {
    const uint64_t n = sizes[i];
    for (int misalign : {0, 1, 7}) {
      const uint64_t key = i * 10 + static_cast<uint64_t>(misalign);
      ASSERT_OK(store->Allocate(key, n));
      auto data = Pattern(n, static_cast<uint32_t>(key));
      Aligned src(n + 8), dst(n + 8);
      std::memcpy(src.p + misalign, data.data(), n);
      // Bytes just past the block must not be touched by a read.
      std::memset(dst.p, 0xEE, n + 8);
      ASSERT_OK(store->Write(key, src.p + misalign));
      ASSERT_OK(store->Read(key, dst.p + misalign));
      ASSERT_EQ(std::memcmp(dst.p + misalign, data.data(), n), 0) << "size " << n << " misalign " << misalign;
      for (uint64_t k = n + misalign; k < n + 8; ++k) ASSERT_EQ(dst.p[k], static_cast<char>(0xEE));
    }
  }
  ASSERT_OK(store->Close());
}

TEST_P(SwapStoreTest, StripesOverSeveralDirectories) {
  TempDir b, c;
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({dir_.path(), b.path(), c.path()}, fallback())));
  ASSERT_OK(store->Allocate(1, 5 * 65536 + 100));
  ASSERT_OK_AND_ASSIGN(auto extents, store->Locate(1));
  std::set<std::string> files;
  for (const auto& e : extents) files.insert(e.path);
  EXPECT_EQ(files.size(), 3u);
  auto data = Pattern(5 * 65536 + 100, 42);
  ASSERT_OK(store->Write(1, data.data()));
  std::vector<char> back(data.size());
  ASSERT_OK(store->Read(1, back.data()));
  EXPECT_EQ(back, data);
}

TEST_P(SwapStoreTest, ManyConcurrentBlocks) {
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({dir_.path()}, fallback())));
  constexpr int kBlocks = 48;
  std::vector<std::vector<char>> data, back(kBlocks);
  for (int i = 0; i < kBlocks; ++i) {
    data.push_back(Pattern(20000 + i * 777, i));
    back[i].resize(data[i].size());
    ASSERT_OK(store->Allocate(i, data[i].size()));
  }
  std::atomic<int> ok{0};
  for (int i = 0; i < kBlocks; ++i)
    store->WriteAsync(i, data[i].data(), [&](Status s) { if (s.ok()) ok++; });
  while (ok.load() < kBlocks) std::this_thread::yield();
  std::vector<std::promise<Status>> ps(kBlocks);
  for (int i = 0; i < kBlocks; ++i)
    store->ReadAsync(i, back[i].data(), [&ps, i](Status s) { ps[i].set_value(std::move(s)); });
  for (int i = 0; i < kBlocks; ++i) {
    ASSERT_OK(ps[i].get_future().get());
    ASSERT_EQ(back[i], data[i]) << i;
  }
}

TEST_P(SwapStoreTest, CorruptedBlockIsDataLossNamingBlockAndFile) {
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({dir_.path()}, fallback())));
  ASSERT_OK(store->Allocate(7, 10000));
  ASSERT_OK(store->Allocate(8, 10000));
  auto data = Pattern(10000, 7);
  ASSERT_OK(store->Write(7, data.data()));
  ASSERT_OK(store->Write(8, data.data()));
  ASSERT_OK_AND_ASSIGN(auto ext, store->Locate(7));
  FlipByte(ext[0].path, ext[0].file_offset + 5000);
  std::vector<char> back(10000);
  Status s = store->Read(7, back.data());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("swap block 7"), std::string::npos) << s;
  EXPECT_NE(s.message().find(ext[0].path), std::string::npos) << s;
  EXPECT_EQ(store->stats().checksum_failures, 1u);
  ASSERT_OK(store->Read(8, back.data()));  // the neighbour is intact
}

TEST_P(SwapStoreTest, ChecksumsCanBeSwitchedOff) {
  auto o = Opts({dir_.path()}, fallback());
  o.checksums = ChecksumKind::kNone;
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
  ASSERT_OK(store->Allocate(1, 8192));
  auto data = Pattern(8192, 1);
  ASSERT_OK(store->Write(1, data.data()));
  ASSERT_OK_AND_ASSIGN(auto ext, store->Locate(1));
  FlipByte(ext[0].path, ext[0].file_offset + 10);
  std::vector<char> back(8192);
  ASSERT_OK(store->Read(1, back.data()));
  EXPECT_NE(back, data);  // not verified: the flipped byte comes back
}

TEST_P(SwapStoreTest, IndexSurvivesARestartInAnotherProcess) {
  auto data = Pattern(123457, 99);
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto store = SwapStore::Open(Opts({dir_.path()}, fallback()));
    if (!store.ok()) _exit(10);
    if (!(*store)->Allocate(5, data.size()).ok()) _exit(11);
    if (!(*store)->Allocate(6, 4096).ok()) _exit(12);
    if (!(*store)->Write(5, data.data()).ok()) _exit(13);
    if (!(*store)->Allocate(9, 100).ok()) _exit(14);  // allocated, never written
    if (!(*store)->Close().ok()) _exit(15);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 0);

  auto o = Opts({dir_.path()}, fallback());
  o.mode = SwapOpenMode::kOpenExisting;
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
  EXPECT_EQ(store->Keys(), (std::vector<uint64_t>{5, 6, 9}));
  std::vector<char> back(data.size());
  ASSERT_OK(store->Read(5, back.data()));
  EXPECT_EQ(back, data);
  EXPECT_EQ(store->Read(9, back.data()).code(), StatusCode::kFailedPrecondition);
  // Space held by reopened blocks is not handed out again.
  ASSERT_OK(store->Allocate(10, 50000));
  ASSERT_OK_AND_ASSIGN(auto r5, store->Lookup(5));
  ASSERT_OK_AND_ASSIGN(auto r10, store->Lookup(10));
  EXPECT_TRUE(r10.offset >= r5.offset + data.size() || r10.offset + 50000 <= r5.offset);
}

TEST_P(SwapStoreTest, AScratchStoreLeavesNothingBehind) {
  TempDir second;
  auto o = Opts({dir_.path(), second.path()}, fallback());
  o.remove_on_close = true;
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
  auto data = Pattern(300000, 7);
  ASSERT_OK(store->Allocate(1, data.size()));
  ASSERT_OK(store->Write(1, data.data()));
  auto names = [](const std::string& dir) {
    std::vector<std::string> v;
    for (const auto& e : std::filesystem::directory_iterator(dir)) v.push_back(e.path().filename());
    return v;
  };
  EXPECT_EQ(names(dir_.path()), std::vector<std::string>{"strata-rank0.swap"});
  EXPECT_EQ(names(second.path()), std::vector<std::string>{"strata-rank0.swap"});
  // A second store on the same files is refused, and its failed open removes nothing of the
  // first's.
  EXPECT_EQ(SwapStore::Open(o).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(names(dir_.path()), std::vector<std::string>{"strata-rank0.swap"});
  EXPECT_EQ(names(second.path()), std::vector<std::string>{"strata-rank0.swap"});
  std::vector<char> back(data.size());
  ASSERT_OK(store->Read(1, back.data()));
  EXPECT_EQ(back, data);
  ASSERT_OK(store->Close());
  EXPECT_TRUE(names(dir_.path()).empty()) << names(dir_.path())[0];
  EXPECT_TRUE(names(second.path()).empty());
  ASSERT_OK(store->Close());  // idempotent: nothing left to remove is no error
  // Without the option the same store keeps its files and writes its index for a reopen.
  o.remove_on_close = false;
  ASSERT_OK_AND_ASSIGN(auto kept, SwapStore::Open(o));
  ASSERT_OK(kept->Close());
  EXPECT_EQ(names(dir_.path()).size(), 2u);
}

TEST_P(SwapStoreTest, CorruptedOrTruncatedIndexIsRejected) {
  {
    ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({dir_.path()}, fallback())));
    ASSERT_OK(store->Allocate(1, 5000));
    auto d = Pattern(5000, 1);
    ASSERT_OK(store->Write(1, d.data()));
  }
  const std::string idx = dir_.path() + "/strata-rank0.index";
  ASSERT_OK_AND_ASSIGN(std::string good, ReadWholeFile(idx));
  auto o = Opts({dir_.path()}, fallback());
  o.mode = SwapOpenMode::kOpenExisting;
  std::string bad = good;
  bad[bad.size() / 2] ^= 1;
  ASSERT_OK(WriteFileAtomically(idx, bad));
  auto s = SwapStore::Open(o);
  EXPECT_EQ(s.status().code(), StatusCode::kDataLoss) << s.status();
  EXPECT_NE(s.status().message().find(idx), std::string::npos) << s.status();
  ASSERT_OK(WriteFileAtomically(idx, good.substr(0, good.size() - 9)));
  s = SwapStore::Open(o);
  EXPECT_EQ(s.status().code(), StatusCode::kDataLoss) << s.status();
  // The failed opens left the damaged index alone; the good one still opens.
  ASSERT_OK(WriteFileAtomically(idx, good));
  ASSERT_OK(SwapStore::Open(o).status());
}

TEST_P(SwapStoreTest, ShortSwapFileIsReported) {
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({dir_.path()}, fallback(), 1 << 20)));
  ASSERT_OK(store->Allocate(1, 8192));
  ASSERT_OK(store->Allocate(2, 8192));
  auto d = Pattern(8192, 2);
  ASSERT_OK(store->Write(2, d.data()));
  ASSERT_OK_AND_ASSIGN(auto ext, store->Locate(2));
  ASSERT_EQ(truncate(ext[0].path.c_str(), static_cast<off_t>(ext[0].file_offset)), 0);
  std::vector<char> back(8192);
  Status s = store->Read(2, back.data());
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_NE(s.message().find(ext[0].path), std::string::npos) << s;
  EXPECT_NE(s.message().find("swap block 2"), std::string::npos) << s;
  ASSERT_OK(store->Close());
  auto o = Opts({dir_.path()}, fallback(), 1 << 20);
  o.mode = SwapOpenMode::kOpenExisting;
  auto reopened = SwapStore::Open(o);
  EXPECT_EQ(reopened.status().code(), StatusCode::kDataLoss) << reopened.status();
  EXPECT_NE(reopened.status().message().find("truncated"), std::string::npos) << reopened.status();
}

TEST_P(SwapStoreTest, InjectedFaultsFailTheBlockWithoutClaimingIt) {
  std::atomic<int64_t> fail_with{0};
  auto o = Opts({dir_.path()}, fallback());
  o.fault_hook = [&](const IoAttempt&, int64_t res) -> int64_t {
    int64_t f = fail_with.load();
    return f ? f : res;
  };
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
  ASSERT_OK(store->Allocate(1, 70000));
  auto d = Pattern(70000, 3);
  ASSERT_OK(store->Write(1, d.data()));
  fail_with = -EIO;
  Status w = store->Write(1, d.data());
  EXPECT_EQ(w.code(), StatusCode::kIoError) << w;
  EXPECT_NE(w.message().find("swap block 1"), std::string::npos) << w;
  EXPECT_NE(w.message().find("strata-rank0.swap"), std::string::npos) << w;
  fail_with = 0;
  std::vector<char> back(70000);
  // The failed write leaves the block unreadable rather than half old, half new.
  EXPECT_EQ(store->Read(1, back.data()).code(), StatusCode::kFailedPrecondition);
  fail_with = -ENOSPC;
  w = store->Write(1, d.data());
  EXPECT_EQ(w.code(), StatusCode::kResourceExhausted) << w;
  fail_with = 0;
  ASSERT_OK(store->Write(1, d.data()));
  fail_with = -EIO;
  EXPECT_EQ(store->Read(1, back.data()).code(), StatusCode::kIoError);
  fail_with = 0;
  ASSERT_OK(store->Read(1, back.data()));
  EXPECT_EQ(back, d);
}

// io_uring_enter failing for good on the write ring: the write fails within the ring's bound
// and the block is not claimed (FAILED_PRECONDITION on read, as after any failed write).
TEST_P(SwapStoreTest, ABrokenRingFailsTheWriteWithoutClaimingTheBlock) {
  if (fallback()) GTEST_SKIP() << "the fallback makes no io_uring_enter call";
  std::atomic<bool> broken{false};
  auto o = Opts({dir_.path()}, fallback());
  o.submit_fault_hook = [&](const std::string& ring) {
    return broken && ring.rfind("write", 0) == 0 ? -EFAULT : 0;
  };
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
  ASSERT_OK(store->Allocate(1, 70000));
  auto d = Pattern(70000, 4);
  ASSERT_OK(store->Write(1, d.data()));
  broken = true;
  Status w = store->Write(1, d.data());
  EXPECT_EQ(w.code(), StatusCode::kIoError) << w;
  EXPECT_NE(w.message().find("io_uring_enter"), std::string::npos) << w;
  std::vector<char> back(70000);
  EXPECT_EQ(store->Read(1, back.data()).code(), StatusCode::kFailedPrecondition);
}

TEST_P(SwapStoreTest, AllocatorReusesFreedSpaceAndReportsExhaustion) {
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({dir_.path()}, fallback(), 1 << 20)));
  EXPECT_EQ(store->capacity(), 1u << 20);
  for (uint64_t k = 0; k < 4; ++k) ASSERT_OK(store->Allocate(k, 256 << 10));
  Status full = store->Allocate(9, 1);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full;
  EXPECT_EQ(store->Allocate(0, 10).code(), StatusCode::kAlreadyExists);
  ASSERT_OK(store->Free(1));
  ASSERT_OK(store->Free(2));
  ASSERT_OK(store->Allocate(9, 512 << 10));  // needs the two freed neighbours coalesced
  EXPECT_EQ(store->Free(42).code(), StatusCode::kNotFound);
}

INSTANTIATE_TEST_SUITE_P(Backends, SwapStoreTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Fallback" : "IoUring"; });

void ExpectRoundTrip(SwapStore& store) {
  ASSERT_OK(store.Allocate(1, 5555));
  auto d = Pattern(5555, 5);
  ASSERT_OK(store.Write(1, d.data()));
  std::vector<char> back(5555);
  ASSERT_OK(store.Read(1, back.data()));
  EXPECT_EQ(back, d);
}

TEST(SwapStoreEnvTest, TmpfsIsDetected) {
  char tmpl[] = "/dev/shm/strata_nvme_XXXXXX";
  if (mkdtemp(tmpl) == nullptr) GTEST_SKIP() << "/dev/shm not available";
  const std::string dir = tmpl;
  // tmpfs refuses O_DIRECT before Linux 6.6 and accepts it since; the store must follow the
  // kernel either way.
  const std::string probe = dir + "/probe";
  int fd = open(probe.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  const bool tmpfs_direct = fd >= 0;
  if (fd >= 0) close(fd);
  unlink(probe.c_str());
  {
    ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({dir}, false, 1 << 20)));
    auto st = store->stats();
    EXPECT_EQ(st.direct_io, tmpfs_direct);
    EXPECT_EQ(st.engine, tmpfs_direct ? "io_uring" : "fallback");
    if (!tmpfs_direct) {
      EXPECT_NE(st.fallback_reason.find("O_DIRECT"), std::string::npos);
    }
    ExpectRoundTrip(*store);
  }
  std::string cmd = "rm -rf " + dir;
  ASSERT_EQ(std::system(cmd.c_str()), 0);
}

TEST(SwapStoreEnvTest, DirectoryRefusingODirectUsesTheFallback) {
  TempDir t;
  auto o = Opts({t.path()}, false, 1 << 20);
  std::atomic<int> refused{0};
  o.open_file = [&](const std::string& path, int flags, mode_t mode) {
    if (flags & O_DIRECT) {
      refused++;
      errno = EINVAL;  // what open(2) says on a file system without O_DIRECT
      return -1;
    }
    return open(path.c_str(), flags, mode);
  };
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
  EXPECT_EQ(refused.load(), 1);
  auto st = store->stats();
  EXPECT_EQ(st.engine, "fallback");
  EXPECT_FALSE(st.direct_io);
  EXPECT_NE(st.fallback_reason.find("O_DIRECT"), std::string::npos) << st.fallback_reason;
  ExpectRoundTrip(*store);
}

// Note [removed while locking]: the file this store opened loses its name (a scratch store
// closing it) before this store locks it. The store must not run on the nameless file: it opens
// the path again, and its blocks are in the file that bears the name.
TEST(SwapStoreEnvTest, AFileRemovedWhileOpeningIsOpenedAgainByName) {
  TempDir t;
  auto o = Opts({t.path()}, false, 1 << 20);
  int opens = 0;
  o.open_file = [&](const std::string& path, int flags, mode_t mode) {
    const int fd = open(path.c_str(), flags, mode);
    if (fd >= 0 && ++opens == 1) unlink(path.c_str());  // the first one loses its name at once
    return fd;
  };
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
  EXPECT_EQ(opens, 2);
  auto data = Pattern(200000, 3);
  ASSERT_OK(store->Allocate(1, data.size()));
  ASSERT_OK(store->Write(1, data.data()));
  // The named file holds the block: read it back through the path, not through the store.
  const std::string path = t.path() + "/strata-rank0.swap";
  const int fd = open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0) << path;
  std::vector<char> back(data.size());
  EXPECT_EQ(pread(fd, back.data(), back.size(), 0), static_cast<ssize_t>(back.size()));
  close(fd);
  EXPECT_EQ(back, data);
  // A path that keeps losing its file is given up on, naming it.
  TempDir u;
  auto always = Opts({u.path()}, false, 1 << 20);
  always.open_file = [](const std::string& path, int flags, mode_t mode) {
    const int fd = open(path.c_str(), flags, mode);
    if (fd >= 0) unlink(path.c_str());
    return fd;
  };
  auto refused = SwapStore::Open(always);
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable) << refused.status();
  EXPECT_NE(refused.status().message().find("strata-rank0.swap"), std::string::npos) << refused.status();
}

TEST(SwapStoreEnvTest, MissingDirectoryNamesThePath) {
  TempDir t;
  const std::string missing = t.path() + "/no/such/dir";
  auto s = SwapStore::Open(Opts({missing}, false));
  EXPECT_EQ(s.status().code(), StatusCode::kNotFound) << s.status();
  EXPECT_NE(s.status().message().find(missing), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("mkdir -p"), std::string::npos) << s.status();
  auto o = Opts({t.path()}, false);
  o.mode = SwapOpenMode::kOpenExisting;
  EXPECT_EQ(SwapStore::Open(o).status().code(), StatusCode::kNotFound);
  o = Opts({}, false);
  EXPECT_EQ(SwapStore::Open(o).status().code(), StatusCode::kInvalidArgument);
}

TEST(SwapStoreEnvTest, ZeroCapacityTakesTheFreeSpaceAndPreallocatesLazily) {
  TempDir t;
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({t.path()}, false, 0)));
  struct statvfs vfs;
  ASSERT_EQ(statvfs(t.path().c_str(), &vfs), 0);
  const uint64_t free_now = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  EXPECT_GT(store->capacity(), 0u);
  EXPECT_LE(store->capacity(), free_now + (64ull << 20));
  const std::string file = t.path() + "/strata-rank0.swap";
  struct stat st;
  ASSERT_EQ(stat(file.c_str(), &st), 0);
  EXPECT_EQ(st.st_size, 64 << 20);  // not the whole disk
  ASSERT_OK(store->Allocate(1, 100 << 20));  // reaches past the first 64 MiB: the file grows
  ASSERT_EQ(stat(file.c_str(), &st), 0);
  EXPECT_GE(st.st_size, 100 << 20);
  ASSERT_OK(store->Allocate(2, 5000));
  auto d = Pattern(5000, 8);
  ASSERT_OK(store->Write(2, d.data()));
  std::vector<char> back(5000);
  ASSERT_OK(store->Read(2, back.data()));
  EXPECT_EQ(back, d);
}

TEST(SwapStoreEnvTest, GrowthOnAFullFileSystemFailsTheAllocationOnly) {
  TempDir t;
  TmpfsMount tmpfs(t.path(), "size=70M");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount tmpfs: " << std::strerror(errno);
  {
    ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(Opts({t.path()}, false, 1ull << 30)));
    ASSERT_OK(store->Allocate(1, 60 << 20));
    Status s = store->Allocate(2, 30 << 20);
    EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find(t.path() + "/strata-rank0.swap"), std::string::npos) << s;
    EXPECT_NE(s.message().find("swap block 2"), std::string::npos) << s;
    ASSERT_OK(store->Allocate(3, 1 << 20));  // still fits in what is preallocated
    auto d = Pattern(1 << 20, 9);
    ASSERT_OK(store->Write(3, d.data()));
  }
}

TEST(SwapStoreEnvTest, ReadOnlyDirectoryIsPermissionDenied) {
  TempDir t;
  const std::string ro = t.path() + "/ro";
  ASSERT_EQ(mkdir(ro.c_str(), 0555), 0);
  ASSERT_EQ(chmod(t.path().c_str(), 0755), 0);
  // Root ignores mode bits, so the check runs in a child that drops to an unprivileged user.
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(20);
    auto s = SwapStore::Open(Opts({ro}, false));
    if (s.ok()) _exit(21);
    if (s.status().code() != StatusCode::kPermissionDenied) _exit(22);
    if (s.status().message().find(ro) == std::string::npos) _exit(23);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 20) GTEST_SKIP() << "cannot drop privileges";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child check failed (see exit code)";
}

TEST(SwapStoreEnvTest, ReallyFullFileSystemIsResourceExhausted) {
  TempDir t;
  TmpfsMount tmpfs(t.path(), "size=1M");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount tmpfs: " << std::strerror(errno);
  auto s = SwapStore::Open(Opts({t.path()}, false, 4 << 20));
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find(t.path() + "/strata-rank0.swap"), std::string::npos) << s.status();
  // A store that fits works on the same file system.
  {
    ASSERT_OK_AND_ASSIGN(auto ok, SwapStore::Open(Opts({t.path()}, false, 512 << 10)));
    ASSERT_OK(ok->Allocate(1, 4096));
  }
}

// A file system that reports no size at all (tmpfs mounted with size=0, like ramfs) holds its
// files in memory without a limit of its own: its free space is the host's available memory, so
// a store that needs space opens there (it was refused as having 0 B free).
TEST(SwapStoreEnvTest, AFileSystemWithoutASizeHasTheHostsMemoryFree) {
  TempDir t;
  TmpfsMount tmpfs(t.path(), "size=0");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount tmpfs: " << std::strerror(errno);
  struct statvfs vfs;
  ASSERT_EQ(statvfs(t.path().c_str(), &vfs), 0);
  ASSERT_EQ(vfs.f_blocks, 0u) << "a tmpfs of size=0 reports a size here";
  const uint64_t available = ReadHostMemory().available_bytes;
  const uint64_t free_bytes = FreeDiskBytes(t.path());
  EXPECT_GT(free_bytes, available / 2);  // read a moment apart: memory moves in between
  EXPECT_LT(free_bytes, available * 2);
  SwapStoreOptions o = Opts({t.path()}, false, 0);  // the capacity from the free space
  o.needed_bytes = 8 << 20;
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
  EXPECT_GE(store->capacity(), 8u << 20);
  ASSERT_OK(store->Allocate(1, 1 << 20));
  auto d = Pattern(1 << 20, 5);
  ASSERT_OK(store->Write(1, d.data()));
  std::vector<char> back(1 << 20);
  ASSERT_OK(store->Read(1, back.data()));
  EXPECT_EQ(back, d);
}

// A state known to be larger than the disk is refused at Open, naming the path, its free space and
// the need, instead of an Allocate failing once training is under way. The same need that fits
// opens, and an old swap file of this rank (about to be truncated) counts as free space.
TEST(SwapStoreEnvTest, NeededBytesPastTheFreeSpaceAreRefusedAtOpen) {
  TempDir t;
  TmpfsMount tmpfs(t.path(), "size=8M");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount tmpfs: " << std::strerror(errno);
  SwapStoreOptions o = Opts({t.path()}, false, 64 << 20);
  o.needed_bytes = 32 << 20;
  auto s = SwapStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find("nvme path " + t.path()), std::string::npos) << s.status();
  EXPECT_NE(s.status().message().find("needs 32"), std::string::npos) << s.status();
  // The way to shrink the state is the caller's (its layout's; it once named bf16 moments to
  // runs that had them, or 8-bit ones that need less): named when given, else none.
  EXPECT_EQ(s.status().message().find("shrink the state"), std::string::npos) << s.status();
  o.shrink_hint = "8-bit moments (strata.optimizer_state_dtype: int8)";
  s = SwapStore::Open(o);
  EXPECT_NE(s.status().message().find("shrink the state (8-bit moments"), std::string::npos)
      << s.status();
  o.shrink_hint.clear();
  o.capacity = 6 << 20;
  o.needed_bytes = 6 << 20;
  {
    ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
    ASSERT_OK(store->Allocate(1, 4 << 20));
    auto d = Pattern(4 << 20, 3);
    ASSERT_OK(store->Write(1, d.data()));
  }
  // Whatever the old file still holds is reusable: reopening for the same need works.
  ASSERT_OK_AND_ASSIGN(auto again, SwapStore::Open(o));
}

uint64_t DeviceOf(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(stat(path.c_str(), &st), 0) << path;
  return static_cast<uint64_t>(st.st_dev);
}

// A caller that gives space back on a file system while it fills the store (the engine's start
// punching zero::Init's staging file) asks for the most its use grows by there: a store larger
// than the free space then opens, and a growth past it is refused naming where the rest comes
// from. Space given back on another file system is no credit here.
TEST(SwapStoreEnvTest, NeededFreeBytesBelowTheStateAreWhatIsCheckedAtOpen) {
  TempDir t;
  TmpfsMount tmpfs(t.path(), "size=8M");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount tmpfs: " << std::strerror(errno);
  SwapStoreOptions o = Opts({t.path()}, false, 32 << 20);
  o.needed_bytes = 32 << 20;
  o.needed_free_on_device[DeviceOf(t.path())] = 9 << 20;
  o.needed_free_why = "the test frees";
  auto s = SwapStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find("needs 9.00 MiB there (32.00 MiB less 23.00 MiB in space the test frees"),
            std::string::npos)
      << s.status();
  o.needed_free_on_device.begin()->second = 6 << 20;
  { ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o)); }
  TempDir elsewhere;  // not the tmpfs
  o.needed_free_on_device = {{DeviceOf(elsewhere.path()), 6 << 20}};
  s = SwapStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("needs 32.00 MiB there"), std::string::npos) << s.status();
}

// Paths on one file system draw on its free space together: two of them each with room for its
// share alone, but not for both, are refused naming both (each path's own check let this open,
// and the run met ENOSPC once the files grew). On two file systems the same shares open; a credit
// on the shared one is for both paths' growth.
TEST(SwapStoreEnvTest, PathsOnOneFileSystemAreCheckedTogether) {
  TempDir t;
  TmpfsMount tmpfs(t.path(), "size=8M");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount tmpfs: " << std::strerror(errno);
  const std::string a = t.path() + "/a", b = t.path() + "/b";
  ASSERT_EQ(mkdir(a.c_str(), 0700), 0);
  ASSERT_EQ(mkdir(b.c_str(), 0700), 0);
  SwapStoreOptions o = Opts({a, b}, false, 12 << 20);
  o.needed_bytes = 12 << 20;  // 6 MiB a path, 12 MiB on the 8 MiB file system
  auto s = SwapStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted) << s.status();
  EXPECT_NE(s.status().message().find("nvme paths " + a + ", " + b + " (one file system) have"), std::string::npos)
      << s.status();
  EXPECT_NE(s.status().message().find("needs 12.00 MiB there (2 shares of 6.00 MiB of 12.00 MiB"), std::string::npos)
      << s.status();
  // A credit on that file system covers both paths' growth.
  o.needed_free_on_device[DeviceOf(a)] = 7 << 20;
  o.needed_free_why = "the test frees";
  { ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o)); }
  o.needed_free_on_device.clear();
  std::filesystem::remove_all(b);  // its swap file, kept by the store above
  TempDir u;
  TmpfsMount other(u.path(), "size=8M");
  ASSERT_TRUE(other.mounted());
  o.paths = {a, u.path()};
  ASSERT_OK_AND_ASSIGN(auto store, SwapStore::Open(o));
  ASSERT_OK(store->Allocate(1, 12 << 20));
}

TEST(SwapStoreEnvTest, ReadOnlyFileSystemIsPermissionDenied) {
  TempDir t;
  TmpfsMount tmpfs(t.path(), "size=1M");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount tmpfs: " << std::strerror(errno);
  if (mount(nullptr, t.path().c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) != 0) {
    GTEST_SKIP() << "cannot remount read-only";
  }
  auto s = SwapStore::Open(Opts({t.path()}, false, 1 << 20));
  EXPECT_EQ(s.status().code(), StatusCode::kPermissionDenied) << s.status();
  EXPECT_NE(s.status().message().find("read-only"), std::string::npos) << s.status();
}

TEST(SwapStoreEnvTest, SecondOpenOfTheSameRankIsRefused) {
  TempDir t;
  ASSERT_OK_AND_ASSIGN(auto a, SwapStore::Open(Opts({t.path()}, false, 1 << 20)));
  auto o = Opts({t.path()}, false, 1 << 20);
  o.mode = SwapOpenMode::kOpenOrCreate;
  auto b = SwapStore::Open(o);
  EXPECT_EQ(b.status().code(), StatusCode::kFailedPrecondition) << b.status();
  EXPECT_NE(b.status().message().find("locked by another engine or process"), std::string::npos)
      << b.status();
  o.rank = 1;  // another rank has its own files
  ASSERT_OK(SwapStore::Open(o).status());
}

TEST(SwapStoreEnvTest, OneDirectoryNamedTwiceIsRefusedHoweverSpelled) {
  // The same directory twice gives both stripes the same file: refused by the directory, not by
  // the spelling, naming both spellings.
  TempDir t;
  ASSERT_EQ(::mkdir((t.path() + "/d").c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((t.path() + "/e").c_str(), 0755), 0);
  ASSERT_EQ(::symlink((t.path() + "/d").c_str(), (t.path() + "/link").c_str()), 0);
  const std::string d = t.path() + "/d";
  for (const std::string& other : {d, d + "/", t.path() + "/e/../d", t.path() + "/link"}) {
    auto s = SwapStore::Open(Opts({d, other}, false, 1 << 20));
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument) << other << ": " << s.status();
    EXPECT_NE(s.status().message().find(StrCat(
                  "nvme path ", other,
                  other == d ? " is listed twice" : " is the directory " + d + " names too")),
              std::string::npos)
        << s.status();
  }
  ASSERT_OK(SwapStore::Open(Opts({d, t.path() + "/e"}, false, 1 << 20)).status());
}

TEST(SwapIndexTest, RoundTripAndEveryTruncationIsRejected) {
  SwapIndex idx;
  idx.rank = 3;
  idx.stripe_unit = 65536;
  idx.capacity = 65536 * 2 * 10;
  idx.files = {"/a/strata-rank3.swap", "/b/strata-rank3.swap"};
  idx.blocks = {{1, 0, 5000, 0xdeadbeef, true}, {2, 8192, 70000, 0x1234, false}};
  std::string bytes = SerializeSwapIndex(idx);
  ASSERT_OK_AND_ASSIGN(SwapIndex back, ParseSwapIndex(bytes, "mem"));
  EXPECT_EQ(back.rank, 3u);
  EXPECT_EQ(back.files, idx.files);
  ASSERT_EQ(back.blocks.size(), 2u);
  EXPECT_EQ(back.blocks[1].length, 70000u);
  EXPECT_FALSE(back.blocks[1].written);
  EXPECT_EQ(back.blocks[0].crc, 0xdeadbeefu);
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = ParseSwapIndex(std::string_view(bytes).substr(0, n), "mem");
    ASSERT_FALSE(r.ok()) << n;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << n;
  }
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] ^= 0x10;
    EXPECT_FALSE(ParseSwapIndex(bad, "mem").ok()) << "flip at " << i;
  }
}

TEST(SwapIndexTest, RandomBodiesWithValidChecksumNeverCrash) {
  // Valid magic, version and trailing crc, so the parser reaches its structural checks.
  std::mt19937 rng(77);
  int parsed = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string b = SerializeSwapIndex(SwapIndex{0, ChecksumKind::kCrc32c, 4096, 4096 * 8, {"/x"}, {}});
    b.resize(b.size() - 4);
    const size_t keep = 12 + rng() % (b.size() - 11);
    b.resize(keep);
    const size_t extra = rng() % 96;
    for (size_t i = 0; i < extra; ++i) b.push_back(static_cast<char>(rng() % 4 == 0 ? rng() : rng() % 3));
    uint32_t crc = Crc32c(b.data(), b.size());
    b.append(reinterpret_cast<const char*>(&crc), 4);
    auto r = ParseSwapIndex(b, "rand");
    if (r.ok()) {
      ++parsed;
    } else {
      EXPECT_EQ(r.status().code(), StatusCode::kDataLoss) << r.status();
    }
  }
  EXPECT_GT(parsed, 0);  // the generator does reach valid indexes too
}

TEST(SwapIndexTest, ConsistentChecksumButBadContentsIsRejected) {
  SwapIndex idx;
  idx.stripe_unit = 4096;
  idx.capacity = 4096 * 4;
  idx.files = {"/a/x.swap"};
  idx.blocks = {{1, 0, 8192, 0, true}, {2, 4096, 10, 0, true}};  // overlap
  auto r = ParseSwapIndex(SerializeSwapIndex(idx), "mem");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("overlap"), std::string::npos) << r.status();
  idx.blocks = {{1, 0, 8192, 0, true}, {1, 8192, 10, 0, true}};  // duplicate key
  EXPECT_FALSE(ParseSwapIndex(SerializeSwapIndex(idx), "mem").ok());
  idx.blocks = {{1, 12288, 8192, 0, true}};  // past capacity
  EXPECT_FALSE(ParseSwapIndex(SerializeSwapIndex(idx), "mem").ok());
  idx.blocks = {};
  idx.stripe_unit = 1000;
  EXPECT_FALSE(ParseSwapIndex(SerializeSwapIndex(idx), "mem").ok());
}

}  // namespace
}  // namespace strata::nvme
