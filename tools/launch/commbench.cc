// strata-commbench: all_gather and reduce_scatter throughput of one communicator backend.
// Run under a launcher: strata-launch --nproc 2 -- strata-commbench --bytes 64MiB
// Reports, per collective, the algorithm bandwidth (full-buffer bytes / time) and the bus
// bandwidth (algbw · (N-1)/N, the bytes each rank actually moves, as nccl-tests count them).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/base/check.h"
#include "runtime/base/host_info.h"
#include "runtime/base/units.h"
#include "runtime/comm/backends.h"
#include "runtime/state/checkpoint.h"

namespace {

using strata::Status;

struct Result {
  double seconds = 0;  // best of the timed iterations
  double mean_seconds = 0;
};

template <typename F>
strata::StatusOr<Result> Time(strata::Communicator& comm, int warmup, int iters, F&& op) {
  for (int i = 0; i < warmup; ++i) STRATA_RETURN_IF_ERROR(op());
  Result res;
  res.seconds = 1e30;
  double total = 0;
  for (int i = 0; i < iters; ++i) {
    STRATA_RETURN_IF_ERROR(comm.Barrier());
    const auto t0 = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(op());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The slowest rank defines the collective's time.
    double worst = s;
    STRATA_RETURN_IF_ERROR(comm.AllReduce(&worst, 1, strata::DType::kF64, strata::ReduceOp::kMax));
    res.seconds = std::min(res.seconds, worst);
    total += worst;
  }
  res.mean_seconds = total / iters;
  return res;
}

// Adds {"comm": {...}} to the profile strata-tune reads (tools/planner/profile.h), creating the
// file when it does not exist; other sections are kept. Written atomically (temporary + rename).
// The profile as it stands (an empty object when the file does not exist yet), read before the
// benchmark runs so that a bad path costs no measurement. Only a profile is taken: every one
// strata-swapbench or strata-commbench writes has "version", and a training config has not, so
// a config given by mistake is refused instead of gaining a "comm" section.
strata::StatusOr<nlohmann::json> ReadProfile(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    return strata::InvalidArgument(
        strata::StrCat("--profile ", path, ": a directory; pass a profile file"));
  auto text = strata::checkpoint::ReadFile(path);
  if (!text.ok()) {
    if (text.status().code() == strata::StatusCode::kNotFound) return nlohmann::json::object();
    return text.status();
  }
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return strata::InvalidArgument(strata::StrCat("--profile ", path, ": not a JSON object; ",
                                                  "pass a strata-swapbench profile or a new path"));
  if (!j.contains("version"))
    return strata::InvalidArgument(strata::StrCat(
        "--profile ", path,
        ": a JSON object without \"version\", so no strata-swapbench profile (a training "
        "config?); pass a profile or a new path"));
  return j;
}

Status WriteToProfile(const std::string& path, const std::string& backend, int world,
                      double busbw) {
  STRATA_ASSIGN_OR_RETURN(nlohmann::json j, ReadProfile(path));
  if (!j.contains("version")) j["version"] = 1;
  j["comm"] = {{"backend", backend}, {"world_size", world}, {"busbw_gbps", busbw}};
  return strata::checkpoint::WriteFileAtomic(path, j.dump(2) + "\n");
}

Status Run(const std::string& bytes_text, int iters, int warmup, const std::string& backend,
           double timeout_s, int64_t bucket, const std::string& profile) {
  STRATA_ASSIGN_OR_RETURN(uint64_t bytes, strata::ParseBytes(bytes_text));
  // One fp32 element per rank at the least; below that the collective moves rounding, not data.
  if (bytes < 4 || bytes > (uint64_t{1} << 40))
    return strata::InvalidArgument(strata::StrCat("--bytes=", bytes_text, ": must be 4 B .. 1 TiB"));
  if (bucket < 0)
    return strata::InvalidArgument(strata::StrCat("--bucket=", bucket, ": must be >= 0 elements (0: the default)"));
  if (!profile.empty()) STRATA_RETURN_IF_ERROR(ReadProfile(profile).status());
  strata::CommOptions opts;
  opts.backend = backend;
  opts.timeout_s = timeout_s;
  if (bucket > 0) opts.buckets = {bucket, bucket};
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::Communicator> comm,
                          strata::CreateCommunicator(opts));
  STRATA_CHECK(comm->memory_kind() == strata::MemoryKind::kHost, "strata-commbench measures host ",
               "backends (gloo, single); backend=", comm->backend(), " uses device memory");
  const int n = comm->world_size();
  if (n == 1 && !profile.empty())
    return strata::InvalidArgument("--profile needs a bandwidth between ranks: run under "
                                   "`strata-launch --nproc N -- strata-commbench --profile ...`");
  const int64_t shard = std::max<int64_t>(1, static_cast<int64_t>(bytes / 4) / n);
  // The full buffer and this rank's part, on every rank of this host: refused before they are
  // allocated (std::bad_alloc would abort).
  const uint64_t need = static_cast<uint64_t>(shard) * 4 * (n + 1) * n;
  const uint64_t available = strata::ReadHostMemory().available_bytes;
  if (available > 0 && need > available / 10 * 9)
    return strata::InvalidArgument(strata::StrCat(
        "--bytes=", bytes_text, ": ", n, " rank(s) here would hold ", strata::FormatBytes(need),
        " of buffers, more than the ", strata::FormatBytes(available),
        " this host has available; give a "
        "smaller --bytes"));
  std::vector<float> full(static_cast<size_t>(shard) * n, 1.0f);
  std::vector<float> part(static_cast<size_t>(shard), 1.0f);
  const double full_bytes = static_cast<double>(full.size()) * 4;

  STRATA_ASSIGN_OR_RETURN(Result ag, Time(*comm, warmup, iters, [&] {
                            return comm->AllGather(part.data(), full.data(), shard,
                                                   strata::DType::kF32);
                          }));
  STRATA_ASSIGN_OR_RETURN(Result rs, Time(*comm, warmup, iters, [&] {
                            return comm->ReduceScatter(full.data(), part.data(), shard,
                                                       strata::DType::kF32, strata::ReduceOp::kAvg);
                          }));
  // Same-run reference: one memcpy of the full buffer (the DRAM cost of any copy a transport makes).
  std::vector<float> copy(full.size());
  double memcpy_s = 1e30;
  for (int i = 0; i < iters + 1; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(copy.data(), full.data(), full.size() * 4);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i > 0) memcpy_s = std::min(memcpy_s, s);
  }
  if (comm->rank() == 0) {
    // A bandwidth means little without its machine: name it (CPU model, ISA, cores).
    const std::string host = strata::HostDescription();
    std::fprintf(stderr, "strata-commbench: %d ranks of %s on %s\n", n, std::string(comm->backend()).c_str(),
                 host.c_str());
    const double memcpy_gbps = full_bytes / memcpy_s / 1e9;
    const double factor = n > 1 ? static_cast<double>(n - 1) / n : 1.0;
    for (auto [name, r] : {std::pair{"all_gather", ag}, std::pair{"reduce_scatter", rs}}) {
      const double algbw = full_bytes / r.seconds / 1e9;
      std::printf(
          "{\"op\":\"%s\",\"backend\":\"%s\",\"world_size\":%d,\"bytes\":%.0f,\"iters\":%d,"
          "\"best_s\":%.6f,\"mean_s\":%.6f,\"algbw_gbps\":%.3f,\"busbw_gbps\":%.3f,"
          "\"memcpy_gbps\":%.3f,\"algbw_over_memcpy\":%.3f,\"host\":%s}\n",
          name, std::string(comm->backend()).c_str(), n, full_bytes, iters, r.seconds,
          r.mean_seconds, algbw, algbw * factor, memcpy_gbps, algbw / memcpy_gbps,
          nlohmann::json(host).dump().c_str());
    }
    if (!profile.empty()) {
      // The engine runs both collectives every micro-step: the slower one is the figure to plan with.
      const double busbw = full_bytes / std::max(ag.seconds, rs.seconds) / 1e9 * factor;
      STRATA_RETURN_IF_ERROR(WriteToProfile(profile, std::string(comm->backend()), n, busbw));
      std::fprintf(stderr, "strata-commbench: wrote comm.busbw_gbps=%.3f (%d ranks) to %s\n", busbw, n,
                   profile.c_str());
    }
  }
  return comm->Barrier();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strata-commbench: all_gather / reduce_scatter throughput (run under strata-launch)"};
  std::string bytes = "64MiB";
  int iters = 5, warmup = 1;
  std::string backend = "auto";
  double timeout_s = 120;
  int64_t bucket = 0;
  std::string profile;
  app.add_option("--bytes", bytes, "size of the full (gathered) fp32 buffer, e.g. 64MiB");
  app.add_option("--iters", iters, "timed iterations")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", warmup, "untimed iterations first")->check(CLI::Range(0, 1000));
  app.add_option("--backend", backend, "auto | single | gloo");
  app.add_option("--timeout", timeout_s, "strata.comm_timeout_s");
  app.add_option("--bucket", bucket, "bucket size in elements (0: DeepSpeed's 5e8 default)");
  app.add_option("--profile", profile,
                 "add the measured bus bandwidth as \"comm\" to this profile JSON (strata-tune reads it "
                 "for --world-size > 1); created when missing");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Help exits 0; a bad flag is a bad argument, 2, as in every Strata tool (CLI11's own codes
    // differ by error kind).
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  const Status s = Run(bytes, iters, warmup, backend, timeout_s, bucket, profile);
  if (!s.ok()) {
    std::fprintf(stderr, "strata-commbench: %s\n", s.ToString().c_str());
    return s.code() == strata::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
