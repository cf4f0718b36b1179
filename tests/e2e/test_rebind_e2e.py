"""Rebuild after GPU rebinding, end to end on the kpro6 twin (issue 7's "done when").

Runs the boot, GPU-assignment, guests and reboot stages through deploy.py's own protocol
(preflight of every stage, then apply) with a spec written per step. The twin's /sys cannot
rebind live, so a move is persisted and applied by the twin's reboot (reboot.allowed: true);
on a real host the same run rebinds through sysfs.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import manifest_diff, root_manifest, run_pyinfra
from tests.twin import hardware

REPO = Path(__file__).resolve().parents[2]
BDFS = ["0000:01:00.0", "0000:21:00.0", "0000:41:00.0", "0000:61:00.0",
        "0000:81:00.0", "0000:a1:00.0", "0000:c1:00.0", "0000:e1:00.0"]

INVENTORY = textwrap.dedent("""\
    import json
    from pathlib import Path
    from spec.load import inventory_hosts
    twin = json.loads(Path({twin_json!r}).read_text())
    name, data = inventory_hosts(Path(__file__).with_suffix(".yml"))[0]
    data = dict(data, ssh_hostname=twin["address"], ssh_port=twin["port"], ssh_user="root",
                ssh_key=twin["key"], ssh_strict_host_key_checking="no", pvegpu_node="kpro6")
    gpu_hosts = [(name, data)]
""")


def spec_yaml(ct_gpus: list[str], vm_gpus: list[str], shutdown_timeout: int | None = None) -> dict:
    """kpro6's spec with `ct_gpus` in CT 200 and `vm_gpus` in VM 300 (guests.shutdown_timeout when given)."""
    guests: dict = {"allow_stop": True}
    if shutdown_timeout is not None:
        guests["shutdown_timeout"] = shutdown_timeout
    return {"hosts": {"kpro6": {
        "node": "kpro6", "iommu": {"vendor": "amd", "params": ["pci=realloc"]},
        "gpus": {b: "lxc" for b in ct_gpus} | {b: "vm:300" for b in vm_gpus},
        "containers": {200: {"gpus": ct_gpus}}, "vms": {300: {"gpus": vm_gpus, "machine": "q35"}},
        "reboot": {"allowed": True}, "guests": guests}}}


class Run:
    def __init__(self, twin, tmp: Path):
        self.twin, self.tmp = twin, tmp
        self.root = Path(json.loads((REPO / ".twin" / twin.name / "twin.json").read_text())["root"])
        (tmp / "inv.py").write_text(INVENTORY.format(twin_json=str(REPO / ".twin" / twin.name / "twin.json")))

    def deploy(self, ct, vm, *extra):
        (self.tmp / "inv.yml").write_text(yaml.safe_dump(spec_yaml(ct, vm)))
        # the whole deploy, as a user runs it (the spec has no nvidia section: that stage is idle)
        result = run_pyinfra(str(self.tmp / "inv.py"), "deploy.py", *extra,
                             env={"PYTHONPATH": str(REPO)}, timeout=600)
        return result.rc, result.output, result

    def read(self, rel: str) -> str:
        p = self.root / rel
        return p.read_text() if p.exists() else ""

    def state(self) -> dict:
        return json.loads(self.read("var/lib/twin/hw/state.json"))

    def snapshot(self) -> dict:
        return root_manifest(self.root)


def drivers(run: Run) -> dict[str, str]:
    return {g["bdf"]: g["driver"] for g in run.state()["gpus"]}


def minors(run: Run) -> dict[str, int]:
    return {g["bdf"]: g["minor"] for g in run.state()["gpus"] if g["minor"] is not None}


@pytest.mark.twin
@pytest.mark.slow
def test_move_two_gpus_from_vm_to_ct_rebuilds_everything(twin_factory, tmp_path):
    twin = twin_factory("kpro6")
    run = Run(twin, tmp_path)

    rc, out, res = run.deploy(BDFS[:4], BDFS[4:])
    assert rc == 0, out
    assert drivers(run) == {b: ("nvidia" if b in BDFS[:4] else "vfio-pci") for b in BDFS}
    rc, out, res = run.deploy(BDFS[:4], BDFS[4:])
    assert rc == 0 and res.changed == 0 and "no reboot pending" in out, out

    # --dry of the move: says what moves and what stops, changes nothing
    before = run.snapshot()
    rc, out, res = run.deploy(BDFS[:6], BDFS[6:], "--dry")
    assert rc == 0, out
    assert "0000:81:00.0: vfio-pci -> nvidia" in out and "0000:a1:00.0: vfio-pci -> nvidia" in out
    assert "guests that would be stopped for it" in out
    assert manifest_diff(before, run.snapshot()) == []

    # a busy GPU is not unbound: moving CT GPU 0000:61:00.0 (held) to the VM fails naming the
    # holder, and nothing changed
    hardware.mark_busy(run.root, "0000:61:00.0", holder="python3")
    rc, out, res = run.deploy(BDFS[:3], BDFS[3:])
    assert rc != 0 and "GPU 0000:61:00.0 must change driver but is held by python3" in out, out
    assert [d for d in manifest_diff(before, run.snapshot()) if not d.startswith("var/lib/twin/busy.json")] == []
    hardware.clear_busy(run.root)

    log_before = run.read("var/lib/twin/guests.log")
    rc, out, res = run.deploy(BDFS[:6], BDFS[6:])
    assert rc == 0, out
    assert drivers(run) == {b: ("nvidia" if b in BDFS[:6] else "vfio-pci") for b in BDFS}
    assert minors(run) == {b: i for i, b in enumerate(BDFS[:6])}
    ct = run.read("etc/pve/lxc/200.conf")
    assert [l for l in ct.splitlines() if re.match(r"^dev\d+: /dev/nvidia\d+,", l)] \
        == [f"dev{i}: /dev/nvidia{i},gid=44" for i in range(6)]
    # exactly its GPUs' nodes, nvidiactl and nvidia-uvm: no uvm-tools, no MIG caps (issue 39 item 7)
    assert "dev6: /dev/nvidiactl,gid=44" in ct and "dev7: /dev/nvidia-uvm,gid=44" in ct
    assert "uvm-tools" not in ct and "nvidia-caps" not in ct and not re.search(r"^dev8:", ct, re.M)
    vm = run.read("etc/pve/qemu-server/300.conf")
    assert sorted(l for l in vm.splitlines() if l.startswith("hostpci")) == [
        "hostpci0: mapping=pvegpu-kpro6-0000-c1-00-0,pcie=1", "hostpci1: mapping=pvegpu-kpro6-0000-e1-00-0,pcie=1"]
    cfg = run.read("etc/pve/mapping/pci.cfg")
    for b in BDFS[6:]:
        assert f"node=kpro6,path={b[:-2]}" in cfg
    # the mappings of the GPUs that left the VM were pvegpu's and nothing references them: deleted
    assert [l for l in cfg.splitlines() if l.startswith("pvegpu-")] == [
        "pvegpu-kpro6-0000-c1-00-0", "pvegpu-kpro6-0000-e1-00-0"]
    assert "PCI mapping pvegpu-kpro6-0000-81-00-0 is stale" in out
    # guests were stopped only where needed (the twin's guests were not running: nothing to stop)
    new_log = run.read("var/lib/twin/guests.log")[len(log_before):]
    assert all(" 200" in l or " 300" in l for l in new_log.splitlines())

    rc, out, res = run.deploy(BDFS[:6], BDFS[6:])
    assert rc == 0 and res.changed == 0 and "no reboot pending" in out, out
