#!/usr/bin/env bash
# `make test`: lint and types first (scripts/lint.sh: ruff, mypy, shellcheck; any finding fails
# the run before a test starts), then every test, on a fresh machine, in well under 30 minutes on 2 cores.
# The real builds (NVIDIA modules on bookworm and on trixie, a kernel) are CPU-bound and long; they run in a second
# pytest process while the rest (unit, twin, end-to-end runs that mostly wait on SSH and twin
# reboots) runs in the first. Both must pass. Extra arguments go to both pytest runs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTEST=.venv/bin/pytest
BUILDS=(tests/e2e/test_driver_build.py tests/e2e/test_driver_build_trixie.py tests/e2e/test_kernel_build.py)
mkdir -p .cache
start=$(date +%s)
bash scripts/lint.sh || { echo "pvegpu: lint failed (scripts/lint.sh); no test ran" >&2; exit 1; }
# The twin root cache is shared by both runs: build it once, first.
for suite in bookworm trixie; do  # bookworm: Proxmox VE 8 profiles; trixie: kpro6-pve9
  tests/twin/twinctl cache --suite "$suite" >/dev/null || { echo "pvegpu: could not build the twin root cache ($suite)" >&2; exit 1; }
done
log=.cache/test-builds.log
"$PYTEST" -p no:cacheprovider "${BUILDS[@]}" "$@" >"$log" 2>&1 &
builds_pid=$!
ignores=()
for b in "${BUILDS[@]}"; do ignores+=(--ignore "$b"); done
"$PYTEST" -p no:cacheprovider "${ignores[@]}" --durations=15 "$@"
rest_rc=$?
wait "$builds_pid"
builds_rc=$?
echo
echo "===== builds (run beside the rest; log: $log) ====="
cat "$log"
echo "pvegpu tests: rest rc=$rest_rc, builds rc=$builds_rc, $(( $(date +%s) - start )) s"
[ "$rest_rc" = 0 ] && [ "$builds_rc" = 0 ]
