"""A rebind that survives the operator (issue 19, part 2), on a kpro6 twin whose /sys rebinds
live (its kernel model, tests/twin/runtime.py `live_sysfs`): the transaction runs detached on the
host with a journal; pyinfra SIGKILLed or sshd killed in the middle of it does not stop it; the
next run reports the journal, starts the guests pvegpu stopped that are still down once their
configs match, and converges; a run after that changes nothing.

Each unbind is slowed down (`runtime.set_fault(unbind_delay_s=...)`) so the fault lands while
the runner is between its first `move` and its end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import PYINFRA, REPO, run_pyinfra
from tests.e2e.test_rebind_e2e import BDFS, INVENTORY, spec_yaml
from tests.twin import runtime

JOURNAL = "var/lib/pvegpu/rebind/journal"

# the guests' shutdown timeout of these runs (the rebind e2e's spec otherwise)
SHUTDOWN_TIMEOUT_S = 20


class Host:
    def __init__(self, twin, tmp: Path):
        self.twin, self.tmp = twin, tmp
        self.root = Path(json.loads((REPO / ".twin" / twin.name / "twin.json").read_text())["root"])
        (tmp / "inv.py").write_text(INVENTORY.format(twin_json=str(REPO / ".twin" / twin.name / "twin.json")))

    def write_spec(self, ct, vm) -> None:
        (self.tmp / "inv.yml").write_text(yaml.safe_dump(spec_yaml(ct, vm, shutdown_timeout=SHUTDOWN_TIMEOUT_S)))

    def deploy(self, ct, vm, *extra):
        self.write_spec(ct, vm)
        return run_pyinfra(str(self.tmp / "inv.py"), "deploy.py", *extra, env={"PYTHONPATH": str(REPO)}, timeout=900)

    def start_deploy(self, ct, vm) -> subprocess.Popen:
        """pyinfra as a user starts it, in its own process group (so the test can kill all of it)."""
        self.write_spec(ct, vm)
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen([PYINFRA, "-y", str(self.tmp / "inv.py"), "deploy.py"], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def ssh(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(runtime.ssh_command(self.twin.name, [command]), capture_output=True, text=True,
                              timeout=120)

    def journal(self) -> list[str]:
        p = self.root / JOURNAL
        return [" ".join(line.split()[1:]) for line in p.read_text().splitlines()] if p.exists() else []

    def drivers(self) -> dict[str, str]:
        state = json.loads((self.root / "var/lib/twin/hw/state.json").read_text())
        return {g["bdf"]: g["driver"] for g in state["gpus"]}

    def status(self, kind: str, gid: int) -> str:
        tool = "pct" if kind == "lxc" else "qm"
        return self.ssh(f"{tool} status {gid}").stdout.strip()

    def wait_journal(self, predicate, timeout: float = 180) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.journal()
            if predicate(lines):
                return lines
            time.sleep(0.2)
        raise AssertionError(f"journal never got there: {self.journal()}")


def ended(lines: list[str]) -> bool:
    return bool(lines) and lines[-1].split()[0] in ("done", "rolledback", "rollback-failed")


def moving(lines: list[str]) -> bool:
    return any(line.startswith("move ") for line in lines)


def converged(host: Host, ct, vm) -> None:
    """What the spec says: bindings, both guests running, nothing left to change."""
    assert host.drivers() == {b: ("nvidia" if b in ct else "vfio-pci") for b in BDFS}
    assert host.status("lxc", 200) == "status: running"
    assert host.status("qemu", 300) == "status: running"
    again = host.deploy(ct, vm)
    assert again.rc == 0 and again.changed == 0, again.output[-4000:]


@pytest.mark.twin
@pytest.mark.slow
def test_rebind_survives_a_killed_deploy_and_a_killed_sshd(twin_factory, tmp_path):
    twin = twin_factory("kpro6", live_sysfs=True)
    host = Host(twin, tmp_path)
    ct, vm = BDFS[:4], BDFS[4:]
    first = host.deploy(ct, vm)
    assert first.rc == 0, first.output[-4000:]
    for cmd in ("nvidia-modprobe -u -c=0", "pct start 200", "qm start 300"):
        started = host.ssh(cmd)
        assert started.returncode == 0, (cmd, started.stderr)
    settle = host.deploy(ct, vm)  # the running CT gets its /etc/nccl.conf (the NCCL stage writes it inside)
    assert settle.rc == 0, settle.output[-4000:]
    converged(host, ct, vm)

    # 1. pyinfra SIGKILLed while the runner moves 0000:61:00.0 to the VM and 0000:81:00.0 to the CT
    runtime.set_fault(twin.name, unbind_delay_s=3)
    ct2, vm2 = BDFS[:3] + [BDFS[4]], [BDFS[3]] + BDFS[5:]
    deploy = host.start_deploy(ct2, vm2)
    try:
        host.wait_journal(moving)
    finally:
        os.killpg(deploy.pid, signal.SIGKILL)
        deploy.wait(30)
    lines = host.wait_journal(ended)
    assert lines[-1] == "done", lines
    assert "stopped lxc 200" in lines and "stopped qemu 300" in lines
    # the runner finished alone: the GPUs moved, the guests stay stopped (their configs are old)
    assert host.drivers()[BDFS[3]] == "vfio-pci" and host.drivers()[BDFS[4]] == "nvidia"
    assert host.status("lxc", 200) == "status: stopped" and host.status("qemu", 300) == "status: stopped"
    runtime.set_fault(twin.name, unbind_delay_s=0)

    after = host.deploy(ct2, vm2)
    assert after.rc == 0, after.output[-4000:]
    assert "GPU rebind transaction started" in after.output and "completed" in after.output
    assert "started again once their configs match: CT 200, VM 300" in after.output
    assert not (host.root / JOURNAL).exists(), "the journal is archived once its guests run"
    assert list((host.root / "var/lib/pvegpu/rebind/history").iterdir())
    converged(host, ct2, vm2)

    # 2. sshd killed (every connection drops) while the runner moves them back
    runtime.set_fault(twin.name, unbind_delay_s=3)
    deploy = host.start_deploy(ct, vm)
    try:
        host.wait_journal(moving)
        runtime.kill_sshd(twin.name)
        out, _ = deploy.communicate(timeout=300)
    finally:
        if deploy.poll() is None:
            os.killpg(deploy.pid, signal.SIGKILL)
    assert deploy.returncode != 0, "the deploy lost its connection"
    lines = host.wait_journal(ended)
    assert lines[-1] == "done", lines
    runtime.set_fault(twin.name, unbind_delay_s=0)
    after = host.deploy(ct, vm)
    assert after.rc == 0, after.output[-4000:]
    assert "completed" in after.output
    converged(host, ct, vm)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-x", "-q"]))
