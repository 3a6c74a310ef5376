// `strata-swapbench profile`: every measurement strata-tune needs, in one run, each figure beside
// its ceiling on this machine:
// - NVMe read/write through Strata's io engine over a sweep of aio block_size x queue_depth x
//   intra_op_parallelism (closed loop: queue_depth x parallelism buffers each resubmitted from
//   its completion), with fio (io_uring, O_DIRECT) at the recommended point as the ceiling;
// - DRAM streaming copy (the ceiling for host copies);
// - host<->device copies through Device streams, pinned and pageable, both directions, on the
//   CPU device and on CUDA when a GPU is present;
// - CPU Adam (optim::AdamStep, fp32 states, bf16 working copy — the engine's call) on 16M elements;
// - a matmul FLOP rate (bf16 and fp32) for the compute lane, on the GPU where there is one (and
//   LibTorch has CUDA), else on the CPU; and the GPU's memory, the device budget strata-tune
//   assumes there.
// Output: a table (or --json, the schema of tools/planner/profile.h), SVG plots with --out, the
// recommended aio block, and --apply CONFIG writes it into a config (atomically).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <tbb/task_arena.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "optim/compact_formats.h"
#include "optim/compact_step.h"
#include "optim/cpu_adam.h"
#include "runtime/base/config.h"
#include "runtime/base/device.h"
#include "runtime/base/host_info.h"
#include "runtime/base/units.h"
#include "runtime/state/state_layout.h"
#include "tiers/hbm/device_factory.h"
#include "tiers/host/cuda_host_alloc.h"
#include "tiers/nvme/io_engine.h"
#include "tools/planner/cli_util.h"
#include "tools/planner/profile.h"
#include "tools/swapbench/commands.h"
#include "tools/swapbench/scratch_files.h"

namespace strata::swapbench {
namespace {

using Clock = std::chrono::steady_clock;
using planner::HardwareProfile;
using planner::NvmePoint;

double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct ProfileArgs {
  bool quick = false;
  bool full = false;
  std::string path;
  bool json = false;
  std::string out;
  std::string apply;
  bool no_fio = false;
};

// A progress bar on stderr: "[#####.....] 5/10 what".
class Progress {
 public:
  explicit Progress(int total) : total_(total), tty_(isatty(2)) {}
  void Step(const std::string& what) {
    ++done_;
    const int width = 30, filled = total_ ? done_ * width / total_ : width;
    std::fprintf(stderr, "%s[%s%s] %d/%d %-40s%s", tty_ ? "\r" : "", std::string(filled, '#').c_str(),
                 std::string(width - filled, '.').c_str(), done_, total_, what.c_str(), tty_ ? "" : "\n");
    if (done_ == total_ && tty_) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  }

 private:
  int total_, done_ = 0;
  bool tty_;
};

// One anonymous mapping for all I/O slots, 2 MiB aligned, huge pages advised (see Note [bench
// buffers] in nvme_cmd.cc for why: fewer segments per request on virtio disks).
struct IoBuffers {
  char* base = nullptr;
  size_t mapped = 0;
  ~IoBuffers() {
    if (base) munmap(base, mapped);
  }
  Status Allocate(size_t bytes) {
    constexpr size_t kHuge = 2u << 20;
    mapped = (bytes + kHuge - 1) / kHuge * kHuge + kHuge;
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return ErrnoToStatus(errno, StrCat("mapping ", FormatBytes(mapped), " of I/O buffers"));
    base = static_cast<char*>(p);
    madvise(aligned(), mapped - kHuge, MADV_HUGEPAGE);
    std::memset(aligned(), 0x5a, mapped - kHuge);
    return Status::Ok();
  }
  char* aligned() const {
    return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + (2u << 20) - 1) / (2u << 20) * (2u << 20));
  }
};

// Closed loop over [0, size) of file 0: `slots` buffers of `bs` bytes, each resubmitted from its
// completion for the next block. Returns GB/s.
StatusOr<double> RunLoop(nvme::IoEngine& engine, nvme::IoOp op, uint64_t size, uint64_t bs, size_t slots,
                         char* buffers) {
  const uint64_t total = size / bs;
  std::atomic<uint64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  size_t active = std::min<uint64_t>(slots, total);
  Status first_error;
  std::vector<std::function<void(Status)>> loops(slots);
  auto issue = [&](size_t slot, uint64_t block) {
    nvme::IoRequest r;
    r.op = op;
    r.file = 0;
    r.buf = buffers + slot * bs;
    r.length = bs;
    r.offset = block * bs;
    r.done = loops[slot];
    engine.Submit(std::move(r));
  };
  for (size_t slot = 0; slot < slots; ++slot) {
    loops[slot] = [&, slot](Status st) {
      bool failed;
      {
        std::lock_guard<std::mutex> l(mu);
        if (!st.ok() && first_error.ok()) first_error = st;
        failed = !first_error.ok();
      }
      const uint64_t b = next.fetch_add(1);
      if (b < total && !failed) return issue(slot, b);
      std::lock_guard<std::mutex> l(mu);
      if (--active == 0) cv.notify_all();
    };
  }
  const auto t0 = Clock::now();
  const size_t starters = active;
  for (size_t slot = 0; slot < starters; ++slot) issue(slot, next.fetch_add(1));
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return active == 0; });
  }
  const double secs = Since(t0);
  engine.Drain();
  if (!first_error.ok()) return first_error;
  return static_cast<double>(total * bs) / secs / 1e9;
}

StatusOr<double> RunFio(const std::string& file, uint64_t size, const NvmePoint& p) {
  const char* rw = p.write ? "write" : "read";
  std::string cmd = StrCat("fio --name=strata-profile --filename=", file, " --rw=", rw, " --bs=", p.block_size,
                           " --iodepth=", p.queue_depth * p.parallelism,
                           " --ioengine=io_uring --direct=1 --size=", size, " --output-format=json 2>&1");
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return ErrnoToStatus(errno, "starting fio");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  if (pclose(f) != 0) return Unavailable(StrCat("fio failed: ", out.substr(0, 300)));
  auto brace = out.find('{');
  auto j = nlohmann::json::parse(brace == std::string::npos ? "" : out.substr(brace), nullptr, false);
  if (j.is_discarded() || !j.contains("jobs") || j["jobs"].empty() || !j["jobs"][0][rw].contains("bw_bytes"))
    return Internal(StrCat("could not read fio's JSON: ", out.substr(0, 300)));
  return j["jobs"][0][rw]["bw_bytes"].get<double>() / 1e9;
}

bool HaveFio() { return std::system("fio --version > /dev/null 2>&1") == 0; }

// NVMe sweep. Writes first (they also fill the file, so reads touch real blocks).
Status SweepNvme(const ProfileArgs& a, HardwareProfile* h, Progress* progress,
                 const std::vector<uint64_t>& bss, const std::vector<int64_t>& qds,
                 const std::vector<int64_t>& pars, uint64_t size, std::vector<std::string>* notes) {
  const std::string file = StrCat(a.path, a.path.back() == '/' ? "" : "/", "strata-profile.dat");
  RemoveOnInterrupt(file);  // the sweep's own file, removed at its end too
  int fd = open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0644);
  bool direct = true;
  if (fd < 0 && errno == EINVAL) {
    direct = false;
    fd = open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    notes->push_back(StrCat(a.path, " does not support O_DIRECT: buffered I/O (figures include the page cache)"));
  }
  if (fd < 0) return ErrnoToStatus(errno, StrCat("opening ", file));
  // The file is the sweep's own, whatever it held: refused up front when the disk cannot hold it.
  struct stat st;
  const uint64_t had = fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
  const uint64_t free_bytes = FreeDiskBytes(a.path);
  if (size > had && size - had > free_bytes) {
    close(fd);
    unlink(file.c_str());
    return InvalidArgument(StrCat("the NVMe sweep's ", FormatBytes(size), " file needs ", FormatBytes(size - had),
                                  " more at ", a.path, ", which has ", FormatBytes(free_bytes),
                                  " free: free disk space there, or pass another directory as --path"));
  }
  if (fallocate(fd, 0, 0, static_cast<off_t>(size)) != 0 && errno != EOPNOTSUPP) {
    Status s = ErrnoToStatus(errno, StrCat("preallocating ", FormatBytes(size), " for ", file));
    close(fd);
    unlink(file.c_str());
    return s;
  }
  const uint64_t max_buffers = 1ull << 30;
  Status result;
  for (nvme::IoOp op : {nvme::IoOp::kWrite, nvme::IoOp::kRead}) {
    for (int64_t par : pars) {
      for (uint64_t bs : bss) {
        for (int64_t qd : qds) {
          const std::string what = StrCat(op == nvme::IoOp::kWrite ? "write " : "read ", FormatBytes(bs), " x QD",
                                          qd, " x ", par);
          const size_t slots = static_cast<size_t>(qd * par);
          if (slots * bs > max_buffers || slots * bs > size) {
            progress->Step(what + " (skipped)");
            continue;
          }
          nvme::IoEngineOptions eo;
          eo.aio.block_size = static_cast<int64_t>(bs);
          eo.aio.queue_depth = qd;
          eo.aio.intra_op_parallelism = par;
          eo.force_fallback = !direct;
          if (!direct) eo.fallback_reason = "no O_DIRECT";
          auto engine = nvme::IoEngine::Create(eo);
          if (!engine.ok()) { result = engine.status(); break; }
          h->nvme_engine = std::string((*engine)->name());
          Status sf = (*engine)->SetFiles({{fd, file}});
          if (!sf.ok()) { result = sf; break; }
          IoBuffers buf;
          Status sb = buf.Allocate(slots * bs);
          if (!sb.ok()) { result = sb; break; }
          (void)(*engine)->RegisterBuffers({{buf.aligned(), slots * bs}});
          auto gbps = RunLoop(**engine, op, size, bs, slots, buf.aligned());
          if (!gbps.ok()) { result = gbps.status(); break; }
          h->nvme.push_back({op == nvme::IoOp::kWrite, static_cast<int64_t>(bs), qd, par, *gbps});
          progress->Step(what);
        }
        if (!result.ok()) break;
      }
      if (!result.ok()) break;
    }
    if (!result.ok()) break;
  }
  close(fd);
  if (result.ok() && !a.no_fio) {
    auto best = h->BestAio();
    if (best.ok() && HaveFio()) {
      auto f = RunFio(file, size, *best);
      if (f.ok()) {
        h->has_fio = true;
        h->fio = *best;
        h->fio.gbps = *f;
      } else {
        notes->push_back(StrCat("fio: ", f.status().message()));
      }
    } else if (best.ok()) {
      notes->push_back("fio is not installed: no NVMe ceiling (apt-get install fio)");
    }
    progress->Step("fio at the recommended point");
  }
  unlink(file.c_str());
  return result;
}

// Bytes copied per second by memcpy between two large buffers, best of `reps`.
double DramCopyGbps(size_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    best = std::max(best, static_cast<double>(bytes) / Since(t0) / 1e9);
    std::swap(a, b);
  }
  return best;
}

// Copies through a stream of `device`; pinned host memory from cudaHostAlloc (CUDA) or
// mmap + mlock (CPU device; pageable when mlock is refused, said in notes).
Status MeasureCopies(Device& device, size_t bytes, int reps, HardwareProfile* h,
                     std::vector<std::string>* notes) {
  const std::string dev_name = device.kind() == DeviceKind::kCuda ? "cuda" : "cpu";
  STRATA_ASSIGN_OR_RETURN(void* dmem, device.Allocate(bytes));
  auto stream = device.CreateStream();
  if (!stream.ok()) {
    (void)device.Free(dmem);
    return stream.status();
  }
  for (const char* memory : {"pinned", "pageable"}) {
    void* host = nullptr;
    bool cuda_pinned = false, mapped = false;
    if (std::strcmp(memory, "pinned") == 0) {
      if (device.kind() == DeviceKind::kCuda && host_internal::CudaHostAllocAvailable()) {
        auto p = host_internal::CudaHostAlloc(bytes);
        if (p.ok()) { host = *p; cuda_pinned = true; }
      }
      if (!host) {
        void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) continue;
        host = p;
        mapped = true;
        if (mlock(host, bytes) != 0)
          notes->push_back(StrCat("mlock of ", FormatBytes(bytes), " refused (", std::strerror(errno),
                                  "): the 'pinned' copy figures are pageable memory"));
      }
    } else {
      host = std::aligned_alloc(4096, bytes);
    }
    std::memset(host, 3, bytes);
    for (const char* dir : {"h2d", "d2h"}) {
      const bool h2d = std::strcmp(dir, "h2d") == 0;
      double best = 0;
      Status s;
      for (int r = 0; r < reps && s.ok(); ++r) {
        auto t0 = Clock::now();
        s = (*stream)->MemcpyAsync(h2d ? dmem : host, h2d ? host : dmem, bytes,
                                   h2d ? CopyKind::kHostToDevice : CopyKind::kDeviceToHost);
        if (s.ok()) s = (*stream)->Synchronize();
        best = std::max(best, static_cast<double>(bytes) / Since(t0) / 1e9);
      }
      if (!s.ok()) {
        notes->push_back(StrCat(dev_name, " ", memory, " ", dir, ": ", s.message()));
        continue;
      }
      h->copies.push_back({dev_name, memory, dir, best});
    }
    if (cuda_pinned) host_internal::CudaHostFree(host);
    else if (mapped) munmap(host, bytes);
    else std::free(host);
  }
  return device.Free(dmem);
}

// The CPU Adam in every optimizer-state layout (Note [compact layouts]), each by the call the
// engine makes: AdamStep for fp32 states (with the bf16 copy the device gets) and for bf16 moments
// beside an fp32 master, CompactAdamStep for 8-bit moments or a bf16 master. Keyed by
// StateLayout::Name() ("fp32" for the first), so that the cost model finds a config's layout.
// Each runs on every thread oneTBB gives this process and again on one thread: the optimizer lane
// gets fewer threads than the machine has where its updates overlap compute
// (ChooseOptimizerThreads), and the cost model scales the rate between the two figures.
Status MeasureAdam(int64_t n, int reps, HardwareProfile* h) {
  struct Case {
    optim::MasterFormat master;
    optim::MomentFormat moments;
  };
  const Case cases[] = {{optim::MasterFormat::kFp32, optim::MomentFormat::kFp32},
                        {optim::MasterFormat::kFp32, optim::MomentFormat::kBf16},
                        {optim::MasterFormat::kFp32, optim::MomentFormat::kInt8},
                        {optim::MasterFormat::kBf16Stochastic, optim::MomentFormat::kBf16},
                        {optim::MasterFormat::kBf16Stochastic, optim::MomentFormat::kInt8}};
  const size_t un = static_cast<size_t>(n);
  std::vector<float> grad(un, 0.01f);
  std::vector<uint16_t> p16(un);
  tbb::task_arena one(1);
  h->adam_threads = tbb::this_task_arena::max_concurrency();
  h->physical_cores = PhysicalCoreCount();
  for (const Case& c : cases) {
    StateLayout layout;
    layout.moments = c.moments;
    layout.bf16_master = c.master != optim::MasterFormat::kFp32;
    std::vector<uint8_t> master(optim::MasterBytes(c.master, un), 0);
    if (c.master == optim::MasterFormat::kFp32) {
      std::fill_n(reinterpret_cast<float*>(master.data()), un, 0.5f);
    }
    std::vector<uint8_t> m(optim::MomentBytes(c.moments, un), 0), v(optim::MomentBytes(c.moments, un), 0);
    optim::AdamParams ap;
    for (tbb::task_arena* arena : {static_cast<tbb::task_arena*>(nullptr), &one}) {
      optim::AdamOptions ao;
      ao.grad_check = optim::GradCheck::kCallerChecked;  // as the engine calls it
      ao.arena = arena;
      double best = 0;
      // One thread takes up to the machine's thread count times longer: fewer rounds of it.
      const int rounds = arena == nullptr ? reps : std::min(reps, 2);
      for (int r = 0; r < rounds; ++r) {
        ap.step = r + 1;
        auto t0 = Clock::now();
        if (c.master == optim::MasterFormat::kFp32 && c.moments != optim::MomentFormat::kInt8) {
          optim::AdamBuffers b;
          b.master = reinterpret_cast<float*>(master.data());
          b.grad = grad.data();
          b.exp_avg = m.data();
          b.exp_avg_sq = v.data();
          b.state_dtype = c.moments == optim::MomentFormat::kBf16 ? optim::DType::kBFloat16 : optim::DType::kFloat32;
          if (c.moments == optim::MomentFormat::kFp32) {
            b.param16 = p16.data();
            b.param16_dtype = optim::DType::kBFloat16;
          }
          b.n = un;
          STRATA_ASSIGN_OR_RETURN(auto res, optim::AdamStep(ap, b, 1.0f, ao));
          if (c.moments == optim::MomentFormat::kFp32) h->adam_isa = optim::IsaName(res.isa);
        } else {
          optim::CompactAdamBuffers b;
          b.master = master.data();
          b.master_format = c.master;
          b.grad = grad.data();
          b.exp_avg = m.data();
          b.exp_avg_sq = v.data();
          b.moment_format = c.moments;
          b.n = un;
          b.rounding_key = optim::RoundingKey(1, ap.step);
          STRATA_RETURN_IF_ERROR(optim::CompactAdamStep(ap, b, 1.0f, ao).status());
        }
        best = std::max(best, static_cast<double>(n) / Since(t0) / 1e9);
      }
      if (arena != nullptr) {
        h->adam_one_thread_gelems_per_s[layout.Name()] = best;
      } else if (c.moments == optim::MomentFormat::kFp32 && c.master == optim::MasterFormat::kFp32) {
        h->adam_gelems_per_s = best;
      } else {
        h->adam_layout_gelems_per_s[layout.Name()] = best;
      }
    }
  }
  h->adam_elements = n;
  return Status::Ok();
}

// n x n matmuls on `device` (CPU, or a CUDA GPU: timed to the stream's end); the best of reps.
double MatmulGflops(torch::Dtype dtype, int64_t n, int reps, torch::Device device) {
  torch::NoGradGuard ng;
  const auto opts = torch::TensorOptions().dtype(dtype).device(device);
  torch::Tensor a = torch::randn({n, n}, opts), b = torch::randn({n, n}, opts);
  const bool cuda = device.is_cuda();
  auto sync = [&] {
    if (cuda) torch::cuda::synchronize(device.index());
  };
  torch::Tensor c = torch::matmul(a, b);  // warm-up (thread pools, packing; cuBLAS handles)
  sync();
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    c = torch::matmul(a, b);
    sync();
    best = std::max(best, 2.0 * n * n * n / Since(t0) / 1e9);
  }
  return best;
}

// ---------------------------------------------------------------------------------------------
// SVG plots, written by hand.

std::string Esc(const std::string& s) {
  std::string o;
  for (char c : s) o += c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '&' ? "&amp;" : std::string(1, c);
  return o;
}

// Heatmap of GB/s over block size (columns) x queue depth (rows), best over parallelism.
std::string Heatmap(const HardwareProfile& h, bool write) {
  std::vector<int64_t> bss, qds;
  for (const auto& p : h.nvme) {
    if (p.write != write) continue;
    if (std::find(bss.begin(), bss.end(), p.block_size) == bss.end()) bss.push_back(p.block_size);
    if (std::find(qds.begin(), qds.end(), p.queue_depth) == qds.end()) qds.push_back(p.queue_depth);
  }
  std::sort(bss.begin(), bss.end());
  std::sort(qds.begin(), qds.end());
  double maxv = 0;
  for (const auto& p : h.nvme)
    if (p.write == write) maxv = std::max(maxv, p.gbps);
  const int cw = 110, ch = 44, x0 = 90, y0 = 60;
  const int W = x0 + cw * static_cast<int>(bss.size()) + 20, H = y0 + ch * static_cast<int>(qds.size()) + 70;
  std::string s = StrCat("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", W, "\" height=\"", H,
                         "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
                         "fill=\"white\"/>\n<text x=\"10\" y=\"22\" font-size=\"15\">NVMe ",
                         write ? "write" : "read", " GB/s (", Esc(h.nvme_engine), ", best over intra_op_parallelism)",
                         h.has_fio ? StrCat(" - fio ceiling ", h.fio.gbps, " GB/s") : std::string(), "</text>\n");
  for (size_t i = 0; i < bss.size(); ++i)
    s += StrCat("<text x=\"", x0 + cw * static_cast<int>(i) + cw / 2, "\" y=\"", y0 - 8,
                "\" text-anchor=\"middle\">", FormatBytes(static_cast<uint64_t>(bss[i])), "</text>\n");
  for (size_t r = 0; r < qds.size(); ++r) {
    s += StrCat("<text x=\"", x0 - 8, "\" y=\"", y0 + ch * static_cast<int>(r) + ch / 2 + 4,
                "\" text-anchor=\"end\">QD ", qds[r], "</text>\n");
    for (size_t i = 0; i < bss.size(); ++i) {
      double v = -1;
      for (const auto& p : h.nvme)
        if (p.write == write && p.block_size == bss[i] && p.queue_depth == qds[r]) v = std::max(v, p.gbps);
      const int x = x0 + cw * static_cast<int>(i), y = y0 + ch * static_cast<int>(r);
      std::string fill = "#dddddd";
      if (v >= 0 && maxv > 0) {
        const double t = v / maxv;  // white -> blue
        fill = StrCat("rgb(", static_cast<int>(255 - 200 * t), ",", static_cast<int>(255 - 140 * t), ",255)");
      }
      char label[32];
      std::snprintf(label, sizeof label, v >= 0 ? "%.2f" : "-", v);
      s += StrCat("<rect x=\"", x, "\" y=\"", y, "\" width=\"", cw - 2, "\" height=\"", ch - 2, "\" fill=\"", fill,
                  "\"/>\n<text x=\"", x + cw / 2, "\" y=\"", y + ch / 2 + 4, "\" text-anchor=\"middle\">", label,
                  "</text>\n");
    }
  }
  s += StrCat("<text x=\"", x0, "\" y=\"", H - 30, "\">columns: aio.block_size; rows: aio.queue_depth</text>\n</svg>\n");
  return s;
}

// Bars per tier pair, each with its ceiling drawn as a tick.
std::string Bars(const HardwareProfile& h) {
  struct Bar {
    std::string label;
    double gbps, ceiling;
  };
  std::vector<Bar> bars;
  double best_r = 0, best_w = 0;
  for (const auto& p : h.nvme) (p.write ? best_w : best_r) = std::max(p.write ? best_w : best_r, p.gbps);
  if (best_r > 0) bars.push_back({"NVMe -> host (read)", best_r, h.has_fio && !h.fio.write ? h.fio.gbps : 0});
  if (best_w > 0) bars.push_back({"host -> NVMe (write)", best_w, h.has_fio && h.fio.write ? h.fio.gbps : 0});
  if (h.dram_gbps > 0) bars.push_back({"DRAM copy", h.dram_gbps, 0});
  for (const auto& c : h.copies)
    bars.push_back({StrCat(c.device, " ", c.memory, " ", c.direction == "h2d" ? "host -> device" : "device -> host"),
                    c.gbps, h.dram_gbps});
  double maxv = 0;
  for (const auto& b : bars) maxv = std::max({maxv, b.gbps, b.ceiling});
  const int x0 = 230, bw = 420, bh = 24, y0 = 50;
  const int H = y0 + (bh + 10) * static_cast<int>(bars.size()) + 40;
  std::string s = StrCat("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", x0 + bw + 120, "\" height=\"", H,
                         "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
                         "fill=\"white\"/>\n<text x=\"10\" y=\"24\" font-size=\"15\">Bandwidth per tier pair "
                         "(GB/s); red tick: ceiling (fio for NVMe, DRAM copy for host copies)</text>\n");
  for (size_t i = 0; i < bars.size(); ++i) {
    const int y = y0 + (bh + 10) * static_cast<int>(i);
    const int w = maxv > 0 ? static_cast<int>(bw * bars[i].gbps / maxv) : 0;
    char label[32];
    std::snprintf(label, sizeof label, "%.2f", bars[i].gbps);
    s += StrCat("<text x=\"", x0 - 8, "\" y=\"", y + bh / 2 + 4, "\" text-anchor=\"end\">", Esc(bars[i].label),
                "</text>\n<rect x=\"", x0, "\" y=\"", y, "\" width=\"", std::max(w, 1), "\" height=\"", bh,
                "\" fill=\"#4a7bd0\"/>\n<text x=\"", x0 + w + 6, "\" y=\"", y + bh / 2 + 4, "\">", label, "</text>\n");
    if (bars[i].ceiling > 0) {
      const int cx = x0 + static_cast<int>(bw * bars[i].ceiling / maxv);
      s += StrCat("<line x1=\"", cx, "\" y1=\"", y - 3, "\" x2=\"", cx, "\" y2=\"", y + bh + 3,
                  "\" stroke=\"red\" stroke-width=\"3\"/>\n");
    }
  }
  return s + "</svg>\n";
}

Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream o(path);
  o << text;
  o.close();
  if (!o) return ErrnoToStatus(errno, StrCat("writing ", path));
  return Status::Ok();
}

// Writes the recommended aio block into `path`, keeping every other key; atomic.
Status ApplyAio(const std::string& path, const NvmePoint& best) {
  STRATA_ASSIGN_OR_RETURN(nlohmann::json j, planner::ReadJsonFile(path));
  nlohmann::json& a = j["aio"];
  a["block_size"] = best.block_size;
  a["queue_depth"] = best.queue_depth;
  a.erase("thread_count");  // DeepSpeed's old spelling of the same knob
  a["intra_op_parallelism"] = best.parallelism;
  STRATA_RETURN_IF_ERROR(planner::WriteJsonFileAtomic(path, j));
  return Config::FromFile(path).status();
}

// What is wrong with the flags, or "" (checked before anything is measured; makes the --out
// folder).
std::string BadProfileArgs(const ProfileArgs& a) {
  if (a.quick && a.full) return "--quick and --full exclude each other";
  if (!a.path.empty()) {
    struct stat st;
    if (stat(a.path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      return StrCat("--path=", a.path, ": not an existing directory; create it first");
  }
  if (!a.apply.empty() && a.path.empty())
    return "--apply needs NVMe figures: pass --path DIR on the NVMe drive";
  if (!a.apply.empty()) {
    auto c = Config::FromFile(a.apply);
    if (!c.ok()) return StrCat("--apply=", a.apply, ": ", c.status().message());
    bool comments = false;
    auto raw = planner::ReadJsonFile(a.apply, &comments);
    if (!raw.ok()) return StrCat("--apply=", a.apply, ": ", raw.status().message());
    if (comments)
      return StrCat("--apply=", a.apply, " holds comments (or trailing commas), which writing the aio block into it "
                    "would drop: remove them, or leave out --apply and copy the recommended block by hand");
  }
  if (!a.out.empty()) {
    struct stat st;
    if (stat(a.out.c_str(), &st) != 0 && mkdir(a.out.c_str(), 0755) != 0)
      return StrCat("--out=", a.out, ": cannot create it (", std::strerror(errno), ")");
  }
  return "";
}

// The human-readable report: each figure beside its ceiling where one was measured.
void PrintProfile(const ProfileArgs& a, const HardwareProfile& h, const StatusOr<NvmePoint>& best,
                  const std::vector<std::string>& notes) {
  std::printf("\non %s\n", HostDescription(a.path).c_str());
  std::printf("%-44s %10s %12s %8s\n", "measurement", "GB/s", "ceiling", "ratio");
  auto row = [](const std::string& what, double v, double ceil) {
    if (ceil > 0) std::printf("%-44s %10.3f %12.3f %7.0f%%\n", what.c_str(), v, ceil, 100 * v / ceil);
    else std::printf("%-44s %10.3f %12s %8s\n", what.c_str(), v, "-", "");
  };
  for (const auto& p : h.nvme) {
    const double ceil = h.has_fio && h.fio.write == p.write && h.fio.block_size == p.block_size &&
                                h.fio.queue_depth == p.queue_depth && h.fio.parallelism == p.parallelism
                            ? h.fio.gbps
                            : 0;
    row(StrCat("nvme ", p.write ? "write " : "read  ", FormatBytes(static_cast<uint64_t>(p.block_size)), " QD",
               p.queue_depth, " x", p.parallelism, " (", h.nvme_engine, ")"),
        p.gbps, ceil);
  }
  if (h.has_fio)
    row(StrCat("fio io_uring ", h.fio.write ? "write " : "read ", FormatBytes(static_cast<uint64_t>(h.fio.block_size)),
               " QD", h.fio.queue_depth * h.fio.parallelism),
        h.fio.gbps, 0);
  row("DRAM streaming copy (memcpy)", h.dram_gbps, 0);
  for (const auto& c : h.copies)
    row(StrCat(c.device, " ", c.memory, " ", c.direction, " (Device stream)"), c.gbps, h.dram_gbps);
  // Each layout on every thread, and on one where measured.
  const auto one = [&](const std::string& layout) {
    const auto it = h.adam_one_thread_gelems_per_s.find(layout);
    if (it == h.adam_one_thread_gelems_per_s.end()) return std::string();
    char text[64];
    std::snprintf(text, sizeof text, ", %.3f on one thread", it->second);
    return std::string(text);
  };
  std::printf("%-44s %10.3f G elements/s (%s, %d threads%s)\n", "CPU Adam, 16M elements", h.adam_gelems_per_s,
              h.adam_isa.c_str(), h.adam_threads, one("fp32").c_str());
  for (const auto& [layout, rate] : h.adam_layout_gelems_per_s)
    std::printf("%-44s %10.3f G elements/s%s\n", StrCat("  optimizer states ", layout).c_str(), rate,
                one(layout).c_str());
  std::printf("%-44s %10.1f GFLOP/s bf16, %.1f fp32\n", StrCat("matmul (LibTorch, ", h.compute_device, ")").c_str(),
              h.compute_gflops, h.compute_fp32_gflops);
  if (h.device_capacity_bytes > 0)
    std::printf("%-44s %10s\n", StrCat("device memory, ", h.device_name).c_str(),
                FormatBytes(h.device_capacity_bytes).c_str());
  if (best.ok())
    std::printf("\nrecommended aio: {\"block_size\": %lld, \"queue_depth\": %lld, \"intra_op_parallelism\": %lld}\n",
                static_cast<long long>(best->block_size), static_cast<long long>(best->queue_depth),
                static_cast<long long>(best->parallelism));
  for (const auto& n : notes) std::printf("note: %s\n", n.c_str());
}

int RunProfile(const ProfileArgs& a) {
  auto usage = [](const std::string& m) {
    std::cerr << "strata-swapbench profile: " << m << "\nRun `strata-swapbench profile --help` for the options.\n";
    return 2;
  };
  if (std::string bad = BadProfileArgs(a); !bad.empty()) return usage(bad);
  const bool full = a.full;
  std::vector<uint64_t> bss = full ? std::vector<uint64_t>{256_KiB, 1_MiB, 4_MiB, 8_MiB}
                                   : std::vector<uint64_t>{1_MiB, 8_MiB};
  std::vector<int64_t> qds = full ? std::vector<int64_t>{4, 16, 64, 128} : std::vector<int64_t>{8, 32};
  std::vector<int64_t> pars = full ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{1};
  const uint64_t size = full ? 1_GiB : 256_MiB;
  const int nvme_steps = a.path.empty() ? 0 : static_cast<int>(2 * bss.size() * qds.size() * pars.size()) + (a.no_fio ? 0 : 1);
  const bool cuda = CudaDeviceCount() > 0;
  Progress progress(nvme_steps + 4 + (cuda ? 1 : 0));

  HardwareProfile h;
  h.device = cuda ? "cuda" : "cpu";
  std::vector<std::string> notes;
  h.nvme_path = a.path;
  if (!a.path.empty()) {
    Status s = SweepNvme(a, &h, &progress, bss, qds, pars, size, &notes);
    if (!s.ok()) {
      std::cerr << "\nstrata-swapbench profile: NVMe sweep: " << s << "\n";
      return 1;
    }
  } else {
    notes.push_back("NVMe skipped: no --path (give a directory on the NVMe drive)");
  }
  const size_t copy_bytes = full ? 256_MiB : 64_MiB;
  h.dram_gbps = DramCopyGbps(copy_bytes, full ? 8 : 4);
  progress.Step("DRAM copy");
  {
    auto dev = CreateDevice("cpu", 2 * copy_bytes);
    Status s = dev.ok() ? MeasureCopies(**dev, copy_bytes, full ? 8 : 4, &h, &notes) : dev.status();
    if (!s.ok()) notes.push_back(StrCat("cpu device copies: ", s.message()));
  }
  progress.Step("cpu device copies");
  if (cuda) {
    auto dev = CreateDevice("cuda", 0);
    if (dev.ok()) {  // before the copies allocate: the capacity the engine's device would have
      h.device_name = (*dev)->name();
      h.device_capacity_bytes = (*dev)->capacity();
    }
    Status s = dev.ok() ? MeasureCopies(**dev, copy_bytes, full ? 8 : 4, &h, &notes) : dev.status();
    if (!s.ok()) notes.push_back(StrCat("cuda copies: ", s.message()));
    progress.Step("cuda copies");
  }
  Status adam = MeasureAdam(16 << 20, full ? 5 : 3, &h);
  if (!adam.ok()) {
    std::cerr << "\nstrata-swapbench profile: Adam: " << adam << "\n";
    return 1;
  }
  progress.Step("CPU Adam 16M elements");
  // The compute rate is the training device's: a GPU's matmul where the engine would compute on
  // one, which is three orders of magnitude above the CPU's.
  const bool cuda_matmul = cuda && torch::cuda::is_available();
  if (cuda && !cuda_matmul)
    notes.push_back("this LibTorch has no CUDA: the matmul figure is the CPU's, not the GPU's "
                    "(strata-tune --device cuda then needs --gflops)");
  const int64_t mm = cuda_matmul ? 8192 : full ? 2048 : 1024;
  const torch::Device mm_device = cuda_matmul ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  h.compute_device = cuda_matmul ? "cuda" : "cpu";
  h.compute_dtype = "bf16";
  h.compute_gflops = MatmulGflops(torch::kBFloat16, mm, full ? 5 : 3, mm_device);
  h.compute_fp32_gflops = MatmulGflops(torch::kFloat32, mm, full ? 5 : 3, mm_device);
  progress.Step(StrCat("matmul bf16/fp32 (", h.compute_device, ")"));

  nlohmann::json j = h.ToJson();
  j["mode"] = full ? "full" : "quick";
  j["host"] = HostDescription(a.path);
  j["notes"] = notes;
  auto best = h.BestAio();
  if (a.json) {
    std::cout << j.dump(2) << "\n";
  } else {
    PrintProfile(a, h, best, notes);
  }
  if (!a.out.empty()) {
    Status s = WriteText(a.out + "/profile.json", j.dump(2) + "\n");
    if (s.ok()) s = WriteText(a.out + "/bandwidth_bars.svg", Bars(h));
    if (s.ok() && !h.nvme.empty()) s = WriteText(a.out + "/nvme_read_heatmap.svg", Heatmap(h, false));
    if (s.ok() && !h.nvme.empty()) s = WriteText(a.out + "/nvme_write_heatmap.svg", Heatmap(h, true));
    if (!s.ok()) {
      std::cerr << "strata-swapbench profile: " << s << "\n";
      return 1;
    }
    std::cerr << "wrote " << a.out << "/{profile.json,bandwidth_bars.svg"
              << (h.nvme.empty() ? "" : ",nvme_read_heatmap.svg,nvme_write_heatmap.svg") << "}\n";
  }
  if (!a.apply.empty()) {
    if (!best.ok()) {
      std::cerr << "strata-swapbench profile: --apply: " << best.status().message() << "\n";
      return 1;
    }
    Status s = ApplyAio(a.apply, *best);
    if (!s.ok()) {
      std::cerr << "strata-swapbench profile: --apply " << a.apply << ": " << s << "\n";
      return 1;
    }
    std::cerr << "wrote the recommended aio block into " << a.apply << "\n";
  }
  return 0;
}

}  // namespace

void RegisterProfileCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<ProfileArgs>();
  CLI::App* cmd = app.add_subcommand(
      "profile",
      "Measures everything strata-tune needs: NVMe read/write over aio block_size x queue_depth x "
      "intra_op_parallelism (fio beside it when installed), DRAM streaming copy, host<->device "
      "copies (pinned and pageable, both directions) through Device streams, CPU Adam on 16M "
      "elements, a matmul FLOP rate (on the GPU when there is one) and the GPU's free memory. "
      "Prints a table (or --json for strata-tune --profile), writes SVG plots with --out, recommends an aio block and writes it with --apply.");
  cmd->add_flag("--quick", args->quick, "a small sweep (2 block sizes x 2 queue depths, 256 MiB file): under a minute");
  cmd->add_flag("--full", args->full, "the full sweep (4 block sizes x 4 queue depths x 2 rings, 1 GiB file)");
  cmd->add_option("--path", args->path, "directory on the NVMe drive to measure (a 256 MiB/1 GiB file is created and "
                                        "removed); without it NVMe is skipped");
  cmd->add_flag("--json", args->json, "print the report as JSON (the input of strata-tune --profile)");
  cmd->add_option("--out", args->out, "directory for profile.json and SVG plots (created if missing)");
  cmd->add_option("--apply", args->apply, "config file to write the recommended aio block into (other keys kept)");
  cmd->add_flag("--no-fio", args->no_fio, "skip the fio reference run");
  cmd->callback([args, exit_code] { *exit_code = RunProfile(*args); });
}

}  // namespace strata::swapbench
