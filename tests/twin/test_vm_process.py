"""A running VM of the twin is a process, as on a real node (issue 26 part 5): `qm start` leaves a
daemon whose argv[0] ends in kvm and whose `-pidfile` names /var/run/qemu-server/<vmid>.pid, the
file holds its pid (qemu-server PVE/QemuServer.pm config_to_command, PVE/QemuServer/Helpers.pm
vm_running_locally); `qm stop` ends it and removes the file; a twin reboot ends it and the VM's
start at boot (onboot) brings a new one. `facts.guest_state.GuestState` reads the VMs from that
without running `qm`."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from facts.guest_state import GuestState
from tests.twin import runtime

pytestmark = [pytest.mark.twin]


def boots(twin: runtime.Twin) -> int:
    path = twin.dir / "boots"
    return len(path.read_text().splitlines()) if path.exists() else 0


def ssh(twin, command: str) -> str:
    return subprocess.run(runtime.ssh_command(twin.name, [command]), check=True, capture_output=True,
                          text=True, timeout=60).stdout


def vm_state(twin) -> dict:
    return GuestState().process(ssh(twin, GuestState.command).splitlines())["qemu"]


def cmdline(twin, pid: str) -> list[str]:
    return ssh(twin, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines()


def test_qm_start_leaves_a_kvm_process_that_stop_and_reboot_end(twin_factory):
    twin = twin_factory("kpro6", name="vmproc")
    root = Path(twin.root)
    runtime.count_pve_calls(root, True)
    assert vm_state(twin) == {300: "stopped"}
    assert runtime.count_pve_calls(root, False) == ["pct list"], "the VMs are read without qm"

    ssh(twin, "qm start 300")
    pid = ssh(twin, "cat /var/run/qemu-server/300.pid").strip()
    argv = cmdline(twin, pid)
    assert argv[0].endswith("kvm") and argv[argv.index("-pidfile") + 1] == "/var/run/qemu-server/300.pid"
    assert vm_state(twin) == {300: "running"}

    request = root / runtime.REBOOT_REQUEST
    ssh(twin, "reboot")  # the twin's reboot stand-in asks the supervisor
    deadline = time.monotonic() + 60
    while (request.exists() or boots(twin) < 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert boots(twin) == 2
    after = ssh(twin, "cat /var/run/qemu-server/300.pid").strip()
    assert after and after != pid, "the VM was started again at boot, a new process"
    assert vm_state(twin) == {300: "running"}

    ssh(twin, "qm stop 300")
    assert ssh(twin, "ls /var/run/qemu-server/").strip() == ""
    assert vm_state(twin) == {300: "stopped"}
    assert ssh(twin, f"[ -e /proc/{after} ] && tr '\\0' ' ' < /proc/{after}/cmdline || true").strip() == ""
