#include "runtime/base/host_info.h"
#include "runtime/base/env_vars.h"

#include <algorithm>

#include <hwloc.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

#include "runtime/base/cpu_features.h"
#include "runtime/base/logging.h"

namespace strata {
namespace {

std::string Trim(std::string s) {
  const auto b = s.find_first_not_of(" \t\n");
  const auto e = s.find_last_not_of(" \t\n");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

std::string ReadFirstLine(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return Trim(line);
}

// The block device (whole disk, not the partition) that holds `path`, with its model.
std::string DiskOf(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return "unknown disk";
  const std::string sys = "/sys/dev/block/" + std::to_string(major(st.st_dev)) + ":" +
                          std::to_string(minor(st.st_dev));
  char buf[4096];
  const ssize_t len = readlink(sys.c_str(), buf, sizeof(buf) - 1);
  if (len <= 0) return "no block device (" + std::to_string(major(st.st_dev)) + ":" +
                       std::to_string(minor(st.st_dev)) + ", e.g. tmpfs or overlay)";
  std::string target(buf, static_cast<size_t>(len));
  std::string name = target.substr(target.rfind('/') + 1);
  // A partition's parent directory is the disk.
  std::string disk = name;
  if (std::ifstream(sys + "/partition").good()) {
    std::string parent = target.substr(0, target.rfind('/'));
    disk = parent.substr(parent.rfind('/') + 1);
  }
  std::string model = ReadFirstLine("/sys/block/" + disk + "/device/model");
  const std::string rot = ReadFirstLine("/sys/block/" + disk + "/queue/rotational");
  std::string out = name;
  if (!model.empty()) out += " (" + model + ")";
  if (rot == "1") out += ", rotational";
  return out;
}

}  // namespace

HostInfo ReadHostInfo() {
  HostInfo h;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0) {
      h.cpu_model = Trim(line.substr(line.find(':') + 1));
      break;
    }
  }
  // CPUs with AMX-BF16 also report AVX512_BF16.
  h.native_bf16 = Cpu().avx512_bf16;
  if (const char* o = GetEnv(kEnvCpuBf16); o && *o != '\0') {
    if ((o[0] == '0' || o[0] == '1') && o[1] == '\0') {
      h.native_bf16 = o[0] == '1';
    } else {
      static std::once_flag warned;
      std::call_once(warned, [o] {
        STRATA_LOG(WARN) << kEnvCpuBf16.name << "=" << o
                         << ": expected 0 or 1; the CPU's own answer stands";
      });
    }
  }
  if (Cpu().avx512_bf16) {
    h.isa = "avx512_bf16";
  } else if (Cpu().avx512f) {
    h.isa = "avx512";
  } else if (Cpu().avx2) {
    h.isa = "avx2";
  } else {
    h.isa = "sse";
  }
  h.cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  return h;
}

int PhysicalCoreCount() {
  const int online = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return online;
  int cores = -1;
  if (hwloc_topology_load(topo) == 0) cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  hwloc_topology_destroy(topo);
  return cores > 0 ? cores : online;
}

int ChooseOptimizerThreads(int cores, int compute_threads, int configured, bool beside_compute,
                           std::string* why) {
  std::string reason;
  int n;
  if (configured > 0) {
    n = configured;
    reason = "strata.optimizer_threads";
  } else if (beside_compute) {
    n = std::max(1, cores - compute_threads);
    reason = "the " + std::to_string(cores) + " physical core(s) hwloc sees less LibTorch's " +
             std::to_string(compute_threads) + " compute thread(s), at least 1: updates overlap compute";
  } else {
    n = std::max(1, cores);
    reason = "one per physical core (hwloc sees " + std::to_string(cores) +
             "): updates run alone in Step";
  }
  if (why) *why = reason;
  return n;
}

std::vector<FileSystemPaths> GroupByFileSystem(const std::vector<std::string>& paths) {
  std::vector<FileSystemPaths> groups;
  for (const std::string& p : paths) {
    struct stat st {};
    const bool known = ::stat(p.c_str(), &st) == 0;
    const uint64_t device = known ? static_cast<uint64_t>(st.st_dev) : 0;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const FileSystemPaths& g) { return known && g.known && g.device == device; });
    if (it == groups.end()) it = groups.insert(groups.end(), FileSystemPaths{device, known, {}});
    it->paths.push_back(p);
  }
  return groups;
}

StripedDisk StripedFreeDisk(const std::vector<std::string>& paths,
                            const std::function<uint64_t(const std::string&)>& given_back) {
  StripedDisk tightest;
  const uint64_t n = paths.size();
  bool first = true;
  for (const FileSystemPaths& fs : GroupByFileSystem(paths)) {
    const uint64_t k = fs.paths.size();
    const StripedDisk here{n * FreeDiskBytes(fs.paths.front()) / k,
                           given_back ? n * given_back(fs.paths.front()) / k : 0};
    if (first || here.free + here.given_back < tightest.free + tightest.given_back) tightest = here;
    first = false;
  }
  return tightest;
}

uint64_t FreeDiskBytes(const std::string& path) {
  std::string at = path.empty() ? "." : path;
  struct statvfs st;
  while (::statvfs(at.c_str(), &st) != 0) {
    const size_t slash = at.find_last_of('/');
    if (slash == std::string::npos) at = ".";
    else if (slash == 0) at = "/";
    else at.resize(slash);
    if (at == "/" || at == ".") {
      if (::statvfs(at.c_str(), &st) != 0) return 0;
      break;
    }
  }
  if (st.f_blocks == 0) return ReadHostMemory().available_bytes;
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

HostMemory ReadHostMemory() {
  HostMemory m;
  std::ifstream f("/proc/meminfo");
  for (std::string line; std::getline(f, line);) {
    // "MemAvailable:   12345678 kB"
    auto field = [&](const char* key, uint64_t* out) {
      const size_t n = std::char_traits<char>::length(key);
      if (line.compare(0, n, key) == 0) *out = std::strtoull(line.c_str() + n, nullptr, 10) * 1024;
    };
    field("MemTotal:", &m.total_bytes);
    field("MemAvailable:", &m.available_bytes);
  }
  return m;
}

bool CpuHasNativeBf16() { return ReadHostInfo().native_bf16; }

std::string HostDescription(const std::string& path) {
  const HostInfo h = ReadHostInfo();
  std::ostringstream o;
  o << (h.cpu_model.empty() ? "unknown CPU" : h.cpu_model) << " (" << h.isa << "), " << h.cores
    << (h.cores == 1 ? " core" : " cores");
  if (!path.empty()) o << "; disk " << DiskOf(path) << " for " << path;
  return o.str();
}

}  // namespace strata
