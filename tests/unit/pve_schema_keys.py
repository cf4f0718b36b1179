"""What Proxmox VE 8 and 9 accept in the /etc/pve files pvegpu writes (issue 40 item 2): facts read
from the real parsers at the last commit of each release's branch, one set per release.

A cluster being upgraded node by node is mixed: /etc/pve is one file system for every node, so a
line one release does not know breaks the other's parse of it. A VM or CT config line whose key
or value its release rejects is dropped with a warning (qemu-server src/PVE/QemuServer.pm
parse_vm_config, pve-container src/PVE/LXC/Config.pm parse_pct_config: "unable to parse value
of ..."); a pci.cfg section entry likewise (pve-common src/PVE/SectionConfig.pm parse_config).

Releases: Proxmox VE 8 = bookworm (branch stable-bookworm; pve-guest-common has none, its 8 is
5.2.2, the last bookworm upload on master), Proxmox VE 9 = trixie (master). Only names and value
rules are kept here, never upstream text. tests/unit/test_mixed_cluster_configs.py checks every
key pvegpu writes against both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class PveRelease:
    name: str
    # pci.cfg: the keys of a mapping section (the section header is its id) and of each `map` entry
    mapping_keys: frozenset[str]
    map_keys: frozenset[str]
    map_required: frozenset[str]
    # qemu-server: the VM config keys pvegpu may set (a subset of $confdesc), the hostpci index
    # bound, and the sub-keys of the property strings pvegpu writes, with each format's default key
    vm_keys: frozenset[str]
    max_hostpci: int
    hostpci_keys: frozenset[str]
    cpu_keys: frozenset[str]
    cpu_vm_flags: frozenset[str]
    machine_keys: frozenset[str]
    # pve-container: devN (N below max_devices) and its sub-keys; raw `lxc.*` keys: exact names, the
    # prefixes accepted as they are, and the prefixes accepted only with a deprecation warning
    max_devices: int
    dev_keys: frozenset[str]
    lxc_keys: frozenset[str]
    lxc_prefixes: tuple[str, ...]
    lxc_deprecated_prefixes: tuple[str, ...]


DEFAULT_KEYS = {"hostpci": "host", "cpu": "cputype", "machine": "type", "dev": "path"}

# value rules the same in both releases
# pve-common src/PVE/JSONSchema.pm $CONFIGID_RE (pve-configid: mapping ids, hostpci mapping=) and
# pve_verify_node_name (pve-node), at stable-bookworm 9196280 (8.3.8) and master f665029 (9.2.1)
CONFIGID_RE = re.compile(r"^[a-z][a-z0-9_-]+$", re.I)
NODE_RE = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9\-]*[a-zA-Z0-9])?$")
# pve-guest-common src/PVE/Mapping/PCI.pm $map_fmt (id, subsystem-id, path: $PCI_RE, iommugroup)
PCI_ID_RE = re.compile(r"^[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}$")
_PCI = r"[a-f0-9]{4,}:[a-f0-9]{2}:[a-f0-9]{2}(?:\.[a-f0-9])?"
MAP_PATH_RE = re.compile(rf"^(?:{_PCI};)*{_PCI}$")
# qemu-server src/PVE/QemuServer/Machine.pm $machine_fmt type; CPUConfig.pm parse_phys_bits
MACHINE_TYPE_RE = re.compile(r"^(pc|pc(-i440fx)?-\d+(\.\d+)+(\+pve\d+)?(\.pxe)?|q35|pc-q35-\d+(\.\d+)+(\+pve\d+)?(\.pxe)?"
                             r"|virt(?:-\d+(\.\d+)+)?(\+pve\d+)?)$")
PHYS_BITS_RE = re.compile(r"^(host|\d{1,2})$")  # and 8 <= bits <= 64
CPU_FLAG_RE = re.compile(r"^([+-])([a-zA-Z0-9\-_.]+)$")
# pve-container src/PVE/LXC/Config.pm verify_lxc_dev_string (under /dev/, no . or .. component)
DEV_PATH_RE = re.compile(r"^/dev/(?!.*/\.\.?(?:/|$))")

_LXC_KEYS_8 = frozenset("""
lxc.apparmor.profile lxc.apparmor.allow_incomplete lxc.apparmor.allow_nesting lxc.apparmor.raw lxc.selinux.context
lxc.include lxc.arch lxc.uts.name lxc.signal.halt lxc.signal.reboot lxc.signal.stop lxc.init.cmd lxc.pty.max
lxc.console.logfile lxc.console.path lxc.tty.max lxc.devtty.dir lxc.hook.autodev lxc.autodev lxc.kmsg lxc.mount.fstab
lxc.mount.entry lxc.mount.auto lxc.rootfs.mount lxc.cap.drop lxc.cap.keep lxc.seccomp.profile
lxc.seccomp.notify.proxy lxc.seccomp.notify.cookie lxc.idmap lxc.hook.pre-start lxc.hook.pre-mount lxc.hook.mount
lxc.hook.start lxc.hook.stop lxc.hook.post-stop lxc.hook.clone lxc.hook.destroy lxc.hook.version lxc.log.level
lxc.log.file lxc.start.auto lxc.start.delay lxc.start.order lxc.group lxc.environment lxc.sysctl.fs.mqueue
lxc.sysctl.kernel.msgmax lxc.sysctl.kernel.msgmnb lxc.sysctl.kernel.msgmni lxc.sysctl.kernel.sem
lxc.sysctl.kernel.shmall lxc.sysctl.kernel.shmmax lxc.sysctl.kernel.shmmni lxc.sysctl.kernel.shm_rmid_forced
""".split())

PVE8 = PveRelease(
    name="Proxmox VE 8 (bookworm)",
    # pve-guest-common src/PVE/Mapping/PCI.pm $defaultData/options and $map_fmt at 58ad1835 (5.2.2)
    mapping_keys=frozenset({"description", "mdev", "live-migration-capable", "map"}),
    map_keys=frozenset({"node", "id", "subsystem-id", "path", "iommugroup", "description"}),
    map_required=frozenset({"node", "id", "path"}),
    # qemu-server src/PVE/QemuServer.pm $confdesc (cpu, machine), QemuServer/PCI.pm $MAX_HOSTPCI_DEVICES
    # and $hostpci_fmt, QemuServer/CPUConfig.pm $cpu_fmt and @supported_cpu_flags, QemuServer/Machine.pm
    # $machine_fmt, at stable-bookworm 5ccd363e (8.4.10)
    vm_keys=frozenset({"cpu", "machine"}),
    max_hostpci=16,
    hostpci_keys=frozenset({"host", "mapping", "rombar", "romfile", "pcie", "x-vga", "legacy-igd", "mdev",
                            "vendor-id", "device-id", "sub-vendor-id", "sub-device-id"}),
    cpu_keys=frozenset({"cputype", "reported-model", "hidden", "hv-vendor-id", "flags", "phys-bits"}),
    cpu_vm_flags=frozenset({"pcid", "spec-ctrl", "ibpb", "ssbd", "virt-ssbd", "amd-ssbd", "amd-no-ssb", "pdpe1gb",
                            "md-clear", "hv-tlbflush", "hv-evmcs", "aes"}),
    machine_keys=frozenset({"type", "viommu", "enable-s3", "enable-s4"}),
    # pve-container src/PVE/LXC/Config.pm $MAX_DEVICES, $dev_desc, $valid_lxc_conf_keys (entries whose
    # value is an error text left out) and is_valid_lxc_conf_key, at stable-bookworm 64758737 (5.3.5)
    max_devices=256,
    dev_keys=frozenset({"path", "mode", "uid", "gid", "deny-write"}),
    lxc_keys=_LXC_KEYS_8,
    lxc_prefixes=("lxc.cgroup.", "lxc.cgroup2.", "lxc.prlimit.", "lxc.net."),
    lxc_deprecated_prefixes=(),
)

PVE9 = PveRelease(
    name="Proxmox VE 9 (trixie)",
    # pve-guest-common src/PVE/Mapping/PCI.pm $defaultData/options and $map_fmt at master 4a8f6cbf (6.0.2)
    mapping_keys=PVE8.mapping_keys,
    map_keys=PVE8.map_keys,
    map_required=PVE8.map_required,
    # qemu-server (the same files; supported flags in QemuServer/CPUFlags.pm for x86_64) at master
    # e6352be6 (9.2.6): hostpci gains `driver`, cpu `guest-phys-bits` and `level`, machine `aw-bits`
    vm_keys=PVE8.vm_keys,
    max_hostpci=16,
    hostpci_keys=PVE8.hostpci_keys | {"driver"},
    cpu_keys=PVE8.cpu_keys | {"guest-phys-bits", "level"},
    cpu_vm_flags=PVE8.cpu_vm_flags | {"nested-virt"},
    machine_keys=PVE8.machine_keys | {"aw-bits"},
    # pve-container src/PVE/LXC/Config.pm (the same names) at master 94f55852 (6.1.10): cgroup v1
    # `lxc.cgroup.` keys only with "deprecated, this will be a hard error" (lxc ignores them: no v1)
    max_devices=256,
    dev_keys=PVE8.dev_keys,
    lxc_keys=_LXC_KEYS_8 | {"lxc.init.cwd", "lxc.init.uid", "lxc.init.gid", "lxc.init.groups",
                            "lxc.environment.runtime", "lxc.environment.hooks"},
    lxc_prefixes=("lxc.cgroup2.", "lxc.prlimit.", "lxc.net."),
    lxc_deprecated_prefixes=("lxc.cgroup.",),
)

RELEASES = (PVE8, PVE9)
