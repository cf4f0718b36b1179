"""The twin's Proxmox CLIs can start as slowly as the real Perl ones (issue 19, part 5):
PVEGPU_TWIN_PVE_DELAY at twin start makes pct/qm/pvesh/pveversion wait that long before they
run (default: no wait), and the calls can be counted (what `make bench` reports)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.twin import runtime

pytestmark = [pytest.mark.twin]


def timed(twin, command: str) -> float:
    """Seconds `command` takes, measured inside the twin around it (SSH's own time, which varies
    with the machine's load, is not in it)."""
    out = subprocess.run(runtime.ssh_command(twin.name, [f"s=$(date +%s.%N); {command}; e=$(date +%s.%N); "
                                                         'echo "$s $e"']),
                         check=True, capture_output=True, text=True, timeout=60).stdout.split()
    return float(out[-1]) - float(out[-2])


def test_pve_delay_and_call_count(twin_factory, monkeypatch):
    monkeypatch.setenv("PVEGPU_TWIN_PVE_DELAY", "0.5")
    twin = twin_factory("kpro6", name="pve-delay")
    monkeypatch.delenv("PVEGPU_TWIN_PVE_DELAY")
    root = Path(twin.root)
    # a sleep is a lower bound whatever the load: two CLIs take at least two delays
    assert timed(twin, "pct list >/dev/null; qm list >/dev/null") >= 2 * 0.5, "each CLI waits its start delay"

    runtime.count_pve_calls(root, True)
    subprocess.run(runtime.ssh_command(twin.name, ["pct list; qm list; pvesh get /version; pveversion; uname -r"]),
                   check=True, capture_output=True, timeout=60)
    assert runtime.count_pve_calls(root, False) == ["pct list", "qm list", "pvesh get /version", "pveversion"]
    assert not (root / "var/lib/twin/pve-calls.log").exists()

    runtime.set_pve_delay(root, None)  # the default: no delay
    assert timed(twin, "pct list >/dev/null; qm list >/dev/null") < 2 * 0.5, "no delay by default"
