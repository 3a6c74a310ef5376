#!/usr/bin/env bash
# The README's main command: installs what is missing, builds Strata and its Python module
# (making `import strata` work for the user), and trains the built-in 'tiny' GPT
# (configs/tiny.json) on the fortunes text for about a minute. Arguments are passed to
# strata-train, e.g.  tools/scripts/run.sh --config configs/cpu-offload.json --steps 50
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)

bash tools/scripts/setup.sh

export CCACHE_BASEDIR="$root"
export CCACHE_NOHASHDIR=1
build="${STRATA_BUILD_DIR:-build}"
echo "== configure and build ($build)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_PYTHON=ON >"$build.configure.log" 2>&1 ||
  { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j "${STRATA_JOBS:-$(nproc)}" --target strata-train strata-launch \
  strata-swapbench strata_python
# `import strata` from any directory: a .pth file in the user's site-packages names this build's
# package directory (no root needed; remove ~/.local/lib/python3*/site-packages/strata.pth to undo).
# shellcheck disable=SC1091
. "$build/strata-env.sh"
site=$("$STRATA_PYTHON" -m site --user-site)
mkdir -p "$site"
echo "$root/$build/python" >"$site/strata.pth"
echo "== import strata: $STRATA_PYTHON now finds $root/$build/python (via $site/strata.pth)"
echo "== strata-train $*"
exec "$build/bin/strata-train" --plot "$build/strata-train.svg" "$@"
