"""facts.run_state: the one per-host run state (issue 18 part 1), and plan/ kept pure."""

from __future__ import annotations

import ast
from pathlib import Path

from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from facts.run_state import need_reboot, reboot_reasons, record_trial_boot, run_state, trial_boot_of

ROOT = Path(__file__).resolve().parents[2]


def test_plan_reads_and_writes_no_host_state():
    """Every module of plan/ is a pure function of (spec, facts): it imports nothing of pyinfra's
    host/state and assigns nothing on any object it is handed (host.data included)."""
    problems = []
    for path in sorted((ROOT / "plan").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyinfra"):
                names = {a.name for a in node.names}
                if names & {"host", "state"} or node.module in ("pyinfra.context", "pyinfra.api.host"):
                    problems.append(f"{path.name}:{node.lineno} imports {node.module} {sorted(names)}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr":
                problems.append(f"{path.name}:{node.lineno} calls setattr")
            elif isinstance(node, ast.Attribute) and node.attr == "data" and getattr(node.value, "id", "") == "host":
                problems.append(f"{path.name}:{node.lineno} reads host.data")
    assert problems == []


def test_one_state_per_host_and_the_reboot_reasons_in_it():
    a, b = create_host(FakeState()), create_host(FakeState())
    assert run_state(a) is run_state(a) and run_state(a) is not run_state(b)
    need_reboot("cmdline", "booted lacks amd_iommu=on", host=a)
    need_reboot("cmdline", "booted lacks amd_iommu=on", host=a)  # once
    need_reboot("kernel", "trial", host=a)
    assert reboot_reasons(a) == [("cmdline", "booted lacks amd_iommu=on"), ("kernel", "trial")]
    assert reboot_reasons(b) == []
    record_trial_boot("6.14.11-9-bpo12-pve", "proxmox-boot-tool", True, host=a)
    assert trial_boot_of(a) == {"release": "6.14.11-9-bpo12-pve", "pin_tool": "proxmox-boot-tool", "esps": True}
    assert trial_boot_of(b) is None


def test_the_stale_rule_drops_only_the_guest_reading_and_only_while_executing():
    state = FakeState()
    host = create_host(state)
    run = run_state(host)
    run.guests = {"pct": True, "lxc": {200: "running"}, "qemu": {}}
    run.facts[("m", "F", "[]")] = "reading"
    with ctx_state.use(state), ctx_host.use(host):
        state.is_executing = False
        run.guests_changed()  # generating: nothing ran, the reading holds
        assert run.guests is not None
        state.is_executing = True
        run.guests_changed()
        assert run.guests is None and run.facts == {("m", "F", "[]"): "reading"}


def test_fact_once_keeps_its_readings_in_the_run_state():
    from facts.guest_state import GuestState
    from facts.once import fact_once

    state = FakeState()
    host = create_host(state)
    calls = []
    def get_fact(cls, **kw):
        calls.append(cls)
        return {"pct": False, "lxc": {}, "qemu": {}}
    host.get_fact = get_fact
    with ctx_state.use(state), ctx_host.use(host):
        fact_once(GuestState)
        fact_once(GuestState)
    assert calls == [GuestState]
    assert list(run_state(host).facts.values()) == [{"pct": False, "lxc": {}, "qemu": {}}]
