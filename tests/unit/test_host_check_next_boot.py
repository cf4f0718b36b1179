"""The host check "what boots next" (tests/host/test_boot.py::
test_kernels_the_loader_boots_next_have_the_nvidia_driver) on a stand-in target whose
facts.loader.LoaderState is a recorded reading: ESPs of both loaders, or a GRUB ESP that a reinit
turned into systemd-boot's too (proxmox-kernel-helper b4954f3's quoted glob), fail naming the
ESPs and the fix, where the kernels they boot would otherwise pass (issue 38)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.host.test_boot import test_kernels_the_loader_boots_next_have_the_nvidia_driver as check
from tests.unit.test_plan_loader import reading, reinit_over_grub_esp

VERSION = "595.71.05"


class Host:
    name = "kpro6"

    def __init__(self, state):
        self.state = state
        self.spec = SimpleNamespace(nvidia=SimpleNamespace(version=VERSION, firmware=False))

    def fact(self, _cls):
        return self.state

    def run(self, command):
        # every kernel has nvidia VERSION, built by its compiler (modinfo, vermagic, .comment, config)
        release = command.split("modinfo -k ", 1)[1].split(" ", 1)[0]
        return 0, (f"{VERSION}\n@@\n{release} SMP preempt mod_unload modversions\n@@\nGCC: (Debian 12.2.0-14) 12.2.0\n"
                   '@@\n@@\nCONFIG_CC_VERSION_TEXT="gcc (Debian 12.2.0-14) 12.2.0"\n')


def test_a_grub_esp_alone_passes():
    state = reinit_over_grub_esp()
    state["esps"][0]["has"] = ["EFI/proxmox/grubx64.efi", "grub"]
    check(Host(state))


def test_a_grub_esp_that_a_reinit_gave_systemd_boot_fails_with_the_fix():
    with pytest.raises(AssertionError) as failed:
        check(Host(reinit_over_grub_esp()))
    said = str(failed.value)
    assert said.startswith("kpro6: what boots next depends on the firmware's boot order: ESP 5A1C-9E27 holds both"), said
    assert "proxmox-boot-tool init <its partition> grub" in said


def test_esps_in_mixed_modes_fail_naming_them_and_the_fix():
    with pytest.raises(AssertionError) as failed:
        check(Host(reading("kpro6-grubesp-mixed-systemd-boot-esp-first")))
    said = str(failed.value)
    assert "5A1C-9E27 (grub)" in said and "7B2D-1F30 (systemd-boot)" in said, said
    assert "proxmox-boot-tool init /dev/disk/by-uuid/7B2D-1F30 grub" in said
