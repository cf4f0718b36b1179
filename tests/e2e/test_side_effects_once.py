"""Side effects once per run (issue 18, part 3) on the kpro6 twin: several stages need the
initramfs rebuilt, one operation at the end of the run does it (operations.handlers). A first
converge runs `update-initramfs` at most once and the boot loader refresh at most once, in that
order; a second converge runs neither."""

from __future__ import annotations

import re

import pytest

from tests.e2e.harness import run_pyinfra

pytestmark = [pytest.mark.twin]

# pyinfra --debug prints every command it sends: "Running command on <host>: (pty=…) <command>"
_SENT = re.compile(r"Running command on [^\n]*")


def sent(output: str, words: str) -> list[str]:
    """The commands pyinfra sent that contain `words`, in order."""
    return [line for line in _SENT.findall(output) if words in line]


def test_first_converge_rebuilds_initramfs_once_then_refreshes_once_second_never(twin_factory):
    twin = twin_factory("kpro6", name="e2e-once")
    env = {"PVEGPU_TWINS": twin.name}

    first = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert first.rc == 0, first.output[-6000:]
    initramfs = sent(first.output, "update-initramfs -u")
    refresh = sent(first.output, "proxmox-boot-tool refresh")
    print(f"first converge: update-initramfs in {len(initramfs)} command(s), "
          f"proxmox-boot-tool refresh in {len(refresh)}")
    assert len(initramfs) <= 1, "update-initramfs ran more than once:\n" + "\n".join(initramfs)
    assert len(refresh) <= 1, "the boot loader refresh ran more than once:\n" + "\n".join(refresh)
    lines = _SENT.findall(first.output)
    if initramfs and refresh:  # the refresh copies the initrd to the ESPs: it comes after
        assert lines.index(initramfs[0]) <= lines.index(refresh[0])

    second = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert second.rc == 0, second.output[-6000:]
    assert second.changed == 0, second.output[-6000:]
    assert not sent(second.output, "update-initramfs -u")
    assert not sent(second.output, "proxmox-boot-tool refresh")
