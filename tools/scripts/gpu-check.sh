#!/usr/bin/env bash
# Proves Strata on a lent GPU machine, one phase per call, each under 9 minutes:
#
#   build    unpack .gpu-pack (tools/scripts/gpu-pack.sh, run before the lease) where the machine
#            lacks a library, configure against the machine's pip torch (its LibTorch) and its
#            NCCL, for the GPU's architecture, and build everything
#   pip      what a Python user does: pip install --no-build-isolation . and ./python into the
#            machine's Python (timed), then from outside the tree the module case by case, the
#            Trainer test, examples/train_gpt2.py and the Python suite on the installed packages
#   test     ctest -L gpu, the Python module case by case (gpu_python_probe.py), the Python
#            suite (on CUDA wherever a GPU is), the Trainer test
#   bench    the 404M bench config (configs/bench-nvme.json) under none/cpu/nvme x fp32/bf16,
#            every lane reported; PyTorch FSDP2 with CPUOffloadPolicy on the same model beside it;
#            the ceilings (NVMe through io_uring and fio, host<->device copies, DRAM, CPU Adam,
#            the matmul and free memory of the GPU); strata-tune's predicted step of the cpu and
#            nvme rows from that profile, beside the measured one
#   scale    the largest GPT this machine trains: 1.3B, 2.7B, 6.7B, 13B, 20B; bf16, activation
#            checkpointing, strata.placement auto (device, host and NVMe filled under what the
#            machine has) with fp32 states, then with the compact layouts (bf16 master with
#            stochastic rounding, 8-bit moments), 3 steps each; each size's placement plan beside
#            TFLOPS (6·params·tokens/step), the lane that bounds the step, peak device, host and
#            disk bytes. SCALE_PLACEMENTS="cpu nvme" runs the sections-as-written placements instead
#   report   one markdown table from the phases' JSON
#
#   tools/scripts/gpu-check.sh PHASE [--device cuda|cpu] [--quick] [--sizes 1.3b,2.7b] [--steps N]
#
# Each phase writes PHASE.json and PHASE.log under $OUT (the device tool's return folder; without
# it, build-gpu/out) and keeps a copy of the JSON in build-gpu/results for `report`. The phases
# share build-gpu/ on a warm machine: run them in order, `build` first.
#   --device cpu   the dry run on a machine without a GPU: the same steps on the CPU device
#   --quick        the dry run's shapes: small models, fewer steps (the pipeline, not the figures)
#   --sizes LIST   scale: the sizes to try, in order (default 1.3b,2.7b,6.7b,13b,20b; also 30b, 34b, 39b)
#   --steps N      bench: steps per run (default 6; quick 3)
# Environment: PYTHON (a python3 with torch; default: the first of python3, /usr/bin/python3 that
# imports torch), PEER_PYTHON (the FSDP2 peer's python, torch >= 2.6; default PYTHON),
# STRATA_NVME_DIR (swap directory; default /var/tmp/strata-gpu-nvme), STRATA_GPU_BUILD,
# STRATA_PHASE_SECONDS (the phase's own time limit; default 530), STRATA_GPU_TARGETS (build: the
# targets to build, default all; `lease` names the ones test, bench and scale run, for a short
# lease where the whole test tree does not fit), STRATA_GPU_TEST_PARTS (test: which of "probe
# trainer" run besides ctest -L gpu and the Python suite; default both), STRATA_GPU_PYTHON_TESTS
# (test: a ctest -R regex of the Python suites to run; pip: a pytest -k expression; default all),
# SCALE_PLACEMENTS (scale: the placements to try per size; default "auto auto-compact"),
# SCALE_RESERVE_MARGIN (scale on a GPU: device memory kept free beyond the estimator's reserve, as
# a fraction of it, at least 2 GiB; default 0.10).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
UTIL="$ROOT/tools/scripts/gpu_check_util.py"

usage() { sed -n '2,/^set -/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; }
phase=${1:-}
case "$phase" in
  build|pip|test|bench|scale|report) shift ;;
  -h|--help) usage; exit 0 ;;
  "") usage >&2; echo "gpu-check: name a phase: build, pip, test, bench, scale or report" >&2; exit 2 ;;
  *) echo "gpu-check: unknown phase '$phase': build, pip, test, bench, scale or report" >&2; exit 2 ;;
esac
device=""; quick=0; sizes="1.3b,2.7b,6.7b,13b,20b"; steps=""
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device=${2:-}; shift 2 ;;
    --device=*) device=${1#*=}; shift ;;
    --quick) quick=1; shift ;;
    --sizes) sizes=${2:-}; shift 2 ;;
    --steps) steps=${2:-}; shift 2 ;;
    *) echo "gpu-check: unknown flag '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=cuda; else device=cpu; fi
fi
case "$device" in cuda|cpu) ;; *) echo "gpu-check: --device=$device: cuda or cpu" >&2; exit 2 ;; esac
if [ "$device" = cuda ] && ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: --device cuda but nvidia-smi sees no GPU; on a machine without one use --device cpu" >&2
  exit 2
fi
if [ -n "$steps" ] && ! [[ "$steps" =~ ^[1-9][0-9]*$ ]]; then
  echo "gpu-check: --steps=$steps: a whole number >= 1" >&2; exit 2
fi

BUILD=${STRATA_GPU_BUILD:-$ROOT/build-gpu}
CM="$BUILD/cmake"
RESULTS="$BUILD/results"
WORK="$BUILD/work/$phase"
OUT=${OUT:-$BUILD/out}
NVME=${STRATA_NVME_DIR:-/var/tmp/strata-gpu-nvme}
PACK="$ROOT/.gpu-pack"
mkdir -p "$OUT" "$RESULTS" "$WORK"
LOG="$OUT/$phase.log"
JSON="$OUT/$phase.json"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
PHASE_LIMIT=${STRATA_PHASE_SECONDS:-530}  # each phase ends inside a 10-minute device command
elapsed() { echo $(( $(date +%s) - T0 )); }
cap() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }  # the smaller of two numbers
left() { echo $(( PHASE_LIMIT - $(elapsed) )); }
say() { echo "[gpu-check $phase $(elapsed)s] $*"; }

pick_python() {
  local c
  for c in ${PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' >/dev/null 2>&1; then
      command -v "$c"; return 0
    fi
  done
  return 1
}
PY=$(pick_python) || PY=""
UPY=${PY:-python3}  # the util needs only the standard library
machine_desc() {
  local cpu gpu mem
  cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
  mem=$(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo)
  gpu="no GPU"
  if [ "$device" = cuda ]; then gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1); fi
  echo "$cpu ($(nproc) CPUs, $mem), $gpu"
}
MACHINE=$(machine_desc)
finish() {  # finish OK NOTES [key=value ...]
  local ok=$1 notes=$2; shift 2
  "$UPY" "$UTIL" phase-json --out "$JSON" --out "$RESULTS/$phase.json" ${MERGE:+--merge "$MERGE"} \
    phase="$phase" ok="$ok" seconds="$(elapsed)" device="$device" quick="$quick" \
    machine="$MACHINE" notes="$notes" "$@"
  say "done: ok=$ok ($notes); $JSON"
  [ "$ok" = true ]
}

# --- dependencies: the machine's own, else the packed .debs -----------------------------------
have_system_deps() {
  pkg-config --exists liburing hwloc 2>/dev/null &&
    for h in nlohmann/json.hpp CLI/CLI.hpp gtest/gtest.h tbb/tbb.h; do
      [ -e "/usr/include/$h" ] || [ -e "/usr/local/include/$h" ] || return 1
    done
}
DEPS="$BUILD/deps"
deps_env() {  # exports what finds the unpacked packages; a no-op on a machine that has its own
  [ -f "$BUILD/deps.env" ] && . "$BUILD/deps.env"
  return 0
}
unpack_deps() {  # prints "system" or "pack": where the build's libraries come from
  local have=pack
  have_system_deps && have=system
  if compgen -G "$PACK/debs/*.deb" >/dev/null; then
    # Unpacked in any case: fio and the fortunes text may be missing where the libraries are not.
    rm -rf "$DEPS"; mkdir -p "$DEPS"
    local deb
    for deb in "$PACK"/debs/*.deb; do
      if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$deb" "$DEPS"
      else (cd "$DEPS" && ar p "$deb" "$(ar t "$deb" | grep '^data.tar')" | tar -x --auto-compress -f -); fi
    done
  elif [ "$have" = pack ]; then
    echo "gpu-check: this machine lacks liburing/hwloc/oneTBB/nlohmann-json/CLI11/GoogleTest and no" \
         ".gpu-pack came with the tree: run tools/scripts/gpu-pack.sh before the lease and carry .gpu-pack" >&2
    return 1
  fi
  if [ "$have" = system ]; then
    echo "# the machine's own libraries" >"$BUILD/deps.env"; echo system; return 0
  fi
  # The .pc files name /usr; point them at the unpacked tree.
  find "$DEPS" -name '*.pc' -exec sed -i -e "s|^prefix=/usr|prefix=$DEPS/usr|" \
    -e "s|^\([a-z_]*dir\)=/usr/|\1=$DEPS/usr/|" {} +
  local lib="$DEPS/usr/lib/x86_64-linux-gnu"
  # Debian's merged /usr keeps some libraries in /lib too.
  cat >"$BUILD/deps.env" <<EOF
export PKG_CONFIG_PATH="$lib/pkgconfig:$DEPS/usr/share/pkgconfig\${PKG_CONFIG_PATH:+:\$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$lib:$DEPS/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
# The compiler searches /usr/include/<multiarch> by itself, never the unpacked tree's (hwloc keeps
# its generated config.h there).
export CPATH="$DEPS/usr/include/x86_64-linux-gnu\${CPATH:+:\$CPATH}"
export LIBRARY_PATH="$lib\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
EOF
  echo pack
}
fio_cmd() {  # fio from the machine, else the packed one (its own libraries on its path alone)
  if command -v fio >/dev/null; then command -v fio; return 0; fi
  local f="$DEPS/usr/bin/fio"
  [ -x "$f" ] || return 1
  local wrapper="$BUILD/fio"
  # librados keeps libceph-common in a private folder it names by absolute path (RUNPATH).
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s:%s:%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
    "$DEPS/usr/lib/x86_64-linux-gnu" "$DEPS/usr/lib/x86_64-linux-gnu/ceph" "$DEPS/lib/x86_64-linux-gnu" \
    "$f" >"$wrapper"
  chmod +x "$wrapper"
  "$wrapper" --version >/dev/null 2>&1 || return 1
  echo "$wrapper"
}

# --- build ------------------------------------------------------------------------------------
pick_cxx() {  # the first g++ whose shared objects need libstdc++.so (not a static copy)
  local c probe="$WORK/libstdcxx-probe"
  for c in ${CXX:-} "$(command -v g++ || true)" /usr/bin/g++; do
    [ -n "$c" ] && [ -x "$(command -v "$c" || true)" ] || continue
    printf '#include <sstream>\nstd::string f(long v) { std::ostringstream s; s << v; return s.str(); }\n' >"$probe.cc"
    if "$c" -shared -fPIC -o "$probe.so" "$probe.cc" 2>/dev/null && grep -qa 'libstdc++\.so' "$probe.so"; then
      command -v "$c"; return 0
    fi
    echo "[gpu-check] $c links libstdc++ statically: not used" >&2
  done
  return 1
}
# configure_args: fills `args` (CMake flags), `from` (system or pack), `arch`, `nccl` and `cxx` for
# this machine: the packed libraries where it lacks them, the pip torch's Gloo headers, the GPU's
# architecture and the NCCL of torch's wheel, a g++ that links the shared libstdc++. Shared by
# `build` (CMake directly) and `pip` (the same flags through STRATA_CMAKE_ARGS).
# On failure it returns 1 with the reason in `why`.
# `dep_args` holds the packed libraries' flags alone.
configure_args() {
  args=() dep_args=() arch="" nccl="" cxx="" why=""
  from=$(unpack_deps) || { why="libraries missing and no .gpu-pack"; return 1; }
  deps_env
  # The default training text (strata-train, the example, the tests) is read from Debian's path.
  local fortunes=/usr/share/games/fortunes
  if [ ! -e "$fortunes" ] && [ -d "$DEPS/usr/share/games/fortunes" ]; then
    mkdir -p /usr/share/games 2>/dev/null && ln -s "$DEPS/usr/share/games/fortunes" "$fortunes" 2>/dev/null &&
      say "linked $fortunes to the packed fortunes text" || say "cannot link $fortunes (not root?): pass --data"
  fi
  if [ "$from" = pack ]; then
    local l="$DEPS/usr/lib/x86_64-linux-gnu/cmake"
    args+=(-DTBB_DIR="$l/TBB" -Dnlohmann_json_DIR="$DEPS/usr/share/cmake/nlohmann_json"
           -DGTest_DIR="$l/GTest" -Dbenchmark_DIR="$l/benchmark"
           -DCMAKE_INCLUDE_PATH="$DEPS/usr/include" -DCMAKE_LIBRARY_PATH="$DEPS/usr/lib/x86_64-linux-gnu")
    [ -d "$DEPS/usr/share/cmake/CLI11" ] && args+=(-DCLI11_DIR="$DEPS/usr/share/cmake/CLI11")
    [ -d "$DEPS/usr/lib/cmake/CLI11" ] && args+=(-DCLI11_DIR="$DEPS/usr/lib/cmake/CLI11")
    dep_args=("${args[@]}" -DCMAKE_PREFIX_PATH="$DEPS/usr")
  fi
  # c10d's ProcessGroupGloo (the CPU collectives) needs Gloo's headers: a pip torch carries them
  # in its own include folders; elsewhere CMake looks in the usual places.
  local gloo
  gloo=$("$PY" -c 'import os, torch.utils.cpp_extension as e
print(next((d for d in e.include_paths() if os.path.exists(os.path.join(d, "gloo", "config.h"))), ""))' 2>/dev/null || true)
  [ -n "$gloo" ] && args+=(-DSTRATA_GLOO_INCLUDE="$gloo")
  if [ "$device" = cuda ]; then
    command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
    command -v nvcc >/dev/null || { why="no nvcc on PATH or in /usr/local/cuda/bin"; return 1; }
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
    # The NCCL that torch loads: its pip wheel's (nvidia/nccl/ or, in CUDA 13 wheels, nvidia/cu13/).
    local header
    header=$("$PY" -c 'import nvidia, os
for d in nvidia.__path__:
    for root, _, files in os.walk(d):
        if "nccl.h" in files: print(os.path.join(root, "nccl.h")); raise SystemExit' 2>/dev/null || true)
    args+=(-DSTRATA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch")
    if [ -n "$header" ]; then
      nccl=$(dirname "$(dirname "$header")")
      local lib; lib=$(ls "$nccl"/lib/libnccl.so* 2>/dev/null | head -1)
      [ -n "$lib" ] && args+=(-DSTRATA_NCCL_INCLUDE="$nccl/include" -DSTRATA_NCCL_LIB="$lib")
    fi
  else
    args+=(-DSTRATA_CUDA=AUTO)
  fi
  # The Python module shares the process with torch's libstdc++.so.6 (Note [one libstdc++] in
  # python/CMakeLists.txt: it links the compiler's shared libstdc++ itself). A g++ whose plain
  # shared objects need libstdc++.so is preferred all the same: the H100 image puts one first on
  # PATH (/opt/gcc) that does not, and whose shared libstdc++ may be missing.
  if cxx=$(pick_cxx); then
    args+=(-DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_C_COMPILER="${cxx%g++}gcc")
    [ "$device" = cuda ] && args+=(-DCMAKE_CUDA_HOST_COMPILER="$cxx")
  else
    cxx=""
    say "no C++ compiler here links libstdc++ as a shared library: the Python module stays off"
  fi
  return 0
}
phase_build() {
  [ -n "$PY" ] || { finish false "no python3 with torch (set PYTHON)"; return 1; }
  local from torch_prefix torch_ver args=() arch="" nccl="" cxx="" why
  configure_args || { finish false "$why"; return 1; }
  say "libraries: $from; python: $PY"
  torch_prefix=$("$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  torch_ver=$("$PY" -c 'import torch; print(torch.__version__)')
  local prefix="$torch_prefix"
  [ "$from" = pack ] && prefix="$DEPS/usr;$torch_prefix"
  say "configure: torch $torch_ver, device $device${arch:+, sm_$arch}${nccl:+, NCCL from $nccl}, ${cxx:-default compiler}"
  mkdir -p "$CM"
  if ! cmake -S "$ROOT" -B "$CM" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_PYTHON=AUTO \
       -DSTRATA_PYTHON_EXECUTABLE="$PY" -DCMAKE_PREFIX_PATH="$prefix" "${args[@]}" >"$WORK/configure.log" 2>&1; then
    tail -30 "$WORK/configure.log"
    finish false "configure failed: $(grep -m1 -i 'error' "$WORK/configure.log" | head -c 200)"; return 1
  fi
  grep -E '^-- strata' "$WORK/configure.log" || true
  local pymod
  pymod=$(grep -q 'Python module off' "$WORK/configure.log" && grep -m1 'Python module off' "$WORK/configure.log" | sed 's/.*off: //' || echo on)
  local jobs=$(nproc) targets=()
  case "${STRATA_GPU_TARGETS:-all}" in
    all) ;;
    lease) targets=(--target strata-train strata-swapbench strata-estimate strata-launch
                    engine_equivalence_test engine_multirank_test)
           [ "$device" = cuda ] && targets+=(kernels_gpu_test compact_gpu_test cuda_device_test nccl_communicator_test)
           [ "$pymod" = on ] && targets+=(strata_python) ;;
    *) read -r -a targets <<<"$STRATA_GPU_TARGETS"; targets=(--target "${targets[@]}") ;;
  esac
  say "build: -j $jobs ${targets[*]:-(all targets)}"
  if ! timeout "$(left)" cmake --build "$CM" -j "$jobs" "${targets[@]}" >"$WORK/build.log" 2>&1; then
    tail -40 "$WORK/build.log"
    finish false "build failed or ran out of the phase's time: $(grep -m1 -E 'error|FAILED' "$WORK/build.log" | head -c 200)"
    return 1
  fi
  tail -2 "$WORK/build.log"
  finish true "built with torch $torch_ver (${from} libraries)" torch="$torch_ver" python="$PY" \
    libraries="$from" cuda_arch="${arch:-none}" nccl="${nccl:-none}" python_module="$pymod"
}

# --- pip ----------------------------------------------------------------------------------------
# What a Python user does on this machine: `pip install --no-build-isolation .` (the extension and
# the tools against the machine's own torch, found by the project's build backend) and
# `pip install ./python` (the deepspeed distribution), then, from outside the source tree, the
# module case by case, the Trainer test, the example and the Python suite, all against the
# installed packages. Only the packed libraries' locations are passed (STRATA_CMAKE_ARGS); the
# torch, its CUDA and NCCL, the GPU's architecture and the compiler are the backend's to find.
phase_pip() {
  [ -n "$PY" ] || { finish false "no python3 with torch (set PYTHON)"; return 1; }
  local from args=() dep_args=() arch="" nccl="" cxx="" why ok=true results=() line t0 secs
  configure_args >/dev/null || { finish false "$why"; return 1; }
  say "pip install --no-build-isolation . ($PY, torch $("$PY" -c 'import torch; print(torch.__version__)'))"
  t0=$(date +%s)
  if ! STRATA_CMAKE_ARGS="${dep_args[*]}" STRATA_BUILD_DIR="$BUILD/pip" timeout "$(( $(left) / 2 ))" \
       "$PY" -m pip install --no-build-isolation --no-deps --no-index -v "$ROOT" >"$WORK/pip-strata.log" 2>&1; then
    tail -30 "$WORK/pip-strata.log"
    finish false "pip install . failed: $(grep -m1 -E 'strata build:.*(failed|cannot|no )|error' "$WORK/pip-strata.log" | head -c 240)"
    return 1
  fi
  secs=$(( $(date +%s) - t0 ))
  line=$(grep -m1 -oE 'wrote strata-[^ ]+ \([0-9.]+ MiB\)' "$WORK/pip-strata.log" || echo "wheel size not found")
  say "strata installed in ${secs}s: $line"
  results+=("pip_strata=${secs}s, $line")
  if "$PY" -m pip install --no-build-isolation --no-deps --no-index "$ROOT/python" >"$WORK/pip-deepspeed.log" 2>&1; then
    results+=("pip_deepspeed=installed")
  else
    ok=false; results+=("pip_deepspeed=failed: $(tail -1 "$WORK/pip-deepspeed.log" | head -c 200)")
  fi
  local scripts site
  scripts=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  cd "$WORK"  # from here on nothing of the source tree is on sys.path
  say "smoke: import strata and deepspeed, the commands on PATH"
  if PATH="$scripts:$PATH" "$PY" -c 'import strata, deepspeed, shutil, sys
print("strata", strata.__file__, "deepspeed", deepspeed.__version__, deepspeed.__file__)
missing = [c for c in ("strata-train", "strata-launch", "strata-swapbench", "strata-estimate", "strata-tune", "deepspeed") if not shutil.which(c)]
sys.exit("missing commands: %s" % missing if missing else 0)' >"$WORK/smoke.log" 2>&1 &&
     PATH="$scripts:$PATH" strata-estimate --help >/dev/null 2>>"$WORK/smoke.log"; then
    results+=("smoke=ok")
  else
    ok=false; results+=("smoke=$(tail -1 "$WORK/smoke.log" | head -c 200)")
  fi
  cat "$WORK/smoke.log"
  # Seven cases of about ten seconds each on the H100 lease of 2026-11-27.
  say "the module case by case (gpu_python_probe.py)"
  if STRATA_BIN="$scripts" timeout "$(cap $(( $(left) / 4 )) 90)" \
       "$PY" "$ROOT/tools/scripts/gpu_python_probe.py" --out "$WORK/probe" --timeout 45 >"$WORK/probe.log" 2>&1; then
    results+=("probe=all cases ran")
  else
    ok=false
    results+=("probe=$(grep -c ' ok ' "$WORK/probe.log" || true) ok, $(grep -c FAILED "$WORK/probe.log" || true) failed of 7")
  fi
  cat "$WORK/probe.log"
  # Seven cases, each a few Trainer runs in processes of their own: the first (stage 2, three
  # runs) took about 90 s on the lease of 2026-11-27. Under set -e an empty grep below is a log
  # without a summary (the time ran out), not an error.
  say "the Trainer test"
  STRATA_BIN="$scripts" STRATA_DS_COMPAT="$site" timeout "$(cap $(( $(left) / 2 )) 130)" \
    "$PY" -m pytest -q -rs -p no:cacheprovider "$ROOT/tests/python/test_hf_trainer.py" >"$WORK/trainer.log" 2>&1 || ok=false
  line=$(grep -E '(passed|failed|skipped|error)' "$WORK/trainer.log" | tail -1 || true)
  line=${line:-ran out of time}; echo "  $line"; results+=("trainer=$line")
  say "examples/train_gpt2.py (30 steps)"
  if PATH="$scripts:$PATH" timeout "$(cap $(( $(left) / 4 )) 60)" "$PY" "$ROOT/examples/train_gpt2.py" \
       --steps 30 --log-every 10 >"$WORK/example.log" 2>&1; then
    results+=("example=$(grep -E '^train_gpt2: 30 steps' "$WORK/example.log" | tail -1 | head -c 200)")
  else
    ok=false; results+=("example=failed: $(grep -v '^\s*$' "$WORK/example.log" | grep -iE 'error' | tail -1 | head -c 200)")
  fi
  tail -4 "$WORK/example.log"
  # A forward that raised, then more training and a close: nothing may be left reading freed
  # device memory (an illegal address in the first lease's suite). Synchronous launches make a
  # fault name its own call.
  say "a failed forward and what follows (CUDA_LAUNCH_BLOCKING=1)"
  STRATA_BIN="$scripts" CUDA_LAUNCH_BLOCKING=1 timeout "$(cap $(( $(left) / 3 )) 60)" \
    "$PY" -m pytest -q -rs -p no:cacheprovider "$ROOT/tests/python/test_failed_forward.py" >"$WORK/failed-forward.log" 2>&1 || ok=false
  line=$(grep -E '(passed|failed|error)' "$WORK/failed-forward.log" | tail -1 || true)
  line=${line:-ran out of time}; echo "  $line"; results+=("failed_forward=$line")
  # The suite: one worker per file (as ctest runs them), as many files at once as cores allow.
  # The corpus test is the CPU device's (its scripts' fp16 refusals); the Trainer and the failed
  # forward ran above; the pip-install test needs the CI pass's venv.
  local pick=() workers=$(( $(nproc) / 2 )) xdist=()
  [ "$workers" -gt 8 ] && workers=8
  [ -n "${STRATA_GPU_PYTHON_TESTS:-}" ] && pick=(-k "$STRATA_GPU_PYTHON_TESTS")
  "$PY" -c 'import xdist' 2>/dev/null && xdist=(-n "$workers" --dist loadfile)
  say "the Python suite on the installed packages (${xdist[*]:-one process}) for $(( $(left) - 15 ))s at most"
  STRATA_BIN="$scripts" STRATA_DS_COMPAT="$site" STRATA_CPU_DEVICE=strict timeout "$(( $(left) - 15 ))" \
    "$PY" -m pytest -q -rs -p no:cacheprovider "${xdist[@]}" "${pick[@]}" \
    --ignore="$ROOT/tests/python/test_hf_trainer.py" --ignore="$ROOT/tests/python/test_ds_corpus.py" \
    --ignore="$ROOT/tests/python/test_failed_forward.py" --ignore="$ROOT/tests/python/test_pip_install.py" \
    "$ROOT/tests/python" >"$WORK/suite.log" 2>&1 || ok=false
  line=$(grep -E '(passed|failed|error)' "$WORK/suite.log" | tail -1 || true)
  echo "  ${line:-the suite ran out of time (see work/pip/suite.log)}"
  results+=("suite=${line:-ran out of time}")
  grep -E '^(FAILED|ERROR) ' "$WORK/suite.log" | head -20 || true
  cd "$ROOT"
  local kv=() s json
  for s in "${results[@]}"; do kv+=("${s%%=*}=${s#*=}"); done
  json=$("$UPY" -c 'import json,sys; print(json.dumps(dict(a.split("=",1) for a in sys.argv[1:])))' "${kv[@]}")
  finish "$ok" "$(IFS=';'; echo "${results[*]}")" results="$json"
}

need_build() {
  [ -x "$CM/bin/strata-train" ] || { finish false "no build in $CM: run the build phase first"; exit 1; }
  deps_env
}

# --- test -------------------------------------------------------------------------------------
# A Python test that dies of a signal leaves only its Python frames (faulthandler). The first such
# suite runs again under a debugger (cuda-gdb debugs host code too; gdb where the image has it),
# stopping at the fault, and the native frames of every thread go to WORK/native-bt.log.
native_backtrace() {
  local suite file dbg
  suite=$(grep -m1 -oE 'python_[a-z_0-9]+ \.+\*\*\*Exception: (SegFault|Bus error|Illegal)' "$WORK/ctest-python.log" |
          grep -oE '^python_[a-z_0-9]+') || return 0
  file="$ROOT/tests/python/test_${suite#python_}.py"
  dbg=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null) || {
    say "$suite died of a signal; no gdb or cuda-gdb here for its native frames"; return 0; }
  local t=$(( $(left) / 2 )); [ "$t" -gt 120 ] && t=120
  [ "$t" -ge 20 ] || return 0
  say "$suite died of a signal: its native frames under $(basename "$dbg") (${t}s at most)"
  (cd "$CM" && PYTHONPATH="$CM/python" STRATA_BIN="$CM/bin" STRATA_DS_COMPAT="$CM/deepspeed-compat" \
     timeout "$t" "$dbg" -q -batch -ex 'set pagination off' -ex run -ex 'info sharedlibrary' \
       -ex 'thread apply all bt 25' --args "$PY" -m pytest -x -q -p no:cacheprovider "$file") \
     >"$WORK/native-bt.log" 2>&1 || true
  grep -m12 -E '^#[0-9]+ ' "$WORK/native-bt.log" | cut -c1-220 || true
}
ctest_line() { grep -E 'tests passed|No tests were found' "$1" | tail -1; }
phase_test() {
  need_build
  local ok=true suites=() line parts=${STRATA_GPU_TEST_PARTS:-probe trainer}
  say "ctest -L gpu"
  (cd "$CM" && timeout "$(( $(left) / 4 ))" ctest -L gpu --output-on-failure -j 2) >"$WORK/ctest-gpu.log" 2>&1 || ok=false
  line=$(ctest_line "$WORK/ctest-gpu.log"); echo "  $line"
  local skipped
  skipped=$(grep -c -E 'SKIPPED|Skipped' "$WORK/ctest-gpu.log" || true)
  suites+=("ctest_gpu=${line:-no summary} (skip lines: $skipped)")
  if [ -d "$CM/python/strata" ] || compgen -G "$CM/python/*strata*" >/dev/null; then
    # One small engine per case, each in its own process: where the module fails on this device,
    # with native frames for a crash (tools/scripts/gpu_python_probe.py).
    if [[ " $parts " != *" probe "* ]]; then
      suites+=("probe=not run (STRATA_GPU_TEST_PARTS=$parts)")
    else
    say "the Python module, case by case (gpu_python_probe.py)"
    if PYTHONPATH="$CM/python" STRATA_BIN="$CM/bin" timeout "$(( $(left) / 4 ))" \
         "$PY" "$ROOT/tools/scripts/gpu_python_probe.py" --out "$WORK/probe" --timeout 45 2>&1 | tee "$WORK/probe.log"; then
      suites+=("probe=all cases ran")
    else
      ok=false; suites+=("probe=$(grep -c FAILED "$WORK/probe.log" || true) cases failed (work/test/probe)")
    fi
    fi
    # The Trainer test before the whole suite: it is the one nothing else covers, and a short
    # lease may end during the suite.
    local trainer="$ROOT/tests/python/test_hf_trainer.py"
    if [[ " $parts " != *" trainer "* ]]; then
      suites+=("trainer=not run (STRATA_GPU_TEST_PARTS=$parts)")
    elif [ -f "$trainer" ]; then
      say "the Trainer test"
      if PYTHONPATH="$CM/python:$CM/deepspeed-compat" STRATA_BIN="$CM/bin" \
           STRATA_DS_COMPAT="$CM/deepspeed-compat" timeout "$(( $(left) / 2 ))" \
           "$PY" -m pytest -q -rs -p no:cacheprovider "$trainer" >"$WORK/trainer.log" 2>&1; then :; else ok=false; fi
      line=$(tail -1 "$WORK/trainer.log"); echo "  $line"
      suites+=("trainer=$line")
    else
      suites+=("trainer=not present (tests/python/test_hf_trainer.py)")
    fi
    # STRATA_GPU_PYTHON_TESTS: a ctest -R regex picking suites when the lease is short.
    local pick=()
    [ -n "${STRATA_GPU_PYTHON_TESTS:-}" ] && pick=(-R "$STRATA_GPU_PYTHON_TESTS")
    say "the Python suite (ctest -L python ${pick[*]}; strata.device auto takes CUDA where a GPU is)"
    (cd "$CM" && timeout "$(( $(left) - 5 ))" ctest -L python "${pick[@]}" --output-on-failure -j 4) >"$WORK/ctest-python.log" 2>&1 || ok=false
    line=$(ctest_line "$WORK/ctest-python.log"); echo "  $line"
    suites+=("python=${line:-no summary}")
    native_backtrace
  else
    suites+=("python=module not built (see build.json's python_module)")
  fi
  grep -E 'Failed|\*\*\*|FAILED' "$WORK"/ctest-*.log | head -20 || true
  local kv=() s
  for s in "${suites[@]}"; do kv+=("${s%%=*}=${s#*=}"); done
  local suites_json
  suites_json=$("$UPY" -c 'import json,sys; print(json.dumps(dict(a.split("=",1) for a in sys.argv[1:])))' "${kv[@]}")
  finish "$ok" "$(IFS=';'; echo "${suites[*]}")" suites="$suites_json"
}

# --- bench ------------------------------------------------------------------------------------
mem_gib() { awk '/MemTotal/{printf "%d", $2/1048576}' /proc/meminfo; }
train_run() {  # train_run NAME CONFIG STEPS: strata-train --json into WORK/train-NAME.jsonl
  local name=$1 cfg=$2 n=$3 t
  t=$(left); [ "$t" -gt 30 ] || { echo "no time left" >"$WORK/train-$name.err"; : >"$WORK/train-$name.jsonl"; return 1; }
  # RUN_SHARE=k: this run may take 1/k of what is left, so that a hung run leaves the rest time.
  [ "${RUN_SHARE:-1}" -gt 1 ] && t=$(( t / RUN_SHARE + 20 ))
  say "strata-train $name ($n steps)"
  rm -rf "$NVME"; mkdir -p "$NVME"
  # No validation: the figures are the steps'. On the 2026-11-27 lease a 6.45B run wrote its 3
  # steps and its summary, then ran past its timeout in the final validation (8 batches, each
  # gathering every parameter again over the copy lane) and left the next size no time.
  if timeout "$((t - 20))" "$CM/bin/strata-train" --config "$cfg" --steps "$n" --json --device "$device" \
       --eval-every 0 --eval-batches 0 --plot "$WORK/train-$name.svg" >"$WORK/train-$name.jsonl" 2>"$WORK/train-$name.err"; then
    "$UPY" "$UTIL" train-summary "$WORK/train-$name.jsonl" | cut -c1-300
  else
    echo "  failed: $(grep -v '^\s*$' "$WORK/train-$name.err" | tail -1)"
  fi
  rm -rf "$NVME"
}
phase_bench() {
  need_build
  local n=${steps:-6} base="$ROOT/configs/bench-nvme.json" model_args=() host_cpu
  [ "$quick" = 1 ] && { n=${steps:-3}; model_args=(--model 2,256,4,128); }
  rm -f "$WORK"/*.jsonl "$WORK"/*.err "$WORK/profile.json"
  mkdir -p "$NVME"
  say "ceilings: strata-swapbench profile --quick (NVMe and fio, copies, DRAM, CPU Adam, matmul)"
  local fio; fio=$(fio_cmd) && export PATH="$(dirname "$fio"):$PATH" || say "fio: not available on this machine"
  local cap=$(( $(left) / 5 )); [ "$cap" -gt 150 ] && cap=150
  timeout "$cap" "$CM/bin/strata-swapbench" profile --quick --json --path "$NVME" >"$WORK/profile.json" \
    2>"$WORK/profile.err" || say "profile failed: $(tail -1 "$WORK/profile.err")"
  # The cpu rows get the host budget a user of this machine would give a 404M model: half its
  # memory, at most 16 GiB (the states take under 7 GiB, and the pool pins its whole budget at
  # start, which costs seconds per 10 GiB); the nvme rows keep the shipped 2 GiB, so that states
  # really stream from the disk.
  local half=$(( $(mem_gib) / 2 )); [ "$half" -gt 16 ] && half=16
  host_cpu="${half}GiB"
  [ "$quick" = 1 ] && host_cpu=2GiB  # the dry run's small model: locking half the host is waste
  local dtype place cfg ppy=${PEER_PYTHON:-$PY}
  # Per dtype: none, cpu, the FSDP2 peer on the cpu row's config, then nvme (the slowest), so that
  # a lease cut short still has the rows the targets compare.
  for dtype in fp32 bf16; do
    for place in none cpu peer nvme; do
      cfg="$WORK/cfg-$place-$dtype.json"
      if [ "$place" = peer ]; then
        say "FSDP2 CPUOffloadPolicy peer ($dtype, $ppy)"
        if [ "$(left)" -lt 40 ]; then echo "no time left" >"$WORK/peer-fsdp2-cpu-$dtype.err"; continue; fi
        timeout "$(( $(left) / 2 ))" $ppy "$ROOT/tools/scripts/fsdp2_peer.py" --config "$WORK/cfg-cpu-$dtype.json" \
          --steps "$n" --device "$device" --offload cpu >"$WORK/peer-fsdp2-cpu-$dtype.jsonl" \
          2>"$WORK/peer-fsdp2-cpu-$dtype.err" || say "peer failed: $(tail -1 "$WORK/peer-fsdp2-cpu-$dtype.err")"
        continue
      fi
      local budget=()
      [ "$place" = cpu ] && budget=(--host-budget "$host_cpu")
      "$UPY" "$UTIL" config "$base" "$cfg" --placement "$place" --dtype "$dtype" --device "$device" \
        --nvme-path "$NVME" "${budget[@]}" "${model_args[@]}"
      RUN_SHARE=2 train_run "$place-$dtype" "$cfg" "$n" || true
    done
  done
  # strata-tune's prediction of the offloaded rows, from this machine's own profile (on a GPU its
  # matmul and free memory are the GPU's): the cost model against the steps just measured.
  local tdt
  for tdt in fp32 bf16; do
    [ -s "$WORK/profile.json" ] && [ -f "$WORK/cfg-cpu-$tdt.json" ] || continue
    timeout 120 "$CM/bin/strata-tune" --config "$WORK/cfg-cpu-$tdt.json" --profile "$WORK/profile.json" \
      --device "$device" --nvme-path "$NVME" --placement config --dry-run --json --top 100 \
      >"$WORK/tune-$tdt.json" 2>"$WORK/tune-$tdt.err" || say "strata-tune ($tdt) failed: $(tail -1 "$WORK/tune-$tdt.err")"
  done
  "$UPY" "$UTIL" bench-json "$WORK" >"$WORK/bench.json"
  local ok; ok=$("$UPY" -c 'import json,sys; print("true" if json.load(open(sys.argv[1]))["ok"] else "false")' "$WORK/bench.json")
  MERGE="$WORK/bench.json" finish "$ok" "$n steps per run, means over steps 2..$n; cpu host budget $host_cpu, nvme 2 GiB"
}

# --- scale ------------------------------------------------------------------------------------
phase_scale() {
  need_build
  local base="$ROOT/configs/bench-nvme.json" seq=2048 micro=8 n=3
  [ "$quick" = 1 ] && { seq=128; micro=2; [ "$sizes" = "1.3b,2.7b,6.7b,13b,20b" ] && sizes="tiny,small"; }
  local host="$(( $(mem_gib) * 3 / 4 ))GiB"
  local runs="$WORK/runs.jsonl"; : >"$runs"
  # The GPU's free memory, less the 1 GiB the run's own CUDA context and libraries take before
  # the engine measures what is free: the estimate's device, as the engine will see it (without
  # it a cuda estimate plans no device tier at all).
  local hbm=()
  if [ "$device" = cuda ] && command -v nvidia-smi >/dev/null; then
    local free_mib
    free_mib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i 0 2>/dev/null | head -1 | tr -dc 0-9)
    [ "${free_mib:-0}" -gt 2048 ] && hbm=(--hbm "$(( free_mib - 1024 ))MiB")
  fi
  local size place largest="" shape cfg
  for size in ${sizes//,/ }; do
    shape=$("$UPY" "$UTIL" size "$size") || { say "unknown size $size"; continue; }
    local trained=""
    # placement auto with fp32 states (18 bytes per parameter), then with the compact layouts
    # (a bf16 master rounded stochastically and 8-bit moments: about 8); SCALE_PLACEMENTS picks
    # others (cpu, nvme, nvme-bf16states: each state kind wholly in its section's tier).
    for place in ${SCALE_PLACEMENTS:-auto auto-compact}; do
      cfg="$WORK/cfg-$size-$place.json"
      local states=() budget=(--host-budget "$host") hbm_p=()
      [ "${place%%-*}" = auto ] && hbm_p=("${hbm[@]}")  # --hbm plans placement auto only
      [ "$place" = nvme-bf16states ] && states=(--state-dtype bf16)
      [ "$place" = auto-compact ] && states=(--state-dtype int8 --bf16-master)
      [ "${place%%-*}" = auto ] && budget=()   # auto measures the host itself
      "$UPY" "$UTIL" config "$base" "$cfg" --placement "${place%%-*}" --dtype bf16 --device "$device" \
        --nvme-path "$NVME" "${budget[@]}" --model "$shape,$seq" --micro-batch "$micro" \
        --checkpoint-activations --chunk-size 64MiB "${states[@]}"
      # Preflight: the estimator's bytes per tier against this machine's memory and disk; under
      # auto its replay also gives the device reserve the plan must leave for compute.
      local est fits
      est=$("$CM/bin/strata-estimate" --config "$cfg" --device "$device" "${hbm_p[@]}" --json 2>"$WORK/est.err" || true)
      local reserve
      reserve=$("$UPY" -c 'import json,sys
try: print(json.loads(sys.argv[1]).get("device_reserve", 0))
except Exception: print(0)' "$est")
      # On a GPU the replay counts LibTorch's activations as allocated, not as its caching
      # allocator holds them (whole segments, kept until the step ends) beside the engine's own
      # pool: keep SCALE_RESERVE_MARGIN more of the device free (default 10 %, at least 2 GiB),
      # so the largest sizes do not hinge on that gap. The run's peak use, sampled from
      # nvidia-smi below, says how much of the margin was needed.
      if [ "$device" = cuda ] && [ "${reserve:-0}" != 0 ]; then
        reserve=$("$UPY" -c 'import sys; r = int(sys.argv[1]); f = float(sys.argv[2])
print(r + max(int(r * f), 2 << 30))' "$reserve" "${SCALE_RESERVE_MARGIN:-0.10}")
      fi
      if [ "${place%%-*}" = auto ] && [ "${reserve:-0}" != 0 ]; then
        "$UPY" "$UTIL" config "$base" "$cfg" --placement auto --dtype bf16 --device "$device" \
          --nvme-path "$NVME" --model "$shape,$seq" --micro-batch "$micro" --checkpoint-activations \
          --chunk-size 64MiB --device-reserve "$reserve" "${states[@]}"
        # The plan with that reserve: what the preflight checks and the report shows.
        est=$("$CM/bin/strata-estimate" --config "$cfg" --device "$device" "${hbm_p[@]}" --json 2>"$WORK/est.err" || true)
      fi
      echo "$est" >"$WORK/est-$size-$place.json"
      mkdir -p "$NVME"
      fits=$("$UPY" - "$est" "$NVME" <<'EOF'
import json, os, sys
try:
    e = json.loads(sys.argv[1])
except json.JSONDecodeError:
    print("ok"); sys.exit()
mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
st = os.statvfs(sys.argv[2]); disk = st.f_bavail * st.f_frsize
# host_min_bytes: what the placement needs in host memory whatever the budget says.
host = max(e.get("host_min_bytes", 0), e.get("host_pinned_bytes", 0) + e.get("host_pageable_bytes", 0))
if host > 0.9 * mem:
    print(f"host needs {host/2**30:.0f} GiB of {mem/2**30:.0f} GiB"); sys.exit()
# zero::Init's staging file beside the NVMe state, which the engine's NVMe tier checks at start.
need = max(e.get("nvme_bytes", 0), e.get("init_disk_need_bytes", e.get("init_disk_peak_bytes", 0)))
if need > disk:
    print(f"disk needs {need/2**30:.0f} GiB, {disk/2**30:.0f} GiB free"); sys.exit()
print("ok")
EOF
)
      if [ "$fits" != ok ]; then
        say "$size $place: does not fit ($fits)"
        echo "{\"size\":\"$size\",\"placement\":\"$place\",\"result\":\"does not fit: $fits\"}" >>"$runs"
        continue
      fi
      # Peak disk use, sampled while the run goes.
      ( peak=0; while sleep 2; do u=$(du -sb "$NVME" 2>/dev/null | cut -f1); [ "${u:-0}" -gt "$peak" ] && peak=$u && echo "$peak" >"$WORK/disk-peak"; done ) &
      local sampler=$!
      echo 0 >"$WORK/disk-peak"
      # The device's memory in use (every allocator and the context), sampled every 200 ms.
      local gsampler=""
      echo 0 >"$WORK/gpu-mem-peak"
      if [ "$device" = cuda ] && command -v nvidia-smi >/dev/null; then
        ( gpeak=0; while sleep 0.2; do
            g=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | head -1 | tr -dc 0-9)
            [ "${g:-0}" -gt "$gpeak" ] && gpeak=$g && echo "$gpeak" >"$WORK/gpu-mem-peak"
          done ) &
        gsampler=$!
      fi
      local name="$size-$place"
      train_run "$name" "$cfg" "$n" || true
      kill "$sampler" 2>/dev/null || true
      [ -n "$gsampler" ] && kill "$gsampler" 2>/dev/null || true
      local disk; disk=$(cat "$WORK/disk-peak" 2>/dev/null || echo 0)
      local gmem; gmem=$(cat "$WORK/gpu-mem-peak" 2>/dev/null || echo 0)
      "$UPY" - "$WORK/train-$name.jsonl" "$WORK/train-$name.err" "$size" "$place" "$micro" "$seq" "$disk" "$UTIL" "$WORK/est-$size-$place.json" "$reserve" "$gmem" >>"$runs" <<'EOF'
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("u", sys.argv[8]); u = importlib.util.module_from_spec(spec); spec.loader.exec_module(u)
jsonl, err, size, place, micro, seq, disk = sys.argv[1:8]
r = u.summarize_train(jsonl)
r.update(size=size, placement=place, disk_bytes=int(disk), device_reserve=int(sys.argv[10] or 0),
         gpu_mem_peak_bytes=int(sys.argv[11] or 0) << 20)
try:  # the plan's bytes per tier (the engine logs the same lines at start)
    est = json.load(open(sys.argv[9]))
    r["plan"] = {t: est["placement"][t]["total"] for t in ("device", "host", "nvme")}
    r["bytes_per_param"] = est.get("bytes_per_param")
except (OSError, ValueError, KeyError, TypeError):
    pass
if r.get("ok") and r.get("step_s") and r.get("params"):
    r["tflops"] = 6 * r["params"] * int(micro) * int(seq) / r["step_s"] / 1e12
    r["result"] = "trained"
else:
    lines = [l.strip() for l in open(err, errors="replace") if l.strip()]
    r["result"] = "failed: " + (lines[-1][:300] if lines else "no output")
print(json.dumps(r))
EOF
      if tail -1 "$runs" | grep -q '"result": "trained"'; then trained=$place; largest=$size; break; fi
    done
    [ -n "$trained" ] || say "$size: not trained; larger sizes are not tried"
    [ -n "$trained" ] || break
  done
  local runs_json
  runs_json=$("$UPY" -c 'import json,sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1]) if l.strip()]))' "$runs")
  # Earlier calls' sizes (scale --sizes split over several calls) stay in the results.
  if [ -f "$RESULTS/scale.json" ]; then
    runs_json=$("$UPY" - "$RESULTS/scale.json" "$runs_json" <<'EOF'
import json, sys
old = json.load(open(sys.argv[1])).get("runs", [])
new = json.loads(sys.argv[2])
keys = {(r.get("size"), r.get("placement")) for r in new}
print(json.dumps([r for r in old if (r.get("size"), r.get("placement")) not in keys] + new))
EOF
)
  fi
  local best
  best=$("$UPY" "$UTIL" largest "$runs_json")
  local ok=false; [ -n "$best" ] && ok=true
  finish "$ok" "sizes ${sizes}; bf16, activation checkpointing, micro-batch $micro x seq $seq, host budget $host" \
    runs="$runs_json" largest="$best"
}

# --- report -----------------------------------------------------------------------------------
phase_report() {
  "$UPY" "$UTIL" report "$RESULTS" >"$OUT/report.md"
  cat "$OUT/report.md"
  finish true "report.md from $(ls "$RESULTS" | grep -v '^report' | tr '\n' ' ')"
}

say "device $device; $MACHINE"
"phase_$phase"
