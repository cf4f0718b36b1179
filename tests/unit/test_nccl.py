from typing import Any

"""NCCL variables from the P2P verdict, RDMA devices and the spec; /etc/nccl.conf rendering."""

import pytest

from facts.gpu import parse_p2p_matrix, parse_topo_matrix
from plan.nccl import (
    NCCL_P2P_LEVELS,
    NCCL_RULES,
    describe_nccl_environment,
    nccl_default_level,
    nccl_environment,
    nccl_level_value,
    nccl_plan,
    nccl_plan_for_spec,
    render_nccl_conf,
    safe_p2p_cutoff,
)
from plan.p2p import p2p_verdict
from tests.unit.test_p2p import all_codes, fixture_lines, kpro6_gpu_bdfs, kpro6_verdict


def nvlink_verdict() -> dict:
    topology = parse_topo_matrix(fixture_lines("topo-m/8x-h100-sxm-nv18-dual-numa-ht-fragment.txt"))
    p2p_read = parse_p2p_matrix(fixture_lines("topo-p2p/8x-gpu-p2p-r-all-ok-stas00.txt"))
    return p2p_verdict(topology=topology, p2p_read=p2p_read)


def pcie_8x(read_codes=None) -> tuple[dict, dict]:
    """The 8-GPU PCIe fixture (PIX pairs, NODE within a socket, SYS across) and its verdict."""
    topology = parse_topo_matrix(fixture_lines("topo-m/8x-pcie-gpu-dual-numa-pix-pairs-node-sys-no-nics.txt"))
    p2p_read = read_codes or parse_p2p_matrix(fixture_lines("topo-p2p/8x-pcie-gpu-dual-numa-p2p-r-and-w-all-ok.txt"))
    return topology, p2p_verdict(topology=topology, p2p_read=p2p_read)


def cross_socket_refused() -> dict:
    """Driver answers for the PCIe fixture where P2P across sockets (SYS) is not supported."""
    topology, _ = pcie_8x()
    return {a: {b: ("CNS" if level == "SYS" else "OK") for b, level in links.items() if b.startswith("GPU")}
            for a, links in topology["links"].items()}


def nccl_conf_values(text: str) -> dict:
    """What NCCL itself reads from the file: '#' lines skipped, NAME=value split at the first '='."""
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or "=" not in line:
            continue
        name, value = line.split("=", 1)
        values[name] = value
    return values


def test_kpro6_disables_p2p_with_the_sev_snp_reason():
    env = nccl_environment(kpro6_verdict(), rdma_devices=[], topology_nics={})
    entry = env["NCCL_P2P_DISABLE"]
    assert entry["value"] == "1" and entry["source"] == "rule"
    assert "SEV-SNP is on and the IOMMU translates GPU DMA" in entry["reason"]
    assert "#nccl-p2p-disable" in entry["reference"]
    assert "NCCL_P2P_LEVEL" not in env


def test_no_driver_answer_across_root_complexes_sets_nothing_nccl_asks_the_driver_itself():
    """Issue 30: unknown is not impossible, and NCCL checks the driver's answer per pair at init."""
    verdict = kpro6_verdict(sev_snp={"snp": False, "enabled": False}, iommu={"enabled": False, "groups": {}})
    assert all(p["status"] == "unknown" for p in verdict["pairs"])
    assert nccl_environment(verdict, rdma_devices=[]) == {}


def test_unknown_driver_answer_with_a_hidden_risk_is_marked_unknown():
    env = nccl_environment(kpro6_verdict(), rdma_devices=[])  # no driver answer, SEV-SNP + IOMMU
    assert env["NCCL_P2P_DISABLE"]["unknown"] is True
    assert "[from unknown]" in render_nccl_conf(env)
    assert any(line.startswith("NCCL_P2P_DISABLE=1  — [from unknown]") for line in describe_nccl_environment(env))
    answered = nccl_environment(kpro6_verdict(p2p_read=all_codes("OK")), rdma_devices=[])
    assert answered["NCCL_P2P_DISABLE"]["unknown"] is False


def test_nvlink_8x_fixture_does_not_disable_p2p():
    env = nccl_environment(nvlink_verdict(), rdma_devices=[], topology_nics={})
    assert "NCCL_P2P_DISABLE" not in env and "NCCL_P2P_LEVEL" not in env


def test_no_ib_disable_without_rdma_devices_nccl_falls_back_to_sockets_itself():
    assert "NCCL_IB_DISABLE" not in nccl_environment(nvlink_verdict(), rdma_devices=[], topology_nics={})


def test_pairs_the_driver_refuses_set_nothing_nccl_drops_them_itself():
    """paths.cc ncclTopoCheckP2p drops every pair whose NVML P2P status is not OK; before, pvegpu
    wrote NCCL_P2P_LEVEL=PHB here, which lifts NCCL >= 2.23 from PXB (4 pairs) to PHB (12 pairs)."""
    _, verdict = pcie_8x(cross_socket_refused())
    assert nccl_environment(verdict, rdma_devices=["mlx5_0"]) == {}
    _, all_ok = pcie_8x()
    assert nccl_environment(all_ok, rdma_devices=["mlx5_0"]) == {}
    assert safe_p2p_cutoff(all_ok["pairs"]) == "SYS"


def with_hidden_risk(verdict: dict, levels: set[str], kind: str = "acs") -> dict:
    """The verdict with a reason NCCL cannot see (ACS redirect) on every pair at these levels."""
    pairs = []
    for pair in verdict["pairs"]:
        if pair["level"] in levels:
            pair = {**pair, "safe": False, "status": "unsafe", "reason_kinds": [kind],
                    "reasons": [f"ACS on root port 0000:00:01.1 between {pair['names'][0]} and {pair['names'][1]}"]}
        pairs.append(pair)
    return {**verdict, "pairs": pairs}


def test_hidden_risk_beyond_nodes_sets_a_level_only_below_nccls_own_default():
    _, verdict = pcie_8x()
    risky = with_hidden_risk(verdict, {"SYS"})
    assert safe_p2p_cutoff(risky["pairs"]) == "PHB"
    # NCCL 2.23+ on Intel stops at PXB by itself: nothing to write (PHB would make it worse)
    env = nccl_environment(risky, nccl_version="2.26.5", cpu_vendor="GenuineIntel")
    assert "NCCL_P2P_LEVEL" not in env and env["NCCL_WIN_ENABLE"]["value"] == "0"
    # NCCL 2.22 goes to SYS by default: PHB, the last safe level
    env = nccl_environment(risky, nccl_version="2.22.3", cpu_vendor="GenuineIntel")
    assert env["NCCL_P2P_LEVEL"]["value"] == "PHB" and "farther than PHB" in env["NCCL_P2P_LEVEL"]["reason"]
    # version unknown: no farther than PXB, NCCL's default since 2.23
    env = nccl_environment(risky)
    assert env["NCCL_P2P_LEVEL"]["value"] == "PXB" and "version is unknown" in env["NCCL_P2P_LEVEL"]["reason"]
    assert "NCCL_P2P_DISABLE" not in env


def test_nccl_default_levels_follow_paths_cc():
    assert nccl_default_level("2.22.3", "GenuineIntel", 8) == "SYS"
    assert nccl_default_level("2.23.4", "GenuineIntel", 8) == "PXB"
    assert nccl_default_level("2.30.7", "AuthenticAMD", 2) == "SYS"
    assert nccl_default_level("2.30.7", "AuthenticAMD", 4) == "PXB"
    assert nccl_default_level(None, "AuthenticAMD", 2) is None


def test_p2p_level_cutoff_when_only_switch_pairs_are_safe():
    _, verdict = pcie_8x()
    risky = with_hidden_risk(verdict, {"NODE", "SYS"})
    env = nccl_environment(risky, nccl_version="2.30.7", cpu_vendor="GenuineIntel")
    assert env["NCCL_P2P_LEVEL"]["value"] == "PIX"


def test_overrides_win_and_are_marked_with_what_they_replace():
    spec = {"profile": "auto", "overrides": {"NCCL_P2P_DISABLE": "0", "NCCL_DEBUG": "WARN"}}
    env = nccl_environment(kpro6_verdict(), rdma_devices=[], nccl=spec)
    p2p = env["NCCL_P2P_DISABLE"]
    assert p2p["value"] == "0" and p2p["source"] == "override"
    assert p2p["replaces"]["value"] == "1" and "SEV-SNP" in p2p["replaces"]["reason"]
    assert "P2P stays on against the facts" in p2p["warning"]
    assert env["NCCL_DEBUG"] == {"value": "WARN", "reason": "set by the spec's NCCL overrides",
                                 "source": "override", "replaces": None, "warning": None}
    assert env["NCCL_WIN_ENABLE"]["source"] == "rule"


def test_override_of_p2p_level_beyond_the_safe_topology_is_applied_with_a_warning():
    _, verdict = pcie_8x()
    risky = with_hidden_risk(verdict, {"SYS"})
    env = nccl_environment(risky, rdma_devices=["x"], nccl={"overrides": {"NCCL_P2P_LEVEL": "SYS"}})
    assert env["NCCL_P2P_LEVEL"]["value"] == "SYS"
    assert env["NCCL_P2P_LEVEL"]["warning"] == "SYS reaches beyond the farthest safe P2P level of this topology (PHB)"


@pytest.mark.parametrize("value, level", [
    ("PHB", "PHB"), ("NVB", "NVB"), ("C2C", "C2C"), ("P2C", "P2C"), ("PXN", "PXN"), ("3", "PHB"), ("9", "SYS"),
    ("0", "LOC"), ("phb", None), ("PHB ", None), ("Phb", None), ("NODE", None),
])
def test_level_values_as_ncclgetlevel_reads_them(value, level):
    assert nccl_level_value(value) == level


@pytest.mark.parametrize("overrides, message", [
    ({"NCCL_P2P_LEVEL": "phb"}, "case-sensitively: PHB"),
    ({"NCCL_P2P_LEVEL": "NODE"}, "no level NCCL knows"),
    ({"NCCL_DEBUG": '"WARN"'}, "verbatim"),
    ({"NCCL_DEBUG": " WARN"}, "verbatim"),
])
def test_overrides_nccl_would_read_otherwise_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        nccl_environment(kpro6_verdict(), nccl={"overrides": overrides})


def test_levels_nccl_knows_are_accepted():
    env = nccl_environment(nvlink_verdict(), nccl={"overrides": {"NCCL_P2P_LEVEL": "NVB"}})
    assert env["NCCL_P2P_LEVEL"]["value"] == "NVB" and env["NCCL_P2P_LEVEL"]["warning"] is None


def test_dangerous_overrides_are_warned():
    _, pcie = pcie_8x()
    warn = nccl_environment(pcie, nccl={"overrides": {"NCCL_PROTO": "LL,LL128,Simple"}})["NCCL_PROTO"]["warning"]
    assert "LL128 on a PCIe-only host" in warn
    assert nccl_environment(pcie, nccl={"overrides": {"NCCL_PROTO": "^LL"}})["NCCL_PROTO"]["warning"]
    assert nccl_environment(pcie, nccl={"overrides": {"NCCL_PROTO": "^LL128"}})["NCCL_PROTO"]["warning"] is None
    assert nccl_environment(nvlink_verdict(), nccl={"overrides": {"NCCL_PROTO": "LL128"}})["NCCL_PROTO"]["warning"] is None
    ignore = nccl_environment(pcie, nccl={"overrides": {"NCCL_IGNORE_DISABLED_P2P": "2"}})
    assert "check of the driver's P2P status" in ignore["NCCL_IGNORE_DISABLED_P2P"]["warning"]
    level = nccl_environment(kpro6_verdict(), nccl={"overrides": {"NCCL_P2P_LEVEL": "PIX"}})["NCCL_P2P_LEVEL"]
    assert level["warning"].startswith("has no effect: NCCL_P2P_DISABLE=1")


def test_profile_none_keeps_only_overrides():
    env = nccl_environment(kpro6_verdict(), rdma_devices=[], nccl={"profile": "none", "overrides": {"NCCL_DEBUG": "INFO"}})
    assert list(env) == ["NCCL_DEBUG"]
    with pytest.raises(ValueError, match="NCCL profile 'fast' is unknown"):
        nccl_environment(kpro6_verdict(), nccl={"profile": "fast"})


@pytest.mark.parametrize("overrides, message", [
    ({"P2P_DISABLE": "1"}, "nccl.overrides: 'P2P_DISABLE' is not an NCCL variable"),
    ({"NCCL_DEBUG": "WARN\nNCCL_P2P_DISABLE=0"}, "the value of NCCL_DEBUG spans several lines"),
])
def test_overrides_that_cannot_be_nccl_conf_lines_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        nccl_environment(kpro6_verdict(), nccl={"overrides": overrides})


def test_per_container_sets_follow_each_containers_gpus_and_overrides():
    topology, verdict = pcie_8x()
    verdict = with_hidden_risk(verdict, {"SYS"})
    spec = {"overrides": {"NCCL_DEBUG": "WARN"},
            "containers": {"101": {"NCCL_DEBUG": "INFO", "NCCL_MIN_NCHANNELS": "4"}}}
    plan = nccl_plan(verdict, containers={"101": ["GPU0", "GPU1"], "102": ["GPU0", "GPU4"], "103": ["GPU3"]},
                     rdma_devices=[], topology_nics=topology["nics"], nccl=spec, nccl_version="2.22.3")
    host, cts = plan["host"], plan["containers"]
    assert host["NCCL_P2P_LEVEL"]["value"] == "PHB" and host["NCCL_DEBUG"]["value"] == "WARN"
    # 101: one PIX pair, safe -> no P2P variables; its own overrides on top of the host's.
    assert "NCCL_P2P_DISABLE" not in cts["101"] and "NCCL_P2P_LEVEL" not in cts["101"]
    assert cts["101"]["NCCL_DEBUG"]["value"] == "INFO"
    assert cts["101"]["NCCL_DEBUG"]["reason"] == "set by the spec's NCCL overrides for container 101"
    assert cts["101"]["NCCL_MIN_NCHANNELS"]["source"] == "override"
    # 102: its only pair crosses sockets, where ACS redirects: P2P and symmetric memory closed.
    assert cts["102"]["NCCL_P2P_DISABLE"]["value"] == "1" and "ACS" in cts["102"]["NCCL_P2P_DISABLE"]["reason"]
    assert cts["102"]["NCCL_WIN_ENABLE"]["value"] == "0"
    assert "--disable-custom-all-reduce" in cts["102"]["NCCL_P2P_DISABLE"]["remains"]
    assert cts["102"]["NCCL_DEBUG"]["value"] == "WARN" and "NCCL_MIN_NCHANNELS" not in cts["102"]
    # 103: one GPU, nothing to decide about P2P.
    assert sorted(cts["103"]) == ["NCCL_DEBUG"]


def test_kpro6_containers_by_bdf_get_p2p_disabled_too():
    bdfs = kpro6_gpu_bdfs()
    plan = nccl_plan(kpro6_verdict(), containers={"129": bdfs[:4], "200": bdfs[4:]}, rdma_devices=[])
    for env in plan["containers"].values():
        assert env["NCCL_P2P_DISABLE"]["value"] == "1" and "SEV-SNP" in env["NCCL_P2P_DISABLE"]["reason"]


def test_rendered_nccl_conf_is_what_nccl_reads_with_a_reason_above_each_line():
    env = nccl_environment(kpro6_verdict(), rdma_devices=[], nccl={"overrides": {"NCCL_DEBUG": "WARN"}})
    text = render_nccl_conf(env, scope="host kpro6")
    assert nccl_conf_values(text) == {name: entry["value"] for name, entry in env.items()}
    lines = text.splitlines()
    settings = [i for i, line in enumerate(lines) if not line.startswith("#") and "=" in line]
    assert [lines[i].split("=")[0] for i in settings] == sorted(env)  # deterministic order
    for i in settings:
        assert lines[i - 1].startswith("# ")
    p2p_comment = lines[lines.index("NCCL_P2P_DISABLE=1") - 1]
    assert "SEV-SNP" in p2p_comment
    assert lines[lines.index("NCCL_DEBUG=WARN") - 1] == "# [override] set by the spec's NCCL overrides"
    assert text == render_nccl_conf(dict(reversed(list(env.items()))), scope="host kpro6")


def test_rule_table_rows_name_their_documentation():
    for rule in NCCL_RULES:
        assert rule.variable.startswith("NCCL_")
        assert "docs.nvidia.com" in rule.source
    assert NCCL_P2P_LEVELS[0] == "LOC" and NCCL_P2P_LEVELS[-1] == "SYS"


def test_plan_for_the_kpro6_spec_file_covers_its_gpu_containers():
    from pathlib import Path

    from spec.load import load_spec_file

    spec = load_spec_file(Path(__file__).resolve().parents[2] / "inventories" / "kpro6.yml")["kpro6"]
    roles = {bdf: gpu.role for bdf, gpu in spec.gpus.items()}
    verdict = kpro6_verdict(roles=roles)
    plan = nccl_plan_for_spec(verdict, spec, rdma_devices=[])
    gpu_containers = sorted(str(ctid) for ctid, ct in spec.containers.items() if ct.gpus)
    assert sorted(plan["containers"]) == gpu_containers and gpu_containers
    for env in [plan["host"], *plan["containers"].values()]:
        assert env["NCCL_P2P_DISABLE"]["value"] == "1"
    vm_gpus = [bdf for bdf, role in roles.items() if role.startswith("vm:")]
    for pair in verdict["pairs"]:
        if pair["a"] in vm_gpus or pair["b"] in vm_gpus:
            assert "role" in pair["reason_kinds"]


def test_unknown_levels_and_refused_pairs_disable_nothing():
    gpus = {f"0000:0{i}:00.0": {"model": "NVIDIA H200", "minor": i} for i in range(1, 3)}
    usable = p2p_verdict(nvidia_gpus=gpus, p2p_read=all_codes("OK", 2))
    assert usable["pairs"][0]["level"] is None and usable["pairs"][0]["possible"]
    assert "NCCL_P2P_DISABLE" not in nccl_environment(usable, rdma_devices=[])
    refused = p2p_verdict(nvidia_gpus=gpus, p2p_read=all_codes("NS", 2))
    assert nccl_environment(refused, rdma_devices=[]) == {}


def test_host_file_ignores_pairs_with_gpus_passed_to_vms():
    """One GPU for the host, one for a VM: no host pair exists, so the host file sets no P2P
    variable — the same before and after the reboot that moves the VM's GPU to vfio-pci."""
    from spec.load import validate_spec

    topology, _ = pcie_8x()
    keep = ["GPU0", "GPU1"]
    topology = {**topology, "devices": keep,
                "links": {a: {b: v for b, v in topology["links"][a].items() if b in keep} for a in keep}}
    p2p_read = {a: {b: "OK" for b in keep if b != a} for a in keep}
    pci = {"0000:19:00.0": {"class": "030000", "vendor": "10de", "driver": "nvidia", "root": "pci0000:00"},
           "0000:1a:00.0": {"class": "030000", "vendor": "10de", "driver": "nvidia", "root": "pci0000:00"}}
    nvidia = {"0000:19:00.0": {"minor": 0, "model": "A6000"}, "0000:1a:00.0": {"minor": 1, "model": "A6000"}}
    roles = {"0000:19:00.0": "lxc", "0000:1a:00.0": "vm:301"}
    verdict = p2p_verdict(topology=topology, p2p_read=p2p_read, pci=pci, nvidia_gpus=nvidia, roles=roles)
    assert any(not p["possible"] for p in verdict["pairs"]), "the pair with the VM GPU is not usable"
    spec = validate_spec({"hosts": {"h": {"gpus": {"0000:19:00.0": "lxc", "0000:1a:00.0": "vm:301"},
                                          "containers": {201: {"gpus": ["0000:19:00.0"]}},
                                          "vms": {301: {"gpus": ["0000:1a:00.0"]}}}}}, "x.yml")["h"]
    plan = nccl_plan_for_spec(verdict, spec, rdma_devices=[])
    assert "NCCL_P2P_DISABLE" not in plan["host"] and "NCCL_P2P_LEVEL" not in plan["host"]
    # without the spec's roles the pair still counts, and NCCL keeps off it by itself (not the host's)
    assert nccl_plan(verdict, rdma_devices=[])["host"] == {}




@pytest.mark.parametrize("value, message", [
    ("phb", "case-sensitively: PHB"),
    ('"PHB"', "verbatim"),
])
def test_spec_refuses_levels_nccl_would_ignore_before_any_connection(value, message):
    from spec.load import SpecError, validate_spec

    with pytest.raises(SpecError, match=message) as error:
        validate_spec({"hosts": {"h": {"containers": {201: {"nccl": {"NCCL_P2P_LEVEL": value}}}}}}, "x.yml")
    assert "x.yml" in str(error.value) and "host h" in str(error.value) and "containers[201].nccl" in str(error.value)


def test_shm_floor_follows_nccls_buffer_sizes_and_checks_a_containers_dev_shm():
    from plan.nccl import NCCL_SHM_CONNECTION_BYTES, shm_floor_bytes, shm_problem

    assert NCCL_SHM_CONNECTION_BYTES == 9633792  # LL 512 KiB + LL128 4.69 MiB + Simple 4 MiB
    assert shm_floor_bytes(1) == 0 and shm_floor_bytes(4) == 4 * 2 * 9633792
    header = "Filesystem 1024-blocks Used Available Capacity Mounted on"
    small = [header, "shm 65536 0 65536 0% /dev/shm"]  # Docker's default 64 MiB
    assert "holds 64 MiB; NCCL's SHM transport needs at least 74 MiB for 4 GPUs" in (shm_problem("CT 200", small, 4) or "")
    assert shm_problem("CT 200", small, 2) is None
    assert "has no /dev/shm mount" in (shm_problem("CT 200", [header, "/dev/sda1 100 1 99 1% /"], 2) or "")
    assert shm_problem("CT 200", [header, "tmpfs 65536000 0 65536000 0% /dev/shm"], 8) is None


def test_plan_uses_each_scopes_nccl_version():
    _, verdict = pcie_8x()
    risky = with_hidden_risk(verdict, {"SYS"})
    plan = nccl_plan(risky, containers={"200": ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4"]},
                     nccl_version="2.22.3", cpu_vendor="intel", container_versions={"200": "2.26.5"})
    assert plan["host"]["NCCL_P2P_LEVEL"]["value"] == "PHB"  # 2.22 goes to SYS by itself
    assert "NCCL_P2P_LEVEL" not in plan["containers"]["200"]  # 2.26 stops at PXB by itself
    assert plan["containers"]["200"]["NCCL_WIN_ENABLE"]["value"] == "0"


def test_report_names_the_sys_opt_in_where_p2p_is_safe_across_root_complexes():
    from plan.nccl import opt_in_note
    from plan.topology_report import topology_text
    from tests.unit.test_p2p import kpro6_iommu, kpro6_nvidia_gpus, kpro6_pci, kpro6_topology

    facts: dict[str, Any] = dict(pci=kpro6_pci(), nvidia_gpus=kpro6_nvidia_gpus(), topology=kpro6_topology(),
                                 iommu=kpro6_iommu("identity"), sev_snp=False, p2p_read=all_codes("OK"),
                                 p2p_write=all_codes("OK"))
    verdict = p2p_verdict(**facts)
    env = nccl_environment(verdict)
    assert env == {}
    note = opt_in_note(verdict, env) or ""
    assert note.startswith("28 of 28 GPU pairs have safe P2P through the CPU (NODE, SYS)")
    assert "NCCL_P2P_LEVEL=SYS in nccl.overrides is an opt-in to measure" in note
    hardware = {"pci_devices": facts["pci"], "nvidia_gpus": facts["nvidia_gpus"], "topology": facts["topology"],
                "iommu": facts["iommu"], "sev_snp": {"snp": False, "enabled": False}, "pci_acs": {},
                "p2p_read": facts["p2p_read"], "p2p_write": facts["p2p_write"]}
    text = topology_text("box", hardware, verdict, env)
    assert "note: 28 of 28 GPU pairs have safe P2P" in text and "restarted" in text


def test_plan_summary_says_nccl_values_need_a_restart():
    from plan.summary import spec_summary
    from spec.load import validate_spec

    spec = validate_spec({"hosts": {"h": {"nccl": {"services": ["vllm"]}}}}, "x.yml")["h"]
    line = next(line for line in spec_summary("h", spec) if "NCCL" in line)
    assert "drop-ins for vllm" in line and "until restarted" in line


def test_gpus_for_nvidia_that_nvidia_smi_does_not_list_are_named():
    """A plan made while the spec's nvidia GPUs have no driver (nvidia-smi lists none) says which."""
    from plan.nccl import unseen_gpus

    drivers = {"0000:01:00.0": "nvidia", "0000:02:00.0": "nvidia", "0000:81:00.0": "vfio-pci", "0000:82:00.0": None}
    assert unseen_gpus(drivers, {}) == ["0000:01:00.0", "0000:02:00.0"]
    assert unseen_gpus(drivers, None) == ["0000:01:00.0", "0000:02:00.0"]
    assert unseen_gpus(drivers, {"0000:01:00.0": {}}) == ["0000:02:00.0"]
    assert unseen_gpus(drivers, {"0000:01:00.0": {}, "0000:02:00.0": {}}) == []
