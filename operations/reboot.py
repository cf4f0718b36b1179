"""Stage 9, reboot policy (last): the one place that decides whether the host reboots.

Stages report reasons with `facts.run_state.need_reboot` while their operations are generated.
Here: no reasons → nothing. Reasons and `spec.reboot.allowed` → one `server.reboot`, then,
when the kernel stage set a trial boot, make the new release the default for good if it is
the one running (else record the failed trial and say so; the default stays on the old kernel). Reasons without permission → a
"reboot pending" summary (logged as a warning, `--dry` included). After the reconnect of every
reboot (a roll's node: once it is back in its cluster), before any step that reads or changes
guests, the stage waits until the node's boot is done: sshd answers while pve-guests.service still
starts the onboot guests (`boot_done_or_warn`: `systemctl is-system-running --wait`, at most
`reboot.rejoin_timeout` s, then a warning and the run goes on).

Rolling reboots (issue 26): a node of a Proxmox cluster (its /etc/pve/.members names a cluster
of more than one node) reboots in batches of at most `reboot.max_parallel` hosts of the run,
fewer when the cluster's quorum needs it (`plan.reboot.roll_width`, votes from corosync.conf);
each node must be online in its cluster again and the cluster quorate (`.members`) within
`reboot.rejoin_timeout` before the next batch starts, and its host checks must pass: the NVIDIA
module of `nvidia.version` loaded, each spec GPU on its role's driver, the command line the boot
stage configured, and a trial kernel made the default (the checks of the kernel trial, one loop:
plan.kernel.HOST_CHECKS_LOOP; `plan.reboot.roll_check_lines`). A node that does not come back or
fails a check stops the roll: every later node of that cluster is left unrebooted, naming the
node and the failed check, its reboot reasons printed as still pending. A node whose reboot would
cost quorum is not rebooted (reboot pending, with the numbers).

Guests (`reboot.guests`): `stop` leaves a node's running guests to its own shutdown. `migrate`,
when the node's turn comes: each running VM whose hostpci lines all name mappings (GPU pools) is
shut down, moved offline (`qm migrate`) to the first other online node of the run with free
entries of its pools, and started there; a running VM with a per-node hostpci address and a
running CT with NVIDIA devices are shut down (`plan.reboot.plan_guest_moves`). After the node is
back and its checks passed, the moved VMs come back (shut down there, migrated back, started
here; as HA's maintenance mode brings its services back: pve-ha-manager PVE/HA/Manager.pm
maintenance_node) and the stopped guests are started. A VM no node has room for stops the roll
(`reboot.migrate_fallback: refuse`) or is stopped (`stop`); a locked guest or an HA resource
always stops it, naming the fix.
"""

from __future__ import annotations

import time
from typing import Any

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, deploy, operation
from pyinfra.operations import server

from facts.files import FileTexts
from facts.guest_state import guest_state, guest_state_changes
from facts.loader import LoaderState
from facts.nvidia import NvidiaHostState
from facts.once import fact_once, read_fact
from facts.once import prefetch as read_facts_now  # not `prefetch`: deploy.py takes that name as the stage protocol
from facts.proxmox import HaResources, LxcConfigs, QemuConfigs
from facts.reboot import NODE_GUESTS_COMMAND, parse_node_guests
from facts.run_state import reboot_reasons, run_state, trial_boot_of
from facts.shell import word
from operations.boot import boot_plan
from operations.boot import stage_facts as boot_facts
from operations.gpus import node_of
from operations.nvidia import build_targets, state_kwargs
from operations.proxmox import KIND_LABEL, KIND_TOOL, PveApiError, api_guest_start, api_of, shutdown_shell
from plan.kernel import finish_trial_command, host_checks_command, host_expectations
from plan.reboot import (
    Guest,
    boot_wait_command,
    boot_wait_problem,
    member_back,
    next_boot_without_modules,
    no_modules_warning,
    not_started_at_boot,
    parse_cluster,
    pending_summary,
    plan_guest_moves,
    roll_check_lines,
    roll_width,
)
from plan.terminal import visible
from spec.models import HostSpec

MEMBERS = "/etc/pve/.members"  # pmxcfs: this node's view of its cluster (status.c)
COROSYNC_CONF = "/etc/pve/corosync.conf"  # the cluster's nodelist with quorum_votes
# clusters whose roll stopped in this run (pyinfra runs every host in one process): cluster -> (node, why)
ROLL_STOPPED: dict[str, tuple[str, str]] = {}
# what clear_guests did to a node's guests, undone by restore_guests: host name -> [(what, kind or HA sid, vmid, target)]
ROLL_MOVED: dict[str, list[tuple[str, str, int, str]]] = {}

REBOOT_TIMEOUT_S = 900  # a many-GPU host takes minutes through firmware and POST


def warn_not_started_at_boot() -> list[Guest]:
    """Warn, before the node reboots, about the guests running now (this run's reading) that its
    boot leaves stopped: Proxmox starts only `onboot: 1` guests at boot (plan.reboot.not_started_at_boot)."""
    current = guest_state()
    if "running" not in [*current["qemu"].values(), *current["lxc"].values()]:
        return []
    read_facts_now([(QemuConfigs, {}), (LxcConfigs, {}), (HaResources, {})])  # one command for the three
    left = not_started_at_boot(current, {"qemu": fact_once(QemuConfigs), "lxc": fact_once(LxcConfigs)},
                               fact_once(HaResources))
    if left:
        logger.warning(f"{host.name}: {', '.join(g.label for g in left)} run(s) now and will not start at boot: Proxmox starts only "
                       "guests with `onboot: 1` (`qm set <id> --onboot 1` / `pct set <id> --onboot 1`); a single "
                       "host's reboot in this run starts them again after it, a cluster node's does not")
    return left


def boot_done_or_warn(state, host, timeout: int) -> bool:
    """After the reconnect of a reboot, before any step that reads or changes guests: wait until
    the node's boot is done (its onboot guests started: plan.reboot.boot_wait_command). A boot
    still not done after `timeout` s is a warning naming the host, and the run goes on: a host
    that is slow to start its guests is not a failed host."""
    ok, output = host.run_shell_command(StringCommand(boot_wait_command(timeout)))
    problem = boot_wait_problem(list(output.stdout_lines)) if ok else "the wait did not run"
    if problem:
        logger.warning(f"{host.name}: the boot was not done {timeout} s after the reconnect ({problem}): guests may "
                       "still be starting (pve-guests.service); the steps after the reboot go on, reading them as they are now")
    return True


@operation(is_idempotent=False)
def reboot_until_booted(timeout: int, delay: int = 5, interval: int = 2, reboot_timeout: int = REBOOT_TIMEOUT_S):
    """A single host's reboot: pyinfra's server.reboot (reboot, reconnect), then wait until its boot
    is done (`boot_done_or_warn`), so that the steps after it (the guests' start, the stages'
    after_reboot) see the guests its boot starts. One operation, as a roll's `cluster_reboot`.

    + timeout: seconds to wait for the boot after the reconnect (reboot.rejoin_timeout)
    + delay, interval, reboot_timeout: server.reboot's
    """
    yield from server.reboot._inner(delay=delay, interval=interval, reboot_timeout=reboot_timeout)
    yield FunctionCommand(boot_done_or_warn, (timeout,), {})


@operation(is_idempotent=False)
def start_after_reboot(guests: list[Guest], api=None):
    """After this run's reboot of a single host: start the guests that ran before it and that its
    boot left stopped (`warn_not_started_at_boot`'s), one by one. A start that
    fails is a warning naming the guest and why (the converge itself is done; the boot would not
    have started it either), not a failed run."""
    guest_state_changes()
    for guest in guests:
        yield FunctionCommand(_start_or_warn, (guest.kind, guest.vmid, api), {})


def _start_or_warn(state, host, kind: str, gid: int, api) -> bool:
    if api is None:
        ok, why = _run(host, f"{KIND_TOOL[kind]} start {word(str(gid))}")
    else:
        try:
            api_guest_start(api, kind, gid)
            ok, why = True, ""
        except PveApiError as e:
            ok, why = False, str(e)
    if not ok:
        logger.warning(f"{host.name}: {KIND_LABEL[kind]} {gid} ran before the reboot but did not start after it: {why}")
    return True


@operation()
def pin_trial_kernel(release: str, loader: str, build_id: str, advanced_id: str | None = None):
    """After the reboot: make `release` the default for good if the host came up on it, else
    record the failed trial and fail saying so (plan.kernel.finish_trial_command).

    + release: the kernel release the trial boot selected
    + loader: plan.kernel.SYSTEMD_BOOT or GRUB
    + build_id, advanced_id: as the kernel stage recorded them (facts.run_state.record_trial_boot)
    """
    yield StringCommand(finish_trial_command(release, loader, build_id, advanced_id, fail=True))


def roll_gate(state, host, cluster: str) -> bool:
    """Before a node of `cluster` reboots: none of its cluster failed to come back or failed its
    host checks in this run; else this node is left as it is, its reboot still pending."""
    stopped = ROLL_STOPPED.get(cluster)
    if stopped:
        failed, why = stopped
        logger.error(f"{host.name}: not rebooted: the rolling reboot of cluster {cluster} stopped at node "
                     f"{failed}, which {why}; fix {failed}, then re-run")
        for line in pending_summary(host.name, reboot_reasons(host)):
            logger.error(line)
        return False
    return True


def roll_checks(state, host, cluster: str, node: str, checks: list[str], trial: dict | None) -> bool:
    """After the node is back in its cluster: a trial kernel made the default if it came up and
    its trial checks hold (plan.kernel.finish_trial_command), then the host checks of the roll
    (plan.reboot.roll_check_lines); a failure stops the roll of `cluster` (`ROLL_STOPPED`)."""
    commands = []
    if trial:
        commands.append(finish_trial_command(trial["release"], trial["pin_tool"], trial.get("build_id", ""),
                                             trial.get("advanced_id"), fail=True))
    commands.append(host_checks_command(checks))
    for command in commands:
        ok, output = host.run_shell_command(StringCommand(command))
        if not ok:
            said = visible(" ".join(" ".join(output.stdout_lines + output.stderr_lines).split()))
            ROLL_STOPPED[cluster] = (node, f"failed its host checks after the reboot ({said})")
            logger.error(f"{host.name}: host checks failed after the reboot: {said}; the rolling reboot of cluster "
                         f"{cluster} stops: its other nodes are not rebooted")
            return False
    logger.info(f"{host.name}: host checks passed after the reboot ({len(checks)} check(s))")
    return True


def run_nodes(state) -> dict[str, Any]:
    """{Proxmox node name: pyinfra host} of the run (the node its spec or inventory names)."""
    return {h.data.get("pvegpu_node") or h.name: h for h in state.inventory}


def _run(host, command: str) -> tuple[bool, str]:
    ok, output = host.run_shell_command(StringCommand(command))
    return ok, visible(" ".join(" ".join(output.stdout_lines + output.stderr_lines).split()))


def _stop_roll(host, cluster: str, node: str, why: str) -> bool:
    ROLL_STOPPED[cluster] = (node, why)
    logger.error(f"{host.name}: not rebooted: {why}; the rolling reboot of cluster {cluster} stops: its other "
                 "nodes are not rebooted")
    for line in pending_summary(host.name, reboot_reasons(host)):
        logger.error(line)
    return False


def _read_guests(host) -> dict | None:
    ok, output = host.run_shell_command(StringCommand(NODE_GUESTS_COMMAND))
    return parse_node_guests(list(output.stdout_lines)) if ok else None


def clear_guests(state, host, cluster: str, node: str, fallback: str, timeout: int, occasion: str = "") -> bool:
    """Before `node` reboots (`reboot.guests: migrate`): its running GPU guests moved or stopped as
    plan.reboot.plan_guest_moves says; a refusal stops the roll here, the node not rebooted.
    `occasion`: what they leave for, when not the roll's reboot (the 8 -> 9 upgrade's start,
    operations/upgrade.py): named in the lines, and a refusal stops only that (no roll is stopped)."""
    before, after = (f"for {occasion}", f"after {occasion}") if occasion else ("before the reboot", "after the reboot")

    def refused(why: str) -> bool:
        if not occasion:
            return _stop_roll(host, cluster, node, why)
        logger.error(f"{host.name}: {why}; {occasion} does not start")
        return False

    mine = _read_guests(host)
    if mine is None:
        return refused(f"its guests could not be read on {node}")
    online = sorted(n for n, v in ((mine["members"] or {}).get("nodelist") or {}).items()
                    if v.get("online") and n != node)
    hosts = run_nodes(state)
    targets = {}
    for n in online:
        if n in hosts:
            reading = _read_guests(hosts[n])
            if reading is not None and ((reading["members"] or {}).get("cluster") or {}).get("name") == cluster:
                targets[n] = reading
    moves = plan_guest_moves(node, mine, targets, fallback, tuple(n for n in online if n not in hosts))
    if moves["refusals"]:
        return refused("its GPU guests cannot leave it: " + " ".join(moves["refusals"]))
    if not (moves["stop"] or moves["migrate"] or moves["relocate"]):
        logger.info(f"{host.name}: no running GPU guest to move or stop {before}")
    done = ROLL_MOVED.setdefault(host.name, [])
    for kind, vmid in moves["stop"]:
        ok, said = _run(host, shutdown_shell(kind, vmid, timeout))
        if not ok:
            return refused(f"{'VM' if kind == 'qemu' else 'CT'} {vmid} did not stop ({said})")
        done.append(("start", kind, vmid, node))
        logger.info(f"{host.name}: {'VM' if kind == 'qemu' else 'CT'} {vmid} stopped {before}; started again {after}")
    for vmid, target in moves["migrate"]:
        # offline: qemu-server PVE/API2/Qemu.pm migrate_vm refuses a running VM without --online
        ok, said = _run(host, f"{shutdown_shell('qemu', vmid, timeout)} && qm migrate {word(str(vmid))} {word(target)}")
        if not ok:
            return refused(f"VM {vmid} could not be migrated to {target} ({said})")
        # the VM is the target's now (its config under /etc/pve/nodes/<target>/): started there
        ok, said = _run(hosts[target], f"qm start {word(str(vmid))}")
        if not ok:
            return refused(f"VM {vmid} was migrated to {target} but did not start there ({said}); "
                              f"it is stopped on {target}")
        done.append(("back", "qemu", vmid, target))
        logger.info(f"{host.name}: VM {vmid} moved to node {target} {before} (shut down, migrated offline, "
                    f"started there); it comes back {after}")
    for vmid, sid, target in moves["relocate"]:
        ok, said = _ha_relocate(host, hosts[target], sid, vmid, target, timeout)
        if not ok:
            return refused(said)
        done.append(("ha-back", sid, vmid, target))
        logger.info(f"{host.name}: VM {vmid} (HA resource {sid}) relocated by HA to node {target} {before}; "
                    "relocated back after it")
    return True


def _ha_relocate(source, target_host, sid: str, vmid: int, target: str, timeout: int) -> tuple[bool, str]:
    """Ask HA to relocate `sid` to `target` (pve-ha-manager `ha-manager crm-command relocate`: the
    CRM queues it, the source's LRM shuts the VM down and migrates it offline, the target's starts
    it) and wait until it runs there: reading both nodes' guests each round (what their LRMs did)."""
    ok, said = _run(source, f"ha-manager crm-command relocate {word(sid)} {word(target)}")
    if not ok:
        return False, f"HA did not take the relocation of {sid} to {target} ({said})"
    deadline = time.monotonic() + timeout + 120  # the shutdown, then HA's rounds (10 s each on a real CRM/LRM)
    while time.monotonic() < deadline:
        _read_guests(source)
        there = _read_guests(target_host)
        if there and there["status"]["qemu"].get(vmid) == "running":
            return True, ""
        time.sleep(2)
    return False, (f"HA did not relocate {sid} to {target} within {timeout + 120} s (`ha-manager status`); "
                   "where it is now is HA's")


def _restore_failed(host, cluster: str, node: str, why: str) -> bool:
    """A guest of `node` did not come back: the roll of `cluster` stops here (the next node would
    move its guests on top of an unsettled cluster)."""
    ROLL_STOPPED[cluster] = (node, f"did not get its guests back after its reboot ({why})")
    logger.error(f"{host.name}: {why}; the rolling reboot of cluster {cluster} stops: its other nodes are not rebooted")
    return False


def restore_guests(state, host, cluster: str, node: str, timeout: int, occasion: str = "") -> bool:
    """After `node` is back and passed its checks: the VMs clear_guests moved come back (an HA
    resource relocated back by HA) and the guests it stopped start again (in the reverse order).
    `occasion`: as clear_guests' (the 8 -> 9 upgrade): named in the lines; a guest that does not come
    back fails only this (the next run tries it again), no roll is stopped."""
    after = f"after {occasion}" if occasion else "after the reboot"

    def failed(why: str) -> bool:
        if not occasion:
            return _restore_failed(host, cluster, node, why)
        logger.error(f"{host.name}: {why}; a later run tries again")
        return False

    hosts = run_nodes(state)
    for what, kind, vmid, target in reversed(ROLL_MOVED.pop(host.name, [])):
        label = "VM" if kind == "qemu" else "CT"
        if what == "ha-back":
            ok, said = _ha_relocate(hosts[target], host, kind, vmid, node, timeout)
            if not ok:
                return failed(f"VM {vmid} did not come back from node {target}: {said}")
            logger.info(f"{host.name}: VM {vmid} (HA resource {kind}) relocated back from node {target}, running here again")
        elif what == "back":
            ok, said = _run(hosts[target], f"{shutdown_shell('qemu', vmid, timeout)} && qm migrate {word(str(vmid))} {word(node)}")
            if ok:
                ok, said = _run(host, f"qm start {word(str(vmid))}")
            if not ok:
                return failed(f"VM {vmid} did not come back from node {target}: {said}")
            logger.info(f"{host.name}: VM {vmid} back from node {target}, running here again")
        else:
            ok, said = _run(host, f"{'qm' if kind == 'qemu' else 'pct'} start {word(str(vmid))}")
            if not ok:
                return failed(f"{label} {vmid} did not start again {after}: {said}")
            logger.info(f"{host.name}: {label} {vmid} started again {after}")
    return True


def wait_rejoined(state, host, cluster: str, node: str, timeout: int) -> bool:
    """After the reboot: `node` online in `cluster` again and the cluster quorate, read from its
    .members; else the roll of the cluster stops here (`ROLL_STOPPED`)."""
    deadline = time.monotonic() + timeout
    probe = StringCommand(f"cat {MEMBERS} 2>/dev/null; echo; echo '==> corosync'; cat {COROSYNC_CONF} 2>/dev/null; true")
    view = None
    while True:
        ok, output = host.run_shell_command(probe)
        if ok:
            members, _, corosync = "\n".join(output.stdout_lines).partition("==> corosync")
            view = parse_cluster(members, corosync)
            if member_back(view, node):
                logger.info(f"{host.name}: back in cluster {cluster} (quorate, {view.online_votes} of "
                            f"{view.expected_votes} votes online)")
                return True
        if time.monotonic() > deadline:
            ROLL_STOPPED[cluster] = (node, "did not come back into the cluster")
            seen = "no answer" if view is None else ("no quorum" if not view.quorate else f"{node} offline")
            logger.error(f"{host.name}: did not come back into cluster {cluster} within {timeout} s ({seen}); "
                         "the rolling reboot stops: its other nodes are not rebooted")
            return False
        time.sleep(2)


@operation(is_idempotent=False)
def cluster_reboot(cluster: str, node: str, rejoin_timeout: int, checks: list[str] | None = None,
                   trial: dict | None = None, guests: str = "stop", fallback: str = "refuse",
                   shutdown_timeout: int = 120, delay: int = 5, interval: int = 2,
                   reboot_timeout: int = REBOOT_TIMEOUT_S):
    """Reboot one node of a rolling reboot: only while its cluster's roll has not stopped; then
    wait for the node to be back in the cluster and pass its host checks (see the module docstring).

    + cluster, node: the node's cluster and node name (from /etc/pve/.members)
    + rejoin_timeout: seconds after SSH answers for the node to be online and the cluster quorate
    + checks: plan.reboot.roll_check_lines of the node
    + trial: the kernel stage's trial boot (facts.run_state.trial_boot_of), finished here
    + guests, fallback: reboot.guests and reboot.migrate_fallback
    + shutdown_timeout: seconds a guest gets to shut down (guests.shutdown_timeout)
    """
    yield FunctionCommand(roll_gate, (cluster,), {})
    if guests == "migrate":
        yield FunctionCommand(clear_guests, (cluster, node, fallback, shutdown_timeout), {})
    yield from server.reboot._inner(delay=delay, interval=interval, reboot_timeout=reboot_timeout)
    yield FunctionCommand(wait_rejoined, (cluster, node, rejoin_timeout), {})
    # startall waits for quorum before its first start (pve-manager PVE/API2/Nodes.pm startall)
    yield FunctionCommand(boot_done_or_warn, (rejoin_timeout,), {})
    yield FunctionCommand(roll_checks, (cluster, node, list(checks or []), trial), {})
    if guests == "migrate":
        yield FunctionCommand(restore_guests, (cluster, node, shutdown_timeout), {})


def next_boot_problem(spec: HostSpec) -> str | None:
    """The warning when the next boot may come up on a kernel without nvidia.version's modules
    (plan.reboot.next_boot_without_modules), else None: such a reboot strands the host's GPUs."""
    if spec.nvidia is None:
        return None
    # read only here, in a run that is about to reboot (not in deploy.py's one up-front probe: the
    # loader's state and every installed kernel's modinfo would cost each converge ~20 program starts,
    # tests/twin/test_probe_programs.py); one more round trip where a reboot costs minutes anyway
    state, releases = build_targets(spec)
    trial = trial_boot_of()
    loader = fact_once(LoaderState)
    trial_release = trial["release"] if trial else None
    missing = next_boot_without_modules(spec.nvidia.version, releases, state, loader, trial_release)
    unread = [r for _, r in missing if r not in (state.get("releases") or {})]
    if unread:  # a kernel the NVIDIA stage does not target: its installed module, if any, read now
        kwargs = state_kwargs(spec)
        state = fact_once(NvidiaHostState, **{**kwargs, "releases": list(dict.fromkeys([*kwargs["releases"], *unread]))})
        missing = next_boot_without_modules(spec.nvidia.version, releases, state, loader, trial_release)
    return no_modules_warning(host.name, spec.nvidia.version, spec.nvidia.releases, missing) if missing else None


@deploy("pvegpu: reboot policy")
def apply(spec: HostSpec) -> None:
    reasons = reboot_reasons()
    summary = pending_summary(host.name, reasons)
    if not reasons:
        logger.info(summary[0])
        return
    if not spec.reboot.allowed:
        for line in summary + [f"{host.name}: reboot.allowed is false in the spec; reboot the host to apply"]:
            logger.warning(line)
        return
    stranded = next_boot_problem(spec)
    if stranded:  # before a single host's reboot and before a roll: the node is left as it is
        for line in summary + [stranded]:
            logger.warning(line)
        return
    # the reasons themselves are logged below; the name stays one readable line
    name = f"Reboot for {len(reasons)} reason(s): " + ", ".join(sorted({kind for kind, _ in reasons}))
    texts = read_fact(FileTexts, paths=[MEMBERS, COROSYNC_CONF])
    view = parse_cluster(texts.get(MEMBERS), texts.get(COROSYNC_CONF))
    width, problem = roll_width(view, spec.reboot.max_parallel)
    if problem:
        for line in summary + [f"{host.name}: not rebooted: {problem}; reboot it when the cluster can spare it"]:
            logger.warning(line)
        return
    for line in summary:
        logger.info(line)
    run_state().rebooting = True  # deploy.py: stages with an after_reboot plan again after it
    trial = trial_boot_of()
    left_stopped = warn_not_started_at_boot() if view.name is None or width == 0 or spec.reboot.guests == "stop" else []
    if view.name is None or width == 0:
        reboot_until_booted(name=name, timeout=spec.reboot.rejoin_timeout)
        if left_stopped:
            start_after_reboot(name="Start the guests that ran before the reboot: " + ", ".join(g.label for g in left_stopped),
                               guests=left_stopped, api=api_of(spec, node_of(spec)))
    else:
        logger.info(f"{host.name}: node {view.node} of cluster {view.name}: rolling reboot, {width} node(s) at a time "
                    f"({view.online_votes} of {view.expected_votes} votes online, quorum {view.quorum})")
        # pyinfra runs an operation host by host (_serial) or in batches (_parallel), every
        # host's run of it before the next operation
        batching = {"_serial": True} if width == 1 else {"_parallel": width}
        cmdline = boot_plan(spec, boot_facts())["difference"] if "cmdline" in {k for k, _ in reasons} else None
        checks = roll_check_lines(host_expectations(spec), reasons, cmdline, trial["release"] if trial else None)
        cluster_reboot(name=name, cluster=view.name, node=view.node or host.name,
                       rejoin_timeout=spec.reboot.rejoin_timeout, checks=checks, trial=trial,
                       guests=spec.reboot.guests, fallback=spec.reboot.migrate_fallback,
                       shutdown_timeout=spec.guests.shutdown_timeout, **batching)
        return  # the trial, if any, was finished in the roll's checks
    if trial:
        pin_trial_kernel(
            name=f"Pin kernel {trial['release']} for good if it came up",
            release=trial["release"],
            loader=trial["pin_tool"],
            build_id=trial.get("build_id", ""),
            advanced_id=trial.get("advanced_id"),
        )
