"""The kernel stage's trial boot on the kpro6 twin (systemd-boot, ESP listed in
/etc/kernel/proxmox-boot-uuids), without compiling: the build dir holds a finished build of
6.14.11-9-bpo12-pve (pve-kernel bookworm-6.14 at ad58d14) whose .debs are stand-ins made here
(an image, config and modules dir in proxmox-kernel-<rel>, a .config in proxmox-headers-<rel>;
the kernel package's postinst runs /etc/kernel/postinst.d as pve-kernel's does, so the twin's
zz-proxmox-boot hook syncs the ESP at install).

The twin's proxmox-boot-tool follows proxmox-kernel-helper: `kernel pin` only writes the pin
file, `refresh` writes the ESP's loader default, the reboot boots that default, and
proxmox-boot-cleanup clears the next-boot pin at boot. So the trial kernel boots only
through the stage's refresh.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from plan import kernel as plan
from spec.models import KernelSpec
from tests.e2e.harness import run_pyinfra
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

STAGES = "operations.kernel,operations.reboot"
RELEASE = "6.14.11-9-bpo12-pve"
DEB_VERSION = "6.14.11-9~bpo12+1"
OLD = "6.14.8-2-pve"
KERNEL: dict[str, Any] = {"version": RELEASE, "source": {"kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git",
                                         "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"},
          "jobs": 1, "ccache": False}
ESP = "var/lib/twin/esp/5A1C-9E27"
GCC = "gcc (Debian 12.2.0-14+deb12u1) 12.2.0"


def twin_run(name: str, *command: str) -> str:
    """Run a command on the twin; an SSH connection refused right after a reboot is retried."""
    deadline = time.monotonic() + 20
    while True:
        r = subprocess.run(runtime.ssh_command(name, list(command)), capture_output=True, text=True, timeout=60)
        if r.returncode != 255 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if r.returncode != 0:
        log = runtime.twin_dir(name) / "supervisor.log"
        raise AssertionError(f"{command} on twin {name}: exit {r.returncode}: {r.stderr[-1500:]}\n"
                             + (log.read_text()[-3000:] if log.exists() else ""))
    return r.stdout


def stand_in_debs(out: Path) -> list[Path]:
    """proxmox-kernel-<rel> and proxmox-headers-<rel> with the files the stages read."""
    kernel = out / "kernel"
    (kernel / "DEBIAN").mkdir(parents=True)
    (kernel / "boot").mkdir()
    (kernel / f"boot/vmlinuz-{RELEASE}").write_bytes(b"twin stand-in kernel image\n")
    (kernel / f"boot/System.map-{RELEASE}").write_text("")
    (kernel / f"boot/config-{RELEASE}").write_text(
        f'CONFIG_CC_VERSION_TEXT="{GCC}"\nCONFIG_BLK_DEV_INITRD=y\nCONFIG_RD_GZIP=y\nCONFIG_RD_ZSTD=y\n'
        "CONFIG_MODULES=y\nCONFIG_VFIO=m\nCONFIG_VFIO_PCI=m\nCONFIG_VFIO_IOMMU_TYPE1=m\n")
    (kernel / f"lib/modules/{RELEASE}").mkdir(parents=True)
    (kernel / f"lib/modules/{RELEASE}/modules.order").write_text("")
    (kernel / f"lib/modules/{RELEASE}/modules.builtin").write_text("")
    (kernel / "DEBIAN/control").write_text(
        f"Package: proxmox-kernel-{RELEASE}\nVersion: {DEB_VERSION}\nArchitecture: amd64\n"
        "Maintainer: pvegpu tests <tests@example.invalid>\nDescription: twin stand-in of the Proxmox kernel image\n")
    # as pve-kernel debian/proxmox-kernel.postinst.in: depmod, then the kernel hooks with version and image
    (kernel / "DEBIAN/postinst").write_text(
        "#!/bin/sh\nset -e\n[ \"$1\" = configure ] || exit 0\n"
        f"depmod {RELEASE}\n"
        f"run-parts --verbose --exit-on-error --arg={RELEASE} --arg=/boot/vmlinuz-{RELEASE} /etc/kernel/postinst.d\n")
    (kernel / "DEBIAN/postinst").chmod(0o755)
    headers = out / "headers"
    (headers / "DEBIAN").mkdir(parents=True)
    (headers / f"usr/src/linux-headers-{RELEASE}").mkdir(parents=True)
    (headers / f"usr/src/linux-headers-{RELEASE}/.config").write_text(f'CONFIG_CC_VERSION_TEXT="{GCC}"\n')
    (headers / "DEBIAN/control").write_text(
        f"Package: proxmox-headers-{RELEASE}\nVersion: {DEB_VERSION}\nArchitecture: amd64\n"
        "Maintainer: pvegpu tests <tests@example.invalid>\nDescription: twin stand-in of the Proxmox kernel headers\n")
    debs = []
    for tree, name in ((kernel, "proxmox-kernel"), (headers, "proxmox-headers")):
        deb = out / f"{name}-{RELEASE}_{DEB_VERSION}_amd64.deb"
        subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)], check=True,
                       capture_output=True)
        debs.append(deb)
    return debs


def seed_finished_build(root: Path, tmp: Path) -> None:
    k = KernelSpec(**KERNEL)
    build = root / plan.build_dir(k, "running").lstrip("/")
    build.mkdir(parents=True)
    for deb in stand_in_debs(tmp):
        (build / deb.name).write_bytes(deb.read_bytes())
    (build / "build.rc").write_text("0\n")
    (build / "manifest.json").write_text(json.dumps({
        "build_id": plan.build_id(k, "running"), "version": RELEASE, "kind": "proxmox-git", "compiler": GCC,
        "source_sha": KERNEL["source"]["ref"], "config_sha256": "0" * 64, "objects": 0}))


def quiet_address() -> str | None:
    """A high 127.0.0.N that is free now: twins started elsewhere on this machine (other
    checkouts) take the lowest free address, and could grab ours while this twin reboots."""
    import os
    import socket
    for n in [200 + (os.getpid() + i) % 50 for i in range(50)]:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((f"127.0.0.{n}", runtime.SSH_PORT))
            except OSError:
                continue
        return f"127.0.0.{n}"
    return None


def loader_default(root: Path) -> str:
    lines = [line for line in (root / ESP / "loader/loader.conf").read_text().splitlines() if line.startswith("default ")]
    return lines[-1].split(None, 1)[1]


def reboot(name: str) -> None:
    boots = runtime.twin_dir(name) / "boots"
    before = len(boots.read_text().splitlines())
    subprocess.run(runtime.ssh_command(name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while len(boots.read_text().splitlines()) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(boots.read_text().splitlines()) > before, "the twin did not reboot"


def converge(name: str, reboot_allowed: bool = False):
    env = {"PVEGPU_TWINS": name, "PVEGPU_STAGES": STAGES, "PVEGPU_E2E_KERNEL": json.dumps(KERNEL)}
    if not reboot_allowed:
        env["PVEGPU_E2E_NO_REBOOT"] = "1"
    return run_pyinfra("inventories/twin.py", "tests/e2e/stage_deploy.py", env=env, timeout=600)


def test_trial_kernel_boots_through_refresh_and_is_pinned_for_good(twin_factory, tmp_path):
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    assert twin_run(twin.name, "uname", "-r").strip() == OLD

    first = converge(twin.name)
    assert first.rc == 0, first.output[-6000:]
    assert f"kernel: {RELEASE} is installed and selected for the next boot only" in first.output
    # the running kernel was pinned before the install, then the trial pinned and refreshed
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == OLD
    assert (root / "etc/kernel/next-boot-pin").read_text().strip() == RELEASE
    assert loader_default(root) == f"proxmox-{RELEASE}.conf"
    assert (root / ESP / f"loader/entries/proxmox-{RELEASE}.conf").exists()
    assert twin_run(twin.name, "uname", "-r").strip() == OLD

    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE  # the trial kernel runs
    assert not (root / "etc/kernel/next-boot-pin").exists()  # proxmox-boot-cleanup at boot
    assert loader_default(root) == f"proxmox-{OLD}.conf"  # ... and its refresh: the default is still the old one

    second = converge(twin.name)
    assert second.rc == 0, second.output[-6000:]
    assert f"{RELEASE} is running; pin it for good" in second.output
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == RELEASE
    assert loader_default(root) == f"proxmox-{RELEASE}.conf"  # pinned and refreshed
    assert not (root / plan.TRIAL_MARKER.lstrip("/")).exists()

    third = converge(twin.name)
    assert third.rc == 0 and third.changed == 0, third.output[-4000:]

    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE  # the default boot is the new kernel
    assert f"vmlinuz-{OLD}" in twin_run(twin.name, "ls", "/boot").split()


def test_a_trial_that_does_not_come_up_leaves_the_old_default(twin_factory, tmp_path):
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(RELEASE + "\n")  # this kernel does not come up here

    first = converge(twin.name, reboot_allowed=True)  # trial, reboot, then the pin-for-good check fails
    assert first.rc != 0, first.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {OLD}; the previous kernel stays pinned" in first.output
    assert twin_run(twin.name, "uname", "-r").strip() == OLD
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == OLD
    assert not (root / "etc/kernel/next-boot-pin").exists()
    assert loader_default(root) == f"proxmox-{OLD}.conf"

    second = converge(twin.name)
    assert second.rc == 0, second.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {OLD}" in second.output  # failed-trial, reported
    assert loader_default(root) == f"proxmox-{OLD}.conf" and second.changed == 0
    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == OLD
