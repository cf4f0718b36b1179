"""Host kernel & IOMMU stage on twins: both boot loaders converge, the twin reboots into a
cmdline with the spec's parameters, and a second run changes nothing (one remote command)."""

from __future__ import annotations

import subprocess

import pytest

from tests.e2e.harness import run_pyinfra
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

STAGES = "operations.boot,operations.reboot"


def twin_run(name: str, *command: str) -> str:
    return subprocess.run(runtime.ssh_command(name, list(command)), capture_output=True, text=True,
                          check=True, timeout=60).stdout


@pytest.mark.parametrize("profile,config_file,params", [
    ("kpro6", "/etc/kernel/cmdline", ["amd_iommu=on", "pci=realloc"]),
    ("intel2", "/etc/default/grub.d/pvegpu.cfg", ["intel_iommu=on", "iommu=pt", "pci=realloc"]),
])
def test_boot_stage_converges_reboots_and_then_changes_nothing(twin_factory, profile, config_file, params):
    twin = twin_factory(profile)
    env = {"PVEGPU_TWINS": twin.name, "PVEGPU_STAGES": STAGES}
    booted_before = twin_run(twin.name, "cat", "/proc/cmdline").split()
    assert not set(params) <= set(booted_before)

    first = run_pyinfra("inventories/twin.py", "tests/e2e/stage_deploy.py", env=env)
    assert first.rc == 0, first.output[-5000:]
    assert f"{twin.name}: reboot pending" in first.output
    assert first.changed == 5  # cmdline file, modules, then once each: initramfs, loader refresh; reboot
    configured = twin_run(twin.name, "cat", config_file)
    assert all(p in configured for p in params), configured

    booted = twin_run(twin.name, "cat", "/proc/cmdline").split()
    assert set(params) <= set(booted), f"after the reboot /proc/cmdline is {' '.join(booted)}"
    assert "quiet" in booted or "root=ZFS=rpool/ROOT/pve-1" in booted  # what was there stays
    assert "vfio_pci" in twin_run(twin.name, "ls", "/sys/module").split()

    second = run_pyinfra("inventories/twin.py", "tests/e2e/stage_deploy.py", env=env)
    assert second.rc == 0, second.output[-5000:]
    assert second.changed == 0 and f"{twin.name}: no reboot pending" in second.output, second.output[-5000:]
    assert second.remote_commands <= 2, f"a no-change boot stage cost {second.remote_commands} remote commands"


def test_sev_snp_twin_refuses_passthrough_before_any_change(twin_factory, tmp_path):
    """kpro6's twin has SEV-SNP on: a spec with iommu=pt is refused and nothing is written."""
    twin = twin_factory("kpro6")
    env = {"PVEGPU_TWINS": twin.name, "PVEGPU_STAGES": STAGES, "PVEGPU_E2E_IOMMU_PT": "1"}
    before = twin_run(twin.name, "cat", "/etc/kernel/cmdline")
    run = run_pyinfra("inventories/twin.py", "tests/e2e/stage_deploy.py", env=env)
    assert run.rc != 0 and "SEV-SNP" in run.output, run.output[-3000:]
    assert twin_run(twin.name, "cat", "/etc/kernel/cmdline") == before
    assert "pvegpu-vfio.conf" not in twin_run(twin.name, "ls", "/etc/modules-load.d")
