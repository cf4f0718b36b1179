"""The roll's execution-time steps (operations/reboot.py) against stand-in hosts: what stops the
roll of a cluster and what the next node's gate then says."""
from __future__ import annotations

from types import SimpleNamespace

import operations.reboot as reboot
from plan.reboot import Guest


class FakeHost:
    def __init__(self, name: str, answers: dict[str, tuple[bool, str]]):
        self.name = name
        self.data = {"pvegpu_node": name}
        self.answers = answers
        self.ran: list[str] = []

    def run_shell_command(self, command):
        text = str(command)
        self.ran.append(text)
        for prefix, (ok, out) in self.answers.items():
            if text.startswith(prefix):
                return ok, SimpleNamespace(stdout_lines=out.splitlines(), stderr_lines=[])
        return True, SimpleNamespace(stdout_lines=[], stderr_lines=[])


def test_a_vm_that_does_not_come_back_stops_the_roll_and_the_next_node_is_not_rebooted(monkeypatch, caplog):
    monkeypatch.setattr(reboot, "ROLL_STOPPED", {})
    monkeypatch.setattr(reboot, "reboot_reasons", lambda host=None: [("cmdline", "lacks x")])
    a = FakeHost("a", {"qm start": (False, "could not find a free device for 'hostpci0'")})
    b = FakeHost("b", {})
    state = SimpleNamespace(inventory=[a, b])
    monkeypatch.setattr(reboot, "ROLL_MOVED", {"a": [("back", "qemu", 300, "b")]})
    assert reboot.restore_guests(state, a, "c1", "a", 5) is False
    assert any("qm migrate 300 a" in r for r in b.ran)
    assert reboot.ROLL_STOPPED["c1"][0] == "a"
    other = FakeHost("c", {})
    assert reboot.roll_gate(state, other, "c1") is False
    assert ("c: not rebooted: the rolling reboot of cluster c1 stopped at node a, which did not get its guests back "
            "after its reboot (VM 300 did not come back from node b: could not find a free device for 'hostpci0')") \
        in caplog.text
    assert "c: reboot pending (1 reason(s)):" in caplog.text


def test_before_a_reboot_the_running_guests_without_onboot_are_named(monkeypatch, caplog):
    """Proxmox starts only `onboot: 1` guests at boot (pve-manager PVE/API2/Nodes.pm startall): the
    reboot stage names the guests running now that the reboot leaves stopped."""
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra_testing.util import FakeState, create_host

    read: list = []
    facts = {"QemuConfigs": {300: {"options": {"onboot": "1"}}, 301: {"options": {}}},
             "LxcConfigs": {200: {"options": {}}}, "HaResources": {}}
    monkeypatch.setattr(reboot, "read_facts_now", read.append)
    monkeypatch.setattr(reboot, "fact_once", lambda cls: facts[cls.__name__])
    monkeypatch.setattr(reboot, "guest_state", lambda: {"pct": True, "qemu": {300: "running", 301: "running"},
                                                         "lxc": {200: "running"}})
    state = FakeState()
    with ctx_state.use(state), ctx_host.use(create_host(state, name="kpro6")):
        assert reboot.warn_not_started_at_boot() == [Guest("qemu", 301), Guest("lxc", 200)]
    assert ("kpro6: VM 301, CT 200 run(s) now and will not start at boot: Proxmox starts only guests with "
            "`onboot: 1`") in caplog.text
    assert len(read) == 1  # the configs and HA resources in one command
    # nothing running: nothing to read, nothing to say
    monkeypatch.setattr(reboot, "guest_state", lambda: {"pct": True, "qemu": {301: "stopped"}, "lxc": {}})
    with ctx_state.use(state), ctx_host.use(create_host(state, name="kpro6")):
        assert reboot.warn_not_started_at_boot() == []
    assert len(read) == 1


def test_after_a_single_hosts_reboot_the_guests_its_boot_left_stopped_start_again(caplog):
    from tests.unit.operations.oprun import run_op

    cmds, _ = run_op(reboot.start_after_reboot, [Guest("qemu", 301), Guest("lxc", 200)], render=None)
    host = FakeHost("kpro6", {"pct start 200": (False, "startup for container '200' failed")})
    assert all(c.function(None, host, *c.args, **c.kwargs) for c in cmds)  # a failed start does not fail the run
    assert host.ran == ["qm start 301", "pct start 200"]
    assert "kpro6: CT 200 ran before the reboot but did not start after it: startup for container '200' failed" \
        in caplog.text


def test_after_the_reconnect_the_boot_is_waited_for_and_a_slow_one_is_a_warning(caplog):
    """sshd answers while pve-guests.service still starts the onboot guests (pve-manager
    services/pve-guests.service): the stage waits for systemd's boot, bounded, and a boot still
    not done is a warning naming the host, not a failed host."""
    from tests.unit.operations.oprun import run_op

    cmds, _ = run_op(reboot.reboot_until_booted, 300, render=None)
    # pyinfra's reboot and reconnect first, then the wait, in the one operation (a run counts one change)
    names = [getattr(getattr(c, "function", None), "__name__", str(c)) for c in cmds]
    assert "wait_and_reconnect" in names and names[-1] == "boot_done_or_warn", names
    assert names.index("wait_and_reconnect") < len(names) - 1 and cmds[-1].args == (300,)
    wait = "timeout 300 systemctl is-system-running --wait || true"
    for said in ("running", "degraded"):  # a failed unit's "degraded" is a finished boot too
        host = FakeHost("kpro6", {wait: (True, said)})
        assert reboot.boot_done_or_warn(None, host, 300) is True
        assert host.ran == [wait]
    assert "guests may still be starting" not in caplog.text
    for said, seen in (("", "no state from systemd"), ("starting", "systemd says 'starting'")):
        host = FakeHost("kpro6", {wait: (True, said)})
        assert reboot.boot_done_or_warn(None, host, 300) is True  # the run goes on
        assert (f"kpro6: the boot was not done 300 s after the reconnect ({seen}): guests may still be starting "
                "(pve-guests.service)") in caplog.text


def test_a_roll_waits_for_the_boot_once_the_node_is_back_and_before_its_checks_and_guests():
    from tests.unit.operations.oprun import run_op

    cmds, _ = run_op(reboot.cluster_reboot, "c1", "a", 240, ["nvidia 595.71.05"], None, "migrate", render=None)
    steps = [c.function for c in cmds if getattr(c, "function", None) in (
        reboot.wait_rejoined, reboot.boot_done_or_warn, reboot.roll_checks, reboot.restore_guests)]
    assert steps == [reboot.wait_rejoined, reboot.boot_done_or_warn, reboot.roll_checks, reboot.restore_guests]
    assert next(c.args for c in cmds if getattr(c, "function", None) is reboot.boot_done_or_warn) == (240,)


def _apply_with(monkeypatch, spec, loader_state, trial=None, members=None):
    """Run the reboot stage's apply on a fake host: which reboot it asks for (none, single, roll)."""
    from pathlib import Path

    import yaml
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra_testing.util import FakeState, create_host

    asked: list[str] = []
    monkeypatch.setattr(reboot, "reboot_reasons", lambda host=None: [("cmdline", "lacks intel_iommu=on")])
    monkeypatch.setattr(reboot, "build_targets", lambda spec: (
        {"running": "6.1.0-57-amd64", "releases": {"6.1.0-57-amd64": {"module": None}}},
        list(spec.nvidia.releases or ["6.1.0-57-amd64"])))
    cases = Path(__file__).resolve().parents[1] / "facts" / "loader.LoaderState"
    loader = yaml.safe_load((cases / f"{loader_state}.yaml").read_text())["fact"]
    monkeypatch.setattr(reboot, "fact_once", lambda cls, **kw: loader)
    monkeypatch.setattr(reboot, "trial_boot_of", lambda host=None: trial)
    monkeypatch.setattr(reboot, "read_fact", lambda cls, **kw: members or {})
    monkeypatch.setattr(reboot, "warn_not_started_at_boot", lambda: [])
    monkeypatch.setattr(reboot, "reboot_until_booted", lambda **kw: asked.append("single"))
    monkeypatch.setattr(reboot, "cluster_reboot", lambda **kw: asked.append("roll"))
    monkeypatch.setattr(reboot, "pin_trial_kernel", lambda **kw: asked.append("pin"))
    state = FakeState()
    with ctx_state.use(state), ctx_host.use(create_host(state, name="kpro6")):
        reboot.apply._inner(spec)
    return asked


def test_no_reboot_into_a_kernel_without_the_nvidia_modules(monkeypatch, caplog):
    """spec nvidia.releases [6.1.0-57-amd64] while GRUB boots 6.8.12-11-pve next: the reboot stays
    pending with the fix named (a cluster twin's roll rebooted such a node and its check then failed)."""
    from spec.models import HostSpec

    spec = HostSpec(nvidia={"version": "595.45.04", "releases": ["6.1.0-57-amd64"]}, reboot={"allowed": True})
    assert _apply_with(monkeypatch, spec, "intel2-grub-first-entry") == []
    assert ("kpro6: not rebooted: the next boot (/boot/grub: 6.8.12-11-pve) has no nvidia 595.45.04 modules "
            "(nvidia.releases: [6.1.0-57-amd64]); add 6.8.12-11-pve to nvidia.releases or leave it out") in caplog.text
    assert "kpro6: reboot pending (1 reason(s)):" in caplog.text
    # a trial of a kernel the run builds for: the trial is what boots next, so the reboot goes on
    assert _apply_with(monkeypatch, spec, "intel2-grub-first-entry",
                       trial={"release": "6.1.0-57-amd64", "pin_tool": "grub"}) == ["single", "pin"]


def test_a_next_boot_with_the_modules_reboots(monkeypatch):
    from spec.models import HostSpec

    spec = HostSpec(nvidia={"version": "595.45.04", "releases": ["6.1.0-57-amd64", "6.8.12-11-pve"]},
                    reboot={"allowed": True})
    assert _apply_with(monkeypatch, spec, "intel2-grub-first-entry") == ["single"]
    assert _apply_with(monkeypatch, HostSpec(reboot={"allowed": True}), "intel2-grub-first-entry") == ["single"]
