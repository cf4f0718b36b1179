"""The 8 -> 9 upgrade check (plan/upgrade.py, issue 29 part 4) on the fact recorded on the kpro6
twin (tests/fixtures/twin-kpro6/upgrade-state-dkms-sdboot-pin.txt), and the spec rule for 9."""

from pathlib import Path

import pytest
import yaml

from facts.upgrade import parse_upgrade_state
from plan.upgrade import upgrade_findings
from spec.load import SpecError, load_spec_file

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
RECORDED = parse_upgrade_state((FIXTURES / "twin-kpro6/upgrade-state-dkms-sdboot-pin.txt").read_text().splitlines()[2:])
CLEAN = {"dkms": [], "systemd_boot": False, "boot_uuids": True, "efi": True, "pin": None}


def test_recorded_state_gives_each_finding_with_its_fix():
    found = upgrade_findings(RECORDED, {200: "lxc.cgroup.devices.allow: c 195:* rwm\n", 201: "arch: amd64\n"},
                             "595.71.05")
    assert len(found) == 5
    dkms, sdboot, pin, cgroup, rebuild = found
    assert dkms.startswith("dkms status lists nvidia/550.163.01: added: pve8to9 warns")
    assert "a second nvidia.ko beside pvegpu's" in dkms and "Fix: remove them before the upgrade" in dkms
    assert sdboot.startswith("the systemd-boot meta-package is installed on this proxmox-boot-tool host")
    assert "apt remove systemd-boot" in sdboot
    assert pin.startswith("proxmox-boot-tool pins kernel 6.8.12-11-pve, a Proxmox VE 8 kernel")
    assert "proxmox-boot-tool kernel unpin" in pin
    assert cgroup.startswith("CT 200: `lxc.cgroup.devices.allow: c 195:* rwm` is a cgroup v1 key")
    assert "nvidia 595.71.05 for 9's kernel with GCC 14" in rebuild


def test_a_clean_host_has_no_findings():
    assert upgrade_findings(CLEAN, {200: "arch: amd64\n"}) == []


@pytest.mark.parametrize("pin,bookworm", [("6.8.12-11-pve", True), ("6.14.11-9-bpo12-pve", True),
                                          ("6.14.11-9-bpo12-pvegpu-pve", True), ("6.17.13-21-pve", False),
                                          ("7.0.14-14-pve", False), ("7.0.14-14-pvegpu-pve", False)])
def test_pins_of_8s_kernels_are_found(pin, bookworm):
    assert bool(upgrade_findings({**CLEAN, "pin": pin}, {})) is bookworm


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
