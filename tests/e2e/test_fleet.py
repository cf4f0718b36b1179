"""Fleet (issue 9, "Fleet"): the whole deploy against 8 kpro6 twins in ONE pyinfra run
converges every host (each reboots once, as its spec allows), and a second run reports no
change on any of the 8."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.e2e.harness import run_pyinfra

pytestmark = [pytest.mark.twin, pytest.mark.slow]

FLEET = 8


def host_results(output: str, name: str) -> dict[str, int]:
    """How often pyinfra reported `[name] Success` / `No changes` / `Error` for an operation."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", output).splitlines()
    marks = [line.strip()[len(name) + 3:].strip() for line in lines if line.strip().startswith(f"[{name}] ")]
    return {kind: sum(1 for m in marks if m.startswith(kind)) for kind in ("Success", "No changes", "Error")}


def test_eight_twins_converge_in_one_run_then_no_changes(twin_factory):
    twins = [twin_factory("kpro6", name=f"fleet-{i}") for i in range(1, FLEET + 1)]
    env = {"PVEGPU_TWINS": ",".join(t.name for t in twins)}

    t0 = time.monotonic()
    first = run_pyinfra("inventories/twin.py", "deploy.py", env=env, timeout=1200)
    converge_s = time.monotonic() - t0
    assert first.rc == 0, first.output[-6000:]
    for t in twins:
        results = host_results(first.output, t.name)
        assert results["Error"] == 0 and results["Success"] > 0, f"{t.name}: {results}\n" + first.output[-4000:]
        boots = (Path(t.root).parent / "boots").read_text().splitlines()
        assert len(boots) == 2, f"{t.name} booted {len(boots)} times; the converge should reboot it once"

    t0 = time.monotonic()
    second = run_pyinfra("inventories/twin.py", "deploy.py", env=env, timeout=600)
    second_s = time.monotonic() - t0
    assert second.rc == 0, second.output[-6000:]
    assert second.totals.get("error", 0) == 0 and second.changed == 0, second.output[-6000:]
    for t in twins:
        results = host_results(second.output, t.name)
        assert results["Success"] == 0 and results["Error"] == 0 and results["No changes"] > 0, \
            f"{t.name} in the second run: {results}"
    print(f"fleet of {FLEET}: converge {converge_s:.1f} s, no-change run {second_s:.1f} s, "
          f"{second.remote_commands} remote commands ({second.remote_commands / FLEET:.1f} per host)")
