#!/usr/bin/env bash
# NVMe engine vs fio (io_uring, O_DIRECT) on one 2 GiB file, the four reference settings.
# Usage: tools/scripts/bench_nvme.sh [DIR] [BUILD_DIR] [REPEAT]
# Each line is strata-swapbench's JSON: gbps (ours, median), fio_gbps, ratio_vs_fio.
set -euo pipefail
dir=${1:-/var/tmp/strata-bench}
build=${2:-build}
repeat=${3:-3}
mkdir -p "$dir"
bin="$build/bin/strata-swapbench"
for cfg in "1MiB 32" "8MiB 64"; do
  set -- $cfg
  for rw in write read; do
    "$bin" nvme --path "$dir" --size 2GiB --block-size "$1" --queue-depth "$2" --rw "$rw" \
      --fio --repeat "$repeat" --json
  done
done
