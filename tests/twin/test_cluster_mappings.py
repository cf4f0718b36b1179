"""Nodes of one cluster writing the same PCI mapping at once (issue 26): the guests stage's merge
(templates/mapping-merge.sh.j2, operations.guests.mapping_commands) run by several "nodes" at
the same moment against one /etc/pve (a tmp root) through the twin's pvesh stand-in, which holds
pmxcfs's cluster lock and checks the digest as the API does."""
import os
import subprocess

import pytest

from operations.guests import mapping_merge_command
from plan.guests import MappingChange


@pytest.fixture
def root(kpro6_tmp_root):
    """A fresh kpro6 root per test (tests/twin/fixtures.py)."""
    return kpro6_tmp_root


def entry(node, bus="81", group="40"):
    return {"id": "10de:2bb5", "iommugroup": group, "node": node, "path": f"0000:{bus}:00",
            "subsystem-id": "10de:204e"}


def merge(root, node, *entries, mid="rtx6000"):
    """Start the SSH command of node `node`'s merge (no wait)."""
    cfg = str(root / "etc/pve/mapping/pci.cfg")
    command = mapping_merge_command(MappingChange(mid, "merge", list(entries), "test", node), cfg=cfg)
    env = dict(os.environ, TWIN_ROOT=str(root), PATH=f"{root}/usr/local/sbin:{os.environ['PATH']}")
    return subprocess.Popen(command, shell=True, env=env, stderr=subprocess.PIPE, text=True)


def maps(root, mid="rtx6000"):
    out, cur = [], None
    for line in (root / "etc/pve/mapping/pci.cfg").read_text().splitlines():
        if line and not line[0].isspace():
            cur = line.strip()
        elif cur == mid and line.strip().startswith("map "):
            out.append(line.strip()[4:])
    return out


def test_nodes_merging_one_mapping_at_once_keep_every_nodes_entries(root):
    # a third node's entry is there before; six nodes (two GPUs each) create/merge at once
    first = merge(root, "n0", entry("n0"))
    assert first.wait() == 0, first.stderr.read() if first.stderr else ""
    nodes = [f"n{i}" for i in range(1, 7)]
    procs = [merge(root, n, entry(n), entry(n, "c1", "41")) for n in nodes]
    assert [p.wait() for p in procs] == [0] * 6, [p.stderr.read() for p in procs if p.stderr]
    got = maps(root)
    assert sorted(got) == sorted(f"id=10de:2bb5,iommugroup={g},node={n},path=0000:{b}:00,subsystem-id=10de:204e"
                                 for n in ["n0", *nodes] for b, g in (("81", "40"), ("c1", "41"))
                                 if n != "n0" or b == "81")
    # a node's merge replaces only its own entries (the hardware changed under n3)
    again = merge(root, "n3", entry("n3", group="99"))
    assert again.wait() == 0
    after = maps(root)
    assert [m for m in after if "node=n3," in m] == ["id=10de:2bb5,iommugroup=99,node=n3,path=0000:81:00,subsystem-id=10de:204e"]
    assert [m for m in after if "node=n3," not in m] == [m for m in got if "node=n3," not in m]
    # and a node that has no such GPU any more takes its entries out, nobody else's
    gone = merge(root, "n5")
    assert gone.wait() == 0
    assert [m for m in maps(root) if "node=n5," in m] == [] and len(maps(root)) == len(after) - 2
