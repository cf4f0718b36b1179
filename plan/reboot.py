"""What a pending reboot looks like to the user (pure).

Stages report reasons with `facts.run_state.need_reboot("cmdline", "booted lacks amd_iommu=on")`
while their operations are generated (from facts, before anything runs); the reboot stage
(last) reads `facts.run_state.reboot_reasons()`: it reboots once when the spec allows it, else
prints this "reboot pending" summary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


def pending_summary(name: str, reasons: list[tuple[str, str]]) -> list[str]:
    if not reasons:
        return [f"{name}: no reboot pending"]
    return [f"{name}: reboot pending ({len(reasons)} reason(s)):"] + [f"  - {k}: {d}" for k, d in reasons]


# ---------------------------------------------------------------- rolling reboots (issue 26)



@dataclass(frozen=True)
class ClusterView:
    """A node's view of its cluster: pmxcfs's /etc/pve/.members (pve-cluster src/pmxcfs/status.c:
    nodename, cluster {name, quorate}, nodelist {name: {online}}) and each node's quorum_votes
    from /etc/pve/corosync.conf's nodelist (corosync.conf(5); 1 when not given). `name` None:
    not in a cluster."""

    name: str | None
    node: str | None
    quorate: bool
    online: dict[str, bool] = field(default_factory=dict)
    votes: dict[str, int] = field(default_factory=dict)

    @property
    def expected_votes(self) -> int:
        return sum(self.votes.get(n, 1) for n in self.online)

    @property
    def quorum(self) -> int:
        """votequorum(5): more than half of the expected votes."""
        return self.expected_votes // 2 + 1

    @property
    def online_votes(self) -> int:
        return sum(self.votes.get(n, 1) for n, up in self.online.items() if up)


def parse_cluster(members: str | None, corosync: str | None) -> ClusterView:
    """`ClusterView` from the texts of /etc/pve/.members and /etc/pve/corosync.conf (None: absent)."""
    try:
        data = json.loads(members or "{}")
    except ValueError:
        data = {}
    cluster = data.get("cluster") or {}
    nodelist = data.get("nodelist") or {}
    if not cluster.get("name") or not nodelist:  # a single node: pmxcfs writes nodename and version only
        return ClusterView(None, data.get("nodename"), True)
    votes: dict[str, int] = {}
    for block in re.findall(r"\bnode\s*\{([^{}]*)\}", corosync or ""):
        name = re.search(r"^\s*name:\s*(\S+)", block, re.M)
        count = re.search(r"^\s*quorum_votes:\s*(\d+)", block, re.M)
        if name:
            votes[name.group(1)] = int(count.group(1)) if count else 1
    return ClusterView(cluster["name"], data.get("nodename"), bool(cluster.get("quorate")),
                       {n: bool(v.get("online")) for n, v in nodelist.items()},
                       {n: votes.get(n, 1) for n in nodelist})


def roll_width(view: ClusterView, max_parallel: int) -> tuple[int, str | None]:
    """How many nodes of `view`'s cluster may reboot at once: at most `max_parallel`, and only as
    many as the online votes can lose while keeping quorum (each node's own votes). ``(0, None)``:
    not a cluster (no limit); ``(0, why)``: no node of it may reboot now."""
    if view.name is None or len(view.online) <= 1:
        return 0, None
    if not view.quorate:
        return 0, f"cluster {view.name} has no quorum now; pvegpu reboots none of its nodes"
    spare = view.online_votes - view.quorum
    per_node = max(view.votes.values() or [1])
    width = min(max_parallel, spare // per_node)
    if width < 1:
        return 0, (f"rebooting a node of cluster {view.name} would leave {view.online_votes - per_node} of "
                   f"{view.expected_votes} votes, and quorum needs {view.quorum}")
    return width, None


def member_back(view: ClusterView, node: str) -> bool:
    """`node` is online in its cluster again and the cluster is quorate."""
    return view.name is None or (view.quorate and view.online.get(node, False))


def roll_check_lines(expect: dict, reasons: list[tuple[str, str]], cmdline: dict | None = None,
                     release: str | None = None) -> list[str]:
    """The host checks a node of a rolling reboot must pass before the next node reboots, as
    lines for plan.kernel.host_checks_command (the loop the kernel trial's checks run through):
    the NVIDIA module of the spec's version loaded and each spec GPU on its role's driver
    (`expect`: plan.kernel.host_expectations), and what the reboot was for: the command line the
    boot stage configured (`cmdline`: plan.boot.cmdline_difference of the run, when a reason is
    "cmdline") and the kernel a trial boot selected (`release`)."""
    kinds = {kind for kind, _ in reasons}
    lines = [f"nvidia {expect['nvidia']}"] if expect.get("nvidia") else []
    lines += [f"gpu {bdf} {driver}" for bdf, driver in sorted((expect.get("drivers") or {}).items())]
    if release:
        lines.append(f"kernel {release}")
    if cmdline and "cmdline" in kinds:
        lines += [f"cmdline {w}" for w in cmdline.get("missing") or []]
        lines += [f"nocmdline {w}" for w in cmdline.get("extra") or []]
    return lines
