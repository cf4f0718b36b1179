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
    assert "different root complexes (pci0000:00, pci0000:e0) with no P2P path" in lines[pair + 1]
    assert "SEV-SNP is on" in lines[pair + 3]
    assert sum(1 for line in lines if re.match(r"^  GPU\d - GPU\d ", line)) == 28
    nccl = lines.index("NCCL environment (/etc/nccl.conf on the host):")
    assert lines[nccl + 2].startswith("  NCCL_P2P_DISABLE=1") and "SEV-SNP" in lines[nccl + 2]


def test_links_below_their_maximum_are_flagged():
    assert link_text({"speed": "32.0 GT/s PCIe", "width": 8, "max_speed": "32.0 GT/s PCIe", "max_width": 16}) == (
        "32.0 GT/s x8 (max 32.0 GT/s x16) DOWNTRAINED: x8 of x16")
    idle = link_text({"speed": "2.5 GT/s PCIe", "width": 16, "max_speed": "32.0 GT/s PCIe", "max_width": 16})
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


def test_kpro6_diagram_has_numa_and_root_complex_clusters_and_red_p2p_edges():
    hardware = kpro6_hardware()
    source = topology_dot("kpro6", hardware, verdict_from_hardware(hardware))
    assert "subgraph cluster_numa_0 {" in source and "subgraph cluster_numa_1 {" in source
    assert len(re.findall(r"subgraph cluster_rc_pci0000_\w\w \{", source)) == 8
    p2p_edges = re.findall(r"^\s*p2p_\w+ -- p2p_\w+ \[(.*)\]$", source, re.M)
    assert len(p2p_edges) == 28 and all("color=red3" in e and "style=dashed" in e for e in p2p_edges)
    assert "rc_pci0000_40 -- bridge_0000_40_01_1" in source
    assert "gpu_0000_e1_00_0 -- p2p_0000_e1_00_0" in source
    svg = graphviz.Source(source).pipe(format="svg").decode()
    assert svg.count('class="cluster"') == 11 and "GPU7" in svg


def test_nvlink_fixture_diagram_without_pci_facts_has_green_edges():
    topology = parse_topo_matrix(fixture_lines("topo-m/8x-h100-sxm-nv18-no-nics-stas00.txt"))
    p2p_read = parse_p2p_matrix(fixture_lines("topo-p2p/8x-gpu-p2p-r-all-ok-stas00.txt"))
    hardware = {"topology": topology, "p2p_read": p2p_read}
    verdict = verdict_from_hardware(hardware)
    source = topology_dot("hgx", hardware, verdict)
    edges = re.findall(r"^\s*p2p_GPU\d -- p2p_GPU\d \[(.*)\]$", source, re.M)
    assert len(edges) == 28 and all("color=darkgreen" in e and "label=NV18" in e for e in edges)
    assert graphviz.Source(source).pipe(format="svg").decode().count("<g id=\"edge") == 28
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
    assert "color=darkgreen" in source  # the two GPUs behind the switch: P2P usable
    assert "<svg" in graphviz.Source(source).pipe(format="svg").decode()


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
