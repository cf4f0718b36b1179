"""The 8 -> 9 upgrade check (plan/upgrade.py, issue 29 part 4, issue 40) on the fact recorded on the
kpro6 twin (tests/fixtures/twin-kpro6/upgrade-state-dkms-sdboot-pins-hold.txt), each branch of
pve-manager PVE/CLI/pve8to9.pm it mirrors, what is due after the upgrade, and the spec rule for 9."""

from pathlib import Path

import pytest
import yaml

from facts.upgrade import parse_upgrade_state
from plan.upgrade import HostView, upgrade_findings
from spec.load import SpecError, load_spec_file

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
RECORDED = parse_upgrade_state((FIXTURES / "twin-kpro6/upgrade-state-dkms-sdboot-pins-hold.txt").read_text()
                               .splitlines()[2:])
CLEAN = {"dkms": [], "systemd_boot": False, "boot_uuids": True, "efi": True, "pin": None, "grub_saved": None,
         "grub_efi": False, "removable": False, "removable_updated": False, "holds": []}
GRUB_EFI = {**CLEAN, "boot_uuids": False, "grub_efi": True}  # UEFI, GRUB, no proxmox-boot-tool ESPs


def test_recorded_state_gives_each_finding_with_its_fix():
    found = upgrade_findings(RECORDED, {200: "lxc.cgroup.devices.allow: c 195:* rwm\n", 201: "arch: amd64\n"},
                             "595.71.05")
    assert len(found) == 6
    dkms, sdboot, pin, grub_pin, cgroup, rebuild = found
    assert dkms.startswith("dkms status lists nvidia/550.163.01: added: pve8to9 warns")
    assert "a second nvidia.ko beside pvegpu's" in dkms and "Fix: remove them before the upgrade" in dkms
    assert sdboot.startswith("the systemd-boot meta-package is installed on this proxmox-boot-tool host")
    assert "apt remove systemd-boot" in sdboot
    assert pin.startswith("proxmox-boot-tool pins kernel 6.8.12-11-pve, a Proxmox VE 8 kernel")
    assert "proxmox-boot-tool kernel unpin" in pin
    # pvegpu's own GRUB default (grub-set-default of an early bookworm 6.14 build): on main, missed
    assert grub_pin.startswith("GRUB's saved default (grubenv saved_entry") and "6.14.0-2-pvegpu-pve" in grub_pin
    assert "grub-editenv /boot/grub/grubenv unset saved_entry" in grub_pin
    assert cgroup.startswith("CT 200: `lxc.cgroup.devices.allow: c 195:* rwm` is a cgroup v1 key")
    assert "nvidia 595.71.05 built with GCC 14" in rebuild
    # the hook builds 9's kernel with its own gcc-14 during the dist-upgrade once gcc-14/g++-14 are
    # configured: they come with the upgrade where gcc and g++ are installed; the converge is the fallback
    assert "keep gcc and g++ (build-essential) and proxmox-default-headers installed" in rebuild
    assert "still names 9's kernel, converge first" in rebuild


def test_a_clean_host_has_no_findings():
    assert upgrade_findings(CLEAN, {200: "arch: amd64\n"}) == []


# pve-kernel debian/changelog of bookworm-6.14: 6.14.0-1, 6.14.0-2 and 6.14.4-1 were bookworm builds
# named without -bpo12 (commit 6a8fa6f added it with 6.14.5-1~bpo12+1); 9.0 shipped 6.14.8-2
PINS = [("6.8.12-11-pve", True), ("6.14.11-9-bpo12-pve", True), ("6.14.11-9-bpo12-pvegpu-pve", True),
        ("6.14.0-1-pve", True), ("6.14.0-2-pve", True), ("6.14.4-1-pve", True), ("6.14.4-1-pvegpu-pve", True),
        ("6.14.8-2-pve", False), ("6.17.13-21-pve", False), ("7.0.14-14-pve", False), ("7.0.14-14-pvegpu-pve", False)]


@pytest.mark.parametrize("pin,bookworm", PINS)
def test_pins_of_8s_kernels_are_found(pin, bookworm):
    assert bool(upgrade_findings({**CLEAN, "pin": pin}, {})) is bookworm


@pytest.mark.parametrize("release,bookworm", PINS)
def test_grub_saved_defaults_of_8s_kernels_are_found(release, bookworm):
    """pvegpu's kernel stage pins on GRUB with grub-set-default (plan.kernel.set_default_command)."""
    entry = f"gnulinux-advanced-7f3c9a>gnulinux-{release}-advanced-7f3c9a"
    found = upgrade_findings({**GRUB_EFI, "grub_saved": entry}, {})
    assert bool(found) is bookworm, found
    assert all("grub-editenv /boot/grub/grubenv unset saved_entry" in f for f in found)


def test_legacy_boot_host_with_systemd_boot():
    found = upgrade_findings({**CLEAN, "systemd_boot": True, "efi": False, "boot_uuids": False}, {})
    assert found == ["the systemd-boot package is installed on a legacy-boot (BIOS) host, where pve8to9 calls it "
                     "unnecessary. Fix: apt remove systemd-boot"]


def test_spec_for_9_refuses_a_bookworm_kernel(tmp_path):
    data = yaml.safe_load((REPO / "inventories/kpro6-pve9.yml").read_text())
    assert load_spec_file(REPO / "inventories/kpro6-pve9.yml")["kpro6"].proxmox_ve == 9
    data["hosts"]["kpro6"]["kernel"]["version"] = "6.14.11-9-bpo12-pve"
    f = tmp_path / "site.yml"
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError) as exc:
        load_spec_file(f)
    msg = str(exc.value)
    assert str(f) in msg and "kpro6" in msg and "kernel.version" in msg
    assert "6.14.11-9-bpo12-pve is a Proxmox VE 8 (bookworm, -bpo12) kernel, but proxmox_ve is 9" in msg
    data["hosts"]["kpro6"]["proxmox_ve"] = 10
    f.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match="proxmox_ve"):
        load_spec_file(f)


def test_legacy_boot_host_with_systemd_boot_after_the_upgrade_too():
    bios = {**CLEAN, "systemd_boot": True, "efi": False, "boot_uuids": False}
    assert upgrade_findings(bios, {}, host=HostView(upgraded=True)) == upgrade_findings(bios, {})


def test_grub_efi_without_the_meta_package():
    """pve8to9 check_bootloader: UEFI, no proxmox-boot-tool ESPs, grub-efi-amd64 not installed."""
    found = upgrade_findings({**GRUB_EFI, "grub_efi": False}, {})
    assert len(found) == 1 and "grub-efi-amd64 meta-package is not installed" in found[0]
    assert found[0].endswith("Fix: apt install grub-efi-amd64")


@pytest.mark.parametrize("updated", [False, True])
def test_removable_loader_that_grub_does_not_update(updated):
    found = upgrade_findings({**GRUB_EFI, "removable": True, "removable_updated": updated}, {})
    if updated:
        assert found == []
    else:
        assert len(found) == 1 and "/boot/efi/EFI/BOOT/BOOTX64.efi" in found[0]
        assert "grub2/force_efi_extra_removable boolean true' | debconf-set-selections" in found[0]
        assert "apt install --reinstall grub-efi-amd64" in found[0]


def test_systemd_boot_on_a_grub_efi_host_fails_before_the_upgrade():
    """pve8to9: without proxmox-boot-tool ESPs the systemd-boot meta-package fails at once."""
    found = upgrade_findings({**GRUB_EFI, "systemd_boot": True}, {})
    assert len(found) == 1 and "Fix before the upgrade: apt remove systemd-boot" in found[0]


def test_systemd_boot_on_a_proxmox_boot_tool_host():
    sd = {**CLEAN, "systemd_boot": True}
    # ESPs set up for systemd-boot, not yet upgraded: pve8to9 skips ("still needed for bootctl")
    before = upgrade_findings(sd, {}, host=HostView(pbt_systemd_boot=True))
    assert len(before) == 1 and "Fix: right after the upgrade, apt remove systemd-boot" in before[0]
    # ESPs set up for GRUB: it fails already
    grub = upgrade_findings(sd, {}, host=HostView(pbt_systemd_boot=False))
    assert len(grub) == 1 and "Fix before the upgrade: apt remove systemd-boot" in grub[0]
    # upgraded: due now
    after = upgrade_findings(sd, {}, host=HostView(upgraded=True, pbt_systemd_boot=True))
    assert len(after) == 1 and "Fix now (the host runs 9): apt remove systemd-boot" in after[0]


def test_after_the_upgrade_the_check_says_what_is_due():
    """The host runs 9 (pve-manager 9): systemd-boot to remove, 8's kernel to unpin before the
    reboot, the reboot into 9's kernel; no rebuild note (the converge does it)."""
    state = {**CLEAN, "systemd_boot": True, "pin": "6.14.11-9-bpo12-pvegpu-pve"}
    found = upgrade_findings(state, {}, "595.71.05",
                             HostView(upgraded=True, running_kernel="6.14.11-9-bpo12-pvegpu-pve", pbt_systemd_boot=True))
    assert len(found) == 3, found
    sdboot, pin, reboot = found
    assert "Fix now (the host runs 9): apt remove systemd-boot" in sdboot
    assert "the host runs Proxmox VE 9 now" in pin and "Fix now, before the reboot: proxmox-boot-tool kernel unpin" in pin
    assert "on kernel 6.14.11-9-bpo12-pvegpu-pve, a Proxmox VE 8 kernel" in reboot
    assert upgrade_findings(CLEAN, {}, "595.71.05", HostView(upgraded=True, running_kernel="7.0.14-14-pve")) == []


@pytest.mark.parametrize("upgraded", [False, True])
def test_held_kernel_metas_are_named_with_their_release(upgraded):
    state = {**CLEAN, "holds": ["proxmox-default-kernel", "proxmox-kernel-6.8", "proxmox-kernel-helper"]}
    found = upgrade_findings(state, {}, host=HostView(upgraded=upgraded, kernel_updates="hold"))
    assert len(found) == 1, found
    assert found[0].startswith("proxmox-default-kernel, proxmox-kernel-6.8 are on hold")
    assert "kernel_updates: hold" in found[0] and "apt-mark unhold proxmox-default-kernel proxmox-kernel-6.8" in found[0]
    assert ("apt full-upgrade" in found[0]) is upgraded
    assert upgrade_findings({**CLEAN, "holds": ["proxmox-kernel-helper"]}, {}) == []


@pytest.mark.parametrize("word,legacy", [("systemd.unified_cgroup_hierarchy=0", True),
                                         ("systemd.unified_cgroup_hierarchy=false", True),
                                         ("systemd.unified_cgroup_hierarchy=1", False),
                                         ("systemd.unified_cgroup_hierarchy", False)])
def test_legacy_cgroup_switch_on_the_command_line(word, legacy):
    found = upgrade_findings(CLEAN, {}, host=HostView(cmdline_params=["root=ZFS=rpool/ROOT/pve-1", word],
                                                       cmdline_file="/etc/kernel/cmdline"))
    assert bool(found) is legacy
    if legacy:
        assert f"the kernel command line in /etc/kernel/cmdline has {word}" in found[0]


@pytest.mark.parametrize("version,old", [("8.3.0", True), ("8.4.0", False), ("8.4.1", False), ("8.2-4", True)])
def test_the_8_4_minimum(version, old):
    found = upgrade_findings(CLEAN, {}, host=HostView(proxmox_ve=version))
    assert bool(found) is old
    if old:
        assert found[0].startswith(f"proxmox-ve is {version}: pve8to9 fails below 8.4-0")


def test_running_gpu_guests_before_the_upgrade():
    found = upgrade_findings(CLEAN, {}, host=HostView(running_gpu_guests=["CT 200", "VM 300"]))
    assert found == [found[0]] and found[0].startswith("GPU guests run (CT 200, VM 300): pve8to9 warns")
