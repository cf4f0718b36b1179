"""`facts.nvidia.parse_registry_dwords`: the RM registry keys the loaded driver was given, read
from /proc/driver/nvidia/params as the driver reads NVreg_RegistryDwords(PerDevice)
(open-gpu-kernel-modules kernel-open/nvidia/os-registry.c, printed by nv-procfs.c)."""

from pathlib import Path

import pytest

from facts.nvidia import parse_colon_params, parse_registry_dwords

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def recorded_params() -> dict:
    """The params file recorded on the h200-vm (tests/fixtures/INDEX.tsv), its two header lines cut."""
    return parse_colon_params((FIXTURES / "h200-vm/driver-params.txt").read_text().splitlines()[2:])


def test_the_recorded_params_file_gives_no_keys():
    params = recorded_params()
    assert params["RegistryDwords"] == '""' and params["RegistryDwordsPerDevice"] == '""'
    assert parse_registry_dwords(params) == {"global": {}, "per_device": {}}


@pytest.mark.parametrize("line, keys", [
    # club-3090 docs/PCIE_P2P.md: the override confirmed live on a patched-driver rig
    ('RegistryDwords: "RMForceStaticBar1=1;PeerMappingOverride=1"', {"RMForceStaticBar1": 1, "PeerMappingOverride": 1}),
    # a CMP 170HX P2P README's grep of /proc/driver/nvidia/params (hex value, four keys)
    ('RegistryDwords: "RMForceStaticBar1=1;RMPcieP2PType=1;RmForceEnableGen2=1;RMPcieLinkSpeed=0x1"',
     {"RMForceStaticBar1": 1, "RMPcieP2PType": 1, "RmForceEnableGen2": 1, "RMPcieLinkSpeed": 1}),
    # ventureoo/nvidia-tweaks issue 9: one key
    ('RegistryDwords: "RMIntrLockingMode=1"', {"RMIntrLockingMode": 1}),
    # a trailing ';', spaces, a token without a value and one with two '=' are skipped as the driver does
    ('RegistryDwords: "RMForceStaticBar1 = 2; Bad; A=1=2; Oct=010; W=on;"', {"RMForceStaticBar1": 2, "Oct": 8, "W": 0}),
])
def test_registry_dwords_lines(line, keys):
    params = {**recorded_params(), **parse_colon_params([line])}
    registry = parse_registry_dwords(params)
    assert registry is not None and registry["global"] == keys


def test_per_device_keys_follow_their_pci_entry_and_an_unknown_form_skips_until_the_next():
    params = {**recorded_params(), **parse_colon_params([
        'RegistryDwordsPerDevice: "pci=0000:c1:00.0;RMForceStaticBar1=1;pci=zz;PeerMappingOverride=1;'
        'pci=41:00;PeerMappingOverride=0x1"'])}
    registry = parse_registry_dwords(params)
    assert registry is not None and registry["per_device"] == {
        "0000:c1:00.0": {"RMForceStaticBar1": 1}, "0000:41:00.0": {"PeerMappingOverride": 1}}


def test_no_params_read_is_none():
    assert parse_registry_dwords({}) is None and parse_registry_dwords(None) is None
