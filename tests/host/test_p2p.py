"""Host check for incident 8 (docs/INCIDENTS.md): GPUs passed to one VM each sit behind their own
virtual root port there, so P2P between them is impossible inside the VM even with ACS off and
Q35. The topology report (topology.py, read-only) must say so for every such pair, in words,
from the host's own facts, before anyone spends a day on it.

    pytest tests/host --inventory inventories/kpro6.py
"""

from __future__ import annotations

from itertools import combinations

import pytest

from facts.hardware import HardwareProbe
from plan.topology_report import topology_text, verdict_from_hardware


def _vm_gpu_pairs(spec) -> list[tuple[str, str, str]]:
    return [(str(vmid), a, b) for vmid, vm in sorted(spec.vms.items()) for a, b in combinations(sorted(vm.gpus), 2)]


def test_report_says_p2p_is_impossible_between_the_gpus_of_one_vm(target):
    """The topology report says P2P is impossible between the GPUs of one VM (incident 8)."""
    pairs = _vm_gpu_pairs(target.spec)
    if not pairs:
        pytest.skip(f"{target.name}: no VM has two or more GPUs")
    hardware = target.fact(HardwareProbe)
    roles = {bdf: gpu.role for bdf, gpu in target.spec.gpus.items()}
    verdict = verdict_from_hardware(hardware, roles)
    text = topology_text(target.name, hardware, verdict)
    by_pair = {frozenset((p["a"], p["b"])): p for p in verdict["pairs"]}
    problems = []
    for vmid, a, b in pairs:
        pair = by_pair.get(frozenset((a, b)))
        if pair is None:
            missing = [bdf for bdf in (a, b) if bdf not in (hardware.get("pci_devices") or {})]
            where = (f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not on this host"
                     if missing else "the report has no verdict for them")
            problems.append(f"VM {vmid}'s GPUs {a} and {b}: {where}")
            continue
        said = [r for r in pair["reasons"] if f"VM {vmid}" in r and "impossible" in r]
        if pair["possible"]:
            problems.append(f"the report calls P2P between VM {vmid}'s GPUs {a} and {b} possible")
        elif not said:
            problems.append(f"the report does not say that VM {vmid}'s GPUs {a} and {b} lose P2P inside the VM "
                            f"(it says: {'; '.join(pair['reasons']) or 'nothing'})")
        elif not all(sentence in text for sentence in said):
            problems.append(f"the printed report leaves out why VM {vmid}'s GPUs {a} and {b} have no P2P")
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_no_gpu_pair_is_left_unknown_once_the_driver_answers(target):
    """No GPU pair's P2P verdict is unknown once the driver answers.

    Issue 30: without the driver's answer (a first converge, before the NVIDIA stage) a pair on
    different root complexes is 'unknown'; with the driver loaded, its answer settles every pair."""
    hardware = target.fact(HardwareProbe)
    if not (hardware.get("nvidia_driver") or {}).get("version"):
        pytest.skip(f"{target.name}: the NVIDIA driver is not loaded; P2P between root complexes stays unknown")
    roles = {bdf: gpu.role for bdf, gpu in target.spec.gpus.items()}
    verdict = verdict_from_hardware(hardware, roles)
    unknown = [f"{p['a']} - {p['b']}" for p in verdict["pairs"] if p["status"] == "unknown"]
    assert not unknown, (f"{target.name}: the driver is loaded but did not answer for P2P between "
                         f"{', '.join(unknown)} (nvidia-smi topo -p2p r gave nothing for them)")
