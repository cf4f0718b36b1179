"""A host's GPU topology for people: a text summary and a graphviz diagram (DOT source).

Pure functions over the HardwareProbe fact's data (``facts.hardware.HardwareProbe``, one remote
command) plus the P2P verdict; `topology.py` gathers the facts and writes the files.
"""

from __future__ import annotations

import html
import re
import textwrap

from plan.nccl import PRECEDENCE, describe_nccl_environment, opt_in_note
from plan.p2p import LEVEL_WORDS, p2p_verdict

NETWORK_CLASS_PREFIX = "02"  # PCI class 02xxxx: Ethernet, InfiniBand, … controllers


def verdict_from_hardware(hardware: dict, roles: dict | None = None) -> dict:
    """`plan.p2p.p2p_verdict` from a HardwareProbe result."""
    return p2p_verdict(
        pci=hardware.get("pci_devices"),
        nvidia_gpus=hardware.get("nvidia_gpus"),
        topology=hardware.get("topology"),
        p2p_read=hardware.get("p2p_read"),
        p2p_write=hardware.get("p2p_write"),
        iommu=hardware.get("iommu"),
        sev_snp=hardware.get("sev_snp"),
        acs=hardware.get("pci_acs"),
        roles=roles,
        nvidia_params=hardware.get("nvidia_params"),
    )


def link_speed(text: str | None) -> float | None:
    """``"32.0 GT/s PCIe"`` → 32.0 (None for "Unknown" or missing)."""
    match = re.match(r"^\s*([\d.]+)\s*GT/s", text or "")
    return float(match.group(1)) if match else None


def link_text(link: dict | None) -> str | None:
    """``32.0 GT/s x16 (max 32.0 GT/s x16)``, with what is below its maximum flagged."""
    link = link or {}
    speed, max_speed = link_speed(link.get("speed")), link_speed(link.get("max_speed"))
    width, max_width = link.get("width"), link.get("max_width")
    if speed is None and width is None:
        return None
    text = f"{speed or '?'} GT/s x{width or '?'} (max {max_speed or '?'} GT/s x{max_width or '?'})"
    if width and max_width and width < max_width:
        text += f" DOWNTRAINED: x{width} of x{max_width}"
    if speed and max_speed and speed < max_speed:
        text += " speed below max (GPUs lower it when idle; check under load)"
    return text


def bar1_size(bars: dict | None) -> int | None:
    """NVIDIA's BAR1 (the VRAM aperture), None when it is not assigned (incident 10).

    sysfs numbers BAR registers, and a 64-bit BAR0 takes two, so BAR1 sits at index 1 (32-bit
    BAR0) or 2 (64-bit BAR0, as on the H200: 16 MiB at 0, 256 GiB at 2, 32 MiB at 4); BAR3 is
    never there, so a missing BAR1 is not mistaken for BAR3.
    """
    bars = {int(index): size for index, size in (bars or {}).items()}
    return bars.get(1) or bars.get(2) or None


def human_bytes(size: int | None) -> str:
    if not size:
        return "none"
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            value = size / (1 << shift)
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{size} B"


def _gpu_label(gpu: dict) -> str:
    return gpu["name"] or gpu["bdf"]


def _network_devices(pci: dict) -> dict[str, dict]:
    return {bdf: dev for bdf, dev in pci.items() if (dev.get("class") or "").startswith(NETWORK_CLASS_PREFIX)}


def _numa_of_root(root: str, pci: dict) -> int | None:
    nodes = {dev.get("numa_node") for dev in pci.values() if dev.get("root") == root} - {None}
    return min(nodes) if nodes else None


def gpus_in_topology_order(gpus: list[dict], pci: dict) -> list[dict]:
    """The GPUs in the order the tree draws them: NUMA node, root complex, upstream bridges, address
    (a depth-first walk of sorted children is the sorted order of the full paths); GPUs without
    PCI facts keep their order, after the others."""
    def key(indexed):
        index, gpu = indexed
        dev = pci.get(gpu["bdf"] or "", {})
        if not gpu["bdf"] or not dev:
            return (1, index, (), ())
        numa = _numa_of_root(dev.get("root"), pci) if dev.get("root") else None
        return (0, (numa is None, numa if numa is not None else 0), dev.get("root") or "",
                tuple(dev.get("bridges") or []) + (gpu["bdf"],))
    return [gpu for _, gpu in sorted(enumerate(gpus), key=key)]


def gpu_models(gpus: list[dict], pci: dict, pci_names: dict | None = None) -> dict[str, dict]:
    """A name for every GPU, also for one the host's driver does not drive (bound to vfio-pci, or
    to no driver): ``{bdf or name: {"model", "note"}}``, from, in this order,

    1. the NVIDIA driver's own name for it (``nvidia-smi``; no note),
    2. the host's PCI ID database (``PciIdNames``: the names lspci shows),
    3. the driver's name of another GPU with the same PCI IDs (vendor, device, subsystem): a
       bookworm host's pci.ids (2023) does not know the RTX PRO 6000 Blackwell or the H200,
    4. the bare IDs.
    """
    pci_names = pci_names or {}
    vendors, devices = pci_names.get("vendors") or {}, pci_names.get("devices") or {}

    def ids(dev: dict) -> tuple:
        return (dev.get("vendor"), dev.get("device"), dev.get("subsystem_vendor"), dev.get("subsystem_device"))

    named_by_driver: dict = {}
    for g in gpus:
        if g["model"] and g["bdf"] in pci:
            named_by_driver.setdefault(ids(pci[g["bdf"]]), g)
    result = {}
    for gpu in gpus:
        key = gpu["bdf"] or gpu["name"]
        dev = pci.get(gpu["bdf"] or "", {})
        vendor, device = dev.get("vendor"), dev.get("device")
        pci_id = f"{vendor}:{device}"
        if gpu["model"]:
            result[key] = {"model": gpu["model"], "note": None}
        elif vendor and device and pci_id in devices:
            result[key] = {"model": f"{vendors.get(vendor, vendor)} {devices[pci_id]}".strip(),
                           "note": f"{pci_id}, name from the PCI ID database"}
        elif vendor and device and ids(dev) in named_by_driver:
            twin = named_by_driver[ids(dev)]
            result[key] = {"model": twin["model"],
                           "note": f"{pci_id}, same PCI IDs as {twin['name'] or twin['bdf']}"}
        elif vendor and device:
            result[key] = {"model": f"{vendors.get(vendor, 'vendor ' + vendor)} device {pci_id}",
                           "note": "not in the PCI ID database" + (" of this host" if pci_names.get("database") else "")}
        else:
            result[key] = {"model": None, "note": None}
    return result


def gpu_locality(gpu: dict, dev: dict, topology: dict) -> tuple:
    """(NUMA node, CPU list) of a GPU, as the text report gives them: the NUMA node from sysfs,
    else nvidia-smi topo -m's; the CPUs from nvidia-smi topo -m, else sysfs' local_cpulist."""
    numa = gpu["numa_node"]
    if numa is None and gpu["name"]:
        numa = (topology.get("numa_affinity") or {}).get(gpu["name"])
    cpus = dev.get("local_cpulist")
    if gpu["name"]:
        cpus = (topology.get("cpu_affinity") or {}).get(gpu["name"]) or cpus
    return numa, cpus


def _tree(pci: dict, endpoints: list[str]) -> dict:
    """``{root: {bridge: {…, endpoint: {}}}}`` for the endpoints' upstream paths."""
    tree: dict = {}
    for bdf in endpoints:
        dev = pci.get(bdf, {})
        node = tree.setdefault(dev.get("root") or "unknown root complex", {})
        for bridge in dev.get("bridges") or []:
            node = node.setdefault(bridge, {})
        node.setdefault(bdf, {})
    return tree


def _cell(pair: dict | None) -> str:
    if pair is None:
        return "X"
    words = {"usable": "yes", "unsafe": "UNSAFE", "unknown": "?", "impossible": "no"}
    return f"{words[verdict_kind(pair)]}/{pair['level'] or '?'}"


def topology_text(host: str, hardware: dict, verdict: dict, nccl_env: dict | None = None) -> str:
    """The text summary: platform, root complexes → bridges → GPUs/NICs, the P2P matrix with reasons."""
    pci = hardware.get("pci_devices") or {}
    topology = hardware.get("topology") or {}
    iommu = hardware.get("iommu") or {}
    driver = hardware.get("nvidia_driver") or {}
    cpu = hardware.get("cpu") or {}
    gpus = gpus_in_topology_order(verdict["gpus"], pci)
    gpu_by_bdf = {g["bdf"]: g for g in gpus if g["bdf"]}
    models = gpu_models(gpus, pci, hardware.get("pci_names"))
    nics = _network_devices(pci)
    roots = sorted({g["root"] for g in gpus if g["root"]})
    numa_nodes = sorted({g["numa_node"] for g in gpus if g["numa_node"] is not None})

    lines = [f"GPU topology of {host}", "=" * len(f"GPU topology of {host}")]
    platform = []
    if cpu.get("model"):
        platform.append(f"CPU {cpu['model']}")
    sev = verdict.get("sev_snp")
    platform.append("SEV-SNP " + {True: "on", False: "off", None: "unknown"}[sev])
    if iommu.get("enabled"):
        platform.append(f"IOMMU on ({iommu.get('mode') or 'mode unknown'})")
    else:
        platform.append("IOMMU off (no groups)")
    if driver.get("version"):
        platform.append(f"NVIDIA driver {driver['version']}{' open' if driver.get('open') else ''}")
    lines.append("; ".join(platform))
    lines.append(
        f"{len(gpus)} GPU(s) on {len(roots) or '?'} root complex(es), NUMA node(s): "
        f"{', '.join(map(str, numa_nodes)) or 'unknown'}"
    )
    lines.append("")

    if pci:
        endpoints = sorted(gpu_by_bdf) + sorted(nics)
        tree = _tree(pci, endpoints)
        by_numa: dict = {}
        for root in tree:
            by_numa.setdefault(_numa_of_root(root, pci), []).append(root)
        for numa in sorted(by_numa, key=lambda n: (n is None, n)):
            lines.append(f"NUMA node {numa if numa is not None else 'unknown'}")
            for root in sorted(by_numa[numa]):
                lines.append(f"  root complex {root}")
                _render_tree(tree[root], pci, gpu_by_bdf, topology, lines, depth=2, models=models)
    else:
        for gpu in gpus:
            numa = (topology.get("numa_affinity") or {}).get(gpu["name"])
            lines.append(f"  {gpu['name']}: NUMA {numa or 'unknown'} (no PCI facts)")
    topo_nics = topology.get("nics") or {}
    if topo_nics:
        lines.append("RDMA NICs the driver sees: " + ", ".join(f"{k}={v}" for k, v in sorted(topo_nics.items())))
    lines.append("")

    if not gpus:
        lines.append("No NVIDIA GPU found (no PCI device of vendor 10de, class 03, and none in nvidia-smi).")
    lines.append("P2P between GPUs (verdict/level; yes = possible and safe):")
    labels = [_gpu_label(g) for g in gpus]
    key = {frozenset((p["a"], p["b"])): p for p in verdict["pairs"]}
    ids = [g["bdf"] or g["name"] for g in gpus]
    width = max([len(label) for label in labels] + [12])
    lines.append(" " * (width + 2) + "".join(label.ljust(width + 2) for label in labels))
    for row_id, row_label in zip(ids, labels, strict=True):
        cells = [_cell(key.get(frozenset((row_id, col_id)))) for col_id in ids]
        lines.append(row_label.ljust(width + 2) + "".join(cell.ljust(width + 2) for cell in cells))
    lines.append("")
    lines.append(verdict["summary"])
    for pair in verdict["pairs"]:
        a, b = (n or x for n, x in zip(pair["names"], (pair["a"], pair["b"]), strict=True))
        state = {"usable": "possible and safe", "unsafe": "possible but UNSAFE", "unknown": "unknown",
                 "impossible": "impossible"}[verdict_kind(pair)]
        if state == "possible but UNSAFE" and pair["possible"] is None:
            state = "UNSAFE (whether possible is unknown)"
        answer = f", driver read {pair['driver_read']}" if pair["driver_read"] else ""
        lines.append(f"  {a} - {b} ({pair['level'] or 'level unknown'}{answer}): {state}")
        lines.extend(f"      - {reason}" for reason in pair["reasons"])
        lines.extend(f"      (note: {note})" for note in pair["notes"])
    if nccl_env is not None:
        lines.append("")
        lines.append("NCCL environment (/etc/nccl.conf on the host):")
        lines.extend(f"  {line}" for line in describe_nccl_environment(nccl_env) or ["(nothing to set)"])
        note = opt_in_note(verdict, nccl_env)
        if note:
            lines.append(f"  note: {note}")
        lines.append(f"  ({PRECEDENCE})")
    return "\n".join(lines) + "\n"


def _render_tree(node: dict, pci: dict, gpus: dict, topology: dict, lines: list[str], depth: int,
                 models: dict) -> None:
    for bdf in sorted(node):
        dev = pci.get(bdf, {})
        pad = "  " * depth
        ids = f"{dev.get('vendor') or '?'}:{dev.get('device') or '?'}"
        link = link_text(dev.get("link"))
        if bdf in gpus:
            gpu = gpus[bdf]
            model = models.get(bdf) or {}
            head = f"{gpu['name'] or 'GPU'} {bdf} {model.get('model') or ids}"
            if model.get("note"):
                head += f" ({model['note']})"
            if not gpu["visible"]:
                head += " - not on the host's NVIDIA driver"
            details = [f"driver {gpu['driver'] or 'none'}"]
            if gpu["role"]:
                details.append(f"role {gpu['role']}")
            driver_numa = (topology.get("numa_affinity") or {}).get(gpu["name"])
            if gpu["numa_node"] is not None:
                details.append(f"NUMA {gpu['numa_node']}")
            else:
                details.append(f"NUMA {driver_numa} (nvidia-smi; sysfs says none)" if driver_numa else "NUMA unknown")
            cpus = (topology.get("cpu_affinity") or {}).get(gpu["name"]) or dev.get("local_cpulist")
            if cpus:
                details.append(f"CPUs {cpus}")
            if gpu["iommu_group"] is not None:
                details.append(f"IOMMU group {gpu['iommu_group']} ({gpu.get('iommu_domain') or 'type unknown'})")
            details.append(f"BAR1 {human_bytes(bar1_size(dev.get('bars')))}")
            lines.append(f"{pad}{head}")
            lines.append(f"{pad}    {', '.join(details)}")
            if link:
                lines.append(f"{pad}    link {link}")
        elif (dev.get("class") or "").startswith(NETWORK_CLASS_PREFIX):
            lines.append(f"{pad}NIC {bdf} {ids} driver {dev.get('driver') or 'none'}" + (f", link {link}" if link else ""))
        else:
            lines.append(f"{pad}bridge {bdf} {ids}" + (f", link {link}" if link else ""))
        _render_tree(node[bdf], pci, gpus, topology, lines, depth + 1, models)


def _node_id(kind: str, name: str) -> str:
    return f"{kind}_" + re.sub(r"[^0-9A-Za-z]", "_", name)


# Verdict kinds of a GPU pair, in the matrix's legend order: (fill colour, word in the cell, legend text).
P2P_KINDS = {
    "usable": ("#a5d6a7", "ok", "possible and safe"),
    "unsafe": ("#ffcc80", "unsafe", "possible but unsafe"),
    "unknown": ("#e0e0e0", "?", "unknown until the driver answers"),
    "impossible": ("#ef9a9a", "no", "impossible"),
}
SELF_CELL_COLOUR = "#eeeeee"


def verdict_kind(pair: dict) -> str:
    """``usable`` (possible and safe), ``unsafe`` (possible, or not known to be impossible, and
    unsafe), ``unknown`` (no driver answer yet where it decides) or ``impossible``."""
    if "status" in pair:
        return pair["status"]
    if pair["possible"] and pair["safe"]:
        return "usable"
    return "unsafe" if pair["possible"] else "impossible"


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _short_bdf(bdf: str | None) -> str:
    """``0000:81:00.0`` → ``81:00.0`` (the domain only when it is not 0000)."""
    return (bdf or "")[5:] if (bdf or "").startswith("0000:") else (bdf or "")


def _matrix_cell_id(a: str, b: str) -> str:
    return _node_id("p2p", f"{a}__{b}")


def _p2p_matrix_label(gpus: list[dict], pairs: dict, *, one_gpu_note: bool) -> str:
    """The P2P matrix as a graphviz HTML-like table: a header row and column of GPUs (topology
    order), one cell per ordered pair filled by verdict with the level and a word in it and the
    reasons as its tooltip (graphviz writes a cell's TOOLTIP into the SVG only for a cell with an
    HREF: each cell links to itself), then a legend."""
    ids = [g["bdf"] or g["name"] for g in gpus]

    def head(gpu: dict, sep: str) -> str:
        parts = [gpu["name"], _short_bdf(gpu["bdf"])] if gpu["name"] else [_short_bdf(gpu["bdf"]), "(" + (gpu["driver"] or "no driver") + ")"]
        return sep.join(_esc(p) for p in parts if p)

    rows = ['<TR><TD BORDER="0"></TD>'
            + "".join(f'<TD BGCOLOR="gray90"><FONT POINT-SIZE="11">{head(g, "<BR/>")}</FONT></TD>' for g in gpus)
            + "</TR>"]
    for row_gpu, row_id in zip(gpus, ids, strict=True):
        cells = [f'<TD BGCOLOR="gray90" ALIGN="LEFT"><FONT POINT-SIZE="11">{head(row_gpu, " ")}</FONT></TD>']
        for col_gpu, col_id in zip(gpus, ids, strict=True):
            if col_id == row_id:
                cells.append(f'<TD BGCOLOR="{SELF_CELL_COLOUR}">—</TD>')
                continue
            pair = pairs.get(frozenset((row_id, col_id)))
            if pair is None:
                cells.append('<TD BGCOLOR="white">?</TD>')
                continue
            kind = verdict_kind(pair)
            colour, word, words = P2P_KINDS[kind]
            cell_id = _matrix_cell_id(row_id, col_id)
            a = _label_of(row_gpu)
            b = _label_of(col_gpu)
            tooltip = f"{a} ↔ {b}: {words} ({pair['level'] or 'level unknown'}). " + " ".join(
                r.rstrip(".") + "." for r in pair["reasons"])
            cells.append(
                f'<TD ID="{cell_id}" HREF="#{cell_id}" TOOLTIP="{_esc(tooltip)}" BGCOLOR="{colour}">'
                f'<FONT POINT-SIZE="13"><B>{_esc(pair["level"] or "?")}</B></FONT><BR/><FONT POINT-SIZE="10">{word}</FONT></TD>')
        rows.append("<TR>" + "".join(cells) + "</TR>")
    matrix = '<TABLE BORDER="0" CELLBORDER="1" CELLSPACING="0" CELLPADDING="3">' + "".join(rows) + "</TABLE>"
    legend_cells = "".join(
        f'<TD BGCOLOR="{colour}">{word}</TD><TD ALIGN="LEFT">{_esc(words)}   </TD>'
        for colour, word, words in P2P_KINDS.values())
    levels = ", ".join(f"{level} {words}" for level, words in LEVEL_WORDS.items())
    level_lines = '<BR ALIGN="LEFT"/>'.join(
        _esc(line) for line in textwrap.wrap(f"Level in each cell (as nvidia-smi topo -m): {levels}; NV# bonded NVLinks.", 100))
    legend = (
        '<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2" CELLPADDING="2">'
        f'<TR>{legend_cells}</TR>'
        f'<TR><TD COLSPAN="6" ALIGN="LEFT"><FONT POINT-SIZE="10">{level_lines}<BR ALIGN="LEFT"/></FONT></TD></TR>'
        "</TABLE>")
    title = "P2P between GPUs (row × column; hover a cell for the reasons)"
    if one_gpu_note:
        title += ": one GPU, no pairs"
    return (
        '<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="4">'
        f'<TR><TD><FONT POINT-SIZE="14"><B>{_esc(title)}</B></FONT></TD></TR><TR><TD>{matrix}</TD></TR><TR><TD>{legend}</TD></TR></TABLE>>'
    )


def _label_of(gpu: dict) -> str:
    if gpu["name"] and gpu["bdf"]:
        return f"{gpu['name']} ({gpu['bdf']})"
    return gpu["name"] or gpu["bdf"] or "?"


def topology_dot(host: str, hardware: dict, verdict: dict) -> str:
    """DOT source: NUMA node clusters ⊃ root complex clusters ⊃ bridges, GPUs, NICs (each GPU with
    its name, driver, role, link, NUMA node and CPUs); below them the P2P matrix (GPUs on both
    axes in topology order, each cell coloured by verdict with the link level in it and the
    reasons as its tooltip) and its legend."""
    import graphviz  # here, not at the top: every converge imports this module (NCCL stage), few draw

    pci = hardware.get("pci_devices") or {}
    topology = hardware.get("topology") or {}
    graph = graphviz.Graph(name=f"topology_{re.sub(r'[^0-9A-Za-z]', '_', host)}")
    title = "\n".join([f"GPU topology of {host}", *textwrap.wrap(verdict["summary"], 110)])
    graph.attr(label=title, labelloc="t", fontname="Helvetica")
    graph.attr("node", fontname="Helvetica", fontsize="10")
    graph.attr("edge", fontname="Helvetica", fontsize="9")
    ordered = gpus_in_topology_order(verdict["gpus"], pci)
    gpus = {g["bdf"]: g for g in ordered if g["bdf"]}
    models = gpu_models(ordered, pci, hardware.get("pci_names"))

    def gpu_label(gpu: dict) -> str:
        dev = pci.get(gpu["bdf"], {}) if gpu["bdf"] else {}
        key = gpu["bdf"] or gpu["name"]
        model = models.get(key, {})
        parts = [" ".join(p for p in (gpu["name"], gpu["bdf"]) if p), model.get("model") or ""]
        if model.get("note"):
            parts.append(f"({model['note']})")
        parts.append(" · ".join(p for p in (f"driver {gpu['driver'] or 'none'}",
                                            f"role {gpu['role']}" if gpu["role"] else "") if p))
        width = (dev.get("link") or {}).get("width")
        if width:
            parts.append(f"x{width} {link_speed((dev.get('link') or {}).get('speed')) or '?'} GT/s")
        numa, cpus = gpu_locality(gpu, dev, topology)
        parts.extend(textwrap.wrap(f"NUMA {numa if numa is not None else '?'} · CPUs {cpus or '?'}", 48))
        return "\n".join(p for p in parts if p)

    def gpu_colour(gpu: dict) -> str:
        return "palegreen" if gpu["visible"] else ("lightblue" if gpu["driver"] == "vfio-pci" else "gray85")

    gpu_nodes = []
    if pci and gpus:
        tree = _tree(pci, sorted(gpus) + sorted(_network_devices(pci)))
        by_numa: dict = {}
        for root in tree:
            by_numa.setdefault(_numa_of_root(root, pci), []).append(root)
        for numa in sorted(by_numa, key=lambda n: (n is None, n)):
            with graph.subgraph(name=f"cluster_numa_{numa}") as numa_graph:
                numa_graph.attr(label=f"NUMA node {numa if numa is not None else '?'}", style="rounded",
                                color="gray40")
                for root in sorted(by_numa[numa], reverse=True):  # dot (2.43) lays sibling clusters out right to left
                    with numa_graph.subgraph(name=_node_id("cluster_rc", root)) as rc:
                        rc.attr(label=f"root complex {root}", style="filled", fillcolor="gray95", color="gray70")
                        root_id = _node_id("rc", root)
                        rc.node(root_id, root, shape="box", style="filled", fillcolor="white")
                        _dot_tree(rc, tree[root], root_id, pci, gpus, gpu_label, gpu_colour)
        gpu_nodes = [_node_id("gpu", bdf) for bdf in gpus]
    else:  # no PCI facts: the GPUs the driver lists, in one row
        with graph.subgraph() as row:
            row.attr(rank="same")
            for gpu in ordered:
                node_id = _node_id("gpu", gpu["bdf"] or gpu["name"])
                row.node(node_id, gpu_label(gpu), shape="box3d", style="filled", fillcolor=gpu_colour(gpu))
                gpu_nodes.append(node_id)

    pairs = {frozenset((p["a"], p["b"])): p for p in verdict["pairs"]}
    graph.node("p2p_matrix", _p2p_matrix_label(ordered, pairs, one_gpu_note=len(ordered) == 1),
               shape="plain", fontname="Helvetica", fontsize="10")
    # Invisible edges put the matrix below the whole tree (dot ranks it under every GPU).
    for node_id in gpu_nodes:
        graph.edge(node_id, "p2p_matrix", style="invis")
    return graph.source


def _dot_tree(graph, node: dict, parent_id: str, pci: dict, gpus: dict, gpu_label, gpu_colour) -> None:
    for bdf in sorted(node):
        dev = pci.get(bdf, {})
        if bdf in gpus:
            node_id = _node_id("gpu", bdf)
            graph.node(node_id, gpu_label(gpus[bdf]), shape="box3d", style="filled", fillcolor=gpu_colour(gpus[bdf]))
        elif (dev.get("class") or "").startswith(NETWORK_CLASS_PREFIX):
            node_id = _node_id("nic", bdf)
            graph.node(node_id, f"NIC {bdf}\n{dev.get('vendor')}:{dev.get('device')}", shape="component")
        else:
            node_id = _node_id("bridge", bdf)
            graph.node(node_id, f"bridge {bdf}\n{dev.get('vendor')}:{dev.get('device')}", shape="ellipse")
        graph.edge(parent_id, node_id, color="gray50")
        _dot_tree(graph, node[bdf], node_id, pci, gpus, gpu_label, gpu_colour)
