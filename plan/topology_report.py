"""A host's GPU topology for people: a text summary and a graphviz diagram (DOT source).

Pure functions over the HardwareProbe fact's data (``facts.hardware.HardwareProbe``, one remote
command) plus the P2P verdict; `topology.py` gathers the facts and writes the files.
"""

from __future__ import annotations

import re
import textwrap

from plan.nccl import describe_nccl_environment
from plan.p2p import p2p_verdict

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
    verdict = "yes" if pair["possible"] and pair["safe"] else ("UNSAFE" if pair["possible"] else "no")
    return f"{verdict}/{pair['level'] or '?'}"


def topology_text(host: str, hardware: dict, verdict: dict, nccl_env: dict | None = None) -> str:
    """The text summary: platform, root complexes → bridges → GPUs/NICs, the P2P matrix with reasons."""
    pci = hardware.get("pci_devices") or {}
    topology = hardware.get("topology") or {}
    iommu = hardware.get("iommu") or {}
    driver = hardware.get("nvidia_driver") or {}
    cpu = hardware.get("cpu") or {}
    gpus = verdict["gpus"]
    gpu_by_bdf = {g["bdf"]: g for g in gpus if g["bdf"]}
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
                _render_tree(tree[root], pci, gpu_by_bdf, topology, lines, depth=2)
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
    for row_id, row_label in zip(ids, labels):
        cells = [_cell(key.get(frozenset((row_id, col_id)))) for col_id in ids]
        lines.append(row_label.ljust(width + 2) + "".join(cell.ljust(width + 2) for cell in cells))
    lines.append("")
    lines.append(verdict["summary"])
    for pair in verdict["pairs"]:
        a, b = (n or x for n, x in zip(pair["names"], (pair["a"], pair["b"])))
        state = "possible and safe" if pair["possible"] and pair["safe"] else (
            "possible but UNSAFE" if pair["possible"] else "impossible")
        answer = f", driver read {pair['driver_read']}" if pair["driver_read"] else ""
        lines.append(f"  {a} - {b} ({pair['level'] or 'level unknown'}{answer}): {state}")
        lines.extend(f"      - {reason}" for reason in pair["reasons"])
        lines.extend(f"      (note: {note})" for note in pair["notes"])
    if nccl_env is not None:
        lines.append("")
        lines.append("NCCL environment (/etc/nccl.conf on the host):")
        lines.extend(f"  {line}" for line in describe_nccl_environment(nccl_env) or ["(nothing to set)"])
    return "\n".join(lines) + "\n"


def _render_tree(node: dict, pci: dict, gpus: dict, topology: dict, lines: list[str], depth: int) -> None:
    for bdf in sorted(node):
        dev = pci.get(bdf, {})
        pad = "  " * depth
        ids = f"{dev.get('vendor') or '?'}:{dev.get('device') or '?'}"
        link = link_text(dev.get("link"))
        if bdf in gpus:
            gpu = gpus[bdf]
            head = f"{gpu['name'] or 'GPU (not the host driver’s)'} {bdf} {gpu['model'] or ids}"
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
        _render_tree(node[bdf], pci, gpus, topology, lines, depth + 1)


def _node_id(kind: str, name: str) -> str:
    return f"{kind}_" + re.sub(r"[^0-9A-Za-z]", "_", name)


P2P_LEGEND = "P2P edges: green = possible and safe, orange = possible but unsafe, red dashed = impossible"
P2P_EDGE_STYLE = {
    "usable": {"color": "darkgreen", "style": "solid", "penwidth": "2"},
    "unsafe": {"color": "darkorange", "style": "bold"},
    "impossible": {"color": "red3", "style": "dashed"},
}


def topology_dot(host: str, hardware: dict, verdict: dict) -> str:
    """DOT source: NUMA node clusters ⊃ root complex clusters ⊃ bridges, GPUs, NICs; below them a
    row with one node per GPU and the P2P edges between GPUs colored by verdict (green usable,
    orange unsafe, red dashed impossible), each edge's tooltip holding the reasons."""
    import graphviz  # here, not at the top: every converge imports this module (NCCL stage), few draw

    pci = hardware.get("pci_devices") or {}
    graph = graphviz.Graph(name=f"topology_{re.sub(r'[^0-9A-Za-z]', '_', host)}")
    title = "\n".join([f"GPU topology of {host}", *textwrap.wrap(verdict["summary"], 110), P2P_LEGEND])
    graph.attr(label=title, labelloc="t", fontname="Helvetica")
    graph.attr("node", fontname="Helvetica", fontsize="10")
    graph.attr("edge", fontname="Helvetica", fontsize="9")
    gpus = {g["bdf"]: g for g in verdict["gpus"] if g["bdf"]}

    def gpu_label(gpu: dict) -> str:
        dev = pci.get(gpu["bdf"], {}) if gpu["bdf"] else {}
        parts = [gpu["name"] or "(not host's)", gpu["bdf"] or "", gpu["model"] or ""]
        width = (dev.get("link") or {}).get("width")
        if width:
            parts.append(f"x{width} {link_speed((dev.get('link') or {}).get('speed')) or '?'} GT/s")
        if gpu["role"]:
            parts.append(f"role {gpu['role']}")
        return "\n".join(p for p in parts if p)

    in_tree = bool(pci and gpus)
    if in_tree:
        tree = _tree(pci, sorted(gpus) + sorted(_network_devices(pci)))
        by_numa: dict = {}
        for root in tree:
            by_numa.setdefault(_numa_of_root(root, pci), []).append(root)
        for numa in sorted(by_numa, key=lambda n: (n is None, n)):
            with graph.subgraph(name=f"cluster_numa_{numa}") as numa_graph:
                numa_graph.attr(label=f"NUMA node {numa if numa is not None else '?'}", style="rounded",
                                color="gray40")
                for root in sorted(by_numa[numa]):
                    with numa_graph.subgraph(name=_node_id("cluster_rc", root)) as rc:
                        rc.attr(label=f"root complex {root}", style="filled", fillcolor="gray95", color="gray70")
                        root_id = _node_id("rc", root)
                        rc.node(root_id, root, shape="box", style="filled", fillcolor="white")
                        _dot_tree(rc, tree[root], root_id, pci, gpus, gpu_label)

    # P2P edges join a row of per-GPU nodes under the tree: dot (2.43) fails ("trouble in
    # init_rank") on many non-ranking edges across nested clusters; edges inside one flat row work.
    with graph.subgraph(name="cluster_p2p") as row:
        row.attr(label="P2P between GPUs (hover an edge for the reasons)", color="gray40")
        ids = []
        for gpu in verdict["gpus"]:
            key = gpu["bdf"] or gpu["name"]
            node_id = _node_id("p2p", key)
            ids.append(node_id)
            if in_tree:
                row.node(node_id, gpu["name"] or gpu["bdf"], shape="ellipse")
                graph.edge(_node_id("gpu", key), node_id, style="dotted", color="gray70")
            else:
                row.node(node_id, gpu_label(gpu), shape="box3d", style="filled", fillcolor="palegreen")
        with row.subgraph() as same_rank:
            same_rank.attr(rank="same")
            for node_id in ids:
                same_rank.node(node_id)
        for pair in verdict["pairs"]:
            kind = "usable" if pair["possible"] and pair["safe"] else ("unsafe" if pair["possible"] else "impossible")
            row.edge(
                _node_id("p2p", pair["a"]), _node_id("p2p", pair["b"]),
                label=pair["level"] or "", tooltip="; ".join(pair["reasons"]), **P2P_EDGE_STYLE[kind],
            )
    return graph.source


def _dot_tree(graph, node: dict, parent_id: str, pci: dict, gpus: dict, gpu_label) -> None:
    for bdf in sorted(node):
        dev = pci.get(bdf, {})
        if bdf in gpus:
            node_id = _node_id("gpu", bdf)
            graph.node(node_id, gpu_label(gpus[bdf]), shape="box3d", style="filled", fillcolor="palegreen")
        elif (dev.get("class") or "").startswith(NETWORK_CLASS_PREFIX):
            node_id = _node_id("nic", bdf)
            graph.node(node_id, f"NIC {bdf}\n{dev.get('vendor')}:{dev.get('device')}", shape="component")
        else:
            node_id = _node_id("bridge", bdf)
            graph.node(node_id, f"bridge {bdf}\n{dev.get('vendor')}:{dev.get('device')}", shape="ellipse")
        graph.edge(parent_id, node_id, color="gray50")
        _dot_tree(graph, node[bdf], node_id, pci, gpus, gpu_label)
