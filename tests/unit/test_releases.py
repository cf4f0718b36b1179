"""Issue 40 item 3: the release is a fact. plan/releases.py names the Proxmox VE major of a kernel
release (pve-kernel: -bpo12 on bookworm since 6a8fa6f, every release before 6.14 and 6.14's early
bookworm builds are 8's), the spec refuses a pve-kernel build of the other major than `proxmox_ve`,
and the preflight refuses one of the other major than the host's Debian release (/etc/os-release)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from plan.releases import host_pve_major, host_release_refusals, kernel_pve_major
from spec.load import SpecError, load_spec_file

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("release,major", [
    ("6.8.12-11-pve", 8), ("6.2.16-20-pve", 8), ("6.11.11-2-pve", 8),
    ("6.14.0-1-pve", 8), ("6.14.0-2-pvegpu-pve", 8), ("6.14.4-1-pve", 8),  # bookworm, before -bpo12
    ("6.14.5-1-bpo12-pve", 8), ("6.14.11-9-bpo12-pvegpu-pve", 8),
    ("6.14.5-1-pve", 9), ("6.14.8-2-pve", 9), ("6.17.13-21-pvegpu-pve", 9), ("7.0.14-14-pvegpu-pve", 9),
    ("5.15.158-2-pve", 7),
    ("6.12.118+deb13-amd64", None), ("6.1.192-x", None)])  # no Proxmox kernel names
def test_kernel_pve_major(release, major):
    assert kernel_pve_major(release) == major


def spec_file(tmp_path: Path, example: str, **changes) -> Path:
    data = yaml.safe_load((REPO / "inventories" / example).read_text())
    host = data["hosts"]["kpro6"]
    for key, value in changes.items():
        if key == "version":
            host["kernel"]["version"] = value
        else:
            host[key] = value
    f = tmp_path / "site.yml"
    f.write_text(yaml.safe_dump(data))
    return f


@pytest.mark.parametrize("version,why", [("6.8.12-11-pvegpu-pve", "bookworm: older than 6.14"),
                                         ("6.14.0-2-pvegpu-pve", "bookworm: an early 6.14"),
                                         ("6.14.4-1-pvegpu-pve", "bookworm: an early 6.14")])
def test_proxmox_ve_9_refuses_kernels_that_are_not_9s(tmp_path, version, why):
    """On main only -bpo12 was refused: 6.8 and the early 6.14 builds passed with proxmox_ve: 9."""
    with pytest.raises(SpecError) as err:
        load_spec_file(spec_file(tmp_path, "kpro6-pve9.yml", version=version))
    assert f"{version} is a Proxmox VE 8 ({why}" in str(err.value) and "proxmox_ve is 9" in str(err.value)


@pytest.mark.parametrize("version", ["7.0.14-14-pvegpu-pve", "6.17.13-21-pvegpu-pve", "6.14.8-2-pvegpu-pve"])
def test_proxmox_ve_8_refuses_9s_kernels(tmp_path, version):
    with pytest.raises(SpecError) as err:
        load_spec_file(spec_file(tmp_path, "kpro6.yml", version=version, proxmox_ve=8))
    assert f"{version} is a Proxmox VE 9 (trixie" in str(err.value) and "proxmox_ve is 8" in str(err.value)
    assert "bookworm-6.14 at ad58d14: 6.14.11-9-bpo12-pvegpu-pve" in str(err.value)


def test_examples_pass_the_rule_with_their_own_major(tmp_path):
    assert load_spec_file(spec_file(tmp_path, "kpro6.yml", proxmox_ve=8))["kpro6"].proxmox_ve == 8
    assert load_spec_file(REPO / "inventories/kpro6-pve9.yml")["kpro6"].proxmox_ve == 9


def test_a_tarball_kernel_is_not_held_to_proxmox_names(tmp_path):
    data = yaml.safe_load((REPO / "inventories/kpro6-pve9.yml").read_text())
    data["hosts"]["kpro6"]["kernel"] = {"version": "6.12.118-pvegpu", "source": {
        "kind": "tarball", "url": "https://cdn.kernel.org/pub/linux/kernel/v6.x/linux-6.12.118.tar.xz", "sha256": "0" * 64}}
    f = tmp_path / "site.yml"
    f.write_text(yaml.safe_dump(data))
    kernel = load_spec_file(f)["kpro6"].kernel
    assert kernel is not None and kernel.version == "6.12.118-pvegpu"


def test_proxmox_ve_9_refuses_the_legacy_cgroup_switch(tmp_path):
    f = spec_file(tmp_path, "kpro6-pve9.yml", iommu={"vendor": "amd", "params": ["systemd.unified_cgroup_hierarchy=0"]})
    with pytest.raises(SpecError, match=r"iommu.params.*systemd.unified_cgroup_hierarchy=0 asks for the legacy"):
        load_spec_file(f)
    assert load_spec_file(spec_file(tmp_path, "kpro6.yml", iommu={"params": ["systemd.unified_cgroup_hierarchy=0"]}))


BOOKWORM, TRIXIE = {"codename": "bookworm", "version_id": "12"}, {"codename": "trixie", "version_id": "13"}


def test_host_major_from_os_release_then_pve_manager():
    assert host_pve_major(BOOKWORM, {"major": 9}) == 8  # mid-upgrade: pve-manager 9 is not yet the release
    assert host_pve_major(TRIXIE, None) == 9
    assert host_pve_major({"codename": None}, {"major": 8}) == 8
    assert host_pve_major(None, None) is None


def test_a_9_kernel_on_a_bookworm_host_is_refused_before_the_clone():
    """proxmox_ve: 9 with kpro6-pve9.yml's kernel on a bookworm host: on main the kernel stage
    cloned master and built it with GCC 12."""
    refused = host_release_refusals(9, "7.0.14-14-pvegpu-pve", True, BOOKWORM, {"major": 8})
    assert len(refused) == 1
    assert refused[0].startswith("kernel.version 7.0.14-14-pvegpu-pve is a Proxmox VE 9 kernel")
    assert "this host runs Debian bookworm (Proxmox VE 8)" in refused[0] and "bookworm's GCC 12" in refused[0]
    assert "leave kernel: out until the 8 -> 9 upgrade is done" in refused[0]
    # a trixie pve-kernel ref with no proxmox_ve at all: the same
    assert host_release_refusals(None, "6.17.13-21-pvegpu-pve", True, BOOKWORM, None) != []
    # an 8 kernel on a trixie host
    back = host_release_refusals(9, "6.14.11-9-bpo12-pvegpu-pve", True, TRIXIE, {"major": 9})
    assert len(back) == 1 and "trixie's GCC 14, not the GCC 12 of its own release" in back[0]


def test_what_is_of_the_hosts_release_passes():
    assert host_release_refusals(8, "6.14.11-9-bpo12-pvegpu-pve", True, BOOKWORM, {"major": 8}) == []
    assert host_release_refusals(9, "7.0.14-14-pvegpu-pve", True, TRIXIE, {"major": 9}) == []
    assert host_release_refusals(9, None, False, BOOKWORM, {"major": 8}) == []  # the upgrade's preview
    assert host_release_refusals(9, "6.12.118-pvegpu", False, BOOKWORM, {"major": 8}) == []  # tarball: host's GCC
    assert host_release_refusals(9, "7.0.14-14-pvegpu-pve", True, None, None) == []  # nothing known


def test_proxmox_ve_8_on_a_trixie_host_is_refused():
    refused = host_release_refusals(8, None, False, TRIXIE, {"major": 9})
    assert refused == ["the spec says proxmox_ve: 8, but this host runs Debian trixie (Proxmox VE 9): there is no "
                       "way back to 8; set proxmox_ve: 9"]
