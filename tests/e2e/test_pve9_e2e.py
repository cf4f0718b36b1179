"""Proxmox VE 9 end to end on the kpro6-pve9 twin (issue 29 part 2): a GPU added to a running
container reaches it without a restart (pve-container >= 6.0.4 hotplugs new devN entries), the
same change on PVE 8's pve-container restarts it; a raw cgroup v1 key of a GPU container is
reported with its lxc.cgroup2 fix and pvegpu writes none."""

from __future__ import annotations

import subprocess

import pytest

from tests.e2e.test_rebind_e2e import BDFS, Run
from tests.twin import runtime

pytestmark = [pytest.mark.twin, pytest.mark.slow]


def ssh(name: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(runtime.ssh_command(name, [command]), capture_output=True, text=True, timeout=120)


def guest_actions(run: Run) -> list[str]:
    return [line.split(" ", 1)[1] for line in run.read("var/lib/twin/guests.log").splitlines()]


@pytest.mark.parametrize("profile,hotplug", [("kpro6-pve9", True), ("kpro6", False)])
def test_gpu_added_to_a_running_ct(twin_factory, tmp_path, profile, hotplug):
    twin = twin_factory(profile, name=f"s29-hot-{'9' if hotplug else '8'}")
    run = Run(twin, tmp_path)
    # the UVM nodes a devN entry needs (the NVIDIA stage makes them on a real run; its spec section is absent here)
    # (after the twin's reboot the CT is stopped: no onboot, and the run's start after the reboot fails
    # without the UVM nodes, a warning)
    start_ct = ("nvidia-modprobe -u -c=0 && { pct status 200 | grep -q running || pct start 200; } && "
                "pct exec 200 -- true && lxc-ls --active -1 | grep -qx 200")
    assert ssh(twin.name, start_ct).returncode == 0
    rc, out, _ = run.deploy([BDFS[0]], [])  # the first converge reboots the twin (cmdline): the CT stops
    assert rc == 0, out[-4000:]
    assert ssh(twin.name, start_ct).returncode == 0
    before = guest_actions(run)
    rc, out, _ = run.deploy([BDFS[0], BDFS[1]], [])
    assert rc == 0, out[-4000:]
    actions = guest_actions(run)[len(before):]
    conf = run.read("etc/pve/lxc/200.conf")
    assert "lxc.cgroup." not in conf, conf
    if hotplug:  # the entries of the first GPU keep dev0-dev2 (no uvm-tools unless asked), the new one takes dev3
        assert "dev0: /dev/nvidia0,gid=44" in conf and "dev3: /dev/nvidia1,gid=44" in conf, conf
        assert "dev2: /dev/nvidia-uvm,gid=44" in conf and "nvidia-uvm-tools" not in conf, conf
        assert "CT 200 runs: its new device entries are hotplugged (dev3), no restart" in out, out[-4000:]
        assert actions == [], actions  # not restarted
        assert "[pve:pending]" not in conf
    else:  # numbered afresh (the CT restarts anyway)
        assert "dev1: /dev/nvidia1,gid=44" in conf, conf
        assert actions == ["shutdown lxc 200", "start lxc 200"], actions
    # the running CT has both GPUs' nodes either way (pve-container's prestart hook / hotplug: 0660, gid 44)
    nodes = ssh(twin.name, "pct exec 200 -- stat -c '%n %a %g' /dev/nvidia0 /dev/nvidia1").stdout
    assert nodes == "/dev/nvidia0 660 44\n/dev/nvidia1 660 44\n", nodes
    rc, out, res = run.deploy([BDFS[0], BDFS[1]], [])
    assert rc == 0 and res.changed == 0, out[-4000:]


def test_cgroup_v1_key_of_a_gpu_ct_is_reported_with_its_fix(twin_factory, tmp_path):
    twin = twin_factory("kpro6-pve9", name="s29-cgv1")
    run = Run(twin, tmp_path)
    conf = run.root / "etc/pve/lxc/200.conf"
    conf.write_text(conf.read_text() + "lxc.cgroup.devices.allow: c 10:200 rwm\n")
    rc, out, _ = run.deploy([BDFS[0]], [], "--dry")
    assert rc == 0, out[-4000:]
    assert ("CT 200: `lxc.cgroup.devices.allow: c 10:200 rwm` is a cgroup v1 key, which Proxmox VE 9 "
            "(cgroup v2 only) ignores") in out, out[-4000:]
    assert "write it as `lxc.cgroup2.devices.allow: c 10:200 rwm`" in out


PREPARE_UPGRADE = (  # what pve8to9 warns about that pvegpu owns: a DKMS module, the systemd-boot meta-package's file
    "mkdir -p /usr/src/nvidia-550.163.01 && printf 'PACKAGE_NAME=nvidia\\nPACKAGE_VERSION=550.163.01\\n"
    "BUILT_MODULE_NAME[0]=nvidia\\nDEST_MODULE_LOCATION[0]=/updates/dkms\\n' > /usr/src/nvidia-550.163.01/dkms.conf && "
    "dkms add -m nvidia -v 550.163.01 >/dev/null && "
    "mkdir -p /usr/share/doc/systemd-boot && : > /usr/share/doc/systemd-boot/changelog.Debian.gz")


@pytest.mark.parametrize("profile,on_8", [("kpro6", True), ("kpro6-pve9", False)])
def test_upgrade_check_when_the_spec_says_9(twin_factory, tmp_path, monkeypatch, profile, on_8):
    """proxmox_ve: 9 on a host still on 8: the run (here --dry, which changes nothing) lists the
    upgrade's to-dos with their fixes; on a host that runs 9, what is still due after the upgrade."""
    from tests.e2e import test_rebind_e2e as rebind
    from tests.e2e.harness import manifest_diff

    base = rebind.spec_yaml
    monkeypatch.setattr(rebind, "spec_yaml", lambda ct, vm: {"hosts": {"kpro6": {**base(ct, vm)["hosts"]["kpro6"],
                                                                                "proxmox_ve": 9}}})
    twin = twin_factory(profile, name=f"s29-upg-{'8' if on_8 else '9'}")
    run = Run(twin, tmp_path)
    pin = " && proxmox-boot-tool kernel pin 6.8.12-11-pve" if on_8 else ""
    assert ssh(twin.name, PREPARE_UPGRADE + pin).returncode == 0
    conf = run.root / "etc/pve/lxc/200.conf"
    conf.write_text(conf.read_text() + "lxc.cgroup.devices.allow: c 10:200 rwm\n")
    before = run.snapshot()
    rc, out, _ = run.deploy([BDFS[0]], [], "--dry")
    assert rc == 0, out[-4000:]
    assert manifest_diff(before, run.snapshot()) == []
    if not on_8:
        # once the host runs 9 the check says what is still due (pve8to9 on 9 fails on the systemd-boot
        # meta-package; issue 40), not what was due before the upgrade (no running-guests or 8.4 lines)
        assert "kpro6: upgrade check: the host runs Proxmox VE 9" in out, out[-4000:]
        assert "apt remove systemd-boot" in out and "Fix now (the host runs 9)" in out, out[-4000:]
        assert "this host runs 8" not in out and "GPU guests run" not in out
        return
    assert "kpro6: upgrade check: the spec says Proxmox VE 9 (proxmox_ve: 9) and this host runs 8.4.1" in out, out[-4000:]
    for finding in ("dkms status lists nvidia/550.163.01: added", "the systemd-boot meta-package is installed",
                    "proxmox-boot-tool pins kernel 6.8.12-11-pve, a Proxmox VE 8 kernel",
                    "CT 200: `lxc.cgroup.devices.allow: c 10:200 rwm` is a cgroup v1 key"):
        assert f"  - {finding}" in out, finding
