#!/usr/bin/env bash
# Fetch Debian's linux-source-6.1 once and cache it under .cache/kernel-src/ (about 140 MB).
# Prints "<path> <sha256> <kernel version>" of the source tarball: the kernel-build tests
# build a tiny config of it in a twin (a real `make bindeb-pkg`, minutes on two cores).
# apt runs with a private sources list and state dir: the machine's own apt config is untouched.
set -euo pipefail
PKG=${PKG:-linux-source-6.1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KERNEL_SRC_CACHE:-$ROOT/.cache/kernel-src}
mkdir -p "$CACHE"
if ! ls "$CACHE"/"$PKG"_*.deb >/dev/null 2>&1; then
  APT="$CACHE/apt"; mkdir -p "$APT/lists/partial" "$APT/archives/partial"
  cat > "$APT/sources.list" <<LIST
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian-security bookworm-security main
LIST
  opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT" -o "Dir::Cache::Archives=$APT/archives"
        -o Debug::NoLocking=1 -q)
  apt-get "${opts[@]}" update >&2
  (cd "$CACHE" && apt-get "${opts[@]}" download "$PKG" >&2)
fi
DEB=$(printf '%s\n' "$CACHE"/"$PKG"_*.deb | sort -V | tail -n 1)
[ -f "$DEB" ] || { echo "pvegpu: no $PKG .deb in $CACHE" >&2; exit 1; }
OUT="$CACHE/$(basename "$DEB" _all.deb).tar.xz"
if [ ! -f "$OUT" ]; then
  dpkg-deb --fsys-tarfile "$DEB" | tar -xO "./usr/src/$PKG.tar.xz" > "$OUT.part"
  mv "$OUT.part" "$OUT"
fi
# the kernel's own version (Makefile VERSION.PATCHLEVEL.SUBLEVEL), not the package's
VERSION=$(tar -xJOf "$OUT" "$PKG/Makefile" | awk '/^VERSION =/{v=$3} /^PATCHLEVEL =/{p=$3} /^SUBLEVEL =/{s=$3} END{print v"."p"."s}')
echo "$OUT $(sha256sum "$OUT" | cut -d' ' -f1) $VERSION"
