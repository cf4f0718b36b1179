"""tests/host/test_nvidia.py::test_module_firmware_and_userspace_versions_are_equal on a stand-in
target: a driver that is not (or another version) loaded while the loader boots next a kernel
without nvidia.version's modules is not "a reboot is pending" (plan.reboot.next_boot_without_modules)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from spec.models import HostSpec
from tests.host.test_nvidia import test_module_firmware_and_userspace_versions_are_equal as check

V = "595.45.04"
RUNNING = "6.1.0-57-amd64"
LOADER = Path(__file__).resolve().parent / "facts" / "loader.LoaderState"


class Target:
    name = "n1"

    def __init__(self, loaded: str | None, loader_case: str, releases: list[str]):
        self.spec = HostSpec(nvidia={"version": V, "releases": releases, "firmware": False},
                             gpus={"0000:01:00.0": {"role": "host"}})
        self.loaded = loaded
        self.loader = yaml.safe_load((LOADER / f"{loader_case}.yaml").read_text())["fact"]

    def run(self, command):
        if command == "uname -r":
            return 0, RUNNING + "\n"
        if command.startswith("cat /proc/driver/nvidia/version"):
            return 0, f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {self.loaded}  Release Build\n" if self.loaded else ""
        if command.startswith("modinfo -k"):
            return 0, V + "\n"
        return 0, f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{V}\n"

    def fact(self, cls, *args):
        if cls.__name__ == "LoaderState":
            return self.loader
        return {"running": RUNNING, "releases": {r: {"module": {"version": V, "vermagic": f"{r} SMP"}} for r in args[0]}}


def test_another_driver_loaded_and_a_next_boot_without_modules_says_so():
    with pytest.raises(AssertionError) as failed:
        check(Target("580.95.05", "intel2-grub-first-entry", [RUNNING]))
    said = str(failed.value)
    assert said.startswith("n1: the loaded NVIDIA driver is 580.95.05, and the next boot (/boot/grub: 6.8.12-11-pve) "
                           "has no nvidia 595.45.04 modules (built for 6.1.0-57-amd64), so a reboot does not load them")
    assert "a reboot is pending" not in said


def test_no_driver_loaded_and_a_next_boot_without_modules_fails():
    with pytest.raises(AssertionError) as failed:
        check(Target(None, "intel2-grub-first-entry", [RUNNING]))
    assert str(failed.value).startswith("n1: no NVIDIA module is loaded, and the next boot (/boot/grub: 6.8.12-11-pve)")


def test_a_pending_reboot_into_a_kernel_with_the_modules_is_still_named():
    with pytest.raises(AssertionError) as failed:
        check(Target("580.95.05", "intel2-grub-first-entry", [RUNNING, "6.8.12-11-pve"]))
    assert "a reboot is pending" in str(failed.value)
    check(Target(V, "intel2-grub-first-entry", [RUNNING]))  # loaded and current: the next boot is test_boot's
