#!/usr/bin/env bash
# Packs what a lent GPU machine lacks to build Strata, run here before a GPU lease: the Debian
# packages of the build's libraries and headers (liburing, oneTBB, hwloc, nlohmann-json, CLI11,
# GoogleTest, Google Benchmark), the fortunes text the tools train on by default, and fio with
# the shared libraries it loads, downloaded into
# .gpu-pack/ (git-ignored). The GPU machine reaches no package registry; its image brings CUDA,
# a pip torch (with its LibTorch and NCCL), CMake, ninja and pybind11. Then
#
#   device run, carry [".gpu-pack"]:  bash tools/scripts/gpu-check.sh build   (then test, bench, ...)
#
# gpu-check.sh unpacks the .debs into its build folder (never into /) and uses them only for what
# the machine does not have itself. Idempotent: a second run only fetches what is missing.
#
#   tools/scripts/gpu-pack.sh            # into .gpu-pack/
#   tools/scripts/gpu-pack.sh --check    # list what is packed and its size, fetch nothing
set -euo pipefail
cd "$(dirname "$0")/../.."
PACK=${STRATA_GPU_PACK:-.gpu-pack}
LIMIT_MIB=40  # the whole tree that travels is capped at 64 MiB; the source is ~3 MiB of it

# The build's libraries, their headers and CMake/pkg-config files (the runtime .so's packages too).
BUILD_PKGS=(
  liburing2 liburing-dev
  libtbb12 libtbbmalloc2 libtbbbind-2-5 libtbb-dev
  libhwloc15 libhwloc-dev
  nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev libbenchmark1debian libbenchmark-dev
)
# The text strata-train, the example and the tests train on by default (/usr/share/games/fortunes).
DATA_PKGS=(fortunes-min fortunes)
# Libraries any glibc >= 2.36 machine has already; fio's own are packed, these are not.
BASE_RE='^(libc6|libgcc-s1|libstdc\+\+6|zlib1g|libzstd1|liblzma5|libbz2-1\.0|libcrypt1|libselinux1|libpcre2-8-0|libuuid1|libblkid1|libudev1|libssl3|libffi8|libgmp10)$'

if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
if [ "${1:-}" = "--check" ]; then
  [ -d "$PACK/debs" ] || { echo "gpu-pack: nothing packed yet ($PACK/debs missing); run without --check"; exit 1; }
  ls -1 "$PACK/debs"
  du -sh "$PACK"
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "gpu-pack: unknown argument '$1' (see --help)" >&2
  exit 2
fi

command -v apt-get >/dev/null || { echo "gpu-pack: needs apt-get (Debian or a derivative)" >&2; exit 1; }
bash tools/scripts/setup.sh >/dev/null  # fio (whose libraries are read below) comes with it

# fio's shared libraries, as this machine resolves them, mapped to their packages.
fio_pkgs=(fio)
owner() {  # the package that ships a library; merged /usr makes dpkg know /lib/... or /usr/lib/...
  local real; real=$(readlink -f "$1")
  { dpkg -S "$real" || dpkg -S "${real#/usr}" || dpkg -S "$(basename "$real")"; } 2>/dev/null |
    head -1 | cut -d: -f1
}
while read -r lib; do
  pkg=$(owner "$lib") || true
  [ -n "$pkg" ] && ! [[ "$pkg" =~ $BASE_RE ]] && fio_pkgs+=("$pkg")
done < <(ldd "$(command -v fio)" | awk '/=> \//{print $3}')
mapfile -t fio_pkgs < <(printf '%s\n' "${fio_pkgs[@]}" | sort -u)

mkdir -p "$PACK/debs"
# The pack must be ignored by git, or it would count as untracked source and bloat commits.
if ! git check-ignore -q "$PACK/debs" 2>/dev/null; then
  echo "gpu-pack: $PACK is not ignored by git; add it to .gitignore" >&2
  exit 1
fi
want=("${BUILD_PKGS[@]}" "${DATA_PKGS[@]}" "${fio_pkgs[@]}")
missing=()
for p in "${want[@]}"; do
  compgen -G "$PACK/debs/${p}_*.deb" >/dev/null || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu-pack: downloading ${#missing[@]} packages: ${missing[*]}"
  # apt-get download writes into the current directory; _apt cannot write into root's folders,
  # which only costs a warning.
  (cd "$PACK/debs" && apt-get download "${missing[@]}" 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
  for p in "${missing[@]}"; do
    compgen -G "$PACK/debs/${p}_*.deb" >/dev/null ||
      { echo "gpu-pack: $p did not download (run 'apt-get update' and retry)" >&2; exit 1; }
  done
fi
printf '%s\n' "${BUILD_PKGS[@]}" >"$PACK/build-packages.txt"
printf '%s\n' "${fio_pkgs[@]}" >"$PACK/fio-packages.txt"
size_mib=$(du -sm "$PACK" | cut -f1)
echo "gpu-pack: ${#want[@]} packages in $PACK (${size_mib} MiB): carry it with the run, e.g. carry [\"$PACK\"]"
if [ "$size_mib" -gt "$LIMIT_MIB" ]; then
  echo "gpu-pack: $PACK is ${size_mib} MiB, over the ${LIMIT_MIB} MiB this script allows itself of the 64 MiB a run carries" >&2
  exit 1
fi
