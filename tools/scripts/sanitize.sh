#!/usr/bin/env bash
# Sanitizer runs of the CPU tests that do not load LibTorch (LibTorch is not instrumented, so a
# test linking strata::torch reports false positives or needs the whole of torch rebuilt).
# Too slow for CI; run by hand before a release or after touching threads, I/O or memory code.
#
#   tools/scripts/sanitize.sh            # address (ASan + UBSan) then thread (TSan)
#   tools/scripts/sanitize.sh address    # build-asan only
#   tools/scripts/sanitize.sh thread     # build-tsan only
#   STRATA_JOBS=2 STRATA_NICE=15 tools/scripts/sanitize.sh all
#
# Covered: status, config, device conformance, partitioner, tier manager, tier conformance, the
# pinned pool, the io_uring / fallback I/O engines, the swap store, the NVMe tier, CPU Adam, the
# loss scaler, the CPU kernels (ASan only: see Note [TSan and oneTBB]) and the fuzz-corpus replay. Exit status: non-zero when a build
# fails, a test fails or a sanitizer reports anything (every report aborts the test).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
mode="${1:-all}"
jobs="${STRATA_JOBS:-$(nproc)}"
nice_level="${STRATA_NICE:-0}"

# One list, used for both the build targets and the ctest selection. None links strata::torch.
TESTS=(
  status_test config_test device_conformance_test partitioner_test tier_manager_test tier_test
  host_pinned_pool_test nvme_io_engine_test nvme_swap_store_test nvme_tier_test
  cpu_adam_test loss_scaler_test kernels_cpu_test fuzz_corpus_replay_test
)

case "$mode" in
  address|thread|all) ;;
  *) echo "sanitize.sh: unknown mode '$mode': use address, thread or all" >&2; exit 2 ;;
esac

export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/strata-ccache}"
export CCACHE_BASEDIR="$root"
export CCACHE_NOHASHDIR=1
# Every report is fatal and names its stack; leaks are checked at exit.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"

run_one() {
  local name="$1" dir="$2"; shift 2
  local t0=$(date +%s)
  echo "== $name: configure $dir"
  nice -n "$nice_level" cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DSTRATA_CUDA=OFF "$@" >"$dir.configure.log" 2>&1 || { cat "$dir.configure.log"; return 1; }
  # Only the tests' own targets: the LibTorch parts of the tree are not built at all.
  local targets=()
  for t in "${TESTS[@]}"; do
    # Note [TSan and oneTBB]: TBB hands tasks between workers inside libtbb.so, which is not
    # built with TSan, so every parallel body's reads of what its spawner wrote are reported as
    # races. Suppressing TBB's frames would hide races in the bodies too, so the TBB-parallel
    # suites (CPU Adam, CPU kernels) are left to ASan; they are deterministic and compared bit
    # for bit against the scalar path, which a race would break.
    if [ "$name" = thread ] && { [ "$t" = cpu_adam_test ] || [ "$t" = kernels_cpu_test ]; }; then
      echo "== $name: $t skipped (oneTBB is not TSan-instrumented; see the note in this script)"
      continue
    fi
    if grep -q "build $t:\|build bin/$t:" "$dir/build.ninja" 2>/dev/null ||
       ninja -C "$dir" -t targets all 2>/dev/null | grep -q "^bin/$t:\|^$t:"; then
      targets+=("$t")
    else
      echo "== $name: no target $t in this tree, skipped"
    fi
  done
  echo "== $name: build ${#targets[@]} tests"
  nice -n "$nice_level" cmake --build "$dir" -j "$jobs" --target "${targets[@]}" || return 1
  local t1=$(date +%s)
  local regex="^($(IFS='|'; echo "${targets[*]}"))\$"
  echo "== $name: test"
  # Called as `run_one ... || status=1`, where set -e is off: keep ctest's status by hand.
  local rc=0
  (cd "$dir" && nice -n "$nice_level" ctest --output-on-failure -j "$jobs" -R "$regex") || rc=$?
  local t2=$(date +%s)
  echo "== $name: build $((t1 - t0)) s, tests $((t2 - t1)) s, ctest status $rc"
  return $rc
}

status=0
if [ "$mode" = address ] || [ "$mode" = all ]; then
  run_one address build-asan -DSTRATA_SANITIZE_ADDRESS=ON -DSTRATA_SANITIZE_THREAD=OFF || status=1
fi
if [ "$mode" = thread ] || [ "$mode" = all ]; then
  run_one thread build-tsan -DSTRATA_SANITIZE_THREAD=ON -DSTRATA_SANITIZE_ADDRESS=OFF || status=1
fi
exit $status
