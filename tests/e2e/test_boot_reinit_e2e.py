"""Issue 38 item 2.1 on the kpro6 twin (systemd-boot on a proxmox-boot-tool ESP): an upgrade of a
boot-loader package (here systemd-boot-efi, whose files land in /usr/lib/systemd/boot) fires
proxmox-kernel-helper's dpkg trigger, whose postinst runs the real `proxmox-boot-tool reinit`:
that rewrites loader.conf to `default proxmox-*` without a refresh, dropping the pin that `kernel
pin` + `refresh` had written (proxmox-boot-tool init_bootloader). The default pvegpu keeps must
survive it: after a failed trial the refused (newest) kernel must not boot from its normal entry."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e import test_kernel_upgrade_e2e as up
from tests.e2e.test_kernel_trial_e2e import (
    OLD,
    RELEASE,
    attempts,
    boots,
    converge,
    loader_default,
    press_reset,
    quiet_address,
    reboot,
    seed_finished_build,
    twin_run,
)
from tests.e2e.test_kernel_upgrade_e2e import host_on_6_1  # noqa: F401  (a fixture)
from tests.twin import runtime
from tests.twin.test_boot_programs import grub_upgrade, upgrade_systemd_boot_efi

pytestmark = [pytest.mark.twin]


@pytest.mark.parametrize("upgrade", ["systemd-boot-efi", "grub-efi-amd64-bin"])
def test_a_boot_loader_upgrade_after_a_failed_trial_does_not_boot_the_refused_kernel(twin_factory, tmp_path, upgrade):
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{RELEASE} hangs\n")
    first = converge(twin.name)
    assert first.rc == 0, first.output[-6000:]
    subprocess.run(runtime.ssh_command(twin.name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while not boots(twin.name)[-1].endswith(" hung") and time.monotonic() < deadline:
        time.sleep(0.2)
    press_reset(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == OLD
    second = converge(twin.name)
    assert second.rc == 0 and f"the trial boot of {RELEASE} came up on {OLD}" in second.output, second.output[-6000:]

    # the real trigger, the real reinit (grub's files land in /usr/lib/grub, the trigger's other path)
    out = upgrade_systemd_boot_efi(twin.name) if upgrade == "systemd-boot-efi" else grub_upgrade(twin.name, tmp_path)
    assert "Processing triggers for proxmox-kernel-helper" in out and "Installing systemd-boot.." in out
    assert loader_default(root) == "proxmox-*"  # what reinit writes, whatever was pinned
    subprocess.run(runtime.ssh_command(twin.name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    before = len(boots(twin.name))
    while len(boots(twin.name)) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not boots(twin.name)[-1].endswith(" hung"), attempts(root)[-2:]
    assert attempts(root)[-1] == f"{OLD} proxmox-{OLD}.conf up", attempts(root)[-3:]
    assert twin_run(twin.name, "uname", "-r").strip() == OLD
    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == OLD


def test_a_boot_loader_upgrade_keeps_the_hooks_default_on_the_kernel_with_nvidia_modules(host_on_6_1, tmp_path):  # noqa: F811
    """The kernel hook's default (a new kernel whose NVIDIA modules did not build: the last kernel
    that has them stays the default) survives the same reinit."""
    twin, _inventory = host_on_6_1(fail_from_6_12=True, profile="kpro6")
    root = Path(twin.root)
    upgrade = up.full_upgrade(twin, tmp_path)
    assert "nvidia-mini does not support kernel 6.12 and later" in upgrade, upgrade[-4000:]
    assert loader_default(root) == f"proxmox-{up.OLD}.conf"
    out = upgrade_systemd_boot_efi(twin.name)
    assert "Processing triggers for proxmox-kernel-helper" in out and "Installing systemd-boot.." in out
    assert loader_default(root) == "proxmox-*"
    up.reboot(twin)
    # not the newest entry (6.14.8-2-pve, whose modules are another driver's), not 6.12 (none)
    assert up.twin_sh(twin, "uname -r").strip() == up.OLD
    assert up.nvidia_version(twin, up.OLD) == up.VERSION
