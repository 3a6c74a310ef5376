// `strata-swapbench tiers`: the tier manager on a training-shaped access trace over the real
// NVMe tier, compared in the same run with the NVMe tier's raw sequential throughput.
//
// The trace, per iteration, over N chunks (param16 and grad of `chunk_size` bytes each; master32,
// exp_avg and exp_avg_sq of twice that):
//   forward   c = 0..N-1:  read param16
//   backward  c = N-1..0:  read param16, write grad
//   optimizer c = 0..N-1:  read grad, read-write master32 / exp_avg / exp_avg_sq, write param16
// Everything is initialized once (not timed); the first iteration records the trace; the
// following `--iterations` are timed. The same trace runs with next-use eviction and with LRU
// (both with trace prefetch at `--lookahead`, and both again without prefetch, where the hit rates
// compare the eviction policies alone).
//
// Figures: achieved_gbps = bytes moved between host and NVMe / wall time of the timed iterations;
// nvme_raw_gbps = the NVMe tier's own sequential throughput (large blocks, closed loop, same aio
// settings, registered pinned buffers, best of two), measured in the same run: the better of
// reads and writes mixed serially in the trace's proportion and reads+writes at once; stall_fraction = time callers waited in Acquire / wall time.
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "runtime/base/host_info.h"
#include "runtime/base/logging.h"
#include "runtime/base/remove_tree.h"
#include "runtime/base/status.h"
#include "runtime/base/units.h"
#include "runtime/state/tier_manager.h"
#include "tiers/host/pinned_pool.h"
#include "tiers/nvme/nvme_tier.h"
#include "tools/swapbench/commands.h"
#include "tools/swapbench/scratch_files.h"

namespace strata::swapbench {
namespace {

using Clock = std::chrono::steady_clock;

struct TiersArgs {
  std::string path;
  std::string chunks = "16";
  std::string chunk_size = "8MiB";
  std::string host_budget;    // default: a quarter of the total
  std::string device_budget;  // default: two chunks of param16
  std::string iterations = "2";
  std::string lookahead = "6";
  std::string block_size = "1MiB";
  std::string queue_depth = "32";
  std::string threads = "1";
  bool json = false;
  bool keep = false;
};

struct Settings {
  std::string dir;
  bool own_dir = false;
  uint32_t chunks = 0;
  uint64_t chunk = 0;
  uint64_t total = 0;
  uint64_t host_budget = 0;
  uint64_t device_budget = 0;
  int iterations = 0;
  int64_t lookahead = 0;
  AioConfig aio;
  bool keep = false;  // --keep: the tier leaves its swap file and index
};

StatusOr<int64_t> ParseInt(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || *end != '\0' || v < lo || v > hi)
    return InvalidArgument(StrCat(flag, "=", text, ": must be an integer in ", lo, "..", hi));
  return static_cast<int64_t>(v);
}

StatusOr<uint64_t> ParseSize(const std::string& flag, const std::string& text) {
  StatusOr<uint64_t> v = ParseBytes(text);
  if (!v.ok()) return InvalidArgument(StrCat(flag, "=", text, ": ", v.status().message()));
  return *v;
}

// O_DIRECT needs a real file system: tmpfs /tmp sends the default to /var/tmp.
std::string DefaultBase() {
  struct statfs fs {};
  constexpr long kTmpfsMagic = 0x01021994;
  if (statfs("/tmp", &fs) == 0 && static_cast<long>(fs.f_type) == kTmpfsMagic) return "/var/tmp";
  return "/tmp";
}

StatusOr<Settings> Validate(const TiersArgs& a) {
  Settings s;
  s.keep = a.keep;
  STRATA_ASSIGN_OR_RETURN(int64_t chunks, ParseInt("--chunks", a.chunks, 3, 1 << 20));
  s.chunks = static_cast<uint32_t>(chunks);
  STRATA_ASSIGN_OR_RETURN(s.chunk, ParseSize("--chunk-size", a.chunk_size));
  if (s.chunk < 4096) return InvalidArgument(StrCat("--chunk-size=", a.chunk_size, ": must be at least 4KiB"));
  s.total = 8 * s.chunk * s.chunks;  // param16 + grad + 2 × (master32, exp_avg, exp_avg_sq)
  // The optimizer step pins five blocks of one chunk at once (8 chunk sizes, in power-of-two
  // slots); prefetch needs room beyond that.
  uint64_t slot = 4096;
  while (slot < 2 * s.chunk) slot <<= 1;
  const uint64_t pinned = 4 * slot;
  if (a.host_budget.empty()) {
    // A quarter of the state, but never less than the step needs: few small chunks would
    // otherwise refuse the default itself.
    s.host_budget = std::max(s.total / 4, 2 * pinned);
  } else {
    STRATA_ASSIGN_OR_RETURN(s.host_budget, ParseSize("--host-budget", a.host_budget));
  }
  if (a.device_budget.empty()) {
    s.device_budget = 2 * s.chunk;
  } else {
    STRATA_ASSIGN_OR_RETURN(s.device_budget, ParseSize("--device-budget", a.device_budget));
  }
  if (s.host_budget < 2 * pinned)
    return InvalidArgument(StrCat("--host-budget=", FormatBytes(s.host_budget),
                                  ": the optimizer step pins ", FormatBytes(pinned),
                                  " at once; give at least ", FormatBytes(2 * pinned),
                                  s.chunk > 4096 ? " or lower --chunk-size" : ""));
  if (s.host_budget >= s.total && a.host_budget.empty())
    return InvalidArgument(
        StrCat("--chunks=", s.chunks, " of ", FormatBytes(s.chunk), ": the default --host-budget (",
               FormatBytes(s.host_budget), ", twice what the optimizer step pins) holds all ",
               FormatBytes(s.total), " of state, so nothing would go to NVMe; raise --chunks"));
  if (s.host_budget >= s.total)
    return InvalidArgument(StrCat("--host-budget=", FormatBytes(s.host_budget), " holds all ",
                                  FormatBytes(s.total), " of state: nothing would go to NVMe; lower it or "
                                  "raise --chunks"));
  if (s.device_budget >= s.chunk * s.chunks)
    return InvalidArgument(StrCat("--device-budget=", FormatBytes(s.device_budget),
                                  " holds every param16 chunk; the trace is meant to exceed it"));
  STRATA_ASSIGN_OR_RETURN(int64_t it, ParseInt("--iterations", a.iterations, 1, 1000));
  s.iterations = static_cast<int>(it);
  STRATA_ASSIGN_OR_RETURN(s.lookahead, ParseInt("--lookahead", a.lookahead, 0, 1 << 20));
  STRATA_ASSIGN_OR_RETURN(uint64_t bs, ParseSize("--block-size", a.block_size));
  s.aio.block_size = static_cast<int64_t>(bs);
  STRATA_ASSIGN_OR_RETURN(s.aio.queue_depth, ParseInt("--queue-depth", a.queue_depth, 1, 4096));
  STRATA_ASSIGN_OR_RETURN(s.aio.intra_op_parallelism, ParseInt("--threads", a.threads, 1, 64));
  STRATA_RETURN_IF_ERROR(nvme::ValidateAioConfig(s.aio));
  if (a.path.empty()) {
    std::string tmpl = DefaultBase() + "/strata-swapbench-tiers-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) return ErrnoToStatus(errno, StrCat("creating ", tmpl));
    s.dir = tmpl;
    s.own_dir = true;
  } else {
    std::error_code ec;
    if (!std::filesystem::is_directory(a.path, ec))
      return InvalidArgument(StrCat("--path=", a.path, ": not an existing directory; create it first"));
    s.dir = a.path;
  }
  return s;
}

struct RawResult {
  double read_gbps = 0;
  double write_gbps = 0;
  double concurrent_gbps = 0;  // reads and writes at once (half the slots each)
};

// Closed-loop sequential throughput of the NVMe tier: one request of `region` bytes in flight per
// buffer, each resubmitted from its completion until its share of `regions` was transferred.
// Slots below `first_write_slot` read, the others write; the result is bytes / wall time.
StatusOr<double> RawPhase(nvme::NvmeTier& tier, const std::vector<void*>& bufs, const std::vector<TierRegion>& regions,
                          size_t first_write_slot) {
  std::mutex mu;
  std::condition_variable cv;
  const size_t nr = first_write_slot == 0 ? 0 : (first_write_slot >= bufs.size() ? regions.size() : regions.size() / 2);
  size_t next_read = 0, next_write = nr;
  size_t done = 0;
  Status first;
  std::function<void(size_t)> submit = [&](size_t slot) {
    const bool write = slot >= first_write_slot;
    size_t idx;
    {
      std::lock_guard<std::mutex> l(mu);
      size_t& next = write ? next_write : next_read;
      if (next >= (write ? regions.size() : nr)) return;
      idx = next++;
    }
    // Resubmit first, count last: once `done` reaches the total the waiting thread may leave and
    // destroy everything this lambda refers to, so nothing is touched after the unlock.
    auto cb = [&, slot](Status s) {
      submit(slot);
      std::lock_guard<std::mutex> l(mu);
      if (!s.ok() && first.ok()) first = s;
      ++done;
      cv.notify_all();
    };
    if (write) {
      tier.WriteAsync(regions[idx], bufs[slot], cb);
    } else {
      tier.ReadAsync(regions[idx], bufs[slot], cb);
    }
  };
  const auto t0 = Clock::now();
  for (size_t slot = 0; slot < bufs.size(); ++slot) submit(slot);
  {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return done == regions.size(); });
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  STRATA_RETURN_IF_ERROR(first);
  return static_cast<double>(regions[0].size) * static_cast<double>(regions.size()) / secs / 1e9;
}

// Best of `reps` for writes, reads, and both at once (the machine is noisy; the best run is the
// hardest reference to meet).
StatusOr<RawResult> MeasureRaw(nvme::NvmeTier& tier, const std::vector<void*>& bufs, uint64_t region, int count,
                               int reps) {
  std::vector<TierRegion> regions;
  for (int i = 0; i < count; ++i) {
    STRATA_ASSIGN_OR_RETURN(TierRegion r, tier.Allocate(region));
    regions.push_back(r);
  }
  for (size_t i = 0; i < bufs.size(); ++i) std::memset(bufs[i], static_cast<int>(i + 1), region);
  RawResult out;
  for (int r = 0; r < reps; ++r) {
    STRATA_ASSIGN_OR_RETURN(double w, RawPhase(tier, bufs, regions, 0));
    STRATA_ASSIGN_OR_RETURN(double rd, RawPhase(tier, bufs, regions, bufs.size()));
    STRATA_ASSIGN_OR_RETURN(double both, RawPhase(tier, bufs, regions, bufs.size() / 2));
    out.write_gbps = std::max(out.write_gbps, w);
    out.read_gbps = std::max(out.read_gbps, rd);
    out.concurrent_gbps = std::max(out.concurrent_gbps, both);
  }
  for (auto& r : regions) STRATA_RETURN_IF_ERROR(tier.Free(r));
  return out;
}

// Touch a block as compute would: one word per page, so the bytes are really used without the
// benchmark measuring memset.
uint64_t TouchRead(const void* p, uint64_t n) {
  uint64_t sum = 0;
  for (uint64_t off = 0; off + 8 <= n; off += 4096) {
    uint64_t w;
    std::memcpy(&w, static_cast<const char*>(p) + off, 8);
    sum += w;
  }
  return sum;
}

void TouchWrite(void* p, uint64_t n, uint64_t v) {
  for (uint64_t off = 0; off + 8 <= n; off += 4096) std::memcpy(static_cast<char*>(p) + off, &v, 8);
}

struct RunResult {
  std::string policy;
  int64_t lookahead = 0;
  double seconds = 0;
  uint64_t bytes_read = 0;     // NVMe -> host in the timed iterations
  uint64_t bytes_written = 0;  // host -> NVMe in the timed iterations
  double achieved_gbps = 0;
  double stall_fraction = 0;
  double hit_rate = 0;
  uint64_t acquires = 0;
  std::string engine;
  bool fixed_buffers = false;
  RawResult raw;
  nlohmann::json manager_stats;
};

// One step's block traffic of a model of s.chunks chunks, through the tier manager as the engine
// makes it: forward reads each param16, backward reads it again and writes the gradient in
// reverse order, the optimizer reads the gradient and updates master, moments and param16.
// The touches read and write every byte, so the copies really happen.
class TraceWorkload {
 public:
  TraceWorkload(TierManager* m, const Settings& s) : m_(m), s_(s) {}

  // Every block written once, then flushed (the initial state; not timed).
  Status WriteAll() {
    for (uint32_t c = 0; c < s_.chunks; ++c)
      for (StateKind k : {StateKind::kParam16, StateKind::kMaster32, StateKind::kExpAvg, StateKind::kExpAvgSq})
        STRATA_RETURN_IF_ERROR(One({c, k}, Access::kWrite));
    return m_->Flush();
  }

  Status Iteration() {
    STRATA_RETURN_IF_ERROR(m_->BeginIteration());
    for (uint32_t c = 0; c < s_.chunks; ++c) STRATA_RETURN_IF_ERROR(One({c, StateKind::kParam16}, Access::kRead));
    for (uint32_t c = s_.chunks; c-- > 0;) {
      STRATA_RETURN_IF_ERROR(Use({c, StateKind::kParam16}, Access::kRead));
      STRATA_RETURN_IF_ERROR(Use({c, StateKind::kGrad}, Access::kWrite));
      STRATA_RETURN_IF_ERROR(Release({c, StateKind::kGrad}, Access::kWrite));
      STRATA_RETURN_IF_ERROR(Release({c, StateKind::kParam16}, Access::kRead));
    }
    const std::pair<StateKind, Access> step[] = {{StateKind::kGrad, Access::kRead},
                                                 {StateKind::kMaster32, Access::kReadWrite},
                                                 {StateKind::kExpAvg, Access::kReadWrite},
                                                 {StateKind::kExpAvgSq, Access::kReadWrite},
                                                 {StateKind::kParam16, Access::kWrite}};
    for (uint32_t c = 0; c < s_.chunks; ++c) {
      for (auto& [k, a] : step) STRATA_RETURN_IF_ERROR(Use({c, k}, a));
      for (auto& [k, a] : step) STRATA_RETURN_IF_ERROR(Release({c, k}, a));
    }
    return m_->EndIteration();
  }

  uint64_t sink() const { return sink_; }

 private:
  uint64_t SizeOf(StateKind k) const {
    return k == StateKind::kParam16 || k == StateKind::kGrad ? s_.chunk : 2 * s_.chunk;
  }
  Status Use(BlockId id, Access a) {
    STRATA_ASSIGN_OR_RETURN(void* p, m_->Acquire(id, a));
    const uint64_t n = SizeOf(id.kind);
    if (a != Access::kWrite) sink_ += TouchRead(p, n);
    if (a != Access::kRead) TouchWrite(p, n, sink_ + id.key());
    return Status::Ok();
  }
  Status Release(BlockId id, Access a) { return m_->Release(id, a != Access::kRead); }
  Status One(BlockId id, Access a) {
    STRATA_RETURN_IF_ERROR(Use(id, a));
    return Release(id, a);
  }

  TierManager* m_;
  const Settings& s_;
  uint64_t sink_ = 0;
};

StatusOr<RunResult> RunTrace(const Settings& s, EvictionPolicy policy, int64_t lookahead, bool measure_raw) {
  const uint64_t raw_region = std::max<uint64_t>(2 * s.chunk, 8_MiB);
  const int raw_depth = 8;
  const int raw_count = static_cast<int>(std::max<uint64_t>(16, std::min<uint64_t>(64, (512_MiB) / raw_region)));
  nvme::NvmeTierOptions no;
  no.paths = {s.dir};
  no.capacity = s.total + (measure_raw ? raw_region * raw_count : 0) + 64_MiB;
  no.aio = s.aio;
  no.remove_on_close = !s.keep;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<nvme::NvmeTier> tier, nvme::NvmeTier::Create(no));

  TierManagerOptions mo;
  mo.host_budget = s.host_budget;
  mo.eviction = policy;
  mo.prefetch_lookahead = lookahead;
  mo.acquire_timeout = std::chrono::seconds(120);  // a bench must not hang
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<TierManager> m, TierManager::Create(mo, tier.get()));

  // The raw measurement's buffers come from a pinned pool of their own; both pools are
  // registered with the engine in one call (io_uring takes one registration per ring).
  std::unique_ptr<PinnedPool> raw_pool;
  std::vector<void*> raw_bufs;
  std::vector<iovec> ranges = m->host_pool().IoRanges();
  if (measure_raw) {
    PinnedPoolOptions po;
    po.budget = raw_region * raw_depth;
    STRATA_ASSIGN_OR_RETURN(raw_pool, PinnedPool::Create(po));
    for (int i = 0; i < raw_depth; ++i) {
      STRATA_ASSIGN_OR_RETURN(PinnedBlock b, raw_pool->Allocate(raw_region));
      raw_bufs.push_back(b.ptr);
    }
    for (const iovec& v : raw_pool->IoRanges()) ranges.push_back(v);
  }
  Status reg = tier->store().RegisterBuffers(ranges);
  if (!reg.ok()) STRATA_LOG(WARN) << "tiers bench: " << reg.ToString();

  RunResult out;
  out.policy = policy == EvictionPolicy::kNextUse ? "next_use" : "lru";
  out.lookahead = lookahead;
  if (measure_raw) {
    STRATA_ASSIGN_OR_RETURN(out.raw, MeasureRaw(*tier, raw_bufs, raw_region, raw_count, 2));
  }

  const uint64_t c1 = s.chunk, c2 = 2 * s.chunk;
  for (uint32_t c = 0; c < s.chunks; ++c) {
    STRATA_RETURN_IF_ERROR(m->Register({c, StateKind::kParam16}, c1, BlockHome::kNvme));
    STRATA_RETURN_IF_ERROR(m->Register({c, StateKind::kGrad}, c1, BlockHome::kNvme));
    STRATA_RETURN_IF_ERROR(m->Register({c, StateKind::kMaster32}, c2, BlockHome::kNvme));
    STRATA_RETURN_IF_ERROR(m->Register({c, StateKind::kExpAvg}, c2, BlockHome::kNvme));
    STRATA_RETURN_IF_ERROR(m->Register({c, StateKind::kExpAvgSq}, c2, BlockHome::kNvme));
  }
  TraceWorkload work(m.get(), s);
  STRATA_RETURN_IF_ERROR(work.WriteAll());
  STRATA_RETURN_IF_ERROR(work.Iteration());  // records the trace
  const TierManagerStats before = m->stats();
  const auto t0 = Clock::now();
  for (int i = 0; i < s.iterations; ++i) STRATA_RETURN_IF_ERROR(work.Iteration());
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  const TierManagerStats after = m->stats();
  out.bytes_read = after.bytes_nvme_to_host - before.bytes_nvme_to_host;
  out.bytes_written = after.bytes_host_to_nvme - before.bytes_host_to_nvme;
  out.achieved_gbps = static_cast<double>(out.bytes_read + out.bytes_written) / out.seconds / 1e9;
  out.stall_fraction = (after.stall_seconds - before.stall_seconds) / out.seconds;
  out.acquires = after.acquires - before.acquires;
  const uint64_t hits = after.host_hits - before.host_hits;
  out.hit_rate = out.acquires == 0 ? 0 : static_cast<double>(hits) / static_cast<double>(out.acquires);
  out.manager_stats = m->StatsJson();
  const auto st = tier->store().stats();
  out.engine = st.engine;
  out.fixed_buffers = st.io.fixed_buffers;
  if (work.sink() == 42) std::cerr << "";  // keeps the touches observable
  m.reset();
  return out;
}

int RunTiers(const TiersArgs& args) {
  auto settings = Validate(args);
  if (!settings.ok()) {
    std::cerr << "strata-swapbench tiers: " << settings.status().message()
              << "\nRun `strata-swapbench tiers --help` for the options.\n";
    return 2;
  }
  const Settings& s = *settings;
  if (!args.keep) {
    RemoveOnInterrupt(s.dir + "/strata-rank0.swap");
    RemoveOnInterrupt(s.dir + "/strata-rank0.index");
    if (s.own_dir) RemoveOnInterrupt(s.dir, /*is_dir=*/true);
  }
  auto cleanup = [&] {
    std::error_code ec;
    if (s.own_dir && !args.keep) {
      RemoveTree(s.dir).IgnoreError();
    } else if (!args.keep) {
      std::filesystem::remove(s.dir + "/strata-rank0.swap", ec);
      std::filesystem::remove(s.dir + "/strata-rank0.index", ec);
    }
  };
  struct Case {
    EvictionPolicy policy;
    int64_t lookahead;
  };
  const Case cases[] = {{EvictionPolicy::kNextUse, s.lookahead},
                        {EvictionPolicy::kLru, s.lookahead},
                        {EvictionPolicy::kNextUse, 0},
                        {EvictionPolicy::kLru, 0}};
  std::vector<RunResult> results;
  for (const Case& c : cases) {
    auto r = RunTrace(s, c.policy, c.lookahead, /*measure_raw=*/results.empty());
    if (!r.ok()) {
      std::cerr << "strata-swapbench tiers: " << r.status() << "\n";
      cleanup();
      return 1;
    }
    results.push_back(std::move(r).value());
    if (args.json) {  // stdout is the JSON object; progress goes to stderr
      std::cerr << "strata-swapbench tiers: case " << results.size() << " of " << std::size(cases)
                << " (" << results.back().policy << ", lookahead " << c.lookahead << ") done\n";
    } else {
      const RunResult& x = results.back();
      std::cout << "policy=" << x.policy << " lookahead=" << x.lookahead << ": " << x.achieved_gbps
                << " GB/s moved (" << FormatBytes(x.bytes_read) << " read, " << FormatBytes(x.bytes_written)
                << " written in " << x.seconds << " s), hit rate " << x.hit_rate << ", stall fraction "
                << x.stall_fraction << "\n";
    }
  }
  cleanup();
  const RunResult& main = results[0];
  // Raw throughput mixed in the trace's proportion of reads and writes.
  const double rb = static_cast<double>(main.bytes_read), wb = static_cast<double>(main.bytes_written);
  const double raw_serial = (rb + wb) / (rb / (main.raw.read_gbps * 1e9) + wb / (main.raw.write_gbps * 1e9)) / 1e9;
  // The reference is the better of: reads and writes one after the other in the trace's
  // proportion, or both at once (separate rings let the device overlap them).
  const double raw_mixed = std::max(raw_serial, main.raw.concurrent_gbps);
  const double ratio = main.achieved_gbps / raw_mixed;
  if (args.json) {
    nlohmann::json j;
    j["command"] = "tiers";
    j["host"] = HostDescription(s.dir);
    j["path"] = s.dir;
    j["engine"] = main.engine;
    j["fixed_buffers"] = main.fixed_buffers;
    j["chunks"] = s.chunks;
    j["chunk_size"] = s.chunk;
    j["total_bytes"] = s.total;
    j["host_budget"] = s.host_budget;
    j["device_budget"] = s.device_budget;
    j["param_working_set_bytes"] = s.chunk * s.chunks;
    j["iterations_timed"] = s.iterations;
    j["lookahead"] = s.lookahead;
    j["aio"] = {{"block_size", s.aio.block_size},
                {"queue_depth", s.aio.queue_depth},
                {"intra_op_parallelism", s.aio.intra_op_parallelism}};
    j["achieved_gbps"] = main.achieved_gbps;
    j["nvme_raw_gbps"] = raw_mixed;
    j["nvme_raw_read_gbps"] = main.raw.read_gbps;
    j["nvme_raw_write_gbps"] = main.raw.write_gbps;
    j["nvme_raw_concurrent_gbps"] = main.raw.concurrent_gbps;
    j["nvme_raw_serial_mix_gbps"] = raw_serial;
    j["achieved_over_raw"] = ratio;
    j["stall_fraction"] = main.stall_fraction;
    j["seconds"] = main.seconds;
    j["bytes_read"] = main.bytes_read;
    j["bytes_written"] = main.bytes_written;
    j["next_use_hit_rate"] = results[0].hit_rate;
    j["lru_hit_rate"] = results[1].hit_rate;
    j["lru_achieved_gbps"] = results[1].achieved_gbps;
    j["lru_stall_fraction"] = results[1].stall_fraction;
    j["next_use_hit_rate_no_prefetch"] = results[2].hit_rate;
    j["lru_hit_rate_no_prefetch"] = results[3].hit_rate;
    j["tier_manager"] = main.manager_stats;
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << "on " << HostDescription(s.dir) << "\n";
    std::cout << "nvme raw: read " << main.raw.read_gbps << " GB/s, write " << main.raw.write_gbps
              << " GB/s, both at once " << main.raw.concurrent_gbps << " GB/s; reference " << raw_mixed
              << " GB/s\n"
              << "achieved / raw = " << ratio << " (target >= 0.8); hit rate next-use " << results[0].hit_rate
              << " vs LRU " << results[1].hit_rate << " (without prefetch " << results[2].hit_rate << " vs "
              << results[3].hit_rate << ")\n";
  }
  return 0;
}

}  // namespace

void RegisterTiersCommand(CLI::App& app, int* exit_code) {
  auto args = std::make_shared<TiersArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tiers",
      "Tier manager on a forward/backward/optimizer-shaped trace over the real NVMe tier: bytes "
      "moved per second vs the tier's raw sequential throughput in the same run, stall fraction, "
      "and hit rates with next-use and LRU eviction.");
  cmd->add_option("--path", args->path,
                  "Directory for the swap file (a real file system; default: a temporary directory under "
                  "/tmp, or /var/tmp when /tmp is tmpfs)");
  cmd->add_option("--chunks", args->chunks, "Chunks in the model (default 16, at least 3)");
  cmd->add_option("--chunk-size", args->chunk_size,
                  "param16 bytes per chunk; grad is the same, master32/exp_avg/exp_avg_sq twice (default 8MiB)");
  cmd->add_option("--host-budget", args->host_budget,
                  "Pinned host pool (default: a quarter of all state, at least twice what the "
                  "optimizer step pins)");
  cmd->add_option("--device-budget", args->device_budget,
                  "Device budget the trace's param working set exceeds (reported; default two chunks)");
  cmd->add_option("--iterations", args->iterations, "Timed iterations after the recording one (default 2)");
  cmd->add_option("--lookahead", args->lookahead, "Prefetch lookahead in trace entries (default 6)");
  cmd->add_option("--block-size", args->block_size, "aio.block_size for the NVMe tier (default 1MiB)");
  cmd->add_option("--queue-depth", args->queue_depth, "aio.queue_depth (default 32)");
  cmd->add_option("--threads", args->threads, "aio.intra_op_parallelism (default 1)");
  cmd->add_flag("--json", args->json, "Print one JSON object");
  cmd->add_flag("--keep", args->keep, "Keep the swap file");
  cmd->callback([args, exit_code] { *exit_code = RunTiers(*args); });
}

}  // namespace strata::swapbench
