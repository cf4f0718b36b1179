"""plan.gpus: per-address bindings, IOMMU-group refusals, moves, guests a rebind stops, holders."""

from pathlib import Path

from facts.proxmox import parse_guest_config, parse_pci_mappings
from facts.rebind import parse_compute_apps, parse_fuser
from plan.gpus import (
    boot_minors,
    desired_bindings,
    holders_of,
    moves,
    plan_rebind,
)
from spec.models import HostSpec

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
BDFS = ["0000:01:00.0", "0000:21:00.0", "0000:41:00.0", "0000:61:00.0",
        "0000:81:00.0", "0000:a1:00.0", "0000:c1:00.0", "0000:e1:00.0"]


def gpu(group, driver, cls="030000"):
    return {"vendor": "10de", "device": "2bb5", "subsystem_vendor": "10de", "subsystem_device": "204e",
            "class": cls, "iommu_group": group, "driver": driver}


def kpro6_pci(vm_driver="vfio-pci"):
    """kpro6-like bus: 8 GPUs, each with its audio function, one IOMMU group per slot."""
    pci = {}
    for i, bdf in enumerate(BDFS):
        drv = "nvidia" if i < 4 else vm_driver
        pci[bdf] = gpu(10 * i, drv)
        pci[bdf[:-1] + "1"] = {**gpu(10 * i, "snd_hda_intel" if i < 4 else vm_driver, "040300"), "device": "22e8"}
        pci[f"0000:{bdf[5:7][0]}0:01.1"] = {**gpu(10 * i + 1, "pcieport", "060400"), "vendor": "1022"}
    return pci


def spec(ct_gpus, vm_gpus, allow_stop=True):
    gpus = {b: "lxc" for b in ct_gpus} | {b: "vm:300" for b in vm_gpus}
    return HostSpec.model_validate({"gpus": gpus, "containers": {200: {"gpus": ct_gpus}},
                                    "vms": {300: {"gpus": vm_gpus}}, "guests": {"allow_stop": allow_stop}})


def test_roles_give_drivers_and_vm_groups_follow():
    b = desired_bindings(spec(BDFS[:4], BDFS[4:]), kpro6_pci())
    assert b.refusals == []
    assert b.drivers["0000:01:00.0"] == "nvidia" and b.drivers["0000:81:00.0"] == "vfio-pci"
    assert b.drivers["0000:81:00.1"] == "vfio-pci" and b.companions["0000:81:00.1"] == "0000:81:00.0"
    assert "0000:01:00.1" not in b.drivers  # an lxc GPU's audio keeps its own driver
    assert "0000:80:01.1" not in b.drivers  # bridges stay with the host


def test_group_shared_with_another_role_or_host_device_is_refused():
    pci = kpro6_pci()
    pci["0000:a1:00.0"]["iommu_group"] = 40  # same group as 0000:81:00.0
    pci["0000:c2:00.0"] = {**gpu(60, "nvme", "010802"), "vendor": "144d"}
    s = HostSpec.model_validate({"gpus": {"0000:81:00.0": "vm:300", "0000:a1:00.0": "lxc", "0000:c1:00.0": "vm:301"},
                                 "containers": {200: {"gpus": ["0000:a1:00.0"]}},
                                 "vms": {300: {"gpus": ["0000:81:00.0"]}, 301: {"gpus": ["0000:c1:00.0"]}}})
    refusals = desired_bindings(s, pci).refusals
    assert any("0000:81:00.0 is for VM 300, but its IOMMU group 40 also holds GPU 0000:a1:00.0 with role lxc" in r
               for r in refusals)
    assert any("0000:c1:00.0 is for VM 301" in r and "0000:c2:00.0, a storage controller" in r for r in refusals)


def test_missing_gpu_and_iommu_off_are_refused():
    pci = kpro6_pci()
    pci["0000:81:00.0"]["iommu_group"] = None
    del pci["0000:e1:00.0"]
    refusals = desired_bindings(spec(BDFS[:4], BDFS[4:]), pci).refusals
    assert any("0000:e1:00.0 (role vm:300) is not on this host's PCI bus" in r for r in refusals)
    assert any("0000:81:00.0" in r and "IOMMU is off" in r for r in refusals)


def test_moving_two_gpus_from_vm_to_ct():
    pci = kpro6_pci()
    b = desired_bindings(spec(BDFS[:6], BDFS[6:]), pci)
    assert [str(m) for m in moves(b, pci)] == [
        "0000:81:00.0: vfio-pci -> nvidia", "0000:a1:00.0: vfio-pci -> nvidia"]
    assert boot_minors(b, pci) == {b_: i for i, b_ in enumerate(BDFS[:6])}
    converged = desired_bindings(spec(BDFS[:4], BDFS[4:]), pci)
    assert moves(converged, pci) == []


def _configs():
    lxc = {200: parse_guest_config(["dev0: /dev/nvidia0,gid=44", "dev1: /dev/nvidia1,gid=44"], "lxc"),
           201: parse_guest_config(["lxc.mount.entry: /dev/nvidia3 dev/nvidia3 none bind,optional,create=file"], "lxc")}
    qemu = {300: parse_guest_config(["machine: q35", "hostpci0: mapping=pvegpu-kpro6-0000-81-00-0,pcie=1",
                                     "hostpci1: 0000:a1:00,pcie=1"], "qemu"),
            301: parse_guest_config(["hostpci0: 0000:05:00.0"], "qemu")}
    mappings = parse_pci_mappings(["pvegpu-kpro6-0000-81-00-0",
                                   "\tmap id=10de:2bb5,iommugroup=40,node=kpro6,path=0000:81:00,subsystem-id=10de:204e"])
    return lxc, qemu, mappings


NVIDIA = {b: {"minor": i} for i, b in enumerate(BDFS[:4])}


def test_vm_to_ct_move_stops_the_vm_using_the_gpus_only():
    lxc, qemu, mappings = _configs()
    s = spec(BDFS[:6], BDFS[6:])
    pci = kpro6_pci()
    status = {"lxc": {200: "running", 201: "running"}, "qemu": {300: "running", 301: "running"}}
    plan = plan_rebind(s, "kpro6", desired_bindings(s, pci), pci, NVIDIA, lxc, qemu, mappings, status, live=True)
    assert plan.stop == [("qemu", 300)] and plan.blocked == []
    text = "\n".join(plan.dry_lines())
    assert "0000:81:00.0: vfio-pci -> nvidia" in text and "stopped for it: VM 300" in text


def test_ct_to_vm_move_stops_the_ct_holding_the_minor_and_respects_allow_stop():
    lxc, qemu, mappings = _configs()
    pci = kpro6_pci()
    ct, vm = [BDFS[0], BDFS[2], BDFS[3]], [BDFS[1]] + BDFS[4:]
    status = {"lxc": {200: "running", 201: "stopped"}, "qemu": {300: "stopped"}}
    s = spec(ct, vm)
    plan = plan_rebind(s, "kpro6", desired_bindings(s, pci), pci, NVIDIA, lxc, qemu, mappings, status, live=True)
    assert plan.stop == [("lxc", 200)]  # CT 200 passes /dev/nvidia1; 201 is stopped anyway
    s = spec(ct, vm, allow_stop=False)
    plan = plan_rebind(s, "kpro6", desired_bindings(s, pci), pci, NVIDIA, lxc, qemu, mappings, status, live=True)
    assert plan.stop == [] and plan.blocked == [("lxc", 200)]


def test_rebind_at_next_boot_stops_nothing_now():
    lxc, qemu, mappings = _configs()
    s = spec(BDFS[:6], BDFS[6:])
    pci = kpro6_pci()
    plan = plan_rebind(s, "kpro6", desired_bindings(s, pci), pci, NVIDIA, lxc, qemu, mappings,
                       {"qemu": {300: "running"}}, live=False)
    assert plan.stop == [] and len(plan.moves) == 2 and "at the next boot" in plan.dry_lines()[0]


def test_holders_from_nvidia_smi_and_fuser():
    recorded = (FIXTURES / "h200-vm/query-compute-apps.txt").read_text().splitlines()[2:]
    assert parse_compute_apps(recorded) == {}  # real, idle H200
    apps = parse_compute_apps(["00000000:81:00.0, 4242, python3", "00000000:01:00.0, 812, nvidia-persistenced"])
    fuser = parse_fuser([
        "                     USER        PID ACCESS COMMAND",
        "/dev/nvidia0:        root        812 F.... nvidia-persistenced",
        "                     root       9001 F.... python3",
        "/dev/nvidia2:        root       7000 F...m ollama serve",
    ])
    assert fuser == {"/dev/nvidia0": ["nvidia-persistenced (pid 812)", "python3 (pid 9001)"],
                     "/dev/nvidia2": ["ollama serve (pid 7000)"]}
    held = holders_of(["0000:01:00.0", "0000:21:00.0", "0000:81:00.0"], NVIDIA, apps, fuser)
    assert held == {"0000:01:00.0": ["nvidia-persistenced (pid 812)", "python3 (pid 9001)"],
                    "0000:81:00.0": ["python3 (pid 4242)"]}


def test_blackwell_in_identity_domain_on_sev_snp_host_is_refused():
    from plan.gpus import identity_domain_refusals

    pci = {"0000:01:00.0": {"vendor": "10de", "device": "2bb5", "class": "030200", "iommu_group": 12},
           "0000:02:00.0": {"vendor": "10de", "device": "2230", "class": "030000", "iommu_group": 13},  # A6000
           "0000:03:00.0": {"vendor": "15b3", "device": "101b", "class": "020700", "iommu_group": 14}}
    iommu = {"groups": {12: "identity", 13: "identity", 14: "identity"}}
    refusals = identity_domain_refusals(pci, iommu, {"enabled": True})
    assert len(refusals) == 1 and "GPU 0000:01:00.0 (Blackwell) is in IOMMU group 12" in refusals[0]
    assert "0x177" in refusals[0]
    assert identity_domain_refusals(pci, iommu, {"enabled": False}) == []
    assert identity_domain_refusals(pci, {"groups": {12: "DMA-FQ"}}, {"enabled": True}) == []
