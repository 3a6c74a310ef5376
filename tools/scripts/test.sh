#!/usr/bin/env bash
# The README's test command: installs what is missing, builds Strata with CUDA on when nvcc is
# present (every .cu file compiles even without a GPU), runs the CPU test suite (the C++ suites and
# the Python ones under tests/python, through ctest), pip-installs the project into a venv and
# tests the installed packages from outside the tree, checks the thread rules with clang, then
# builds and tests again with -DSTRATA_CUDA=OFF. GPU-only tests (label gpu) run only where a GPU exists.
#
#   tools/scripts/test.sh                  # everything
#   STRATA_TEST_CUDA_OFF=0 tools/scripts/test.sh   # skip the CUDA=OFF pass
#   STRATA_CTEST_ARGS="-L nvme" tools/scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)

bash tools/scripts/setup.sh


export CCACHE_BASEDIR="$root"
export CCACHE_NOHASHDIR=1
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
jobs="${STRATA_JOBS:-$(nproc)}"

gpu_label_args=(-LE gpu)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpu_label_args=()   # a GPU is present: run the gpu-labelled tests too
fi

run_pass() {
  local dir="$1"; shift
  local t0=$(date +%s)
  echo "== configure $dir ($*)"
  # STRATA_PYTHON=ON: the Python module and its pytest suite are part of every test run.
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_PYTHON=ON "$@" \
    >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; exit 1; }
  echo "== build $dir"
  cmake --build "$dir" -j "$jobs"
  local t1=$(date +%s)
  echo "== test $dir"
  (cd "$dir" && ctest --output-on-failure -j "$jobs" "${gpu_label_args[@]}" ${STRATA_CTEST_ARGS:-})
  # The DeepSpeed script corpus's counts (test_ds_corpus prints them; ctest keeps passing output
  # in its log only).
  grep -h "^corpus: .* scripts from" "$dir/Testing/Temporary/LastTest.log" 2>/dev/null || true
  local t2=$(date +%s)
  echo "== $dir: build $((t1 - t0)) s, tests $((t2 - t1)) s"
}

# The pip pass: what a Python user does. A venv that sees Debian's torch (--system-site-packages),
# `pip install --no-build-isolation .` and `./python` into it (offline: the project's own build
# backend), then, from a folder outside the tree, the installed packages' own test and the
# DeepSpeed compatibility suite against them. Run after the CUDA=AUTO pass: the same compiler
# flags, so ccache serves the objects.
pip_pass() {
  local venv="$root/build-ci/venv" t0=$(date +%s) away
  echo "== pip pass ($venv)"
  rm -rf "$venv"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  STRATA_BUILD_DIR="$root/build-ci/pip" STRATA_JOBS="$jobs" \
    "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps --no-index "$root"
  "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps --no-index "$root/python"
  away=$(mktemp -d)
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  (cd "$away" && STRATA_PIP_VENV="$venv" STRATA_DS_COMPAT="$site" STRATA_CPU_DEVICE=strict \
     STRATA_BIN="$venv/bin" PATH="$venv/bin:$PATH" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
     "$root/tests/python/test_pip_install.py" "$root/tests/python/test_deepspeed_api.py")
  rm -rf "$away"
  echo "== pip pass: $(( $(date +%s) - t0 )) s"
}

# The thread rules (runtime/base/thread_annotations.h) checked by clang: the floors the engine
# is built from and the engine itself with -Wthread-safety -Werror=thread-safety, and a file of
# deliberate violations that must fail to compile, or the check proves nothing.
clang_pass() {
  local dir="$root/build-ci/clang" t0=$(date +%s)
  echo "== clang thread-safety pass ($dir)"
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_C_COMPILER=clang -DSTRATA_PYTHON=OFF -DSTRATA_BUILD_TESTS=OFF -DSTRATA_CUDA=OFF \
    "-DCMAKE_CXX_FLAGS=-Wthread-safety -Werror=thread-safety" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; exit 1; }
  cmake --build "$dir" -j "$jobs" --target strata_tiers strata_state strata_engine
  if clang++ -std=c++17 -I"$root" -Wthread-safety -Werror=thread-safety -fsyntax-only \
       "$root/tests/runtime/thread_safety_violation.cc" 2>/dev/null; then
    echo "clang pass: tests/runtime/thread_safety_violation.cc compiled: the analysis checks nothing" >&2
    exit 1
  fi
  echo "== clang pass: $(( $(date +%s) - t0 )) s"
}

mkdir -p build-ci
run_pass build-ci/cuda-auto -DSTRATA_CUDA=AUTO
pip_pass
clang_pass
if [ "${STRATA_TEST_CUDA_OFF:-1}" = "1" ]; then
  run_pass build-ci/cuda-off -DSTRATA_CUDA=OFF
fi
