"""The 8 -> 9 upgrade of a cluster, one node at a time (issue 40 item 2), on a two-node cluster
twin of kpro6 nodes on Proxmox VE 8 (fast lane: no real dist-upgrade; the job waits for dpkg's lock,
which the test holds as another apt run would, then fails on a broken package for real).

- one run over both nodes with `proxmox_ve_upgrade: perform`: one node starts its upgrade (the
  first whose plan claims the run's turn: pyinfra plans hosts side by side); the other waits,
  saying for whom, and nothing changes on it;
- a run while the first node's job runs: the first is reported, the second still waits, naming that
  node's job and step;
- the first node's job fails (`dpkg --configure -a` on a package whose postinst fails): the next run
  refuses it with its log's tail (a preflight refusal stops the whole run), and the second node
  still does not start: the upgrades stop at the first node that is not back healthy.

Fails on e8e8434^ (before the cluster turn): the second node starts its own upgrade in the first run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import REPO, manifest_diff, root_manifest, run_pyinfra
from tests.e2e.test_cluster_e2e import INVENTORY
from tests.e2e.test_upgrade_perform_e2e import BROKEN_DEB, HOLD_LOCK, PVE_LIST, STATE, wait_for
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

def ssh(name: str, command: str) -> str:
    done = runtime.ssh_run(name, [command])
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_one_node_at_a_time(twin_factory, tmp_path):
    cluster = f"u{os.getpid()}"
    twins = [twin_factory("kpro6", name=f"s22u{x}-{os.getpid()}", cluster=cluster) for x in "ab"]
    roots = {t.name: Path(t.root) for t in twins}
    spec = {"proxmox_ve": 9, "proxmox_ve_upgrade": "perform",
            "reboot": {"allowed": False}, "guests": {"allow_stop": True, "shutdown_timeout": 5}}
    (tmp_path / "inv.yml").write_text(yaml.safe_dump({"hosts": {n: dict(spec, node=n) for n in roots}}))
    (tmp_path / "inv.py").write_text(INVENTORY.format(names=list(roots), twins=str(runtime.TWINS_DIR)))
    inv = str(tmp_path / "inv.py")
    for name, root in roots.items():
        assert "half-configured" in ssh(name, BROKEN_DEB)  # before the lock below: dpkg takes it
        (root / PVE_LIST).write_text("deb http://download.proxmox.com/debian/pve bookworm pve-no-subscription\n")
        ssh(name, HOLD_LOCK)
        assert wait_for(lambda root=root: (root / "root/locked").exists(), 60)
    uppers = {n: root_manifest(roots[n].parent / "upper") for n in roots}

    # one node starts; the other waits for it and is left as it is
    one = run_pyinfra(inv, "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=600)
    assert one.rc != 0, one.output[-4000:]  # the waiting node stops the run for itself
    started = [n for n in roots if f"{n}: the Proxmox VE 8 -> 9 upgrade starts detached" in one.output]
    assert len(started) == 1, one.output[-4000:]
    first, second = started[0], next(n for n in roots if n != started[0])
    upper = roots[second].parent / "upper"
    before = uppers[second]
    assert f"{first}: the Proxmox VE 8 -> 9 upgrade starts detached on the host" in one.output, one.output[-4000:]
    assert (f"pvegpu: host {second}: the 8 -> 9 upgrade waits: the nodes of cluster {cluster} are upgraded one at "
            f"a time, and {first} starts its upgrade in this run") in one.output, one.output[-4000:]
    assert f"nothing was changed on {second}" in one.output
    assert manifest_diff(before, root_manifest(upper)) == []
    assert not (roots[second] / STATE).exists()
    assert wait_for(lambda: "step=wait-for-dpkg" in text(roots[first] / STATE / "state"), 60)

    # while the first node's job runs: reported there, the second still waits, naming it
    running = run_pyinfra(inv, "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=600)
    assert "the 8 -> 9 upgrade runs on the host" in running.output, running.output[-4000:]
    assert f"{first}: its upgrade job runs (step wait-for-dpkg since " in running.output, running.output[-4000:]
    assert manifest_diff(before, root_manifest(upper)) == []

    # the first node's job fails for real: it is refused with its log, and the second does not start
    (roots[first] / "root/release").touch()
    assert wait_for(lambda: "status=failed" in text(roots[first] / STATE / "state"), 120)
    failed = run_pyinfra(inv, "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=600)
    assert failed.rc != 0
    assert "pvegpu-test-broken: postinst fails" in failed.output, failed.output[-4000:]
    assert f"pvegpu preflight refused host {first}; nothing was changed" in failed.output  # the run stops there
    assert manifest_diff(before, root_manifest(upper)) == []
    assert not (roots[second] / STATE).exists()
    assert json.loads(ssh(second, "cat /etc/pve/.members"))["cluster"]["name"] == cluster
    (roots[second] / "root/release").touch()


POOL = ["0000:81:00.0", "0000:a1:00.0"]


def pool_entry(root: Path, node: str, bdf: str) -> str:
    """A map entry of the pool as Proxmox keeps it (pve-guest-common PVE/Mapping/PCI.pm: id,
    subsystem-id, iommugroup, node, path), from the twin's sysfs."""
    dev = root / "var/lib/twin/hw/sys/bus/pci/devices" / bdf
    sub = f"{(dev / 'subsystem_vendor').read_text().strip()[2:]}:{(dev / 'subsystem_device').read_text().strip()[2:]}"
    group = Path(os.readlink(dev / "iommu_group")).name
    return f"\tmap id=10de:2bb5,iommugroup={group},node={node},path={bdf[:-2]},subsystem-id={sub}\n"


def qm_list(name: str) -> dict[int, str]:
    return {int(w[0]): w[-4] for w in (line.split() for line in ssh(name, "qm list").splitlines()[1:]) if w}


def test_the_starting_node_moves_its_pooled_vm_and_gets_it_back(twin_factory, tmp_path):
    """`reboot.guests: migrate`: each node runs a VM of a GPU pool (one of the pool's two GPUs of
    each node). The node that starts its upgrade moves its VM (offline) to the other node, which
    has a free entry of the pool, and records it (guests-moved, 0600); once its job is done and its
    host checks have passed (the state written so here: the fast lane has no trixie to upgrade to),
    its run brings the VM back (migrated back, started here) and removes the record, while the
    other node waits for that (a node is done with its upgrade once its guests are back)."""
    cluster = f"v{os.getpid()}"
    twins = [twin_factory("kpro6", name=f"s22v{x}-{os.getpid()}", cluster=cluster) for x in "ab"]
    roots = {t.name: Path(t.root) for t in twins}
    a, b = roots
    pve = runtime.cluster_pve(cluster)
    (pve / "mapping").mkdir(exist_ok=True)
    (pve / "mapping/pci.cfg").write_text("rtx6000\n\tdescription pvegpu-gpu-pool\n" + "".join(
        pool_entry(roots[n], n, bdf) for n in roots for bdf in POOL))
    vms = {a: 300, b: 301}  # VM 300 is the profile's, on the first node
    ssh(b, "qm create 301 --machine q35 --bios ovmf")
    for name, vmid in vms.items():
        ssh(name, f"qm set {vmid} --hostpci0 mapping=rtx6000,pcie=1 && qm start {vmid}")
        (roots[name] / PVE_LIST).write_text("deb http://download.proxmox.com/debian/pve bookworm pve-no-subscription\n")
        ssh(name, HOLD_LOCK)
        assert wait_for(lambda name=name: (roots[name] / "root/locked").exists(), 60)
    spec = {"proxmox_ve": 9, "proxmox_ve_upgrade": "perform",
            "reboot": {"allowed": False, "guests": "migrate"}, "guests": {"allow_stop": True, "shutdown_timeout": 5}}
    (tmp_path / "inv.yml").write_text(yaml.safe_dump({"hosts": {n: dict(spec, node=n) for n in roots}}))
    (tmp_path / "inv.py").write_text(INVENTORY.format(names=list(roots), twins=str(runtime.TWINS_DIR)))
    inv = str(tmp_path / "inv.py")

    one = run_pyinfra(inv, "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=600)
    started = [n for n in roots if f"{n}: the Proxmox VE 8 -> 9 upgrade starts detached" in one.output]
    assert len(started) == 1, one.output[-4000:]
    first = started[0]
    other = b if first == a else a
    moved = vms[first]
    assert f"{first}: VM {moved} moved to node {other} for the 8 -> 9 upgrade" in one.output, one.output[-4000:]
    assert qm_list(other) == {300: "running", 301: "running"}
    assert moved not in qm_list(first)
    record = roots[first] / STATE / "guests-moved"
    assert record.read_text() == f"back qemu {moved} {other}\n"
    assert oct(record.stat().st_mode & 0o777) == "0o600"

    # the job's end, as a finished upgrade leaves it (the fast lane has no trixie): done, checked on
    # a kernel that is not 8's (kpro6 runs 6.14.8-2-pve, 9.0's kernel); the next run on that node
    # brings its VM back
    (roots[first] / "root/release").touch()
    assert wait_for(lambda: "status=" in text(roots[first] / STATE / "state") and
                    "status=running" not in text(roots[first] / STATE / "state"), 120)
    (roots[first] / STATE / "state").write_text("status=done\nstep=reboot-into-9\nsince=2026-12-07T00:00:00Z\n"
                                                "checked=2026-12-07T00:10:00Z\n")
    # the other node (lock still held: it would wait for dpkg) waits while the first's guests are away
    back = run_pyinfra(inv, "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=600)
    assert f"{first}: VM {moved} back from node {other}, running here again" in back.output, back.output[-4000:]
    assert (f"{first}: its GPU guests moved away for its upgrade are not back yet (qemu {moved} on {other})"
            in back.output), back.output[-4000:]
    assert not (roots[other] / STATE).exists()
    assert qm_list(first) == {moved: "running"} and moved not in qm_list(other)
    assert not record.exists()
    again = run_pyinfra(inv, "deploy.py", "--limit", first, env={"PYTHONPATH": str(REPO)}, timeout=600)
    assert again.rc == 0 and "Bring back the GPU guests" not in again.output, again.output[-4000:]
    (roots[other] / "root/release").touch()
