// HostInfo: what machine a figure was measured on. Every benchmark prints it beside its numbers,
// because machines differ from one session to the next (an AVX2-only Zen 3 one week, an
// AVX-512 BF16 Zen 4 the next) and a figure without its machine cannot be compared.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace strata {

struct HostInfo {
  std::string cpu_model;   // /proc/cpuinfo "model name", e.g. "AMD EPYC 9354P 32-Core Processor"
  std::string isa;         // the widest vector ISA the CPU and OS offer: "avx512_bf16", "avx512",
                           // "avx2" or "sse"
  bool native_bf16 = false;  // bf16 dot-product instructions (AVX512_BF16 or AMX-BF16)
  int cores = 0;           // online logical CPUs
};

// Reads the running machine (cpuid and /proc; never fails: unknown fields stay empty).
// STRATA_CPU_BF16=0 (or 1) overrides native_bf16, to try the other kind of CPU's choices.
HostInfo ReadHostInfo();

// Physical cores (hwloc's HWLOC_OBJ_CORE; the online CPU count when hwloc cannot tell). The
// optimizer's thread arena is at most this wide: SMT siblings share the core's load ports, which
// a streaming kernel already saturates.
int PhysicalCoreCount();

// The optimizer arena's width: `configured` when > 0 (strata.optimizer_threads); when the
// updates run beside compute, the physical cores LibTorch's `compute_threads` leave, at least 1;
// otherwise every physical core. `why` (optional) gets the reason, for the log.
int ChooseOptimizerThreads(int physical_cores, int compute_threads, int configured,
                           bool beside_compute, std::string* why = nullptr);

// The host's memory from /proc/meminfo: MemTotal and MemAvailable (what the kernel can hand out
// without swapping), in bytes; 0 where the file or the field is missing.
struct HostMemory {
  uint64_t total_bytes = 0;
  uint64_t available_bytes = 0;
};
HostMemory ReadHostMemory();

// Bytes free to an unprivileged writer on the filesystem holding `path` (its nearest existing
// ancestor when it does not exist yet); 0 when it cannot be read. A file system that reports no
// size at all (ramfs; tmpfs mounted with size=0) keeps its files in memory without a limit of
// its own, so what it has free is the host's available memory (ReadHostMemory).
uint64_t FreeDiskBytes(const std::string& path);

// `paths` grouped by the file system they lie on (st_dev), in the order of each group's first
// path: striped nvme paths on one file system draw on its free space together. A path that
// cannot be stat'ed is a group of its own, with `known` false.
struct FileSystemPaths {
  uint64_t device = 0;
  bool known = false;
  std::vector<std::string> paths;
};
std::vector<FileSystemPaths> GroupByFileSystem(const std::vector<std::string>& paths);

// The free disk a state striped over `paths` can fill, so that the engine's placement auto and
// the estimator's plan budget the same. Each of the n paths holds 1/n of the state, so a file
// system with k of them takes k/n of it: the state fits while it is at most n x (free + given
// back) / k on every file system, and the tightest one bounds it. `given_back(path)`: bytes on
// the file system of `path` that come back during the engine's start (a staging file); none
// when empty. No paths: zero.
struct StripedDisk {
  uint64_t free = 0;
  uint64_t given_back = 0;
};
StripedDisk StripedFreeDisk(const std::vector<std::string>& paths,
                            const std::function<uint64_t(const std::string&)>& given_back = {});

// ReadHostInfo().native_bf16: whether bf16 matmuls run at full speed on this CPU.
bool CpuHasNativeBf16();

// "AMD EPYC 9354P (avx512_bf16), 2 cores". With a path, also the block device holding it and
// its model when the kernel names one: "...; disk vda (Virtio) for /tmp/x".
std::string HostDescription(const std::string& path = "");

}  // namespace strata
