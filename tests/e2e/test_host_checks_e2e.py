"""The host checks prove a converged twin right, and name what is wrong, in a sentence, once
one thing on the host is broken (issue 8)."""

from __future__ import annotations

import pytest

from tests.e2e.harness import run_host_checks, run_pyinfra
from tests.twin import runtime

pytestmark = [pytest.mark.twin]


@pytest.mark.parametrize("profile", ["kpro6", "kpro6-pve9"])  # Proxmox VE 8 (bookworm) and 9.2 (trixie)
def test_checks_pass_converged_and_fail_readably_when_one_thing_breaks(twin_factory, profile):
    twin = twin_factory(profile, name=f"checks-{profile}")
    env = {"PVEGPU_TWINS": twin.name}
    converge = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert converge.rc == 0, converge.output[-4000:]

    ok = run_host_checks("inventories/twin.py", env=env)
    assert ok.returncode == 0, ok.stdout[-4000:]

    # break one thing: the module options file (incident 3's guard) disappears
    import subprocess

    subprocess.run(runtime.ssh_command(twin.name, ["rm", "-f", "/etc/modprobe.d/pvegpu-nvidia.conf"]), check=True)
    broken = run_host_checks("inventories/twin.py", env=env)
    out = broken.stdout
    assert broken.returncode == 1, out[-4000:]
    failed = [line for line in out.splitlines() if line.startswith("FAILED ")]
    assert failed and all("test_nvidia.py" in line or "test_modprobe" in line for line in failed), out[-4000:]
    sentences = [line.strip() for line in out.splitlines() if "HOST CHECK FAILED:" in line]
    assert any(f"{twin.name}: modprobe -c lacks" in s or "uvm_disable_hmm" in s for s in sentences), out[-4000:]
    assert "Traceback" not in out and "def test_" not in out, "failures must read as sentences, not code"
