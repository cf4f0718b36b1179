"""Issue 38 item 2.1 on the kpro6 twin (systemd-boot on a proxmox-boot-tool ESP): an upgrade of a
boot-loader package (here systemd-boot-efi, whose files land in /usr/lib/systemd/boot) fires
proxmox-kernel-helper's dpkg trigger, whose postinst runs the real `proxmox-boot-tool reinit`:
that rewrites loader.conf to `default proxmox-*` without a refresh, dropping the pin that `kernel
pin` + `refresh` had written (proxmox-boot-tool init_bootloader). The default pvegpu keeps must
survive it: after a failed trial the refused (newest) kernel must not boot from its normal entry.

On Proxmox VE 9 (the kpro6-pve9 twin: trixie's package shapes, boot_packages; proxmox-kernel-helper
9.2.0's own trigger and reinit) the same upgrades keep the default pvegpu keeps (the pin and the EFI
default, as the kernel hook and the kernel stage write them). What 9.2.0's init_bootloader does
beyond 8.1.4's (a memtest86+ entry on the ESP when /boot has memtest86+x64.efi; refusing without
systemd-boot-efi's /usr/lib/systemd/boot/efi) is shown there too: neither changes the kernel booted."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from operations import kernel_hook
from spec.models import HostSpec
from tests.e2e import test_kernel_upgrade_e2e as up
from tests.e2e.test_kernel_trial_e2e import (
    OLD,
    RELEASE,
    attempts,
    boots,
    converge,
    loader_default,
    nvidia_module,
    press_reset,
    quiet_address,
    reboot,
    seed_finished_build,
    twin_run,
)
from tests.e2e.test_kernel_upgrade_e2e import host_on_6_1  # noqa: F401  (a fixture)
from tests.twin import boot_packages, runtime
from tests.twin.test_boot_programs import grub_upgrade, install_debs, install_kernel, sh, upgrade_systemd_boot_efi
from tests.twin.test_boot_programs import reboot as reboot_into

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


# kpro6-pve9's kernels (tests/twin/profiles/kpro6-pve9.yml): the 9.1 series kept, the newest 9.2
# one (running); a newer 9.2 kernel comes whose NVIDIA build fails
TRIXIE_OLD, TRIXIE_RUNNING, TRIXIE_BAD = "6.17.13-21-pve", "7.0.14-14-pve", "7.0.15-1-pve"


def test_on_trixie_each_boot_loader_upgrade_runs_9_2_0s_reinit_and_the_hooks_default_boots(twin_factory, tmp_path):
    """kpro6-pve9: pvegpu's kernel hook (as the kernel-hook stage installs it) keeps the running
    kernel, which has the driver, the default when the newer kernel's build fails (its pin and the
    EFI default, templates/kernel-postinst-nvidia.sh.j2 fail()/efi_default). Then systemd-boot-efi,
    grub-efi-amd64 (-bin, -signed and trixie's -unsigned) and shim-signed upgrades each fire
    proxmox-kernel-helper 9.2.0's trigger, whose reinit rewrites loader.conf to `default proxmox-*`
    (the newest: the refused kernel); after each, the kept kernel still boots."""
    twin = twin_factory("kpro6-pve9", address=quiet_address())
    name, root = twin.name, Path(twin.root)
    assert sh(name, "dpkg-query -W -f '${Version}' proxmox-kernel-helper").stdout == "9.2.0"
    assert twin_run(name, "uname", "-r").strip() == TRIXIE_RUNNING  # no pin: the newest entry
    version = json.loads((root / "var/lib/twin/profile.json").read_text())["nvidia"]["version"]
    (root / f"lib/modules/{TRIXIE_RUNNING}/updates/pvegpu-nvidia").mkdir(parents=True, exist_ok=True)
    nvidia_module(root / f"lib/modules/{TRIXIE_RUNNING}/updates/pvegpu-nvidia/nvidia.ko", version)
    twin_run(name, f"depmod {TRIXIE_RUNNING}")
    spec = HostSpec(nvidia={"version": version, "open": True, "modules_source": {
        "url": "file:///nonexistent/nvidia.tar.gz", "sha256": hashlib.sha256(b"none").hexdigest()}})
    hook = root / kernel_hook.HOOK.lstrip("/")
    hook.write_text(kernel_hook.hook_script(spec, 2, False))
    hook.chmod(0o755)
    install_kernel(name, TRIXIE_BAD)  # its archive is missing: the build fails
    kept = (root / f"var/lib/pvegpu/kernel-hook/{TRIXIE_BAD}.failed").read_text().splitlines()[2]
    assert kept.startswith(f"{TRIXIE_RUNNING} stays the boot default (pinned by pvegpu"), kept
    assert loader_default(root) == f"proxmox-{TRIXIE_RUNNING}.conf"
    # 9.2.0's init_bootloader adds a memtest86+ entry where /boot has its EFI image (8.1.4 does not)
    sh(name, "printf 'twin placeholder: memtest86+\\n' > /boot/memtest86+x64.efi")
    grub = sh(name, "dpkg-query -W -f '${Version}' grub-common").stdout
    upgrades = {
        "systemd-boot-efi": lambda: upgrade_systemd_boot_efi(name),
        "grub-efi-amd64": lambda: grub_upgrade(name, tmp_path),
        "shim-signed": lambda: (install_debs(name, [boot_packages.shim_signed(tmp_path, boot_packages.SHIM_SIGNED["trixie"] + "~twin0")]),
                                install_debs(name, [boot_packages.shim_signed(tmp_path, boot_packages.SHIM_SIGNED["trixie"])]))[1],
    }
    for package, upgrade in upgrades.items():
        out = upgrade()
        assert "Processing triggers for proxmox-kernel-helper" in out and "Installing systemd-boot.." in out, (package, out[-3000:])
        assert "Adding memtest86+x64.efi .." in out, (package, out[-3000:])
        assert loader_default(root) == "proxmox-*", package  # what reinit writes, whatever was pinned
        assert reboot_into(name) == TRIXIE_RUNNING, (package, attempts(root)[-3:])
    esp = root / "var/lib/twin/esp/5A1C-9E27"
    assert (esp / "loader/entries/memtest86+x64.efi.conf").exists()
    assert sh(name, "dpkg-query -W -f '${Version}' grub-efi-amd64-unsigned").stdout == grub
    assert grub == boot_packages.GRUB2["trixie"]
