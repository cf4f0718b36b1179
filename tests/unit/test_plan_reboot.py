"""plan.reboot: a node's view of its cluster and how many of its nodes may reboot at once (issue 26)."""

from __future__ import annotations

import json

from plan.reboot import member_back, parse_cluster, roll_width

COROSYNC = """\
totem {
  cluster_name: gpu
  version: 2
}

nodelist {
  node {
    name: kpro5
    nodeid: 1
    quorum_votes: 1
    ring0_addr: 10.0.0.5
  }
  node {
    name: kpro6
    nodeid: 2
    quorum_votes: 2
    ring0_addr: 10.0.0.6
  }
  node {
    name: kpro7
    nodeid: 3
    ring0_addr: 10.0.0.7
  }
}
"""


def members(online: dict[str, int], quorate: int = 1, node: str = "kpro6") -> str:
    # pve-cluster src/pmxcfs/status.c: the layout of /etc/pve/.members in a cluster
    return json.dumps({"nodename": node, "version": 5,
                       "cluster": {"name": "gpu", "version": 3, "nodes": len(online), "quorate": quorate},
                       "nodelist": {n: {"id": i + 1, "online": up, "ip": f"10.0.0.{i + 5}"}
                                    for i, (n, up) in enumerate(online.items())}})


def test_a_single_node_has_no_roll():
    view = parse_cluster('{"nodename": "kpro6", "version": 0}\n', None)
    assert view.name is None and roll_width(view, 1) == (0, None) and member_back(view, "kpro6")


def test_votes_come_from_corosync_conf_default_one():
    view = parse_cluster(members({"kpro5": 1, "kpro6": 1, "kpro7": 1}), COROSYNC)
    assert view.votes == {"kpro5": 1, "kpro6": 2, "kpro7": 1}
    assert (view.expected_votes, view.quorum, view.online_votes) == (4, 3, 4)
    # one node at a time at most: the 2-vote node down leaves exactly the quorum
    assert roll_width(view, 3) == (0, "rebooting a node of cluster gpu would leave 2 of 4 votes, and quorum needs 3")


def test_width_is_what_quorum_spares_and_max_parallel_allows():
    five = {f"n{i}": 1 for i in range(5)}
    view = parse_cluster(members(five, node="n0"), None)
    assert (view.expected_votes, view.quorum) == (5, 3)
    assert roll_width(view, 1) == (1, None) and roll_width(view, 4) == (2, None)
    # one node already down: only one more may go
    view = parse_cluster(members(dict(five, n4=0), node="n0"), None)
    assert roll_width(view, 4) == (1, None)


def test_two_nodes_or_no_quorum_reboot_nothing():
    two = parse_cluster(members({"kpro5": 1, "kpro6": 1}), None)
    width, why = roll_width(two, 1)
    assert width == 0 and "leave 1 of 2 votes, and quorum needs 2" in (why or "")
    lost = parse_cluster(members({"kpro5": 0, "kpro6": 1, "kpro7": 0}, quorate=0), None)
    assert roll_width(lost, 1) == (0, "cluster gpu has no quorum now; pvegpu reboots none of its nodes")


def test_a_node_is_back_when_online_and_the_cluster_quorate():
    assert member_back(parse_cluster(members({"kpro5": 1, "kpro6": 1, "kpro7": 0}), None), "kpro6")
    assert not member_back(parse_cluster(members({"kpro5": 1, "kpro6": 0, "kpro7": 1}), None), "kpro6")
    assert not member_back(parse_cluster(members({"kpro5": 0, "kpro6": 1, "kpro7": 0}, quorate=0), None), "kpro6")
    assert parse_cluster("not json", None).name is None
