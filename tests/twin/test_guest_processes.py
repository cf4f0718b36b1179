"""The twin's running guests are processes, as on a real node (issue 26 part 5).

A VM: `qm start` leaves a daemon whose argv[0] ends in kvm and whose `-pidfile` names
/var/run/qemu-server/<vmid>.pid, the file holds its pid (qemu-server PVE/QemuServer.pm
config_to_command, PVE/QemuServer/Helpers.pm vm_running_locally); `qm stop` ends it and removes
the file. A CT: `pct start` leaves its init in the CT's own root, whose pid `lxc-info -n <id> -p`
answers and which `lxc-ls --active` counts (lxc src/lxc/tools); `pct stop` ends it. A twin reboot
ends them all, and at boot only the guests whose config says `onboot: 1` start again (pve-manager
services/pve-guests.service runs PVE/API2/Nodes.pm startall): a guest without it stays stopped. `facts.guest_state.GuestState`
reads this without any Proxmox CLI, and the CT's files are read through /proc/<init>/root."""

from __future__ import annotations

import datetime
import os
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


def reboot(twin, boot: int, settle: bool = True) -> None:
    """The twin's reboot stand-in asks the supervisor; back once it has booted the `boot`th time
    (its sshd answers) and, with `settle`, its onboot guests are started (`systemctl
    is-system-running --wait`, as the product waits after a reboot)."""
    request = Path(twin.root) / runtime.REBOOT_REQUEST
    ssh(twin, "reboot")
    deadline = time.monotonic() + 60
    while (request.exists() or boots(twin) < boot) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert boots(twin) == boot
    if settle:
        assert ssh(twin, "systemctl is-system-running --wait") == "running\n"


def vm_state(twin) -> dict:
    return GuestState().process(ssh(twin, GuestState.command).splitlines())["qemu"]


def cmdline(twin, pid: str) -> list[str]:
    return ssh(twin, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines()


def test_qm_start_leaves_a_kvm_process_that_stop_and_reboot_end(twin_factory):
    twin = twin_factory("kpro6", name="vmproc")
    root = Path(twin.root)
    runtime.count_pve_calls(root, True)
    assert vm_state(twin) == {300: "stopped"}
    assert runtime.count_pve_calls(root, False) == [], "the guests are read without a Proxmox CLI"

    ssh(twin, "qm start 300")
    pid = ssh(twin, "cat /var/run/qemu-server/300.pid").strip()
    argv = cmdline(twin, pid)
    assert argv[0].endswith("kvm") and argv[argv.index("-pidfile") + 1] == "/var/run/qemu-server/300.pid"
    assert vm_state(twin) == {300: "running"}

    # no `onboot: 1`: the reboot stops it and startall leaves it stopped
    reboot(twin, 2)
    assert vm_state(twin) == {300: "stopped"}
    assert ssh(twin, "ls /var/run/qemu-server/ 2>/dev/null || true").split() in ([], ["pci-id-reservations"])
    assert ssh(twin, f"[ -e /proc/{pid} ] && echo alive || true").strip() == ""

    # `onboot: 1`: started at boot, even though it was stopped before the reboot (startall does not ask)
    ssh(twin, "qm set 300 --onboot 1")
    reboot(twin, 3)
    after = ssh(twin, "cat /var/run/qemu-server/300.pid").strip()
    assert after and after != pid, "the VM was started again at boot, a new process"
    assert vm_state(twin) == {300: "running"}

    ssh(twin, "qm stop 300")
    # the pid file goes; the PCI reservation list stays, without 300 (qemu-server PCI.pm remove_pci_reservation)
    assert ssh(twin, "ls /var/run/qemu-server/").split() == ["pci-id-reservations"]
    assert ssh(twin, "cat /var/run/qemu-server/pci-id-reservations") == ""
    assert vm_state(twin) == {300: "stopped"}
    assert ssh(twin, f"[ -e /proc/{after} ] && tr '\\0' ' ' < /proc/{after}/cmdline || true").strip() == ""


def ct_state(twin) -> dict:
    return GuestState().process(ssh(twin, GuestState.command).splitlines())["lxc"]


def test_pct_start_leaves_an_init_in_the_cts_root_that_stop_and_reboot_end(twin_factory):
    twin = twin_factory("kpro6", name="ctproc")
    assert ct_state(twin) == {200: "stopped"} and ssh(twin, "lxc-ls --active -1") == ""
    assert ssh(twin, "lxc-info -n 200 -p -H") == ""  # lxc prints no PID for a stopped CT
    ssh(twin, "pct start 200 && pct exec 200 -- sh -c 'echo inside > /etc/pvegpu-probe'")
    pid = ssh(twin, "lxc-info -n 200 -p -H").strip()
    assert pid.isdigit() and ct_state(twin) == {200: "running"}
    # the CT's files through its init, the same view pct exec has; the host's / is another
    assert ssh(twin, f"cat /proc/{pid}/root/etc/pvegpu-probe") == "inside\n"
    assert not ssh(twin, "ls /etc/pvegpu-probe 2>/dev/null || true").strip()
    assert (ssh(twin, f"stat -L -c %d:%i /proc/{pid}/root/") == ssh(twin, "pct exec 200 -- stat -c %d:%i /"))

    ssh(twin, "pct set 200 --onboot 1")
    reboot(twin, 2)
    after = ssh(twin, "lxc-info -n 200 -p -H").strip()
    assert after.isdigit() and after != pid, "started again at boot: a new init"
    assert ssh(twin, f"cat /proc/{after}/root/etc/pvegpu-probe") == "inside\n"

    ssh(twin, "pct stop 200")
    assert ct_state(twin) == {200: "stopped"} and ssh(twin, "lxc-info -n 200 -p -H") == ""
    assert ssh(twin, f"[ -e /proc/{after} ] && echo alive || true").strip() == ""


def test_ssh_answers_while_the_boot_still_starts_its_onboot_guests(twin_factory):
    """On a real node nothing orders sshd after pve-guests.service (pve-manager services/
    pve-guests.service: a oneshot running startall, TimeoutSec=infinity): a login right after a
    reboot can find an onboot guest not started yet, and `systemctl is-system-running` says
    "starting" (exit 1) until startall is done, "running" (exit 0) after; `--wait` blocks until then."""
    twin = twin_factory("kpro6", name="bootwait")
    ssh(twin, "qm set 300 --onboot 1 --startup order=1,up=2 && pct set 200 --onboot 1 --startup order=2")
    assert ssh(twin, "systemctl is-system-running") == "running\n"
    reboot(twin, 2, settle=False)
    # VM 300 starts first, then startall waits its up=2 before CT 200: the login comes meanwhile
    r = subprocess.run(runtime.ssh_command(twin.name, ["systemctl is-system-running; echo rc=$?; pct status 200"]),
                       capture_output=True, text=True, timeout=60)
    assert r.stdout == "starting\nrc=1\nstatus: stopped\n", r.stdout + r.stderr
    t0 = time.monotonic()
    assert ssh(twin, "systemctl is-system-running --wait; echo rc=$?; pct status 200") == (
        "running\nrc=0\nstatus: running\n")
    assert time.monotonic() - t0 > 0.5, "--wait blocked until the boot's starts were done"
    assert ssh(twin, "systemctl is-system-running -q; echo rc=$?") == "rc=0\n"
    assert [line.split(" ", 1)[1] for line in (Path(twin.root) / "var/lib/twin/guests.log").read_text().splitlines()[-2:]] == [
        "onboot qemu 300", "onboot lxc 200"]


def test_the_boot_waits_the_nodes_startall_onboot_delay_before_its_onboot_starts(twin_factory):
    """pve-guests.service's ExecStartPre (pve-manager bin/pve-startall-delay) sleeps the node's
    `startall-onboot-delay` (/etc/pve/nodes/<node>/config, PVE/NodeConfig.pm) before startall, in
    the same oneshot unit: sshd answers meanwhile, the onboot CT is not started yet, and
    `systemctl is-system-running --wait` returns only once the delay and the starts are done."""
    twin = twin_factory("kpro6", name="s14s-delay")
    ssh(twin, "pct set 200 --onboot 1 && printf 'startall-onboot-delay: 2\\n' > /etc/pve/local/config")
    log = Path(twin.root) / "var/lib/twin/guests.log"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    reboot(twin, 2, settle=False)
    booted = float((twin.dir / "boots").read_text().splitlines()[-1].split()[0])  # sshd answers, the starts begin
    r = subprocess.run(runtime.ssh_command(twin.name, ["systemctl is-system-running; echo rc=$?; pct status 200"]),
                       capture_output=True, text=True, timeout=60)
    assert r.stdout == "starting\nrc=1\nstatus: stopped\n", r.stdout + r.stderr
    assert ssh(twin, "systemctl is-system-running --wait; echo rc=$?; pct status 200") == (
        "running\nrc=0\nstatus: running\n")
    waited = time.time() - booted
    started = [line.split(" ") for line in log.read_text().splitlines()[before:]]
    assert [line[1:] for line in started] == [["onboot", "lxc", "200"]]
    at = datetime.datetime.fromisoformat(started[0][0]).timestamp() - booted
    assert at >= 2 and waited >= at, (at, waited)
    assert "Delaying on-boot 'startall' command for 2 second(s)." in (twin.dir / "supervisor.log").read_text()

    # startall-onboot-delay 0 (or none): the starts come at once
    ssh(twin, "printf 'startall-onboot-delay: 0\\n' > /etc/pve/local/config")
    reboot(twin, 3)
    last = log.read_text().splitlines()[-1].split(" ")
    booted = float((twin.dir / "boots").read_text().splitlines()[-1].split()[0])
    assert last[1:] == ["onboot", "lxc", "200"]
    assert datetime.datetime.fromisoformat(last[0]).timestamp() - booted < 1.5


def test_a_cluster_node_waits_only_its_own_startall_onboot_delay(twin_factory):
    """Cluster twins share one /etc/pve; each node's delay is in its own nodes/<node>/config
    (pve-manager bin/pve-startall-delay loads the local node's config, PVE/NodeConfig.pm)."""
    cluster = f"s14s{os.getpid()}"
    a = twin_factory("kpro6", name=f"s14sa-{os.getpid()}", cluster=cluster)
    b = twin_factory("kpro6", name=f"s14sb-{os.getpid()}", cluster=cluster)
    log = Path(a.root) / "var/lib/twin/guests.log"

    def first_start_after_boot() -> float:
        last = log.read_text().splitlines()[-1].split(" ")
        assert last[1:] == ["onboot", "lxc", "200"], last
        booted = float((a.dir / "boots").read_text().splitlines()[-1].split()[0])
        return datetime.datetime.fromisoformat(last[0]).timestamp() - booted

    ssh(a, "pct set 200 --onboot 1")  # the profile's guests are on the first node
    ssh(b, f"printf 'startall-onboot-delay: 3\\n' > /etc/pve/local/config && test ! -e /etc/pve/nodes/{a.name}/config")
    reboot(a, 2)
    assert first_start_after_boot() < 1.5, "another node's delay is not this node's"
    ssh(b, f"printf 'startall-onboot-delay: 2\\n' > /etc/pve/nodes/{a.name}/config")  # the shared tree
    reboot(a, 3)
    assert 2 <= first_start_after_boot() < 3
