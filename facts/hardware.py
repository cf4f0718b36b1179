"""Batched probes: a host's whole hardware picture (and its boot/guest configuration) in one
remote command each. Each probe runs the individual facts' own commands between section
markers and hands every section to that fact's own parser, so both paths give identical data.
"""

from __future__ import annotations

import copy
from functools import partial

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
)
from facts.nvidia import NvidiaDriver, NvidiaDriverParams, NvidiaGpus
from facts.pci import PciAcs, PciDevices
from facts.proxmox import LxcConfigs, PciMappings, PveVersion, QemuConfigs
from facts.sections import PROBE_SECTION, parse_sections
from facts.shared import prelude

SECTION_MARKER = PROBE_SECTION  # facts.sections: a probe's sections are whole facts' outputs


def fact_command(fact: FactBase, args: tuple = (), kwargs: dict | None = None) -> str:
    """A fact's own command for these arguments, as the string pyinfra would run."""
    kwargs = kwargs or {}
    command = fact.command(*args, **kwargs) if callable(fact.command) else fact.command
    return str(command)


def _section_run(fact_class: type[FactBase], args: tuple = (), kwargs: dict | None = None) -> str:
    """A fact's own command as one section: stderr dropped, skipped where its program is missing."""
    fact = fact_class()
    run = f"( {fact_command(fact, args, kwargs)} ) 2>/dev/null"
    required = fact.requires_command(*args, **(kwargs or {}))
    if required:
        run = f"if command -v {required} >/dev/null 2>&1; then {run}; fi"
    return run


def _one_write(script: str) -> str:
    """`script` with its whole output handed to sshd in one write: the sections print in
    hundreds of small writes, and sshd sends each as its own SSH packet, which pyinfra's
    paramiko decrypts, checks and wakes a reader for one by one (in pure Python: per packet the
    largest part of what a probe costs the runner). `dd iflag=fullblock` (coreutils) collects
    up to 4 MiB before writing."""
    return f"{{ {script}; }} | dd bs=4M iflag=fullblock status=none"


def _probe_command(sections) -> str:
    """One command for ``[(name, fact class, args, kwargs)]``: each fact's own command after its
    section marker, all output in one write; a reading several sections take (`uname -r`, dpkg's
    package list: facts.shared) is taken once before them."""
    script = "; ".join(f"echo '{SECTION_MARKER}{name}'; {_section_run(fc, args, kwargs)}"
                       for name, fc, args, kwargs in sections) + "; true"
    return _one_write(prelude(script) + script)


def fact_value(fact_class: type[FactBase], lines: list[str]):
    """What `fact_class` makes of these output lines."""
    fact = fact_class()
    # Same rule as pyinfra's own fact loading: no output → the fact's default.
    return fact.process(lines) if lines else fact.default()


class SectionedProbe(FactBase):
    """Base of the batched probes: ``sections`` maps a key to ``(fact class, args)``."""

    abstract = True
    sections: dict[str, tuple[type[FactBase], tuple]] = {}

    @property  # a str-valued property: pyinfra 3.10 facts.py _make_command uses a non-callable as is
    def command(self) -> str:  # type: ignore[override]
        return _probe_command((key, fact_class, args, None) for key, (fact_class, args) in self.sections.items())

    @classmethod
    def default(cls) -> dict:
        return {key: fact_class().default() for key, (fact_class, _) in cls.sections.items()}

    def process(self, output):
        return parse_sections(output, {key: partial(fact_value, fact_class)
                                       for key, (fact_class, _) in self.sections.items()}, SECTION_MARKER)


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


def combined_probe(requests: list[tuple[type[FactBase], dict]]) -> type[FactBase]:
    """A fact class that reads every fact of `requests` (``[(fact class, kwargs)]``) in one
    remote command; its value is the list of their values, in order, each exactly what
    ``host.get_fact(fact_class, **kwargs)`` returns.

    A `SectionedProbe` (no kwargs) is flattened into its sections, and a section several
    requests share (same fact, same arguments: e.g. `CpuInfo` in `HardwareProbe` and in the
    boot stage's probe) is run once; each request gets its own copy of a shared value.
    """
    sections: dict[str, tuple[type[FactBase], tuple, dict]] = {}
    ids: dict[tuple, str] = {}

    def section(fact_class, args=(), kwargs=None) -> str:
        identity = (fact_class.__module__, fact_class.__qualname__, repr(args), repr(sorted((kwargs or {}).items())))
        if identity not in ids:
            ids[identity] = f"c{len(ids)}"
            sections[ids[identity]] = (fact_class, args, kwargs or {})
        return ids[identity]

    layout: list = []  # per request: {key: section} for a probe, else one section name
    for fact_class, kwargs in requests:
        if issubclass(fact_class, SectionedProbe) and not kwargs:
            layout.append({key: section(fc, args) for key, (fc, args) in fact_class.sections.items()})
        else:
            layout.append(section(fact_class, (), kwargs))
    class CombinedProbe(FactBase):
        __doc__ = "Facts " + ", ".join(fc.__name__ for fc, _ in requests) + " in one remote command."

        @property  # str-valued, as in SectionedProbe
        def command(self) -> str:  # type: ignore[override]
            return _probe_command((name, fc, args, kwargs) for name, (fc, args, kwargs) in sections.items())

        @staticmethod
        def default() -> list:
            return CombinedProbe().process([])

        def process(self, output):
            values = parse_sections(output, {name: partial(fact_value, fc) for name, (fc, _, _) in sections.items()},
                                    SECTION_MARKER)
            seen: set[str] = set()

            def value(name):  # a shared section's second and later users get copies
                if name in seen:
                    return copy.deepcopy(values[name])
                seen.add(name)
                return values[name]

            return [{key: value(name) for key, name in entry.items()} if isinstance(entry, dict) else value(entry)
                    for entry in layout]

    return CombinedProbe
