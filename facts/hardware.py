"""Batched probes: a host's whole hardware picture (and its boot/guest configuration) in one
remote command each. Each probe runs the individual facts' own commands between section
markers and hands every section to that fact's own parser, so both paths give identical data.
"""

from __future__ import annotations

import copy
from functools import partial
from itertools import pairwise

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
# Every program a probe runs answers in the C locale: messages untranslated (apt-cache policy's
# "Candidate:", gettext's LANGUAGE is ignored under LC_ALL=C), C collation and number formats, whatever
# /etc/default/locale or the ssh session sets (pam_env); set once, for the whole command (issue 43)
LOCALE_FREE = "LC_ALL=C; export LC_ALL; "


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


# Holds up to 4 MiB of what it reads before writing any of it (`iflag=fullblock`, coreutils).
_BUFFER = "dd bs=4M iflag=fullblock status=none"


def _one_write(script: str) -> str:
    """`script` with its whole output handed to sshd in one write: the sections print in
    hundreds of small writes, and sshd sends each as its own SSH packet, which pyinfra's
    paramiko decrypts, checks and wakes a reader for one by one (in pure Python: per packet the
    largest part of what a probe costs the runner). `dd iflag=fullblock` (coreutils) collects
    up to 4 MiB before writing."""
    return f"{{ {script}; }} | {_BUFFER}"


# The sections run in up to PROBE_GROUPS groups at once (`_grouped`): the kpro6 converge's first
# probe (40 sections) took 172 ms one after another inside the twin, 125 ms in 4 groups (2 and 3
# groups the same: the twin's 2 cores are busy either way). Each group more costs a few forks, a dd
# and two cats; a real node (16-128 cores) runs four groups side by side.
PROBE_GROUPS = 4
# What a section costs in the split, relative to a plain one (a few builtins, a cat or a grep:
# ~1-3 ms): each call of a program measured far slower, so that such calls land in different
# groups where the order of the sections allows. nvidia-smi: `topo -m` 53 ms, `topo -p2p r` 25 ms,
# `--query-gpu` 30 ms on an H200 host. dpkg-query needs none: a probe runs it at most once
# (facts.shared: the prelude takes a reading two sections take, before every group).
SLOW_PROGRAMS = {"nvidia-smi": 10}


def section_weight(command: str) -> int:
    """A section's share in the split of a probe into groups: 1, plus `SLOW_PROGRAMS`' weight for
    each call of such a program in the fact's own command."""
    return 1 + sum(weight * command.count(f"{program} ") for program, weight in SLOW_PROGRAMS.items())


def split_groups(weights: list[int], groups: int) -> list[int]:
    """Where `groups` contiguous groups of sections with these weights start (first: 0): the
    split whose heaviest group is the lightest possible (the order of the sections is kept),
    among those the one whose groups start earliest. ``min(groups, len(weights))`` groups,
    none empty."""
    n, k = len(weights), max(1, min(groups, len(weights)))
    sums = [0]
    for w in weights:
        sums.append(sums[-1] + w)
    # best[j][i]: (heaviest group, starts) for the first i sections in j groups
    best: list[list[tuple[int, list[int]] | None]] = [[None] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0, [])
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            options = [(max(prev[0], sums[i] - sums[s]), prev[1] + [s])
                       for s in range(j - 1, i) if (prev := best[j - 1][s]) is not None]
            best[j][i] = min(options)
    answer = best[k][n]
    assert answer is not None  # k <= n
    return answer[1]


def _grouped(runs: list[str], weights: list[int], groups: int) -> str:
    """The sections `runs` (shell, in order) as contiguous groups that run at once, their output
    in the order of the sections, with no file written.

    Every group is a stage of one pipeline (the stages of a pipeline all start together). Group 0
    prints straight into it. Group i > 0 prints into a `dd` that holds its whole output (up to
    4 MiB; a larger output waits in the pipe, still in order) while `{ cat <&3; cat; }` first
    passes on everything the stages before it print (their pipe, duplicated to fd 3), then the
    held output: the sections come out in their order, byte for byte. Not held in a shell variable
    (``o=$(group)``): dash's command substitution loses NUL bytes and trailing newlines (src/expand.c:
    expbackq copies through memtodest, which skips NULs, then eats the final newlines). Each
    group's stdin is /dev/null (a section that read stdin would take the earlier groups' output)
    and fd 3 closed; stderr is dropped as each section's. The variables the prelude set before
    the pipeline are in every stage's copy of the shell."""
    starts = split_groups(weights, groups) + [len(runs)]
    stages = []
    for g, (start, end) in enumerate(pairwise(starts)):
        group = "{ " + "; ".join(runs[start:end]) + "; } </dev/null 2>/dev/null"
        stages.append(group if g == 0 else f"{{ {group} 3<&- | {_BUFFER} | {{ cat <&3; cat; }}; }} 3<&0")
    return " | ".join(stages)


def _probe_command(sections, groups: int | None = None) -> str:
    """One command for ``[(name, fact class, args, kwargs)]``: each fact's own command after its
    section marker, the sections in up to `groups` (default `PROBE_GROUPS`) contiguous groups
    that run at once (`_grouped`; 1: one after another), all output in one write, in the
    sections' order; a reading several sections take (`uname -r`, dpkg's package list:
    facts.shared) is taken once before them."""
    groups = PROBE_GROUPS if groups is None else groups
    sections = list(sections)  # the command starts with LOCALE_FREE (below)
    runs = [f"echo '{SECTION_MARKER}{name}'; {_section_run(fc, args, kwargs)}" for name, fc, args, kwargs in sections]
    script = "; ".join(runs)
    shared = LOCALE_FREE + prelude(script)
    if groups <= 1 or len(runs) <= 1:
        return _one_write(shared + script + "; true")
    weights = [section_weight(fact_command(fc(), args, kwargs)) for _, fc, args, kwargs in sections]
    return _one_write(shared + _grouped(runs, weights, groups) + "; true")


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
            # nested: a section's fact may mark parts of its own with SECTION_MARKER (KernelStageFacts);
            # only this probe's section names (c0, c1, …) cut
            values = parse_sections(output, {name: partial(fact_value, fc) for name, (fc, _, _) in sections.items()},
                                    SECTION_MARKER, nested=True)
            seen: set[str] = set()

            def value(name):  # a shared section's second and later users get copies
                if name in seen:
                    return copy.deepcopy(values[name])
                seen.add(name)
                return values[name]

            return [{key: value(name) for key, name in entry.items()} if isinstance(entry, dict) else value(entry)
                    for entry in layout]

    return CombinedProbe
