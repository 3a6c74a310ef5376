#!/usr/bin/env bash
# Builds Strata against LibTorch 2.x and runs its CPU test suite (C++ and Python), inside a Debian
# trixie root made with debootstrap: trixie's libtorch-dev and python3-torch are 2.6, where
# bookworm (CI, tools/scripts/setup.sh) has 1.13. The source tree is bind-mounted read-only; the
# build and the root stay under $STRATA_TRIXIE_DIR between runs, so a second run only rebuilds.
#
#   sudo tools/scripts/test-libtorch2.sh            # root, debootstrap and network to Debian
#   STRATA_TRIXIE_DIR=/big/disk/trixie tools/scripts/test-libtorch2.sh
#
# It takes about 30 minutes on 2 cores the first time (the root: ~5, packages: ~5, the build:
# ~15, the tests: ~3). Not part of `.ci/run`, which must stay well under its time limit.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${STRATA_TRIXIE_DIR:-/var/tmp/strata-trixie}
ROOT=$DIR/root
MIRROR=${STRATA_DEBIAN_MIRROR:-http://deb.debian.org/debian}

if [ "$(id -u)" -ne 0 ]; then
  echo "test-libtorch2: needs root (debootstrap, chroot, bind mounts); run it with sudo" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null; then
  echo "test-libtorch2: installing debootstrap"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
fi

mkdir -p "$DIR"
if [ ! -x "$ROOT/usr/bin/apt-get" ]; then
  echo "test-libtorch2: debootstrap trixie into $ROOT"
  rm -rf "$ROOT"
  debootstrap --variant=minbase trixie "$ROOT" "$MIRROR"
fi

mounts=()
cleanup() {
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[$i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
bind() {  # bind <host path> <path in the root> [ro]
  mkdir -p "$ROOT$2"
  mount --bind "$1" "$ROOT$2"
  mounts+=("$ROOT$2")
  if [ "${3:-}" = ro ]; then mount -o remount,bind,ro "$ROOT$2"; fi
}
bind /proc /proc
bind /sys /sys
bind /dev /dev
bind "$SRC" /src ro
# The tests' shared fixtures sit beside the checkout when CI runs (../shared).
if [ -d "$SRC/../shared" ]; then bind "$(cd "$SRC/../shared" && pwd)" /shared ro; fi
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"

# Inside the root: the same package list as on bookworm (setup.sh), then a clean configure that
# lets find_package(Torch) find trixie's LibTorch, the build, and the CPU suite.
chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root CI="${CI:-}" \
  bash -euo pipefail -c '
    bash /src/tools/scripts/setup.sh
    python3 -c "import torch; print(\"test-libtorch2: torch\", torch.__version__)"
    cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_CUDA=OFF \
      -DSTRATA_PYTHON_EXECUTABLE=/usr/bin/python3
    cmake --build /build -j"$(nproc)"
    cd /build
    ctest -LE gpu -j"$(nproc)" --output-on-failure
  '
echo "test-libtorch2: LibTorch 2.x build and CPU suite passed"
