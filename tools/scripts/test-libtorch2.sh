#!/usr/bin/env bash
# Builds Strata against LibTorch 2.x and runs its CPU test suite (C++ and Python), inside a Debian
# root made with debootstrap: trixie's libtorch-dev and python3-torch are 2.6, sid's are 2.14,
# where bookworm (CI, tools/scripts/setup.sh) has 1.13. The source tree is bind-mounted read-only;
# the build and the root stay under $STRATA_TRIXIE_DIR (default /var/tmp/strata-<suite>) between
# runs, so a second run only rebuilds.
#
#   sudo tools/scripts/test-libtorch2.sh                 # trixie, the whole CPU suite
#   sudo tools/scripts/test-libtorch2.sh --hf            # sid + transformers + accelerate: the
#                                                        # Trainer and accelerate tests only
#   sudo tools/scripts/test-libtorch2.sh --suite sid -- -R python_  # any suite, any ctest filter
#   STRATA_TRIXIE_DIR=/big/disk/trixie tools/scripts/test-libtorch2.sh
#
# --hf exists because Hugging Face's transformers (5.x, which needs torch >= 2.4) and accelerate
# are packaged in Debian sid only, and PyPI is out of reach here: it is the one place off a GPU
# machine where tests/python/test_hf_trainer.py runs instead of reporting itself skipped.
#
# It takes about 30 minutes on 2 cores the first time (the root: ~1-5, packages: ~5, the build:
# ~15, the tests: ~3). Not part of `.ci/run`, which must stay well under its time limit.
set -euo pipefail

SUITE=trixie
EXTRA_PACKAGES=""
CTEST_ARGS=(-LE gpu)
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) SUITE=${2:?--suite needs a Debian suite name, e.g. trixie or sid}; shift 2 ;;
    --hf)
      SUITE=sid
      EXTRA_PACKAGES="python3-transformers python3-accelerate"
      CTEST_ARGS=(-R '^python_hf_trainer$')
      shift ;;
    --) shift; CTEST_ARGS=("$@"); break ;;
    -h|--help) usage; exit 0 ;;
    *) echo "test-libtorch2: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

SRC=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${STRATA_TRIXIE_DIR:-/var/tmp/strata-$SUITE}
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
  echo "test-libtorch2: debootstrap $SUITE into $ROOT"
  rm -rf "$ROOT"
  debootstrap --variant=minbase "$SUITE" "$ROOT" "$MIRROR"
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
# sid's Release file carries a Valid-Until date (trixie's does not); a mirror that serves a frozen
# copy, or a machine whose clock runs ahead, makes apt refuse it as expired. The root is a throwaway
# test bed, so apt may use it anyway.
echo 'Acquire::Check-Valid-Until "false";' > "$ROOT/etc/apt/apt.conf.d/99strata-test-root"

# Inside the root: the same package list as on bookworm (setup.sh) plus the extras, then a clean
# configure that lets find_package(Torch) find the suite's LibTorch, the build, and the tests.
ctest_args=$(printf '%q ' "${CTEST_ARGS[@]}")
chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root CI="${CI:-}" \
  EXTRA_PACKAGES="$EXTRA_PACKAGES" CTEST_ARGS="$ctest_args" \
  bash -euo pipefail -c '
    bash /src/tools/scripts/setup.sh
    if [ -n "$EXTRA_PACKAGES" ]; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $EXTRA_PACKAGES
    fi
    python3 -c "import torch; print(\"test-libtorch2: torch\", torch.__version__)"
    cmake -S /src -B /build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_CUDA=OFF \
      -DSTRATA_PYTHON_EXECUTABLE=/usr/bin/python3
    cmake --build /build -j"$(nproc)"
    cd /build
    eval "ctest $CTEST_ARGS -j$(nproc) --output-on-failure"
  '
echo "test-libtorch2: $SUITE build and the selected tests passed (ctest ${CTEST_ARGS[*]})"
