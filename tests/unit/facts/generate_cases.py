"""Writes the fact test cases (pyinfra-testing YAML: command, output, fact) from the real
fixture files in tests/fixtures/.

Every case names its fixture file and the line ranges (1-based, inclusive, counted in the
fixture file) its ``output`` carries; tests/unit/test_facts_traceability.py checks ``output``
against those lines. Shell prompts and echoed commands are left out (a fact sees only a
command's output); section markers (``@@ …``) are added where the fact's own command prints
them. ``fact`` is what the parser returned when the case was written and was then checked by
hand against the fixture: re-running this script keeps existing ``fact`` values unless
``--update`` is given, so a parser change shows up as a failing test, not a silent rewrite.

    .venv/bin/python tests/unit/facts/generate_cases.py [--update]

Facts no published output exists for (the stages' own facts) are recorded on a twin
(tests/twin): `TWIN_RECORDINGS` lists them; with a twin running (`tests/twin/twinctl start NAME
--profile kpro6`, prepared as INDEX.tsv says),

    .venv/bin/python tests/unit/facts/generate_cases.py --record-twin NAME [stages|guests|packages|upgrade]

(`guests`: the second recording, `TWIN_RECORDINGS_GUESTS`, prepared as its comment says)
runs each fact's own command there (`twinctl ssh NAME -- sh -c '<command>'`, as pyinfra
runs it), writes tests/fixtures/twin-kpro6/<name>.txt and prints its INDEX.tsv row.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml
from pyinfra.api import StringCommand
from pyinfra_testing.facts import _to_jsonable

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "tests" / "fixtures"
CASES_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

# Lines that are a shell prompt, an echoed command or an author's annotation, not output.
PROMPT = re.compile(
    r"^(\$ |\(base\) |/# |# cat |# output$|\[sudo\] password|root@\S+[#$]|\S+@\S+:\S*[#$] |"
    r"\S+@\S+ > |nvidia-smi topo|cat /proc/cmdline; for d|\s+n=\$\{d#)"
)


def body_ranges(fixture: str, first: int = 3, last: int | None = None) -> list[list[int]]:
    """Contiguous ranges of output lines of a fixture (header and prompt lines left out)."""
    lines = (FIXTURES / fixture).read_text().splitlines()
    last = last or len(lines)
    ranges: list[list[int]] = []
    for number in range(first, last + 1):
        if PROMPT.match(lines[number - 1]):
            continue
        if ranges and ranges[-1][1] == number - 1:
            ranges[-1][1] = number
        else:
            ranges.append([number, number])
    return ranges


def fixture_lines(fixture: str, ranges: list[list[int]]) -> list[str]:
    lines = (FIXTURES / fixture).read_text().splitlines()
    return [line for start, end in ranges for line in lines[start - 1:end]]


def case(fact: str, name: str, fixture: str, ranges=None, args=None, sections=None, note=None) -> dict:
    """One case. ``sections``: [(marker line, fixture, ranges)] for commands printing markers."""
    return {"fact": fact, "name": name, "fixture": fixture, "ranges": ranges, "args": args,
            "sections": sections, "note": note}


TWIN_DIR = "twin-kpro6"
TWIN_MACHINE = ("pvegpu twin 'kpro6' (tests/twin, profile tests/twin/profiles/kpro6.yml: 8 x RTX PRO 6000 Blackwell host "
                "modelled on DESIGN.md, not recorded hardware) on the debootstrapped bookworm twin root; pct, qm and "
                "proxmox-boot-tool are the twin's Python stand-ins")
# Twin state before the recording (run over twinctl ssh, in this order): /etc/modules-load.d/pvegpu-vfio.conf
# with vfio, vfio_iommu_type1, vfio_pci, then `reboot` (the twin loads modules-load.d at boot); two build
# records written by operations.progress.record_command; `pct start 200`; `qm set 300 --hostpci0
# mapping=pvegpu-kpro6-0000-01-00-0,pcie=1`; /etc/nccl.conf with one NCCL_IB_DISABLE=1 line.
TWIN_PREPARED = ("after: vfio modules in /etc/modules-load.d and a twin reboot, two build records "
                 "(operations.progress.record_command), pct start 200, qm set 300 --hostpci0 mapping=…, a one-line /etc/nccl.conf")
NCCL_PATHS = ["/etc/nccl.conf", "/etc/systemd/system/vllm.service.d/pvegpu-nccl.conf"]
KERNEL_BUILD = ["/var/lib/pvegpu/kernel-build/6.14.11-9-bpo12-pve-3f0c2a9e", "6.14.11-9-bpo12-pve",
                "git://git.proxmox.com/git/pve-kernel.git", "bookworm-6.14"]
# (fixture name, fact, args)
TWIN_RECORDINGS = [
    ("boot-stage-facts", "boot.BootStageFacts", None),
    ("grub-files", "boot.GrubFiles", None),
    ("loaded-modules-vfio", "boot.LoadedModules", None),
    ("nvidia-host-state-6.14.8-2-pve", "nvidia.NvidiaHostState",
     [["6.14.8-2-pve"], {"modules": ["/opt/src/open-gpu-kernel-modules-595.71.05.tar.xz", "0" * 64]}]),
    ("durations-two-records", "progress.Durations", None),
    ("container-userspace-ct200", "containers.ContainerUserspace", [[200]]),
    ("container-gpu-state", "guests.ContainerGpuState", None),
    ("vm-mapping-references", "guests.VmMappingReferences", None),
    ("nccl-state-ct200", "nccl.NcclState", [NCCL_PATHS, [200]]),
    ("kernel-stage-facts-no-build", "kernel.KernelStageFacts", KERNEL_BUILD),
    # recorded on a live-sysfs twin by hand (session 6; INDEX.tsv says how the twin was prepared)
    ("guest-runtime-live", "rebind.GuestRuntime", None),
    ("gpu-holders-nvidia0", "rebind.GpuHolders", [["/dev/nvidia0", "/dev/nvidia1"]]),
    ("rebind-journal-done", "rebind.RebindJournal", None),
]
# A second recording (session 7, `--record-twin NAME guests`) on a fresh kpro6 twin for the facts
# the first one left without cases, prepared over twinctl ssh, in this order: `pct start 200`;
# `pvesh create /cluster/mapping/pci --id pvegpu-kpro6-0000-01-00-0 --map id=10de:2bb5,iommugroup=12,
# node=kpro6,path=0000:01:00,subsystem-id=10de:204e`; `qm set 300 --hostpci0
# mapping=pvegpu-kpro6-0000-01-00-0,pcie=1`; /etc/pve/ha/resources.cfg written with `ct: 200` /
# `state started` (as tests/e2e/test_guest_control_e2e.py does), then `ha-manager set ct:200 --state
# stopped` (the stand-in rewrites the file, and its CRM stops CT 200); /etc/modules-load.d/pvegpu-vfio.conf
# with vfio, vfio_iommu_type1, vfio_pci. The twin root's pci.ids (Debian bookworm's, 2023.04.10) knows the
# NIC and NVMe IDs, not the Blackwell GPU's nor its audio's.
TWIN_PREPARED_GUESTS = ("after: pct start 200, pvesh create /cluster/mapping/pci (GPU 0000:01:00), qm set 300 "
                        "--hostpci0 mapping=…,pcie=1, ct: 200 in /etc/pve/ha/resources.cfg set to stopped by "
                        "ha-manager set, the vfio modules-load.d file")
MANAGED_PATHS = ["/etc/kernel/cmdline", "/etc/default/grub.d/pvegpu.cfg", "/etc/modules-load.d/pvegpu-vfio.conf",
                 "/etc/modprobe.d/pvegpu-blacklist-nouveau.conf", "/etc/modules-load.d/modules.conf",
                 "/etc/systemd/system/multi-user.target.wants/ssh.service"]
TWIN_RECORDINGS_GUESTS = [
    ("guest-state-ct200-stopped-by-ha", "guest_state.GuestState", None),
    ("node-name", "proxmox.NodeName", None),
    ("qemu-configs-vm300-mapping", "proxmox.QemuConfigs", None),
    ("pci-mappings-one-gpu", "proxmox.PciMappings", None),
    ("ha-resources-ct200-stopped", "proxmox.HaResources", None),
    ("managed-files-boot-stage", "files.ManagedFiles", [MANAGED_PATHS]),
    ("file-texts-vm300-and-missing", "files.FileTexts", [["/etc/pve/qemu-server/300.conf", "/etc/nccl.conf"]]),
    ("pci-id-names-kpro6", "pci.PciIdNames", [["10de:2bb5", "10de:22e8", "1022:14ab", "8086:1572", "144d:a80a"]]),
]
# A third recording (session 8, `--record-twin NAME packages`): the Proxmox VE versions read from
# dpkg (no pveversion), on a kpro6 twin whose root carries the profile's Proxmox VE packages in its
# real dpkg database (tests/twin/hardware.py _seed_pve_packages); dpkg-query is Debian's own.
TWIN_PREPARED_PACKAGES = "a kpro6 twin as started (its profile's Proxmox VE packages in dpkg's database)"
TWIN_RECORDINGS_PACKAGES = [
    ("pve-version-dpkg", "proxmox.PveVersion", None),
    ("pve-packages-dpkg", "proxmox.PvePackages", None),
]
# A fourth recording (issue 40, `--record-twin NAME upgrade`): the upgrade check's facts on a kpro6
# twin prepared over twinctl ssh, in this order: /usr/src/nvidia-550.163.01/dkms.conf (a minimal
# dkms.conf, no module source) and `dkms add -m nvidia -v 550.163.01` (the twin root's real dkms); an
# empty /usr/share/doc/systemd-boot/changelog.Debian.gz (the file pve8to9 check_bootloader tests; the
# package is not installed); `proxmox-boot-tool kernel pin 6.8.12-11-pve`; /boot/grub made and
# `grub-set-default 'gnulinux-advanced-7f3c9a>gnulinux-6.14.0-2-pvegpu-pve-advanced-7f3c9a'` (Debian's
# grub2-common; the id form pvegpu's kernel stage sets); an empty /boot/efi/EFI/BOOT/BOOTX64.efi;
# `echo 'grub-efi-amd64 grub2/force_efi_extra_removable boolean true' | debconf-set-selections`;
# `apt-mark hold proxmox-kernel-helper` (the twin's dpkg database has no proxmox-default-kernel).
TWIN_PREPARED_UPGRADE = ("after: dkms add of a minimal nvidia/550.163.01 dkms.conf, an empty systemd-boot changelog, "
                         "proxmox-boot-tool kernel pin 6.8.12-11-pve, grub-set-default of a 6.14.0-2-pvegpu-pve entry, an "
                         "empty /boot/efi/EFI/BOOT/BOOTX64.efi, debconf grub2/force_efi_extra_removable true, "
                         "apt-mark hold proxmox-kernel-helper")
TWIN_RECORDINGS_UPGRADE = [
    ("upgrade-state-dkms-sdboot-pins-hold", "upgrade.UpgradeState", None),
    ("os-release-bookworm", "upgrade.OsRelease", None),
]
# A fifth recording (issue 41, `--record-twin NAME share`): the shared build's fact on the first node
# of tests/e2e/test_build_share_e2e.py's 3-node cluster twin, after its converge (this node built
# nvidia 595.45.04 for 6.1.0-57-amd64 for the three and keeps it under /var/cache/pvegpu/nvidia-share).
TWIN_PREPARED_SHARE = ("on the first node of a 3-node cluster twin (tests/e2e/test_build_share_e2e.py) after its "
                       "converge: /etc/pve/.members of the cluster, the build this node made for the three kept")
TWIN_RECORDINGS_SHARE = [
    ("build-share-state-cluster-node", "build_share.BuildShareState", [["6.1.0-57-amd64"]]),
]
# A sixth and a seventh recording (issue 40 item 1, `--record-twin NAME perform-preflight`, then
# `perform-job`): the facts of a performed upgrade on a kpro6 twin. perform-preflight: a one-line
# /etc/apt/sources.list.d/pve-install-repo.list (bookworm pve-no-subscription) and ceph.list (ceph-reef
# bookworm no-subscription) written beside the root's deb822 debian.sources, and the pve8to9 stand-in
# told to report one FAIL (tests/twin/runtime.py set_fault(pve8to9_fails=...)). perform-job: then
# ceph.list removed, the fault cleared, a package whose postinst fails dpkg -i'd (half-configured), and
# one converge with proxmox_ve: 9, proxmox_ve_upgrade: perform (the e2e's spec) started the job, which
# failed at dpkg --configure -a (tests/e2e/test_upgrade_perform_e2e.py, without the held dpkg lock).
TWIN_PREPARED_PERFORM_PREFLIGHT = ("after: a one-line pve-install-repo.list and a ceph-reef ceph.list beside the "
                                   "root's debian.sources, the pve8to9 stand-in set to report one FAIL")
TWIN_RECORDINGS_PERFORM_PREFLIGHT = [
    ("upgrade-preflight-fail-ceph-reef", "upgrade.UpgradePreflight", None),
]
TWIN_PREPARED_PERFORM_JOB = ("after: the upgrade job started by a converge with proxmox_ve_upgrade: perform failed at "
                             "dpkg --configure -a on a package whose postinst fails")
TWIN_RECORDINGS_PERFORM_JOB = [
    ("upgrade-job-failed-configure", "upgrade.UpgradeJob", None),
    ("upgrade-preflight-trixie-sources", "upgrade.UpgradePreflight", None),
]
RECORDING_GROUPS: dict[str, tuple[list, str]] = {"stages": (TWIN_RECORDINGS, TWIN_PREPARED), "guests": (TWIN_RECORDINGS_GUESTS, TWIN_PREPARED_GUESTS),
                    "packages": (TWIN_RECORDINGS_PACKAGES, TWIN_PREPARED_PACKAGES),
                    "upgrade": (TWIN_RECORDINGS_UPGRADE, TWIN_PREPARED_UPGRADE),
                    "share": (TWIN_RECORDINGS_SHARE, TWIN_PREPARED_SHARE),
                    "perform-preflight": (TWIN_RECORDINGS_PERFORM_PREFLIGHT, TWIN_PREPARED_PERFORM_PREFLIGHT),
                    "perform-job": (TWIN_RECORDINGS_PERFORM_JOB, TWIN_PREPARED_PERFORM_JOB)}


def fact_command(fact_path: str, args) -> str:
    module_name, class_name = fact_path.rsplit(".", 1)
    fact = getattr(importlib.import_module(f"facts.{module_name}"), class_name)()
    command = fact.command(*(args or [])) if callable(fact.command) else fact.command
    return StringCommand(command).get_raw_value()


def record_twin(name: str, group: str = "stages", date: str | None = None) -> None:
    date = date or time.strftime("%Y-%m-%d")
    recordings, prepared = RECORDING_GROUPS[group]
    twinctl = ROOT / "tests" / "twin" / "twinctl"
    folder = FIXTURES / TWIN_DIR
    folder.mkdir(exist_ok=True)
    for fixture, fact_path, args in recordings:
        command = fact_command(fact_path, args)
        run = subprocess.run([str(twinctl), "ssh", name, "--", f"sh -c {shlex.quote(command)}"],
                             capture_output=True, text=True, timeout=300)
        arguments = f" ({json.dumps(args)})" if args else ""
        source = (f"recorded by pvegpu tests/unit/facts/generate_cases.py --record-twin on {date}: "
                  f"facts.{fact_path} command{arguments} run over ssh on the twin, {prepared}")
        (folder / f"{fixture}.txt").write_text(f"# source: {source}\n# machine: {TWIN_MACHINE}\n" + run.stdout)
        print(f"{TWIN_DIR}/{fixture}.txt\t{source}\t{TWIN_MACHINE}")


TOPO_M = sorted(p.name for p in (FIXTURES / "topo-m").iterdir())
CASES = [
    *[case("gpu.GpuTopology", Path(name).stem, f"topo-m/{name}") for name in TOPO_M],
    case("gpu.GpuTopology", "h200-vm-1gpu-ansi", "h200-vm/topo-m.txt"),
    case("gpu.GpuP2P", "2x-rtx2080ti-autodl-p2p-p-ns", "topo-p2p/2x-rtx2080ti-autodl-p2p-p-ns.txt", args=["p"]),
    case("gpu.GpuP2P", "2x-rtx3090-nvlink-p2p-ok-proxmox-lxc", "topo-p2p/2x-rtx3090-nvlink-p2p-ok-proxmox-lxc.txt",
         args=["r"], note="the source does not say which -p2p letter it used; r is assumed"),
    case("gpu.GpuP2P", "2x-rtx5090-threadripper-3975wx-p2p-rw-gns",
         "topo-p2p/2x-rtx5090-threadripper-3975wx-p2p-rw-gns.txt", args=["rw"]),
    case("gpu.GpuP2P", "5gpu-rtx50-epyc-p2p-p-all-ok-with-usage-error",
         "topo-p2p/5gpu-rtx50-epyc-p2p-p-all-ok-patched-plus-usage-error-fragment.txt", args=["p"]),
    case("gpu.GpuP2P", "8x-gpu-p2p-r-all-ok-stas00", "topo-p2p/8x-gpu-p2p-r-all-ok-stas00.txt", args=["r"]),
    case("gpu.GpuP2P", "8x-pcie-gpu-dual-numa-p2p-r", "topo-p2p/8x-pcie-gpu-dual-numa-p2p-r-and-w-all-ok.txt",
         ranges=[[7, 25]], args=["r"]),
    case("gpu.GpuP2P", "8x-pcie-gpu-dual-numa-p2p-w", "topo-p2p/8x-pcie-gpu-dual-numa-p2p-r-and-w-all-ok.txt",
         ranges=[[31, 49]], args=["w"]),
    case("gpu.GpuP2P", "2x-rtx3090-epyc7302p-rewrapped-p2p-rw", "topo-m/2x-rtx3090-epyc7302p-h12ssl-node-rewrapped.txt",
         ranges=[[21, 34]], args=["rw"], note="the topo -p2p rw block that follows topo -m in this paste"),
    *[case("gpu.GpuP2P", f"h200-vm-p2p-{k}", f"h200-vm/topo-p2p-{k}.txt", args=[k]) for k in "rwnap"],
    *[case("nvidia.NvidiaDriver", Path(p.name).stem, f"driver-version/{p.name}")
      for p in sorted((FIXTURES / "driver-version").iterdir())],
    case("nvidia.NvidiaDriver", "h200-vm-open-580", "h200-vm/driver-version.txt"),
    case("nvidia.NvidiaGpus", "h200-vm-1gpu", "h200-vm/driver-gpus-information.txt"),
    case("nvidia.NvidiaDriverParams", "h200-vm", "h200-vm/driver-params.txt"),
    case("devices.CharDeviceMajors", "cuda-guide-grep-nvidia-imex-channels-234-nvswitch-509",
         "proc-devices/cuda-guide-grep-nvidia-imex-channels-234-nvswitch-509.txt"),
    case("devices.CharDeviceMajors", "desktop-550plus-naming-head50-no-uvm-yet",
         "proc-devices/desktop-550plus-naming-head50-no-uvm-yet.txt"),
    case("devices.CharDeviceMajors", "dra-driver-304-proc-devices-abridged-imex-channels",
         "proc-devices/dra-driver-304-proc-devices-abridged-imex-channels.txt", ranges=[[12, 16]],
         note="the cat /proc/devices part only; the ls -la /dev/nvidia-caps part before it is a listing"),
    case("devices.CharDeviceMajors", "rtx5060-open-module-no-udev-nvidia-subset",
         "proc-devices/rtx5060-open-module-no-udev-nvidia-subset.txt"),
    case("devices.CharDeviceMajors", "h200-vm-uvm-238-block-devices-after", "h200-vm/proc-devices.txt"),
    case("devices.NvidiaDeviceNodes", "ls-dev-nvidia-lxc-container-uvm-511",
         "proc-devices/ls-dev-nvidia-lxc-container-uvm-511.txt"),
    case("devices.NvidiaDeviceNodes", "ls-dev-nvidia-vm-uvm-234", "proc-devices/ls-dev-nvidia-vm-uvm-234.txt",
         note="listed with the nv* glob, so /dev/nvram shows up too"),
    case("devices.NvidiaDeviceNodes", "h200-vm-uvm-238-caps-dir", "h200-vm/ls-dev-nvidia.txt"),
    # the fact's own stat command on a second real GPU host, in its session's locale and in a German
    # one with TIME_STYLE=long-iso: the same lines (issue 43 item 2)
    case("devices.NvidiaDeviceNodes", "h100-vm-stat", "h100-vm/stat-dev-nvidia.txt"),
    case("devices.NvidiaDeviceNodes", "h100-vm-stat-de-long-iso", "h100-vm/stat-dev-nvidia-de.txt"),
    case("devices.NvidiaDeviceNodes", "h100-vm-ls", "h100-vm/ls-dev-nvidia.txt"),
    case("devices.CharDeviceMajors", "h100-vm-uvm-238", "h100-vm/proc-devices.txt"),
    case("nvidia.NvidiaDriver", "h100-vm-open-580-gcc15", "h100-vm/driver-version.txt"),
    case("nvidia.NvidiaGpus", "h100-vm-1gpu", "h100-vm/driver-gpus-information.txt"),
    case("nvidia.NvidiaDriverParams", "h100-vm", "h100-vm/driver-params.txt"),
    case("kernel.KernelCmdline", "h100-vm-init-args-after-dashes", "h100-vm/proc-cmdline.txt"),
    case("gpu.GpuTopology", "h100-vm-1gpu", "h100-vm/topo-m.txt"),
    case("gpu.GpuP2P", "h100-vm-p2p-r", "h100-vm/topo-p2p-r.txt", args=["r"]),
    *[case("kernel.KernelCmdline", Path(name).stem, f"cmdline/{name}") for name in (
        "fedora-fsync-intel-iommu-pt-proc-cmdline.txt", "proxmox-fuji-pve-6.5.11-intel-iommu-on.txt",
        "proxmox-suprox-pve-6.5.11-intel-iommu-pt.txt", "proxmox-systemd-boot-zfs-5.4.73-proc-cmdline.txt",
        "truenas-scale-zfs-root-amd-and-intel-iommu.txt")],
    case("kernel.KernelCmdline", "h200-vm", "h200-vm/proc-cmdline.txt"),
    *[case("kernel.BootLoader", Path(name).stem, f"cmdline/{name}",
           sections=[("@@ proxmox-boot-tool status", None, None), ("@@ firmware", None, None),
                     ("@@ /etc/kernel/cmdline", None, None), ("@@ /etc/default/grub", f"cmdline/{name}", None)],
           note="/etc/default/grub of a GRUB host without proxmox-boot-tool")
      for name in ("asus-esc8000a-e12-etc-default-grub-amd-iommu-off.txt",
                   "puget-wrx90-etc-default-grub-amd-iommu-off.txt",
                   "proxmox-etc-default-grub-intel-sriov-kamilllooo.txt")],
    *[case("kernel.BootLoader", f"proxmox-etc-kernel-cmdline-zfs-{which}",
           "cmdline/proxmox-etc-kernel-cmdline-zfs-default-and-iommu.txt",
           sections=[("@@ proxmox-boot-tool status", None, None), ("@@ firmware", None, None),
                     ("@@ /etc/kernel/cmdline", "cmdline/proxmox-etc-kernel-cmdline-zfs-default-and-iommu.txt",
                      [[line, line]]),
                     ("@@ /etc/default/grub", None, None)],
           note=f"the {which} /etc/kernel/cmdline of this systemd-boot host")
      for which, line in (("default", 3), ("with-iommu", 5))],
    case("kernel.BootLoader", "proxmox-boot-tool-one-esp-uefi-and-grub",
         "proxmox-boot-tool/status-one-esp-uefi-and-grub.txt",
         sections=[("@@ proxmox-boot-tool status", "proxmox-boot-tool/status-one-esp-uefi-and-grub.txt", None),
                   ("@@ firmware", None, None), ("@@ /etc/kernel/cmdline", None, None), ("@@ /etc/default/grub", None, None)],
         note="an ESP with both loaders (proxmox-boot-tool _status_detail): each part's versions; without a firmware "
              "line the ESP's loader is GRUB's (zz-proxmox-boot sets up systemd-boot only under UEFI)"),
    case("kernel.KernelToolchain", "h200-vm-gcc-15", "h200-vm/proc-version.txt",
         sections=[("@@ /proc/version", "h200-vm/proc-version.txt", None)]),
    *[case("kernel.KernelToolchain", f"proc-version-{release}", "proc-version/percona-pmm-telemetry-hosts.txt",
           sections=[("@@ /proc/version", "proc-version/percona-pmm-telemetry-hosts.txt", [[line, line]])],
           note="/proc/version before 5.8: `gcc version X (pkgversion)`; GCC's version is X, not the last x.y.z")
      for line, release in ((3, "4.4.0-47-generic-ubuntu-gcc-5.4.0"), (4, "3.13.0-129-generic-ubuntu-gcc-4.8.4"),
                            (5, "4.13.0-11-lowlatency-gcc-7.2.0"), (7, "4.4.35-1-pve-debian-gcc-4.9.2"),
                            (8, "4.12.13-300.fc26-red-hat-gcc-7.1.1"), (11, "4.9.41-moby-alpine-gcc-6.2.1"))],
    case("kernel.KernelToolchain", "debian-headers-6.1.0-57-amd64-unquoted-auto-conf",
         "debian-headers/kernel-toolchain-headers-6.1.0-57-amd64.txt", args=["6.1.0-57-amd64"],
         note="include/config/auto.conf writes CONFIG_CC_VERSION_TEXT unquoted"),
    *[case("kernel.IommuState", Path(p.name).stem, f"iommu-groups/{p.name}")
      for p in sorted((FIXTURES / "iommu-groups").iterdir())],
    case("kernel.IommuState", "h200-vm-no-groups", "h200-vm/iommu-groups.txt"),
    case("kernel.SevSnp", "h200-vm-intel-no-sev", "h200-vm/sev.txt"),
    case("kernel.ModuleParameters", "h200-vm-nvidia-uvm", "h200-vm/uvm-params.txt", args=["nvidia_uvm"]),
    case("kernel.ModuleParameters", "h200-vm-nvidia-not-listed", "h200-vm/nvidia-module-params.txt",
         args=["nvidia"]),
    case("cpu.CpuInfo", "h200-vm-intel-xeon", "h200-vm/cpuinfo-first.txt"),
    case("pci.PciDevices", "h200-vm-sysfs", "h200-vm/sysfs-pci-fact.txt"),
    *[case("pci.PciAcs", Path(p.name).stem, f"lspci/{p.name}")
      for p in sorted((FIXTURES / "lspci").iterdir()) if "lspci-tv" not in p.name],
    case("pci.PciAcs", "h200-vm-no-lspci", "h200-vm/lspci-vvv.txt"),
    case("pci.PciAcs", "h200-vm-lspci-n-no-bridges", "h200-vm/pci-acs-fact.txt",
         note="the fact's own command with lspci carried in: numeric headers, no ACS capability, no bridge"),
    *[case("proxmox.LxcConfigs", Path(name).stem, f"lxc-conf/{name}",
           sections=[(f"@@ /etc/pve/lxc/{ctid}.conf", f"lxc-conf/{name}", None)], note=note)
      for name, ctid, note in (
          ("frigate-7640-intel-igpu-no-nvidia-negative.txt", 102, "CT id from its rootfs volume name"),
          ("frigate-8652-2051-unprivileged-2x-nvidia-coral-idmap-fragment.txt", 2051, None),
          ("pve-6006-gpuaas-privileged-nvidia-caps-loop.txt", 6006, None),
          ("pve9-102-jellyfin-privileged-lxc-mount-entry-nvidia-caps-dir.txt", 102, None),
          ("pve9-116-xtts-unprivileged-raw-lxc-nvidia-allow-a.txt", 116, None),
          ("telmate-1138-gpu-and-coral-snippet.txt", 100, "the source names no CT id; 100 is assumed"),
      )],
    *[case("kernel.ProxmoxKernels", name, f"proxmox-boot-tool/{fixture}",
           sections=[("@@ kernel list", f"proxmox-boot-tool/{fixture}", ranges), ("@@ /boot", None, None),
                     ("@@ running", None, None), ("@@ pin", None, None), ("@@ next-boot-pin", None, None)],
           note="kernel list only; /boot, uname -r and the pin files are not in the source")
      for name, fixture, ranges in (
          ("kernel-list-pinned-6.8.4-2", "kernel-list-pinned-6.8.4-2.txt", None),
          ("kernel-list-three-kernels-before-pin", "kernel-list-three-kernels-before-and-after-pin.txt", [[4, 10]]),
          ("kernel-list-three-kernels-after-pin", "kernel-list-three-kernels-before-and-after-pin.txt", [[13, 22]]),
          ("kernel-list-no-blank-lines-two-kernels", "kernel-list-no-blank-lines-two-kernels.txt", None),
      )],
    *[case("loader.LoaderState", name, fixture, note=note) for name, fixture, note in (
        ("kpro6-oneshot-and-default", "twin-kpro6/loader-state-oneshot-and-default.txt",
         "the real bootctl's LoaderEntryOneShot and LoaderEntryDefault in the twin's efivarfs, the real refresh's entries"),
        ("kpro6-pin-and-entry-without-kernel", "twin-kpro6/loader-state-pin-and-entry-without-kernel.txt",
         "loader.conf's default after kernel pin + refresh; an entry whose kernel is not on the ESP"),
        ("intel2-grub-first-entry", "twin-intel2/loader-state-grub-first-entry.txt",
         "GRUB on /boot (LVM): GRUB_DEFAULT=0, an empty grubenv, no ESP"),
        ("intel2-grub-saved-and-next-entry", "twin-intel2/loader-state-grub-saved-and-next-entry.txt",
         "GRUB_DEFAULT=saved, grub-set-default and grub-reboot (Debian's grub2-common) by entry id"),
        ("kpro6-grubesp-mixed-grub-esp-first", "twin-kpro6-grubesp/loader-state-mixed-grub-esp-first.txt",
         "ESPs of both loaders, GRUB's first: the real refresh skipped the systemd-boot ESP after it (no entries)"),
        ("kpro6-grubesp-mixed-systemd-boot-esp-first", "twin-kpro6-grubesp/loader-state-mixed-systemd-boot-esp-first.txt",
         "ESPs of both loaders, systemd-boot's first: the real refresh wrote each in its own mode"),
    )],
    case("rebind.GuestRuntime", "h200-vm-sysfs-section", "h200-vm-probe/rebind-facts.txt", ranges=[[5, 6]],
         note="the device run printed the command's sysfs section only (the machine is no Proxmox node)"),
    case("proxmox.NodeName", "h200-vm-no-domain", "h200-vm/uname-n.txt",
         note="uname -n on the H200 machine (device run of session 5)"),
    case("hardware.HardwareProbe", "h200-vm-one-command", "h200-vm-probe/hardware-probe.txt",
         note="the probe's own single command, run on the H200 VM"),
    case("hardware.HostConfigProbe", "h200-vm-one-command", "h200-vm-probe/host-config-probe.txt",
         note="the probe's own single command, run on the H200 VM (no Proxmox there); its pve_version "
              "section was pveversion then, which prints nothing there, as dpkg-query of pve-manager does"),
    *[case(fact_path, f"twin-kpro6-{fixture}", f"{TWIN_DIR}/{fixture}.txt", args=args,
           note="recorded on the kpro6 twin (INDEX.tsv says how it was prepared)")
      for fixture, fact_path, args in TWIN_RECORDINGS + TWIN_RECORDINGS_GUESTS + TWIN_RECORDINGS_PACKAGES
      + TWIN_RECORDINGS_UPGRADE + TWIN_RECORDINGS_SHARE + TWIN_RECORDINGS_PERFORM_PREFLIGHT
      + TWIN_RECORDINGS_PERFORM_JOB],
    *[case("boot.GrubFiles", Path(name).stem, f"cmdline/{name}",
           sections=[("@@ /etc/default/grub", f"cmdline/{name}", None)],
           note="/etc/default/grub alone (no grub.d drop-ins in the source)")
      for name in ("asus-esc8000a-e12-etc-default-grub-amd-iommu-off.txt",
                   "puget-wrx90-etc-default-grub-amd-iommu-off.txt",
                   "proxmox-etc-default-grub-intel-sriov-kamilllooo.txt")],
    case("nvidia.NvidiaHostState", "debian-root-6.1-and-6.12.118-deb12",
         "debian-headers/nvidia-host-state-6.1-and-6.12.118-deb12.txt", ranges=[[1, 33]],
         args=[["6.1.0-57-amd64", "6.12.118+deb12-amd64"],
               {"modules": ["/opt/src/open-gpu-kernel-modules-595.45.04.tar.xz",
                            "654a8bd9d3e2c185073ac5adb2c9aaa9b6134df1c7584366ecf6de400dca8c0b"]}],
         note="the file has no header lines; the modules source was absent there, so its sha256 (the one "
              "tests/unit/test_plan_nvidia.py uses) does not show in the output"),
]

# Fixtures deliberately not used, and why (kept here so the choice is visible).
SKIPPED = {
    "proc-devices/ls-dev-char-nvidia-symlinks-uvm-234-caps-237.txt":
        "a /dev/char symlink listing and bare `ls` names, not /proc/devices nor `ls -l` with numbers",
    "cmdline/proxmox-systemd-boot-zfs-6.8.12-dmesg-command-line.txt":
        "dmesg lines echoing the command line, not /proc/cmdline",
    "lspci/*-lspci-tv.txt": "lspci -tv trees; the PCI tree comes from sysfs (PciDevices)",
}


def build(spec: dict) -> dict:
    module_name, class_name = spec["fact"].rsplit(".", 1)
    fact_class = getattr(importlib.import_module(f"facts.{module_name}"), class_name)
    fact = fact_class()
    args = spec["args"] or []
    command = fact.command(*args) if callable(fact.command) else fact.command
    data: dict = {"fixture": spec["fixture"]}
    if spec["sections"]:
        output: list[str] = []
        used = []
        for marker, fixture, ranges in spec["sections"]:
            output.append(marker)
            if fixture:
                ranges = ranges or body_ranges(fixture)
                used.append({"marker": marker, "fixture": fixture, "fixture_lines": ranges})
                output.extend(fixture_lines(fixture, ranges))
        data["sections"] = used
    else:
        ranges = spec["ranges"] or body_ranges(spec["fixture"])
        data["fixture_lines"] = ranges
        output = fixture_lines(spec["fixture"], ranges)
    if spec["note"]:
        data["note"] = spec["note"]
    if args:
        data["arg"] = args
    data["command"] = StringCommand(command).get_raw_value()
    requires = fact.requires_command(*args)
    if requires:
        data["requires_command"] = requires
    data["output"] = output
    result = fact.process(output) if output else fact.default()
    data["fact"] = json.loads(json.dumps(_to_jsonable(result)))  # tuple keys as pyinfra-testing writes them
    return data


def main(update: bool) -> None:
    for spec in CASES:
        folder = CASES_DIR / spec["fact"]
        folder.mkdir(exist_ok=True)
        path = folder / f"{spec['name']}.yaml"
        data = build(spec)
        if path.exists() and not update:
            data["fact"] = yaml.safe_load(path.read_text())["fact"]
        path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=200))
        print(path.relative_to(ROOT))


if __name__ == "__main__":
    if "--record-twin" in sys.argv:
        at = sys.argv.index("--record-twin")
        record_twin(*sys.argv[at + 1:at + 3])  # NAME [GROUP: stages (default) or guests]
    else:
        main(update="--update" in sys.argv)
