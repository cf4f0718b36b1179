#!/usr/bin/env bash
# Usage: scripts/fetch-upstream.sh NAME
# Fetch the upstream source archive NAME (a row of scripts/upstream-sources.tsv: url + sha256)
# into .cache/upstream/ once and print its cached path. A file with the listed sha256 under
# ../shared/sources/ (or $UPSTREAM_SHARED) is copied instead of downloading, so machines without
# internet work from the shared copy. Nothing is used unless its sha256 matches: the archive's
# own sha256, or the sha256 of its uncompressed tar stream (same tree, other compressor).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TABLE=${UPSTREAM_SOURCES:-$ROOT/scripts/upstream-sources.tsv}
CACHE=${UPSTREAM_CACHE:-$ROOT/.cache/upstream}
SHARED=${UPSTREAM_SHARED:-$ROOT/../shared/sources}
# a clone made elsewhere (CI clones into a temp dir): the shared copy beside the repo it came from
if [ ! -d "$SHARED" ] && origin=$(git -C "$ROOT" config remote.origin.url 2>/dev/null) && [ -d "$origin/../shared/sources" ]; then
  SHARED="$origin/../shared/sources"
fi
NAME=${1:?usage: $0 NAME (a name from $TABLE)}

row=$(awk -F'\t' -v n="$NAME" '$1 == n && $1 !~ /^#/ {print; exit}' "$TABLE")
if [ -z "$row" ]; then
  echo "fetch-upstream: no source named '$NAME' in $TABLE" >&2; exit 2
fi
IFS=$'\t' read -r _ URL SHA TARSHA <<<"$row"

sha_of() { sha256sum "$1" | cut -d' ' -f1; }
# sha256 of the uncompressed tar stream, whatever compressor carries it (by magic bytes)
tar_sha_of() {
  case "$(head -c 6 "$1" | od -An -tx1 | tr -d ' \n')" in
    1f8b*) gzip -dc "$1" ;;
    fd377a585a00) xz -dc "$1" ;;
    425a68*) bzip2 -dc "$1" ;;
    28b52ffd*) zstd -dc "$1" ;;
    *) cat "$1" ;;
  esac | sha256sum | cut -d' ' -f1
}
ext_of() {
  case "$(head -c 6 "$1" | od -An -tx1 | tr -d ' \n')" in
    1f8b*) echo tar.gz ;; fd377a585a00) echo tar.xz ;; 425a68*) echo tar.bz2 ;;
    28b52ffd*) echo tar.zst ;; *) echo tar ;;
  esac
}
accepted() {  # $1: file -> 0 when it is the listed tree
  [ "$(sha_of "$1")" = "$SHA" ] && return 0
  [ -n "${TARSHA:-}" ] && [ "$(tar_sha_of "$1")" = "$TARSHA" ] && return 0
  return 1
}

mkdir -p "$CACHE"
# already cached (verified when it was stored; re-checked cheaply by the archive sha when it can)
for f in "$CACHE/$NAME".tar "$CACHE/$NAME".tar.{gz,xz,bz2,zst}; do
  [ -f "$f" ] || continue
  sum=$(sha_of "$f")
  if [ "$sum" = "$SHA" ] || [ "$(cat "$f.verified" 2>/dev/null)" = "$sum" ]; then echo "$f"; exit 0; fi
done

put() {  # $1: verified file -> copy into the cache under NAME.<ext>, print the path
  local dest
  dest="$CACHE/$NAME.$(ext_of "$1")"
  cp "$1" "$dest.part" && chmod 0644 "$dest.part" && mv -f "$dest.part" "$dest"
  [ "$(sha_of "$dest")" = "$SHA" ] || sha_of "$dest" > "$dest.verified"
  echo "$dest"
}

# a shared copy: the file named after NAME first, then any file with the listed sha256
if [ -d "$SHARED" ]; then
  for f in "$SHARED/$NAME".tar* "$SHARED"/*; do
    [ -f "$f" ] || continue
    if [ "$(sha_of "$f")" = "$SHA" ]; then put "$f"; exit 0; fi
  done
fi

tmp=$(mktemp "$CACHE/.$NAME.XXXXXX")
trap 'rm -f "$tmp"' EXIT
if ! curl -fsSL --retry 2 -o "$tmp" "$URL"; then
  echo "fetch-upstream: $NAME: download failed from $URL and no file with sha256 $SHA in $SHARED" >&2
  exit 1
fi
if ! accepted "$tmp"; then
  echo "fetch-upstream: $NAME: $URL gave sha256 $(sha_of "$tmp") (tar stream $(tar_sha_of "$tmp")); expected $SHA${TARSHA:+ or tar stream $TARSHA}" >&2
  exit 1
fi
put "$tmp"
