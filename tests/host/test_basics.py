"""Checks every managed GPU host must pass, whatever its stages."""

from __future__ import annotations


def test_reachable_and_root(target):
    """The host answers over SSH, as root."""
    rc, out = target.run("id -u")
    assert rc == 0 and out.strip() == "0", f"{target.name}: commands do not run as root (id -u printed {out.strip()!r})"


def test_spec_gpus_exist_on_the_host(target):
    """Every GPU address of the spec is on the host."""
    missing = [bdf for bdf in target.spec.gpus if not target.host.file(f"/sys/bus/pci/devices/{bdf}").exists]
    assert not missing, f"{target.name}: the spec names GPU(s) {', '.join(missing)} that the host does not have (no /sys/bus/pci/devices entry)"
