"""A Proxmox cluster of GPU nodes (issue 26), end to end on a cluster twin: three kpro6 twins
sharing one /etc/pve (tests/twin/runtime.py "Clusters"), converged in one pyinfra run (pyinfra
drives the hosts at once), each node's VM in the same GPU pool.

Proves: every node's pool entries survive the others' writes (the mapping merge under the
digest, templates/mapping-merge.sh.j2, through the twin's pvesh that holds pmxcfs's cluster
lock), each VM references the pool, and a second converge changes nothing. The reboots the
first converge needs (IOMMU on the command line, GPUs to vfio-pci) roll one node at a time, each
back in the cluster and its host checks passed before the next; a node that does not come back or
fails its checks stops the roll, naming it (and the check), and the nodes after it are not rebooted. A pooled VM whose node has no free GPU of the pool
left migrates (offline) to a node that has one and starts there.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.e2e.harness import run_host_checks, run_pyinfra
from tests.twin import runtime

REPO = Path(__file__).resolve().parents[2]
POOL_GPUS = ["0000:81:00.0", "0000:a1:00.0"]

INVENTORY = textwrap.dedent("""\
    import json
    from pathlib import Path
    from spec.load import inventory_hosts
    specs = dict(inventory_hosts(Path(__file__).with_suffix(".yml")))
    gpu_hosts = []
    for name in {names!r}:
        twin = json.loads((Path({twins!r}) / name / "twin.json").read_text())
        gpu_hosts.append((name, dict(specs[name], ssh_hostname=twin["address"], ssh_port=twin["port"],
                                     ssh_user="root", ssh_key=twin["key"], ssh_known_hosts_file="/dev/null",
                                     ssh_strict_host_key_checking="no", pvegpu_node=name)))
""")


def node_spec(name: str, vmid: int, params: tuple[str, ...] = ("pci=realloc",), pool: str | None = "rtx6000",
              guests: str = "stop") -> dict:
    vm = {"gpus": POOL_GPUS, "machine": "q35"} | ({"pool": pool} if pool else {})
    return {"node": name, "iommu": {"vendor": "amd", "params": list(params)},
            "gpus": {b: f"vm:{vmid}" for b in POOL_GPUS},
            "vms": {vmid: vm},
            "reboot": {"allowed": True, "rejoin_timeout": 8, "guests": guests},
            "guests": {"allow_stop": True, "shutdown_timeout": 5}}


def guest_log(name: str) -> list[tuple[float, str]]:
    """(unix time, "action kind id") of twin `name`'s guest starts and stops (tests/twin/standins/twinstate.py)."""
    f = Path(runtime.spec_of(name)["root"]) / "var/lib/twin/guests.log"
    out = []
    for line in (f.read_text().splitlines() if f.exists() else []):
        when, _, what = line.partition(" ")
        out.append((datetime.datetime.fromisoformat(when).timestamp(), what))
    return out


def reboots(name: str) -> list[tuple[float, float]]:
    """(requested, booted) of each reboot of twin `name` (tests/twin/runtime.py)."""
    f = runtime.TWINS_DIR / name / "reboots"
    return [(float(a), float(b)) for a, b in (line.split() for line in f.read_text().splitlines())] if f.exists() else []


def ssh(name: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(runtime.ssh_command(name, [command]), capture_output=True, text=True, timeout=60)


def reboot_by_hand(name: str) -> None:
    """Reboot twin `name` as an operator would (its reboot request) and wait until it is online in
    its cluster again."""
    before = len(reboots(name))
    ssh(name, "touch /var/lib/twin/reboot-request")

    def online() -> bool:
        r = ssh(name, "cat /etc/pve/.members")
        return r.returncode == 0 and json.loads(r.stdout or "{}").get("nodelist", {}).get(name, {}).get("online") == 1
    assert runtime._wait_until(lambda: len(reboots(name)) > before and online(), 120), name


@pytest.mark.twin
@pytest.mark.slow
def test_three_nodes_converged_at_once_share_one_gpu_pool(twin_factory, tmp_path):
    cluster = f"c{os.getpid()}"
    names = [twin_factory("kpro6", name=f"s26{x}-{os.getpid()}", cluster=cluster).name for x in "abc"]
    vmids = {names[0]: 300, names[1]: 301, names[2]: 302}
    for name in names[1:]:  # VM 300 is the profile's, on the first node
        assert ssh(name, f"qm create {vmids[name]} --machine q35 --bios ovmf").returncode == 0
    (tmp_path / "inv.yml").write_text(yaml.safe_dump({"hosts": {n: node_spec(n, vmids[n]) for n in names}}))
    (tmp_path / "inv.py").write_text(INVENTORY.format(names=names, twins=str(runtime.TWINS_DIR)))

    result = run_pyinfra(str(tmp_path / "inv.py"), "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=900)
    assert result.rc == 0, result.output
    pve = runtime.cluster_pve(cluster)
    cfg = (pve / "mapping/pci.cfg").read_text()
    pool = cfg.split("rtx6000\n", 1)[1].split("\n\n", 1)[0]
    entries = sorted(line.strip() for line in pool.splitlines() if line.strip().startswith("map "))
    assert len(entries) == 6, cfg
    for name in names:
        for bdf in POOL_GPUS:
            assert any(f"node={name},path={bdf[:-2]}" in e for e in entries), (name, bdf, cfg)
        conf = (pve / "nodes" / name / "qemu-server" / f"{vmids[name]}.conf").read_text()
        assert sorted(line for line in conf.splitlines() if line.startswith("hostpci")) == [
            "hostpci0: mapping=rtx6000,pcie=1", "hostpci1: mapping=rtx6000,pcie=1"], conf
    assert not re.search(r"^pvegpu-", cfg, re.M)  # pooled VMs need no per-node mappings
    assert not list((pve / "priv/lock").iterdir())  # every cluster lock given back

    # the reboots rolled: one node at a time, each booted before the next was asked to reboot
    rolled = sorted(r for n in names for r in reboots(n))
    assert [len(reboots(n)) for n in names] == [1, 1, 1], rolled
    assert all(rolled[i][1] < rolled[i + 1][0] for i in range(len(rolled) - 1)), rolled
    assert "rolling reboot, 1 node(s) at a time (3 of 3 votes online, quorum 2)" in result.output
    # each node passed its host checks before the next rebooted: both pooled GPUs on vfio-pci, the
    # configured command line booted (plan.reboot.roll_check_lines)
    for n in names:
        assert f"{n}: host checks passed after the reboot (" in result.output, result.output

    again = run_pyinfra(str(tmp_path / "inv.py"), "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=900)
    assert again.rc == 0 and again.changed == 0, again.output
    assert json.loads(ssh(names[1], "cat /etc/pve/.vmlist").stdout)["ids"]["302"]["node"] == names[2]
    assert "\tdescription pvegpu-gpu-pool\n" in cfg  # how a later run knows the pool is pvegpu's
    # the host checks of every node pass with pooled VMs (tests/host/test_gpus.py)
    checks = run_host_checks(str(tmp_path / "inv.py"), env={"PYTHONPATH": str(REPO)})
    assert checks.returncode == 0, checks.stdout[-3000:] + checks.stderr[-2000:]

    # the third node's VM leaves the pool: that node's entries leave it, the others' stay, and
    # its (stopped) VM gets per-node mappings
    c = names[2]
    (tmp_path / "inv.yml").write_text(yaml.safe_dump({"hosts": {
        n: node_spec(n, vmids[n], pool=None if n == c else "rtx6000") for n in names}}))
    out = run_pyinfra(str(tmp_path / "inv.py"), "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=900)
    assert out.rc == 0, out.output
    cfg = (pve / "mapping/pci.cfg").read_text()
    pool = cfg.split("rtx6000\n", 1)[1].split("\n\n", 1)[0]
    assert pool.count("\tmap ") == 4 and f"node={c}," not in pool, cfg
    assert f"GPU pool rtx6000 is not in this node's spec any more: taking out {c}'s entries" in out.output
    conf = (pve / "nodes" / c / "qemu-server" / f"{vmids[c]}.conf").read_text()
    assert sorted(line for line in conf.splitlines() if line.startswith("hostpci")) == [
        f"hostpci0: mapping=pvegpu-{c}-0000-81-00-0,pcie=1", f"hostpci1: mapping=pvegpu-{c}-0000-a1-00-0,pcie=1"], conf

    # a change that needs a reboot everywhere, and no node comes back into the cluster after its
    # boot (the fault on all three: pyinfra's order of hosts is its own): the first one rebooted
    # stops the roll, the two others are left alone, each saying why
    for n in names:
        runtime.set_fault(n, no_cluster_rejoin=True)
    (tmp_path / "inv.yml").write_text(yaml.safe_dump({"hosts": {
        n: node_spec(n, vmids[n], ("pci=realloc", "pcie_aspm=off")) for n in names}}))
    failed = run_pyinfra(str(tmp_path / "inv.py"), "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=900)
    assert failed.rc != 0
    (first,) = [n for n in names if len(reboots(n)) == 2]
    assert f"did not come back into cluster {cluster} within 8 s ({first} offline)" in failed.output
    left = sorted(n for n in names
                  if f"{n}: not rebooted: the rolling reboot of cluster {cluster} stopped at node {first}" in failed.output)
    assert left == sorted(n for n in names if n != first) and all(len(reboots(n)) == 1 for n in left)
    for n in names:
        runtime.set_fault(n)

    # the node that did not come back is rebooted by hand, into its cluster; the two others still
    # need their reboot. The next of them rebooted comes up with one pooled GPU its driver's probe
    # failed for (the fault on both): its host checks fail, the roll stops naming the node and the
    # check, and the last node is not rebooted, its reboot printed as pending
    reboot_by_hand(first)
    rest = [n for n in names if n != first]
    for n in rest:
        runtime.set_fault(n, probe_fails=(POOL_GPUS[1],))
    counts = {n: len(reboots(n)) for n in names}
    bad = run_pyinfra(str(tmp_path / "inv.py"), "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=900)
    assert bad.rc != 0
    (broken,) = [n for n in rest if len(reboots(n)) == counts[n] + 1]
    (spared,) = [n for n in rest if n != broken]
    said = f"GPU {POOL_GPUS[1]} is on no driver, not vfio-pci"
    assert f"{broken}: host checks failed after the reboot: {said}" in bad.output, bad.output
    assert (f"{spared}: not rebooted: the rolling reboot of cluster {cluster} stopped at node {broken}, which failed "
            f"its host checks after the reboot ({said};)") in bad.output, bad.output
    assert f"{spared}: reboot pending (" in bad.output
    assert len(reboots(spared)) == counts[spared] and len(reboots(first)) == counts[first]
    for n in rest:
        runtime.set_fault(n)
    reboot_by_hand(broken)  # its GPU probes again

    # reboot.guests: migrate. VM 300 runs on the first node, holding both of its pooled GPUs; a
    # change every node reboots for: when the first node's turn comes, VM 300 is shut down,
    # migrated offline to the first other node with two free devices of the pool (the second,
    # whose pooled VM is stopped), started there, and brought back once the first node is back
    # and its checks passed
    # VM 302 on the third node is an HA resource HA keeps started: HA relocates it (the twin's CRM/LRM,
    # tests/twin/standins/proxmox.py ha_step) to the second node before the third reboots, and back
    a, b = names[0], names[1]
    assert ssh(a, "qm start 300").returncode == 0
    (pve / "ha").mkdir(exist_ok=True)
    (pve / "ha/resources.cfg").write_text("vm: 302\n\tstate started\n")
    assert "Requesting HA start for VM 302" in ssh(c, "qm start 302").stdout
    assert runtime._wait_until(lambda: "status: running" in ssh(c, "qm status 302").stdout, 30)
    (tmp_path / "inv.yml").write_text(yaml.safe_dump({"hosts": {
        n: node_spec(n, vmids[n], ("pci=realloc", "pcie_aspm=off", "pcie_port_pm=off"), guests="migrate")
        for n in names}}))
    counts = {n: len(reboots(n)) for n in names}
    moved = run_pyinfra(str(tmp_path / "inv.py"), "deploy.py", env={"PYTHONPATH": str(REPO)}, timeout=900)
    assert moved.rc == 0, moved.output
    assert {n: len(reboots(n)) - counts[n] for n in names} == {n: 1 for n in names}
    assert (f"{a}: VM 300 moved to node {b} before the reboot (shut down, migrated offline, started there)"
            in moved.output), moved.output
    assert f"{a}: VM 300 back from node {b}, running here again" in moved.output
    assert f"{c}: VM 302 (HA resource vm:302) relocated by HA to node {b} before the reboot" in moved.output
    assert f"{c}: VM 302 (HA resource vm:302) relocated back from node {b}, running here again" in moved.output
    assert "ha-relocate qemu 302" in [what for _, what in guest_log(c)]
    assert "ha-start qemu 302" in [what for _, what in guest_log(b)]
    assert "status: running" in ssh(c, "qm status 302").stdout
    requested, booted = reboots(a)[-1]
    on_b = [(t, what) for t, what in guest_log(b) if what.endswith(" qemu 300")]
    started = [t for t, what in on_b if what.startswith("start ")]
    halted = [t for t, what in on_b if not what.startswith("start ")]
    # it ran on the second node while the first rebooted (the log has whole seconds)
    assert started and int(started[-1]) <= requested and halted and halted[-1] >= int(booted), (on_b, requested, booted)
    assert "status: running" in ssh(a, "qm status 300").stdout
    assert json.loads(ssh(b, "cat /etc/pve/.vmlist").stdout)["ids"]["300"]["node"] == a
    assert ssh(a, "qm stop 300").returncode == 0
    (pve / "ha/resources.cfg").write_text("")
    assert ssh(c, "qm stop 302").returncode == 0

    # the first node's pooled GPUs are taken by another VM of the pool: VM 300 finds no free one
    # there, migrates offline to the second node (whose pooled VM is stopped) and starts on it
    a, b = names[0], names[1]
    assert ssh(a, "qm create 310 --machine q35 --hostpci0 mapping=rtx6000,pcie=1 "
                  "--hostpci1 mapping=rtx6000,pcie=1 && qm start 310").returncode == 0
    r = ssh(a, "qm start 300")
    assert r.returncode != 0 and "could not find a free device for 'hostpci0'" in r.stderr, r.stderr
    r = ssh(a, f"qm migrate 300 {b}")
    assert r.returncode == 0, r.stderr
    r = ssh(b, "qm start 300")
    assert r.returncode == 0, r.stderr
    assert "running" in ssh(b, "qm status 300").stdout
    held = ssh(b, "cat /run/qemu-server/pci-id-reservations").stdout
    ids = [line.split()[0] for line in held.splitlines() if line.split()[1] == "300"]
    assert ids and {i.rsplit(".", 1)[0] for i in ids} == {g[:-2] for g in POOL_GPUS}, held
    ssh(a, "qm stop 310")
    ssh(b, "qm stop 300")
