"""P2P verdict per GPU pair, on real driver outputs (tests/fixtures) and hand-built PCI trees
that mirror kpro6 (8 GPUs, each on its own root complex, AMD EPYC, SEV-SNP, translating IOMMU)."""

from pathlib import Path

import pytest

from facts.gpu import parse_p2p_matrix, parse_topo_matrix
from plan.p2p import derived_level, p2p_verdict, path_ports, restrict_verdict

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"

KPRO6_ROOTS = ["00", "20", "40", "60", "80", "a0", "c0", "e0"]
BLACKWELL = "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def fixture_lines(relative: str) -> list[str]:
    """A fixture's output lines, without its two header lines."""
    return (FIXTURES / relative).read_text().splitlines()[2:]


def pci_device(*, vendor, device, cls, root, bridges, driver=None, numa=None, group=None,
               link=(32.0, 16, 32.0, 16), bars=None):
    speed, width, max_speed, max_width = link
    return {
        "vendor": vendor, "device": device, "class": cls, "driver": driver, "numa_node": numa,
        "iommu_group": group,
        "link": {"speed": f"{speed} GT/s PCIe", "width": width,
                 "max_speed": f"{max_speed} GT/s PCIe", "max_width": max_width},
        "bars": bars or {}, "root": root, "bridges": bridges,
    }


def kpro6_pci(numa_of_root=lambda index: 0 if index < 4 else 1) -> dict:
    """8 GPUs (+ their audio functions), each behind its own root port on its own root complex."""
    pci = {}
    for index, bus in enumerate(KPRO6_ROOTS):
        root = f"pci0000:{bus}"
        port = f"0000:{bus}:01.1"
        gpu_bus = f"{int(bus, 16) + 1:02x}"
        numa = numa_of_root(index)
        pci[port] = pci_device(vendor="1022", device="14ab", cls="060400", root=root, bridges=[],
                               driver="pcieport", numa=numa, group=30 + index)
        pci[f"0000:{gpu_bus}:00.0"] = pci_device(
            vendor="10de", device="2bb5", cls="030200", root=root, bridges=[port], driver="nvidia",
            numa=numa, group=10 + index, bars={0: 64 << 20, 1: 128 << 30, 3: 32 << 20})
        pci[f"0000:{gpu_bus}:00.1"] = pci_device(
            vendor="10de", device="22e8", cls="040300", root=root, bridges=[port],
            driver="snd_hda_intel", numa=numa, group=10 + index)
    return pci


def kpro6_gpu_bdfs() -> list[str]:
    return [f"0000:{int(bus, 16) + 1:02x}:00.0" for bus in KPRO6_ROOTS]


def kpro6_nvidia_gpus() -> dict:
    return {bdf: {"model": BLACKWELL, "minor": i, "uuid": f"GPU-{i}", "firmware": "595.71.05"}
            for i, bdf in enumerate(kpro6_gpu_bdfs())}


def kpro6_topology() -> dict:
    """What nvidia-smi topo -m says for kpro6: NODE within a socket, SYS across."""
    names = [f"GPU{i}" for i in range(8)]
    links = {a: {b: ("NODE" if (i < 4) == (j < 4) else "SYS") for j, b in enumerate(names) if b != a}
             for i, a in enumerate(names)}
    return {"devices": names, "links": links,
            "cpu_affinity": {n: ("0-63" if i < 4 else "64-127") for i, n in enumerate(names)},
            "numa_affinity": {n: ("0" if i < 4 else "1") for i, n in enumerate(names)},
            "nics": {}}


def all_codes(code: str, n: int = 8) -> dict:
    names = [f"GPU{i}" for i in range(n)]
    return {a: {b: code for b in names if b != a} for a in names}


def kpro6_iommu(kind: str = "DMA-FQ") -> dict:
    """IommuState as on kpro6: every group of the GPUs and root ports has the same domain type."""
    groups = {group: kind for group in [*range(10, 18), *range(30, 38)]}
    mode = {"DMA-FQ": "translated", "identity": "passthrough"}[kind]
    return {"enabled": True, "units": ["ivhd0"], "mode": mode, "groups": groups,
            "group_modes": {group: mode for group in groups}, "devices": {}}


def kpro6_verdict(**changes) -> dict:
    facts = dict(pci=kpro6_pci(), nvidia_gpus=kpro6_nvidia_gpus(), topology=kpro6_topology(),
                 iommu=kpro6_iommu(), sev_snp={"snp": True, "enabled": True})
    facts.update(changes)
    return p2p_verdict(**facts)


@pytest.mark.parametrize("driver_answer", [None, "OK"])
def test_kpro6_every_pair_impossible_with_root_complex_and_sev_snp_reasons(driver_answer):
    verdict = kpro6_verdict(p2p_read=all_codes(driver_answer) if driver_answer else None)
    pairs = verdict["pairs"]
    assert len(pairs) == 28  # audio functions are not GPUs
    for pair in pairs:
        assert pair["possible"] is False and pair["safe"] is False
        a_root = "pci0000:" + KPRO6_ROOTS[kpro6_gpu_bdfs().index(pair["a"])]
        b_root = "pci0000:" + KPRO6_ROOTS[kpro6_gpu_bdfs().index(pair["b"])]
        root_reason = next(r for r in pair["reasons"] if "different root complexes" in r)
        if driver_answer:
            assert f"({a_root}, {b_root}) with no P2P path" in root_reason
        else:  # no driver answer: the root complexes leave P2P open; the IOMMU still blocks it
            assert f"({a_root}, {b_root}); whether the CPU routes P2P between them is unknown" in root_reason
            assert "iommu" in pair["reason_kinds"] and "root_complex" not in pair["reason_kinds"]
        assert any("SEV-SNP is on" in r for r in pair["reasons"])
        assert pair["driver_read"] == driver_answer
    assert verdict["summary"].startswith("P2P is impossible for all 28 GPU pairs.")
    if driver_answer:
        assert "different root complexes with no P2P path: 28 of 28" in verdict["summary"]


def test_kpro6_levels_come_from_the_driver_and_names_follow_pci_order():
    pairs = {tuple(p["names"]): p for p in kpro6_verdict()["pairs"]}
    assert pairs[("GPU0", "GPU1")]["level"] == "NODE"
    assert pairs[("GPU0", "GPU7")]["level"] == "SYS"
    assert pairs[("GPU0", "GPU7")]["a"] == "0000:01:00.0" and pairs[("GPU0", "GPU7")]["b"] == "0000:e1:00.0"


def test_level_alone_decides_nothing_epyc_routes_between_root_complexes_when_driver_says_ok():
    # Same 8 root complexes, but no SEV-SNP, IOMMU in identity mode, driver answers OK.
    verdict = kpro6_verdict(p2p_read=all_codes("OK"), p2p_write=all_codes("OK"),
                            iommu=kpro6_iommu("identity"), sev_snp={"snp": False, "enabled": False})
    assert all(p["possible"] and p["safe"] for p in verdict["pairs"])
    assert all("different root complexes" in " ".join(p["notes"]) for p in verdict["pairs"])
    assert verdict["summary"].startswith("P2P is possible and safe for all 28 GPU pairs.")


def test_translating_iommu_blocks_pcie_p2p_even_without_sev_snp():
    verdict = kpro6_verdict(p2p_read=all_codes("OK"), sev_snp={"snp": False, "enabled": False})
    pair = verdict["pairs"][0]
    assert not pair["possible"]
    assert pair["safe"] is False
    assert "iommu" in pair["reason_kinds"] and "sev_snp" not in pair["reason_kinds"]


def test_driver_refusal_is_reported_with_its_meaning():
    verdict = kpro6_verdict(p2p_read=all_codes("CNS"), iommu=kpro6_iommu("identity"), sev_snp=False)
    pair = verdict["pairs"][0]
    assert not pair["possible"]
    assert "the driver reports P2P read between GPU0 (0000:01:00.0) and GPU1 (0000:21:00.0) as CNS " \
           "(chipset not supported)" in pair["reasons"]


def test_blackwell_identity_domain_on_sev_snp_host_is_unsafe():
    verdict = kpro6_verdict(p2p_read=all_codes("OK"), iommu=kpro6_iommu("identity"))
    pair = verdict["pairs"][0]
    assert pair["possible"] and not pair["safe"]
    assert any("FSP error 0x177" in r for r in pair["reasons"])


def test_nvlink_8x_h100_fixture_all_pairs_possible_and_safe():
    topology = parse_topo_matrix(fixture_lines("topo-m/8x-h100-sxm-nv18-no-nics-stas00.txt"))
    p2p_read = parse_p2p_matrix(fixture_lines("topo-p2p/8x-gpu-p2p-r-all-ok-stas00.txt"))
    verdict = p2p_verdict(topology=topology, p2p_read=p2p_read)
    assert len(verdict["pairs"]) == 28
    assert {p["level"] for p in verdict["pairs"]} == {"NV18"}
    assert all(p["possible"] and p["safe"] and p["driver_read"] == "OK" for p in verdict["pairs"])
    assert "18 bonded NVLinks" in verdict["pairs"][0]["notes"][0]


def test_pcie_8x_fixture_levels_and_driver_answers_per_pair():
    topology = parse_topo_matrix(fixture_lines("topo-m/8x-pcie-gpu-dual-numa-pix-pairs-node-sys-no-nics.txt"))
    lines = fixture_lines("topo-p2p/8x-pcie-gpu-dual-numa-p2p-r-and-w-all-ok.txt")
    split = next(i for i, line in enumerate(lines) if "P2P Write" in line)
    verdict = p2p_verdict(topology=topology, p2p_read=parse_p2p_matrix(lines[:split]),
                          p2p_write=parse_p2p_matrix(lines[split:]))
    levels = {tuple(p["names"]): p["level"] for p in verdict["pairs"]}
    assert levels[("GPU0", "GPU1")] == "PIX" and levels[("GPU0", "GPU2")] == "NODE"
    assert levels[("GPU3", "GPU4")] == "SYS"
    assert all(p["possible"] and p["driver_write"] == "OK" for p in verdict["pairs"])


def test_geforce_gns_fixture_makes_the_pair_impossible():
    topology = parse_topo_matrix(fixture_lines("topo-m/2x-rtx5090-threadripper-3975wx-phb.txt"))
    p2p = parse_p2p_matrix(fixture_lines("topo-p2p/2x-rtx5090-threadripper-3975wx-p2p-rw-gns.txt"))
    (pair,) = p2p_verdict(topology=topology, p2p_read=p2p)["pairs"]
    assert not pair["possible"]
    assert pair["reason_kinds"] == ["driver"] and "GNS (GPU not supported)" in pair["reasons"][0]


def test_gpus_passed_to_a_vm_are_not_the_hosts_and_lose_p2p_inside_the_vm():
    pci = kpro6_pci()
    nvidia_gpus = kpro6_nvidia_gpus()
    vm_gpus = kpro6_gpu_bdfs()[:2]
    for bdf in vm_gpus:
        pci[bdf]["driver"] = "vfio-pci"
        del nvidia_gpus[bdf]
    roles = {bdf: "vm:101" for bdf in vm_gpus}
    topology = kpro6_topology()  # the host's nvidia-smi now sees 6 GPUs
    topology["devices"] = topology["devices"][:6]
    verdict = kpro6_verdict(pci=pci, nvidia_gpus=nvidia_gpus, roles=roles, topology=topology)
    vm_pair = next(p for p in verdict["pairs"] if {p["a"], p["b"]} == set(vm_gpus))
    assert vm_pair["names"] == [None, None]
    assert vm_pair["level"] == "NODE" and vm_pair["level_source"] == "pci"
    assert "0000:01:00.0 is passed through to VM 101 (vfio-pci): the host's driver does not see it, " \
           "so no host P2P with it" in vm_pair["reasons"]
    assert "virtual_root_port" in vm_pair["reason_kinds"]
    # nvidia-smi renumbers the GPUs it still sees, in PCI order.
    named = {g["bdf"]: g["name"] for g in verdict["gpus"]}
    assert named["0000:41:00.0"] == "GPU0" and named["0000:e1:00.0"] == "GPU5"


def vm_pci(cliques: tuple = (None, None)) -> dict:
    """A QEMU q35 guest: two GPUs, each behind its own pcie-root-port (1b36:000c)."""
    pci = {}
    for slot in range(2):
        port = f"0000:00:1c.{slot}"
        bdf = f"0000:0{slot + 1}:00.0"
        pci[port] = pci_device(vendor="1b36", device="000c", cls="060400", root="pci0000:00",
                               bridges=[], driver="pcieport")
        pci[bdf] = pci_device(vendor="10de", device="2bb5", cls="030200", root="pci0000:00",
                              bridges=[port], driver="nvidia")
    return pci


def test_inside_a_vm_each_gpu_behind_its_own_virtual_root_port():
    """Without a driver answer and without a clique, or with the driver refusing: impossible, and
    NCCL keeps off by itself. Issue 43 item 7: where the driver answers OK there (a hypervisor's
    GPUDirect clique), the pair is unsafe, not impossible: NCCL follows the driver."""
    pci = vm_pci()
    (pair,) = p2p_verdict(pci=pci, iommu={"enabled": False, "groups": {}})["pairs"]
    assert pair["status"] == "impossible"
    assert pair["reasons"] == [
        "GPU0 (0000:01:00.0) and GPU1 (0000:02:00.0) sit behind separate virtual root ports of this VM "
        "(0000:00:1c.0, 0000:00:1c.1): P2P between them is impossible"
    ]
    assert pair["level"] == "PHB"  # derived from sysfs: they meet at the host bridge
    (refused,) = p2p_verdict(pci=pci, iommu={"enabled": False, "groups": {}}, p2p_read=all_codes("CNS", 2))["pairs"]
    assert refused["status"] == "impossible" and refused["reason_kinds"] == ["driver", "virtual_root_port"]
    (claimed,) = p2p_verdict(pci=pci, iommu={"enabled": False, "groups": {}}, p2p_read=all_codes("OK", 2))["pairs"]
    assert claimed["status"] == "unsafe" and claimed["reason_kinds"] == ["vm_clique"]
    assert claimed["reasons"][0].startswith(
        "GPU0 (0000:01:00.0) and GPU1 (0000:02:00.0) sit behind separate virtual root ports of this VM "
        "(0000:00:1c.0, 0000:00:1c.1), yet the driver answers P2P OK: through QEMU's virtual root ports NCCL")


def switch_pci() -> dict:
    """Two GPUs behind one PCIe switch (root port -> upstream port -> two downstream ports)."""
    pci = {}
    rp, usp, dsp0, dsp1 = "0000:40:01.1", "0000:41:00.0", "0000:42:00.0", "0000:42:01.0"
    for bdf, bridges in ((rp, []), (usp, [rp]), (dsp0, [rp, usp]), (dsp1, [rp, usp])):
        pci[bdf] = pci_device(vendor="10b5", device="c010", cls="060400", root="pci0000:40",
                              bridges=bridges, driver="pcieport", numa=0)
    for bdf, dsp in (("0000:43:00.0", dsp0), ("0000:44:00.0", dsp1)):
        pci[bdf] = pci_device(vendor="10de", device="2230", cls="030000", root="pci0000:40",
                              bridges=[rp, usp, dsp], driver="nvidia", numa=0, group=None)
    return pci


def acs(redirect: bool) -> dict:
    ctl = {"SrcValid": False, "ReqRedir": redirect, "CmpltRedir": redirect, "EgressCtrl": False}
    return {"status": "enabled", "redirect": redirect, "ctl": ctl}


def test_acs_redirect_on_a_switch_port_makes_the_pair_unsafe_and_names_the_port():
    pci = switch_pci()
    bridges = {bdf: acs(bdf == "0000:42:01.0") for bdf, dev in pci.items() if dev["class"] == "060400"}
    (pair,) = p2p_verdict(pci=pci, acs=bridges, iommu={"enabled": False, "groups": {}})["pairs"]
    assert pair["possible"] and pair["safe"] is False and pair["status"] == "unsafe"
    assert pair["reason_kinds"] == ["acs"]
    assert pair["reasons"][0].startswith(
        "ACS on switch port 0000:42:01.0 between GPU0 (0000:43:00.0) and GPU1 (0000:44:00.0) has P2P Request Redirect, "
        "P2P Completion Redirect on (ReqRedir+ CmpltRedir+)")
    assert pair["level"] == "PIX"


def test_acs_on_the_switch_upstream_port_both_meet_at_counts_too():
    """p2pdma.c's walk counts the common upstream bridge: ACS there decides as well."""
    pci = switch_pci()
    bridges = {bdf: acs(bdf == "0000:41:00.0") for bdf, dev in pci.items() if dev["class"] == "060400"}
    (pair,) = p2p_verdict(pci=pci, acs=bridges, iommu={"enabled": False, "groups": {}})["pairs"]
    assert pair["status"] == "unsafe" and "0000:41:00.0" in pair["reasons"][0]
    # the root port above the meeting point is not on the path
    bridges = {bdf: acs(bdf == "0000:40:01.1") for bdf, dev in pci.items() if dev["class"] == "060400"}
    (pair,) = p2p_verdict(pci=pci, acs=bridges, iommu={"enabled": False, "groups": {}})["pairs"]
    assert pair["status"] == "usable"


def test_switch_without_acs_redirect_is_usable_and_unknown_acs_is_noted():
    pci = switch_pci()
    bridges = {"0000:41:00.0": acs(False), "0000:42:00.0": acs(False),
               "0000:42:01.0": {"status": "unknown", "redirect": None, "ctl": None}}
    (pair,) = p2p_verdict(pci=pci, acs=bridges, iommu={"enabled": False, "groups": {}})["pairs"]
    assert pair["possible"] and pair["safe"] and pair["status"] == "usable"
    assert pair["notes"] == ["ACS state of switch port 0000:42:01.0 is unknown"]
    assert "through at most one PCIe bridge" in pair["reasons"][0]


def test_source_validation_alone_on_a_root_port_of_a_node_pair_does_not_make_it_unsafe():
    """Issue 30 looked at the root ports of NODE pairs; issue 43 item 6: Source Validation alone
    redirects nothing (the kernel's p2pdma.c pci_bridge_has_acs_redir tests RR|CR|EC only): the
    pair stays usable and the port's bits are a note; Request Redirect on the same port decides."""
    sv_ctl = {"SrcValid": True, "ReqRedir": False, "CmpltRedir": False, "UpstreamFwd": False}
    sv_only = {"status": "enabled", "redirect": False, "ctl": sv_ctl}
    ports = {f"0000:{bus}:01.1": (sv_only if bus == "20" else acs(False)) for bus in KPRO6_ROOTS}
    verdict = kpro6_verdict(p2p_read=all_codes("OK"), p2p_write=all_codes("OK"), iommu=kpro6_iommu("identity"),
                            sev_snp=False, acs=ports)
    pairs = {tuple(p["names"]): p for p in verdict["pairs"]}
    assert {p["status"] for p in verdict["pairs"]} == {"usable"}
    assert "ACS on root port 0000:20:01.1 has Source Validation on (SrcValid+): these do not redirect peer " \
           "traffic" in pairs[("GPU0", "GPU1")]["notes"][1]
    ports["0000:20:01.1"] = {**sv_only, "ctl": {**sv_ctl, "ReqRedir": True}}
    verdict = kpro6_verdict(p2p_read=all_codes("OK"), p2p_write=all_codes("OK"), iommu=kpro6_iommu("identity"),
                            sev_snp=False, acs=ports)
    bad = {tuple(p["names"]): p for p in verdict["pairs"]}[("GPU0", "GPU1")]
    assert bad["status"] == "unsafe" and bad["reason_kinds"] == ["acs"]
    assert "ACS on root port 0000:20:01.1 between GPU0 (0000:01:00.0) and GPU1 (0000:21:00.0) has P2P Request " \
           "Redirect on (ReqRedir+)" in bad["reasons"][0]
    assert sum(p["status"] == "unsafe" for p in verdict["pairs"]) == 7  # every pair with GPU1


# Issue 43 item 6: the ACSCtl line of the PEX890xx switch ports on an 8x RTX PRO 6000 host that
# measured P2P on all 28 pairs (lspci -vvv prints all seven bits; the issue quotes SrcValid+ and
# UpstreamFwd+ with the redirects off).
PEX890XX_ACSCTL = "\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir- CmpltRedir- UpstreamFwd+ EgressCtrl- DirectTrans-"


def pex890xx_host() -> tuple[dict, dict]:
    """8 GPUs behind two Broadcom PEX890xx switches (1000:c030), one per root complex and NUMA
    node: root port -> switch upstream port -> 4 downstream ports -> one GPU each. Every bridge's
    config space carries an ACS capability with the control word of the issue's ACSCtl line."""
    pci: dict = {}
    for numa, bus in enumerate((0x00, 0x80)):
        root = f"pci0000:{bus:02x}"
        rp, usp = f"0000:{bus:02x}:01.1", f"0000:{bus + 1:02x}:00.0"
        pci[rp] = pci_device(vendor="1022", device="14ab", cls="060400", root=root, bridges=[], numa=numa)
        pci[usp] = pci_device(vendor="1000", device="c030", cls="060400", root=root, bridges=[rp], numa=numa)
        for slot in range(4):
            dsp = f"0000:{bus + 2:02x}:{slot:02x}.0"
            pci[dsp] = pci_device(vendor="1000", device="c030", cls="060400", root=root, bridges=[rp, usp],
                                  numa=numa)
            pci[f"0000:{bus + 3 + slot:02x}:00.0"] = pci_device(
                vendor="10de", device="2bb5", cls="030200", root=root, bridges=[rp, usp, dsp], driver="nvidia",
                numa=numa)
    gpus = sorted(bdf for bdf, dev in pci.items() if dev["class"] == "030200")
    nvidia_gpus = {bdf: {"model": BLACKWELL, "minor": i} for i, bdf in enumerate(gpus)}
    return pci, nvidia_gpus


def test_pex890xx_switch_ports_with_source_validation_and_upstream_forwarding_leave_all_28_pairs_usable(tmp_path):
    """Issue 43 item 6: the config bytes that give exactly the issue's ACSCtl bits, read by
    PciAcs's own command from a sysfs tree, agree with the lspci line; with them on every port,
    every pair the driver answers OK for is usable (before: all 28 unsafe, NCCL_P2P_DISABLE=1)."""
    from facts.pci import ACS_FLAGS, parse_acs
    from plan.nccl import nccl_environment
    from tests.unit.test_pci_acs_config import config, read_acs

    pci, nvidia_gpus = pex890xx_host()
    ctl_word = sum(1 << bit for bit, flag in enumerate(ACS_FLAGS) if f"{flag}+" in PEX890XX_ACSCTL)
    assert ctl_word == 0x11  # PCI_ACS_SV | PCI_ACS_UF (include/uapi/linux/pci_regs.h)
    bridges = {bdf: ("0x060400", config(caps=[(0x0001, 0), (0x000D, ctl_word)]))
               for bdf, dev in pci.items() if dev["class"] == "060400"}
    read, _ = read_acs(tmp_path, bridges)
    from_lspci = parse_acs(["0000:02:00.0 0604: 1000:c030", PEX890XX_ACSCTL])["0000:02:00.0"]
    assert {bdf: entry["ctl"] for bdf, entry in read.items()} == {bdf: from_lspci["ctl"] for bdf in bridges}
    assert from_lspci["redirect"] is False and from_lspci["status"] == "enabled"

    verdict = p2p_verdict(pci=pci, nvidia_gpus=nvidia_gpus, acs=read, p2p_read=all_codes("OK"),
                          p2p_write=all_codes("OK"), iommu={"enabled": False, "groups": {}}, sev_snp=False)
    assert len(verdict["pairs"]) == 28
    assert {p["status"] for p in verdict["pairs"]} == {"usable"}
    assert verdict["summary"].startswith("P2P is possible and safe for all 28 GPU pairs.")
    pair = verdict["pairs"][0]
    assert pair["level"] == "PIX"
    assert "ACS on switch port 0000:02:00.0 has Source Validation and Upstream Forwarding on (SrcValid+ " \
           "UpstreamFwd+): these do not redirect peer traffic" in pair["notes"][0]
    env = nccl_environment(verdict, nccl_version="2.27.7", cpu_vendor="AuthenticAMD")
    assert "NCCL_P2P_DISABLE" not in env and "NCCL_P2P_LEVEL" not in env and env == {}


def test_no_driver_answer_across_root_complexes_is_unknown_not_impossible():
    verdict = kpro6_verdict(iommu=kpro6_iommu("identity"), sev_snp=False)
    pair = verdict["pairs"][0]
    assert pair["possible"] is None and pair["safe"] is None and pair["status"] == "unknown"
    assert pair["reason_kinds"] == ["root_complex_unknown"]
    assert "no P2P path" not in " ".join(pair["reasons"])
    assert verdict["summary"].startswith("Whether P2P is possible is unknown for all 28 GPU pairs.")
    # the driver's answer settles it
    settled = kpro6_verdict(iommu=kpro6_iommu("identity"), sev_snp=False, p2p_read=all_codes("CNS"))
    assert settled["pairs"][0]["status"] == "impossible"


def test_legacy_soc_level_is_sys():
    topology = kpro6_topology()
    topology["links"]["GPU0"]["GPU7"] = "SOC"
    pairs = {tuple(p["names"]): p for p in kpro6_verdict(topology=topology)["pairs"]}
    assert pairs[("GPU0", "GPU7")]["level"] == "SYS"


def test_path_ports_walk_both_sides_up_to_the_meeting_point_or_the_root_complexes():
    a = gpu("pci0000:40", ["r", "u", "d0"])
    b = gpu("pci0000:40", ["r", "u", "d1"])
    assert path_ports(a, b) == ["d0", "u", "d1"]
    assert path_ports(gpu("pci0000:40", ["r0"]), gpu("pci0000:40", ["r1"])) == ["r0", "r1"]
    assert path_ports(gpu("pci0000:40", ["r0", "u0"]), gpu("pci0000:60", ["r1"])) == ["u0", "r0", "r1"]


def gpu(root, bridges, numa=0):
    return {"root": root, "bridges": bridges, "numa_node": numa}


@pytest.mark.parametrize("a, b, level", [
    (gpu("pci0000:40", ["r", "u", "d0"]), gpu("pci0000:40", ["r", "u", "d1"]), "PIX"),
    (gpu("pci0000:40", ["r", "u", "d0", "u2", "d2"]), gpu("pci0000:40", ["r", "u", "d1"]), "PXB"),
    (gpu("pci0000:40", ["r0"]), gpu("pci0000:40", ["r1"]), "PHB"),
    (gpu("pci0000:40", ["r0"]), gpu("pci0000:60", ["r1"]), "NODE"),
    (gpu("pci0000:40", ["r0"], 0), gpu("pci0000:80", ["r1"], 1), "SYS"),
    (gpu("pci0000:40", ["r0"], None), gpu("pci0000:80", ["r1"], None), "SYS"),
])
def test_levels_derived_from_pci_paths(a, b, level):
    assert derived_level(a, b) == level


def test_restrict_verdict_keeps_only_the_containers_pairs():
    verdict = kpro6_verdict()
    mine = restrict_verdict(verdict, kpro6_gpu_bdfs()[:3])
    assert len(mine["pairs"]) == 3 and len(mine["gpus"]) == 3
    assert mine["summary"].startswith("P2P is impossible for all 3 GPU pairs.")
    assert restrict_verdict(verdict, kpro6_gpu_bdfs()[:1])["summary"].startswith("Fewer than two GPUs")


def test_kpro6_twin_hardware_read_by_the_real_probe_gives_the_kpro6_verdict(tmp_path):
    """The kpro6 twin profile rendered into a tmp root (no sshd needed) and read by HardwareProbe's
    own command: its absolute /sys and /proc paths point at the rendered tree, nvidia-smi at the
    twin's stand-in, and the printed paths are mapped back before the probe's parsers see them."""
    import os
    import subprocess

    from facts.hardware import HardwareProbe
    from tests.twin import hardware as twin_hardware

    root = tmp_path / "kpro6"
    twin_hardware.install(root, "kpro6")
    hw = root / "var/lib/twin/hw"
    command = (HardwareProbe().command.replace("/sys/", f"{hw}/sys/").replace("/proc/", f"{hw}/proc/")
               .replace("nvidia-smi", str(root / "usr/local/bin/nvidia-smi")))
    run = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TWIN_ROOT": str(root)})
    facts = HardwareProbe().process(run.stdout.replace(str(hw), "").splitlines())
    verdict = p2p_verdict(pci=facts["pci_devices"], nvidia_gpus=facts["nvidia_gpus"], topology=facts["topology"],
                          p2p_read=facts["p2p_read"], p2p_write=facts["p2p_write"], iommu=facts["iommu"],
                          sev_snp=facts["sev_snp"], acs=facts["pci_acs"])
    assert len(verdict["pairs"]) == 28
    for pair in verdict["pairs"]:
        assert pair["driver_read"] == "OK"  # the driver says OK; the verdict still says no
        assert not pair["possible"] and not pair["safe"]
        assert pair["reason_kinds"][0] == "root_complex" and "sev_snp" in pair["reason_kinds"]
    assert verdict["summary"].startswith("P2P is impossible for all 28 GPU pairs.")


def test_real_recorded_acs_control_on_a_port_of_the_path_names_it():
    """The ACSCtl line recorded on a Matisse downstream port (tests/fixtures/lspci, SrcValid+
    ReqRedir+ CmpltRedir+ UpstreamFwd+, what the kernel enables with the IOMMU on) on the path of
    a GPU pair; the ESC8000A's recorded 'all off' on every port leaves the pair usable."""
    from facts.pci import parse_acs

    port = "0000:03:02.0"
    recorded = parse_acs(["bridge 0000:03:02.0"] + fixture_lines(
        "lspci/amd-matisse-switch-downstream-port-acs-enabled-lspci-vvv.txt"))
    assert recorded[port]["status"] == "enabled"
    pci = switch_pci()
    pci = {bdf.replace("0000:42:01.0", port): {**dev, "bridges": [b.replace("0000:42:01.0", port) for b in dev["bridges"]]}
           for bdf, dev in pci.items()}
    off_line = next(line for line in fixture_lines("lspci/4x-rtx6000ada-asus-esc8000a-e12-acsctl-all-off.txt")
                    if "ACSCtl" in line)
    all_off = parse_acs(["0000:00:00.0 0604: 1022:14ab", off_line])["0000:00:00.0"]
    acs_facts = {bdf: all_off for bdf, dev in pci.items() if dev["class"] == "060400"}
    (usable,) = p2p_verdict(pci=pci, acs=acs_facts, iommu={"enabled": False, "groups": {}})["pairs"]
    assert usable["status"] == "usable"
    (pair,) = p2p_verdict(pci=pci, acs={**acs_facts, port: recorded[port]},
                          iommu={"enabled": False, "groups": {}})["pairs"]
    assert pair["status"] == "unsafe" and pair["reason_kinds"] == ["acs"]
    assert f"ACS on switch port {port}" in pair["reasons"][0]
    # Source Validation and Upstream Forwarding redirect nothing (p2pdma.c): only RR and CR are named
    assert "has P2P Request Redirect, P2P Completion Redirect on (ReqRedir+ CmpltRedir+)" in pair["reasons"][0]


# Issue 43 item 8: GeForce cards on a P2P-patched open driver. The 5-GPU RTX 50-series EPYC host
# of aikitoria/open-gpu-kernel-modules issue 13 (tests/fixtures: topo -m NODE/PHB, topo -p2p all OK);
# the params file is the one recorded on the h200-vm (tests/fixtures/h200-vm/driver-params.txt,
# format of nv-procfs.c) with its RegistryDwords line as the user of club-3090 issue 873 / docs
# PCIE_P2P.md confirmed it live: "RMForceStaticBar1=1;PeerMappingOverride=1".
AIKITORIA_MODELS = ("NVIDIA GeForce RTX 5090", "NVIDIA GeForce RTX 5080", "NVIDIA GeForce RTX 5070 Ti",
                    "NVIDIA GeForce RTX 5060 Ti", "NVIDIA GeForce RTX 5090")
STATIC_BAR1_LINE = 'RegistryDwords: "RMForceStaticBar1=1;PeerMappingOverride=1"'


def params_with(registry_line: str | None) -> dict:
    from facts.nvidia import parse_colon_params

    lines = fixture_lines("h200-vm/driver-params.txt")
    if registry_line is not None:
        lines = [registry_line if line.startswith("RegistryDwords:") else line for line in lines]
    return parse_colon_params(lines)


def geforce_verdict(nvidia_params: dict | None) -> dict:
    topology = parse_topo_matrix(fixture_lines("topo-m/5gpu-rtx50-epyc-node-phb-aikitoria-13.txt"))
    p2p = parse_p2p_matrix(fixture_lines(
        "topo-p2p/5gpu-rtx50-epyc-p2p-p-all-ok-patched-plus-usage-error-fragment.txt"))
    gpus = {f"0000:{bus}:00.0": {"model": model, "minor": i}
            for i, (bus, model) in enumerate(zip(("01", "21", "41", "61", "81"), AIKITORIA_MODELS, strict=True))}
    return p2p_verdict(topology=topology, nvidia_gpus=gpus, p2p_read=p2p, p2p_write=p2p,
                       nvidia_params=nvidia_params)


def test_geforce_pairs_the_patched_driver_says_ok_for_are_unsafe_without_the_static_bar1_mapping():
    from plan.nccl import nccl_environment

    verdict = geforce_verdict(params_with(None))  # the recorded file: RegistryDwords: ""
    assert len(verdict["pairs"]) == 10
    for pair in verdict["pairs"]:
        assert pair["driver_read"] == "OK" and pair["status"] == "unsafe" and pair["reason_kinds"] == ["static_bar1"]
    reason = verdict["pairs"][0]["reasons"][0]
    assert reason.startswith("GPU0 (0000:01:00.0) and GPU1 (0000:21:00.0) are GeForce cards and the driver "
                             "answers P2P OK over PCIe")
    assert "lack PeerMappingOverride=1;RMForceStaticBar1=1" in reason and "The OK is not proof" in reason
    env = nccl_environment(verdict, nccl_version="2.27.7", cpu_vendor="AuthenticAMD")
    assert env["NCCL_P2P_DISABLE"]["value"] == "1" and "GeForce cards" in env["NCCL_P2P_DISABLE"]["reason"]
    assert env["NCCL_WIN_ENABLE"]["value"] == "0"

    # with the mapping on, the driver's OK stands
    mapped = geforce_verdict(params_with(STATIC_BAR1_LINE))
    assert {p["status"] for p in mapped["pairs"]} == {"usable"}
    assert nccl_environment(mapped, nccl_version="2.27.7", cpu_vendor="AuthenticAMD") == {}
    # only one of the two keys, or AUTO (2): still unsafe, naming what is missing
    half = geforce_verdict(params_with('RegistryDwords: "RMForceStaticBar1=2;PeerMappingOverride=1"'))
    assert "lack RMForceStaticBar1=1," in half["pairs"][0]["reasons"][0]
    # per GPU (RegistryDwordsPerDevice) for GPU0 and GPU1 only: their pair is usable, the others not
    per_device = params_with(None)
    per_device["RegistryDwordsPerDevice"] = (
        '"pci=0000:01:00.0;RMForceStaticBar1=1;PeerMappingOverride=1;pci=21:00;RMForceStaticBar1=0x1;'
        'PeerMappingOverride=1"')
    statuses = {tuple(p["names"]): p["status"] for p in geforce_verdict(per_device)["pairs"]}
    assert statuses[("GPU0", "GPU1")] == "usable" and statuses[("GPU0", "GPU2")] == "unsafe"
    # params not read at all: unknown mapping, still unsafe
    assert "was not read" in geforce_verdict(None)["pairs"][0]["reasons"][0]


def test_geforce_pairs_the_driver_refuses_or_joins_by_nvlink_are_not_the_static_bar1_case():
    topology = parse_topo_matrix(fixture_lines("topo-m/2x-rtx5090-threadripper-3975wx-phb.txt"))
    p2p = parse_p2p_matrix(fixture_lines("topo-p2p/2x-rtx5090-threadripper-3975wx-p2p-rw-gns.txt"))
    gpus = {"0000:01:00.0": {"model": "NVIDIA GeForce RTX 5090"}, "0000:41:00.0": {"model": "NVIDIA GeForce RTX 5090"}}
    (pair,) = p2p_verdict(topology=topology, p2p_read=p2p, nvidia_gpus=gpus, nvidia_params=params_with(None))["pairs"]
    assert pair["reason_kinds"] == ["driver"]
    topology = parse_topo_matrix(fixture_lines("topo-m/2x-rtx3090-nvlink-nv4-x299-proxmox-lxc.txt"))
    ok = parse_p2p_matrix(fixture_lines("topo-p2p/2x-rtx3090-nvlink-p2p-ok-proxmox-lxc.txt"))
    gpus = {"0000:17:00.0": {"model": "NVIDIA GeForce RTX 3090"}, "0000:65:00.0": {"model": "NVIDIA GeForce RTX 3090"}}
    (pair,) = p2p_verdict(topology=topology, p2p_read=ok, nvidia_gpus=gpus, nvidia_params=params_with(None))["pairs"]
    assert pair["status"] == "usable" and pair["level"] == "NV4"


def test_the_hardware_probes_params_reach_the_verdict_and_the_report():
    """verdict_from_hardware hands the HardwareProbe's nvidia_params (NvidiaDriverParams) on: the
    topology report and its NCCL lines say why the GeForce pairs are unsafe."""
    from plan.nccl import nccl_environment
    from plan.topology_report import topology_text, verdict_from_hardware

    base = geforce_verdict(None)
    topology = parse_topo_matrix(fixture_lines("topo-m/5gpu-rtx50-epyc-node-phb-aikitoria-13.txt"))
    p2p = parse_p2p_matrix(fixture_lines(
        "topo-p2p/5gpu-rtx50-epyc-p2p-p-all-ok-patched-plus-usage-error-fragment.txt"))
    gpus = {g["bdf"]: {"model": AIKITORIA_MODELS[i]} for i, g in enumerate(base["gpus"])}
    hardware = {"topology": topology, "nvidia_gpus": gpus, "p2p_read": p2p, "p2p_write": p2p,
                "nvidia_params": params_with(None)}
    verdict = verdict_from_hardware(hardware)
    text = topology_text("epyc", hardware, verdict, nccl_environment(verdict, nccl_version="2.27.7"))
    assert "GeForce P2P the driver says OK for without its static BAR1 mapping: 10 of 10" in text
    assert "NCCL_P2P_DISABLE=1" in text
    hardware["nvidia_params"] = params_with(STATIC_BAR1_LINE)
    assert {p["status"] for p in verdict_from_hardware(hardware)["pairs"]} == {"usable"}


def test_a_vm_whose_gpus_share_a_gpudirect_clique_is_unsafe_and_nccl_p2p_is_disabled(tmp_path):
    """Issue 43 item 7: a q35 guest whose two GPUs carry QEMU's x-nv-gpudirect-clique capability
    (config bytes laid out as the cloud T4 guest's lspci shows, read by PciAcs's own command):
    the driver answers OK (club-3090 docs/PCIE_P2P.md: topo -p2p went CNS -> OK with the clique)
    and NCCL hung at the first collective until NCCL_P2P_DISABLE=1. Before: "impossible", no
    NCCL variable."""
    from facts.pci import PciAcs
    from plan.nccl import nccl_environment
    from tests.unit.test_pci_acs_config import _out, _sysfs, config, guest_gpu_config

    pci = vm_pci()
    env = _sysfs(tmp_path, {"0000:00:1c.0": ("0x060400", config(caps=[(0x000D, 0)])),
                            "0000:00:1c.1": ("0x060400", config(caps=[(0x000D, 0)])),
                            "0000:01:00.0": ("0x030200", guest_gpu_config(1)),
                            "0000:02:00.0": ("0x030200", guest_gpu_config(1))})
    for bdf in ("0000:01:00.0", "0000:02:00.0"):
        (tmp_path / "sys/bus/pci/devices" / bdf / "vendor").write_text("0x10de\n")
    acs = PciAcs().process(_out(tmp_path, PciAcs().command, env).splitlines())
    iommu = {"enabled": False, "groups": {}}
    for answer in ("OK", None):
        (pair,) = p2p_verdict(pci=pci, acs=acs, iommu=iommu,
                              p2p_read=all_codes(answer, 2) if answer else None)["pairs"]
        assert pair["status"] == "unsafe" and pair["reason_kinds"] == ["vm_clique"]
        assert "the hypervisor put both in GPUDirect clique 1 (QEMU x-nv-gpudirect-clique)" in pair["reasons"][0]
        assert "NCCL then used P2P and hung at its first collective" in pair["reasons"][0]
        nccl = nccl_environment({"pairs": [pair]}, nccl_version="2.21.5")
        assert nccl["NCCL_P2P_DISABLE"]["value"] == "1"
        assert "GPUDirect clique 1" in nccl["NCCL_P2P_DISABLE"]["reason"]
        assert nccl["NCCL_P2P_DISABLE"]["unknown"] is (answer is None)
    # different cliques: the driver's chipset check decides (a q35 host bridge: CNS), impossible
    acs["0000:02:00.0"] = {**acs["0000:02:00.0"], "clique": 2}
    (pair,) = p2p_verdict(pci=pci, acs=acs, iommu=iommu)["pairs"]
    assert pair["status"] == "impossible" and pair["reason_kinds"] == ["virtual_root_port"]
