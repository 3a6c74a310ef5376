// Every environment variable Strata reads, declared once. C++ reads them through GetEnv(kEnv...)
// (a raw std::getenv of a name is a review defect); the Python package, the pip build and the
// test harness read theirs by the names declared here too. tests/python/test_env_vars.py scans
// the source tree for every variable read and checks it is in this table, and that the README's
// "Environment variables" section lists each row; strata._strata.env_vars() gives the table to
// Python.
//
// Thread-safety: the table is constant; GetEnv is std::getenv (safe while nothing calls setenv).
#pragma once

#include <cstddef>

namespace strata {

struct EnvVar {
  const char* name;
  // Who reads it: "runtime" (the engine, any frontend), "strata-train", "launch" (the ranks'
  // rendezvous, as torchrun sets them), "python" (the strata package), "pip build", "tests",
  // "scripts" (tools/scripts and .ci/run).
  const char* reader;
  const char* meaning;  // values and effect, one sentence
};

// The runtime's own.
inline constexpr EnvVar kEnvLogLevel{"STRATA_LOG_LEVEL", "runtime",
                                     "debug, info (default), warn, error or off: the C++ log level"};
inline constexpr EnvVar kEnvCpuDevice{
    "STRATA_CPU_DEVICE", "runtime",
    "strict: the CPU device keeps its memory apart from the host's as a GPU would, so host code "
    "that touches device memory directly fails (the tests' setting); unset: plain"};
inline constexpr EnvVar kEnvCpuBf16{
    "STRATA_CPU_BF16", "runtime",
    "1 or 0: report the CPU as having (or not) native bf16, overriding the CPUID probe"};
inline constexpr EnvVar kEnvAdamIsa{
    "STRATA_ADAM_ISA", "runtime",
    "avx512_bf16, avx512, avx2 or scalar: the CPU Adam kernel to run instead of the best this "
    "CPU supports (one it cannot run is ignored with a warning)"};
inline constexpr EnvVar kEnvAdamPrefetch{
    "STRATA_ADAM_PREFETCH", "runtime",
    "1 or 0: software prefetch in the AVX-512 Adam kernel (default: on, off on AMD family 19h)"};
inline constexpr EnvVar kEnvNvmePlainRing{
    "STRATA_NVME_PLAIN_RING", "runtime",
    "1: io_uring rings without SINGLE_ISSUER/DEFER_TASKRUN, for comparisons"};
inline constexpr EnvVar kEnvNativeBacktrace{
    "STRATA_NATIVE_BACKTRACE", "python",
    "1: the Python module prints a native backtrace on SIGSEGV, SIGABRT, SIGBUS and SIGFPE"};
inline constexpr EnvVar kEnvKeepOmpWait{
    "STRATA_KEEP_OMP_WAIT", "strata-train",
    "any value: strata-train does not restart itself with OMP_WAIT_POLICY=PASSIVE"};
inline constexpr EnvVar kEnvOmpWaitPolicy{
    "OMP_WAIT_POLICY", "strata-train",
    "OpenMP's; when unset strata-train sets PASSIVE and restarts itself (spinning OpenMP threads "
    "beside BLAS threads slow a 2-core step several times)"};
// The ranks' rendezvous, as torchrun and strata-launch set it.
inline constexpr EnvVar kEnvWorldSize{"WORLD_SIZE", "launch", "ranks in the job (default 1)"};
inline constexpr EnvVar kEnvRank{"RANK", "launch", "this rank, 0..WORLD_SIZE-1"};
inline constexpr EnvVar kEnvLocalRank{
    "LOCAL_RANK", "launch", "this rank on its node; picks the GPU (cuda:LOCAL_RANK)"};
inline constexpr EnvVar kEnvLocalWorldSize{"LOCAL_WORLD_SIZE", "launch", "ranks on this node"};
inline constexpr EnvVar kEnvMasterAddr{"MASTER_ADDR", "launch", "address of rank 0's store"};
inline constexpr EnvVar kEnvMasterPort{"MASTER_PORT", "launch",
                                       "port of rank 0's store (default 29500 for one rank)"};
inline constexpr EnvVar kEnvGlooSocketIfname{
    "GLOO_SOCKET_IFNAME", "launch", "the network interface Gloo's CPU collectives use"};
// The Python package's, the pip build's and the tests' (read in Python; declared here so that
// one table lists them all).
inline constexpr EnvVar kEnvRankCores{
    "STRATA_RANK_CORES", "python",
    "the launcher's per-rank CPU core lists (set by the deepspeed launcher for its ranks)"};
inline constexpr EnvVar kEnvDsEnvFile{
    "DS_ENV_FILE", "python",
    "DeepSpeed's file of KEY=VALUE lines the deepspeed launcher exports to every rank"};
inline constexpr EnvVar kEnvReplaceDeepspeed{
    "STRATA_REPLACE_DEEPSPEED", "pip build",
    "1: install the deepspeed compatibility distribution over a real DeepSpeed"};
inline constexpr EnvVar kEnvBuildDir{"STRATA_BUILD_DIR", "pip build",
                                     "the CMake build folder pip's build uses"};
inline constexpr EnvVar kEnvBuildType{"STRATA_BUILD_TYPE", "pip build",
                                      "CMAKE_BUILD_TYPE of pip's build (default RelWithDebInfo)"};
inline constexpr EnvVar kEnvCmakeArgs{"STRATA_CMAKE_ARGS", "pip build",
                                      "extra CMake arguments for pip's build (shell words)"};
inline constexpr EnvVar kEnvJobs{"STRATA_JOBS", "pip build",
                                 "parallel compile jobs of pip's build (default: the cores)"};
inline constexpr EnvVar kEnvWheelKeepDebug{
    "STRATA_WHEEL_KEEP_DEBUG", "pip build", "1: ship the extension's debug info in the wheel"};
inline constexpr EnvVar kEnvCxx{"CXX", "pip build", "the C++ compiler pip's build uses"};
inline constexpr EnvVar kEnvFakeData{
    "STRATA_FAKE_DATA", "tests",
    "the corpus harness: samples of the fake datasets standing in for downloads"};
inline constexpr EnvVar kEnvSeed{"STRATA_SEED", "tests",
                                 "the corpus harness: torch.manual_seed before the script runs"};
inline constexpr EnvVar kEnvTestDevice{"STRATA_TEST_DEVICE", "tests",
                                       "the Python suites' device (default: cuda when present)"};
inline constexpr EnvVar kEnvDsCompat{
    "STRATA_DS_COMPAT", "tests", "the build's deepspeed-compat folder, for the Python suites"};
inline constexpr EnvVar kEnvBin{"STRATA_BIN", "tests", "the build's bin folder"};
inline constexpr EnvVar kEnvPipVenv{"STRATA_PIP_VENV", "tests",
                                    "the venv the pip-install test installs into"};
// tools/scripts' knobs (shell).
inline constexpr EnvVar kEnvVenv{"STRATA_VENV", "scripts",
                                 "run.sh's venv (default .venv in the checkout)"};
inline constexpr EnvVar kEnvCtestArgs{"STRATA_CTEST_ARGS", "scripts",
                                      "test.sh: extra ctest arguments (e.g. -R engine)"};
inline constexpr EnvVar kEnvTestCudaOff{
    "STRATA_TEST_CUDA_OFF", "scripts", "test.sh: 0 skips the second, CUDA-off build and its tests"};
inline constexpr EnvVar kEnvNice{"STRATA_NICE", "scripts",
                                 "fuzz.sh and sanitize.sh: the builds' nice level"};
inline constexpr EnvVar kEnvFuzzBuild{"STRATA_FUZZ_BUILD", "scripts", "fuzz.sh's build folder"};
inline constexpr EnvVar kEnvFuzzTargets{"STRATA_FUZZ_TARGETS", "scripts",
                                        "fuzz.sh's targets (config swap_index manifest)"};
inline constexpr EnvVar kEnvGpuBuild{"STRATA_GPU_BUILD", "scripts",
                                     "gpu-check.sh and gpu-lease.sh: the GPU build folder"};
inline constexpr EnvVar kEnvGpuTargets{"STRATA_GPU_TARGETS", "scripts",
                                       "gpu-check.sh: the targets to build (default all)"};
inline constexpr EnvVar kEnvScalePlacements{
    "SCALE_PLACEMENTS", "scripts", "gpu-check.sh scale: the placements per size (default auto auto-compact)"};
inline constexpr EnvVar kEnvScaleReserveMargin{
    "SCALE_RESERVE_MARGIN", "scripts",
    "gpu-check.sh scale on a GPU: device memory kept beyond the estimated reserve, a fraction of it (default 0.10, at least 2 GiB)"};
inline constexpr EnvVar kEnvGpuPythonTests{
    "STRATA_GPU_PYTHON_TESTS", "scripts", "gpu-check.sh: a -k / -R filter for the GPU test run"};
inline constexpr EnvVar kEnvGpuPack{"STRATA_GPU_PACK", "scripts",
                                    "gpu-pack.sh's folder (default .gpu-pack)"};
inline constexpr EnvVar kEnvNvmeDir{"STRATA_NVME_DIR", "scripts",
                                    "gpu-check.sh's NVMe folder on the GPU machine"};
inline constexpr EnvVar kEnvPhaseSeconds{
    "STRATA_PHASE_SECONDS", "scripts", "gpu-check.sh: the time limit of each phase (default 530)"};
inline constexpr EnvVar kEnvTrixieDir{"STRATA_TRIXIE_DIR", "scripts",
                                      "test-libtorch2.sh's root and build folder"};
inline constexpr EnvVar kEnvDebianMirror{"STRATA_DEBIAN_MIRROR", "scripts",
                                         "test-libtorch2.sh's Debian mirror"};
inline constexpr EnvVar kEnvPeerRoot{"ROOT", "scripts",
                                     "ds_differential.sh: the DeepSpeed peer root "
                                     "(default /var/tmp/strata-peer/trixie)"};
inline constexpr EnvVar kEnvPython{"PYTHON", "scripts",
                                   "gpu-check.sh: the interpreter with torch to try first"};
inline constexpr EnvVar kEnvPeerPython{"PEER_PYTHON", "scripts",
                                       "gpu-check.sh: the interpreter that runs the FSDP2 peer"};
inline constexpr EnvVar kEnvCi{"CI", "scripts",
                               "set by CI runners; test-libtorch2.sh passes it into its root"};

inline constexpr EnvVar kEnvVars[] = {
    kEnvLogLevel,     kEnvCpuDevice,    kEnvCpuBf16,          kEnvAdamIsa,
    kEnvAdamPrefetch, kEnvNvmePlainRing, kEnvNativeBacktrace, kEnvKeepOmpWait,
    kEnvOmpWaitPolicy, kEnvWorldSize,   kEnvRank,             kEnvLocalRank,
    kEnvLocalWorldSize, kEnvMasterAddr, kEnvMasterPort,       kEnvGlooSocketIfname,
    kEnvRankCores,    kEnvDsEnvFile,    kEnvReplaceDeepspeed, kEnvBuildDir,
    kEnvBuildType,    kEnvCmakeArgs,    kEnvJobs,             kEnvWheelKeepDebug,
    kEnvCxx,          kEnvFakeData,     kEnvSeed,             kEnvTestDevice,
    kEnvDsCompat,     kEnvBin,          kEnvPipVenv,          kEnvVenv,
    kEnvCtestArgs,    kEnvTestCudaOff,  kEnvNice,             kEnvFuzzBuild,
    kEnvFuzzTargets,  kEnvGpuBuild,     kEnvGpuTargets,       kEnvScalePlacements,
    kEnvScaleReserveMargin, kEnvGpuPythonTests,
    kEnvGpuPack,      kEnvNvmeDir,      kEnvPhaseSeconds,     kEnvTrixieDir,
    kEnvDebianMirror, kEnvPeerRoot,     kEnvPython,           kEnvPeerPython,
    kEnvCi};

// std::getenv of the variable's name; nullptr when unset.
const char* GetEnv(const EnvVar& var);

}  // namespace strata
