#!/usr/bin/env bash
# Fetch Debian's NVIDIA 535 kernel-module source once and cache it under .cache/nvidia-src/.
# Prints "<path> <sha256> <version>" of the module tarball.
#
# What this is: NVIDIA's *proprietary* kernel module tree (interface layer in source plus the
# prebuilt nv-kernel.o), the same Kbuild tree the .run carries under kernel/. It is NOT the
# open-gpu-kernel-modules tree: bookworm has no nvidia-open-kernel-source (it starts in trixie,
# at 550.x). Tests and bench/driver_ccache.py build it (spec nvidia.open: false) because it goes
# through the same Makefile/Kbuild/conftest path against real Debian headers. The twin root
# already carries it at /usr/src/nvidia-kernel.tar.xz; this script is for a machine without one.
# apt runs with a private sources list and state dir: the machine's own apt config is untouched.
set -euo pipefail
PKG=${PKG:-nvidia-kernel-source}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${NVIDIA_SRC_CACHE:-$ROOT/.cache/nvidia-src}
mkdir -p "$CACHE"
if ! ls "$CACHE"/"$PKG"_*.deb >/dev/null 2>&1; then
  APT="$CACHE/apt"; mkdir -p "$APT/lists/partial" "$APT/archives/partial"
  cat > "$APT/sources.list" <<LIST
deb http://deb.debian.org/debian bookworm non-free
deb http://deb.debian.org/debian bookworm-updates non-free
deb http://deb.debian.org/debian-security bookworm-security non-free
LIST
  opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT" -o "Dir::Cache::Archives=$APT/archives"
        -o Debug::NoLocking=1 -q)
  apt-get "${opts[@]}" update >&2
  (cd "$CACHE" && apt-get "${opts[@]}" download "$PKG" >&2)
fi
DEB=$(printf '%s\n' "$CACHE"/"$PKG"_*.deb | sort -V | tail -n 1)
[ -f "$DEB" ] || { echo "pvegpu: no $PKG .deb in $CACHE" >&2; exit 1; }
VERSION=$(dpkg-deb -f "$DEB" Version | sed 's/-.*//')
OUT="$CACHE/nvidia-kernel-$VERSION.tar.xz"
if [ ! -f "$OUT" ]; then
  dpkg-deb --fsys-tarfile "$DEB" | tar -xO ./usr/src/nvidia-kernel.tar.xz > "$OUT.part"
  mv "$OUT.part" "$OUT"
fi
echo "$OUT $(sha256sum "$OUT" | cut -d' ' -f1) $VERSION"
