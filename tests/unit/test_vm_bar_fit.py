"""Issue 30 part 3: a VM's GPUs' BARs against the 64-bit window its CPU type and OVMF can open
(qemu-server CPUConfig.pm phys-bits/guest-phys-bits; edk2 OvmfPkg PlatformDynamicMmioWindow)."""

import pytest

from plan.guests import gpu_mmio64_need, parse_cpu_option, plan_bar_fit, plan_vm
from tests.twin import hardware as twin_hardware

GIB = 1 << 30
FOUR = [f"0000:{bus}:00.0" for bus in ("81", "a1", "c1", "e1")]


def big_gpus() -> dict:
    """Four RTX PRO 6000 as the kpro6 profile has them: BAR0 64 MiB (32-bit), BAR1 128 GiB, BAR3 32 MiB."""
    return {bdf: {"bars": {0: 64 << 20, 1: 128 * GIB, 3: 32 << 20}} for bdf in FOUR}


def vm(cpu: str | None, bios: str | None = "ovmf", machine: str = "q35") -> dict:
    options = {"machine": machine, "memory": "262144"}
    if cpu is not None:
        options["cpu"] = cpu
    if bios:
        options["bios"] = bios
    return {"options": options, "hostpci": {}}


def test_four_128_gib_bars_take_a_1_tib_window():
    # each GPU's 64-bit BARs (128 GiB + 32 MiB) in a root port window aligned to 128 GiB: 256 GiB
    assert gpu_mmio64_need(FOUR, big_gpus()) == 1024 * GIB


@pytest.mark.parametrize("cpu", ["kvm64", "x86-64-v2-AES", None])
def test_four_128_gib_bars_under_a_40_bit_guest_get_the_bits_they_need(cpu):
    options, problems, notes = plan_bar_fit(300, FOUR, vm(cpu), big_gpus(), host_phys_bits=52)
    assert problems == []
    parts = parse_cpu_option(options["cpu"])
    assert parts["phys-bits"] == "43" and "+pdpe1gb" in parts["flags"].split(";")
    assert parts["cputype"] == (cpu or "kvm64")
    assert "need 1024 GiB of 64-bit MMIO" in notes[0] and "opens 32 GiB window" in notes[0]


def test_cpu_host_passes_as_it_is():
    assert plan_bar_fit(300, FOUR, vm("host"), big_gpus(), host_phys_bits=52) == ({}, [], [])


def test_existing_options_of_cpu_are_kept():
    options, _, _ = plan_bar_fit(300, FOUR, vm("host,phys-bits=40,flags=+aes"), big_gpus(), host_phys_bits=52)
    assert options == {"cpu": "host,phys-bits=43,flags=+aes"}


def test_refused_with_the_numbers_when_the_host_cannot_give_the_bits():
    options, problems, _ = plan_bar_fit(300, FOUR, vm("kvm64"), big_gpus(), host_phys_bits=42)
    assert options == {}
    assert "43 bits are needed, more than OVMF (46) and the host (42) allow" in problems[0]
    assert "1024 GiB" in problems[0]


def test_seabios_is_said_not_guessed():
    options, problems, notes = plan_bar_fit(300, FOUR, vm("kvm64", bios=None), big_gpus(), host_phys_bits=52)
    assert (options, problems) == ({}, []) and "SeaBIOS" in notes[0]


def test_small_bars_need_nothing():
    small = {bdf: {"bars": {0: 16 << 20, 1: 256 << 20, 3: 32 << 20}} for bdf in FOUR}
    assert plan_bar_fit(300, FOUR, vm("kvm64"), small, host_phys_bits=46) == ({}, [], [])


def test_plan_vm_sets_cpu_with_the_hostpci_lines_and_wants_q35():
    config = vm("kvm64")
    plan = plan_vm(300, "kpro6", FOUR, "q35", False, config, big_gpus(), set(FOUR), host_phys_bits=52)
    assert plan.set_options["cpu"] == "kvm64,phys-bits=43,flags=+pdpe1gb"
    assert plan.set_options["hostpci0"].endswith(",pcie=1")
    i440 = plan_vm(300, "kpro6", FOUR, "i440fx", False, vm("host", machine="pc"), big_gpus(), set(FOUR),
                   host_phys_bits=52)
    assert any("need machine q35 with pcie=1" in p for p in i440.problems)


def test_kpro6_twin_vm_300_carries_what_its_four_gpus_need():
    """The twin's VM 300 (profile kpro6) with the four GPUs of the profile and its host CPU."""
    from facts.cpu import parse_cpuinfo
    from facts.proxmox import parse_guest_config

    profile = twin_hardware.load_profile("kpro6")
    pci = {}
    for dev in profile["pci"]:
        pci[dev["bdf"]] = {"bars": {bar["index"]: twin_hardware._size(bar["size"]) for bar in dev.get("bars") or []}}
    config = parse_guest_config(profile["guests"]["qemu"][300].splitlines(), "qemu")
    assert config is not None
    cpuinfo = parse_cpuinfo(["vendor_id\t: AuthenticAMD", f"address sizes\t: {profile['cpu']['address_sizes']}"])
    assert cpuinfo is not None
    host_bits = cpuinfo["phys_bits"]
    assert gpu_mmio64_need(FOUR, pci) == 1024 * GIB
    assert config["options"]["bios"] == "ovmf" and config["options"]["cpu"] == "host"
    assert plan_bar_fit(300, FOUR, config, pci, host_bits) == ({}, [], [])


def test_preflight_refuses_a_vm_whose_bars_no_width_can_map_before_anything_changes():
    from operations.guests import bar_fit_refusals
    from spec.load import validate_spec

    spec = validate_spec({"hosts": {"h": {"gpus": {bdf: "vm:300" for bdf in FOUR},
                                          "vms": {300: {"gpus": FOUR}}}}}, "x.yml")["h"]
    facts = {"hw": {"pci_devices": big_gpus(), "cpu": {"phys_bits": 42}},
             "cfg": {"qemu_configs": {300: vm("kvm64")}}}
    (refusal,) = bar_fit_refusals(spec, facts)
    assert refusal.startswith("VM 300: its 4 GPUs' BARs need 1024 GiB of 64-bit MMIO")
    facts["hw"]["cpu"]["phys_bits"] = 52  # the converge can fix it: nothing to refuse
    assert bar_fit_refusals(spec, facts) == []


def test_io_bars_take_no_mmio():
    with_io = {bdf: {"bars": {0: 64 << 20, 1: 16 * GIB, 5: 128}} for bdf in FOUR[:1]}
    assert gpu_mmio64_need(FOUR[:1], with_io) == 16 * GIB  # counted as MMIO it would round up to 32 GiB
