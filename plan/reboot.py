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
from typing import NamedTuple

from facts.shell import word
from plan.guest_control import KIND_LABEL, config_lock, ha_resource, lock_refusal
from plan.loader import next_boot
from plan.nvidia import module_current


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


# ---------------------------------------------------------------- the boot's own jobs after a reboot

# systemd's manager states once its boot transaction is over (systemctl is-system-running prints
# one); "initializing" and "starting" mean it is still booting (systemd src/systemctl/
# systemctl-is-system-running.c verb_is_system_running: --wait waits while it says either)
BOOT_DONE_STATES = ("running", "degraded", "maintenance", "stopping")


def boot_wait_command(timeout: int) -> str:
    """After the reconnect of a reboot: wait (at most `timeout` s) until the node's boot is done,
    pve-guests.service's start of the onboot guests included (it is a oneshot of multi-user.target,
    so systemd's boot is "starting" until startall and its `up=` delays are over, and nothing
    orders sshd after it: pve-manager services/pve-guests.service). Always exits 0; the last line
    is the state systemd ends with, none when the wait timed out (`boot_wait_problem`)."""
    return f"timeout {word(int(timeout))} systemctl is-system-running --wait || true"


def boot_wait_problem(stdout_lines: list[str]) -> str | None:
    """`boot_wait_command`'s output → None when the boot is done (whatever state it ended in, a
    failed unit's "degraded" included), else what was seen: the state still booting, or that
    systemd gave no state (the wait timed out, or no systemd answered)."""
    state = stdout_lines[-1].strip() if stdout_lines else ""
    if state in BOOT_DONE_STATES:
        return None
    return f"systemd says {state!r}" if state else "no state from systemd"


# ---------------------------------------------------------------- GPU guests before a node reboots


def _pve_true(value) -> bool:
    # a boolean config key: 1|on|yes|true (pve-common PVE/JSONSchema.pm parse_boolean)
    return str(value or "").strip().lower() in ("1", "on", "yes", "true")


class Guest(NamedTuple):
    """One guest of a node: `kind` "qemu" or "lxc", and its vmid."""

    kind: str
    vmid: int

    @property
    def label(self) -> str:
        """"VM 300" / "CT 200", for messages."""
        return f"{KIND_LABEL[self.kind]} {self.vmid}"


def not_started_at_boot(guests: dict, configs: dict[str, dict[int, dict]], ha: dict) -> list[Guest]:
    """The guests running now that the node's boot leaves stopped (VMs first, each kind by vmid).

    `guests`: a facts.guest_state.GuestState reading; `configs`: {"qemu": QemuConfigs, "lxc":
    LxcConfigs}; `ha`: HaResources. At boot pve-guests.service runs `startall` (pve-manager
    PVE/API2/Nodes.pm startall, get_start_stop_list): it starts only guests whose config has
    `onboot` set, no template, no HA resource (the HA stack starts those by their requested state)."""
    out = []
    for kind in ("qemu", "lxc"):
        for vmid, status in sorted((guests.get(kind) or {}).items()):
            options = ((configs.get(kind) or {}).get(vmid) or {}).get("options") or {}
            if status != "running" or ha_resource(ha, kind, vmid):
                continue
            if not _pve_true(options.get("onboot")) or _pve_true(options.get("template")):
                out.append(Guest(kind, vmid))
    return out


def _entry_free(entry: dict, reserved: set[str]) -> bool:
    """A mapping entry none of whose devices a running VM holds (qemu-server PVE/QemuServer/PCI.pm
    choose_hostpci_devices(): an entry is taken when no reservation of another running VM covers
    any of its paths; a path without a function covers every function of the slot)."""
    paths = [p for p in str(entry.get("path") or "").split(";") if p]
    return bool(paths) and not any(r == p or r.startswith(p + ".") for p in paths for r in reserved)


def free_devices(node: str, guests: dict) -> dict[str, int]:
    """{mapping id: entries for `node` no running VM holds}, from a facts.reboot.parse_node_guests
    reading of `node` (its reservations and the running VMs of `qm list`)."""
    running = {v for v, s in guests["status"]["qemu"].items() if s == "running"}
    reserved = {i for i, v in guests["reserved"].items() if v in running}
    return {mid: sum(1 for e in m.get("map") or [] if e.get("node") == node and _entry_free(e, reserved))
            for mid, m in guests["mappings"].items()}


def _has_gpu_devices(config: dict) -> bool:
    """A CT with NVIDIA device nodes passed in (devN or lxc.mount.entry of /dev/nvidia*)."""
    if any(str(d.get("path", "")).startswith("/dev/nvidia") for d in (config.get("devices") or {}).values()):
        return True
    return any(k.startswith("lxc.mount.entry") and "/dev/nvidia" in v for k, v in config.get("lxc") or [])


def plan_guest_moves(node: str, mine: dict, targets: dict[str, dict], fallback: str = "refuse",
                     absent: tuple[str, ...] = ()) -> dict:
    """What `reboot.guests: migrate` does with `node`'s running GPU guests before it reboots.

    `mine`, `targets[n]`: facts.reboot.parse_node_guests readings of this node and of each other
    online node of the run; `absent`: online nodes not in the run (their free devices are not
    known here). Returns ``{"migrate": [(vmid, target)], "relocate": [(vmid, sid, target)],
    "stop": [(kind, vmid)], "refusals": [why]}``:
    a running VM whose every hostpci line names a mapping goes to the first target (by name) with
    a free entry of those mappings for each line (offline: qemu-server PVE/API2/Qemu.pm migrate_vm
    refuses a running VM without --online, and a VM with passthrough devices cannot migrate
    online); a VM with a hostpci line bound to this node's address, and a running CT with NVIDIA
    device nodes (pve-container PVE/LXC/Migrate.pm prepare: no live migration of containers), are
    stopped (started again after). A pooled VM that is an HA resource HA keeps started is relocated
    by HA to the target instead. Refused: a locked guest, any other HA resource (HA owns its
    placement, a shutdown only asks HA), and a pooled VM no target has room for, unless `fallback`
    is "stop" (not for an HA resource)."""
    # a mixed cluster (the 8 -> 9 upgrade, node by node): a guest moves to a node of its own release or a
    # newer one only (Proxmox's upgrade guide: migration from a newer release to an older one is not
    # supported; 9's configs may carry what 8's parsers refuse)
    mine_major = mine.get("pve_major")
    older = sorted(n for n, g in targets.items()
                   if mine_major is not None and g.get("pve_major") is not None and g["pve_major"] < mine_major)
    free = {n: free_devices(n, g) for n, g in sorted(targets.items()) if n not in older}
    out: dict[str, list] = {"migrate": [], "relocate": [], "stop": [], "refusals": []}
    for kind in ("qemu", "lxc"):
        for vmid, status in sorted(mine["status"][kind].items()):
            config = mine["configs"][kind].get(vmid) or {}
            if status != "running":
                continue
            lines = list((config.get("hostpci") or {}).values()) if kind == "qemu" else []
            if kind == "qemu" and not lines or kind == "lxc" and not _has_gpu_devices(config):
                continue
            label = "VM" if kind == "qemu" else "CT"
            lock = config_lock(config)
            if lock:
                out["refusals"].append(lock_refusal(kind, vmid, lock, "move it off the node for its reboot"))
                continue
            managed = ha_resource(mine["ha"], kind, vmid)
            pools = [h["mapping"] for h in lines if h.get("mapping")]
            movable = kind == "qemu" and len(pools) == len(lines)
            if managed and not (movable and managed[1].get("state") == "started"):
                out["refusals"].append(
                    f"{label} {vmid} is HA resource {managed[0]} (requested state {managed[1].get('state')}): HA "
                    f"decides where it runs and `{'qm' if kind == 'qemu' else 'pct'} shutdown` only asks HA, so pvegpu "
                    f"does not move or stop it. Relocate it first (`ha-manager crm-command relocate {managed[0]} "
                    f"<node>`) or stop it through HA, then re-run")
                continue
            if not movable:
                out["stop"].append((kind, vmid))
                continue
            need: dict[str, int] = {}
            for m in pools:
                need[m] = need.get(m, 0) + 1
            target = next((n for n, f in free.items() if all(f.get(m, 0) >= k for m, k in need.items())), None)
            if target:
                for m, k in need.items():
                    free[target][m] -= k
                if managed:
                    # pve-ha-manager: `ha-manager crm-command relocate` has the CRM move it (the LRM shuts
                    # it down, migrates it offline: PVE/HA/Resources/PVEVM.pm migrate; the target's starts it)
                    out["relocate"].append((vmid, managed[0], target))
                else:
                    out["migrate"].append((vmid, target))
                continue
            if fallback == "stop" and not managed:
                out["stop"].append((kind, vmid))
                continue
            wanted = ", ".join(f"{k} of {m}" for m, k in sorted(need.items()))
            seen = "; ".join(f"{n}: " + ", ".join(f"{f.get(m, 0)} of {m}" for m in sorted(need)) for n, f in free.items())
            out["refusals"].append(
                f"VM {vmid} needs {wanted} free on another node, and no online node of the run has them"
                f" ({seen or 'no other online node in the run'}"
                + (f"; not in the run, so not known: {', '.join(absent)}" if absent else "")
                + (f"; on an older Proxmox VE than this node, so not a target: {', '.join(older)}" if older else "")
                + "); set reboot.migrate_fallback: stop to stop it for the reboot instead, or free a device")
    return out


# -- the next boot and the NVIDIA modules ---------------------------------------------------

def next_boot_without_modules(version: str, releases: list[str], nvidia_state: dict, loader_state: dict | None,
                              trial_release: str | None = None) -> list[tuple[str, str]]:
    """[(where, release)] the next boot may come up on without nvidia `version`'s modules: a
    reboot there leaves the host without its GPUs (a roll's check then fails on a node already down).

    What boots next: the kernel stage's trial release when this run armed one (a one-shot entry the
    loader takes first), else the loader's own answer (plan.loader.next_boot over the
    facts.loader.LoaderState reading, one-shots included). A release has the modules when this run
    builds for it (`releases`: plan.nvidia.target_releases as the NVIDIA stage computed them) or the
    module `modinfo -k <release>` finds is `version` built for it (`nvidia_state`: the
    facts.nvidia.NvidiaHostState reading; plan.nvidia.module_current). Places whose release is
    unknown are left out (tests/host/test_boot.py reports them)."""
    if trial_release:
        choices = [("the kernel trial's one-shot entry", trial_release)]
    else:
        choices = [(c["where"], c["release"]) for c in next_boot(loader_state or {}) if c["release"]]
    installed = nvidia_state.get("releases") or {}
    return [(where, release) for where, release in choices
            if release not in releases and not module_current(release, version, (installed.get(release) or {}).get("module"))[0]]


def no_modules_warning(host: str, version: str, explicit: list[str] | None, missing: list[tuple[str, str]]) -> str:
    """The reboot stage's warning for `next_boot_without_modules`' answer (the reboot stays pending)."""
    where = "; ".join(f"{w}: {r}" for w, r in missing)
    add = ", ".join(dict.fromkeys(r for _, r in missing))
    if explicit:
        return (f"{host}: not rebooted: the next boot ({where}) has no nvidia {version} modules "
                f"(nvidia.releases: [{', '.join(explicit)}]); add {add} to nvidia.releases or leave it out")
    return (f"{host}: not rebooted: the next boot ({where}) has no nvidia {version} modules (nvidia.releases not "
            f"set: built for the running kernel and the kernel stage's); add {add} to nvidia.releases")
