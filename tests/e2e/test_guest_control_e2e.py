"""Guest control as Proxmox does it, end to end on the kpro6 twin (issue 16 part 4): a running
CT that is an HA resource is not restarted through pct (whose shutdown would only queue an HA
request), a locked CT config is neither written nor its CT restarted, a spec node that is not the
host's node name is refused before anything changes; then the same CT converges, its device nodes
are 0660 and `pct exec` keeps the caller's environment."""

from __future__ import annotations

import subprocess

import pytest

from tests.e2e.test_rebind_e2e import BDFS, Run
from tests.twin import runtime


def spec(node: str = "kpro6") -> dict:
    return {"hosts": {"kpro6": {"node": node, "gpus": {BDFS[0]: "lxc"}, "containers": {200: {"gpus": [BDFS[0]]}},
                                "guests": {"allow_stop": True}}}}


def ssh(name: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(runtime.ssh_command(name, [command]), capture_output=True, text=True, timeout=120)


@pytest.mark.twin
@pytest.mark.slow
def test_ha_lock_and_node_are_honoured_then_the_ct_converges(twin_factory, tmp_path, monkeypatch):
    twin = twin_factory("kpro6")
    run = Run(twin, tmp_path)
    node = {"value": "kpro6"}
    monkeypatch.setattr("tests.e2e.test_rebind_e2e.spec_yaml", lambda ct, vm: spec(node["value"]))
    assert ssh(twin.name, "pct start 200").returncode == 0
    # the UVM nodes a devN entry needs (the twin boots without them; the NVIDIA stage makes them on a real run)
    assert ssh(twin.name, "nvidia-modprobe -u -c=0").returncode == 0
    conf_before = run.read("etc/pve/lxc/200.conf")

    # HA resource ct:200, HA stack stalled: pvegpu refuses the restart and writes nothing
    (run.root / "etc/pve/ha").mkdir(parents=True, exist_ok=True)
    (run.root / "etc/pve/ha/resources.cfg").write_text("ct: 200\n\tstate started\n")
    (run.root / "var/lib/twin/ha.json").write_text('{"mode": "stalled"}')
    rc, out, _ = run.deploy([], [])
    assert rc != 0 and "CT 200 needs a restart for its new GPUs but is HA resource ct:200" in out, out
    assert "ha-manager remove ct:200" in out
    assert run.read("etc/pve/lxc/200.conf") == conf_before
    assert ssh(twin.name, "ha-manager remove ct:200").returncode == 0

    # a backup holds the CT's config: refused naming the lock, nothing written
    (run.root / "etc/pve/lxc/200.conf").write_text(conf_before + "lock: backup\n")
    rc, out, _ = run.deploy([], [])
    assert rc != 0 and "CT 200 is locked (backup)" in out, out
    assert run.read("etc/pve/lxc/200.conf") == conf_before + "lock: backup\n"
    assert ssh(twin.name, "pct unlock 200").returncode == 0

    # the spec names a node the host is not (Proxmox's node name is `uname -n` without the domain)
    node["value"] = "kpro6x"
    rc, out, _ = run.deploy([], [])
    assert rc != 0 and "the spec says node 'kpro6x'" in out and "is Proxmox node 'kpro6'" in out, out
    assert run.read("etc/pve/lxc/200.conf") == conf_before

    node["value"] = "kpro6"
    rc, out, _ = run.deploy([], [])
    assert rc == 0, out
    assert "dev0: /dev/nvidia0,gid=44" in run.read("etc/pve/lxc/200.conf")
    # pve-container's prestart hook: 0660 (not the host node's mode), gid as configured
    assert ssh(twin.name, "pct exec 200 -- stat -c '%a %g' /dev/nvidia0").stdout == "660 44\n"
    # pct exec keeps the caller's environment on PVE 8 (keep-env defaults to 1)
    assert ssh(twin.name, "PVEGPU_PROBE=kept pct exec 200 -- printenv PVEGPU_PROBE").stdout == "kept\n"
    rc, out, res = run.deploy([], [])
    assert rc == 0 and res.changed == 0, out
