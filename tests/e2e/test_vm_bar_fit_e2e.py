"""Issue 30 part 3 on the kpro6 twin: VM 300 takes four GPUs with a 128 GiB BAR1 each. With a
40-bit CPU model (kvm64) OVMF opens a 32 GiB window; the converge gives the VM's cpu the 43
physical address bits a 1 TiB window needs (qemu-server's phys-bits, checked by the twin's qm as
qemu-server checks it), a second converge changes nothing, and the host checks pass."""

from __future__ import annotations

import subprocess

import pytest

from tests.e2e.harness import run_host_checks, run_pyinfra
from tests.twin import runtime

pytestmark = [pytest.mark.twin]


def ssh(name: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(runtime.ssh_command(name, [command]), capture_output=True, text=True, timeout=120)


def test_a_40_bit_vm_gets_the_address_bits_its_gpus_bars_need(twin_factory):
    twin = twin_factory("kpro6", name="i30bar-kpro6")
    env = {"PVEGPU_TWINS": twin.name}
    assert ssh(twin.name, "qm set 300 --cpu kvm64").returncode == 0

    dry = run_pyinfra("inventories/twin.py", "deploy.py", "--dry", env=env)
    assert dry.rc == 0, dry.output[-4000:]
    assert "VM 300: its 4 GPUs' BARs need 1024 GiB of 64-bit MMIO" in dry.output, dry.output[-4000:]
    assert "cpu: kvm64" in ssh(twin.name, "cat /etc/pve/qemu-server/300.conf").stdout

    first = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert first.rc == 0, first.output[-6000:]
    config = ssh(twin.name, "cat /etc/pve/qemu-server/300.conf").stdout
    assert "cpu: kvm64,phys-bits=43,flags=+pdpe1gb" in config, config

    second = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert second.rc == 0 and second.changed == 0, second.output[-6000:]
    checks = run_host_checks("inventories/twin.py", env=env)
    assert checks.returncode == 0, checks.stdout[-4000:]
