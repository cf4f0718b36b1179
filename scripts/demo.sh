#!/usr/bin/env bash
# The main job on a built-in twin: start it (and its GPU container), preview (--dry), converge,
# converge again (must report no changes), host checks. The twin is stopped at the end (by PID, by twinctl).
# PVEGPU_DEMO_PROFILE (make demo PROFILE=...): kpro6 (default, Proxmox VE 8 on bookworm) or
# kpro6-pve9 (the same hardware on Proxmox VE 9.2, trixie); its spec is inventories/twin.yml's host of that name.
set -euo pipefail
cd "$(dirname "$0")/.."
TWINCTL=tests/twin/twinctl
PROFILE=${PVEGPU_DEMO_PROFILE:-kpro6}
TWIN=${PVEGPU_DEMO_TWIN:-$PROFILE}
cleanup() { $TWINCTL stop "$TWIN" >/dev/null 2>&1 || true; }
trap cleanup EXIT
$TWINCTL stop "$TWIN" >/dev/null 2>&1 || true
$TWINCTL start "$TWIN" --profile "$PROFILE"
# the LLM container runs, as on the real host: the converge gives it its GPUs and the host's
# NVIDIA user space, and the checks run nvidia-smi inside it
$TWINCTL ssh "$TWIN" -- pct start 200
export PVEGPU_TWINS=$TWIN
echo "== preview (--dry): nothing changes"
.venv/bin/pyinfra -y inventories/twin.py deploy.py --dry
echo "== converge"
.venv/bin/pyinfra -y inventories/twin.py deploy.py
echo "== converge again: no changes expected"
.venv/bin/pyinfra -y inventories/twin.py deploy.py | tee .twin/demo-second-run.log
echo "== host checks"
.venv/bin/pytest -q tests/host --inventory inventories/twin.py
