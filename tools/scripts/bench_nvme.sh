#!/usr/bin/env bash
# NVMe engine vs fio (io_uring, O_DIRECT) on one 2 GiB file, the four reference settings.
# Usage: tools/scripts/bench_nvme.sh [DIR] [BUILD_DIR] [REPEAT] [extra swapbench flags...]
#   e.g. tools/scripts/bench_nvme.sh /var/tmp/strata-bench build 4 --no-huge-pages
# Each line is strata-swapbench's JSON: gbps (ours, median), fio_gbps, ratio_vs_fio, the runs.
set -euo pipefail
dir=${1:-/var/tmp/strata-bench}
build=${2:-build}
repeat=${3:-3}
shift $(( $# < 3 ? $# : 3 ))
extra=("$@")
mkdir -p "$dir"
bin="$build/bin/strata-swapbench"
for cfg in "1MiB 32" "8MiB 64"; do
  read -r bs qd <<<"$cfg"
  for rw in write read; do
    "$bin" nvme --path "$dir" --size 2GiB --block-size "$bs" --queue-depth "$qd" --rw "$rw" \
      --fio --repeat "$repeat" --json "${extra[@]}"
  done
done
