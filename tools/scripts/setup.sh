#!/usr/bin/env bash
# Installs everything Strata needs on Debian bookworm (or a derivative). Idempotent: when every
# package is already present it only checks and returns in about a second.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libgloo-dev libopenblas0-pthread
  liburing-dev libtbb-dev libhwloc-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev
  fio fortunes fortunes-min
  python3-dev python3-setuptools python3-torch python3-torchvision python3-pybind11 python3-pytest
  python3-venv python3-pip
  # What the public DeepSpeed scripts of tests/data/ds-scripts import besides torch.
  python3-matplotlib python3-mpi4py python3-tqdm
  clang
)
# Extras for the by-hand jobs: `setup.sh --fuzz` adds clang's libFuzzer runtime.
if [ "${1:-}" = "--fuzz" ]; then
  PACKAGES+=(libclang-rt-14-dev)
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "setup: not root and no sudo; install these packages by hand: ${PACKAGES[*]}" >&2
    exit 1
  fi
fi

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$status" = "install ok installed" ] || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
