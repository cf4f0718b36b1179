"""Host checks that tell the truth (issue 28 part 7) on the h200-vm twin, a recording of the H200
test machine: its NVIDIA driver 580.159.04 is loaded, but no nvidia module lies under
/lib/modules (it came from elsewhere), and its spec gives no GPU to a VM."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.e2e.harness import PYTEST, REPO

pytestmark = [pytest.mark.twin]


def test_driver_from_elsewhere_is_named_and_vfio_is_not_asked_for_without_vm_gpus(twin_factory, tmp_path):
    twin = twin_factory("h200-vm", name=f"i28hc-{os.getpid() % 10000}")
    spec = {"hosts": {twin.name: {
        "ssh": {"hostname": twin.address, "port": twin.port, "user": "root", "key": twin.key},
        "node": "vm", "nvidia": {"version": "580.159.04"}, "gpus": {"0000:00:06.0": "lxc"}}}}
    (tmp_path / "h200.yml").write_text(json.dumps(spec))
    inventory = tmp_path / "h200.py"
    inventory.write_text("from spec.load import inventory_hosts\n"
                         f"hosts = inventory_hosts({str(tmp_path / 'h200.yml')!r})\n")
    done = subprocess.run([PYTEST, "-q", "-rs", "-p", "no:cacheprovider", "tests/host", "--inventory", str(inventory),
                           "-k", "versions_are_equal or vfio or nouveau"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    out = done.stdout
    assert "1 failed, 1 passed, 1 skipped" in out, out[-4000:]
    assert (f"{twin.name}: the running kernel" in out and "has the NVIDIA driver 580.159.04 loaded, but no nvidia "
            "module under /lib/modules/" in out and "came from elsewhere" in out), out[-4000:]
    assert "has nvidia module none" not in out, out[-4000:]
    assert f"{twin.name}: the spec gives no GPU to a VM, so nothing needs vfio-pci" in out, out[-4000:]
