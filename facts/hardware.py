"""Batched probes: a host's whole hardware picture (and its boot/guest configuration) in one
remote command each. Each probe runs the individual facts' own commands between section
markers and hands every section to that fact's own parser, so both paths give identical data.
"""

from __future__ import annotations

from pyinfra.api import FactBase

from facts.cpu import CpuInfo
from facts.devices import CharDeviceMajors, NvidiaDeviceNodes
from facts.gpu import GpuP2P, GpuTopology
from facts.kernel import (
    BootLoader,
    IommuState,
    KernelCmdline,
    KernelToolchain,
    ModuleParameters,
    ProxmoxKernels,
    SevSnp,
    split_sections,
)
from facts.nvidia import NvidiaDriver, NvidiaDriverParams, NvidiaGpus
from facts.pci import PciAcs, PciDevices
from facts.proxmox import LxcConfigs, PciMappings, PveVersion, QemuConfigs

SECTION_MARKER = "@@pvegpu-section "


def _fact_command(fact: FactBase, args: tuple) -> str:
    command = fact.command(*args) if callable(fact.command) else fact.command
    return str(command)


class SectionedProbe(FactBase):
    """Base of the batched probes: ``sections`` maps a key to ``(fact class, args)``."""

    abstract = True
    sections: dict[str, tuple[type[FactBase], tuple]] = {}

    @property
    def command(self) -> str:
        parts = []
        for key, (fact_class, args) in self.sections.items():
            fact = fact_class()
            inner = _fact_command(fact, args)
            required = fact.requires_command(*args)
            run = f"( {inner} ) 2>/dev/null"
            if required:
                run = f"if command -v {required} >/dev/null 2>&1; then {run}; fi"
            parts.append(f"echo '{SECTION_MARKER}{key}'; {run}")
        return "; ".join(parts) + "; true"

    @classmethod
    def default(cls) -> dict:
        return {key: fact_class().default() for key, (fact_class, _) in cls.sections.items()}

    def process(self, output):
        lines_by_key = split_sections(output, SECTION_MARKER)
        result = {}
        for key, (fact_class, _) in self.sections.items():
            fact = fact_class()
            lines = lines_by_key.get(key, [])
            # Same rule as pyinfra's own fact loading: no output → the fact's default.
            result[key] = fact.process(lines) if lines else fact.default()
        return result


class HardwareProbe(SectionedProbe):
    """
    The hardware picture of a host in one remote command: sysfs PCI devices and ACS, IOMMU
    groups, cmdline, char majors, /dev/nvidia* nodes, kernel toolchain, /proc/driver/nvidia,
    nvidia_uvm parameters, SEV-SNP, CPU, and `nvidia-smi topo -m` / `-p2p r|w` when present.

    .. code:: python

        {"pci_devices": <PciDevices>, "pci_acs": <PciAcs>, "iommu": <IommuState>,
         "cmdline": <KernelCmdline>, "char_majors": <CharDeviceMajors>,
         "device_nodes": <NvidiaDeviceNodes>, "toolchain": <KernelToolchain>,
         "nvidia_driver": <NvidiaDriver>, "nvidia_gpus": <NvidiaGpus>,
         "nvidia_params": <NvidiaDriverParams>, "uvm_params": <ModuleParameters nvidia_uvm>,
         "sev_snp": <SevSnp>, "cpu": <CpuInfo>, "topology": <GpuTopology>,
         "p2p_read": <GpuP2P r>, "p2p_write": <GpuP2P w>}

    Each value is exactly what the named fact returns on its own.
    """

    abstract = False
    sections = {
        "pci_devices": (PciDevices, ()),
        "pci_acs": (PciAcs, ()),
        "iommu": (IommuState, ()),
        "cmdline": (KernelCmdline, ()),
        "char_majors": (CharDeviceMajors, ()),
        "device_nodes": (NvidiaDeviceNodes, ()),
        "toolchain": (KernelToolchain, ()),
        "nvidia_driver": (NvidiaDriver, ()),
        "nvidia_gpus": (NvidiaGpus, ()),
        "nvidia_params": (NvidiaDriverParams, ()),
        "uvm_params": (ModuleParameters, ("nvidia_uvm",)),
        "sev_snp": (SevSnp, ()),
        "cpu": (CpuInfo, ()),
        "topology": (GpuTopology, ()),
        "p2p_read": (GpuP2P, ("r",)),
        "p2p_write": (GpuP2P, ("w",)),
    }


class HostConfigProbe(SectionedProbe):
    """
    A host's boot and Proxmox configuration in one remote command.

    .. code:: python

        {"boot_loader": <BootLoader>, "kernels": <ProxmoxKernels>, "pve_version": <PveVersion>,
         "lxc_configs": <LxcConfigs>, "qemu_configs": <QemuConfigs>,
         "pci_mappings": <PciMappings>}
    """

    abstract = False
    sections = {
        "boot_loader": (BootLoader, ()),
        "kernels": (ProxmoxKernels, ()),
        "pve_version": (PveVersion, ()),
        "lxc_configs": (LxcConfigs, ()),
        "qemu_configs": (QemuConfigs, ()),
        "pci_mappings": (PciMappings, ()),
    }
