"""Which kernel driver each PCI function should have, which GPUs move, which guests a move
touches (pure: spec + facts in, decisions out).

Binding is per PCI address (identical GPUs cannot be split by vendor:device id). A VM GPU
takes its whole IOMMU group to vfio-pci (companion audio and any other endpoint; PCI bridges
stay with the host) — and is refused when that group holds a device given elsewhere or one the
host needs (storage, network, USB, host bridges). GPUs for `lxc`/`host` go to nvidia; their
companion functions keep whatever driver they have (no rule is written for them).

Data shapes used below (facts, see facts/*.py):
    pci      PciDevices   {bdf: {"vendor", "device", "class", "driver", "iommu_group", ...}}
    nvidia   NvidiaGpus   {bdf: {"minor": 0, ...}}
    lxc/qemu LxcConfigs/QemuConfigs, mappings PciMappings
    status   {"lxc": {200: "running"}, "qemu": {300: "stopped"}}   (`pct list` / `qm list`)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spec.models import HostSpec

# Class-code prefixes of devices a host cannot give away with a VM's GPU group.
HOST_CRITICAL_CLASSES = {
    "01": "storage controller", "02": "network controller", "0600": "host bridge",
    "0601": "ISA bridge", "0c03": "USB controller", "0c05": "SMBus controller",
}
PCI_BRIDGE_CLASS = "0604"


def _critical(device: dict) -> str | None:
    cls = device.get("class") or ""
    for prefix, what in HOST_CRITICAL_CLASSES.items():
        if cls.startswith(prefix):
            return what
    return None


def _slot(bdf: str) -> str:
    return bdf.rsplit(".", 1)[0]


def _group_members(pci: dict[str, dict], group: int) -> list[str]:
    return sorted(b for b, d in pci.items() if d.get("iommu_group") == group)


@dataclass
class Bindings:
    """`drivers`: {bdf: "vfio-pci" | "nvidia" | None (leave unbound)} for every function pvegpu
    binds (GPUs and the IOMMU-group companions of VM GPUs); `refusals`: sentences."""

    drivers: dict[str, str | None]
    refusals: list[str] = field(default_factory=list)
    companions: dict[str, str] = field(default_factory=dict)  # companion bdf -> its GPU


def desired_bindings(spec: HostSpec, pci: dict[str, dict]) -> Bindings:
    """The driver each function should have, from the GPUs' roles (GpuSpec.driver)."""
    drivers: dict[str, str | None] = {}
    refusals: list[str] = []
    companions: dict[str, str] = {}
    for bdf, gpu in sorted(spec.gpus.items()):
        if bdf not in pci:
            refusals.append(f"GPU {bdf} (role {gpu.role}) is not on this host's PCI bus; fix the address in the spec")
            continue
        drivers[bdf] = gpu.driver
    for bdf, gpu in sorted(spec.gpus.items()):
        if gpu.vmid is None or bdf not in pci:
            continue
        group = pci[bdf].get("iommu_group")
        if group is None:
            refusals.append(f"GPU {bdf} is for VM {gpu.vmid} but has no IOMMU group: the IOMMU is off; "
                            f"passthrough needs it on (boot stage: amd_iommu=on/intel_iommu=on, then reboot)")
            continue
        for other in _group_members(pci, group):
            if other == bdf or (pci[other].get("class") or "").startswith(PCI_BRIDGE_CLASS):
                continue
            other_gpu = spec.gpus.get(other)
            if other_gpu is not None:
                if other_gpu.role != gpu.role:
                    refusals.append(f"GPU {bdf} is for VM {gpu.vmid}, but its IOMMU group {group} also holds GPU "
                                    f"{other} with role {other_gpu.role}; a group goes to one VM as a whole "
                                    f"(give both the same role, or split the group with ACS)")
                continue
            what = _critical(pci[other])
            if what:
                refusals.append(f"GPU {bdf} is for VM {gpu.vmid}, but its IOMMU group {group} also holds {other}, "
                                f"a {what} the host needs; passing the group would take it from the host")
                continue
            drivers[other] = "vfio-pci"
            companions[other] = bdf
    return Bindings(drivers, refusals, companions)


@dataclass(frozen=True)
class Move:
    bdf: str
    current: str | None
    wanted: str | None

    def __str__(self) -> str:
        return f"{self.bdf}: {self.current or 'unbound'} -> {self.wanted or 'unbound'}"


def moves(bindings: Bindings, pci: dict[str, dict]) -> list[Move]:
    """Functions whose bound driver (now) differs from the wanted one, in BDF order."""
    return [Move(b, pci.get(b, {}).get("driver"), d) for b, d in sorted(bindings.drivers.items())
            if pci.get(b, {}).get("driver") != d]


def boot_minors(bindings: Bindings, pci: dict[str, dict]) -> dict[str, int]:
    """The Device Minors the nvidia driver will give after a boot with these bindings.

    At boot the driver probes GPUs in PCI bus order, so the nvidia-bound GPUs get 0, 1, ...
    in BDF order (the twin's hardware follows the same rule). Used only while a rebind waits
    for a reboot; otherwise the minors come from `NvidiaGpus`.
    """
    gpus = sorted(b for b, d in bindings.drivers.items()
                  if d == "nvidia" and (pci.get(b, {}).get("class") or "").startswith("03"))
    return {b: i for i, b in enumerate(gpus)}


def _config_nodes(config: dict) -> set[str]:
    nodes = {d.get("path", "") for d in config.get("devices", {}).values()}
    for key, value in config.get("lxc", []):
        if key == "lxc.mount.entry" and value.split():
            nodes.add(value.split()[0])
    return nodes


def _vm_hosts(config: dict, node: str, mappings: dict[str, dict]) -> set[str]:
    """Slots (`0000:81:00`) a VM's hostpci lines pass, raw or through a mapping."""
    slots = set()
    for entry in config.get("hostpci", {}).values():
        for h in entry.get("host", []):
            slots.add(h if h.count(".") == 0 else _slot(h))
        mapping = mappings.get(entry.get("mapping") or "")
        for m in (mapping or {}).get("map", []):
            if m.get("node") == node and m.get("path"):
                for p in m["path"].split(";"):
                    slots.add(p if "." not in p else _slot(p))
    return slots


@dataclass
class RebindPlan:
    """The rebind transaction for one host.

    `moves`: what changes driver; `stop`: running guests that use a moving GPU now and must be
    stopped first (`[("lxc", 200), ("qemu", 300)]`); `blocked`: guests that would need stopping
    while the spec forbids it; `live`: True to rebind now through sysfs, False to apply the
    persisted rules at the next boot.
    """

    moves: list[Move]
    stop: list[tuple[str, int]]
    blocked: list[tuple[str, int]]
    live: bool

    def dry_lines(self) -> list[str]:
        if not self.moves:
            return ["GPU binding: no GPU changes driver"]
        how = "now (runtime rebind)" if self.live else "at the next boot (this host cannot rebind live)"
        lines = [f"GPU binding: {len(self.moves)} function(s) would move {how}:"]
        lines += [f"  {m}" for m in self.moves]
        if self.stop:
            lines.append("guests that would be stopped for it: " + ", ".join(f"{'CT' if k == 'lxc' else 'VM'} {i}" for k, i in self.stop))
        else:
            lines.append("guests that would be stopped for it: none")
        return lines


def plan_rebind(spec: HostSpec, node: str, bindings: Bindings, pci: dict[str, dict], nvidia: dict[str, dict],
                lxc: dict[int, dict], qemu: dict[int, dict], mappings: dict[str, dict],
                status: dict[str, dict[int, str]], live: bool) -> RebindPlan:
    """Which running guests hold a GPU that is about to leave its driver.

    A CT uses a GPU when its config passes `/dev/nvidia<minor>` of it; a VM when a hostpci
    line passes its slot (raw or through a mapping). Guests only gaining a GPU keep running
    here; the guests stage restarts them after their config changed.
    """
    mv = moves(bindings, pci)
    leaving = {m.bdf for m in mv}
    leaving_nodes = {f"/dev/nvidia{nvidia[b]['minor']}" for b in leaving
                     if b in nvidia and nvidia[b].get("minor") is not None}
    leaving_slots = {_slot(b) for b in leaving}
    users: list[tuple[str, int]] = []
    if live:
        for ctid, config in sorted(lxc.items()):
            if _config_nodes(config) & leaving_nodes:
                users.append(("lxc", ctid))
        for vmid, config in sorted(qemu.items()):
            if _vm_hosts(config, node, mappings) & leaving_slots:
                users.append(("qemu", vmid))
    running = [(k, i) for k, i in users if status.get(k, {}).get(i) == "running"]
    if spec.guests.allow_stop:
        return RebindPlan(mv, running, [], live)
    return RebindPlan(mv, [], running, live)


def holders_of(bdfs: list[str], nvidia: dict[str, dict], compute_apps: dict[str, list[str]],
               fuser: dict[str, list[str]]) -> dict[str, list[str]]:
    """{bdf: [holders]} for the given GPUs, from both sources, without duplicates."""
    result: dict[str, list[str]] = {}
    for bdf in bdfs:
        found = list(compute_apps.get(bdf, []))
        minor = nvidia.get(bdf, {}).get("minor")
        if minor is not None:
            found += fuser.get(f"/dev/nvidia{minor}", [])
        if found:
            result[bdf] = list(dict.fromkeys(found))
    return result


def identity_domain_refusals(pci: dict[str, dict], iommu: dict, sev_snp: dict | None) -> list[str]:
    """Incident 9: on a SEV-SNP host, a Blackwell GPU in an identity-mapped IOMMU domain fails its
    FSP boot (error 0x177). pvegpu never sets a group's type; one switched by hand is refused here,
    before any change, with how to undo it.

    + pci: `PciDevices`; iommu: `IommuState` (``groups``: {group: domain type}); sev_snp: `SevSnp`
    """
    from plan.nvidia import is_blackwell, nvidia_gpu_ids

    if not (sev_snp or {}).get("enabled"):
        return []
    types = (iommu or {}).get("groups") or {}
    refusals = []
    for bdf, device_id in nvidia_gpu_ids(pci).items():
        group = pci[bdf].get("iommu_group")
        if group is None or (types.get(int(group)) or "").lower() != "identity" or not is_blackwell(device_id):
            continue
        refusals.append(
            f"GPU {bdf} (Blackwell) is in IOMMU group {group} with an identity domain on a SEV-SNP host: its "
            "FSP boot fails there (error 0x177, incident 9). Set the group back to a translated domain "
            f"(echo DMA-FQ > /sys/kernel/iommu_groups/{group}/type while unbound, or drop whatever set it, "
            "e.g. iommu=pt) and re-run")
    return refusals
