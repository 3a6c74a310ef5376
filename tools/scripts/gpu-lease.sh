#!/usr/bin/env bash
# Runs several gpu-check.sh phases in one device command, inside one deadline, and packs what
# they wrote into the few files a lease brings back. A short lease (15 minutes of device time,
# the machine's start included) has room for one or two commands, not one per phase.
#
#   tools/scripts/gpu-lease.sh [--total SECONDS] PHASE[:CAP] [FLAGS...] [PHASE[:CAP] [FLAGS...]]...
#
#   --total S    the whole command's deadline (default 560: inside a 10-minute device command)
#   PHASE        build, pip, test, bench, scale or report, run in the order given
#   :CAP         at most CAP seconds for that phase; without it, a phase gets what is left
#                (less 20 s kept for the report and the packing)
#   FLAGS        passed to the phase before them, e.g. `bench --steps 4 scale --sizes 1.3b`
#
# A failed build ends the run (the other phases need it); a failed test or bench does not.
# Back in $OUT: report.md and lease.tar.gz (every phase's JSON and log, and the runs' own
# outputs under build-gpu/work). Environment as gpu-check.sh's (STRATA_GPU_TARGETS, PYTHON, ...).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
CHECK="$ROOT/tools/scripts/gpu-check.sh"
BUILD=${STRATA_GPU_BUILD:-$ROOT/build-gpu}
total=560
phases=() caps=() flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --total) total=${2:-}; shift 2 ;;
    --total=*) total=${1#*=}; shift ;;
    build|build:*|pip|pip:*|test|test:*|bench|bench:*|scale|scale:*|report|report:*)
      phases+=("${1%%:*}")
      if [[ "$1" == *:* ]]; then caps+=("${1#*:}"); else caps+=(""); fi
      flags+=("")
      shift ;;
    *)
      if [ ${#phases[@]} -eq 0 ]; then
        echo "gpu-lease: '$1' before any phase: name a phase first (build, pip, test, bench, scale, report)" >&2
        exit 2
      fi
      flags[-1]="${flags[-1]} $1"; shift ;;
  esac
done
[[ "$total" =~ ^[1-9][0-9]*$ ]] || { echo "gpu-lease: --total=$total: seconds, a whole number" >&2; exit 2; }
[ ${#phases[@]} -gt 0 ] || { echo "gpu-lease: name at least one phase (see --help)" >&2; exit 2; }
for c in "${caps[@]}"; do
  [ -z "$c" ] || [[ "$c" =~ ^[1-9][0-9]*$ ]] || { echo "gpu-lease: phase cap '$c': seconds, a whole number" >&2; exit 2; }
done

FINAL=${OUT:-$BUILD/out}
STAGE="$BUILD/lease-out"  # the phases' own $OUT; packed into $FINAL at the end
rm -rf "$STAGE"; mkdir -p "$STAGE" "$FINAL"
T0=$(date +%s)
left() { echo $(( total - ($(date +%s) - T0) )); }
reserve=20
status=0
for i in "${!phases[@]}"; do
  p=${phases[$i]} cap=${caps[$i]}
  budget=$(( $(left) - reserve ))
  [ "$p" = report ] && budget=$(( $(left) ))
  [ -n "$cap" ] && [ "$cap" -lt "$budget" ] && budget=$cap
  if [ "$budget" -lt 15 ]; then
    echo "[gpu-lease] $p: skipped, ${budget}s left of the ${total}s deadline"
    status=1; continue
  fi
  echo "[gpu-lease $(( $(date +%s) - T0 ))s] $p (${budget}s)${flags[$i]}"
  # shellcheck disable=SC2086  # the flags are words the caller typed
  OUT="$STAGE" STRATA_PHASE_SECONDS="$budget" timeout "$(( budget + 10 ))" bash "$CHECK" "$p" ${flags[$i]}
  rc=$?
  if [ $rc -ne 0 ]; then
    status=1
    echo "[gpu-lease] $p exited $rc"
    [ "$p" = build ] && { echo "[gpu-lease] the build failed: the other phases need it"; break; }
  fi
done
[ -f "$STAGE/report.md" ] && cp "$STAGE/report.md" "$FINAL/report.md"
tar -C "$BUILD" -czf "$FINAL/lease.tar.gz" --exclude='*.svg' lease-out results work 2>/dev/null
echo "[gpu-lease $(( $(date +%s) - T0 ))s] packed: $FINAL/lease.tar.gz ($(du -h "$FINAL/lease.tar.gz" | cut -f1))"
exit $status
