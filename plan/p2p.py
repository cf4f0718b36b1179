"""P2P verdict for every GPU pair: possible or not, safe or not, and why, in words.

The verdict weighs together what the facts say (no I/O here; callers pass the facts' data):

- the driver's own answer (`GpuP2P` read/write: ``OK``, ``CNS``, ``GNS``, ``TNS``, ``NS``, ``DR``, ``U``),
- the topology level (`GpuTopology` links: ``NV#``, ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``;
  derived from the PCI tree when the driver does not see a GPU),
- root complexes and upstream bridges (`PciDevices`), ACS control of every port on the path
  (`PciAcs`, read from each bridge's PCIe extended config space),
- the IOMMU domain type of each GPU's group and SEV-SNP,
- each GPU's role (a GPU passed to a VM is not the host's to use for P2P).

The level alone decides nothing: EPYC often routes P2P between root complexes of one socket
(the driver then answers ``OK``), a VM's virtual root ports do not, and ``OK`` through a
translating IOMMU under SEV-SNP still corrupted data (INCIDENTS.md rows 7, 8, 9).
"""

from __future__ import annotations

from itertools import combinations

from facts.nvidia import parse_registry_dwords

# What nvidia-smi's P2P status codes mean (its own legend).
P2P_STATUS_WORDS = {
    "OK": "OK",
    "CNS": "chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "topology not supported",
    "NS": "not supported",
    "DR": "disabled by regkey",
    "U": "unknown",
}

# nvidia-smi topology levels in words (its own legend, shortened).
# Older drivers print SOC for what newer ones call SYS (same legend text); `normal_level` maps it.
LEVEL_ALIASES = {"SOC": "SYS"}
LEVEL_WORDS = {
    "PIX": "through at most one PCIe bridge (one switch)",
    "PXB": "through several PCIe bridges, not through the host bridge",
    "PHB": "through a PCIe host bridge (the CPU)",
    "NODE": "across PCIe host bridges within one NUMA node",
    "SYS": "across the CPU interconnect between NUMA nodes",
}

# QEMU's PCIe root port (vendor 1b36 = Red Hat/QEMU): seen inside a VM, never on bare metal.
VIRTUAL_ROOT_PORT_IDS = {("1b36", "000c")}

# ACS control flags that send peer traffic up to the root complex instead of straight to the peer:
# P2P Request Redirect, P2P Completion Redirect and P2P Egress Control, exactly what the kernel's
# drivers/pci/p2pdma.c pci_bridge_has_acs_redir() tests (PCI_ACS_RR | PCI_ACS_CR | PCI_ACS_EC) on
# every bridge from each device up to their common upstream bridge (__upstream_bridge_distance()).
# Source Validation (PCI_ACS_SV) only checks a request's bus number against the port's bus range
# and Upstream Forwarding (PCI_ACS_UF) only sends up what would go back out the port it came in
# on: neither redirects peer traffic between two ports, and alone they leave P2P direct (issue 43:
# 8 RTX PRO 6000 behind two PEX890xx switches with SrcValid+ UpstreamFwd+ did P2P on all 28 pairs).
ACS_REDIRECT_FLAGS = ("ReqRedir", "CmpltRedir", "EgressCtrl")
ACS_CHECK_FLAGS = ("SrcValid", "UpstreamFwd")
ACS_FLAG_WORDS = {
    "SrcValid": "Source Validation",
    "ReqRedir": "P2P Request Redirect",
    "CmpltRedir": "P2P Completion Redirect",
    "UpstreamFwd": "Upstream Forwarding",
    "EgressCtrl": "P2P Egress Control",
}

# Consumer GPUs (nvidia-smi's model name): NVIDIA's own driver refuses them PCIe P2P (GNS/NS); a
# driver that answers OK for them is a P2P-patched open driver (tinygrad's, aikitoria's), whose
# peer path writes straight into the peer's BAR1 and needs the whole VRAM mapped there: the RM
# registry keys RMForceStaticBar1=1 (src/nvidia/interface/nvrm_registry.h: 1 = ENABLE, 2 = AUTO maps
# it only where BAR1 is large enough) and PeerMappingOverride=1 (kernel_bif.c; osmemdesc.c refuses
# peer mappings of IO memory to non-root processes without it). Without them the driver still
# answers OK and NCCL hung in ncclCommInitRank (club-3090 issue 873, issue 43 item 8).
CONSUMER_MODEL_WORDS = ("geforce", "titan")
STATIC_BAR1_KEYS = {"RMForceStaticBar1": 1, "PeerMappingOverride": 1}

# IOMMU group types in /sys/kernel/iommu_groups/*/type, mapped to what they mean for P2P DMA.
IOMMU_DOMAIN_KINDS = {
    "DMA": "translated",
    "DMA-FQ": "translated",
    "identity": "identity",
    "unmanaged": "vfio",  # owned by VFIO (a VM); the guest's mappings translate
    "blocked": "blocked",
}

CUDA_IOMMU_REFERENCE = (
    "https://docs.nvidia.com/cuda/cuda-programming-guide/03-advanced/multi-gpu-systems.html"
    "#host-iommu-hardware-pci-access-control-services-and-vms"
)


def normal_level(level: str | None) -> str | None:
    """A topology cell with the legacy ``SOC`` read as ``SYS`` (nvidia-smi's older name for it)."""
    if not level:
        return level
    return LEVEL_ALIASES.get(level, level)


def _nvidia_gpu(device: dict) -> bool:
    """An NVIDIA display/3D controller (class 03xxxx), i.e. a GPU and not its audio function."""
    return (device.get("vendor") or "").lower() == "10de" and (device.get("class") or "").startswith("03")


def _upstream_bridges(device: dict) -> list[str]:
    """The device's upstream bridges, root port first (PciDevices ``bridges``)."""
    return list(device.get("bridges") or [])


def iommu_domain_kind(iommu: dict | None, group) -> str | None:
    """What a GPU's IOMMU group does to its DMA: translated, identity, vfio, blocked, off, or None.

    + iommu: the IommuState fact, ``{"enabled": True, "groups": {12: "DMA-FQ", …}, …}``
    + group: the device's ``iommu_group`` from PciDevices (``None`` when the IOMMU is off)
    """
    if iommu is None:
        return None
    if group is None:
        return "off"
    groups = iommu.get("groups") or {}
    kind = groups.get(group, groups.get(str(group)))
    return IOMMU_DOMAIN_KINDS.get(kind) if kind else None


def sev_snp_enabled(sev: dict | bool | None) -> bool | None:
    """SEV-SNP on (True), off (False) or unknown (None), from the SevSnp fact
    (``{"snp": True, "enabled": True, …}``; ``snp`` is None when the CPU has the flag but kvm_amd
    does not say)."""
    if sev is None or isinstance(sev, bool):
        return sev
    if "snp" in sev:
        return None if sev["snp"] is None else bool(sev["snp"])
    return None if sev.get("enabled") is None else bool(sev["enabled"])


def acs_redirect_flags(entry: dict | None, flags: tuple[str, ...] = ACS_REDIRECT_FLAGS) -> list[str] | None:
    """ACS control flags of one port that redirect peer requests (`ACS_REDIRECT_FLAGS`; or those
    of `flags`).

    + entry: the PciAcs fact's value for the bridge,
      ``{"status": "enabled", "redirect": True, "ctl": {"ReqRedir": True, …}}``

    Returns the flags of `flags` that are on (``[]`` when none or no ACS capability), or ``None``
    when the state is unknown (no lspci, capabilities unreadable, bridge not listed).
    """
    if not entry or entry.get("status") == "unknown":
        return None
    ctl = entry.get("ctl") or {}
    return [flag for flag in flags if ctl.get(flag)]


def gpu_inventory(
    *,
    pci: dict | None = None,
    nvidia_gpus: dict | None = None,
    topology: dict | None = None,
    roles: dict | None = None,
) -> list[dict]:
    """Every GPU the facts know of, in PCI order, with the driver's name for it when it has one.

    Returns ``[{"bdf": "0000:01:00.0" | None, "name": "GPU0" | None, "model", "driver", "role",
    "root", "bridges", "numa_node", "iommu_group", "visible"}]``. ``name`` is nvidia-smi's
    (it numbers the GPUs bound to the nvidia driver in PCI bus order); ``visible`` says whether the
    host's NVIDIA driver drives the GPU. Without PCI facts, the GPUs of the topology matrix.
    """
    pci = pci or {}
    nvidia_gpus = nvidia_gpus or {}
    roles = roles or {}
    topo_names = [d for d in (topology or {}).get("devices", []) if d.startswith("GPU")]
    bdfs = sorted({bdf for bdf, dev in pci.items() if _nvidia_gpu(dev)} | set(nvidia_gpus))
    if not bdfs:
        return [
            {"bdf": None, "name": name, "model": None, "driver": "nvidia", "role": None,
             "root": None, "bridges": [], "numa_node": None, "iommu_group": None, "visible": True}
            for name in topo_names
        ]
    visible = [
        bdf for bdf in bdfs
        if bdf in nvidia_gpus or (pci.get(bdf, {}).get("driver") == "nvidia")
    ]
    # nvidia-smi numbers the GPUs it sees in PCI bus order; trust that only when the counts agree.
    names = {}
    if not topo_names or len(topo_names) == len(visible):
        names = {bdf: f"GPU{index}" for index, bdf in enumerate(visible)}
    gpus = []
    for bdf in bdfs:
        dev = pci.get(bdf, {})
        gpus.append({
            "bdf": bdf,
            "name": names.get(bdf),
            "model": nvidia_gpus.get(bdf, {}).get("model"),
            "driver": dev.get("driver", "nvidia" if bdf in nvidia_gpus else None),
            "role": roles.get(bdf),
            "root": dev.get("root"),
            "bridges": _upstream_bridges(dev),
            "numa_node": dev.get("numa_node"),
            "iommu_group": dev.get("iommu_group"),
            "visible": bdf in visible,
        })
    return gpus


def _label(gpu: dict) -> str:
    if gpu["name"] and gpu["bdf"]:
        return f"{gpu['name']} ({gpu['bdf']})"
    return gpu["name"] or gpu["bdf"]


def derived_level(a: dict, b: dict) -> str | None:
    """nvidia-smi's level for two GPUs, derived from their PCI paths (for GPUs the driver does not see)."""
    if not a["root"] or not b["root"]:
        return None
    if a["root"] != b["root"]:
        if a["numa_node"] is not None and a["numa_node"] == b["numa_node"]:
            return "NODE"
        return "SYS"
    common = 0
    for x, y in zip(a["bridges"], b["bridges"], strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return "PHB"
    if len(a["bridges"]) - common <= 1 and len(b["bridges"]) - common <= 1:
        return "PIX"
    return "PXB"


def path_ports(a: dict, b: dict) -> list[str]:
    """Every port peer traffic between a and b passes, in order: a's upstream bridges from a up to
    the deepest bridge both share (that one included), then b's below it, back down to b. With no
    shared bridge (different root ports or root complexes) each side's whole chain, root ports
    included: the traffic climbs to the root complex on both sides. Follows the walk of the
    kernel's drivers/pci/p2pdma.c __upstream_bridge_distance(), which counts ACS redirect on the
    common bridge too."""
    common = 0
    for x, y in zip(a["bridges"], b["bridges"], strict=False):
        if x != y or a["root"] != b["root"]:
            break
        common += 1
    ports = list(reversed(a["bridges"][common:]))
    if common:
        ports.append(a["bridges"][common - 1])
    return ports + list(b["bridges"][common:])


def _driver_answer(matrix: dict | None, a: dict, b: dict) -> str | None:
    if not matrix or not a["name"] or not b["name"]:
        return None
    return (matrix.get(a["name"]) or {}).get(b["name"])


def _role_reason(gpu: dict) -> str | None:
    role = gpu["role"] or ""
    label = _label(gpu)
    if role.startswith("vm:") or gpu["driver"] == "vfio-pci":
        vm = f" to VM {role[3:]}" if role.startswith("vm:") else ""
        return f"{label} is passed through{vm} (vfio-pci): the host's driver does not see it, so no host P2P with it"
    if role == "unused":
        return f"{label} is marked unused in the spec"
    if not gpu["visible"]:
        driver = gpu["driver"] or "no driver"
        return f"{label} is not driven by the host's NVIDIA driver ({driver}), so no host P2P with it"
    return None


def consumer_gpu(gpu: dict) -> bool:
    """A GeForce/TITAN card by the driver's model name (`CONSUMER_MODEL_WORDS`)."""
    model = (gpu.get("model") or "").lower()
    return any(word in model for word in CONSUMER_MODEL_WORDS)


def static_bar1_missing(registry: dict | None, bdf: str | None) -> list[str] | None:
    """The `STATIC_BAR1_KEYS` the loaded driver was not given for this GPU (its
    RegistryDwordsPerDevice entry, else RegistryDwords), as ``name=value`` texts; ``None`` when
    /proc/driver/nvidia/params was not read (`facts.nvidia.parse_registry_dwords`)."""
    if registry is None:
        return None
    keys = {**registry.get("global", {}), **registry.get("per_device", {}).get(bdf or "", {})}
    return [f"{name}={value}" for name, value in STATIC_BAR1_KEYS.items() if keys.get(name) != value]


def _static_bar1_reason(a: dict, b: dict, registry: dict | None) -> str | None:
    """Why a consumer pair the driver says OK for over PCIe is still unsafe, or None."""
    if not (consumer_gpu(a) and consumer_gpu(b)):
        return None
    missing = {_label(gpu): static_bar1_missing(registry, gpu["bdf"]) for gpu in (a, b)}
    if registry is not None and not any(missing.values()):
        return None
    if registry is None:
        lacks = "/proc/driver/nvidia/params was not read, so whether the driver maps all of VRAM into BAR1 is unknown"
    else:
        needed = sorted({key for keys in missing.values() for key in keys or []})
        lacks = (f"the loaded driver's RegistryDwords (/proc/driver/nvidia/params) lack {';'.join(needed)}, so it "
                 "does not map all of VRAM into BAR1 (static BAR1)")
    return (f"{_label(a)} and {_label(b)} are GeForce cards and the driver answers P2P OK over PCIe (a P2P-patched "
            f"driver: NVIDIA's own refuses it for them), but {lacks}: there the driver still answers OK while no "
            "byte reaches the peer and NCCL hung in its init. The OK is not proof; what decides is "
            "RMForceStaticBar1=1;PeerMappingOverride=1 in NVreg_RegistryDwords, a BAR1 as large as VRAM and a "
            "transfer checked on the receiving GPU")


def shared_clique(acs: dict | None, a: dict, b: dict) -> int | None:
    """The GPUDirect clique both GPUs carry in their config space (`PciAcs` ``clique``: QEMU's
    x-nv-gpudirect-clique inside a VM), None when they share none."""
    cliques = {((acs or {}).get(gpu["bdf"] or "") or {}).get("clique") for gpu in (a, b)}
    return cliques.pop() if len(cliques) == 1 else None


def _pair_verdict(a, b, *, topology, p2p_read, p2p_write, iommu, sev_snp, acs, pci, registry=None) -> dict:
    blocking: list[tuple[str, str]] = []  # (kind, sentence): make P2P impossible
    unsafe: list[tuple[str, str]] = []    # make it unsafe even where it happens
    unknown: list[tuple[str, str]] = []   # leave open whether it is possible
    notes: list[str] = []
    la, lb = _label(a), _label(b)

    level = None
    if a["name"] and b["name"]:
        level = normal_level(((topology or {}).get("links", {}).get(a["name"]) or {}).get(b["name"]))
    level_source = "driver" if level else None
    if not level:
        level = derived_level(a, b)
        level_source = "pci" if level else None

    for gpu in (a, b):
        reason = _role_reason(gpu)
        if reason:
            blocking.append(("role", reason))
    role_a, role_b = a["role"] or "", b["role"] or ""
    if role_a.startswith("vm:") and role_a == role_b:
        blocking.append((
            "virtual_root_port",
            f"{la} and {lb} both go to VM {role_a[3:]}, where each passthrough GPU sits on its own "
            "virtual root port: P2P between them is impossible there too",
        ))

    answers = {}
    for kind, matrix in (("read", p2p_read), ("write", p2p_write)):
        code = _driver_answer(matrix, a, b)
        answers[kind] = code
        if code and code != "OK":
            words = P2P_STATUS_WORDS.get(code, code)
            blocking.append(("driver", f"the driver reports P2P {kind} between {la} and {lb} as {code} ({words})"))
    driver_ok = answers["read"] == "OK" and answers["write"] in (None, "OK")

    nvlink = bool(level and level.startswith("NV"))
    domains = {gpu["bdf"]: iommu_domain_kind(iommu, gpu["iommu_group"]) for gpu in (a, b) if gpu["bdf"]}
    translating = [gpu for gpu in (a, b) if gpu["bdf"] and domains.get(gpu["bdf"]) == "translated"]
    snp = sev_snp_enabled(sev_snp)
    pci = pci or {}

    if nvlink and level:  # (nvlink implies a level; the check tells mypy)
        notes.append(f"{la} and {lb} are joined by {level[2:]} bonded NVLinks: P2P does not cross PCIe or the IOMMU")
    else:
        if a["root"] and b["root"] and a["root"] != b["root"]:
            if driver_ok and not translating:
                notes.append(
                    f"{la} and {lb} are on different root complexes ({a['root']}, {b['root']}); "
                    "the driver reports P2P through the CPU as OK"
                )
            elif answers["read"] is None:
                # No driver answer yet (no nvidia-smi, a first converge): whether the CPU routes
                # peer traffic between root complexes is the chipset's to say, and only the driver
                # knows (nvidia-smi topo -p2p r); the host check after the driver settles it.
                unknown.append((
                    "root_complex_unknown",
                    f"{la} and {lb} are on different root complexes ({a['root']}, {b['root']}); whether "
                    "the CPU routes P2P between them is unknown until the driver answers (nvidia-smi topo -p2p r)",
                ))
            else:
                blocking.append((
                    "root_complex",
                    f"{la} and {lb} are on different root complexes ({a['root']}, {b['root']}) with no P2P path",
                ))
        virtual_ports = [
            bdf for bdf in (a["bridges"][:1] + b["bridges"][:1])
            if (pci.get(bdf, {}).get("vendor"), pci.get(bdf, {}).get("device")) in VIRTUAL_ROOT_PORT_IDS
        ]
        if len(virtual_ports) == 2 and virtual_ports[0] != virtual_ports[1]:
            where = (f"{la} and {lb} sit behind separate virtual root ports of this VM "
                     f"({virtual_ports[0]}, {virtual_ports[1]})")
            clique = shared_clique(acs, a, b)
            refused = any(code and code != "OK" for code in answers.values())
            if not refused and (driver_ok or clique is not None):
                # open-gpu-kernel-modules p2p_caps.c: a hypervisor's clique (hypervisor.c
                # hypervisorPcieP2pDetection) answers OK before any check of the path
                warrant = (f"the hypervisor put both in GPUDirect clique {clique} (QEMU x-nv-gpudirect-clique), "
                           "which the driver takes as a warrant without checking the path, so "
                           if clique is not None else "")
                answer = "the driver answers P2P OK" if driver_ok else "the driver will answer P2P OK"
                unsafe.append((
                    "vm_clique",
                    f"{where}, yet {warrant}{answer}: through QEMU's virtual root ports NCCL then used P2P and "
                    "hung at its first collective (the writes never reached the peer GPU). The driver's OK is "
                    "a claim here, not a path",
                ))
            else:
                blocking.append(("virtual_root_port", f"{where}: P2P between them is impossible"))
        for port in path_ports(a, b) if acs is not None else []:
            flags = acs_redirect_flags(acs.get(port))
            kind = "root port" if port in (a["bridges"][:1] + b["bridges"][:1]) else "switch port"
            if flags:
                words = ", ".join(ACS_FLAG_WORDS[flag] for flag in flags)
                unsafe.append((
                    "acs",
                    f"ACS on {kind} {port} between {la} and {lb} has {words} on ({'+ '.join(flags)}+): peer "
                    "requests are sent up to the root complex instead of to the peer, where NCCL's P2P path "
                    "hung until ACS was cleared",
                ))
            elif flags is None:
                notes.append(f"ACS state of {kind} {port} is unknown")
            checks = acs_redirect_flags(acs.get(port), ACS_CHECK_FLAGS)
            if checks and not flags:
                words = " and ".join(ACS_FLAG_WORDS[flag] for flag in checks)
                notes.append(f"ACS on {kind} {port} has {words} on ({'+ '.join(checks)}+): "
                             "these do not redirect peer traffic (the kernel's p2pdma counts only "
                             "Request/Completion Redirect and Egress Control)")
        static_bar1 = _static_bar1_reason(a, b, registry) if driver_ok else None
        if static_bar1:
            unsafe.append(("static_bar1", static_bar1))
        if translating:
            which = " and ".join(f"{gpu['name'] or gpu['bdf']} (group {gpu['iommu_group']})" for gpu in translating)
            blocking.append((
                "iommu",
                f"the IOMMU translates DMA for {which}: CUDA does not support PCIe P2P through a "
                "translating IOMMU on bare-metal Linux",
            ))
        if translating and snp:
            unsafe.append((
                "sev_snp",
                "SEV-SNP is on and the IOMMU translates GPU DMA: P2P DMA through it corrupted data "
                "on such a host (NCCL hangs, wrong results)",
            ))
        identity = [gpu for gpu in (a, b) if gpu["bdf"] and domains.get(gpu["bdf"]) == "identity"]
        blackwell = [gpu for gpu in identity if "blackwell" in (gpu["model"] or "").lower()]
        if snp and blackwell:
            unsafe.append((
                "sev_snp_identity",
                f"{_label(blackwell[0])} is a Blackwell GPU in an identity IOMMU domain on a SEV-SNP host: "
                "such GPUs failed to boot (FSP error 0x177)",
            ))
        if iommu is None and (a["bdf"] or b["bdf"]):
            notes.append("the IOMMU mode is unknown")
        if snp is None and translating:
            notes.append("whether SEV-SNP is on is unknown")

    possible: bool | None = not blocking
    if possible and unknown:
        possible = None
    safe: bool | None = bool(possible) and not unsafe
    if possible is None:
        safe = False if unsafe else None
    status = ("impossible" if possible is False else "unsafe" if unsafe
              else "unknown" if possible is None else "usable")
    reasons = blocking + unsafe + unknown
    if not reasons and possible:
        how = LEVEL_WORDS.get(level or "", "over NVLink" if nvlink else "by an unknown path")
        reasons = [("path", f"{la} and {lb} connect {how}" + (" and the driver reports P2P OK" if driver_ok else ""))]
    return {
        "a": a["bdf"] or a["name"],
        "b": b["bdf"] or b["name"],
        "names": [a["name"], b["name"]],
        "possible": possible,
        "safe": safe,
        "status": status,
        "level": level,
        "level_source": level_source,
        "driver_read": answers["read"],
        "driver_write": answers["write"],
        "reasons": [sentence for _, sentence in reasons],
        "reason_kinds": [kind for kind, _ in reasons],
        "notes": notes,
    }


REASON_KIND_WORDS = {
    "role": "a GPU is not the host's (VM, unused, other driver)",
    "virtual_root_port": "separate virtual root ports in a VM",
    "driver": "the driver reports P2P unsupported",
    "root_complex": "different root complexes with no P2P path",
    "root_complex_unknown": "different root complexes, P2P unknown until the driver answers",
    "acs": "ACS redirect on a port of the path",
    "iommu": "the IOMMU translates GPU DMA",
    "sev_snp": "SEV-SNP with a translating IOMMU (P2P DMA corrupts data)",
    "sev_snp_identity": "identity IOMMU domain for Blackwell GPUs on a SEV-SNP host",
    "static_bar1": "GeForce P2P the driver says OK for without its static BAR1 mapping",
    "vm_clique": "P2P the driver claims in a VM across virtual root ports (GPUDirect clique)",
    "path": "a P2P path exists",
}


def summarize(pairs: list[dict]) -> str:
    """One paragraph: how many pairs can use P2P safely, and the reasons that decide it, counted."""
    if not pairs:
        return "Fewer than two GPUs: no GPU pairs, nothing to decide about P2P."
    usable = sum(1 for p in pairs if p["possible"] and p["safe"])
    possible = sum(1 for p in pairs if p["possible"])
    unknown = sum(1 for p in pairs if p["possible"] is None)
    counts: dict[str, int] = {}
    for pair in pairs:
        for kind in dict.fromkeys(pair["reason_kinds"]):
            counts[kind] = counts.get(kind, 0) + 1
    n = len(pairs)
    every = "the only GPU pair" if n == 1 else f"all {n} GPU pairs"
    if unknown == n:
        head = f"Whether P2P is possible is unknown for {every}."
    elif possible == 0 and unknown == 0:
        head = f"P2P is impossible for {every}."
    elif unknown:
        head = f"P2P is possible for {possible}, unknown for {unknown} and safe for {usable} of {n} GPU pairs."
    elif usable == n:
        head = f"P2P is possible and safe for {every}."
    else:
        head = f"P2P is possible for {possible} and safe for {usable} of {n} GPU pairs."
    details = "; ".join(
        f"{REASON_KIND_WORDS.get(kind, kind)}: {count} of {n}" for kind, count in counts.items()
    )
    return f"{head} Reasons: {details}."


def p2p_verdict(
    *,
    pci: dict | None = None,
    nvidia_gpus: dict | None = None,
    topology: dict | None = None,
    p2p_read: dict | None = None,
    p2p_write: dict | None = None,
    iommu: dict | None = None,
    sev_snp: dict | bool | None = None,
    acs: dict | None = None,
    roles: dict | None = None,
    nvidia_params: dict | None = None,
) -> dict:
    """The P2P verdict for every GPU pair, from the facts' plain data.

    + pci: PciDevices (per BDF: vendor, device, class, driver, numa_node, iommu_group, link, bars,
      bridges, root)
    + nvidia_gpus: NvidiaGpus (per BDF: model, minor, uuid, firmware)
    + topology: GpuTopology; p2p_read / p2p_write: GpuP2P with kind ``r`` / ``w``
    + iommu: IommuState (domain type per group); sev_snp: SevSnp (or a bool)
    + acs: PciAcs (ACS control per bridge BDF); roles: the spec's role per GPU BDF (``lxc``, ``vm:101``, …)
    + nvidia_params: NvidiaDriverParams (/proc/driver/nvidia/params: the RM registry keys the
      driver was loaded with; decides GeForce pairs, `_static_bar1_reason`)

    .. code:: python

        {"pairs": [{"a": "0000:01:00.0", "b": "0000:41:00.0", "names": ["GPU0", "GPU1"],
                    "possible": False, "safe": False, "level": "SYS", "level_source": "driver",
                    "driver_read": "OK", "driver_write": None,
                    "reasons": ["GPU0 (0000:01:00.0) and GPU1 (0000:41:00.0) are on different root
                                 complexes (pci0000:00, pci0000:40) with no P2P path", …],
                    "reason_kinds": ["root_complex", "iommu", "sev_snp"], "notes": []}],
         "gpus": [...gpu_inventory...], "sev_snp": True, "summary": "P2P is impossible for all 28 …"}
    """
    gpus = gpu_inventory(pci=pci, nvidia_gpus=nvidia_gpus, topology=topology, roles=roles)
    registry = parse_registry_dwords(nvidia_params)
    pairs = [
        _pair_verdict(a, b, topology=topology, p2p_read=p2p_read, p2p_write=p2p_write,
                      iommu=iommu, sev_snp=sev_snp, acs=acs, pci=pci, registry=registry)
        for a, b in combinations(gpus, 2)
    ]
    for gpu in gpus:
        gpu["iommu_domain"] = iommu_domain_kind(iommu, gpu["iommu_group"]) if gpu["bdf"] else None
    return {"pairs": pairs, "gpus": gpus, "sev_snp": sev_snp_enabled(sev_snp), "summary": summarize(pairs)}


def restrict_verdict(verdict: dict, gpus: list[str]) -> dict:
    """The verdict for a subset of GPUs (e.g. one container's), named by BDF or nvidia-smi name."""
    wanted = set(gpus)
    pairs = [p for p in verdict["pairs"] if {p["a"], p["b"]} <= wanted]
    kept = [g for g in verdict["gpus"] if (g["bdf"] or g["name"]) in wanted]
    return {**verdict, "pairs": pairs, "gpus": kept, "summary": summarize(pairs)}
