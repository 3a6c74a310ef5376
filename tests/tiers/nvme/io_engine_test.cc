// IoEngine: both backends move bytes exactly, finish short transfers, retry EAGAIN and turn
// errors into Status naming the file; plus crc32c's known values.
#include "tiers/nvme/io_engine.h"

#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "tiers/nvme/crc32c.h"

namespace strata::nvme {
namespace {

using strata::testing::TempDir;

struct Aligned {
  explicit Aligned(size_t n) : size(n) {
    void* q = nullptr;
    if (posix_memalign(&q, 4096, n) != 0) std::abort();
    p = static_cast<char*>(q);
  }
  ~Aligned() { std::free(p); }
  char* p;
  size_t size;
};

void Fill(char* p, size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i < n; ++i) p[i] = static_cast<char>(rng());
}

class EngineTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    path_ = dir_.path() + "/engine.dat";
    fd_ = open(path_.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
    ASSERT_GE(fd_, 0) << std::strerror(errno);
    ASSERT_EQ(fallocate(fd_, 0, 0, 8 << 20), 0);
  }
  void TearDown() override { close(fd_); }

  std::unique_ptr<IoEngine> Make(AioConfig aio = {}, IoFaultHook hook = nullptr,
                                 IoSubmitFaultHook submit_hook = nullptr) {
    IoEngineOptions o;
    o.aio = aio;
    o.force_fallback = GetParam();
    o.fault_hook = std::move(hook);
    o.submit_fault_hook = std::move(submit_hook);
    auto e = IoEngine::Create(o);
    EXPECT_TRUE(e.ok()) << e.status();
    auto engine = std::move(e).value();
    EXPECT_OK(engine->SetFiles({{fd_, path_}}));
    EXPECT_EQ(engine->name(), GetParam() ? "fallback" : "io_uring");
    return engine;
  }

  static Status Io(IoEngine& e, IoOp op, void* buf, uint64_t len, uint64_t off) {
    std::promise<Status> p;
    auto f = p.get_future();
    e.Submit({op, 0, buf, len, off, [&p](Status s) { p.set_value(std::move(s)); }});
    return f.get();
  }

  TempDir dir_;
  std::string path_;
  int fd_ = -1;
};

TEST_P(EngineTest, RoundTripSplitsByBlockSize) {
  AioConfig aio;
  aio.block_size = 16384;  // a 100 KiB request becomes 7 pieces
  aio.queue_depth = 4;
  auto e = Make(aio);
  Aligned w(25 * 4096), r(25 * 4096);
  Fill(w.p, w.size, 1);
  ASSERT_OK(Io(*e, IoOp::kWrite, w.p, w.size, 3 * 4096));
  std::memset(r.p, 0, r.size);
  ASSERT_OK(Io(*e, IoOp::kRead, r.p, r.size, 3 * 4096));
  EXPECT_EQ(std::memcmp(w.p, r.p, w.size), 0);
  auto st = e->stats();
  EXPECT_EQ(st.requests, 2u);
  EXPECT_EQ(st.pieces, 14u);
  EXPECT_EQ(st.bytes_written, w.size);
  EXPECT_EQ(st.bytes_read, r.size);
}

TEST_P(EngineTest, ManyConcurrentRequestsEachCompleteOnTheirOwn) {
  for (bool overlap : {true, false}) {
    for (bool single : {false, true}) {
      AioConfig aio;
      aio.block_size = 8192;
      aio.queue_depth = 3;
      aio.intra_op_parallelism = 2;
      aio.overlap_events = overlap;
      aio.single_submit = single;
      auto e = Make(aio);
      constexpr int kN = 64;
      Aligned w(kN * 12288), r(kN * 12288);
      Fill(w.p, w.size, 7);
      std::atomic<int> ok{0}, calls{0};
      for (int i = 0; i < kN; ++i)
        e->Submit({IoOp::kWrite, 0, w.p + i * 12288, 12288, uint64_t(i) * 12288, [&](Status s) {
                     calls++;
                     if (s.ok()) ok++;
                   }});
      e->Drain();
      ASSERT_EQ(calls.load(), kN);
      ASSERT_EQ(ok.load(), kN);
      // Reads issued from several threads at once, each waiting only for its own completion.
      std::vector<std::future<Status>> fs;
      for (int i = 0; i < kN; ++i)
        fs.push_back(std::async(std::launch::async, [&, i] {
          return Io(*e, IoOp::kRead, r.p + i * 12288, 12288, uint64_t(i) * 12288);
        }));
      for (auto& f : fs) ASSERT_OK(f.get());
      EXPECT_EQ(std::memcmp(w.p, r.p, w.size), 0) << "overlap=" << overlap << " single=" << single;
    }
  }
}

TEST_P(EngineTest, ShortTransfersAreFinished) {
  std::atomic<int> shortened{0};
  auto hook = [&](const IoAttempt& a, int64_t res) -> int64_t {
    // Report only the first 4 KiB of every first attempt longer than that.
    if (a.attempt == 0 && res > 4096) {
      shortened++;
      return 4096;
    }
    return res;
  };
  auto e = Make(AioConfig{}, hook);
  Aligned w(64 * 1024), r(64 * 1024);
  Fill(w.p, w.size, 3);
  ASSERT_OK(Io(*e, IoOp::kWrite, w.p, w.size, 0));
  ASSERT_OK(Io(*e, IoOp::kRead, r.p, r.size, 0));
  EXPECT_EQ(std::memcmp(w.p, r.p, w.size), 0);
  EXPECT_EQ(shortened.load(), 2);
  EXPECT_EQ(e->stats().retries_short, 2u);
}

TEST_P(EngineTest, EagainIsRetried) {
  std::atomic<int> refused{0};
  auto hook = [&](const IoAttempt& a, int64_t res) -> int64_t {
    if (a.attempt < 3) {
      refused++;
      return -EAGAIN;
    }
    return res;
  };
  auto e = Make(AioConfig{}, hook);
  Aligned w(8192), r(8192);
  Fill(w.p, w.size, 4);
  ASSERT_OK(Io(*e, IoOp::kWrite, w.p, w.size, 4096));
  ASSERT_OK(Io(*e, IoOp::kRead, r.p, r.size, 4096));
  EXPECT_EQ(std::memcmp(w.p, r.p, w.size), 0);
  EXPECT_EQ(e->stats().retries_eagain, 6u);
}

// A device that refuses for good: each retry waits longer (100 us doubling to 20 ms), and the
// request fails UNAVAILABLE after 64 retries, about 1.2 s, never spinning and never hanging.
TEST_P(EngineTest, PersistentEagainFailsWithinItsBoundAfterBackingOff) {
  auto hook = [](const IoAttempt&, int64_t) -> int64_t { return -EAGAIN; };
  auto e = Make(AioConfig{}, hook);
  Aligned b(4096);
  const auto t0 = std::chrono::steady_clock::now();
  Status s = Io(*e, IoOp::kWrite, b.p, b.size, 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find(path_), std::string::npos) << s;
  EXPECT_EQ(e->stats().retries_eagain, 65u);  // the first refusal and 64 retries
  EXPECT_GT(secs, 1.0) << "the retries did not back off";
  EXPECT_LT(secs, 3.0) << "past the stated bound";
  e->Drain();  // returns: nothing is left in flight
}

// Every kernel-level try of a piece is one attempt: a piece that keeps moving less than one
// block is seen by the fault hook as attempts 0, 1, 2, ... with none skipped.
TEST_P(EngineTest, EachAttemptIsCountedOnce) {
  std::mutex mu;
  std::vector<int> seen;
  auto hook = [&](const IoAttempt& a, int64_t res) -> int64_t {
    std::lock_guard<std::mutex> l(mu);
    seen.push_back(a.attempt);
    return a.attempt < 4 ? 100 : res;  // four tries that move less than a block
  };
  auto e = Make(AioConfig{}, hook);
  Aligned w(8192);
  Fill(w.p, w.size, 8);
  ASSERT_OK(Io(*e, IoOp::kWrite, w.p, w.size, 0));
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3, 4}));
}

TEST_P(EngineTest, ErrorsNameTheFileAndKeepTheirCode) {
  auto hook = [](const IoAttempt& a, int64_t res) -> int64_t {
    if (a.offset == 0) return a.op == IoOp::kWrite ? -ENOSPC : -EIO;
    return res;
  };
  AioConfig aio;
  aio.block_size = 4096;
  auto e = Make(aio, hook);
  Aligned b(3 * 4096);
  Fill(b.p, b.size, 5);
  Status w = Io(*e, IoOp::kWrite, b.p, b.size, 0);
  EXPECT_EQ(w.code(), StatusCode::kResourceExhausted) << w;
  EXPECT_NE(w.message().find(path_), std::string::npos) << w;
  Status r = Io(*e, IoOp::kRead, b.p, b.size, 0);
  EXPECT_EQ(r.code(), StatusCode::kIoError) << r;
  EXPECT_NE(r.message().find(path_), std::string::npos) << r;
  EXPECT_EQ(e->stats().errors, 2u);
  // Pieces not hit by the fault still work.
  ASSERT_OK(Io(*e, IoOp::kWrite, b.p, 4096, 4096));
}

TEST_P(EngineTest, ReadPastEndOfFileIsAShortFile) {
  auto e = Make();
  Aligned b(8192);
  Status s = Io(*e, IoOp::kRead, b.p, b.size, (8 << 20) - 4096);
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange) << s;
  EXPECT_NE(s.message().find("short file"), std::string::npos) << s;
  EXPECT_NE(s.message().find(path_), std::string::npos) << s;
}

TEST_P(EngineTest, RegisteredBuffersAreUsedWhenAvailable) {
  auto e = Make();
  Aligned w(1 << 20), r(1 << 20);
  Fill(w.p, w.size, 9);
  ASSERT_OK(e->RegisterBuffers({{w.p, w.size}, {r.p, r.size}}));
  ASSERT_OK(Io(*e, IoOp::kWrite, w.p + 4096, w.size - 4096, 0));
  ASSERT_OK(Io(*e, IoOp::kRead, r.p, r.size - 4096, 0));
  EXPECT_EQ(std::memcmp(w.p + 4096, r.p, w.size - 4096), 0);
  if (!GetParam()) {
    EXPECT_TRUE(e->stats().fixed_buffers);
  }
}

TEST_P(EngineTest, DestructionDrainsInFlightIo) {
  std::atomic<int> done{0};
  Aligned w(32 * 4096);
  Fill(w.p, w.size, 11);
  {
    AioConfig aio;
    aio.block_size = 4096;
    aio.queue_depth = 2;
    auto e = Make(aio);
    for (int i = 0; i < 32; ++i)
      e->Submit({IoOp::kWrite, 0, w.p + i * 4096, 4096, uint64_t(i) * 4096, [&](Status s) {
                   EXPECT_OK(s);
                   done++;
                 }});
  }
  EXPECT_EQ(done.load(), 32);
}

INSTANTIATE_TEST_SUITE_P(Backends, EngineTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Fallback" : "IoUring"; });

// io_uring_enter itself failing (Note [broken ring] in uring_engine.cc), injected before the call
// reaches the kernel. The io_uring engine only: the fallback makes no such call.
class RingTest : public EngineTest {};

TEST_P(RingTest, PersistentSubmitErrorFailsEveryRequestWithinItsBound) {
  std::atomic<bool> fail_writes{true};
  auto submit = [&](const std::string& ring) { return fail_writes && ring == "write0" ? -EIO : 0; };
  AioConfig aio;
  aio.block_size = 4096;
  aio.queue_depth = 4;
  auto e = Make(aio, nullptr, submit);
  constexpr int kN = 16;
  Aligned w(kN * 4096);
  Fill(w.p, w.size, 12);
  std::atomic<int> failed{0}, calls{0};
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kN; ++i)
    e->Submit({IoOp::kWrite, 0, w.p + i * 4096, 4096, uint64_t(i) * 4096, [&](Status s) {
                 calls++;
                 if (s.code() == StatusCode::kIoError &&
                     s.message().find("io_uring_enter") != std::string::npos)
                   failed++;
               }});
  e->Drain();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(calls.load(), kN);
  EXPECT_EQ(failed.load(), kN) << "each request fails with the call's error";
  EXPECT_LT(secs, 1.0) << "5 tries with a 31 ms backoff, then the ring gives up";
  EXPECT_EQ(e->stats().broken_rings, 1u);
  EXPECT_EQ(e->stats().bytes_written, 0u);
  // A broken ring fails later requests at once; the read ring is untouched.
  fail_writes = false;
  Aligned r(4096);
  EXPECT_EQ(Io(*e, IoOp::kWrite, w.p, 4096, 0).code(), StatusCode::kIoError);
  EXPECT_OK(Io(*e, IoOp::kRead, r.p, r.size, 0));
}

TEST_P(RingTest, ATransientSubmitErrorIsRetried) {
  std::atomic<int> left{3};
  auto submit = [&](const std::string&) { return left.fetch_sub(1) > 0 ? -ENOMEM : 0; };
  auto e = Make(AioConfig{}, nullptr, submit);
  Aligned w(8192), r(8192);
  Fill(w.p, w.size, 13);
  ASSERT_OK(Io(*e, IoOp::kWrite, w.p, w.size, 0));
  ASSERT_OK(Io(*e, IoOp::kRead, r.p, r.size, 0));
  EXPECT_EQ(std::memcmp(w.p, r.p, w.size), 0);
  EXPECT_EQ(e->stats().broken_rings, 0u);
}

// EAGAIN from io_uring_enter with nothing in flight to complete: retried with a backoff for the
// busy bound (2 s), then the ring gives up instead of spinning.
TEST_P(RingTest, SubmitEagainWithNothingCompletingGivesUpAfterItsBound) {
  std::atomic<bool> busy{false};  // from the request on: the ring's own set-up goes through
  auto submit = [&](const std::string& ring) { return busy && ring == "read0" ? -EAGAIN : 0; };
  auto e = Make(AioConfig{}, nullptr, submit);
  Aligned r(4096);
  busy = true;
  const auto t0 = std::chrono::steady_clock::now();
  Status s = Io(*e, IoOp::kRead, r.p, r.size, 0);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_GT(secs, 1.9);
  EXPECT_LT(secs, 4.0);
}

INSTANTIATE_TEST_SUITE_P(IoUring, RingTest, ::testing::Values(false),
                         [](const auto&) { return std::string("IoUring"); });

// Makes io_uring_setup fail with ENOSYS in this process, as on a kernel built without io_uring
// or with it disabled, without touching the machine-wide io_uring_disabled sysctl.
bool DenyIoUringSetup() {
#if defined(__x86_64__) && defined(__NR_io_uring_setup)
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
#else
  return false;
#endif
}

TEST(EngineSetupTest, FallsBackWhenIoUringCannotBeSetUp) {
  TempDir dir;
  const std::string path = dir.path() + "/f.dat";
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (!DenyIoUringSetup()) _exit(77);
    IoEngineOptions o;
    auto e = IoEngine::Create(o);
    if (!e.ok()) _exit(10);
    if ((*e)->name() != "fallback") _exit(11);
    if ((*e)->fallback_reason().find("io_uring") == std::string::npos) _exit(12);
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
    if (fd < 0 || !(*e)->SetFiles({{fd, path}}).ok()) _exit(13);
    Aligned w(8192), r(8192);
    Fill(w.p, w.size, 21);
    std::promise<Status> pw, pr;
    (*e)->Submit({IoOp::kWrite, 0, w.p, w.size, 0, [&](Status s) { pw.set_value(s); }});
    if (!pw.get_future().get().ok()) _exit(14);
    (*e)->Submit({IoOp::kRead, 0, r.p, r.size, 0, [&](Status s) { pr.set_value(s); }});
    if (!pr.get_future().get().ok()) _exit(15);
    if (std::memcmp(w.p, r.p, w.size) != 0) _exit(16);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "seccomp unavailable";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child check failed (see exit code)";
}

TEST(AioConfigTest, BadValuesNameTheKeyAndRange) {
  AioConfig aio;
  aio.queue_depth = 0;
  Status s = ValidateAioConfig(aio);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("aio.queue_depth=0"), std::string::npos) << s;
  aio = {};
  aio.block_size = 1000;
  s = ValidateAioConfig(aio);
  EXPECT_NE(s.message().find("aio.block_size=1000"), std::string::npos) << s;
  aio = {};
  aio.intra_op_parallelism = 0;
  IoEngineOptions o;
  o.aio = aio;
  EXPECT_FALSE(IoEngine::Create(o).ok());
}

TEST(Crc32cTest, KnownValuesAndBothPathsAgree) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32c("", 0), 0u);
  std::vector<char> zeros(32, 0);
  EXPECT_EQ(Crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  std::vector<char> data(100003);
  Fill(data.data(), data.size(), 13);
  for (size_t off : {0, 1, 3, 7}) {
    // Around the three-lane runs of 12 KiB: below, at, just past, several.
    for (size_t n : {0, 1, 7, 8, 9, 63, 4096, 12287, 12288, 12289, 12296, 36864 + 5, 99990}) {
      EXPECT_EQ(Crc32cExtendPortable(0, data.data() + off, n), Crc32c(data.data() + off, n));
    }
  }
  // Extending in pieces equals one pass.
  uint32_t c = Crc32cExtend(0, data.data(), 1000);
  c = Crc32cExtend(c, data.data() + 1000, data.size() - 1000);
  EXPECT_EQ(c, Crc32c(data.data(), data.size()));
}

}  // namespace
}  // namespace strata::nvme
