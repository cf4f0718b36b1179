"""Incident 8's host check (tests/host/test_p2p.py) on stand-in targets: the H200 VM's recorded
HardwareProbe, with its GPU given a second function beside it where a VM needs two GPUs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from facts.hardware import HardwareProbe
from spec.load import validate_spec
from tests.host.test_p2p import test_report_says_p2p_is_impossible_between_the_gpus_of_one_vm as check

RECORDED = Path(__file__).parents[1] / "fixtures" / "h200-vm-probe" / "hardware-probe.txt"
GPU, SECOND = "0000:00:06.0", "0000:00:07.0"


def _hardware(second_gpu: bool) -> dict:
    lines = [line for line in RECORDED.read_text().splitlines() if not line.startswith("# ")]
    hardware = HardwareProbe().process(lines)
    if second_gpu:
        hardware["pci_devices"][SECOND] = copy.deepcopy(hardware["pci_devices"][GPU])
    return hardware


def _spec(roles: dict, vm_gpus: list[str]):
    host = {"iommu": {"vendor": "intel"}, "nvidia": {"version": "580.159.04"}, "gpus": roles}
    if vm_gpus:
        host["vms"] = {300: {"gpus": vm_gpus, "machine": "q35"}}
    return validate_spec({"hosts": {"pve1": host}}, "test.yml")["pve1"]


class Target:
    name = "pve1"

    def __init__(self, spec, hardware):
        self.spec, self.hardware = spec, hardware

    def fact(self, fact_class, *args):
        assert fact_class is HardwareProbe and not args
        return self.hardware


def test_two_gpus_of_one_vm_are_reported_without_p2p_and_why():
    check(Target(_spec({GPU: "vm:300", SECOND: "vm:300"}, [GPU, SECOND]), _hardware(second_gpu=True)))


def test_a_vm_gpu_that_is_not_on_the_host_fails_in_a_sentence():
    with pytest.raises(AssertionError) as failed:
        check(Target(_spec({GPU: "vm:300", SECOND: "vm:300"}, [GPU, SECOND]), _hardware(second_gpu=False)))
    assert str(failed.value).split("\n")[0] == f"pve1: VM 300's GPUs {GPU} and {SECOND}: {SECOND} is not on this host"


def test_no_vm_with_two_gpus_skips():
    with pytest.raises(pytest.skip.Exception, match="no VM has two or more GPUs"):
        check(Target(_spec({GPU: "host"}, []), _hardware(second_gpu=False)))
