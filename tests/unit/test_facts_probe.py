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


PROBE_RUN = Path(__file__).parents[1] / "fixtures" / "h200-vm-probe"


def _recorded_sections() -> dict[tuple[str, str], list[str]]:
    """facts.txt of the device run: each fact's own command output, by (probe, section)."""
    sections: dict[tuple[str, str], list[str]] = {}
    current = None
    for line in (PROBE_RUN / "facts.txt").read_text().splitlines()[2:]:
        if line.startswith("#### "):
            probe, key = line[5:].split()
            current = sections.setdefault((probe, key), [])
        elif current is not None:
            current.append(line)
    return sections


@pytest.mark.parametrize("probe,recording", [(HardwareProbe, "hardware-probe.txt"),
                                             (HostConfigProbe, "host-config-probe.txt")])
def test_probe_on_the_gpu_machine_equals_each_fact_run_there(probe, recording):
    """Recorded on the H200 VM in one device run: the probe's one command, and each fact's own."""
    batched = _jsonable(probe().process((PROBE_RUN / recording).read_text().splitlines()[2:]))
    singles = _recorded_sections()
    for key, (fact_class, _) in probe.sections.items():
        lines = singles[(probe.__name__, key)]
        fact = fact_class()
        # '##PYINFRA_NOCMD##' is pyinfra's marker for a missing required tool: the default.
        expected = fact.default() if lines in ([], ["##PYINFRA_NOCMD##"]) else fact.process(lines)
        assert batched[key] == _jsonable(expected), key


def test_probe_on_the_gpu_machine_agrees_with_the_separate_recordings():
    """The probe run and the lead's separate recording of the same VM kind say the same things."""
    data = _jsonable(HardwareProbe().process((PROBE_RUN / "hardware-probe.txt").read_text().splitlines()[2:]))
    assert data["nvidia_driver"] == _case("nvidia.NvidiaDriver/h200-vm-open-580")["fact"]
    assert data["char_majors"] == _case("devices.CharDeviceMajors/h200-vm-uvm-238-block-devices-after")["fact"]
    assert data["device_nodes"] == _case("devices.NvidiaDeviceNodes/h200-vm-uvm-238-caps-dir")["fact"]
    assert data["topology"] == _case("gpu.GpuTopology/h200-vm-1gpu-ansi")["fact"]
    assert data["iommu"] == _case("kernel.IommuState/h200-vm-no-groups")["fact"]
    gpus = data["nvidia_gpus"]
    assert list(gpus) == ["0000:00:06.0"] and gpus["0000:00:06.0"]["model"] == "NVIDIA H200"
    assert gpus["0000:00:06.0"]["minor"] == 0 and gpus["0000:00:06.0"]["uuid"].startswith("GPU-")
    gpu = data["pci_devices"]["0000:00:06.0"]
    assert (gpu["vendor"], gpu["class"], gpu["driver"]) == ("10de", "030200", "nvidia")
    assert gpu["bars"]["2"] == 256 * 2**30  # the H200's 256 GiB BAR
