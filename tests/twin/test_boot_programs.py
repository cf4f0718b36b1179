"""The twin's boot chain on a running twin: proxmox-kernel-helper's own proxmox-boot-tool, kernel
hooks, trigger and boot-cleanup unit, systemd's own bootctl, over the stand-ins for what a chroot
cannot have (tests/twin/standins/esp.sh: the ESPs' block devices and mounts; the NVRAM as efivarfs
files) and the firmware's choice at a reset (tests/twin/hardware.py esp_boot_entry, boot.c's rules)."""
from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.twin import boot_packages, hardware, runtime

ESP = "var/lib/twin/esp/5A1C-9E27"
NEW = "6.14.11-1-pve"


def sh(name: str, cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = runtime.ssh_run(name, [cmd], pause_s=0.3)
    if check:
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r


def reboot(name: str) -> str:
    """Reboot the twin and wait for it; the release it came up with."""
    boots = runtime.twin_dir(name) / "boots"
    before = len(boots.read_text().splitlines())
    subprocess.run(runtime.ssh_command(name, ["reboot"]), capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while len(boots.read_text().splitlines()) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(boots.read_text().splitlines()) > before, "the twin did not reboot"
    return sh(name, "uname -r").stdout.strip()


def loader_default(root: Path) -> str:
    lines = [line for line in (root / ESP / "loader/loader.conf").read_text().splitlines() if line.startswith("default ")]
    return lines[-1].split(None, 1)[1]


# A kernel package as dpkg installs one: its image, initrd and modules dir, and the postinst that
# runs the kernel hooks (pve-kernel debian/proxmox-kernel.postinst.in: run-parts with version and image)
KERNEL_DEB = r"""set -e
d=$(mktemp -d /root/kdeb.XXXXXX)
mkdir -p "$d/DEBIAN" "$d/boot" "$d/lib/modules/{rel}"
echo image > "$d/boot/vmlinuz-{rel}"
printf 'CONFIG_BLK_DEV_INITRD=y\nCONFIG_RD_GZIP=y\nCONFIG_MODULES=y\n' > "$d/boot/config-{rel}"
printf 'Package: proxmox-kernel-{rel}-signed\nVersion: 1\nArchitecture: amd64\nProvides: proxmox-kernel-{rel}\nMaintainer: t <t@example.invalid>\nDescription: twin test kernel\n' > "$d/DEBIAN/control"
printf '#!/bin/sh\nset -e\n[ "$1" = configure ] || exit 0\nrun-parts --verbose --exit-on-error --arg={rel} --arg=/boot/vmlinuz-{rel} /etc/kernel/postinst.d\n' > "$d/DEBIAN/postinst"
chmod 755 "$d/DEBIAN/postinst"
dpkg-deb -Zgzip -b "$d" "$d.deb" >/dev/null
dpkg -i "$d.deb"
rm -rf "$d" "$d.deb"
"""


def install_kernel(name: str, rel: str) -> str:
    return sh(name, KERNEL_DEB.format(rel=rel)).stdout


# An upgrade of systemd-boot-efi: the installed package's files again under a higher version, so
# dpkg unpacks files below /usr/lib/systemd/boot and fires the triggers interested in that path
# (proxmox-kernel-helper's debian/triggers), whose postinst then runs `proxmox-boot-tool reinit`
BOOT_EFI_UPGRADE = r"""set -e
d=$(mktemp -d /root/efideb.XXXXXX)
v=$(dpkg-query -W -f '${Version}' systemd-boot-efi)
mkdir -p "$d/DEBIAN"
dpkg-query -L systemd-boot-efi | while read -r f; do [ -f "$f" ] && install -D "$f" "$d$f"; done
printf 'Package: systemd-boot-efi\nVersion: %s+twin1\nArchitecture: amd64\nMaintainer: t <t@example.invalid>\nDescription: systemd-boot EFI binaries (upgrade)\n' "$v" > "$d/DEBIAN/control"
dpkg-deb -Zgzip -b "$d" "$d.deb" >/dev/null
dpkg -i "$d.deb"
rm -rf "$d" "$d.deb"
"""


def upgrade_systemd_boot_efi(name: str) -> str:
    r = sh(name, BOOT_EFI_UPGRADE)
    return r.stdout + r.stderr


@pytest.fixture
def kpro6(twin_factory):
    return twin_factory("kpro6")


def test_proxmox_boot_tool_is_the_real_package_and_sees_the_esp_as_a_partition(kpro6):
    name = kpro6.name
    assert sh(name, "dpkg-query -W -f '${Version} ${Status}' proxmox-kernel-helper").stdout == "8.1.4 install ok installed"
    assert sh(name, "head -1 /usr/sbin/proxmox-boot-tool").stdout == "#!/bin/sh\n"
    status = sh(name, "proxmox-boot-tool status").stdout
    assert "5A1C-9E27 is configured with: uefi (versions: 6.14.8-2-pve, 6.8.12-11-pve)" in status
    assert sh(name, "lsblk --bytes --pairs -o 'UUID,SIZE,FSTYPE,PARTTYPE,PKNAME,MOUNTPOINT' "
                    "$(realpath /dev/disk/by-uuid/5A1C-9E27)").stdout == (
        'UUID="5A1C-9E27" SIZE="1073741824" FSTYPE="vfat" PARTTYPE="c12a7328-f81f-11d2-ba4b-00a0c93ec93b" '
        'PKNAME="sda" MOUNTPOINT=""\n')
    r = sh(name, "mkdir -p /mnt/e && mount -t vfat -o umask=0077 /dev/disk/by-uuid/5A1C-9E27 /mnt/e && "
                 "lsblk -P -o MOUNTPOINT /dev/sda2 && ls /mnt/e/loader && umount /dev/sda2 && lsblk -P -o MOUNTPOINT /dev/sda2")
    assert r.stdout.splitlines() == ['MOUNTPOINT="/mnt/e"', "entries", "loader.conf", 'MOUNTPOINT=""']
    r = sh(name, "mount /dev/disk/by-uuid/0000-0000 /mnt/e", check=False)
    assert r.returncode == 32
    # the real bootctl reads the NVRAM model: the loader that booted, the entry it chose
    out = sh(name, "bootctl status 2>/dev/null", check=False).stdout
    assert "Product: systemd-boot 252." in out


def test_kernel_hook_pin_next_boot_and_cleanup_unit_as_shipped(kpro6):
    name, root = kpro6.name, Path(kpro6.root)
    install_kernel(name, NEW)
    assert (root / ESP / f"loader/entries/proxmox-{NEW}.conf").exists()
    assert reboot(name) == NEW  # default proxmox-*: the newest entry
    sh(name, "proxmox-boot-tool kernel pin 6.8.12-11-pve --next-boot && proxmox-boot-tool refresh")
    assert loader_default(root) == "proxmox-6.8.12-11-pve.conf"
    assert reboot(name) == "6.8.12-11-pve"
    # proxmox-boot-cleanup.service ran at that boot: unpinned and refreshed
    assert not (root / "etc/kernel/next-boot-pin").exists()
    assert loader_default(root) == "proxmox-*"
    assert reboot(name) == NEW
    sh(name, "proxmox-boot-tool kernel pin 6.14.8-2-pve")
    assert reboot(name) == NEW  # pinned, not refreshed
    sh(name, "proxmox-boot-tool refresh")
    assert reboot(name) == "6.14.8-2-pve"
    # /etc/kernel/cmdline's first line becomes the entries' options at the next refresh
    sh(name, "echo 'root=ZFS=rpool/ROOT/pve-1 boot=zfs amd_iommu=on iommu=pt' > /etc/kernel/cmdline")
    reboot(name)
    assert "iommu=pt" not in sh(name, "cat /proc/cmdline").stdout
    sh(name, "proxmox-boot-tool refresh")
    reboot(name)
    assert sh(name, "cat /proc/cmdline").stdout == (
        "initrd=\\EFI\\proxmox\\6.14.8-2-pve\\initrd.img-6.14.8-2-pve root=ZFS=rpool/ROOT/pve-1 boot=zfs amd_iommu=on iommu=pt\n")
    assert sh(name, "cat /sys/module/kvm_amd/parameters/sev_snp").stdout == "N\n"


def test_bootctl_one_shot_is_read_once_and_the_default_variable_beats_loader_conf(kpro6):
    name, root = kpro6.name, Path(kpro6.root)
    sh(name, "bootctl set-oneshot proxmox-6.8.12-11-pve.conf")
    assert reboot(name) == "6.8.12-11-pve"
    assert not list((root / "var/lib/twin/efivars").glob("LoaderEntryOneShot-*"))  # deleted as read
    assert reboot(name) == "6.14.8-2-pve"
    sh(name, "bootctl set-default proxmox-6.8.12-11-pve.conf")
    assert loader_default(root) == "proxmox-*"
    assert reboot(name) == "6.8.12-11-pve"  # LoaderEntryDefault over loader.conf's default
    assert reboot(name) == "6.8.12-11-pve"
    sh(name, "bootctl set-default ''")
    assert reboot(name) == "6.14.8-2-pve"


def test_a_one_shot_that_hangs_or_panics_is_left_after_one_reset(kpro6):
    name, root = kpro6.name, Path(kpro6.root)
    install_kernel(name, NEW)
    sh(name, "proxmox-boot-tool kernel pin 6.14.8-2-pve && proxmox-boot-tool refresh")
    entries = root / ESP / "loader/entries"
    (entries / f"pvegpu-trial-{NEW}.conf").write_text(
        (entries / f"proxmox-{NEW}.conf").read_text().replace("boot=zfs", "boot=zfs panic=10"))
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{NEW} panics\n")
    sh(name, f"bootctl set-oneshot pvegpu-trial-{NEW}.conf")
    assert reboot(name) == "6.14.8-2-pve"  # panicked, reset by panic=10, the default came up
    attempts = (root / "var/lib/twin/boot/attempts").read_text().splitlines()[-2:]
    assert attempts[0].startswith(f"{NEW} pvegpu-trial-{NEW}.conf panic") and attempts[1].startswith("6.14.8-2-pve ")


def test_a_next_boot_pin_as_loader_default_boots_a_hanging_kernel_at_every_reset(kpro6):
    """`kernel pin --next-boot` + refresh writes loader.conf's default; only the cleanup unit (user
    space) puts it back, so a kernel that hangs is chosen again at every reset."""
    name, root = kpro6.name, Path(kpro6.root)
    install_kernel(name, NEW)
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{NEW}\n")
    sh(name, f"proxmox-boot-tool kernel pin 6.14.8-2-pve && proxmox-boot-tool kernel pin {NEW} --next-boot "
             "&& proxmox-boot-tool refresh")
    boots = runtime.twin_dir(name) / "boots"

    def booted(count: int) -> bool:  # the supervisor records a boot, hung or not (a fixed sleep failed under load)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(boots.read_text().splitlines()) >= count:
                return True
            time.sleep(0.2)
        return False

    first = len(boots.read_text().splitlines())
    subprocess.run(runtime.ssh_command(name, ["reboot"]), capture_output=True, timeout=60)
    for n in range(1, 4):
        assert booted(first + n)
        assert hardware.hung(root)
        runtime.reset(name)
    assert booted(first + 4)
    assert hardware.hung(root) and (root / "etc/kernel/next-boot-pin").exists()


def test_a_systemd_boot_efi_upgrade_fires_the_real_trigger_and_reinit_drops_the_pin(kpro6):
    """proxmox-kernel-helper's trigger (interest in /usr/lib/systemd/boot) runs its postinst
    `triggered`: `proxmox-boot-tool reinit` reinstalls systemd-boot and rewrites loader.conf to
    `default proxmox-*`, whatever pin refresh had written (proxmox-boot-tool init_bootloader)."""
    name, root = kpro6.name, Path(kpro6.root)
    sh(name, "proxmox-boot-tool kernel pin 6.8.12-11-pve && proxmox-boot-tool refresh")
    assert loader_default(root) == "proxmox-6.8.12-11-pve.conf"
    out = upgrade_systemd_boot_efi(name)
    assert "Processing triggers for proxmox-kernel-helper" in out and "Installing systemd-boot.." in out
    assert loader_default(root) == "proxmox-*"
    assert reboot(name) == "6.14.8-2-pve"


def test_the_firmware_orders_entries_as_systemd_does(kpro6):
    """systemd-boot sorts entries without a sort-key by id, newest first, with systemd's
    strverscmp_improved, in which "1a" is newer than "1.a" (a '.'-prefixed segment is older than
    one without); the twin's firmware model asks the root's own systemd (before: a Python copy
    that had '.' newer, so the twin booted the other entry than systemd-boot would)."""
    root = Path(kpro6.root)
    entries = root / ESP / "loader/entries"
    template = (entries / "proxmox-6.14.8-2-pve.conf").read_text()
    for entry_id in ("zz-1.a", "zz-1a"):
        (entries / f"{entry_id}.conf").write_text(template.replace("title ", f"title {entry_id} ", 1))
    conf = root / ESP / "loader/loader.conf"
    conf.write_text("".join(line + "\n" for line in conf.read_text().splitlines()
                            if not line.startswith("default ")) + "default zz-*\n")
    assert hardware.strverscmp_improved(root, "zz-1a", "zz-1.a") > 0 > hardware.strverscmp_improved(root, "zz-1.a", "zz-1a")
    entry = hardware.esp_boot_entry(root)
    assert entry is not None and entry["file"] == "zz-1a.conf", entry


def install_debs(name: str, debs: list[Path]) -> str:
    """`dpkg -i` of packages built on this machine (copied into the twin's /root first)."""
    root = Path(runtime.spec_of(name)["root"])
    for deb in debs:
        shutil.copyfile(deb, root / "root" / deb.name)
    r = sh(name, "dpkg -i " + " ".join(f"/root/{d.name}" for d in debs) + " && rm -f "
           + " ".join(f"/root/{d.name}" for d in debs))
    return r.stdout + r.stderr


def grub_upgrade(name: str, out: Path) -> str:
    """grub-efi-amd64-bin and -signed installed at an earlier build of the root's grub2, then
    upgraded to it (bookworm: 2.06-13+deb12u2, trixie: 2.12-9+deb13u4 with -unsigned, the versions
    Debian ships: boot_packages.GRUB2): dpkg's output of the upgrade."""
    version = sh(name, "dpkg-query -W -f '${Version}' grub-common").stdout
    install_debs(name, boot_packages.grub_efi_debs(out, f"{version}~twin0"))
    return install_debs(name, boot_packages.grub_efi_debs(out, version))


@pytest.fixture
def grubesp(twin_factory):
    return twin_factory("kpro6-grubesp")


def test_grub_esp_twin_boots_what_the_esps_grub_cfg_says(grubesp):
    """proxmox-boot-tool's grub mode, run by the real program: refresh copies the kernels to the
    ESP and writes its grub/grub.cfg (update-grub with the ESP bound on /boot in its own mount
    namespace), the pin as GRUB_DEFAULT; the firmware model boots from that grub.cfg, not /boot/grub's."""
    name, root = grubesp.name, Path(grubesp.root)
    assert "5A1C-9E27 is configured with: grub (versions: 6.14.8-2-pve, 6.8.12-11-pve)" in \
        sh(name, "proxmox-boot-tool status").stdout
    assert sh(name, "uname -r").stdout.strip() == "6.14.8-2-pve"  # no pin: 10_linux's first entry, the newest
    sh(name, "proxmox-boot-tool kernel pin 6.8.12-11-pve && proxmox-boot-tool refresh")
    cfg = (root / ESP / "grub/grub.cfg").read_text()
    found = re.search(r"gnulinux-advanced-(\S+)'", cfg)
    assert found, cfg
    dev = found.group(1)
    assert f'set default="gnulinux-advanced-{dev}>gnulinux-6.8.12-11-pve-advanced-{dev}"' in cfg
    assert 'set default="0"' in (root / "boot/grub/grub.cfg").read_text()  # the root's: not what boots
    assert reboot(name) == "6.8.12-11-pve"
    # next_entry in the ESP's grubenv boots once and GRUB clears it (save_env on the vfat ESP)
    sh(name, f"grub-editenv /{ESP}/grub/grubenv set "
             f"'next_entry=gnulinux-advanced-{dev}>gnulinux-6.14.8-2-pve-advanced-{dev}'")
    assert reboot(name) == "6.14.8-2-pve"
    assert "next_entry=\n" in (root / ESP / "grub/grubenv").read_text()
    assert reboot(name) == "6.8.12-11-pve"


def test_a_grub_upgrade_on_grub_esps_runs_the_real_reinit_and_the_pin_still_boots(grubesp, tmp_path):
    """A grub-efi-amd64-bin/-signed upgrade unpacks files below /usr/lib/grub: dpkg runs
    proxmox-kernel-helper's trigger, whose postinst runs the real `proxmox-boot-tool reinit`: in
    grub mode grub-install again on each ESP (a new EFI image, the modules), grub.cfg and grubenv
    left as they were, so the pinned kernel still boots and the newest (one that hangs) does not."""
    name, root = grubesp.name, Path(grubesp.root)
    install_kernel(name, NEW)
    sh(name, "proxmox-boot-tool kernel pin 6.14.8-2-pve && proxmox-boot-tool refresh")
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{NEW} hangs\n")
    before = (root / ESP / "grub/grub.cfg").read_text()
    out = grub_upgrade(name, tmp_path)
    version = sh(name, "dpkg-query -W -f '${Version}' grub-common").stdout
    assert "Processing triggers for proxmox-kernel-helper" in out and "Installing grub x86_64 target.." in out, out
    assert (root / ESP / "EFI/proxmox/grubx64.efi").read_text() == f"twin GRUB image: grub-efi-amd64-bin {version}\n"
    assert (root / ESP / "EFI/BOOT/BOOTX64.EFI").read_text() == f"twin GRUB image: grub-efi-amd64-bin {version}\n"
    assert (root / ESP / "grub/grub.cfg").read_text() == before
    assert reboot(name) == "6.14.8-2-pve"
    out = install_debs(name, [boot_packages.shim_signed(tmp_path, boot_packages.SHIM_SIGNED["bookworm"] + "~twin0")])
    out = install_debs(name, [boot_packages.shim_signed(tmp_path, boot_packages.SHIM_SIGNED["bookworm"])])
    assert "Processing triggers for proxmox-kernel-helper" in out and "Installing grub x86_64 target.." in out, out
    assert reboot(name) == "6.14.8-2-pve"


def test_a_grub_upgrade_on_systemd_boot_esps_reinits_and_the_efi_default_still_boots(kpro6, tmp_path):
    """The same trigger on a systemd-boot host: reinit reinstalls systemd-boot and rewrites
    loader.conf to `default proxmox-*`; the EFI default (LoaderEntryDefault, what pvegpu keeps
    beside the pin) survives it, so the newest kernel (one that hangs) does not boot."""
    name, root = kpro6.name, Path(kpro6.root)
    install_kernel(name, NEW)
    sh(name, "proxmox-boot-tool kernel pin 6.14.8-2-pve && proxmox-boot-tool refresh "
             "&& bootctl set-default proxmox-6.14.8-2-pve.conf")
    (root / "var/lib/twin/boot").mkdir(parents=True, exist_ok=True)
    (root / "var/lib/twin/boot/no-boot").write_text(f"{NEW} hangs\n")
    out = grub_upgrade(name, tmp_path)
    assert "Processing triggers for proxmox-kernel-helper" in out and "Installing systemd-boot.." in out, out
    assert loader_default(root) == "proxmox-*"
    assert reboot(name) == "6.14.8-2-pve"
