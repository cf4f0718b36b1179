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
