"""The 8 -> 9 upgrade pvegpu performs when the spec opts in (`proxmox_ve_upgrade: perform`; pure).

Preflight (`perform_refusals`): before any change, the run refuses unless pve8to9 `--full`
reports no FAIL, proxmox-ve is at least 8.4-0, / has 10 GB free, the spec's running GPU guests
may be stopped (guests.allow_stop, reboot.guests: stop), no kernel meta-package is on hold,
no Ceph repository of a release before Squid is configured, an apt source names bookworm, and
no earlier upgrade of pvegpu's failed.

The job (`job_reading`): the dist-upgrade runs detached on the host (templates/pve-upgrade.sh.j2,
a transient systemd unit or a setsid'd process) and keeps its state in STATE_DIR: `state`
(status=running|failed|done, step=, since=), `upgrade.log`, and `lock` (held by the job while it
runs: flock(1)). The next run reads them: running -> reported, the run stops; failed (or the job
gone while its state says running: killed, a power cut) -> refused with the log's tail and how
to start again; done -> the converge goes on, and reboots into 9's kernel per `reboot.allowed`.

The cluster (`node_phase`, `cluster_refusals`, `turn_wait`): the nodes of one Proxmox cluster
are upgraded one at a time. A node starts its upgrade only when every node of its cluster is in
the run (each one's upgrade is read), online and quorate, none of the others is still in its
upgrade (its job runs, failed, or is done while the node runs 8's kernel or has not passed its
host checks on 9's: `checked=` in its state, written by the run after them; or the GPU guests it
moved away for it are not back yet), and no other node
claimed the run's turn (the first whose plan gets there: pyinfra plans the hosts side by side). A
node that is waiting is left as it is.

The guests (`guests_to_start`): the GPU guests the start stopped are recorded in GUESTS_FILE
(`lxc 200`, `qemu 300`, one a line; kept across a failed job and a new start) before they are
stopped; once the job is done and the host runs 9's kernel, the run after the converge starts
those of them still stopped, once, and removes the record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from plan.reboot import ClusterView
from plan.releases import kernel_pve_major
from plan.terminal import visible
from plan.upgrade import _KERNEL_META, proxmox_ve_too_old

STATE_DIR = "/var/lib/pvegpu/upgrade"
STATE_FILE = f"{STATE_DIR}/state"
LOG_FILE = f"{STATE_DIR}/upgrade.log"
LOCK_FILE = f"{STATE_DIR}/lock"
SCRIPT = f"{STATE_DIR}/upgrade.sh"
GUESTS_FILE = f"{STATE_DIR}/guests-stopped"  # the GPU guests the start stopped: `lxc 200`, `qemu 300`
# `reboot.guests: migrate` in a cluster: what the start did to the node's GPU guests (operations/reboot.py
# clear_guests), undone once the node passed its host checks on 9: `back qemu 301 pve2` (migrated to
# pve2), `ha-back vm:301 301 pve2` (relocated by HA), `start lxc 200 pve1` (stopped here)
MOVED_FILE = f"{STATE_DIR}/guests-moved"
UNIT = "pvegpu-upgrade"
# Proxmox's upgrade guide (Upgrade from 8 to 9, "Continuously use the pve8to9 checklist script"):
# at least 5 GB free on /, 10 GB recommended; pvegpu's kernel build dirs and .debs live there too
MIN_FREE_BYTES = 10 * 10**9
LOG_TAIL = 20
OLD_SUITE, NEW_SUITE = "bookworm", "trixie"  # pve8to9.pm: $old_suite, $new_suite
# pve8to9.pm $ceph_supported_release = 19 (Squid): the Ceph release both 8 and 9 ship; Proxmox's Ceph
# repositories are named after the release (download.proxmox.com/debian/ceph-<name>)
CEPH_SUPPORTED = "squid"
_CEPH_REPO = re.compile(r"/ceph-([a-z]+)(/|$)")
# pve8to9.pm $log_line: `uc($level): line`; print_header `= NAME =`; the summary's `FAILURES: N`
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FAILURES = re.compile(r"^FAILURES:\s*(\d+)\s*$")


def pve8to9_fails(lines: list[str]) -> tuple[list[str], int | None]:
    """The FAIL lines of `pve8to9 --full` and its summary's FAILURES count (None: no summary, the
    checklist did not finish). pve8to9 exits 0 whatever it finds (its checklist returns undef), so
    the output is the verdict. Colour codes (Term::ANSIColor, printed even without a terminal) are
    dropped."""
    fails, count = [], None
    for raw in lines:
        line = _ANSI.sub("", raw).rstrip()
        if line.startswith("FAIL: "):
            fails.append(line[len("FAIL: "):])
        m = _FAILURES.match(line)
        if m:
            count = int(m.group(1))
    return fails, count


@dataclass(frozen=True)
class AptEntry:
    file: str
    line: int
    uris: tuple[str, ...]
    suites: tuple[str, ...]


def parse_sources(files: dict[str, list[str]]) -> list[AptEntry]:
    """The enabled entries of apt's sources (sources.list(5)): one-line `deb [opts] URI SUITE ...`
    of `*.list` files, deb822 stanzas (`Types:`, `URIs:`, `Suites:`, `Enabled: no` skips) of
    `*.sources` files."""
    entries: list[AptEntry] = []
    for path, lines in files.items():
        if path.endswith(".sources"):
            stanza: dict[str, str] = {}
            start, key = 0, ""
            for number, raw in enumerate([*lines, ""], 1):
                if raw.startswith("#"):
                    continue
                if not raw.strip():
                    if stanza and stanza.get("enabled", "yes").lower() != "no" and "deb" in stanza.get("types", "").split():
                        entries.append(AptEntry(path, start, tuple(stanza.get("uris", "").split()),
                                                tuple(stanza.get("suites", "").split())))
                    stanza, key = {}, ""
                    continue
                if raw[0] in " \t":  # a continuation line of the field before
                    if key:
                        stanza[key] += " " + raw.strip()
                    continue
                name, sep, value = raw.partition(":")
                if sep:
                    start = start if stanza else number
                    key = name.strip().lower()
                    stanza[key] = value.strip()
        else:
            for number, raw in enumerate(lines, 1):
                words = raw.split("#", 1)[0].split()
                if not words or words[0] not in ("deb", "deb-src"):
                    continue
                words = words[1:]
                if words and words[0].startswith("["):  # [arch=amd64 signed-by=...]
                    while words and not words[0].endswith("]"):
                        words = words[1:]
                    words = words[1:]
                if len(words) >= 2:
                    entries.append(AptEntry(path, number, (words[0],), (words[1],)))
    return entries


def _suite_base(suite: str) -> str:
    # pve8to9.pm check_apt_repos: -updates, -backports, -security, -proposed-updates, -debug
    return re.sub(r"-(?:(?:proposed-)?updates|backports|debug|security)(?:-debug)?$", "", suite)


@dataclass
class PerformView:
    """What the preflight of `perform` reads (operations/upgrade.py fills it from the facts)."""

    pve8to9: list[str] | None = None             # `pve8to9 --full` output lines; None: not installed
    proxmox_ve: str | None = None                # the proxmox-ve package's version
    free_bytes: int | None = None                # available on / (df)
    running_gpu_guests: list[str] = field(default_factory=list)  # ["CT 200", "VM 300"]
    allow_stop: bool = True                      # guests.allow_stop
    reboot_guests: str = "stop"                  # reboot.guests
    in_cluster: bool = False                     # the node is in a cluster of more than one node
    holds: list[str] = field(default_factory=list)  # packages on hold (apt-mark showhold)
    sources: list[AptEntry] = field(default_factory=list)
    job: dict = field(default_factory=dict)      # `job_reading` of the job's state


def perform_refusals(view: PerformView) -> list[str]:
    """Why the upgrade may not start now (empty: it may), each with its fix."""
    refusals = []
    if view.pve8to9 is None:
        refusals.append("pve8to9 is not installed (pve-manager of the latest 8.4 ships it): apt update && apt "
                        "full-upgrade on 8's repositories, then run again")
    else:
        fails, count = pve8to9_fails(view.pve8to9)
        if count is None:
            refusals.append("pve8to9 --full did not finish (no SUMMARY with a FAILURES count); run it by hand and "
                            "see why")
        elif count or fails:
            shown = "; ".join(visible(f) for f in fails[:5]) or "see its output"
            refusals.append(f"pve8to9 --full reports {max(count, len(fails))} FAILURE(S): {shown}. Fix them (run "
                            "pve8to9 --full on the host), then run again")
    if view.proxmox_ve is None or proxmox_ve_too_old(view.proxmox_ve):
        refusals.append(f"proxmox-ve is {view.proxmox_ve or 'not installed'}: the upgrade to 9 starts from the "
                        "latest 8.4 (pve8to9: 8.4-0 at least). Fix: apt update && apt full-upgrade on 8's "
                        "repositories, reboot, run again")
    if view.free_bytes is not None and view.free_bytes < MIN_FREE_BYTES:
        refusals.append(f"/ has {view.free_bytes / 10**9:.1f} GB free, the upgrade wants {MIN_FREE_BYTES // 10**9} GB "
                        "(Proxmox's upgrade guide; pvegpu's kernel builds live there too). Fix: free space "
                        "(apt clean, old kernels, /var/lib/pvegpu/kernel-build)")
    if view.running_gpu_guests:
        names = ", ".join(view.running_gpu_guests)
        if not view.allow_stop:
            refusals.append(f"GPU guests run ({names}) and guests.allow_stop is false: the upgrade stops them (its "
                            "new kernel and NVIDIA modules, a reboot). Fix: stop or migrate them yourself, or allow "
                            "guests.allow_stop")
        elif view.reboot_guests == "migrate" and not view.in_cluster:
            refusals.append(f"GPU guests run ({names}) and reboot.guests is migrate, but this node is in no cluster: "
                            "there is no other node to move them to. Fix: set reboot.guests: stop to have them "
                            "stopped (and started again on 9), or migrate them yourself")
    held = [p for p in view.holds if _KERNEL_META.match(p)]
    if held:
        refusals.append(f"{', '.join(held)} on hold (apt-mark showhold): the dist-upgrade would keep 9's kernel "
                        f"back and boot 8's under 9. Fix: apt-mark unhold {' '.join(held)} (or kernel_updates: "
                        "follow and converge)")
    old_ceph = sorted({f"ceph-{m.group(1)} ({e.file}:{e.line})" for e in view.sources for u in e.uris
                       if (m := _CEPH_REPO.search(u)) and m.group(1) != CEPH_SUPPORTED})
    if old_ceph:
        refusals.append(f"a Ceph repository before Squid is configured: {', '.join(old_ceph)}; 9 ships Ceph Squid "
                        "only (pve8to9: Ceph must be on Squid first). Fix: upgrade Ceph to Squid on 8")
    if not any(_suite_base(s) == OLD_SUITE for e in view.sources for s in e.suites):
        refusals.append("no apt source names bookworm (/etc/apt/sources.list, sources.list.d/*.list, *.sources): "
                        "pvegpu moves the host's sources from bookworm to trixie and finds none to move. Fix: "
                        "add Debian's and Proxmox's bookworm repositories")
    status = view.job.get("status")
    if status in ("failed", "interrupted"):
        refusals.append(job_refusal(view.job))
    return refusals


def job_reading(state_lines: list[str], lock: str | None, log_tail: list[str]) -> dict:
    """The job's state file (key=value lines), whether its lock is held, the log's tail ->
    {"status": None|"running"|"failed"|"done"|"interrupted", "step", "since", "log": [...]}.
    `interrupted`: the state says running but nothing holds the lock (the job was killed, or the
    host lost power)."""
    values = {}
    for line in state_lines:
        key, sep, value = line.strip().partition("=")
        if sep:
            values[key] = value
    status = values.get("status") or None
    if status == "running" and lock != "held":
        status = "interrupted"
    elif status not in (None, "running", "failed", "done"):
        status = "failed"
    return {"status": status, "step": values.get("step"), "since": values.get("since"),
            "checked": values.get("checked") if status == "done" else None,
            "log": [visible(line.rstrip("\n")) for line in log_tail][-LOG_TAIL:]}


def _tail(job: dict) -> str:
    lines = job.get("log") or ["(the log is empty)"]
    return "".join(f"\n      | {line}" for line in lines)


def job_refusal(job: dict) -> str:
    """A failed (or interrupted) upgrade: what happened, the log's tail, how to start again."""
    what = ("was interrupted (its state says running, but no job holds its lock: killed, or the host lost power)"
            if job.get("status") == "interrupted" else "failed")
    return (f"the 8 -> 9 upgrade pvegpu started {what} at step {job.get('step') or '?'} "
            f"(since {job.get('since') or '?'}); the last lines of {LOG_FILE}:{_tail(job)}\n"
            f"    Fix the cause on the host (dpkg --configure -a and apt -f install finish a half-done apt run), "
            f"then rm {STATE_FILE} and run again: the upgrade starts over and each of its steps is safe to repeat")


def job_running(job: dict) -> str:
    return (f"the 8 -> 9 upgrade runs on the host (unit {UNIT}, or its process where no systemd runs), step "
            f"{job.get('step') or '?'} since {job.get('since') or '?'}; the last lines of {LOG_FILE}:{_tail(job)}\n"
            "    Nothing else is changed while it runs; run again when it is over (journalctl -u "
            f"{UNIT} -f or tail -f {LOG_FILE} follows it)")


def stale_pins(state: dict) -> dict:
    """What pve8to9 says to undo after the upgrade, before the reboot into 9 (plan/upgrade.py
    _pin_findings): a proxmox-boot-tool pin or GRUB saved default on an 8 kernel."""
    from plan.kernel import grub_release_of

    def of_8(release: str | None) -> bool:
        return bool(release) and kernel_pve_major(str(release)) in (7, 8)

    return {"unpin": of_8(state.get("pin")), "unset_saved": of_8(grub_release_of(state.get("grub_saved")))}


def parse_stopped_guests(lines: list[str]) -> list[tuple[str, int]]:
    """GUESTS_FILE's lines -> [(kind, id)] in file order, each once (a line not `lxc|qemu <id>` is
    skipped: the file is pvegpu's own)."""
    found: list[tuple[str, int]] = []
    for line in lines:
        words = line.split()
        if len(words) == 2 and words[0] in ("lxc", "qemu") and words[1].isdigit():
            guest = (words[0], int(words[1]))
            if guest not in found:
                found.append(guest)
    return found


_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*")
_HA_SID = re.compile(r"(?:vm|ct):\d+")


def parse_moved(lines: list[str]) -> list[tuple[str, str, int, str]]:
    """MOVED_FILE's lines -> [(what, kind or HA sid, vmid, node)] as operations/reboot.py's
    restore_guests takes them (ROLL_MOVED), in file order; a line not of that shape is skipped (the
    file is pvegpu's own)."""
    found: list[tuple[str, str, int, str]] = []
    for line in lines:
        words = line.split()
        if len(words) != 4 or not words[2].isdigit() or not _NODE.fullmatch(words[3]):
            continue
        what, kind = words[0], words[1]
        if (what in ("back", "start") and kind in ("lxc", "qemu")) or (what == "ha-back" and _HA_SID.fullmatch(kind)):
            if what != "back" or kind == "qemu":
                found.append((what, kind, int(words[2]), words[3]))
    return found


def guests_to_start(job: dict, running_kernel: str | None, rebooted_for_upgrade: bool,
                    recorded: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The guests to start again after the upgrade: those pvegpu stopped for it (GUESTS_FILE), once
    the job is done and the host runs 9's kernel (read at the run's start, or this run rebooted it
    for the upgrade: the reboot's host checks passed). Empty while the job runs or failed, or the
    host still runs 8's kernel (no reboot allowed): the record waits."""
    if job.get("status") != "done" or not recorded:
        return []
    # 8's kernel gone, as node_phase and operations/upgrade.py confirm read it: a tarball build's or a
    # distribution's kernel has no Proxmox major in its name
    on_9 = bool(running_kernel) and not runs_8_kernel(str(running_kernel))
    return list(recorded) if on_9 or rebooted_for_upgrade else []


# ---------------------------------------------------------------- a cluster, one node at a time

ON_8, UPGRADING, UPGRADED, UNKNOWN = "on-8", "upgrading", "upgraded", "unknown"


@dataclass(frozen=True)
class NodePhase:
    """Where a node stands in the cluster's upgrade: ON_8 (no job, Proxmox VE 8), UPGRADING (its
    job runs, failed or was interrupted, or is done and the node has not yet passed its host checks
    on 9's kernel), UPGRADED (on 9: its job done and checked, or upgraded without pvegpu), UNKNOWN
    (no Proxmox VE version read). `why`: in words, for the lines of the nodes that wait."""

    phase: str
    why: str


def node_phase(job: dict, pve: dict | None, moved: list[str] | None = None) -> NodePhase:
    """The node's phase from its job's reading (`job_reading`), its PveVersion fact and its record of
    guests moved for the upgrade (MOVED_FILE's lines: while any is left it is still in its upgrade)."""
    status, step = job.get("status"), job.get("step") or "?"
    major = (pve or {}).get("major")
    kernel = (pve or {}).get("running_kernel")
    if status == "running":
        return NodePhase(UPGRADING, f"its upgrade job runs (step {step} since {job.get('since') or '?'})")
    if status in ("failed", "interrupted"):
        return NodePhase(UPGRADING, f"its upgrade job {status} at step {step}: fix that node first (its run "
                                    "shows the log)")
    if status == "done":
        if not kernel or runs_8_kernel(str(kernel)):
            return NodePhase(UPGRADING, f"its upgrade is done and it still runs 8's kernel {kernel or '?'}: its "
                                        "reboot into 9's kernel is due")
        if not job.get("checked"):
            return NodePhase(UPGRADING, f"it runs kernel {kernel} and has not passed its host checks since the "
                                        "upgrade (a run on it with proxmox_ve_upgrade: perform checks them)")
        back = parse_moved(moved or [])
        if back:
            return NodePhase(UPGRADING, "its GPU guests moved away for its upgrade are not back yet ("
                                        + ", ".join(f"{k} {i} on {n}" for _, k, i, n in back) + ")")
        return NodePhase(UPGRADED, f"upgraded (host checks passed {job['checked']})")
    if major == 8:
        return NodePhase(ON_8, "on Proxmox VE 8")
    if major == 9:
        return NodePhase(UPGRADED, "on Proxmox VE 9")
    return NodePhase(UNKNOWN, "its Proxmox VE version could not be read")


def runs_8_kernel(kernel: str) -> bool:
    """A kernel of Proxmox VE 8 (or 7): what the upgrade leaves behind until the reboot
    (plan.releases.kernel_pve_major; a kernel that is not a Proxmox kernel's name is not one)."""
    return kernel_pve_major(kernel) in (7, 8)


def cluster_refusals(view: ClusterView, run_nodes: set[str]) -> list[str]:
    """Why no node of `view`'s cluster may start its upgrade in this run (empty: the turn decides):
    a node of the cluster outside the run (its upgrade cannot be read), no quorum, a node offline
    (pve8to9.pm check_cluster_corosync fails on both too)."""
    if view.name is None or len(view.online) <= 1:
        return []
    refusals = []
    outside = sorted(set(view.online) - run_nodes)
    if outside:
        refusals.append(f"node(s) {', '.join(outside)} of cluster {view.name} are not in this run: pvegpu upgrades "
                        "the nodes of a cluster one at a time and reads each one's upgrade first. Fix: run with "
                        "every node of the cluster (inventory, --limit)")
    if not view.quorate:
        refusals.append(f"cluster {view.name} has no quorum now: no node of it starts the upgrade")
    offline = sorted(n for n, up in view.online.items() if not up)
    if offline:
        refusals.append(f"node(s) {', '.join(offline)} of cluster {view.name} are offline: bring them back before "
                        "a node starts the upgrade")
    return refusals


def turn_wait(node: str, cluster: str, phases: dict[str, NodePhase], starting: list[str]) -> str | None:
    """Why `node` (on 8, its preflight passed) does not start its upgrade in this run: another node
    of `cluster` is in its upgrade (`phases`, every other node's), or another claimed this run's
    turn (`starting`). None: its turn."""
    busy = [(n, p) for n, p in sorted(phases.items()) if n != node and p.phase in (UPGRADING, UNKNOWN)]
    if busy:
        said = "; ".join(f"{n}: {p.why}" for n, p in busy)
        return (f"the 8 -> 9 upgrade waits: the nodes of cluster {cluster} are upgraded one at a time, and {said}. "
                "Run again once that node is done")
    first = [n for n in starting if n != node]
    if first:
        return (f"the 8 -> 9 upgrade waits: the nodes of cluster {cluster} are upgraded one at a time, and "
                f"{first[0]} starts its upgrade in this run. Run again once it is done")
    return None
