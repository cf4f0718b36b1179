"""Issue 38 items 2.2 and 2.4 on the kpro6-grubesp twin: ESPs in proxmox-boot-tool's grub mode
(as a UEFI ZFS install made with Secure Boot leaves them: tests/twin/profiles/kpro6-grubesp.yml),
where GRUB reads grub.cfg and grubenv from each ESP's grub/ and the twin's firmware boots that
GRUB (tests/twin/hardware.py grub_boot_entry: next_entry once, cleared with save_env on the vfat
ESP); with UEFI (EFI/proxmox/grubx64.efi) and with legacy BIOS (kpro6-grubesp-bios: GRUB's i386-pc
boot code, its prefix on the ESP). The kernel stage's one-boot trial there: the known-good re-asserted by the pin (refresh ->
GRUB_DEFAULT on each ESP), the trial entry written into each ESP's grub.cfg by refresh's
update-grub, next_entry set in each ESP's grubenv after checking that ESP's default. A trial kernel
that hangs is left after one reset and recorded refused, and stays refused across a grub package
upgrade (proxmox-kernel-helper's trigger: reinit); a good one becomes the default by the pin.
Before, the stage refused the trial on these hosts.

With a second ESP set up for systemd-boot beside the GRUB one (either order in
/etc/kernel/proxmox-boot-uuids) the deploy refuses before any change (plan.loader.mixed_esps_refusal)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from operations import kernel_hook
from plan import kernel as plan
from spec.models import HostSpec
from tests.e2e.test_kernel_trial_e2e import (
    ESP,
    OLD,
    RELEASE,
    attempts,
    boots,
    converge,
    nvidia_module,
    press_reset,
    quiet_address,
    reboot,
    seed_finished_build,
    twin_run,
)
from tests.e2e.test_kernel_trial_e2e import STAGES as KERNEL_STAGES
from tests.twin import boot_packages, runtime
from tests.twin.test_boot_programs import grub_upgrade, install_kernel

pytestmark = [pytest.mark.twin]
TRIAL_ID = f"pvegpu-trial-{RELEASE}"


def esp_grubenv(root: Path) -> dict:
    text = (root / ESP / "grub/grubenv").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))


def esp_default(root: Path) -> str:
    cfg = (root / ESP / "grub/grub.cfg").read_text()
    return [line.strip() for line in cfg.splitlines()
            if line.strip().startswith('set default="') and "next_entry" not in line][-1]


def grub_package_upgrade(name: str, out: Path, uefi: bool) -> str:
    """UEFI: grub-efi-amd64-bin/-signed (tests/twin/test_boot_programs.py grub_upgrade); legacy BIOS:
    the root's real grub-pc-bin again at a higher version. dpkg's output."""
    if uefi:
        return grub_upgrade(name, out)
    r = runtime.ssh_run(name, [boot_packages.repack_command("grub-pc-bin")], pause_s=0.3)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


@pytest.mark.parametrize("profile", ["kpro6-grubesp", "kpro6-grubesp-bios"])
def test_a_grub_esp_trial_that_hangs_is_left_after_one_reset_and_a_good_one_becomes_the_default(twin_factory, tmp_path,
                                                                                               profile):
    uefi = profile == "kpro6-grubesp"
    twin = twin_factory(profile, address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{RELEASE} hangs\n")
    assert twin_run(twin.name, "uname", "-r").strip() == OLD

    first = converge(twin.name)
    assert first.rc == 0, first.output[-6000:]
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == OLD
    assert f">gnulinux-{OLD}-advanced-" in esp_default(root)  # the known-good, by the pin
    assert esp_grubenv(root)["next_entry"] == TRIAL_ID
    cfg = (root / ESP / "grub/grub.cfg").read_text()
    trial = cfg.split(f"$menuentry_id_option '{TRIAL_ID}' {{", 1)[1].split("\n}", 1)[0]
    assert f"vmlinuz-{RELEASE} root=ZFS=rpool/ROOT/pve-1" in trial and trial.split("\n")[1].rstrip().endswith("panic=10")
    assert (root / ESP / f"vmlinuz-{RELEASE}").exists()  # refresh copied the trial kernel onto the ESP

    subprocess.run(runtime.ssh_command(twin.name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while not boots(twin.name)[-1].endswith(" hung") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert boots(twin.name)[-1].endswith(" hung"), boots(twin.name)
    assert attempts(root)[-1].startswith(f"{RELEASE} {TRIAL_ID} hung")
    press_reset(twin.name)  # one reset: GRUB cleared next_entry as it booted the trial, the default boots
    assert twin_run(twin.name, "uname", "-r").strip() == OLD
    assert not esp_grubenv(root).get("next_entry")

    second = converge(twin.name)
    assert second.rc == 0, second.output[-6000:]
    assert f"the trial boot of {RELEASE} came up on {OLD}" in second.output, second.output[-4000:]
    failed = json.loads((root / plan.TRIAL_FAILED.lstrip("/")).read_text())
    assert failed["release"] == RELEASE and failed["came_up_on"] == OLD
    assert TRIAL_ID not in (root / ESP / "grub/grub.cfg").read_text()  # the trial entry is gone
    assert f">gnulinux-{OLD}-advanced-" in esp_default(root)
    third = converge(twin.name)  # reported, not tried again
    assert third.rc == 0 and third.changed == 0, third.output[-6000:]
    # a grub upgrade (the real trigger, the real reinit: grub-install on the ESP) keeps the pin's
    # default: the refused kernel, the newest, does not boot
    out = grub_package_upgrade(twin.name, tmp_path, uefi)
    target = "x86_64" if uefi else "i386-pc"
    assert "Processing triggers for proxmox-kernel-helper" in out and f"Installing grub {target} target.." in out, out
    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == OLD

    # the same kernel, now one that comes up: a retry needs the record gone
    (root / "var/lib/twin/boot/no-boot").write_text("")
    (root / plan.TRIAL_FAILED.lstrip("/")).unlink()
    fourth = converge(twin.name, reboot_allowed=True)
    assert fourth.rc == 0, fourth.output[-6000:]
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == RELEASE
    assert f">gnulinux-{RELEASE}-advanced-" in esp_default(root)  # the default for good
    assert TRIAL_ID not in (root / ESP / "grub/grub.cfg").read_text()
    assert not esp_grubenv(root).get("next_entry")
    reboot(twin.name)
    assert twin_run(twin.name, "uname", "-r").strip() == RELEASE
    assert "panic=" not in twin_run(twin.name, "cat", "/proc/cmdline")


SECOND_ESP = "7B2D-1F30"


def tree_digest(root: Path, *parts: str) -> dict[str, str]:
    """path -> what it is (a file's sha256, a link's target, "dir") for everything under the given
    directories of the twin root: the host's state the deploy may change."""
    out: dict[str, str] = {}
    for part in parts:
        base = root / part
        for dirpath, dirnames, filenames in os.walk(base):
            d = Path(dirpath)
            out[str(d.relative_to(root))] = "dir"
            for name in dirnames + filenames:
                p = d / name
                rel = str(p.relative_to(root))
                if p.is_symlink():
                    out[rel] = "-> " + os.readlink(p)
                elif p.is_file():
                    out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("order", ["grub-esp-first", "systemd-boot-esp-first"])
def test_esps_of_both_loaders_are_refused_before_any_change(twin_factory, tmp_path, order):
    """Issue 38: a second ESP set up by the real `proxmox-boot-tool init` for systemd-boot next to
    the GRUB-mode one. proxmox-kernel-helper zz-proxmox-boot update_esp_func keeps GRUB's mode for
    the ESPs after a GRUB one in /etc/kernel/proxmox-boot-uuids (the real refresh skips the
    systemd-boot ESP: "contains no grub directory"), so what each ESP holds depends on the order,
    and which loader starts on the firmware's: the deploy refuses, naming each ESP and the fix, and
    nothing under /boot, the ESPs or /etc changed. Before, the stages went on (a trial armed on
    the GRUB ESP only)."""
    twin = twin_factory("kpro6-grubesp", address=quiet_address())
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    (root / "var/lib/twin/esp" / SECOND_ESP).mkdir(parents=True)  # a second disk's ESP (hardware.esp_devices)
    reboot(twin.name)
    init = twin_run(twin.name, f"proxmox-boot-tool init /dev/disk/by-uuid/{SECOND_ESP} 2>&1")
    assert "Installing systemd-boot.." in init and f"{SECOND_ESP} contains no grub directory - skipping" in init, init
    if order == "systemd-boot-esp-first":
        (root / "etc/kernel/proxmox-boot-uuids").write_text(f"{SECOND_ESP}\n5A1C-9E27\n")
        out = twin_run(twin.name, "proxmox-boot-tool refresh 2>&1")
        assert f"Copying and configuring kernels on /dev/disk/by-uuid/{SECOND_ESP}" in out, out
    before = tree_digest(root, "boot", "var/lib/twin/esp", "etc")

    done = converge(twin.name, stages="operations.boot," + KERNEL_STAGES)
    assert done.rc != 0 and "preflight refused" in done.output, done.output[-6000:]
    assert "different boot loaders: " in done.output and f"{SECOND_ESP} (systemd-boot)" in done.output
    assert "5A1C-9E27 (grub)" in done.output
    assert f"proxmox-boot-tool init /dev/disk/by-uuid/{SECOND_ESP} grub" in done.output
    after = tree_digest(root, "boot", "var/lib/twin/esp", "etc")
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, changed
    assert not esp_grubenv(root).get("next_entry")


OLD_8 = "6.8.12-11-pve"  # kpro6's other installed kernel, of bookworm by its name


def test_the_kernel_hook_pins_nothing_on_esps_of_both_loaders(twin_factory, tmp_path):
    """Issue 38: the kernel hook runs inside apt, without pvegpu's preflight. On the same two ESPs
    (GRUB's, then one the real `proxmox-boot-tool init` set up for systemd-boot) a kernel whose
    NVIDIA build fails leaves the loader alone: no pin (refresh would write it as GRUB's default on
    one ESP and nothing on the other), the ESPs' modes said in its record. Before, it pinned."""
    twin = twin_factory("kpro6-grubesp", address=quiet_address())
    root = Path(twin.root)
    (root / "var/lib/twin/esp" / SECOND_ESP).mkdir(parents=True)
    reboot(twin.name)
    init = twin_run(twin.name, f"proxmox-boot-tool init /dev/disk/by-uuid/{SECOND_ESP} 2>&1")
    assert "Installing systemd-boot.." in init, init
    version = json.loads((root / "var/lib/twin/profile.json").read_text())["nvidia"]["version"]
    spec = HostSpec(nvidia={"version": version, "open": True, "modules_source": {
        "url": "file:///nonexistent/nvidia.tar.gz", "sha256": hashlib.sha256(b"none").hexdigest()}})
    # 6.8.12-11-pve has the driver's modules: the kernel the hook would keep as the default (pin)
    (root / f"lib/modules/{OLD_8}/updates/pvegpu-nvidia").mkdir(parents=True, exist_ok=True)
    nvidia_module(root / f"lib/modules/{OLD_8}/updates/pvegpu-nvidia/nvidia.ko", version)
    twin_run(twin.name, f"depmod {OLD_8}")
    hook = root / kernel_hook.HOOK.lstrip("/")
    hook.write_text(kernel_hook.hook_script(spec, 2, False))
    hook.chmod(0o755)
    bad = "6.8.12-12-pve"  # a bookworm kernel (the hook's kernel_rel), its archive missing: the build fails
    out = install_kernel(twin.name, bad)
    record = (root / f"var/lib/pvegpu/kernel-hook/{bad}.failed").read_text().splitlines()
    assert record[2].startswith("the ESPs in /etc/kernel/proxmox-boot-uuids are not in one boot-loader mode: "
                                f"5A1C-9E27 (grub), {SECOND_ESP} (systemd-boot); "), (record, out[-3000:])
    assert not (root / "etc/kernel/proxmox-boot-pin").exists()
    # the same on one mode (the second ESP's UUID off the list): the hook pins the kernel with modules
    (root / "etc/kernel/proxmox-boot-uuids").write_text("5A1C-9E27\n")
    install_kernel(twin.name, "6.8.12-13-pve")
    assert (root / "etc/kernel/proxmox-boot-pin").read_text().strip() == OLD_8
