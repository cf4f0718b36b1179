"""What each guest's GPU configuration should be (pure: spec + facts in, lines out).

Containers (`/etc/pve/lxc/<ctid>.conf`): the device lines for exactly the CT's GPUs, matched
by BDF → *Device Minor* (`NvidiaGpus` fact; minors shift when GPUs move, so never by N), plus
the control nodes every CUDA process needs (/dev/nvidiactl, /dev/nvidia-uvm) and the extra nodes
the CT's spec asks for (uvm-tools, MIG config/monitor caps): each node by itself, never a whole
major or directory. Two syntaxes (DESIGN.md §7):

    pve-container >= 5.0.7:  dev0: /dev/nvidia2,gid=44   (PVE resolves majors at CT start;
                             >= 6.0.4 hotplugs new ones into a running CT)
    older:       lxc.cgroup2.devices.allow: c 195:2 rwm      (majors from /proc/devices)
                 lxc.mount.entry: /dev/nvidia2 dev/nvidia2 none bind,optional,create=file

`merge_container_config` touches only the lines pvegpu owns (see `owned_line`), keeps every
other line where it was, and leaves `[snapshot]` sections and commented lines byte-identical.
pvegpu never writes a cgroup v1 `lxc.cgroup.*` key (ours of that kind are replaced); other
`lxc.cgroup.*` lines are reported with their `lxc.cgroup2.*` fix (`legacy_cgroup_keys`).

VMs: one PCI resource mapping per GPU (`/etc/pve/mapping/pci.cfg`, id
`pvegpu-<node>-<bdf>`), and `hostpciN: mapping=<id>,pcie=1` lines (pcie only on q35). A VM of
a GPU pool (`vms.<id>.pool`) references the pool's mapping instead, one line per GPU; the pool's
mapping holds one entry per pooled GPU of every node (`plan_pool_mappings`: each node writes
only its own entries).
A `pvegpu-*` mapping of this node that no VM of the spec uses and no VM config of the
cluster references any more is stale and deleted (`plan_stale_mappings`); other mappings are
never deleted.

Companion functions (decision): a GPU whose slot has other functions in the same IOMMU group
(HDMI audio `.1`, USB-C `.2`, ...) is mapped as the whole device, path `0000:81:00` without a
function — Proxmox then passes every function of the slot as one multifunction device, which
is what the guest's driver expects. A single-function GPU is mapped by its full BDF.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from spec.models import MAX_HOSTPCI_DEVICES

NVIDIA_MAJOR = 195
# The nodes a CT gets besides its GPUs' /dev/nvidiaN: what a CUDA process opens, nothing more.
# follows libnvidia-container src/nvc_info.c lookup_devices and src/nvc_mount.c nvc_driver_mount:
# a compute container gets /dev/nvidiactl and /dev/nvidia-uvm (NVIDIA also hands it
# /dev/nvidia-uvm-tools, and the CDI generator, nvidia-container-toolkit pkg/nvcdi/common-nvml.go
# controlDeviceNodeDiscoverer, adds /dev/nvidia-modeset too); pvegpu leaves uvm-tools out unless the
# CT asks (`extra_devices: [uvm-tools]`): open-gpu-kernel-modules kernel-open/nvidia-uvm/uvm_tools.c
# serves only the tools interface (event trackers, counters) profilers and debuggers use (CUPTI,
# Nsight); CUDA itself needs /dev/nvidia-uvm (the same driver's uvm.c). modeset is for display.
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm")
# Nodes a CT gets only when its spec asks (`containers.<id>.extra_devices`). MIG config/monitor: the
# toolkit mounts them only on request (src/nvc_mount.c nvc_mig_config_global_caps_mount /
# nvc_mig_monitor_global_caps_mount, for NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES, which
# cmd/nvidia-container-runtime-hook/container_config.go getNvidiaConfig refuses in an unprivileged
# container); their minors follow open-gpu-kernel-modules kernel-open/nvidia/nv-caps.c
# nv_cap_tables_init (nvlink fabric-mgmt 0, then mig/config 1, mig/monitor 2).
EXTRA_NODES = {"uvm-tools": "/dev/nvidia-uvm-tools",
               "mig-config": "/dev/nvidia-caps/nvidia-cap1",
               "mig-monitor": "/dev/nvidia-caps/nvidia-cap2"}
CAPS_NODES = (EXTRA_NODES["mig-config"], EXTRA_NODES["mig-monitor"])
# Each node's char device as (the /proc/devices name of its major, minor), for exact cgroup allow
# lines in the raw `lxc.*` syntax (a `devN` gets exactly its node's number from pve-container).
# follows open-gpu-kernel-modules kernel-open/common/inc/nv-chardev-numbers.h (control device 255)
# and kernel-open/nvidia-uvm/uvm_common.h (NVIDIA_UVM_PRIMARY_MINOR_NUMBER 0, _TOOLS_ 1)
NODE_NUMBERS = {"/dev/nvidiactl": ("nvidia", 255),
                "/dev/nvidia-uvm": ("nvidia-uvm", 0),
                "/dev/nvidia-uvm-tools": ("nvidia-uvm", 1),
                "/dev/nvidia-caps/nvidia-cap1": ("nvidia-caps", 1),
                "/dev/nvidia-caps/nvidia-cap2": ("nvidia-caps", 2)}
# /proc/devices names of the NVIDIA char majors (nvidia-uvm and nvidia-caps are dynamic).
NVIDIA_MAJOR_NAMES = ("nvidia", "nvidiactl", "nvidia-modeset", "nvidia-uvm", "nvidia-caps",
                      "nvidia-nvlink", "nvidia-nvswitch", "nvidia-caps-imex-channels")
MOUNT_OPTIONS = "none bind,optional,create={kind}"
SECTION_RE = re.compile(r"^\[[^\]]+\]\s*$")
KEY_RE = re.compile(r"^([\w.\-]+)\s*:\s?(.*?)\s*$")
DEV_KEY_RE = re.compile(r"^dev(\d+)$")
ALLOW_RE = re.compile(r"^c\s+(\d+):(\S+)\s+\S+$")
# Linux hands out dynamic char majors from 234-254, then 384-511 (fs/char_dev.c); only a
# major from there can be a leftover of nvidia-uvm/nvidia-caps after a reboot.
DYNAMIC_MAJORS = set(range(234, 255)) | set(range(384, 512))


# follows pve-container debian/changelog 5.0.7 ("allow passing raw device nodes through to
# containers"): the `devN:` keys exist in the installed pve-container from that version on
DEV_ENTRIES_PVE_CONTAINER = "5.0.7"


def pve_supports_dev_entries(pve_packages: dict | None) -> bool:
    """`devN:` passthrough entries: the installed pve-container is >= 5.0.7 (`PvePackages`
    fact, `pveversion -v`); pve-manager's version does not decide it."""
    from facts.proxmox import debian_version_key

    version = (pve_packages or {}).get("pve-container")
    if not version:
        return False
    return debian_version_key(version) >= debian_version_key(DEV_ENTRIES_PVE_CONTAINER)


# follows pve-container debian/changelog 6.0.4 ("implement device hotplug", add only) and
# src/PVE/LXC/Config.pm vmconfig_hotplug_pending: `pct set`/the API on a running CT hotplugs a
# devN whose index the config does not hold yet (PVE::LXC device_passthrough_hotplug: the node
# bind-mounted into the CT, its cgroup2 device rule allowed); a devN that exists is skipped (stays
# pending until the restart), and a deleted one is never hot-unplugged
HOTPLUG_DEV_PVE_CONTAINER = "6.0.4"


def pve_hotplugs_dev_entries(pve_packages: dict | None) -> bool:
    """New `devN:` entries reach a running CT without a restart: pve-container >= 6.0.4."""
    from facts.proxmox import debian_version_key

    version = (pve_packages or {}).get("pve-container")
    if not version:
        return False
    return debian_version_key(version) >= debian_version_key(HOTPLUG_DEV_PVE_CONTAINER)


def nvidia_majors(char_majors: dict[str, int]) -> set[int]:
    """The char majors that belong to NVIDIA (from `CharDeviceMajors`), always including 195."""
    return {NVIDIA_MAJOR} | {m for name, m in char_majors.items() if name in NVIDIA_MAJOR_NAMES}


# ---------------------------------------------------------------- containers


@dataclass
class ContainerDevices:
    """A CT's wanted device lines and anything that kept them from being complete.

    `lines`: ``[("dev0", "/dev/nvidia0,gid=44"), ...]`` or ``[("lxc.mount.entry", "..."), ...]``
    (the keys of the old syntax repeat). `problems`: sentences, e.g. a GPU without a minor.
    """

    ctid: int
    gpu_nodes: list[str]
    lines: list[tuple[str, str]]
    problems: list[str] = field(default_factory=list)


def gpu_nodes_for(bdfs: list[str], minors: Mapping[str, int | None]) -> tuple[list[str], list[str]]:
    """`/dev/nvidiaN` of each BDF by its Device Minor, in minor order; and the BDFs without one."""
    found, missing = [], []
    for bdf in bdfs:
        minor = minors.get(bdf)
        (missing.append(bdf) if minor is None else found.append(minor))
    return [f"/dev/nvidia{m}" for m in sorted(found)], missing


def container_nodes(gpu_nodes: list[str], extra: Sequence[str] = ()) -> list[str]:
    """Every device node a CT with these GPU nodes gets: its GPUs, the control nodes, and the
    `extra` nodes its spec asks for (`EXTRA_NODES` keys), in that order."""
    return list(gpu_nodes) + list(CONTROL_NODES) + [EXTRA_NODES[e] for e in EXTRA_NODES if e in extra]


def node_number(node: str, char_majors: Mapping[str, int]) -> tuple[int, int] | None:
    """(major, minor) of a node `container_nodes` gives; None when its major is not registered."""
    gpu = re.fullmatch(r"/dev/nvidia(\d+)", node)
    name, minor = ("nvidia", int(gpu.group(1))) if gpu else NODE_NUMBERS[node]
    major = NVIDIA_MAJOR if name == "nvidia" else char_majors.get(name)
    return None if major is None else (major, minor)


def render_container_devices(ctid: int, bdfs: list[str], minors: Mapping[str, int | None],
                             char_majors: dict[str, int], dev_entries: bool, gid: int,
                             used_dev_indices: AbstractSet[int] = frozenset(),
                             caps_present: list[str] | None = None,
                             current: Mapping[str, int] | None = None,
                             extra: Sequence[str] = (), unprivileged: bool = False) -> ContainerDevices:
    """The device lines a CT needs for exactly `bdfs`: each GPU's /dev/nvidiaN, /dev/nvidiactl,
    /dev/nvidia-uvm, and the `extra` nodes its spec asks for (`EXTRA_NODES`), nothing else.

    + minors: {bdf: Device Minor} (from `NvidiaGpus`: ``{bdf: v["minor"]}``)
    + char_majors: `CharDeviceMajors` (old syntax only)
    + dev_entries: `devN:` syntax (pve-container >= 5.0.7), else raw `lxc.*` lines: one cgroup
      allow line per node (`c 195:N rwm`, the uvm major's minor 0, ...) and one bind per node
    + used_dev_indices: devN indices held by other (not ours) entries; ours take the lowest free
    + caps_present: the /dev/nvidia-caps/* nodes that exist on the host (None: assume all). A
      `devN:` entry whose path is missing stops the CT from starting ("Device … does not exist"),
      and the caps nodes exist only once something (nvidia-modprobe -c, MIG) created them.
    + current: our `devN` entries the config holds now, ``{"/dev/nvidia0,gid=44": 0}``
      (`current_dev_entries`; given where pve-container >= 6.0.4 hotplugs): an entry wanted
      again keeps its index, new ones take the lowest free, so a GPU added to a CT is only added
      lines; without it the entries are numbered from the lowest free index in order
    + extra: the spec's `extra_devices` (uvm-tools, mig-config, mig-monitor)
    + unprivileged: the CT config says `unprivileged: 1`; MIG caps are refused there, as NVIDIA's
      runtime hook refuses them in an unprivileged container
    """
    gpu_nodes, missing = gpu_nodes_for(bdfs, minors)
    problems = [f"CT {ctid}: GPU {b} has no /dev/nvidia minor (not bound to the nvidia driver)"
                for b in missing]
    if not bdfs:
        return ContainerDevices(ctid, [], [], problems)
    wanted = list(extra)
    mig = [e for e in wanted if e.startswith("mig-")]
    if mig and unprivileged:
        problems.append(f"CT {ctid} is unprivileged: extra_devices {', '.join(mig)} (MIG management) are left out; "
                        "NVIDIA's container runtime gives them only to privileged containers")
        wanted = [e for e in wanted if e not in mig]
    for e in list(wanted):
        node = EXTRA_NODES[e]
        if node in CAPS_NODES and caps_present is not None and node not in caps_present:
            problems.append(f"CT {ctid}: extra_devices {e}: {node} does not exist on the host (the driver makes "
                            "it with nvidia-modprobe -f /proc/driver/nvidia/capabilities/mig/"
                            f"{e[len('mig-'):]}); left out")
            wanted.remove(e)
    nodes = container_nodes(gpu_nodes, wanted)
    lines: list[tuple[str, str]] = []
    if dev_entries:
        values = [f"{node},gid={gid}" for node in nodes]
        kept = {v: i for v, i in (current or {}).items() if v in values and i not in used_dev_indices}
        free = (i for i in range(10_000) if i not in used_dev_indices and i not in kept.values())
        index = {v: kept[v] if v in kept else next(free) for v in values}
        lines = [(f"dev{index[v]}", v) for v in sorted(values, key=index.__getitem__)]
        return ContainerDevices(ctid, gpu_nodes, lines, problems)
    allowed = []
    for node in nodes:
        number = node_number(node, char_majors)
        if number is None:
            name = NODE_NUMBERS[node][0]
            problems.append(f"CT {ctid}: {name} is not in /proc/devices, so the major of {node} is unknown "
                            f"(is the module loaded?); its cgroup allow line is left out")
            continue
        allowed.append(node)
        lines.append(("lxc.cgroup2.devices.allow", f"c {number[0]}:{number[1]} rwm"))
    for node in allowed:
        lines.append(("lxc.mount.entry", f"{node} {node[1:]} {MOUNT_OPTIONS.format(kind='file')}"))
    return ContainerDevices(ctid, gpu_nodes, lines, problems)


def _device_path(value: str) -> str:
    return value.split(",", 1)[0].strip()


def owned_line(key: str, value: str, majors: set[int], stale_majors_ok: bool) -> bool:
    """Is `key: value` a GPU line pvegpu manages?

    Ours: `devN` whose path is /dev/nvidia*; `lxc.*` lines that mention nvidia; cgroup allow
    lines for an NVIDIA major (`majors`), or — when `stale_majors_ok` (the caller saw a dynamic
    major that no driver has registered, in a config that uses nvidia) — the leftover of
    nvidia-uvm's major before a reboot changed it (incident 4).
    """
    if DEV_KEY_RE.match(key):
        return _device_path(value).startswith("/dev/nvidia")
    if not key.startswith("lxc."):
        return False
    if "nvidia" in value:
        return True
    if key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
        match = ALLOW_RE.match(value.strip())
        if match:
            major = int(match.group(1))
            return major in majors or stale_majors_ok
    return False


@dataclass
class MergedConfig:
    text: str
    changed: bool
    removed: list[str]
    added: list[str]


def split_config(text: str) -> tuple[list[str], list[str]]:
    """(main section lines, the rest from the first `[section]` line on, verbatim)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if SECTION_RE.match(line):
            return lines[:i], lines[i:]
    return lines, []


def used_dev_indices(text: str, majors: set[int]) -> set[int]:
    """devN indices of the main section held by entries that are not ours."""
    used = set()
    for line in split_config(text)[0]:
        match = KEY_RE.match(line)
        dev = DEV_KEY_RE.match(match.group(1)) if match else None
        if match and dev and not owned_line(match.group(1), match.group(2), majors, False):
            used.add(int(dev.group(1)))
    return used


def current_dev_entries(text: str, majors: set[int]) -> dict[str, int]:
    """Our devN entries of the main section: ``{"/dev/nvidia0,gid=44": 0}``."""
    entries: dict[str, int] = {}
    for line in split_config(text)[0]:
        match = KEY_RE.match(line)
        dev = DEV_KEY_RE.match(match.group(1)) if match else None
        if match and dev and owned_line(match.group(1), match.group(2), majors, False):
            entries.setdefault(match.group(2), int(dev.group(1)))
    return entries


def hotplug_additions(merged: MergedConfig) -> list[tuple[str, str]] | None:
    """The `devN` entries a change only adds (none of ours removed or changed), as (key, value)
    pairs for `pct set`; None when the change is anything else (a restart applies it)."""
    if not merged.changed or merged.removed or not merged.added:
        return None
    pairs = []
    for line in merged.added:
        match = KEY_RE.match(line)
        if not match or not DEV_KEY_RE.match(match.group(1)):
            return None
        pairs.append((match.group(1), match.group(2)))
    return pairs


# follows pve-container src/PVE/LXC/Config.pm is_valid_lxc_conf_key (6.1.6, "warn about deprecated
# cgroupv1 keys"): any raw `lxc.cgroup.` key is accepted with "… is deprecated, this will be a hard
# error in the future!", and lxc >= 7.0 ignores it (PVE 9 runs a pure cgroup v2 hierarchy;
# pve-manager PVE/CLI/pve8to9.pm check_virtual_guests lists such CTs). Files whose cgroup v2 name
# is the v1 one keep it under `lxc.cgroup2.`; the others are renamed in cgroup v2.
CGROUP_V2_SAME_NAME = ("devices.allow", "devices.deny", "cpuset.cpus", "cpuset.mems")


def legacy_cgroup_keys(ctid: int, text: str) -> list[str]:
    """A sentence, with its fix, for each raw `lxc.cgroup.*` line of a CT config's main section."""
    found = []
    for line in split_config(text)[0]:
        match = KEY_RE.match(line)
        if not match or not match.group(1).startswith("lxc.cgroup."):
            continue
        key, value = match.groups()
        rest = key[len("lxc.cgroup."):]
        if rest in CGROUP_V2_SAME_NAME:
            fix = f"write it as `lxc.cgroup2.{rest}: {value}`"
        else:
            fix = f"write its cgroup v2 equivalent under `lxc.cgroup2.` (cgroup v2 renames {rest!r})"
        found.append(f"CT {ctid}: `{key}: {value}` is a cgroup v1 key, which Proxmox VE 9 (cgroup v2 only) "
                     f"ignores with a warning (pve-container 6.1.6; to become an error); {fix}")
    return found


def merge_container_config(text: str, wanted: list[tuple[str, str]], char_majors: dict[str, int]) -> MergedConfig:
    """Put exactly `wanted` into a CT config, replacing the lines we own and nothing else.

    Our lines go where our first line was (ordering stays stable from run to run); with none
    yet, `devN` lines go before the first raw `lxc.` key and `lxc.*` lines after the last
    line of the main section. Comments (including PVE's `#dev0%3A ...` disabled entries) and
    everything from the first `[snapshot]` header on are kept byte for byte.
    """
    main, rest = split_config(text)
    majors = nvidia_majors(char_majors)
    registered = set(char_majors.values())
    has_nvidia = any("nvidia" in line for line in main if not line.lstrip().startswith("#"))

    def is_ours(line: str) -> bool:
        if line.lstrip().startswith("#"):
            return False
        match = KEY_RE.match(line)
        if not match:
            return False
        key, value = match.groups()
        stale = False
        allow = ALLOW_RE.match(value.strip())
        if allow and registered and has_nvidia:
            major = int(allow.group(1))
            stale = major in DYNAMIC_MAJORS and major not in registered
        return owned_line(key, value, majors, stale)

    kept: list[str] = []
    removed: list[str] = []
    insert_at: int | None = None
    for line in main:
        if is_ours(line):
            removed.append(line)
            if insert_at is None:
                insert_at = len(kept)
            continue
        kept.append(line)
    new_lines = [f"{k}: {v}" for k, v in wanted]
    if insert_at is None:
        # after the last non-blank line (trailing blank lines stay last); devN before raw lxc.*
        insert_at = max((i + 1 for i, l in enumerate(kept) if l.strip()), default=0)
        if wanted and DEV_KEY_RE.match(wanted[0][0]):
            insert_at = next((i for i, l in enumerate(kept) if l.startswith("lxc.")), insert_at)
    merged_main = kept[:insert_at] + new_lines + kept[insert_at:]
    out = "\n".join(merged_main + rest)
    if text.endswith("\n") or not text:
        out += "\n"
    added = [l for l in new_lines if l not in removed]
    gone = [l for l in removed if l not in new_lines]
    return MergedConfig(out, out != text, gone, added)


def is_unprivileged(text: str) -> bool:
    """The CT config's main section says `unprivileged: 1` (pve-container's default is 0)."""
    for line in split_config(text)[0]:
        match = KEY_RE.match(line)
        if match and match.group(1) == "unprivileged":
            return match.group(2).strip() == "1"
    return False


def config_device_nodes(text: str) -> list[str]:
    """Every /dev/nvidia* node a CT config passes (devN paths, lxc.mount.entry sources), sorted."""
    nodes = set()
    for line in split_config(text)[0]:
        match = KEY_RE.match(line)
        if line.lstrip().startswith("#") or not match:
            continue
        key, value = match.groups()
        path = _device_path(value) if DEV_KEY_RE.match(key) else \
            (value.split() or [""])[0] if key == "lxc.mount.entry" else ""
        if path.startswith("/dev/nvidia"):
            nodes.add(path)
    return sorted(nodes)


def config_device_allows(text: str, majors: set[int]) -> list[str]:
    """The raw cgroup allow rules of a CT config's main section for an NVIDIA major (`majors`),
    as written (``c 195:0 rwm``)."""
    found = []
    for line in split_config(text)[0]:
        match = KEY_RE.match(line)
        if line.lstrip().startswith("#") or not match or \
                match.group(1) not in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            continue
        allow = ALLOW_RE.match(match.group(2).strip())
        if allow and int(allow.group(1)) in majors:
            found.append(match.group(2).strip())
    return found


def config_gpu_nodes(text: str) -> list[str]:
    """The /dev/nvidiaN GPU nodes a CT config passes (devN or mount entries), sorted."""
    nodes = set()
    for line in split_config(text)[0]:
        if line.lstrip().startswith("#"):
            continue
        match = KEY_RE.match(line)
        if not match:
            continue
        key, value = match.groups()
        if DEV_KEY_RE.match(key):
            path = _device_path(value)
        elif key == "lxc.mount.entry":
            path = value.split()[0] if value.split() else ""
        else:
            continue
        if re.fullmatch(r"/dev/nvidia\d+", path):
            nodes.add(path)
    return sorted(nodes, key=lambda p: int(p[len("/dev/nvidia"):]))


# ---------------------------------------------------------------- VMs


def mapping_id(node: str, bdf: str) -> str:
    """`pvegpu-kpro6-0000-81-00-0`: Proxmox mapping ids are [a-z][a-z0-9_-]*."""
    slug = re.sub(r"[^a-z0-9]+", "-", f"{node}-{bdf}".lower()).strip("-")
    return f"pvegpu-{slug}"


def mapping_path(bdf: str, pci_devices: dict[str, dict]) -> str:
    """The GPU's BDF, or its whole slot (`0000:81:00`) when other functions of the slot share
    its IOMMU group (audio `.1` and friends; see the module docstring)."""
    slot = bdf.rsplit(".", 1)[0]
    group = pci_devices.get(bdf, {}).get("iommu_group")
    siblings = [b for b, d in pci_devices.items()
                if b != bdf and b.rsplit(".", 1)[0] == slot and d.get("iommu_group") == group]
    return slot if siblings else bdf


# follows pve-guest-common src/PVE/Mapping/PCI.pm $map_fmt (5.2.2, PVE 8.4; 6.0.2 on master, for
# PVE 9: the same keys): node, id and path required (id vendor:device in hex, path one or more BDFs
# or slots), subsystem-id and iommugroup optional; mdev / live-migration-capable (8.4) are mapping
# options, not entry keys, and pvegpu sets neither (GPUs passed whole, offline migration)
def render_mapping_entry(node: str, bdf: str, pci_devices: dict[str, dict]) -> dict[str, str]:
    """One node's `map` entry for a GPU (keys in sorted order, as Proxmox writes them)."""
    dev = pci_devices[bdf]
    entry = {"id": f"{dev['vendor']}:{dev['device']}"}
    if dev.get("iommu_group") is not None:
        entry["iommugroup"] = str(dev["iommu_group"])
    entry["node"] = node
    entry["path"] = mapping_path(bdf, pci_devices)
    if dev.get("subsystem_vendor") and dev.get("subsystem_device"):
        entry["subsystem-id"] = f"{dev['subsystem_vendor']}:{dev['subsystem_device']}"
    return entry


def map_string(entry: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in entry.items())


@dataclass
class MappingChange:
    """`action`: "merge" (this node's entries become `maps`; other nodes' entries are kept as
    they are when the write runs, not as the facts saw them: `operations.guests`) or "delete"
    (the whole id; `maps` empty)."""

    id: str
    action: str
    maps: list[dict[str, str]]
    reason: str
    node: str = ""
    description: str = ""  # given to a mapping this write creates (GPU pools: POOL_DESCRIPTION)


# the description of the GPU pools' mappings pvegpu creates: a pool that leaves the spec is found
# by it, and this node's entries are taken out of it (plan_stale_pools)
POOL_DESCRIPTION = "pvegpu-gpu-pool"


def plan_mappings(node: str, vm_gpus: list[str], pci_devices: dict[str, dict],
                  existing: dict[str, dict]) -> list[MappingChange]:
    """Mapping creations/corrections for the GPUs given to VMs (`PciMappings` fact shape).

    A mapping whose entry for this node differs from the hardware (id, subsystem-id, path,
    IOMMU group) is rewritten: Proxmox refuses to start a VM on a stale one (incident 11).
    """
    changes = []
    for bdf in sorted(vm_gpus):
        wanted = render_mapping_entry(node, bdf, pci_devices)
        mid = mapping_id(node, bdf)
        current = existing.get(mid)
        if current is None:
            changes.append(MappingChange(mid, "merge", [wanted], f"{bdf} has no mapping {mid}", node))
            continue
        mine = [m for m in current["map"] if m.get("node") == node]
        if mine == [wanted]:
            continue
        if mine:
            diffs = sorted(k for k in set(wanted) | set(mine[0]) if wanted.get(k) != mine[0].get(k))
            reason = f"mapping {mid} does not match the hardware ({', '.join(diffs)})"
        else:
            reason = f"mapping {mid} has no entry for node {node}"
        changes.append(MappingChange(mid, "merge", [wanted], reason, node))
    return changes


def _is_q35(machine: str | None) -> bool:
    return bool(machine and "q35" in machine)


# ---------------------------------------------------------------- BAR fit (issue 30 part 3)

# QEMU reports 40 physical address bits to a guest unless the CPU model is `host` (host-phys-bits
# on by default) or phys-bits is set; qemu-server passes `phys-bits=N|host` (PVE 8 and 9) and
# `guest-phys-bits=N` (PVE 9) of the VM's `cpu` option to -cpu (qemu-server
# src/PVE/QemuServer/CPUConfig.pm get_cpu_options; parse_phys_bits: 8-64 or host).
QEMU_DEFAULT_PHYS_BITS = 40
# OVMF (edk2 OvmfPkg/Library/PlatformInitLib MemDetect.c PlatformAddressWidthFromCpuid): a width
# above 40 needs 1 GiB pages (pdpe1gb) and is capped at 46 (4-level paging); 40 bits reported
# by QEMU without host-phys-bits is its "quirk" and gives the classic 32 GiB window
# (PcdPciMmio64Size). PlatformDynamicMmioWindow then takes the top 1/8 of the address space
# (2^(bits-3)) as the 64-bit PCI window.
OVMF_MAX_PHYS_BITS = 46
OVMF_CLASSIC_WINDOW = 32 << 30


def _pow2_at_least(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def gpu_mmio64_need(bdfs: list[str], pci_devices: dict[str, dict]) -> int:
    """Bytes of 64-bit MMIO window the GPUs' BARs take in a q35 guest, each GPU behind its own
    root port (pcie=1): per GPU its 64-bit BARs (an NVIDIA GPU's BAR0 is its 32-bit register
    BAR, below 4 GiB; BAR1 and BAR3 are 64-bit prefetchable) summed and aligned to the largest,
    as a bridge window is (edk2 PciBusDxe), then the windows of all GPUs together."""
    total = 0
    for bdf in bdfs:
        # BAR5 of these GPUs is an I/O BAR (128 bytes): port space, not MMIO; memory BARs are >= 4 KiB here
        bars = [size for index, size in ((pci_devices.get(bdf) or {}).get("bars") or {}).items()
                if int(index) >= 1 and size >= 4096]
        if bars:
            largest = _pow2_at_least(max(bars))
            total += -(-sum(bars) // largest) * largest
    return total


def parse_cpu_option(value: str | None) -> dict:
    """A VM's `cpu` option (``host,flags=+pdpe1gb,phys-bits=46``) as ``{"cputype": …, key: value}``
    (qemu-server's property string: the default key is cputype)."""
    parts: dict[str, str] = {}
    for item in (value or "").split(","):
        if not item:
            continue
        key, sep, val = item.partition("=")
        if sep:
            parts[key.strip()] = val.strip()
        else:
            parts["cputype"] = key.strip()
    parts.setdefault("cputype", "kvm64")  # qemu-server get_default_cpu_type for x86 with KVM
    return parts


def format_cpu_option(parts: dict) -> str:
    rest = [f"{k}={v}" for k, v in parts.items() if k != "cputype"]
    return ",".join([parts["cputype"], *rest])


def guest_phys_bits(parts: dict, host_phys_bits: int | None) -> int | None:
    """The physical address bits QEMU gives the guest for this `cpu` option (None: unknown)."""
    for key in ("guest-phys-bits", "phys-bits"):
        value = parts.get(key)
        if value == "host":
            return host_phys_bits
        if value and value.isdigit():
            bits = int(value)
            if key == "guest-phys-bits" and "phys-bits" in parts and parts["phys-bits"].isdigit():
                bits = min(bits, int(parts["phys-bits"]))
            return bits
    if parts["cputype"] in ("host", "max"):
        return host_phys_bits
    return QEMU_DEFAULT_PHYS_BITS


def ovmf_window(bits: int | None, one_gib_pages: bool) -> int | None:
    """The 64-bit PCI window OVMF opens for a guest of `bits` physical address bits."""
    if bits is None:
        return None
    if bits <= QEMU_DEFAULT_PHYS_BITS or not one_gib_pages:
        return OVMF_CLASSIC_WINDOW if bits <= QEMU_DEFAULT_PHYS_BITS else 1 << (QEMU_DEFAULT_PHYS_BITS - 3)
    return 1 << (min(bits, OVMF_MAX_PHYS_BITS) - 3)


def _gib(value: int) -> str:
    return f"{value / (1 << 30):g} GiB"


def plan_bar_fit(vmid: int, gpus: list[str], config: dict, pci_devices: dict[str, dict],
                 host_phys_bits: int | None) -> tuple[dict[str, str], list[str], list[str]]:
    """Whether the VM's firmware can map its GPUs' BARs, and the `cpu` option that makes it so.

    Returns ``(set_options, problems, notes)``: ``{"cpu": "host,phys-bits=43"}`` where more
    address bits fix it, a problem naming the numbers where nothing Proxmox offers does.
    """
    need = gpu_mmio64_need(gpus, pci_devices)
    if need <= OVMF_CLASSIC_WINDOW:  # fits any window OVMF opens
        return {}, [], []
    options = config.get("options") or {}
    if (options.get("bios") or "seabios") != "ovmf":
        return {}, [], [f"VM {vmid}: its GPUs' BARs need {_gib(need)} of 64-bit MMIO; with SeaBIOS "
                        "pvegpu does not check the guest's window (OVMF's is)"]
    parts = parse_cpu_option(options.get("cpu"))
    bits = guest_phys_bits(parts, host_phys_bits)
    pages = parts["cputype"] in ("host", "max") or "+pdpe1gb" in parts.get("flags", "").split(";")
    have = ovmf_window(bits, pages)
    if have is not None and have >= need:
        return {}, [], []
    needed_bits = max(QEMU_DEFAULT_PHYS_BITS + 1, _pow2_at_least(need).bit_length() - 1 + 3)
    limit = min(OVMF_MAX_PHYS_BITS, host_phys_bits) if host_phys_bits else None
    why = (f"VM {vmid}: its {len(gpus)} GPUs' BARs need {_gib(need)} of 64-bit MMIO; OVMF with "
           f"{bits if bits is not None else 'unknown'} guest physical address bits (cpu: {options.get('cpu') or 'kvm64'}) "
           f"opens {_gib(have) if have else 'an unknown'} window")
    if limit is None or needed_bits > limit:
        return {}, [why + f", and {needed_bits} bits are needed, more than OVMF ({OVMF_MAX_PHYS_BITS}) and the host "
                          f"({host_phys_bits if host_phys_bits else 'unknown'}) allow: give it fewer GPUs or "
                          "smaller BARs"], []
    fixed = dict(parts)
    fixed.pop("guest-phys-bits", None)
    fixed["phys-bits"] = str(needed_bits)
    if fixed["cputype"] not in ("host", "max"):
        flags = [f for f in fixed.get("flags", "").split(";") if f and f != "-pdpe1gb"]
        if "+pdpe1gb" not in flags:
            flags.append("+pdpe1gb")  # OVMF caps the width at 40 without 1 GiB pages (CPUConfig.pm warns)
        fixed["flags"] = ";".join(flags)
    value = format_cpu_option(fixed)
    return {"cpu": value}, [], [why + f": cpu {options.get('cpu') or 'kvm64'} -> {value} "
                                      f"(a {_gib(1 << (needed_bits - 3))} window)"]


@dataclass
class VmPlan:
    vmid: int
    set_options: dict[str, str]   # {"hostpci0": "mapping=...,pcie=1", "machine": "q35"}
    delete: list[str]             # ["hostpci3"]
    problems: list[str]
    notes: list[str]
    per_node_kept: bool = False   # a running pooled VM keeps its per-node mappings until stopped

    @property
    def changed(self) -> bool:
        return bool(self.set_options or self.delete)


def plan_vm(vmid: int, node: str, gpus: list[str], want_machine: str, allow_machine_change: bool,
            config: dict | None, pci_devices: dict[str, dict], managed_bdfs: set[str],
            host_phys_bits: int | None = None, pool: str | None = None, running: bool = False,
            pools: AbstractSet[str] = frozenset()) -> VmPlan:
    """hostpci lines for exactly the VM's GPUs (`QemuConfigs` entry as `config`).

    Ours: hostpci entries whose mapping id is a pvegpu id, the VM's `pool` or one of pvegpu's GPU
    pools (`pools`, see `gpu_pool_ids`), or whose raw host BDFs are GPUs the spec manages
    (`managed_bdfs`); other passthrough devices keep their index.
    pcie=1 needs q35: a VM on i440fx is reported, and switched only with `allow_machine_change`.
    With a `pool`, each GPU's line is `mapping=<pool>` (qemu-server takes a free device of the
    mapping's entries for this node at start); a `running` VM whose lines are exactly its GPUs'
    per-node mappings keeps them (a config change of a running VM would need a restart) and
    moves to the pool once it is stopped (`per_node_kept`).
    """
    if config is None:
        return VmPlan(vmid, {}, [], [f"VM {vmid} does not exist on this node; create it, then re-run"], [])
    problems, notes = [], []
    set_options: dict[str, str] = {}
    machine = config["options"].get("machine")
    q35 = _is_q35(machine)
    if want_machine == "q35" and not q35 and gpus:
        if allow_machine_change:
            set_options["machine"] = "q35"
            q35 = True
            notes.append(f"VM {vmid}: machine {machine or 'i440fx (default)'} -> q35 for PCIe passthrough")
        else:
            problems.append(f"VM {vmid} runs machine {machine or 'i440fx (default)'}; PCIe passthrough "
                            f"(pcie=1) needs q35: set vms.{vmid}.allow_machine_change: true to switch it, "
                            f"or machine: i440fx to pass the GPUs as plain PCI")
    ours = {}
    for key, entry in config.get("hostpci", {}).items():
        mapping = entry.get("mapping") or ""
        is_ours = mapping.startswith("pvegpu-") or mapping == pool or (mapping and mapping in pools) or any(
            h.rsplit(".", 1)[0] in {b.rsplit(".", 1)[0] for b in managed_bdfs} for h in entry.get("host", []))
        if is_ours:
            ours[key] = entry
    per_node_kept = bool(pool and running and gpus) and \
        sorted(e.get("mapping") or "" for e in ours.values()) == sorted(mapping_id(node, b) for b in gpus)
    if per_node_kept:
        notes.append(f"VM {vmid} runs: its GPUs move to pool {pool} once it is stopped (pvegpu does not change "
                     "the config of a running VM for that); until then it keeps its per-node mappings")
    taken = {int(k[len("hostpci"):]) for k in config.get("hostpci", {}) if k not in ours}
    free = (i for i in range(10_000) if i not in taken)
    wanted: dict[str, str] = {}
    for bdf in sorted(gpus):
        index = next(free)
        if index >= MAX_HOSTPCI_DEVICES:  # qemu-server knows hostpci0..hostpci15 only
            problems.append(f"VM {vmid}: no free hostpci line for GPU {bdf}: hostpci0-hostpci"
                            f"{MAX_HOSTPCI_DEVICES - 1} are taken by other passthrough devices; free one")
            continue
        target = pool if pool and not per_node_kept else mapping_id(node, bdf)
        # follows qemu-server src/PVE/QemuServer/PCI.pm $hostpci_fmt (8.4.10 on stable-bookworm, 9.2.6 on
        # master): `mapping` (a pve-configid) in place of the default key `host`, `pcie` only on
        # q35; 9.1's `driver` defaults to vfio, the binding pvegpu gives VM GPUs, so it is not written
        wanted[f"hostpci{index}"] = f"mapping={target}" + (",pcie=1" if q35 else "")
    for key, value in wanted.items():
        current = ours.get(key)
        want_opts = {"pcie": "1"} if q35 else {}
        if current is None or current.get("host") or current.get("mapping") != value.split(",")[0][len("mapping="):] \
                or current.get("options", {}) != want_opts:
            set_options[key] = value
    delete = sorted(k for k in ours if k not in wanted)
    if gpus:
        fit_options, fit_problems, fit_notes = plan_bar_fit(vmid, gpus, config, pci_devices, host_phys_bits)
        if fit_problems or gpu_mmio64_need(gpus, pci_devices) > OVMF_CLASSIC_WINDOW and not q35:
            problems += fit_problems or [f"VM {vmid}: GPUs behind a BAR window of "
                                         f"{_gib(gpu_mmio64_need(gpus, pci_devices))} need machine q35 with pcie=1"]
        set_options.update(fit_options)
        notes += fit_notes
    return VmPlan(vmid, set_options, delete, problems, notes, per_node_kept)


def plan_pool_mappings(node: str, pools: dict[str, list[str]], pci_devices: dict[str, dict],
                       existing: dict[str, dict]) -> list[MappingChange]:
    """This node's entries of each GPU pool's mapping (`pools`: ``{"rtx6000": [bdf, ...]}``,
    the GPUs of this node's VMs of that pool): one entry per GPU, every other node's entries
    left to that node (a merge, `MappingChange`)."""
    changes = []
    for pool, bdfs in sorted(pools.items()):
        wanted = [render_mapping_entry(node, b, pci_devices) for b in sorted(set(bdfs))]
        current = existing.get(pool)
        mine = [m for m in (current or {}).get("map", []) if m.get("node") == node]
        key = lambda m: sorted(m.items())  # noqa: E731 — the order of entries is not the pool's business
        if current is not None and sorted(mine, key=key) == sorted(wanted, key=key):
            continue
        reason = (f"GPU pool {pool} has no mapping yet" if current is None else
                  f"GPU pool {pool}: this node's entries ({len(mine)}) are not its GPUs ({len(wanted)}) as they are now")
        changes.append(MappingChange(pool, "merge", wanted, reason, node, POOL_DESCRIPTION))
    return changes


def gpu_pool_ids(existing: dict[str, dict], spec_pools: AbstractSet[str]) -> set[str]:
    """The GPU pools' mapping ids: the spec's and every one pvegpu created (`POOL_DESCRIPTION`)."""
    return set(spec_pools) | {mid for mid, m in existing.items() if m.get("description") == POOL_DESCRIPTION}


def plan_stale_pools(node: str, pools: AbstractSet[str], existing: dict[str, dict]) -> list[MappingChange]:
    """GPU pools pvegpu created (`POOL_DESCRIPTION`) that no VM of this node's spec names any more
    but that still have entries of this node: those entries are taken out (a merge with none),
    so Proxmox no longer hands this node's GPUs to the pool's VMs; other nodes' entries stay."""
    return [MappingChange(mid, "merge", [], f"GPU pool {mid} is not in this node's spec any more: "
                                            f"taking out {node}'s entries", node)
            for mid, mapping in sorted(existing.items())
            if mapping.get("description") == POOL_DESCRIPTION and mid not in pools
            and any(m.get("node") == node for m in mapping.get("map", []))]


def vm_mappings_after(config: dict, plan: VmPlan) -> set[str]:
    """Mapping ids a VM's main section references once `plan` is applied (`QemuConfigs` entry)."""
    entries = {k: e.get("mapping") for k, e in config.get("hostpci", {}).items()}
    for key in plan.delete:
        entries.pop(key, None)
    for key, value in plan.set_options.items():
        if key.startswith("hostpci"):
            m = re.match(r"^mapping=([^,]+)", value)
            entries[key] = m.group(1) if m else None
    return {m for m in entries.values() if m}


def mapping_references(found: dict, node: str, planned_main: dict[int, set[str]]) -> dict[str, list[str]]:
    """{mapping id: ["VM 300 on kpro6", ...]} from `VmMappingReferences` (``{(node, vmid):
    {"main": [ids], "sections": [ids]}}``); for this node's VMs in `planned_main` their main
    section as this run leaves it. Snapshot/pending references always count."""
    refs: dict[str, list[str]] = {}
    for (where, vmid), found_ids in sorted(found.items()):
        main = planned_main[vmid] if where == node and vmid in planned_main else set(found_ids["main"])
        for mid in sorted(main):
            refs.setdefault(mid, []).append(f"VM {vmid} on {where}")
        for mid in sorted(set(found_ids["sections"])):
            refs.setdefault(mid, []).append(f"a snapshot or pending change of VM {vmid} on {where}")
    return refs


@dataclass
class StaleMappings:
    """`delete`: pvegpu mappings to delete; `notes`: sentences about mappings left alone."""

    delete: list[MappingChange]
    notes: list[str]


def _slot_paths(entry: dict[str, str]) -> set[str]:
    return {p.rsplit(".", 1)[0] if p.count(".") else p for p in entry.get("path", "").split(";") if p}


def plan_stale_mappings(node: str, existing: dict[str, dict], vm_gpus: list[str],
                        references: dict[str, list[str]], managed_bdfs: set[str],
                        candidates_only: bool = False, pools: AbstractSet[str] = frozenset()) -> StaleMappings:
    """Which of this node's `pvegpu-*` mappings (`PciMappings` shape) nothing uses any more.

    A candidate: id starts with `pvegpu-`, every map entry is for this node (a mapping with no
    entry: its id names this node), and no GPU in `vm_gpus` maps to it. It is deleted unless a
    VM config references it (`references`, see `mapping_references`). Mappings with other
    names are never deleted; one whose entry for this node passes a GPU of the spec
    (`managed_bdfs`) is reported. `candidates_only`: skip the reference check (to decide
    whether the VM configs need reading at all).
    """
    wanted = {mapping_id(node, b) for b in vm_gpus}
    own_prefix = mapping_id(node, "")
    delete, notes = [], []
    managed_slots = {b.rsplit(".", 1)[0]: b for b in sorted(managed_bdfs)}
    for mid, mapping in sorted(existing.items()):
        entries = mapping.get("map", [])
        if mid in pools or mapping.get("description") == POOL_DESCRIPTION:  # pools: plan_(stale_)pool(s|_mappings)
            continue
        if not mid.startswith("pvegpu-"):
            for entry in entries:
                hit = sorted(managed_slots[s] for s in _slot_paths(entry) if s in managed_slots)
                if entry.get("node") == node and hit:
                    notes.append(f"PCI mapping {mid} (not created by pvegpu) points at GPU(s) {', '.join(hit)} of "
                                 f"the spec; pvegpu leaves it as it is (VMs in the spec use pvegpu-* mappings)")
            continue
        if mid in wanted:
            continue
        ours = all(e.get("node") == node for e in entries) if entries else mid.startswith(own_prefix + "-")
        if not ours:
            if any(e.get("node") == node for e in entries):
                others = sorted({e.get("node") or "?" for e in entries if e.get("node") != node})
                notes.append(f"PCI mapping {mid} is no longer used on {node} but also has entries for "
                             f"{', '.join(others)}; left as it is")
            continue
        users = references.get(mid, [])
        if users and not candidates_only:
            notes.append(f"PCI mapping {mid} is not used by a VM of the spec but is referenced by "
                         f"{'; '.join(users)}; kept (remove that reference, then re-run)")
            continue
        delete.append(MappingChange(mid, "delete", [], f"PCI mapping {mid} is stale (no VM of the spec uses it, "
                                                       f"no VM config references it): deleting it"))
    return StaleMappings(delete, notes)
