// `strata-swapbench nvme`: sequential read or write throughput of one file through Strata's NVMe
// engine (tiers/nvme/io_engine.h), optionally compared in the same run with fio (io_uring engine,
// O_DIRECT, same file, size, block size and queue depth).
//
// The measurement is a closed loop like fio's: queue_depth × threads buffers of block_size bytes,
// each resubmitted from its completion callback for the next block of the file until the file
// has been covered once. The timed phase runs from the first submission to the last completion.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/check.h"
#include "runtime/base/host_info.h"
#include "runtime/base/logging.h"
#include "runtime/base/status.h"
#include "runtime/base/units.h"
#include "tiers/nvme/io_engine.h"
#include "tiers/nvme/swap_store.h"
#include "tools/swapbench/commands.h"
#include "tools/swapbench/scratch_files.h"

namespace strata::swapbench {
namespace {

using nvme::IoEngine;
using nvme::IoOp;

struct NvmeArgs {
  std::string path;
  std::string size = "2GiB";
  std::string block_size = "1MiB";
  std::string queue_depth = "32";
  std::string threads = "1";
  std::string rw;
  std::string repeat = "1";
  bool json = false;
  bool fio = false;
  bool fallback = false;
  bool cleanup = false;
  bool no_fixed_buffers = false;
  bool no_huge_pages = false;
  bool store = false;
};

struct Settings {
  std::string dir;
  std::string file;
  uint64_t size = 0;
  uint64_t block_size = 0;
  int64_t queue_depth = 0;
  int64_t threads = 0;
  int64_t repeat = 1;
  IoOp op = IoOp::kRead;
};

StatusOr<int64_t> ParseCount(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || *end != '\0' || v < lo || v > hi)
    return InvalidArgument(StrCat(flag, "=", text, ": must be an integer in ", lo, "..", hi));
  return static_cast<int64_t>(v);
}

StatusOr<Settings> Validate(const NvmeArgs& a) {
  Settings s;
  if (a.path.empty()) return InvalidArgument("--path is required: a directory on the device to measure");
  struct stat st;
  if (stat(a.path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
    return InvalidArgument(StrCat("--path=", a.path, ": not an existing directory; create it first"));
  s.dir = a.path;
  s.file = StrCat(a.path, a.path.back() == '/' ? "" : "/", "strata-swapbench.dat");
  auto size = ParseBytes(a.size);
  if (!size.ok()) return InvalidArgument(StrCat("--size=", a.size, ": ", size.status().message()));
  auto bs = ParseBytes(a.block_size);
  if (!bs.ok()) return InvalidArgument(StrCat("--block-size=", a.block_size, ": ", bs.status().message()));
  s.size = *size;
  s.block_size = *bs;
  if (s.block_size < 4096 || s.block_size % 4096 != 0 || s.block_size > (1ull << 30))
    return InvalidArgument(StrCat("--block-size=", a.block_size, ": must be a multiple of 4KiB "
                                  "between 4KiB and 1GiB (O_DIRECT transfers are 4 KiB-aligned)"));
  if (s.size < s.block_size || s.size % s.block_size != 0)
    return InvalidArgument(StrCat("--size=", a.size, ": must be a positive multiple of --block-size=",
                                  a.block_size, " (e.g. 2GiB)"));
  STRATA_ASSIGN_OR_RETURN(s.queue_depth, ParseCount("--queue-depth", a.queue_depth, 1, 4096));
  STRATA_ASSIGN_OR_RETURN(s.threads, ParseCount("--threads", a.threads, 1, 64));
  STRATA_ASSIGN_OR_RETURN(s.repeat, ParseCount("--repeat", a.repeat, 1, 100));
  if (a.rw == "read") {
    s.op = IoOp::kRead;
  } else if (a.rw == "write") {
    s.op = IoOp::kWrite;
  } else {
    return InvalidArgument(StrCat("--rw=", a.rw, ": must be read or write"));
  }
  const uint64_t buffers = s.block_size * static_cast<uint64_t>(s.queue_depth * s.threads);
  if (buffers > (16ull << 30))
    return InvalidArgument(StrCat("--block-size x --queue-depth x --threads = ", FormatBytes(buffers),
                                  " of buffers: keep it under 16 GiB"));
  return s;
}

// Note [bench buffers]
// All slots share one anonymous mapping aligned to 2 MiB and advised MADV_HUGEPAGE, as fio's
// single buffer effectively is. With 4 KiB pages a 1 MiB transfer is 256 segments, which a
// virtio disk limited to fewer segments per request (254 here) splits into two requests; with
// huge pages it is one or two segments.
struct Buffers {
  char* base = nullptr;
  size_t mapped = 0;
  std::vector<char*> bufs;
  ~Buffers() {
    if (base != nullptr) munmap(base, mapped);
  }
  Status Allocate(size_t count, size_t bytes, bool huge) {
    constexpr size_t kHuge = 2u << 20;
    const size_t total = (count * bytes + kHuge - 1) / kHuge * kHuge;
    mapped = total + kHuge;
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      p = nullptr;
      return ErrnoToStatus(errno, StrCat("mapping ", FormatBytes(mapped), " of I/O buffers"));
    }
    base = static_cast<char*>(p);
    char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge);
    madvise(aligned, total, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);  // advisory
    for (size_t i = 0; i < count; ++i) {
      bufs.push_back(aligned + i * bytes);
      // Distinct, non-zero contents so a write really moves data (and the pages exist).
      std::memset(bufs.back(), static_cast<int>(0x5a ^ i), bytes);
    }
    return Status::Ok();
  }
};

struct RunResult {
  double seconds = 0;
  double gbps = 0;
};

// Moves one block: through the engine (a file range) or through the swap store (a block key).
using MoveFn = std::function<void(IoOp op, uint64_t block, char* buf, nvme::IoDone done)>;

// Runs the closed loop once over the whole file.
StatusOr<RunResult> RunOnce(const MoveFn& move, const std::function<void()>& drain, const Settings& s,
                            IoOp op, const Buffers& buffers) {
  const uint64_t total = s.size / s.block_size;
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  size_t active = 0;
  Status first_error;

  // One closure per slot: it owns a buffer and keeps it busy until the file is covered.
  std::vector<std::function<void(Status)>> loops(buffers.bufs.size());
  auto issue = [&](size_t slot, uint64_t block) { move(op, block, buffers.bufs[slot], loops[slot]); };
  for (size_t slot = 0; slot < loops.size(); ++slot) {
    loops[slot] = [&, slot](Status st) {
      if (!st.ok()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.ok()) first_error = st;
      }
      uint64_t b = next.fetch_add(1);
      bool failed;
      {
        std::lock_guard<std::mutex> lock(mu);
        failed = !first_error.ok();
      }
      if (b < total && !failed) {
        issue(slot, b);
        return;
      }
      std::lock_guard<std::mutex> lock(mu);
      if (--active == 0) cv.notify_all();
    };
  }
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu);
    active = std::min<uint64_t>(loops.size(), total);
  }
  const size_t starters = std::min<uint64_t>(loops.size(), total);
  for (size_t slot = 0; slot < starters; ++slot) {
    // Early completions already take blocks from `next`, so a starter may find none left.
    const uint64_t b = next.fetch_add(1);
    if (b < total) {
      issue(slot, b);
    } else {
      std::lock_guard<std::mutex> lock(mu);
      if (--active == 0) cv.notify_all();
    }
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return active == 0; });
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  drain();
  if (!first_error.ok()) return first_error;
  return RunResult{secs, static_cast<double>(s.size) / secs / 1e9};
}

// How fio's buffers are set up to match Strata's (like for like): registered buffers and files
// when Strata registers its buffers, and huge-page memory when Strata's buffers use huge pages.
struct FioBuffers {
  bool fixed = true;  // --fixedbufs --registerfiles
  bool huge = true;   // --iomem=shmhuge (needs reserved huge pages, see ReserveHugePages)
};

// Reserves enough 2 MiB huge pages for fio's --iomem=shmhuge and restores the old count on
// destruction. ok() is false when the kernel would not give them (not root, no memory).
class HugePageReservation {
 public:
  explicit HugePageReservation(uint64_t bytes) {
    const uint64_t need = (bytes + (2u << 20) - 1) / (2u << 20) + 2;
    old_ = Read("/proc/sys/vm/nr_hugepages");
    const uint64_t have_free = ReadMeminfo("HugePages_Free:");
    if (have_free >= need) {
      ok_ = true;
      return;
    }
    if (!Write(old_ + need - have_free)) return;
    changed_ = true;
    ok_ = ReadMeminfo("HugePages_Free:") >= need;
  }
  ~HugePageReservation() {
    if (changed_) Write(old_);
  }
  bool ok() const { return ok_; }

 private:
  static uint64_t Read(const char* path) {
    std::ifstream f(path);
    uint64_t v = 0;
    f >> v;
    return v;
  }
  static uint64_t ReadMeminfo(const std::string& key) {
    std::ifstream f("/proc/meminfo");
    for (std::string line; std::getline(f, line);)
      if (line.rfind(key, 0) == 0) return std::strtoull(line.c_str() + key.size(), nullptr, 10);
    return 0;
  }
  static bool Write(uint64_t n) {
    std::ofstream f("/proc/sys/vm/nr_hugepages");
    f << n;
    f.flush();
    return static_cast<bool>(f);
  }
  uint64_t old_ = 0;
  bool changed_ = false;
  bool ok_ = false;
};

// fio with the io_uring engine on the same file, its buffers set up as `fb`; returns decimal GB/s.
StatusOr<double> RunFio(const Settings& s, const FioBuffers& fb) {
  const char* rw = s.op == IoOp::kRead ? "read" : "write";
  std::string cmd = StrCat("fio --name=strata-swapbench --filename=", s.file, " --rw=", rw,
                           " --bs=", s.block_size, " --iodepth=", s.queue_depth,
                           " --ioengine=io_uring --direct=1 --numjobs=", s.threads,
                           " --group_reporting --output-format=json");
  if (fb.fixed) cmd += " --fixedbufs --registerfiles";
  if (fb.huge) cmd += " --iomem=shmhuge";
  if (s.threads > 1) {
    cmd += StrCat(" --size=", s.size / s.threads, " --offset_increment=", s.size / s.threads);
  } else {
    cmd += StrCat(" --size=", s.size);
  }
  cmd += " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return ErrnoToStatus(errno, "starting fio");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  int rc = pclose(p);
  if (rc != 0)
    return Unavailable(StrCat("fio failed (exit ", rc, "; is fio installed? apt-get install fio): ",
                              out.substr(0, 500)));
  auto brace = out.find('{');
  if (brace == std::string::npos) return Internal(StrCat("fio printed no JSON: ", out.substr(0, 500)));
  auto j = nlohmann::json::parse(out.substr(brace), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty())
    return Internal(StrCat("could not parse fio's JSON: ", out.substr(0, 500)));
  const auto& job = j["jobs"][0][rw];
  if (!job.contains("bw_bytes")) return Internal("fio's JSON has no bw_bytes");
  return job["bw_bytes"].get<double>() / 1e9;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// One `strata-swapbench nvme` run: the buffers, then exactly one of the two I/O paths (the raw
// engine on one file, or the swap store), the rounds (interleaved with fio's when asked), the
// path closed, the report.
class NvmeBench {
 public:
  NvmeBench(const NvmeArgs& args, const Settings& s) : args_(args), s_(s), run_(s) {}
  ~NvmeBench() {
    engine_.reset();
    store_.reset();
    if (fd_ >= 0) close(fd_);
  }

  Status Run() {
    STRATA_RETURN_IF_ERROR(AllocateBuffers());
    AioConfig aio;
    aio.block_size = static_cast<int64_t>(s_.block_size);
    aio.queue_depth = s_.queue_depth;
    aio.intra_op_parallelism = s_.threads;
    STRATA_RETURN_IF_ERROR(args_.store ? OpenStore(aio) : OpenFile(aio));
    if (needs_fill_ && s_.op == IoOp::kRead) {
      // Preallocated space reads back as zeros without touching the device: write it for real.
      auto filled = RunOnce(move_, drain_, s_, IoOp::kWrite, buffers_);
      if (!filled.ok()) return filled.status().WithContext("filling the file before reading");
    }
    STRATA_RETURN_IF_ERROR(Rounds());
    Close();
    Report();
    return Status::Ok();
  }

 private:
  // With --fio, fio needs a huge-page reservation for --iomem=shmhuge; without one both sides
  // use 4 KiB pages.
  Status AllocateBuffers() {
    huge_ = !args_.no_huge_pages;
    fio_buffers_.fixed = !args_.no_fixed_buffers;
    if (args_.fio && huge_) {
      reservation_ = std::make_unique<HugePageReservation>(s_.queue_depth * s_.threads * s_.block_size);
      if (!reservation_->ok()) {
        std::cerr << "strata-swapbench nvme: could not reserve huge pages for fio's --iomem=shmhuge "
                     "(needs root and free memory); both sides use 4 KiB pages instead\n";
        huge_ = false;
      }
    }
    fio_buffers_.huge = huge_;
    STRATA_RETURN_IF_ERROR(
        buffers_.Allocate(static_cast<size_t>(s_.queue_depth * s_.threads), s_.block_size, huge_));
    for (char* b : buffers_.bufs) iov_.push_back({b, s_.block_size});
    return Status::Ok();
  }

  Status OpenStore(const AioConfig& aio) {
    nvme::SwapStoreOptions so;
    so.paths = {s_.dir};
    RemoveOnInterrupt(StrCat(s_.dir, "/strata-rank0.swap"));  // Close removes them too
    RemoveOnInterrupt(StrCat(s_.dir, "/strata-rank0.index"));
    so.capacity = s_.size;
    so.aio = aio;
    so.force_fallback = args_.fallback;
    STRATA_ASSIGN_OR_RETURN(store_, nvme::SwapStore::Open(so));
    for (uint64_t b = 0; b < s_.size / s_.block_size; ++b)
      STRATA_RETURN_IF_ERROR(store_->Allocate(b, s_.block_size));
    STRATA_ASSIGN_OR_RETURN(auto ext, store_->Locate(0));
    run_.file = ext[0].path;  // fio measures the swap file itself
    direct_ = store_->stats().direct_io;
    move_ = [this](IoOp op, uint64_t block, char* buf, nvme::IoDone done) {
      if (op == IoOp::kRead) {
        store_->ReadAsync(block, buf, std::move(done));
      } else {
        store_->WriteAsync(block, buf, std::move(done));
      }
    };
    drain_ = [] {};  // every block's callback has run when the loop ends
    if (!args_.no_fixed_buffers) {
      Status reg = store_->RegisterBuffers(iov_);
      if (!reg.ok()) STRATA_LOG(WARN) << "nvme bench: " << reg;
    }
    return Status::Ok();
  }

  Status OpenFile(const AioConfig& aio) {
    fd_ = open(s_.file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0644);
    if (fd_ < 0 && errno == EINVAL) {
      direct_ = false;
      fd_ = open(s_.file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    }
    if (fd_ < 0) return ErrnoToStatus(errno, StrCat("opening ", s_.file));
    struct stat st;
    fstat(fd_, &st);
    const uint64_t had = static_cast<uint64_t>(st.st_size);
    needs_fill_ = had < s_.size;
    if (needs_fill_) {
      // A file the disk cannot hold is refused before a byte is written, and one the disk
      // turned out not to hold is put back as it was: a benchmark must not leave a full disk.
      const auto put_back = [&] {
        if (had == 0) unlink(s_.file.c_str());
        else if (ftruncate(fd_, static_cast<off_t>(had)) != 0) STRATA_LOG(WARN) << "truncating " << s_.file << " back";
      };
      const uint64_t free_bytes = FreeDiskBytes(s_.dir);
      if (s_.size - had > free_bytes) {
        put_back();
        return InvalidArgument(StrCat("--size ", FormatBytes(s_.size), " needs ", FormatBytes(s_.size - had),
                                      " more at ", s_.dir, ", which has ", FormatBytes(free_bytes),
                                      " free: lower --size or free disk space"));
      }
      if (fallocate(fd_, 0, 0, static_cast<off_t>(s_.size)) != 0 && errno != EOPNOTSUPP) {
        const int err = errno;
        put_back();
        return ErrnoToStatus(err, StrCat("preallocating ", FormatBytes(s_.size), " for ", s_.file));
      }
    }
    nvme::IoEngineOptions eo;
    eo.aio = aio;
    eo.force_fallback = args_.fallback || !direct_;
    if (!direct_) eo.fallback_reason = StrCat(s_.dir, " does not support O_DIRECT");
    STRATA_ASSIGN_OR_RETURN(engine_, IoEngine::Create(eo));
    STRATA_RETURN_IF_ERROR(engine_->SetFiles({{fd_, s_.file}}));
    move_ = [this](IoOp op, uint64_t block, char* buf, nvme::IoDone done) {
      nvme::IoRequest r;
      r.op = op;
      r.file = 0;
      r.buf = buf;
      r.length = s_.block_size;
      r.offset = block * s_.block_size;
      r.done = std::move(done);
      engine_->Submit(std::move(r));
    };
    drain_ = [this] { engine_->Drain(); };
    if (!args_.no_fixed_buffers) {
      Status reg = engine_->RegisterBuffers(iov_);
      if (!reg.ok()) STRATA_LOG(WARN) << "nvme bench: " << reg;
    }
    return Status::Ok();
  }

  // With --fio the order alternates (ours first, then fio first, ...): on a virtual disk the
  // host may cache what the previous run read, which would favour whoever runs second.
  Status Rounds() {
    for (int64_t r = 0; r < s_.repeat; ++r) {
      const bool fio_first = args_.fio && r % 2 == 1;
      if (fio_first) STRATA_RETURN_IF_ERROR(RunFioOnce());
      STRATA_ASSIGN_OR_RETURN(RunResult res, RunOnce(move_, drain_, s_, s_.op, buffers_));
      ours_.push_back(res.gbps);
      secs_.push_back(res.seconds);
      if (args_.fio && !fio_first) STRATA_RETURN_IF_ERROR(RunFioOnce());
      if (!args_.json) {
        std::cout << "run " << r + 1 << "/" << s_.repeat << ": strata " << res.gbps << " GB/s";
        if (args_.fio) std::cout << ", fio " << fio_.back() << " GB/s, ratio " << res.gbps / fio_.back();
        std::cout << "\n";
      }
    }
    return Status::Ok();
  }

  Status RunFioOnce() {
    STRATA_ASSIGN_OR_RETURN(double gbps, RunFio(run_, fio_buffers_));
    fio_.push_back(gbps);
    return Status::Ok();
  }

  // The path's I/O statistics kept, then the path closed (a fresh store is made on every run).
  void Close() {
    if (store_) {
      auto ss = store_->stats();
      io_ = ss.io;
      engine_name_ = ss.engine;
      reason_ = ss.fallback_reason;
      store_.reset();
      unlink(run_.file.c_str());
      unlink(StrCat(s_.dir, "/strata-rank0.index").c_str());
    } else {
      io_ = engine_->stats();
      engine_name_ = std::string(engine_->name());
      reason_ = engine_->fallback_reason();
      engine_.reset();
      close(fd_);
      fd_ = -1;
    }
    if (args_.cleanup) unlink(s_.file.c_str());
  }

  void Report() const {
    const double gbps = Median(ours_);
    if (!args_.json) {
      std::cout << "on " << HostDescription(s_.dir) << "\n";
      std::cout << "nvme " << (s_.op == IoOp::kRead ? "read" : "write") << " file=" << run_.file
                << " size=" << FormatBytes(s_.size) << " bs=" << FormatBytes(s_.block_size)
                << " qd=" << s_.queue_depth << " threads=" << s_.threads << " engine=" << engine_name_
                << " fixed_buffers=" << io_.fixed_buffers << "\n  strata: " << gbps << " GB/s (median of "
                << s_.repeat << ")\n";
      if (args_.fio)
        std::cout << "  fio:    " << Median(fio_) << " GB/s\n  ratio:  " << gbps / Median(fio_) << "\n";
      return;
    }
    nlohmann::json j;
    j["command"] = "nvme";
    j["host"] = HostDescription(s_.dir);
    j["file"] = run_.file;
    j["path"] = args_.store ? "swap_store" : "engine";
    j["rw"] = s_.op == IoOp::kRead ? "read" : "write";
    j["size"] = s_.size;
    j["block_size"] = s_.block_size;
    j["queue_depth"] = s_.queue_depth;
    j["threads"] = s_.threads;
    j["repeat"] = s_.repeat;
    j["engine"] = engine_name_;
    if (!reason_.empty()) j["fallback_reason"] = reason_;
    j["direct_io"] = direct_;
    j["fixed_buffers"] = io_.fixed_buffers;
    j["fixed_files"] = io_.fixed_files;
    j["huge_pages"] = huge_;
    if (args_.fio)
      j["fio_options"] = StrCat(fio_buffers_.fixed ? "--fixedbufs --registerfiles " : "",
                                fio_buffers_.huge ? "--iomem=shmhuge" : "--iomem=malloc (4 KiB pages)");
    j["gbps"] = gbps;
    j["runs_gbps"] = ours_;
    j["seconds"] = Median(secs_);
    j["retries_short"] = io_.retries_short;
    j["retries_eagain"] = io_.retries_eagain;
    if (args_.fio) {
      j["fio_gbps"] = Median(fio_);
      j["fio_runs_gbps"] = fio_;
      j["ratio_vs_fio"] = gbps / Median(fio_);
    }
    std::cout << j.dump() << "\n";
  }

  const NvmeArgs& args_;
  const Settings s_;
  Settings run_;  // what fio is given: the swap file itself under --store
  bool huge_ = false;
  FioBuffers fio_buffers_;
  std::unique_ptr<HugePageReservation> reservation_;
  Buffers buffers_;
  std::vector<iovec> iov_;
  bool direct_ = true;
  int fd_ = -1;
  std::unique_ptr<IoEngine> engine_;
  std::unique_ptr<nvme::SwapStore> store_;
  bool needs_fill_ = true;
  MoveFn move_;
  std::function<void()> drain_;
  std::vector<double> ours_, fio_, secs_;
  nvme::IoEngineStats io_;
  std::string engine_name_, reason_;
};

// Returns the process exit code: 0 success, 1 run-time failure, 2 bad arguments.
int RunNvme(const NvmeArgs& args) {
  auto settings = Validate(args);
  if (!settings.ok()) {
    std::cerr << "strata-swapbench nvme: " << settings.status().message()
              << "\nRun `strata-swapbench nvme --help` for the options.\n";
    return 2;
  }
  Settings s = *settings;
  // With --fio, at least 3 interleaved rounds: one pair of runs says little on a disk whose speed
  // swings between minutes; the medians and their ratio are reported.
  if (args.fio && s.repeat < 3) s.repeat = 3;
  Status st = NvmeBench(args, s).Run();
  if (!st.ok()) {
    std::cerr << "strata-swapbench nvme: " << st << "\n";
    return st.code() == StatusCode::kInvalidArgument ? 2 : 1;  // a --size the disk cannot hold
  }
  return 0;
}

}  // namespace

void RegisterNvmeCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<NvmeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "nvme",
      "Sequential read or write throughput of one file through Strata's NVMe engine (io_uring, "
      "O_DIRECT, registered buffers), in decimal GB/s. The file is <path>/strata-swapbench.dat, "
      "preallocated to --size (and written once before a read test if it was shorter). Keeps "
      "queue-depth x threads requests of block-size bytes in flight. With --fio, fio runs with the "
      "io_uring engine on the same file, size, block size and queue depth in each round (alternating "
      "which runs first), and the ratio of the medians is printed. Exit status: 0 ok, 1 I/O failure, 2 bad arguments.");
  cmd->add_option("--path", args->path, "Directory on the device to measure (required)");
  cmd->add_option("--size", args->size, "File size, e.g. 2GiB (default 2GiB)");
  cmd->add_option("--block-size", args->block_size, "Bytes per request, multiple of 4KiB, e.g. 1MiB (default 1MiB)");
  cmd->add_option("--queue-depth", args->queue_depth, "Requests in flight per ring, 1..4096 (default 32)");
  cmd->add_option("--threads", args->threads, "Rings per direction (aio.intra_op_parallelism), 1..64 (default 1)");
  cmd->add_option("--rw", args->rw, "read or write (required)");
  cmd->add_option("--repeat", args->repeat,
                  "Runs (alternating with fio when --fio, then at least 3); medians are reported (default 1)");
  cmd->add_flag("--json", args->json, "Print one JSON object (gbps, engine, settings, fio figures)");
  cmd->add_flag("--fio", args->fio,
                "Also run fio (io_uring, O_DIRECT) on the same file, with the same kind of buffers as "
                "Strata (--fixedbufs --registerfiles unless --no-fixed-buffers; --iomem=shmhuge on "
                "reserved huge pages unless --no-huge-pages), at least 3 interleaved rounds, and print "
                "the ratio of the medians");
  cmd->add_flag("--fallback", args->fallback, "Use the pread/pwrite fallback engine instead of io_uring");
  cmd->add_flag("--cleanup", args->cleanup, "Delete the test file afterwards");
  cmd->add_flag("--store", args->store,
                "Go through the swap store (one block per request, crc32c on every block, index) "
                "instead of the raw engine; fio then measures the swap file");
  cmd->add_flag("--no-huge-pages", args->no_huge_pages,
                "Back the buffers with 4 KiB pages (MADV_NOHUGEPAGE), as fio's default buffers are "
                "where transparent huge pages are madvise-only");
  cmd->add_flag("--no-fixed-buffers", args->no_fixed_buffers,
                "Do not register the buffers with io_uring (plain read/write opcodes)");
  cmd->callback([args, exit_code] { *exit_code = RunNvme(*args); });
}

}  // namespace strata::swapbench
