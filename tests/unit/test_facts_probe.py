"""The batched probes give exactly what the individual facts give: on real fixture output
(the H200 VM's recordings, section by section) and on this machine, run for real."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from facts.hardware import SECTION_MARKER, HardwareProbe, HostConfigProbe

CASES = Path(__file__).parent / "facts"

# One host's picture: the real H200 VM recordings, one fact case per probe section.
H200_CASES = {
    "pci_devices": "pci.PciDevices/h200-vm-sysfs",
    "pci_acs": "pci.PciAcs/h200-vm-no-lspci",
    "iommu": "kernel.IommuState/h200-vm-no-groups",
    "cmdline": "kernel.KernelCmdline/h200-vm",
    "char_majors": "devices.CharDeviceMajors/h200-vm-uvm-238-block-devices-after",
    "device_nodes": "devices.NvidiaDeviceNodes/h200-vm-uvm-238-caps-dir",
    "toolchain": "kernel.KernelToolchain/h200-vm-gcc-15",
    "nvidia_driver": "nvidia.NvidiaDriver/h200-vm-open-580",
    "nvidia_gpus": "nvidia.NvidiaGpus/h200-vm-1gpu",
    "nvidia_params": "nvidia.NvidiaDriverParams/h200-vm",
    "uvm_params": "kernel.ModuleParameters/h200-vm-nvidia-uvm",
    "sev_snp": "kernel.SevSnp/h200-vm-intel-no-sev",
    "cpu": "cpu.CpuInfo/h200-vm-intel-xeon",
    "topology": "gpu.GpuTopology/h200-vm-1gpu-ansi",
    "p2p_read": "gpu.GpuP2P/h200-vm-p2p-r",
    "p2p_write": "gpu.GpuP2P/h200-vm-p2p-w",
}


def _case(name: str) -> dict:
    return yaml.safe_load((CASES / f"{name}.yaml").read_text())


def _jsonable(data):
    return json.loads(json.dumps(data))


def _sh(command: str) -> list[str]:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout.splitlines()


def test_hardware_probe_covers_every_section_with_a_real_case():
    assert set(H200_CASES) == set(HardwareProbe.sections)


def test_hardware_probe_splits_real_output_into_each_facts_result():
    output = []
    for key, name in H200_CASES.items():
        output += [SECTION_MARKER + key] + _case(name)["output"]
    data = _jsonable(HardwareProbe().process(output))
    assert data == {key: _case(name)["fact"] for key, name in H200_CASES.items()}
    assert data["nvidia_gpus"]["0000:00:06.0"]["model"] == "NVIDIA H200"
    assert data["pci_devices"]["0000:00:06.0"]["driver"] == "nvidia"


def test_host_config_probe_splits_real_output():
    boot = _case("kernel.BootLoader/proxmox-etc-kernel-cmdline-zfs-with-iommu")
    lxc = _case("proxmox.LxcConfigs/pve9-102-jellyfin-privileged-lxc-mount-entry-nvidia-caps-dir")
    output = [SECTION_MARKER + "boot_loader", *boot["output"], SECTION_MARKER + "lxc_configs", *lxc["output"]]
    data = _jsonable(HostConfigProbe().process(output))
    assert data["boot_loader"] == boot["fact"]
    assert data["lxc_configs"] == lxc["fact"]
    # Sections without output fall back to the fact's default, as pyinfra does for a fact.
    assert data["pve_version"] is None and data["qemu_configs"] == {} and data["pci_mappings"] == {}


@pytest.mark.parametrize("probe", [HardwareProbe, HostConfigProbe])
def test_probe_is_one_command_running_each_facts_own_command(probe):
    command = probe().command
    for key, (fact_class, args) in probe.sections.items():
        fact = fact_class()
        inner = fact.command(*args) if callable(fact.command) else fact.command
        assert f"echo '{SECTION_MARKER}{key}'; " in command
        assert inner in command


@pytest.mark.parametrize("probe", [HardwareProbe, HostConfigProbe])
def test_probe_equals_individual_facts_on_this_machine(probe):
    """Run for real here: the probe's one command and each fact's own command agree."""
    batched = _jsonable(probe().process(_sh(probe().command)))
    for key, (fact_class, args) in probe.sections.items():
        fact = fact_class()
        command = fact.command(*args) if callable(fact.command) else fact.command
        required = fact.requires_command(*args)
        if required and subprocess.run(["sh", "-c", f"command -v {required}"], capture_output=True).returncode:
            expected = fact.default()  # pyinfra's answer when the required tool is missing
        else:
            lines = _sh(command)
            expected = fact.process(lines) if lines else fact.default()
        assert batched[key] == _jsonable(expected), key
