"""Issue 38 items 2.2 and 2.9: while the kernel stage tries a kernel (one boot through the loader's
one-shot), nothing but the trial's pass makes it the default, and the one-shot it arms is the one
that boots. On the kpro6 twin (systemd-boot on the ESP 5A1C-9E27, the real proxmox-boot-tool,
bootctl and the firmware's choice at a reset) and on intel2 with /boot on a plain partition (GRUB,
grubenv written by GRUB's own tools). The trial kernel hangs in each test that reboots, so a
wrong default shows as the refused kernel booting again after the reset.

- 2.2: the kernel hook (/etc/kernel/postinst.d/00pvegpu-nvidia, run by the trial kernel's postinst)
  moved its own earlier pin onto the trial kernel; the stage checks the default before arming.
- 2.9: a `kernel pin --next-boot` left over wins over the pin in loader.conf; the hook's
  grub-set-default in the trial window unset GRUB's next_entry (grub util/grub-set-default.in);
  the trial entry copied an entry refresh wrote before /etc/kernel/cmdline changed.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from operations import kernel_hook
from tests.e2e.test_kernel_trial_e2e import (
    ESP,
    GRUB_STAGES,
    KERNEL,
    OLD,
    RELEASE,
    TRIAL_ENTRY,
    attempts,
    boots,
    converge,
    grub_twin,
    grubenv,
    loader_default,
    oneshot,
    press_reset,
    quiet_address,
    reboot,
    seed_finished_build,
    twin_run,
)
from tests.twin import kernel_packages as kp
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

EFI_DEFAULT = "LoaderEntryDefault-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
PVEGPU_MODULES = "updates/pvegpu-nvidia"  # where the NVIDIA stage and the hook install nvidia.ko


def efi_default(root: Path) -> str | None:
    var = root / "var/lib/twin/efivars" / EFI_DEFAULT
    return var.read_bytes()[4:].decode("utf-16-le").rstrip("\x00") if var.exists() else None


def install_hook(root: Path) -> str:
    """The kernel hook as operations/kernel_hook.py writes it, for the profile's driver (its
    source archive is not on the twin: a kernel without nvidia.ko of that version fails in it,
    and the hook keeps the last kernel with them the default)."""
    import json
    version = json.loads((root / "var/lib/twin/profile.json").read_text())["nvidia"]["version"]
    nv = SimpleNamespace(version=version, open=True, signing=None,
                         modules_source=SimpleNamespace(url="file:///opt/src/nvidia.tar.gz", sha256="0" * 64))
    hook = root / kernel_hook.HOOK.lstrip("/")
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(kernel_hook.hook_script(SimpleNamespace(nvidia=nv), 1, False))
    hook.chmod(0o755)
    return version


def hang(root: Path) -> None:
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{RELEASE} hangs\n")


def reboot_into_hang_and_reset(name: str) -> None:
    """The trial boot hangs (no sshd); one press of the reset button; the loader chooses again."""
    subprocess.run(runtime.ssh_command(name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while not boots(name)[-1].endswith(" hung") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert boots(name)[-1].endswith(" hung"), boots(name)
    press_reset(name)


def test_the_hooks_pin_stays_off_a_kernel_under_trial(twin_factory, tmp_path):
    """2.2: the hook pinned the running kernel for an earlier kernel whose modules did not build
    (its pin, LoaderEntryDefault and record); the trial kernel's postinst runs the hook, whose
    ok() moved that pin onto every newer kernel with modules, the trial kernel too: the refused
    kernel was the default before its one boot and booted again after the reset."""
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path, nvidia_dir=PVEGPU_MODULES)
    install_hook(root)
    # what the hook's fail() left: the pin, the EFI default, its record of the pin
    twin_run(twin.name, f"mkdir -p -m 700 /var/lib/pvegpu/kernel-hook && echo {OLD} > "
             f"/var/lib/pvegpu/kernel-hook/pinned && proxmox-boot-tool kernel pin {OLD} && proxmox-boot-tool refresh "
             f"&& bootctl set-default proxmox-{OLD}.conf")
    hang(root)

    run = converge(twin.name)
    assert run.rc == 0, run.output[-6000:]
    log = (root / f"var/lib/pvegpu/kernel-hook/{RELEASE}.log").read_text()  # the hook ran in the install
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == OLD, log[-3000:]
    assert loader_default(root) == f"proxmox-{OLD}.conf" and efi_default(root) == f"proxmox-{OLD}.conf"
    assert oneshot(root) == TRIAL_ENTRY
    assert f"{RELEASE} is under the kernel stage's trial boot: the boot default stays" in log, log[-3000:]
    # the hook again inside the trial window (its package reconfigured): the default stays
    out = twin_run(twin.name, f"DEBIAN_FRONTEND=noninteractive dpkg-reconfigure proxmox-kernel-{RELEASE} 2>&1")
    assert "under the kernel stage's trial boot" in out, out[-3000:]
    assert loader_default(root) == f"proxmox-{OLD}.conf" and efi_default(root) == f"proxmox-{OLD}.conf"

    reboot_into_hang_and_reset(twin.name)
    assert attempts(root)[-1] == f"{OLD} proxmox-{OLD}.conf up", attempts(root)[-3:]
    assert twin_run(twin.name, "uname", "-r").strip() == OLD


def test_a_left_over_next_boot_pin_does_not_win_over_the_known_good_default(twin_factory, tmp_path):
    """2.9: the operator pinned the running kernel, and a `kernel pin --next-boot` of another
    (6.8.12-11-pve, no NVIDIA modules) is still there: refresh writes the next-boot pin, not the pin,
    as loader.conf's default (zz-proxmox-boot), so after the trial's one boot that kernel came up."""
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    twin_run(twin.name, f"proxmox-boot-tool kernel pin {OLD} && proxmox-boot-tool kernel pin 6.8.12-11-pve "
             "--next-boot && proxmox-boot-tool refresh")
    assert loader_default(root) == "proxmox-6.8.12-11-pve.conf"
    hang(root)

    run = converge(twin.name)
    assert run.rc == 0, run.output[-6000:]
    assert not (root / "etc/kernel/next-boot-pin").exists()
    assert loader_default(root) == f"proxmox-{OLD}.conf" and oneshot(root) == TRIAL_ENTRY
    reboot_into_hang_and_reset(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == OLD, attempts(root)[-3:]


def test_a_hook_pin_in_the_grub_trial_window_keeps_the_one_shot(twin_factory, tmp_path):
    """2.9: with the trial armed (grubenv next_entry), apt installs another kernel whose modules
    the hook cannot build; it keeps the running kernel GRUB's saved entry. grub-set-default also
    unsets next_entry (grub util/grub-set-default.in): the trial boot never happened, and the next
    run would record it as failed."""
    twin, root = grub_twin(twin_factory, "")
    seed_finished_build(root, tmp_path, nvidia_dir=PVEGPU_MODULES)
    version = install_hook(root)
    old = twin_run(twin.name, "uname", "-r").strip()
    run = converge(twin.name, stages=GRUB_STAGES)
    assert run.rc == 0, run.output[-6000:]
    assert grubenv(twin.name)["next_entry"] == f"pvegpu-trial-{RELEASE}"

    other = "6.8.12-12-pve"
    deb = kp.image(tmp_path / "other", other, "6.8.12-12", {
        f"boot/vmlinuz-{other}": "twin stand-in kernel image\n", f"boot/System.map-{other}": "",
        f"boot/config-{other}": "CONFIG_BLK_DEV_INITRD=y\nCONFIG_RD_GZIP=y\nCONFIG_RD_ZSTD=y\nCONFIG_MODULES=y\n",
        f"lib/modules/{other}/modules.order": "", f"lib/modules/{other}/modules.builtin": ""})
    (root / "root" / deb.name).write_bytes(deb.read_bytes())
    done = subprocess.run(runtime.ssh_command(twin.name, [f"DEBIAN_FRONTEND=noninteractive dpkg -i /root/{deb.name} 2>&1"]),
                          capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, out[-3000:]
    assert f"nvidia {version} could not be built for kernel {other}" in out, out[-3000:]
    assert f"{old} stays the boot default (GRUB's saved entry" in out, out[-3000:]
    env = grubenv(twin.name)
    assert f">gnulinux-{old}-advanced-" in env["saved_entry"], env
    assert env.get("next_entry") == f"pvegpu-trial-{RELEASE}", env

    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE  # the trial's one boot


def test_the_trial_entry_carries_todays_kernel_command_line(twin_factory, tmp_path):
    """2.9: the kernel installed earlier (trial_boot off), /etc/kernel/cmdline changed since (the
    boot stage writes it; its refresh is a handler at the end of the run, after the kernel stage).
    The trial entry is a copy of the release's entry on the ESP, which the install's refresh wrote
    with the old line: the trial booted without the new parameters."""
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    run = converge(twin.name, kernel={**KERNEL, "trial_boot": False})
    assert run.rc == 0, run.output[-6000:]
    cmdline = (root / "etc/kernel/cmdline").read_text().strip()
    (root / "etc/kernel/cmdline").write_text(f"{cmdline} pvegpu.e2e=1\n")

    run = converge(twin.name)
    assert run.rc == 0, run.output[-6000:]
    options = [line for line in (root / ESP / "loader/entries" / TRIAL_ENTRY).read_text().splitlines()
               if line.startswith("options ")][0]
    assert options.split(None, 1)[1] == f"{cmdline} pvegpu.e2e=1 panic=10", options
    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE
    assert "pvegpu.e2e=1" in twin_run(twin.name, "cat", "/proc/cmdline").split()
