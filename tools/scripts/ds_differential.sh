#!/usr/bin/env bash
# By-hand differential against real DeepSpeed (not CI): runs one corpus script
# (tests/data/ds-scripts/FOLDER, unmodified) under DeepSpeed in the peer root that
# ../shared/peers/deepspeed-cpu/setup.sh builds, and under Strata through this build's
# `deepspeed` launcher, with the same fake data and the same torch seed (STRATA_SEED, set by
# tests/python/ds_corpus/sitecustomize.py before the script runs), and prints both runs' loss
# lines side by side with their largest difference.
#
#   tools/scripts/ds_differential.sh [--build DIR] [--ranks N] [--pattern REGEX] FOLDER ARGS...
#
#   --build DIR     the Strata build (default build-ci/cuda-off)
#   --ranks N       ranks for both launchers (default 1)
#   --pattern RE    the loss line; its first group is the value (default: the CIFAR script's)
# Environment: ROOT (the peer root, default /var/tmp/strata-peer/trixie), STRATA_FAKE_DATA
# (default 64), STRATA_SEED (default 0). Needs root (chroot). Exit status: 0 both ran, 1 one
# failed (its log is named), 2 bad arguments.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../.." && pwd)
BUILD="$HERE/build-ci/cuda-off" RANKS=1 PATTERN='\[ *[0-9]+, *[0-9]+\] loss: *([0-9.eE+-]+)'
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --pattern) PATTERN=$2; shift 2 ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || { echo "ds_differential: name a corpus folder (see --help)" >&2; exit 2; }
FOLDER=$1; shift
SRC="$HERE/tests/data/ds-scripts/$FOLDER"
[ -d "$SRC" ] || { echo "ds_differential: no corpus folder $SRC" >&2; exit 2; }
ROOT=${ROOT:-/var/tmp/strata-peer/trixie}
[ -f "$ROOT/opt/.ds-installed" ] || { echo "ds_differential: no DeepSpeed peer at $ROOT: run ../shared/peers/deepspeed-cpu/setup.sh" >&2; exit 2; }
[ -x "$BUILD/deepspeed-compat/bin/deepspeed" ] || { echo "ds_differential: no Strata build at $BUILD" >&2; exit 2; }
FAKE=${STRATA_FAKE_DATA:-64} SEED=${STRATA_SEED:-0}
OUT=$(mktemp -d /tmp/ds-diff.XXXXXX)
"$HERE/../shared/peers/deepspeed-cpu/chroot-mounts.sh" up "$ROOT" >/dev/null 2>&1 || true
rm -rf "$ROOT/opt/diff" && mkdir -p "$ROOT/opt/diff"
cp -r "$SRC" "$ROOT/opt/diff/run" && cp -r "$HERE/tests/python/ds_corpus" "$ROOT/opt/diff/fake"
cp -r "$SRC" "$OUT/strata-run"
status=0
chroot "$ROOT" bash -c "cd /opt/diff/run && env DS_ACCELERATOR=cpu USE_LIBUV=0 PYTHONUNBUFFERED=1 \
  PYTHONPATH=/opt/diff/fake STRATA_FAKE_DATA=$FAKE STRATA_SEED=$SEED \
  deepspeed --num_gpus $RANKS --master_port 29561 $*" >"$OUT/deepspeed.log" 2>&1 || {
  echo "DeepSpeed failed: $OUT/deepspeed.log"; status=1; }
(cd "$OUT/strata-run" && env PYTHONPATH="$HERE/tests/python/ds_corpus:$BUILD/deepspeed-compat:$BUILD/python" \
  STRATA_FAKE_DATA=$FAKE STRATA_SEED=$SEED PYTHONUNBUFFERED=1 \
  "$BUILD/deepspeed-compat/bin/deepspeed" --num_gpus "$RANKS" "$@") >"$OUT/strata.log" 2>&1 || {
  echo "Strata failed: $OUT/strata.log"; status=1; }
python3 - "$OUT/deepspeed.log" "$OUT/strata.log" "$PATTERN" <<'PY'
import re, sys
def losses(path):
    return [float(m.group(1)) for m in re.finditer(sys.argv[3], open(path, errors="replace").read())]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
print(f"{'step':>4}  {'DeepSpeed':>10}  {'Strata':>10}")
for i in range(max(len(a), len(b))):
    x = f"{a[i]:10.4f}" if i < len(a) else " " * 10
    y = f"{b[i]:10.4f}" if i < len(b) else " " * 10
    print(f"{i:4d}  {x}  {y}")
n = min(len(a), len(b))
if n:
    print(f"max |difference| over {n} lines: {max(abs(a[i] - b[i]) for i in range(n)):.4g}")
PY
echo "logs: $OUT"
exit $status
