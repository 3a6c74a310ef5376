#!/usr/bin/env bash
# The README's main command: installs what is missing, builds Strata, and trains the built-in
# 'tiny' GPT (configs/tiny.json) on the fortunes text for about a minute. Arguments are passed to
# strata-train, e.g.  tools/scripts/run.sh --config configs/cpu-offload.json --steps 50
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)

bash tools/scripts/setup.sh

export CCACHE_BASEDIR="$root"
export CCACHE_NOHASHDIR=1
build="${STRATA_BUILD_DIR:-build}"
echo "== configure and build ($build)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "${STRATA_JOBS:-$(nproc)}" --target strata-train strata-launch \
  strata-swapbench
echo "== strata-train $*"
exec "$build/bin/strata-train" --plot "$build/strata-train.svg" "$@"
