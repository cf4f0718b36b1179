"""Twins of one cluster share /etc/pve as pmxcfs gives it to every node (tests/twin/runtime.py
"Clusters"): nodes/<node>/..., mapping/, the cluster lock under priv/lock, .vmlist, and each
node's own views (lxc, qemu-server, local, .members)."""
from __future__ import annotations

import json
import os
import subprocess

from tests.twin import runtime


def ssh(twin, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(runtime.ssh_command(twin.name, [command]), capture_output=True, text=True,
                          timeout=60)


def test_two_nodes_share_etc_pve_and_each_lists_its_own_guests(twin_factory):
    cluster = f"c{os.getpid()}"
    a = twin_factory("kpro6", name=f"s26a-{os.getpid()}", cluster=cluster)
    b = twin_factory("kpro6", name=f"s26b-{os.getpid()}", cluster=cluster)
    # the profile's guests went to the first node only: guest ids are the cluster's
    assert "300" in ssh(a, "qm list").stdout and ssh(b, "qm list").stdout.strip() == ""
    vmlist = json.loads(ssh(b, "cat /etc/pve/.vmlist").stdout)
    assert vmlist["ids"]["300"] == {"node": a.name, "type": "qemu", "version": 1}
    # pve-cluster check_vmid_unused: an id another node has is refused with that node's name
    r = ssh(b, "qm create 300")
    assert r.returncode != 0 and f"VM 300 already exists on node '{a.name}'" in r.stderr
    assert ssh(b, "qm create 301 --machine q35").returncode == 0
    assert json.loads(ssh(a, "cat /etc/pve/.vmlist").stdout)["ids"]["301"]["node"] == b.name
    # a write on one node is the other node's file; the node-local views differ
    assert ssh(a, f"cat /etc/pve/nodes/{b.name}/qemu-server/301.conf").stdout == "machine: q35\n"
    assert ssh(b, "ls /etc/pve/qemu-server").stdout.split() == ["301.conf"]
    assert "300.conf" in ssh(a, "ls /etc/pve/qemu-server").stdout.split()
    ssh(a, "pvesh create /cluster/mapping/pci --id rtx6000 --map node=x,path=0000:81:00.0,id=10de:2bb5")
    assert "rtx6000" in ssh(b, "cat /etc/pve/mapping/pci.cfg").stdout
    assert ssh(b, "qm create 302 && qm destroy 302").returncode == 0
    assert "302" not in json.loads(ssh(a, "cat /etc/pve/.vmlist").stdout)["ids"]
    members = [json.loads(ssh(t, "cat /etc/pve/.members").stdout) for t in (a, b)]
    assert [m["nodename"] for m in members] == [a.name, b.name]
    assert members[0]["nodelist"] == members[1]["nodelist"] and members[0]["cluster"]["quorate"] == 1
    assert {n: v["online"] for n, v in members[0]["nodelist"].items()} == {a.name: 1, b.name: 1}
    # one node down: the other sees it offline; 1 of 2 votes is no quorum (corosync votequorum)
    twin_factory.stop(b)
    after = json.loads(ssh(a, "cat /etc/pve/.members").stdout)
    assert after["nodelist"][b.name]["online"] == 0 and after["cluster"]["quorate"] == 0
    # the shared tree survives a reboot of a node (its mounts are made again at each boot)
    boots = runtime.TWINS_DIR / a.name / "boots"
    before = len(boots.read_text().splitlines())
    ssh(a, "touch /var/lib/twin/reboot-request")
    assert runtime._wait_until(lambda: len(boots.read_text().splitlines()) > before, 60)
    assert "301" in ssh(a, "cat /etc/pve/.vmlist").stdout and "300" in ssh(a, "qm list").stdout


def test_a_two_node_cluster_has_no_quorum_while_a_node_is_down_and_has_it_again_when_it_is_back(twin_factory):
    # corosync votequorum without two_node or a QDevice: 2 nodes, quorum 2; the operator's way on
    # such a cluster (docs/howto/add-node.md): reboot one node, then `pvecm status` on the other
    cluster = f"q{os.getpid()}"
    a = twin_factory("kpro6", name=f"s18a-{os.getpid()}", cluster=cluster)
    b = twin_factory("kpro6", name=f"s18b-{os.getpid()}", cluster=cluster)
    r = ssh(a, "pvecm status")
    assert r.returncode == 0 and "Quorate:          Yes" in r.stdout and "Total votes:      2" in r.stdout, r
    # b boots but its corosync does not come back: a is alone, 1 of 2 votes, no quorum
    runtime.set_fault(b.name, no_cluster_rejoin=True)
    try:
        runtime.reboot(b.name, timeout=5)
        raise AssertionError("twinctl reboot waited for a node that stays out of its cluster")
    except runtime.TwinError as e:
        assert "did not boot again" in str(e)
    r = ssh(a, "pvecm status")
    assert r.returncode == 2 and "Quorate:          No" in r.stdout and "Activity blocked" in r.stdout, r
    assert f"{a.address} (local)\n" in r.stdout and b.address not in r.stdout.split("Membership information")[1]
    # b rejoins at its next boot: quorate again, both members
    runtime.set_fault(b.name)
    assert runtime.reboot(b.name)
    r = ssh(a, "pvecm status")
    assert r.returncode == 0 and "Quorate:          Yes" in r.stdout, r
    # node ids follow the names (runtime.write_members): a is 1, b is 2
    assert r.stdout.endswith(f"0x00000001          1 {a.address} (local)\n0x00000002          1 {b.address}\n")
