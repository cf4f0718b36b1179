"""Side effects once per run (issue 18, part 3) on the kpro6 twin: several stages need the
initramfs rebuilt, one operation at the end of the run does it (operations.handlers). A first
converge runs `update-initramfs` at most once and the boot loader refresh at most once, in that
order, depmod and systemd's daemon-reload once each; a second converge runs none of them."""

from __future__ import annotations

import re
from pathlib import Path

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
    # depmod (the NVIDIA stage's modules) and the daemon-reload (the nodes unit, the NCCL drop-in):
    # once each; this twin's modules are seeded, so depmod runs from its missing stamp
    depmod, reload = sent(first.output, "depmod "), sent(first.output, "systemctl daemon-reload")
    print(f"first converge: depmod in {len(depmod)} command(s), daemon-reload in {len(reload)}")
    assert len(depmod) == 1 and len(reload) == 1, "\n".join(depmod + reload)
    if initramfs:  # the initramfs hooks resolve modules through modules.dep
        assert lines.index(depmod[0]) < lines.index(initramfs[0])

    second = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert second.rc == 0, second.output[-6000:]
    assert second.changed == 0, second.output[-6000:]
    assert not sent(second.output, "update-initramfs -u")
    assert not sent(second.output, "proxmox-boot-tool refresh")
    assert not sent(second.output, "depmod ") and not sent(second.output, "systemctl daemon-reload")


def test_failed_initramfs_update_is_retried_next_run_from_its_stamp(twin_factory):
    """update-initramfs fails on the first converge, after every stage wrote its files: the next
    run changes no file but still runs it once (the stamp records the old files), then never."""
    twin = twin_factory("kpro6", name="e2e-retry")
    env = {"PVEGPU_TWINS": twin.name}
    failing = Path(twin.root) / "usr/local/sbin/update-initramfs"  # before /usr/sbin in root's PATH
    failing.parent.mkdir(parents=True, exist_ok=True)
    failing.write_text("#!/bin/sh\necho 'update-initramfs: failing on purpose' >&2\nexit 1\n")
    failing.chmod(0o755)
    try:
        first = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    finally:
        failing.unlink()
    assert first.rc != 0 and "failing on purpose" in first.output, first.output[-4000:]
    assert len(sent(first.output, "update-initramfs -u")) == 1
    assert not sent(first.output, "proxmox-boot-tool refresh")
    assert not (Path(twin.root) / "var/lib/pvegpu/initramfs.stamp").exists()

    again = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert again.rc == 0, again.output[-6000:]
    assert len(sent(again.output, "update-initramfs -u")) == 1, again.output[-6000:]
    assert "previous run stopped" in again.output
    # the refresh never ran either (it comes after the initramfs): retried once, after it
    assert len(sent(again.output, "proxmox-boot-tool refresh")) == 1
    assert (Path(twin.root) / "var/lib/pvegpu/initramfs.stamp").is_file()

    quiet = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert quiet.rc == 0 and quiet.changed == 0, quiet.output[-6000:]
    assert not sent(quiet.output, "update-initramfs -u")
