"""The topology report: text summary and graphviz diagram, from kpro6-like inputs and real
outputs recorded on the H200 VM (tests/fixtures/h200-vm)."""

import re

import graphviz

from facts.gpu import parse_p2p_matrix, parse_topo_matrix
from facts.kernel import parse_iommu, parse_sev_snp
from facts.nvidia import parse_driver_version, parse_gpu_information
from facts.pci import parse_pci_devices
from plan.nccl import nccl_environment
from plan.topology_report import bar1_size, link_text, topology_dot, topology_text, verdict_from_hardware
from tests.unit.test_p2p import (
    fixture_lines,
    kpro6_iommu,
    kpro6_nvidia_gpus,
    kpro6_pci,
    kpro6_topology,
    pci_device,
    switch_pci,
)


def kpro6_hardware() -> dict:
    return {"pci_devices": kpro6_pci(), "nvidia_gpus": kpro6_nvidia_gpus(), "topology": kpro6_topology(),
            "iommu": kpro6_iommu(), "sev_snp": {"snp": True, "enabled": True}, "p2p_read": {}, "p2p_write": {},
            "pci_acs": {}, "nvidia_driver": {"version": "595.71.05", "open": True}}


def h200_vm_hardware() -> dict:
    """The real H200 VM's outputs, each parsed by its own fact parser."""
    return {
        "pci_devices": parse_pci_devices(fixture_lines("h200-vm/sysfs-pci.txt")),
        "nvidia_gpus": parse_gpu_information(fixture_lines("h200-vm/driver-gpus-information.txt")),
        "nvidia_driver": parse_driver_version(fixture_lines("h200-vm/driver-version.txt")),
        "topology": parse_topo_matrix(fixture_lines("h200-vm/topo-m.txt")),
        "p2p_read": parse_p2p_matrix(fixture_lines("h200-vm/topo-p2p-r.txt")),
        "iommu": parse_iommu(fixture_lines("h200-vm/iommu-groups.txt")),
        "sev_snp": parse_sev_snp(fixture_lines("h200-vm/sev.txt")),
    }


def test_kpro6_text_walks_numa_root_complexes_bridges_gpus_and_explains_every_pair():
    hardware = kpro6_hardware()
    verdict = verdict_from_hardware(hardware)
    text = topology_text("kpro6", hardware, verdict, nccl_environment(verdict, rdma_devices=[]))
    lines = text.splitlines()
    assert lines[0] == "GPU topology of kpro6"
    assert "SEV-SNP on" in lines[2] and "NVIDIA driver 595.71.05 open" in lines[2]
    assert lines[3] == "8 GPU(s) on 8 root complex(es), NUMA node(s): 0, 1"
    # NUMA 0 holds the first four root complexes, each with its root port and GPU, in that order.
    numa0, numa1 = lines.index("NUMA node 0"), lines.index("NUMA node 1")
    assert numa0 < lines.index("  root complex pci0000:60") < numa1 < lines.index("  root complex pci0000:80")
    port = lines.index("    bridge 0000:40:01.1 1022:14ab, link 32.0 GT/s x16 (max 32.0 GT/s x16)")
    assert lines[port + 1] == "      GPU2 0000:41:00.0 NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert lines[port + 2].strip() == (
        "driver nvidia, NUMA 0, CPUs 0-63, IOMMU group 12 (translated), BAR1 128 GiB")
    assert "audio" not in text and "22e8" not in text  # the GPUs' audio functions are left out
    # The matrix row of GPU0 and a pair with its reasons.
    assert re.search(r"^GPU0 +X +no/NODE +no/NODE +no/NODE +no/SYS", text, re.M)
    pair = lines.index("  GPU0 - GPU7 (SYS): impossible")
    # no driver answer in these facts: the root complexes leave P2P open, the IOMMU closes it
    assert "the IOMMU translates DMA for GPU0" in lines[pair + 1]
    assert "SEV-SNP is on" in lines[pair + 2]
    assert "different root complexes (pci0000:00, pci0000:e0); whether the CPU routes P2P between them " \
           "is unknown" in lines[pair + 3]
    assert sum(1 for line in lines if re.match(r"^  GPU\d - GPU\d ", line)) == 28
    nccl = lines.index("NCCL environment (/etc/nccl.conf on the host):")
    p2p = next(line for line in lines[nccl:] if line.startswith("  NCCL_P2P_DISABLE=1"))
    assert "SEV-SNP" in p2p and "[from unknown]" in p2p  # these facts have no driver answer


def test_links_below_their_maximum_are_flagged():
    assert link_text({"speed": "32.0 GT/s PCIe", "width": 8, "max_speed": "32.0 GT/s PCIe", "max_width": 16}) == (
        "32.0 GT/s x8 (max 32.0 GT/s x16) DOWNTRAINED: x8 of x16")
    idle = link_text({"speed": "2.5 GT/s PCIe", "width": 16, "max_speed": "32.0 GT/s PCIe", "max_width": 16})
    assert idle is not None
    assert "DOWNTRAINED" not in idle and "speed below max (GPUs lower it when idle" in idle
    assert link_text({"speed": None, "width": None}) is None
    hardware = kpro6_hardware()
    hardware["pci_devices"]["0000:61:00.0"]["link"]["width"] = 4
    text = topology_text("kpro6", hardware, verdict_from_hardware(hardware))
    assert "link 32.0 GT/s x4 (max 32.0 GT/s x16) DOWNTRAINED: x4 of x16" in text


def test_h200_vm_report_from_real_outputs():
    hardware = h200_vm_hardware()
    verdict = verdict_from_hardware(hardware)
    text = topology_text("h200-vm", hardware, verdict)
    assert "IOMMU off (no groups)" in text and "SEV-SNP off" in text
    assert "1 GPU(s) on 1 root complex(es)" in text
    # The GPU sits directly on the VM's root bus, next to virtio devices (one of them a NIC).
    lines = text.splitlines()
    gpu = lines.index("    GPU0 0000:00:06.0 NVIDIA H200")
    assert lines.index("  root complex pci0000:00") < gpu
    assert lines[gpu + 1] == "        driver nvidia, NUMA 0 (nvidia-smi; sysfs says none), CPUs 0-15, BAR1 256 GiB"
    assert "BAR1 256 GiB" in text  # nvidia-smi -q on that VM: BAR1 Total 262144 MiB
    assert "    NIC 0000:00:03.0 1af4:1041 driver virtio-pci" in lines
    assert "Fewer than two GPUs: no GPU pairs" in text
    assert bar1_size(hardware["pci_devices"]["0000:00:06.0"]["bars"]) == 262144 << 20


def test_kpro6_diagram_has_numa_and_root_complex_clusters_and_a_red_p2p_matrix():
    hardware = kpro6_hardware()
    source = topology_dot("kpro6", hardware, verdict_from_hardware(hardware))
    assert "subgraph cluster_numa_0 {" in source and "subgraph cluster_numa_1 {" in source
    assert len(re.findall(r"subgraph cluster_rc_pci0000_\w\w \{", source)) == 8
    assert "rc_pci0000_40 -- bridge_0000_40_01_1" in source
    assert "gpu_0000_e1_00_0 -- p2p_matrix [style=invis]" in source  # the matrix sits below the tree
    assert not re.search(r"gpu_\w+ -- gpu_\w+", source)  # no P2P edges between GPUs any more
    _, svg = render_svg("kpro6", hardware)
    cells = matrix_cells(svg)
    assert len(cells) == 56 and {c["kind"] for c in cells.values()} == {"impossible"}
    assert sum(1 for g in svg.iter(f"{SVG}g") if g.get("class") == "cluster") == 10  # 2 NUMA + 8 root complexes
    legend = [t.text for t in svg.iter(f"{SVG}text")]
    assert {"possible and safe", "possible but unsafe", "impossible"} <= {(t or "").strip() for t in legend}


def test_nvlink_fixture_diagram_without_pci_facts_has_a_green_matrix():
    topology = parse_topo_matrix(fixture_lines("topo-m/8x-h100-sxm-nv18-no-nics-stas00.txt"))
    p2p_read = parse_p2p_matrix(fixture_lines("topo-p2p/8x-gpu-p2p-r-all-ok-stas00.txt"))
    hardware = {"topology": topology, "p2p_read": p2p_read}
    verdict, svg = render_svg("hgx", hardware)
    cells = matrix_cells(svg)
    assert len(cells) == 56 and all(c["kind"] == "usable" and c["text"] == ["NV18", "ok"] for c in cells.values())
    assert node_texts(svg, "gpu_GPU4")[0] == "GPU4" and node_texts(svg, "gpu_GPU4")[-1].startswith("NUMA 1 · CPUs ")
    text = topology_text("hgx", hardware, verdict)
    assert "  GPU4: NUMA 1 (no PCI facts)" in text.splitlines()
    assert "P2P is possible and safe for all 28 GPU pairs." in text


def test_nic_behind_the_gpus_switch_is_drawn_in_the_tree():
    pci = switch_pci()
    pci["0000:45:00.0"] = pci_device(vendor="15b3", device="1021", cls="020700", root="pci0000:40",
                                     bridges=["0000:40:01.1", "0000:41:00.0"], driver="mlx5_core", numa=0)
    hardware = {"pci_devices": pci, "iommu": {"enabled": False, "groups": {}}, "sev_snp": {"snp": False, "enabled": False}}
    verdict = verdict_from_hardware(hardware)
    lines = topology_text("box", hardware, verdict).splitlines()
    usp = lines.index("      bridge 0000:41:00.0 10b5:c010, link 32.0 GT/s x16 (max 32.0 GT/s x16)")
    assert "        NIC 0000:45:00.0 15b3:1021 driver mlx5_core, link 32.0 GT/s x16 (max 32.0 GT/s x16)" in lines[usp:]
    source = topology_dot("box", hardware, verdict)
    assert "bridge_0000_41_00_0 -- nic_0000_45_00_0" in source
    _, svg = render_svg("box", hardware)
    assert {c["kind"] for c in matrix_cells(svg).values()} == {"usable"}  # the two GPUs behind the switch


def test_topology_deploy_file_on_this_machine_writes_the_report_and_queues_no_operation(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    pyinfra = Path(sys.executable).parent / "pyinfra"
    run = subprocess.run(
        [str(pyinfra), "-y", "@local", "topology.py"], cwd=repo, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PVEGPU_TOPOLOGY_OUT": str(tmp_path)},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    text = (tmp_path / "@local.txt").read_text()
    assert text.startswith("GPU topology of @local\n") and text in run.stdout
    assert (tmp_path / "@local.svg").read_text().lstrip().startswith(("<?xml", "<svg"))
    assert re.search(r"Grand total\s+-\s+-\s+-\s+-\s", run.stderr)  # pyinfra's results table: no operation


def test_bar1_is_index_1_or_2_never_bar3():
    # 32-bit BAR0: BAR1 at 1 (64-bit, upper half at 2), BAR3 at 3; 64-bit BAR0 (H200): BAR1 at 2, BAR3 at 4
    assert bar1_size({0: 16 << 20, 1: 256 << 30, 3: 32 << 20}) == 256 << 30
    assert bar1_size({0: 16 << 20, 2: 256 << 30, 4: 32 << 20}) == 256 << 30
    # BAR1 could not be assigned (incident 10): BAR3 is not taken for it
    assert bar1_size({0: 16 << 20, 4: 32 << 20}) is None
    assert bar1_size({0: 16 << 20, 3: 32 << 20}) is None


# ---------------------------------------------------------------- the picture (issue 20)

SVG = "{http://www.w3.org/2000/svg}"
XLINK = "{http://www.w3.org/1999/xlink}"
FILL = {"#a5d6a7": "usable", "#ffcc80": "unsafe", "#ef9a9a": "impossible", "#e0e0e0": "unknown"}


def twin_profile_hardware(tmp_path, monkeypatch, profile: str, vfio: tuple = ()) -> dict:
    """A twin profile's hardware rendered into a tmp root (no sshd), with `vfio` GPUs bound to
    vfio-pci by the deploy's own udev rules, read by HardwareProbe's own command (paths mapped
    to the rendered tree as in tests/unit/test_p2p.py), plus PciIdNames on a real bookworm
    pci.ids (the cached twin root's, when it is there)."""
    import os
    import subprocess

    from facts.hardware import HardwareProbe
    from facts.pci import PciIdNames
    from plan.render import render_template
    from tests.twin import hardware as twin_hardware
    from tests.twin import runtime

    monkeypatch.setattr(twin_hardware.installer, "build", lambda *a, **k: None)  # no .run needed here
    root = tmp_path / profile
    twin_hardware.install(root, profile)
    if vfio:
        rules = root / twin_hardware.BINDING_RULES
        rules.parent.mkdir(parents=True, exist_ok=True)
        rules.write_text(render_template("gpu-binding.rules.j2", bindings=[(bdf, "vfio-pci") for bdf in vfio]))
        (root / "etc/modules-load.d").mkdir(parents=True, exist_ok=True)  # the boot stage loads vfio early
        (root / "etc/modules-load.d/pvegpu-vfio.conf").write_text(
            render_template("modules-load-vfio.conf.j2", modules=["vfio", "vfio_iommu_type1", "vfio_pci"]))
        twin_hardware.render(root)  # the twin's reboot: the rules bind at boot
    hw = root / "var/lib/twin/hw"
    command = (HardwareProbe().command.replace("/sys/", f"{hw}/sys/").replace("/proc/", f"{hw}/proc/")
               .replace("nvidia-smi", str(root / "usr/local/bin/nvidia-smi")))
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TWIN_ROOT": str(root)})
    hardware = HardwareProbe().process(run.stdout.replace(str(hw), "").splitlines())
    # bookworm's own (the trixie root's newer pci.ids knows Blackwell; root-<key> dirs sort by key)
    databases = [p for p in [runtime.CACHE_DIR / f"root-{runtime.cache_key('bookworm')}/usr/share/misc/pci.ids"]
                 if p.exists()]
    if databases:
        ids = sorted({f"{d['vendor']}:{d['device']}" for d in hardware["pci_devices"].values() if d["vendor"] == "10de"})
        names = subprocess.run(["bash", "-c", PciIdNames().command(ids).replace("/usr/share/misc/pci.ids", str(databases[0]))],
                               capture_output=True, text=True, timeout=60)
        hardware["pci_names"] = PciIdNames().process(names.stdout.splitlines())
    return hardware


def render_svg(host: str, hardware: dict, roles: dict | None = None):
    """(verdict, SVG root element) of the picture graphviz draws."""
    import xml.etree.ElementTree as ET

    verdict = verdict_from_hardware(hardware, roles)
    svg = graphviz.Source(topology_dot(host, hardware, verdict)).pipe(format="svg")
    return verdict, ET.fromstring(svg)


def matrix_cells(svg) -> dict:
    """{(row, column): {"kind", "text", "tooltip"}} read from the SVG's structure: each matrix cell
    is a link group ``a_p2p_<row>__<column>`` whose polygon carries the verdict's fill."""
    cells = {}
    for group in svg.iter(f"{SVG}g"):
        match = re.fullmatch(r"a_p2p_(\w+?)__(\w+)", group.get("id") or "")
        if not match:
            continue
        link = group.find(f"{SVG}a")
        fill = link.find(f"{SVG}polygon").get("fill")
        cells[match.groups()] = {"kind": FILL.get(fill, fill),
                                 "text": [t.text for t in link.iter(f"{SVG}text")],
                                 "tooltip": link.get(f"{XLINK}title")}
    return cells


def node_texts(svg, node_id: str) -> list[str]:
    """The text lines of the graphviz node named `node_id` (its <title>)."""
    for group in svg.iter(f"{SVG}g"):
        if group.get("class") == "node" and group.findtext(f"{SVG}title") == node_id:
            return [t.text for t in group.iter(f"{SVG}text")]
    raise AssertionError(f"no node {node_id} in the SVG")


def svg_id(bdf: str) -> str:
    return re.sub(r"[^0-9A-Za-z]", "_", bdf)


def test_kpro6_twin_picture_matrix_names_and_locality(tmp_path, monkeypatch):
    """The 8-GPU kpro6 twin as the issue saw it: four GPUs on the host driver, four bound to vfio-pci."""
    from spec.load import load_spec_file

    roles = {bdf: gpu.role for bdf, gpu in load_spec_file("inventories/twin.yml")["kpro6"].gpus.items()}
    vfio = tuple(bdf for bdf, role in roles.items() if role.startswith("vm:"))
    hardware = twin_profile_hardware(tmp_path, monkeypatch, "kpro6", vfio)
    verdict, svg = render_svg("kpro6", hardware, roles)
    cells = matrix_cells(svg)
    bdfs = [g["bdf"] for g in verdict["gpus"]]
    assert len(bdfs) == 8 and len(cells) == 8 * 7  # every ordered pair, no cell for a GPU with itself
    for pair in verdict["pairs"]:
        for row, col in ((pair["a"], pair["b"]), (pair["b"], pair["a"])):
            cell = cells[(svg_id(row), svg_id(col))]
            assert cell["kind"] == "impossible"
            assert cell["text"] == [pair["level"], "no"]
            assert all(reason.rstrip(".") in cell["tooltip"] for reason in pair["reasons"])
    # NODE inside a socket, SYS across; rows and columns in topology order (NUMA 0's GPUs first)
    assert cells[(svg_id("0000:01:00.0"), svg_id("0000:21:00.0"))]["text"][0] == "NODE"
    assert cells[(svg_id("0000:01:00.0"), svg_id("0000:81:00.0"))]["text"][0] == "SYS"
    assert "is passed through to VM 300 (vfio-pci)" in cells[(svg_id("0000:01:00.0"), svg_id("0000:81:00.0"))]["tooltip"]
    # every GPU is named, the vfio-pci ones as their identical siblings (bookworm's pci.ids has no Blackwell)
    blackwell = "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    host_gpu = node_texts(svg, "gpu_0000_01_00_0")
    assert host_gpu[:2] == ["GPU0 0000:01:00.0", blackwell]
    assert "driver nvidia · role lxc" in host_gpu
    vm_gpu = node_texts(svg, "gpu_0000_81_00_0")
    assert vm_gpu[:3] == ["0000:81:00.0", blackwell, "(10de:2bb5, same PCI IDs as GPU0)"]
    assert "driver vfio-pci · role vm:300" in vm_gpu
    assert "not host's" not in " ".join(t for g in svg.iter(f"{SVG}text") for t in [g.text or ""])
    # locality under each GPU: the profile's NUMA nodes and their CPU lists
    assert host_gpu[-1] == "NUMA 0 · CPUs 0-31,64-95" and vm_gpu[-1] == "NUMA 1 · CPUs 32-63,96-127"
    # the headline sentence stays
    title = " ".join(t.text for t in svg.find(f"{SVG}g").findall(f"{SVG}text"))
    assert "P2P is impossible for all 28 GPU pairs." in title
    text = topology_text("kpro6", hardware, verdict)
    assert (f"      GPU 0000:81:00.0 {blackwell} (10de:2bb5, same PCI IDs as GPU0) - not on the host's NVIDIA driver"
            in text.splitlines())
    assert "          driver vfio-pci, role vm:300, NUMA 1, CPUs 32-63,96-127, IOMMU group" in text


def test_intel2_twin_picture_two_gpus_behind_a_switch(tmp_path, monkeypatch):
    """The 2-GPU intel2 twin (2 x A6000 behind a PLX switch); its second GPU bound to vfio-pci for a VM
    is named from bookworm's PCI ID database, which knows the A6000."""
    hardware = twin_profile_hardware(tmp_path, monkeypatch, "intel2")
    verdict, svg = render_svg("intel2", hardware)
    cells = matrix_cells(svg)
    (pair,) = verdict["pairs"]
    for row, col in ((pair["a"], pair["b"]), (pair["b"], pair["a"])):
        cell = cells[(svg_id(row), svg_id(col))]
        kind = "usable" if pair["possible"] and pair["safe"] else ("unsafe" if pair["possible"] else "impossible")
        assert cell["kind"] == kind and cell["text"][0] == pair["level"]
    assert pair["level"] in ("PIX", "PXB") and len(cells) == 2
    assert node_texts(svg, f"gpu_{svg_id(pair['a'])}")[0].startswith("GPU0 ")

    vfio_hw = twin_profile_hardware(tmp_path / "vfio", monkeypatch, "intel2", (pair["b"],))
    verdict, svg = render_svg("intel2", vfio_hw, {pair["a"]: "lxc", pair["b"]: "vm:301"})
    cell = matrix_cells(svg)[(svg_id(pair["a"]), svg_id(pair["b"]))]
    assert cell["kind"] == "impossible" and "is passed through to VM 301" in cell["tooltip"]
    lines = node_texts(svg, f"gpu_{svg_id(pair['b'])}")
    if vfio_hw.get("pci_names"):  # the cached twin root's pci.ids (Debian bookworm)
        assert lines[1:3] == ["NVIDIA Corporation GA102GL [RTX A6000]", "(10de:2230, name from the PCI ID database)"]
    else:
        assert lines[2] == "(10de:2230, same PCI IDs as GPU0)"


def test_h200_vm_picture_one_gpu_no_pairs():
    hardware = h200_vm_hardware()
    verdict, svg = render_svg("h200-vm", hardware)
    assert matrix_cells(svg) == {}
    gpu = node_texts(svg, "gpu_0000_00_06_0")
    assert gpu[:2] == ["GPU0 0000:00:06.0", "NVIDIA H200"]
    assert gpu[-1] == "NUMA 0 · CPUs 0-15"  # nvidia-smi's affinity: the VM's sysfs has no NUMA node
    matrix = " ".join(t.text for t in svg.iter(f"{SVG}text") if t.text)
    assert "P2P between GPUs (row × column; hover a cell for the reasons): one GPU, no pairs" in matrix


def sixteen_gpu_hardware() -> dict:
    """16 GPUs: two sockets, two root complexes each, a PCIe switch with two GPUs under each root
    port pair; no IOMMU translation, no SEV-SNP: P2P possible and safe below one switch."""
    pci, nvidia = {}, {}
    for r, bus in enumerate(["00", "40", "80", "c0"]):
        root, port = f"pci0000:{bus}", f"0000:{bus}:01.1"
        numa = r // 2
        pci[port] = pci_device(vendor="1022", device="14ab", cls="060400", root=root, bridges=[], numa=numa)
        for s in range(2):
            usp = f"0000:{int(bus, 16) + 1 + 4 * s:02x}:00.0"
            pci[usp] = pci_device(vendor="10b5", device="c010", cls="060400", root=root, bridges=[port], numa=numa)
            for g in range(2):
                dsp = f"0000:{int(bus, 16) + 2 + 4 * s:02x}:{g:02x}.0"
                pci[dsp] = pci_device(vendor="10b5", device="c010", cls="060400", root=root, bridges=[port, usp], numa=numa)
                bdf = f"0000:{int(bus, 16) + 3 + 4 * s + g:02x}:00.0"
                pci[bdf] = pci_device(vendor="10de", device="2230", cls="030000", root=root, bridges=[port, usp, dsp],
                                      driver="nvidia", numa=numa)
                pci[bdf]["local_cpulist"] = "0-31" if numa == 0 else "32-63"
                nvidia[bdf] = {"model": "NVIDIA RTX A6000"}
    return {"pci_devices": pci, "nvidia_gpus": nvidia, "iommu": {"enabled": False, "groups": {}},
            "sev_snp": {"snp": False, "enabled": False}, "pci_acs": {}}


def test_sixteen_gpus_matrix_levels_by_topology():
    hardware = sixteen_gpu_hardware()
    verdict, svg = render_svg("big", hardware)
    cells = matrix_cells(svg)
    assert len(verdict["gpus"]) == 16 and len(cells) == 16 * 15
    kinds = {cell["kind"] for cell in cells.values()}
    # no driver answer in these facts: pairs across root complexes are unknown, not impossible
    assert kinds == {"usable", "unknown"}
    # two GPUs below one switch: PIX (one downstream port each), possible and safe; two switches
    # under one root port: PXB
    same_switch = cells[(svg_id("0000:03:00.0"), svg_id("0000:04:00.0"))]
    assert same_switch["text"] == ["PIX", "ok"] and same_switch["kind"] == "usable"
    assert cells[(svg_id("0000:03:00.0"), svg_id("0000:07:00.0"))]["text"] == ["PXB", "ok"]
    assert cells[(svg_id("0000:03:00.0"), svg_id("0000:43:00.0"))]["text"] == ["NODE", "?"]
    across = cells[(svg_id("0000:03:00.0"), svg_id("0000:83:00.0"))]
    assert across["text"] == ["SYS", "?"] and across["kind"] == "unknown"
    assert node_texts(svg, "gpu_0000_83_00_0")[-1] == "NUMA 1 · CPUs 32-63"


def test_pci_id_names_fact_reads_pci_ids_lines_and_refuses_a_bad_id(tmp_path):
    """The fact's own command on pci.ids lines in the database's format (tab-indented devices,
    two spaces before a name, the class list at the end), run by the machine's awk."""
    import subprocess

    import pytest

    from facts.pci import PciIdNames

    database = tmp_path / "pci.ids"
    database.write_text(
        "# comment\n10b5  PLX Technology, Inc.\n\t8747  PEX 8747 48-Lane, 5-Port PCI Express Gen 3 (8.0 GT/s) Switch\n"
        "10de  NVIDIA Corporation\n\t2230  GA102GL [RTX A6000]\n\t\t10de 1459  RTX A6000\n\t2236  GA102GL [A10]\n"
        "C 03  Display controller\n\t02  3D controller\n")
    command = PciIdNames().command(["10de:2230", "10DE:2bb5"]).replace("/usr/share/misc/pci.ids", str(database))
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
    assert PciIdNames().process(run.stdout.splitlines()) == {
        "database": str(database), "vendors": {"10de": "NVIDIA Corporation"},
        "devices": {"10de:2230": "GA102GL [RTX A6000]"}}  # 2bb5 is not in it: absent
    with pytest.raises(ValueError, match="not a vendor:device ID: 10de:2230;"):
        PciIdNames().command(["10de:2230; reboot"])


def test_the_picture_renders_to_png_with_librsvg():
    """rsvg-convert (Debian librsvg2-bin, scripts/install-debs.sh) reads the SVG as a browser's
    SVG parser would; the 16-GPU picture comes out as a PNG wide enough for its matrix."""
    import shutil
    import struct
    import subprocess

    import pytest

    if not shutil.which("rsvg-convert"):
        pytest.skip("rsvg-convert is not installed (scripts/install-debs.sh installs librsvg2-bin)")
    hardware = sixteen_gpu_hardware()
    svg = graphviz.Source(topology_dot("big", hardware, verdict_from_hardware(hardware))).pipe(format="svg")
    png = subprocess.run(["rsvg-convert", "--format=png"], input=svg, capture_output=True, timeout=60)
    assert png.returncode == 0, png.stderr.decode()
    assert png.stdout[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png.stdout[16:24])
    assert width > 1500 and height > 800, (width, height)
