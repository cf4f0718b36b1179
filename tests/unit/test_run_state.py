"""facts.run_state: the one per-host run state (issue 18 part 1), and plan/ kept pure."""

from __future__ import annotations

import ast
from pathlib import Path

from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from facts.run_state import (
    need_reboot,
    nothing_executed,
    reboot_reasons,
    record_trial_boot,
    run_state,
    trial_boot_of,
)

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


def _op(commands=None):
    """pyinfra's per-host record of one operation: complete with `commands`, or not yet run (None)."""
    from types import SimpleNamespace

    from pyinfra.api.operation import OperationMeta
    from pyinfra.connectors.util import CommandOutput

    meta = OperationMeta("hash", None)
    if commands is not None:
        meta.set_complete(True, commands, CommandOutput([]))
    return SimpleNamespace(operation_meta=meta)


def test_nothing_executed_until_an_operation_runs_a_command():
    state = FakeState()
    host, other = create_host(state), create_host(state)
    with ctx_state.use(state), ctx_host.use(host):
        assert nothing_executed()  # no operation at all
        state.ops = {host: {"a": _op([]), "b": _op(None)}, other: {"a": _op(["touch /x"])}}
        assert nothing_executed()  # a no-op, one not run yet; the other host's command is its own
        assert not nothing_executed(other)
        state.ops[host]["c"] = _op(["pct set 200 --dev0 /dev/nvidia0"])
        assert not nothing_executed()


def test_fact_unless_changed_takes_the_prefetched_reading_only_while_nothing_ran(monkeypatch):
    """An operation that reads its fact as it executes gets the prefetched reading while every
    operation before it was a no-op (a no-change run: no command of its own), else a reading now."""
    from pyinfra import host as current_host

    from facts.guests import ContainerGpuState
    from facts.once import _key, fact_unless_changed

    state = FakeState()
    host = create_host(state)
    read: list = []

    def get_fact(self, cls, **kwargs):
        read.append(cls)
        return "read now"

    monkeypatch.setattr(type(host), "get_fact", get_fact, raising=False)
    with ctx_state.use(state), ctx_host.use(host):
        assert current_host.get_fact(ContainerGpuState) == "read now" and read.pop() is ContainerGpuState
        assert fact_unless_changed(ContainerGpuState) == "read now" and read.pop()  # nothing prefetched
        run_state().facts[_key(ContainerGpuState, {})] = "prefetched"
        state.ops = {host: {"a": _op([])}}
        assert fact_unless_changed(ContainerGpuState) == "prefetched" and read == []
        state.ops[host]["b"] = _op(["echo 1 > /sys/bus/pci/drivers/vfio-pci/unbind"])
        assert fact_unless_changed(ContainerGpuState) == "read now" and read == [ContainerGpuState]
