#!/usr/bin/env bash
# Installs the Debian packages the tests and the twin need, only when missing.
set -euo pipefail
need=(debootstrap openssh-client graphviz librsvg2-bin ccache zstd
      git make dpkg-dev xz-utils  # the pve-kernel tree tests: git, make and dpkg-buildpackage on it
      systemd  # systemd-analyze compare-versions: systemd-boot's version order (tests/unit/test_plan_loader.py)
      shellcheck)  # scripts/lint.sh
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" != 0 ]; then
    echo "pvegpu: need root to install Debian packages: ${missing[*]}" >&2; exit 1
  fi
  echo "pvegpu: installing Debian packages: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get -qq update
  DEBIAN_FRONTEND=noninteractive apt-get -qq install -y --no-install-recommends "${missing[@]}" >/dev/null
fi
