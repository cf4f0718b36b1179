"""Host checks for GPU assignment and guests (stages 6-7): the same expectations the plan uses.

    pytest tests/host --inventory inventories/kpro6.py
"""

from __future__ import annotations

import re

import pytest

from facts.devices import parse_char_majors
from facts.gpu import parse_bus_ids
from facts.nvidia import NvidiaDriver, NvidiaGpus, parse_driver_version, parse_gpu_information
from facts.pci import PciDevices, parse_pci_devices
from facts.proxmox import parse_guest_config, parse_pci_mappings
from plan.gpus import desired_bindings
from plan.guests import (
    config_device_allows,
    config_device_nodes,
    config_gpu_nodes,
    container_nodes,
    is_unprivileged,
    mapping_id,
    node_number,
    nvidia_majors,
    render_mapping_entry,
)
from plan.nvidia import nvidia_gpu_ids


def _read(target, command):
    rc, out = target.run(command)
    return out.splitlines()


def _pci(target):
    return parse_pci_devices(_read(target, PciDevices.command))


def _minors(target):
    return {b: g["minor"] for b, g in parse_gpu_information(_read(target, NvidiaGpus.command)).items()}


def _node(target):
    return target.spec.node or target.name


def test_each_gpu_is_bound_to_the_driver_its_role_needs(target):
    """Each GPU (and its companion functions) is on its role's driver."""
    pci = _pci(target)
    wrong = []
    for bdf, driver in sorted(desired_bindings(target.spec, pci).drivers.items()):
        have = pci.get(bdf, {}).get("driver")
        if have != driver:
            role = target.spec.gpus[bdf].role if bdf in target.spec.gpus else "companion of a VM GPU"
            wrong.append(f"{bdf} is bound to {have or 'nothing'} but its role {role} needs {driver or 'no driver'}")
    assert not wrong, f"{target.name}: " + "; ".join(wrong)


def test_each_container_passes_exactly_its_gpus_by_minor(target):
    """Each container's device entries are exactly its GPUs, by device minor."""
    minors = _minors(target)
    problems = []
    for ctid, ct in sorted(target.spec.containers.items()):
        text = target.read(f"/etc/pve/lxc/{ctid}.conf")
        if text is None:
            problems.append(f"CT {ctid} has no config")
            continue
        want = sorted((f"/dev/nvidia{minors[b]}" for b in ct.gpus if b in minors),
                      key=lambda p: int(p[len("/dev/nvidia"):]))
        missing = [b for b in ct.gpus if b not in minors]
        if missing:
            problems.append(f"CT {ctid}'s GPUs {', '.join(missing)} have no nvidia minor")
        have = config_gpu_nodes(text)
        if have != want:
            problems.append(f"CT {ctid} passes {', '.join(have) or 'no GPU'} but its GPUs are {', '.join(want)}")
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_each_container_gets_exactly_its_device_nodes(target):
    """Each container holds no device node beyond its GPUs, `/dev/nvidiactl`, `/dev/nvidia-uvm` and its `extra_devices`, and no broad `c MAJOR:* rwm` allow line.

    Each GPU CT passes its GPUs, /dev/nvidiactl and /dev/nvidia-uvm and only the extra nodes its
    spec asks for (no uvm-tools, no MIG caps otherwise); raw cgroup allow lines name each node's
    major:minor, never a whole NVIDIA major (issue 39 item 7)."""
    minors = _minors(target)
    majors = parse_char_majors(_read(target, "cat /proc/devices"))
    problems = []
    for ctid, ct in sorted(target.spec.containers.items()):
        text = target.read(f"/etc/pve/lxc/{ctid}.conf")
        if text is None or not ct.gpus:
            continue
        gpu_nodes = [f"/dev/nvidia{minors[b]}" for b in ct.gpus if b in minors]
        extra = [e for e in ct.extra_devices if not (e.startswith("mig-") and is_unprivileged(text))]
        want = container_nodes(gpu_nodes, extra)
        have = config_device_nodes(text)
        more = sorted(set(have) - set(want))
        # MIG caps exist only once created on the host; the plan leaves a missing one out
        less = sorted(n for n in set(want) - set(have) if "nvidia-caps" not in n)
        if more:
            problems.append(f"CT {ctid} passes {', '.join(more)}, which neither its GPUs nor its extra_devices need")
        if less:
            problems.append(f"CT {ctid} lacks {', '.join(less)}")
        allows = config_device_allows(text, nvidia_majors(majors))
        if allows:
            numbers = [node_number(n, majors) for n in have if n in want]
            exact = {f"c {num[0]}:{num[1]} rwm" for num in numbers if num is not None}
            broad = sorted(set(allows) - exact)
            if broad:
                problems.append(f"CT {ctid} allows {', '.join(broad)} beyond its nodes' own numbers")
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_container_cgroup_majors_match_proc_devices(target):
    """Cgroup device lines name the majors of `/proc/devices` (incident 4)."""
    majors = parse_char_majors(_read(target, "cat /proc/devices"))
    allowed = {195} | {majors[n] for n in ("nvidia-uvm", "nvidia-caps") if n in majors}
    problems = []
    for ctid in sorted(target.spec.containers):
        config = parse_guest_config((target.read(f"/etc/pve/lxc/{ctid}.conf") or "").splitlines(), "lxc")
        for key, value in config["lxc"]:
            m = re.match(r"^c\s+(\d+):", value) if key.endswith("devices.allow") else None
            if m and int(m.group(1)) not in allowed and int(m.group(1)) not in majors.values():
                problems.append(f"CT {ctid} allows char major {m.group(1)}, which no driver has now "
                                f"(nvidia-uvm is {majors.get('nvidia-uvm')})")
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_vm_mappings_and_hostpci_match_the_hardware(target):
    """PCI mappings and `hostpciN` lines match the hardware (incident 11)."""
    pci = _pci(target)
    node = _node(target)
    mappings = parse_pci_mappings((target.read("/etc/pve/mapping/pci.cfg") or "").splitlines())
    problems = []
    for vmid, vm in sorted(target.spec.vms.items()):
        config = parse_guest_config((target.read(f"/etc/pve/qemu-server/{vmid}.conf") or "").splitlines(), "qemu")
        used = sorted(e["mapping"] for e in config["hostpci"].values() if e.get("mapping"))
        want = sorted(mapping_id(node, b) for b in vm.gpus)
        if vm.pool:  # GPU pool (issue 26): one line per GPU on the pool; this node's entries are its GPUs
            pooled = [m for m in used if m == vm.pool]
            if len(pooled) != len(vm.gpus) and used != want:  # a running VM keeps per-node ones until stopped
                problems.append(f"VM {vmid} maps {', '.join(used) or 'nothing'} but its {len(vm.gpus)} GPU(s) "
                                f"need pool {vm.pool}")
            entries = [m for m in mappings.get(vm.pool, {}).get("map", []) if m.get("node") == node]
            for bdf in vm.gpus:
                if bdf in pci and render_mapping_entry(node, bdf, pci) not in entries:
                    problems.append(f"pool {vm.pool} has no entry of {node} matching GPU {bdf} (ids, path or IOMMU group)")
            continue
        if used != want:
            problems.append(f"VM {vmid} maps {', '.join(used) or 'nothing'} but its GPUs need {', '.join(want)}")
        for bdf in vm.gpus:
            entry = [m for m in mappings.get(mapping_id(node, bdf), {}).get("map", []) if m.get("node") == node]
            if bdf in pci and entry != [render_mapping_entry(node, bdf, pci)]:
                problems.append(f"mapping {mapping_id(node, bdf)} does not match GPU {bdf} (ids, path or IOMMU group)")
    assert not problems, f"{target.name}: " + "; ".join(problems)


def _running_gpu_containers(target):
    """{ctid: ContainerSpec} of the spec's GPU CTs that run now (pct exec needs a running CT)."""
    rc, out = target.run("pct list 2>/dev/null")
    running = {int(line.split()[0]) for line in out.splitlines()[1:]
               if len(line.split()) > 1 and line.split()[0].isdigit() and line.split()[1] == "running"}
    return {c: ct for c, ct in sorted(target.spec.containers.items()) if ct.gpus and c in running}


def test_nvidia_smi_in_each_running_container_sees_exactly_its_gpus(target):
    """`nvidia-smi` in each running GPU container sees exactly its GPUs."""
    cts = _running_gpu_containers(target)
    if not cts:
        pytest.skip(f"{target.name}: no GPU container runs (pct exec needs one running)")
    problems = []
    for ctid, ct in cts.items():
        rc, out = target.run(f"pct exec {ctid} -- nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader 2>&1")
        if rc != 0:
            problems.append(f"nvidia-smi fails in CT {ctid}: {out.strip()[:300]}")
            continue
        seen = parse_bus_ids(out.splitlines())
        if seen != sorted(ct.gpus):
            problems.append(f"nvidia-smi in CT {ctid} sees {', '.join(seen) or 'no GPU'} but its GPUs are "
                            f"{', '.join(sorted(ct.gpus))}")
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_each_managed_container_has_exactly_the_hosts_driver_user_space(target):
    """Each managed container has the host's driver user space (incident 6)."""
    from operations.containers import managed_containers
    from plan.containers import LIB_DIRS, installed_versions

    managed = managed_containers(target.spec)
    cts = {c: ct for c, ct in _running_gpu_containers(target).items() if c in managed}
    if not cts:
        pytest.skip(f"{target.name}: no running container whose NVIDIA user space pvegpu manages")
    rc, out = target.run(NvidiaDriver.command)
    host_version = (parse_driver_version(out.splitlines()) or {}).get("version")
    problems = []
    for ctid in cts:
        globs = " ".join(f"{d}/libnvidia-ml.so.*" for d in LIB_DIRS)
        rc, out = target.run(f"pct exec {ctid} -- sh -c 'ls -1 {globs} 2>/dev/null; true'")
        have = installed_versions(out.split())
        if have != [host_version]:
            problems.append(f"CT {ctid} has NVIDIA user space {', '.join(have) or 'none'} but the host runs "
                            f"driver {host_version or 'none'}")
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_every_gpu_has_its_bar1(target):
    """Every GPU has its BAR1 (incident 10).

    Incident 10: 96 GB cards came up without BAR1 ("BAR can't assign") when the BAR space
    was too small (fix: pci=realloc)."""
    from plan.topology_report import bar1_size

    pci = _pci(target)
    gpus = {b: pci[b] for b in nvidia_gpu_ids(pci)}
    if not gpus:
        pytest.skip(f"{target.name}: no NVIDIA GPU on the PCI bus")
    missing = sorted(b for b, d in gpus.items() if not bar1_size(d.get("bars")))
    assert not missing, (f"{target.name}: GPU {', '.join(missing)} has no BAR1 (its memory window); "
                         "the BIOS/kernel could not place it: boot with pci=realloc or enable Above 4G decoding")


def test_no_blackwell_gpu_uses_an_identity_iommu_domain_on_a_sev_snp_host(target):
    """No Blackwell GPU has an identity IOMMU domain on a SEV-SNP host (incident 9).

    Incident 9: Blackwell FSP boot failed (0x177) with identity-mapped IOMMU domains on a
    SEV-SNP host."""
    from facts.kernel import IommuState, SevSnp
    from plan.nvidia import is_blackwell

    _, out = target.run(SevSnp.command)
    if not SevSnp().process(out.splitlines()).get("enabled"):
        pytest.skip(f"{target.name}: SEV-SNP is off")
    pci = _pci(target)
    blackwell = {b: pci[b] for b, device_id in nvidia_gpu_ids(pci).items() if is_blackwell(device_id)}
    if not blackwell:
        pytest.skip(f"{target.name}: no Blackwell GPU")
    _, out = target.run(IommuState.command)
    types = IommuState().process(out.splitlines()).get("groups") or {}
    bad = sorted(f"{b} (group {d.get('iommu_group')})" for b, d in blackwell.items()
                 if d.get("iommu_group") is not None and (types.get(int(d["iommu_group"])) or "").lower() == "identity")
    assert not bad, (f"{target.name}: Blackwell GPU {', '.join(bad)} has an identity IOMMU domain on a SEV-SNP "
                     "host; its FSP boot fails there (0x177): set the group back to DMA/DMA-FQ")
