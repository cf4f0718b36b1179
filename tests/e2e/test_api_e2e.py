"""Proxmox writes through the API, end to end on a kpro6 twin running the API stand-in.

The spec has `proxmox_api` pointing at the twin's own https://127.0.0.N:8006 (the stand-in,
tests/twin/standins/pveapi.py, started inside the twin over SSH); the token is set only in the
pyinfra subprocess's environment. Three runs and a --dry:

1. converge 4 GPUs to CT 200 and 4 to VM 300: mappings and hostpci lines are created through
   the API (the GPUs move to vfio-pci at the twin's reboot, which also ends the API server:
   it is started again);
2. with both guests running, --dry of the change below lists the stale mapping and sends no
   request; then the change: a GPU leaves CT 200 (stays lxc) and one leaves VM 300 (unused,
   stays on vfio-pci): no driver moves, so both guests are shut down and started through the
   API, VM 300's hostpci line goes (PUT config) and its mapping is deleted (DELETE);
3. a run that changes nothing.
The token never appears in pyinfra's output.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import manifest_diff, root_manifest, run_pyinfra
from tests.e2e.test_rebind_e2e import BDFS, INVENTORY
from tests.twin import runtime

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests/twin/standins/pveapi.py"
TOKEN_ENV = "PVEGPU_E2E_API_TOKEN"
PORT = 8006


class ApiTwin:
    """A kpro6 twin, its API stand-in (started in the twin, stopped by pid) and the deploy runs."""

    def __init__(self, twin, tmp: Path):
        self.twin, self.tmp = twin, tmp
        self.root = Path(twin.root)
        self.token = "e2e-" + secrets.token_hex(16)
        self.pid: int | None = None
        (tmp / "inv.py").write_text(INVENTORY.format(twin_json=str(REPO / ".twin" / twin.name / "twin.json")))
        lib = self.root / "usr/local/lib/twin/pveapi.py"
        shutil.copyfile(STANDIN, lib)
        (self.root / "etc/pve/priv").mkdir(parents=True, exist_ok=True)
        (self.root / "etc/pve/priv/token.cfg").write_text(f"root@pam!pvegpu {self.token}\n")

    def ssh(self, command: str) -> subprocess.CompletedProcess:
        # ssh joins its arguments into one line for the remote shell: pass the line itself
        return subprocess.run(runtime.ssh_command(self.twin.name, [command]),
                              capture_output=True, text=True, timeout=60)

    def answering(self) -> bool:
        try:
            with socket.create_connection((self.twin.address, PORT), timeout=1):
                return True
        except OSError:
            return False

    def start_api(self) -> None:
        """Start the stand-in in the twin unless it answers (a twin reboot kills it)."""
        if self.answering():
            return
        started = self.ssh(f"setsid python3 /usr/local/lib/twin/pveapi.py --listen {self.twin.address} "
                           f"--port {PORT} </dev/null >/var/log/pveapi.out 2>&1 & echo $!")
        assert started.returncode == 0, started.stderr
        self.pid = int(started.stdout.split()[-1])
        deadline = time.monotonic() + 30
        while not self.answering():
            assert time.monotonic() < deadline, self.read("var/log/pveapi.out")
            time.sleep(0.2)
        shutil.copyfile(self.root / "etc/pve/local/pve-ssl.pem", self.tmp / "pve-root-ca.pem")

    def stop_api(self) -> None:
        if self.pid is not None:
            self.ssh(f"kill {self.pid}")
            self.pid = None

    def spec(self, ct: list[str], vm: list[str], lxc_spare: Sequence[str] = (), unused: Sequence[str] = ()) -> dict:
        gpus = {b: "lxc" for b in [*ct, *lxc_spare]} | {b: "vm:300" for b in vm} | {b: "unused" for b in unused}
        return {"hosts": {"kpro6": {
            "node": "kpro6", "iommu": {"vendor": "amd", "params": ["pci=realloc"]}, "gpus": gpus,
            "containers": {200: {"gpus": ct}}, "vms": {300: {"gpus": vm, "machine": "q35"}},
            "reboot": {"allowed": True}, "guests": {"allow_stop": True, "shutdown_timeout": 30},
            "proxmox_api": {"host": self.twin.address, "port": PORT, "user": "root@pam", "token_name": "pvegpu",
                            "token_env": TOKEN_ENV, "verify_ssl": True,
                            "ca_file": str(self.tmp / "pve-root-ca.pem")}}}}

    def deploy(self, spec: dict, *extra: str):
        (self.tmp / "inv.yml").write_text(yaml.safe_dump(spec))
        result = run_pyinfra(str(self.tmp / "inv.py"), "deploy.py", *extra,
                             env={"PYTHONPATH": str(REPO), TOKEN_ENV: self.token}, timeout=600)
        assert self.token not in result.output
        return result

    def read(self, rel: str) -> str:
        p = self.root / rel
        return p.read_text() if p.exists() else ""

    def lines_since(self, rel: str, before: str) -> list[str]:
        """New lines of a log, without their timestamps."""
        return [" ".join(l.split()[1:]) for l in self.read(rel)[len(before):].splitlines()]


@pytest.mark.twin
@pytest.mark.slow
def test_api_converges_mappings_hostpci_and_guest_restarts(twin_factory, tmp_path):
    twin = twin_factory("kpro6", name=f"api-{secrets.token_hex(3)}")
    run = ApiTwin(twin, tmp_path)
    try:
        run.start_api()
        ct, vm = BDFS[:4], BDFS[4:]

        res = run.deploy(run.spec(ct, vm))
        assert res.rc == 0, res.output
        api_log = run.read("var/log/pveapi.log")
        assert api_log.count("POST /api2/json/cluster/mapping/pci 200") == 4, api_log
        assert "PUT /api2/json/nodes/kpro6/qemu/300/config 200" in api_log
        assert sorted(l for l in run.read("etc/pve/qemu-server/300.conf").splitlines() if l.startswith("hostpci")) \
            == [f"hostpci{i}: mapping=pvegpu-kpro6-{b.replace(':', '-').replace('.', '-')},pcie=1" for i, b in enumerate(vm)]
        run.start_api()  # the twin's reboot (GPUs to vfio-pci) ended it

        # the spec has no nvidia stage (no unit makes the UVM nodes at boot): make them as an
        # admin would, then start both guests
        for cmd in ("nvidia-modprobe -u -c=0", "pct start 200", "qm start 300"):
            started = run.ssh(cmd)
            assert started.returncode == 0, started.stderr
        spec2 = run.spec(ct[:3], vm[:3], lxc_spare=ct[3:], unused=vm[3:])
        stale = "pvegpu-kpro6-0000-e1-00-0"

        before, api_before = root_manifest(run.root), run.read("var/log/pveapi.log")
        res = run.deploy(spec2, "--dry")
        assert res.rc == 0, res.output
        assert f"PCI mapping {stale} is stale" in res.output
        assert run.read("var/log/pveapi.log") == api_before  # --dry sent nothing
        assert [d for d in manifest_diff(before, root_manifest(run.root)) if "pveapi.log" not in d] == []

        guests_before = run.read("var/lib/twin/guests.log")
        res = run.deploy(spec2)
        assert res.rc == 0, res.output
        calls = run.lines_since("var/log/pveapi.log", api_before)
        assert f"DELETE /api2/json/cluster/mapping/pci/{stale} 200" in calls
        assert "PUT /api2/json/nodes/kpro6/qemu/300/config 200" in calls
        assert "POST /api2/json/nodes/kpro6/lxc/200/status/shutdown 200" in calls
        assert "POST /api2/json/nodes/kpro6/qemu/300/status/shutdown 200" in calls
        assert run.lines_since("var/lib/twin/guests.log", guests_before) == [
            "shutdown lxc 200", "start lxc 200", "shutdown qemu 300", "start qemu 300"]
        assert stale not in run.read("etc/pve/mapping/pci.cfg")
        assert "hostpci3" not in run.read("etc/pve/qemu-server/300.conf")
        assert "/dev/nvidia3," not in run.read("etc/pve/lxc/200.conf")
        assert json.loads(run.read("var/lib/twin/guests.json")) == {"lxc/200": "running", "qemu/300": "running"}

        api_before = run.read("var/log/pveapi.log")
        res = run.deploy(spec2)
        assert res.rc == 0 and res.changed == 0, res.output
        assert run.lines_since("var/log/pveapi.log", api_before) == []
    finally:
        run.stop_api()
