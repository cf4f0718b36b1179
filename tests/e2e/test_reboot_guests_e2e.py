"""A single host's reboot and its running guests, on a kpro6 twin: Proxmox starts only `onboot: 1`
guests at boot (pve-manager services/pve-guests.service runs PVE/API2/Nodes.pm startall, as the
twin's boot does), so the reboot stage names the running guests without it before it reboots
and starts them again once the host is back; a guest with `onboot: 1` is the boot's to start. sshd
answers while the boot still starts its onboot guests (nothing orders sshd after pve-guests.service),
so the steps after the reboot wait until systemd says the boot is done."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import REPO, run_pyinfra, spec_inventory
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

STAGES = "operations.boot,operations.reboot"


def ssh(name: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(runtime.ssh_command(name, [command]), capture_output=True, text=True, timeout=120)


def converge(name: str, stages: str = STAGES):
    return run_pyinfra("inventories/twin.py", "tests/e2e/stage_deploy.py",
                       env={"PVEGPU_TWINS": name, "PVEGPU_STAGES": stages}, timeout=600)


def test_a_reboot_names_the_guests_boot_leaves_stopped_and_starts_them_again(twin_factory):
    twin = twin_factory("kpro6", name="s11o-reboot")
    root = Path(twin.root)
    for cmd in ("qm set 300 --onboot 1", "qm start 300", "pct start 200"):
        r = ssh(twin.name, cmd)
        assert r.returncode == 0, r.stderr
    log = root / "var/lib/twin/guests.log"
    before = len(log.read_text().splitlines())
    boots = len((twin.dir / "boots").read_text().splitlines())

    first = converge(twin.name)
    assert first.rc == 0, first.output[-6000:]
    assert len((twin.dir / "boots").read_text().splitlines()) == boots + 1, "the converge rebooted the twin"
    warned = [line for line in first.output.splitlines() if "will not start at boot" in line]
    assert len(warned) == 1 and "CT 200 run(s) now" in warned[0] and "VM 300" not in warned[0], first.output[-6000:]
    # the boot started VM 300 (onboot), the run CT 200 (it ran before the reboot)
    assert [line.split(" ", 1)[1] for line in log.read_text().splitlines()[before:]] == [
        "onboot qemu 300", "start lxc 200"]
    assert json.loads((root / "var/lib/twin/guests.json").read_text()) == {"lxc/200": "running", "qemu/300": "running"}

    again = converge(twin.name)
    assert again.rc == 0 and again.changed == 0, again.output[-6000:]


def test_the_steps_after_the_reboot_see_an_onboot_ct_the_boot_starts_late(twin_factory):
    """The node's `startall-onboot-delay: 5` passes first (pve-manager bin/pve-startall-delay, the
    ExecStartPre of pve-guests.service), then startall starts VM 300 and waits its `up=10` before
    CT 200 (PVE/API2/Nodes.pm), while sshd already answers: the NCCL stage's after_reboot, which
    writes /etc/nccl.conf into the running GPU CTs, runs only once the boot is done, so CT 200 gets
    its file in this run."""
    twin = twin_factory("kpro6", name="s13-late")
    r = ssh(twin.name, "qm set 300 --onboot 1 --startup order=1,up=10 && pct set 200 --onboot 1 --startup order=2"
            " && printf 'startall-onboot-delay: 5\\n' > /etc/pve/local/config")
    assert r.returncode == 0, r.stderr
    stages = "operations.boot,operations.nccl,operations.reboot"
    log = Path(twin.root) / "var/lib/twin/guests.log"
    before = len(log.read_text().splitlines()) if log.exists() else 0

    first = converge(twin.name, stages)  # CT 200 is stopped before the reboot: the NCCL stage skips it then
    assert first.rc == 0, first.output[-6000:]
    assert "CT 200 is stopped" in first.output, first.output[-6000:]
    assert "guests may still be starting" not in first.output, first.output[-6000:]
    assert (runtime.twin_dir(twin.name) / "ct/200/upper/etc/nccl.conf").is_file(), first.output[-6000:]
    # the boot's starts (a VM's start may fail its checks: startall goes on), none by the run
    assert [line.split(" ", 1)[1].split(" ", 1)[1] for line in log.read_text().splitlines()[before:]] == [
        "qemu 300", "lxc 200"]
    booted = float((twin.dir / "boots").read_text().splitlines()[-1].split()[0])
    first = datetime.datetime.fromisoformat(log.read_text().splitlines()[before].split(" ", 1)[0]).timestamp()
    assert first - booted >= 5, "the boot waited the node's startall-onboot-delay before its first start"
    assert "/etc/nccl.conf (container 200)" in ssh(twin.name, "pct exec 200 -- cat /etc/nccl.conf").stdout

    again = converge(twin.name, stages)
    assert again.rc == 0 and again.changed == 0, again.output[-6000:]


def test_no_reboot_into_a_kernel_without_nvidia_modules(twin_factory, tmp_path):
    """nvidia.releases lists only 6.1.0-57-amd64 while the loader boots the twin's own kernel next,
    whose nvidia.ko is gone (removed here, as a kernel reinstall or a purge leaves it): a reboot there
    would bring the node up without its GPU driver (the twin's kmod: "Module nvidia not found").
    The boot stage's command line wants a reboot and reboot.allowed is true, yet the reboot stage
    (plan.reboot.next_boot_without_modules) leaves it pending and says which release to add; the code
    before rebooted the twin."""
    twin = twin_factory("kpro6", name="s21-nomods")
    release = ssh(twin.name, "uname -r").stdout.strip()
    gone = ssh(twin.name, f"find /lib/modules/{release} -name 'nvidia*.ko*' -print -delete")
    assert gone.returncode == 0 and "nvidia.ko" in gone.stdout, gone.stdout + gone.stderr
    host = yaml.safe_load((REPO / "inventories/twin.yml").read_text())["hosts"]["kpro6"]
    host["nvidia"]["releases"] = ["6.1.0-57-amd64"]
    inventory = spec_inventory(tmp_path, twin, host, "nomods")
    boots = len((twin.dir / "boots").read_text().splitlines())

    run = run_pyinfra(inventory, "tests/e2e/stage_deploy.py", env={"PVEGPU_STAGES": STAGES}, timeout=600)
    assert run.rc == 0, run.output[-6000:]
    assert len((twin.dir / "boots").read_text().splitlines()) == boots, "the twin was rebooted"
    assert ("not rebooted: the next boot" in run.output and f"{release}) has no nvidia 595.71.05 modules" in run.output
            and f"add {release} to nvidia.releases" in run.output), run.output[-6000:]
