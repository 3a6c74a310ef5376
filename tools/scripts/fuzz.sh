#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan + coverage on the libraries they link too) in
# build-fuzz and runs each for N seconds on its committed corpus, tests/fuzz/corpus/<target>/.
# New interesting inputs go to build-fuzz/corpus/<target>/ (not the committed corpus); crashes
# to build-fuzz/artifacts/<target>/ and fail the script. Add a reproducer to the committed corpus
# once the bug is fixed: fuzz_corpus_replay_test then replays it in every CI build.
#
#   tools/scripts/fuzz.sh             # 60 s per target
#   tools/scripts/fuzz.sh 600         # 10 min per target
#   STRATA_FUZZ_TARGETS="config" tools/scripts/fuzz.sh 30
#
# Needs clang and libclang-rt-14-dev; `tools/scripts/setup.sh --fuzz` installs them (run first).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
seconds="${1:-60}"
jobs="${STRATA_JOBS:-$(nproc)}"
nice_level="${STRATA_NICE:-0}"
dir="${STRATA_FUZZ_BUILD:-build-fuzz}"
read -r -a targets <<<"${STRATA_FUZZ_TARGETS:-config swap_index manifest profile}"

bash tools/scripts/setup.sh --fuzz
if ! command -v clang++ >/dev/null 2>&1; then
  echo "fuzz.sh: clang++ not found after setup: install clang and libclang-rt-14-dev" >&2
  exit 1
fi

export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/strata-ccache}"
export CCACHE_BASEDIR="$root"
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

flags="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
nice -n "$nice_level" cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DSTRATA_CUDA=OFF -DSTRATA_FUZZ=ON \
  -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" >"$dir.configure.log" 2>&1 ||
  { cat "$dir.configure.log"; exit 1; }
bins=()
for t in "${targets[@]}"; do bins+=("${t}_fuzz"); done
nice -n "$nice_level" cmake --build "$dir" -j "$jobs" --target "${bins[@]}"

status=0
for t in "${targets[@]}"; do
  mkdir -p "$dir/corpus/$t" "$dir/artifacts/$t"
  echo "== $t: ${seconds} s"
  # -timeout: one input taking over 10 s is a hang; -rss_limit_mb bounds allocations.
  if ! nice -n "$nice_level" "$dir/bin/${t}_fuzz" -max_total_time="$seconds" -timeout=10 \
       -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$dir/artifacts/$t/" \
       "$dir/corpus/$t" "tests/fuzz/corpus/$t" 2>"$dir/$t.log"; then
    echo "== $t: FAILED, reproducer in $dir/artifacts/$t/:" >&2
    tail -40 "$dir/$t.log" >&2
    status=1
  fi
  grep -E "^stat::(number_of_executed_units|peak_rss_mb|new_units_added)|cov: .* ft:" "$dir/$t.log" | tail -4
done
exit $status
