"""What the host kernel & IOMMU stage (operations/boot.py) reads: GRUB's default files, the
vfio/nouveau modules loaded, and all of it with the boot loader, cmdline, CPU and the stage's
own files in one batched command (`BootStageFacts`)."""

from __future__ import annotations

from facts.base import ShellFact
from facts.cpu import CpuInfo
from facts.files import ManagedFiles
from facts.hardware import SectionedProbe
from facts.kernel import BootLoader, KernelCmdline, SevSnp
from facts.proxmox import PveVersion
from facts.sections import SECTION, split_sections
from facts.shared import EACH_FILE, read_file

# The files the boot stage writes (their state is part of `BootStageFacts`).
KERNEL_CMDLINE = "/etc/kernel/cmdline"
GRUB_DROPIN = "/etc/default/grub.d/pvegpu.cfg"
VFIO_CONF = "/etc/modules-load.d/pvegpu-vfio.conf"
NOUVEAU_CONF = "/etc/modprobe.d/pvegpu-blacklist-nouveau.conf"
STAGE_PATHS = [KERNEL_CMDLINE, GRUB_DROPIN, VFIO_CONF, NOUVEAU_CONF]
WATCHED_MODULES = ("vfio", "vfio_iommu_type1", "vfio_pci", "vfio_virqfd", "nouveau")


class GrubFiles(ShellFact):
    """/etc/default/grub and /etc/default/grub.d/*.cfg as grub-mkconfig sources them, in order.

    .. code:: python

        [["/etc/default/grub", ["GRUB_DEFAULT=0", 'GRUB_CMDLINE_LINUX_DEFAULT="quiet"', …]],
         ["/etc/default/grub.d/pvegpu.cfg", [...]]]
    """

    command = ("for f in /etc/default/grub /etc/default/grub.d/*.cfg; do "
               f'[ -r "$f" ] && {{ echo "{SECTION}$f"; {read_file(EACH_FILE)}; }}; done; true')

    @staticmethod
    def default() -> list:
        return []

    def process(self, output):
        return [[path, lines] for path, lines in split_sections(output).items()]


class LoadedModules(ShellFact):
    """Which of the modules the boot stage cares about are loaded (or built in): /sys/module/<name>.

    .. code:: python

        ["vfio", "vfio_iommu_type1", "vfio_pci"]
    """

    command = "for m in " + " ".join(WATCHED_MODULES) + '; do [ -d "/sys/module/$m" ] && echo "$m"; done; true'

    @staticmethod
    def default() -> list:
        return []

    def process(self, output):
        return [line.strip() for line in output if line.strip()]


class BootStageFacts(SectionedProbe):
    """Everything the boot stage reads, in one remote command.

    .. code:: python

        {"boot_loader": <BootLoader>, "cmdline": <KernelCmdline>, "sev_snp": <SevSnp>,
         "cpu": <CpuInfo>, "pve_version": <PveVersion>, "grub_files": <GrubFiles>,
         "modules": <LoadedModules>, "files": <ManagedFiles of STAGE_PATHS>}
    """

    abstract = False
    sections = {
        "boot_loader": (BootLoader, ()),
        "cmdline": (KernelCmdline, ()),
        "sev_snp": (SevSnp, ()),
        "cpu": (CpuInfo, ()),
        "pve_version": (PveVersion, ()),
        "grub_files": (GrubFiles, ()),
        "modules": (LoadedModules, ()),
        "files": (ManagedFiles, (STAGE_PATHS,)),
    }
