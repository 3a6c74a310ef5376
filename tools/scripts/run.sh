#!/usr/bin/env bash
# The README's main command: installs what is missing, pip-installs Strata into a venv of its own
# (.venv, made with Debian's /usr/bin/python3 and --system-site-packages, so that Debian's torch is
# the one it builds against and imports), and trains the built-in 'tiny' GPT (configs/tiny.json)
# on the fortunes text for about a minute with the venv's strata-train. Arguments are passed to
# strata-train, e.g.  tools/scripts/run.sh --config configs/cpu-offload.json --steps 50
# Then `source .venv/bin/activate` puts strata, its commands and that python3 first.
# Environment: STRATA_VENV (another venv folder), STRATA_JOBS (build jobs).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)

bash tools/scripts/setup.sh

export CCACHE_BASEDIR="$root"
export CCACHE_NOHASHDIR=1
venv="${STRATA_VENV:-$root/.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "== venv $venv (/usr/bin/python3, --system-site-packages: Debian's torch)"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
fi
echo "== pip install --no-build-isolation . into $venv (the first build takes minutes on 2 cores)"
# -v: pip then shows the build's own progress instead of one spinner for minutes; the whole
# log stays in build/pip-install.log.
mkdir -p build
set +e
"$venv/bin/python" -m pip install -v --no-build-isolation --no-deps --no-index "$root" 2>&1 |
  tee build/pip-install.log | grep --line-buffered -E '^ *(strata build:|\[[0-9]+/[0-9]+\]|Successfully)'
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  tail -40 build/pip-install.log
  echo "run.sh: pip install failed (exit $rc); the whole log is build/pip-install.log" >&2
  exit 1
fi
# An earlier run.sh put a strata.pth naming build/python into the user's site-packages; the venv
# replaces it.
old_pth=$(/usr/bin/python3 -m site --user-site)/strata.pth
if [ -f "$old_pth" ] && grep -q "^$root/" "$old_pth"; then rm -f "$old_pth"; fi
echo "== Python: source $venv/bin/activate   (then: python3 examples/train_gpt2.py)"
echo "== DeepSpeed scripts on Strata: $venv/bin/pip install --no-build-isolation ./python"
echo "== strata-train $*"
exec "$venv/bin/strata-train" --plot build/strata-train.svg "$@"
