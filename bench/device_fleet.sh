#!/bin/bash
# The fleet bench (bench/run.py --only fleet; BENCHES="converge cluster fleet" for those three) on
# another Linux machine, from the bundle
# bench/device_bundle.py made (a slim twin root, the runner's wheels, the stand-in client).
# Run as root in a copy of this repository, with the bundle at BUNDLE:
#
#     bash bench/device_fleet.sh .cache/bench-device OUT_DIR
#
# Needs python3 (the version the wheels were fetched for) with its venv module, unshare,
# nsenter, chroot, tar, xz; ssh-keygen, zstd and ssh (the converge bench starts CT 200 over it) are taken
# from the twin's root where missing.
# Leaves the results in OUT_DIR (results.json, bench.txt, env.txt).
set -u
BUNDLE=${1:?bundle dir}
OUT=${2:?output dir}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$OUT"
t0=$(date +%s)
KEY=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["cache_key"])' "$BUNDLE/bundle.json") || exit 3
VENV=/tmp/pvegpu-bench-venv
python3 -m venv --without-pip "$VENV" || exit 3
SITE=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$BUNDLE"/wheels/*.whl || exit 3
# byte-compiled as pip does by default (--no-compile above keeps pip quiet): a run of pyinfra must
# not compile its ~300 modules each time (that machine may set PYTHONDONTWRITEBYTECODE), which
# would weigh on both sides of every ratio alike and pull them towards 1
"$VENV/bin/python" -m compileall -q -j 0 "$SITE" >/dev/null || exit 3
printf '#!%s\nimport sys\nfrom pyinfra_cli.main import main\nsys.exit(main())\n' "$VENV/bin/python" > "$VENV/bin/pyinfra"
chmod +x "$VENV/bin/pyinfra"
ROOT=$PWD/.cache/twin/root-$KEY
if [ ! -e "$ROOT/.twin-complete" ]; then
    rm -rf "$ROOT" && mkdir -p "$ROOT" || exit 3
    tar -C "$ROOT" --numeric-owner -xJpf "$BUNDLE/root.tar.xz" || exit 3
    echo "$KEY" > "$ROOT/.twin-complete"
fi
cp "$BUNDLE"/standin-client-* .cache/twin/ 2>/dev/null
mkdir -p "$VENV/tools"
for tool in ssh-keygen zstd ssh; do  # the twin root's own, with its own loader and libraries
    command -v $tool >/dev/null && continue
    printf '#!/bin/sh\nexec %s/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2 --library-path %s/usr/lib/x86_64-linux-gnu %s/usr/bin/%s "$@"\n' \
        "$ROOT" "$ROOT" "$ROOT" $tool > "$VENV/tools/$tool"
    chmod +x "$VENV/tools/$tool"
done
export PATH=$VENV/tools:$PATH
{
    echo "cores $(nproc), $(python3 --version), $("$VENV/bin/pyinfra" --version 2>&1)"
    grep -m1 'model name' /proc/cpuinfo
    # the device machine's own file, not one of the repo's
    # shellcheck source=/dev/null
    . /etc/os-release && echo "$PRETTY_NAME, kernel $(uname -r)"
    echo "setup $(( $(date +%s) - t0 )) s, loadavg $(cut -d' ' -f1-3 /proc/loadavg), PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset}"
} > "$OUT/env.txt" 2>&1
# BENCHES: which of bench/run.py's benches to run there (default: fleet; "fleet cluster" adds the
# 3-node cluster twin figure, cluster3_vs_1)
# shellcheck disable=SC2086  # BENCHES is a list of bench names, one word each
PYTHONUNBUFFERED=1 "$VENV/bin/python" bench/run.py --only ${BENCHES:-fleet} > "$OUT/bench.txt" 2>&1
rc=$?
echo "bench rc $rc after $(( $(date +%s) - t0 )) s" >> "$OUT/env.txt"
cp bench/results.json "$OUT/results.json"
cat "$OUT/env.txt"
tail -8 "$OUT/bench.txt"
exit $rc
