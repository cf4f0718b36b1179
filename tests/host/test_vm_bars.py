"""Host check for issue 30 part 3: each VM of the spec can map its GPUs' BARs: the 64-bit MMIO
window OVMF opens for the VM's `cpu` (its physical address bits) holds what the GPUs' BARs take
(plan.guests.plan_bar_fit, from the host's own facts).

    pytest tests/host --inventory inventories/kpro6.py
"""

from __future__ import annotations

import pytest

from facts.hardware import HardwareProbe, HostConfigProbe
from plan.guests import plan_bar_fit


def test_each_vm_can_map_its_gpus_bars(target):
    """Each VM's 64-bit MMIO window holds its GPUs' BARs."""
    spec = target.spec
    if not any(vm.gpus for vm in spec.vms.values()):
        pytest.skip(f"{target.name}: no VM with GPUs in the spec")
    hardware = target.fact(HardwareProbe)
    configs = target.fact(HostConfigProbe)["qemu_configs"]
    pci = hardware["pci_devices"]
    host_bits = (hardware.get("cpu") or {}).get("phys_bits")
    problems = []
    for vmid, vm in sorted(spec.vms.items()):
        gpus = [bdf for bdf in vm.gpus if bdf in pci]
        config = configs.get(vmid)
        if not gpus or config is None:
            continue
        fix, refused, _ = plan_bar_fit(vmid, gpus, config, pci, host_bits)
        problems += refused
        if fix:
            problems.append(f"VM {vmid}'s cpu is {config['options'].get('cpu') or 'kvm64'}; its GPUs' BARs need "
                            f"cpu: {fix['cpu']} (a converge sets it)")
    assert not problems, f"{target.name}: " + "; ".join(problems)
