"""The host's release and the 8 -> 9 upgrade check (plan/releases.py, plan/upgrade.py).

preflight: the host's Debian release (/etc/os-release) and Proxmox VE major (pve-manager's
version) are read every run that names a kernel or `proxmox_ve`; what belongs to the other
release is refused before any change, --dry included (a pve-kernel branch of 9 on a bookworm host
would be cloned and built with GCC 12; `proxmox_ve: 8` on a trixie host).

perform (`proxmox_ve_upgrade: perform`, plan/upgrade_perform.py): on a host still on 8 the run
refuses before any change unless the upgrade's preflight passes, then stops the spec's running
GPU guests, backs up their configs (operations/backup.py) and /etc/pve (a tarball in
/var/lib/pvegpu/upgrade, 0700), and starts the upgrade job detached (templates/pve-upgrade.sh.j2);
nothing else is converged in that run. The next runs read the job: running -> reported, the run
stops; failed -> refused with its log's tail; done -> the converge goes on (on 9 now), with a
reboot into 9's kernel where the host still runs 8's (per reboot.allowed); once 8's kernel is gone
the host checks run once (`confirm`: `checked=` in the job's state).

cluster (plan/upgrade_perform.py node_phase, cluster_refusals, turn_wait): the nodes of a cluster
are upgraded one at a time; a node whose upgrade would start waits (`stop_host`: only it stops)
while another is in its upgrade or claimed this run's turn. With `reboot.guests: migrate` the start
moves the node's GPU guests away as the rolling reboot does and `restore_moved` brings them back
after `checked=`.

report: when the spec says `proxmox_ve: 9`, the run (and --dry) lists what pve8to9 would warn
about that pvegpu causes or can fix, each with its fix: before the upgrade (the host runs 8) and
after it (the host runs 9, while anything is still due: systemd-boot to remove, 8's kernel to
unpin before the reboot, kernel packages on hold, a reboot into 9's kernel). Read-only: the report
yields no operation (only `perform` above runs the upgrade). The converge after the distribution upgrade
rebuilds what the new kernel needs (the NVIDIA stage's toolchain guard takes 9's GCC 14 from the
kernel's CONFIG_CC_VERSION_TEXT) and the host checks prove it.
"""

from __future__ import annotations

from typing import Any

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.context import ctx_host, ctx_state
from pyinfra.context import state as current_state

from facts.boot import BootStageFacts
from facts.files import FileTexts
from facts.guest_state import guest_state, guest_state_changes
from facts.once import fact_once, read_fact
from facts.proxmox import LxcConfigs, PvePackages, PveVersion
from facts.shell import word
from facts.upgrade import OsRelease, UpgradeJob, UpgradePreflight, UpgradeState
from operations.backup import backup_command
from operations.files import write_file_command
from operations.proxmox import KIND_LABEL, KIND_TOOL, guest_stop_commands
from plan import upgrade_perform as perform
from plan.kernel import host_checks_command, host_expectations
from plan.reboot import ClusterView, parse_cluster, roll_check_lines
from plan.releases import host_release_refusals, kernel_pve_major
from plan.render import PRIVATE, render_template, root_dirs
from plan.terminal import visible
from plan.upgrade import HostView, upgrade_findings
from spec.models import HostSpec

# pmxcfs's view of the node's cluster and its nodelist's votes (as the reboot stage's roll reads them)
CLUSTER_FILES = ["/etc/pve/.members", "/etc/pve/corosync.conf"]
# per run (pyinfra plans every host in one process, side by side), kept on its state: each node's
# upgrade phase read so far, and the nodes that claimed this run's turn to start, per cluster
_TURNS = "_pvegpu_upgrade_turns"


def _asks(spec: HostSpec) -> bool:
    return spec.proxmox_ve is not None or spec.kernel is not None


def prefetch(spec: HostSpec) -> list:
    """The facts the release rule and the check read (in deploy.py's first batched command)."""
    release: list = [(OsRelease, {}), (PveVersion, {})] if _asks(spec) else []
    check: list = ([(UpgradeState, {}), (LxcConfigs, {}), (PvePackages, {}), (BootStageFacts, {})]
             if spec.proxmox_ve == 9 else [])
    job: list = [(UpgradeJob, {}), (FileTexts, {"paths": CLUSTER_FILES})] if _performs(spec) else []
    return release + check + job


def _performs(spec: HostSpec) -> bool:
    return spec.proxmox_ve == 9 and spec.proxmox_ve_upgrade == "perform"


def job(spec: HostSpec) -> dict:
    """The upgrade job's reading (plan.upgrade_perform.job_reading); status None: none started."""
    if not _performs(spec):
        return {"status": None}
    found = _job_fact()
    return perform.job_reading(found["state"], found["lock"], found["log"])


def _on_8() -> bool:
    pve = fact_once(PveVersion)
    return bool(pve) and pve["major"] == 8


def running(spec: HostSpec) -> str | None:
    """The report of an upgrade job that runs (the run stops after it), or None."""
    current = job(spec)
    return perform.job_running(current) if current["status"] == "running" else None


def starts(spec: HostSpec) -> bool:
    """This run starts the upgrade (perform, the host on 8, no job yet; the preflight passed)."""
    return _performs(spec) and _on_8() and job(spec)["status"] is None


def perform_preflight(spec: HostSpec) -> list[str]:
    """Refusals of `perform`: a failed or interrupted job, else (the host on 8, no job) the upgrade's
    preflight (plan.upgrade_perform.perform_refusals)."""
    current = job(spec)
    cluster = _cluster() if _performs(spec) else ClusterView(None, None, True)
    if cluster.name is not None:  # the other nodes of its cluster read this node's phase from here (turn_wait)
        _turns()["phases"][cluster.node or host.name] = perform.node_phase(current, fact_once(PveVersion),
                                                                           _job_fact().get("moved"))
    if current["status"] in ("failed", "interrupted"):
        return [perform.job_refusal(current)]
    if not starts(spec):
        return []
    pre = fact_once(UpgradePreflight)
    view = perform.PerformView(
        pve8to9=pre["pve8to9"], proxmox_ve=(fact_once(PvePackages) or {}).get("proxmox-ve"),
        free_bytes=pre["free_bytes"], running_gpu_guests=_running_gpu_guests(spec),
        allow_stop=spec.guests.allow_stop, reboot_guests=spec.reboot.guests,
        in_cluster=cluster.name is not None and len(cluster.online) > 1,
        holds=(fact_once(UpgradeState) or {}).get("holds") or [],
        sources=perform.parse_sources(pre["sources"]), job=current)
    in_cluster = perform.cluster_refusals(cluster, set(_run_nodes())) if cluster.name is not None else []
    return perform.perform_refusals(view) + in_cluster


def _cluster() -> ClusterView:
    texts = fact_once(FileTexts, paths=CLUSTER_FILES) or {}
    return parse_cluster(texts.get(CLUSTER_FILES[0]), texts.get(CLUSTER_FILES[1]))


def _turns() -> dict[str, Any]:
    state = ctx_state.get()
    if getattr(state, _TURNS, None) is None:
        setattr(state, _TURNS, {"phases": {}, "starting": {}})
    return getattr(state, _TURNS)


def _run_nodes() -> dict[str, Any]:
    """{Proxmox node name: pyinfra host} of the hosts this run connected (within --limit): the roll's
    node map (operations/reboot.py run_nodes) less the inventory's hosts the run did not connect."""
    from operations.reboot import run_nodes

    state = current_state
    return {n: h for n, h in run_nodes(state).items() if state.is_host_in_limit(h) and h in state.activated_hosts}


def _phase_of(node: str, other) -> perform.NodePhase:
    """Another node's upgrade phase: as its own planning registered it, else read from it now (its
    job and Proxmox VE version in one command, without touching its run's readings)."""
    turns = _turns()
    if node not in turns["phases"]:
        from facts.hardware import combined_probe

        with ctx_host.use(other):
            found, pve = read_fact(combined_probe([(UpgradeJob, {}), (PveVersion, {})]))
        found = found or UpgradeJob.default()
        turns["phases"][node] = perform.node_phase(
            perform.job_reading(found["state"], found["lock"], found["log"]), pve, found.get("moved"))
    return turns["phases"][node]


def turn_wait(spec: HostSpec) -> str | None:
    """Why this host, which would start its upgrade now, waits for another node of its cluster
    (plan.upgrade_perform.turn_wait); None: not in a cluster, or its turn."""
    if not starts(spec):
        return None
    view = _cluster()
    me = view.node or host.name
    if view.name is None or len(view.online) <= 1:
        return None
    nodes = _run_nodes()
    phases = {n: _phase_of(n, nodes[n]) for n in sorted(view.online) if n != me and n in nodes}
    # pyinfra plans the hosts side by side (each waits on its own commands in turn): the decision and
    # the claim of the turn are one step, with no remote command between them
    starting = _turns()["starting"].setdefault(view.name, [])
    wait = perform.turn_wait(me, view.name, phases, starting)
    if wait is None:
        starting.append(me)
    return wait


def start_commands(spec: HostSpec) -> tuple[str, str]:
    """The job script (templates/pve-upgrade.sh.j2) and the command that backs up /etc/pve and
    starts it (templates/pve-upgrade-start.sh.j2)."""
    state = fact_once(UpgradeState) or {}
    boot = (fact_once(BootStageFacts) or {}).get("boot_loader") or {}
    pins = perform.stale_pins(state)
    sd_boot_pin = pins["unpin"] and any(e.get("mode") == "uefi" for e in boot.get("esps") or [])
    script = render_template("pve-upgrade.sh.j2", state_dir=perform.STATE_DIR, unpin=pins["unpin"],
                             efi_default=sd_boot_pin, unset_saved=pins["unset_saved"])
    return script, start_command()


def start_command() -> str:
    """templates/pve-upgrade-start.sh.j2: back up /etc/pve, start the job (perform.SCRIPT) detached:
    a transient unit perform.UNIT where systemd runs, else a process of its own session."""
    return render_template("pve-upgrade-start.sh.j2", state_dir=perform.STATE_DIR, lock=perform.LOCK_FILE,
                           script=perform.SCRIPT, unit=perform.UNIT)


@operation()
def start_upgrade(script: str, start: str, stop: list[tuple[str, int]], configs: list[str], timeout: int,
                  record: str = "", migrate: tuple[str, str, str] | None = None,
                  moved_before: list[tuple[str, str, int, str]] | None = None):
    """Stop the running GPU guests, back up their configs, write the job and start it detached.

    + script: rendered templates/pve-upgrade.sh.j2
    + start: rendered templates/pve-upgrade-start.sh.j2 (backs up /etc/pve, starts the job)
    + stop: the running GPU guests [(kind, id)] (the preflight refused unless guests.allow_stop)
    + configs: the guest config files backed up first (operations/backup.py)
    + timeout: guests.shutdown_timeout
    + record: rendered templates/pve-upgrade-guests.j2, the guests to start again after the upgrade
      (written before any is stopped; empty: none)
    + migrate: (cluster, node, reboot.migrate_fallback) with `reboot.guests: migrate` in a cluster: the
      node's running GPU guests moved or stopped as before a rolling reboot (operations/reboot.py
      clear_guests) and recorded (perform.MOVED_FILE, with `moved_before`: an earlier start's) to be
      undone once the node passed its host checks on 9 (restore_moved)
    """
    for path in configs:
        yield StringCommand(backup_command(path))
    dirs = root_dirs(("/var/lib/pvegpu", PRIVATE), (perform.STATE_DIR, PRIVATE))
    if record:
        yield StringCommand(dirs + write_file_command(perform.GUESTS_FILE, record, "600", keep_previous=False))
    for kind, gid in stop:
        yield from guest_stop_commands(None, kind, gid, timeout)  # over SSH, as the job itself
    if migrate:
        yield FunctionCommand(_clear_for_upgrade, (*migrate, timeout, list(moved_before or [])), {})
    yield StringCommand(dirs + write_file_command(perform.SCRIPT, script, "700", keep_previous=False))
    yield StringCommand(start)


def _write_moved(host, moved: list[tuple[str, str, int, str]]) -> bool:
    """Keep (or, empty, remove) the record of what the start did to the guests (perform.MOVED_FILE)."""
    if not moved:
        command = f"rm -f -- {word(perform.MOVED_FILE)}"
    else:
        text = render_template("pve-upgrade-moved.j2", moved=moved)
        command = root_dirs(("/var/lib/pvegpu", PRIVATE), (perform.STATE_DIR, PRIVATE)) + write_file_command(
            perform.MOVED_FILE, text, "600", keep_previous=False)
    ok, _ = host.run_shell_command(StringCommand(command))
    return bool(ok)


def _clear_for_upgrade(state, host, cluster: str, node: str, fallback: str, timeout: int,
                       moved_before: list[tuple[str, str, int, str]]) -> bool:
    """`reboot.guests: migrate`: the node's running GPU guests leave it as before a rolling reboot's
    (operations/reboot.py clear_guests: pooled VMs migrated offline to a node with free entries, the
    others shut down); what was done is recorded even when a guest could not leave (the job does not
    start then, and the next start adds to the record)."""
    from operations.reboot import ROLL_MOVED, clear_guests

    ok = clear_guests(state, host, cluster, node, fallback, timeout, occasion="the 8 -> 9 upgrade")
    moved = [*moved_before, *ROLL_MOVED.pop(host.name, [])]
    return _write_moved(host, moved) and ok


def _migrates(spec: HostSpec) -> bool:
    cluster = _cluster()
    return spec.reboot.guests == "migrate" and cluster.name is not None and len(cluster.online) > 1


def start(spec: HostSpec) -> None:
    """Yield the start of the upgrade (after `perform_preflight` passed)."""
    state = guest_state()
    stop = ([("lxc", c) for c, ct in sorted(spec.containers.items()) if ct.gpus and state["lxc"].get(c) == "running"]
            + [("qemu", v) for v, vm in sorted(spec.vms.items()) if vm.gpus and state["qemu"].get(v) == "running"])
    migrate = None
    if _migrates(spec):  # the guests leave the node as before its rolling reboot; none is stopped here
        cluster = _cluster()
        migrate, stop = (str(cluster.name), cluster.node or host.name, spec.reboot.migrate_fallback), []
    configs = ([f"/etc/pve/lxc/{c}.conf" for c in sorted(spec.containers)]
               + [f"/etc/pve/qemu-server/{v}.conf" for v in sorted(spec.vms)])
    script, command = start_commands(spec)
    # the guests stopped now, and those an earlier start stopped (a failed job started again): started
    # again once the host runs 9's kernel (restart_guests)
    guests = perform.parse_stopped_guests([*_job_fact()["guests"], *(f"{k} {g}" for k, g in stop)])
    record = render_template("pve-upgrade-guests.j2", guests=guests) if guests else ""
    start_upgrade(name="Start the Proxmox VE 8 -> 9 upgrade (detached; backup of /etc/pve and the guest configs "
                       f"first{', GPU guests stopped' if stop else ''}{', GPU guests moved' if migrate else ''})",
                  script=script, start=command, stop=stop, configs=configs, timeout=spec.guests.shutdown_timeout,
                  record=record, migrate=migrate, moved_before=perform.parse_moved(_job_fact().get("moved") or []))


def restart_guests(spec: HostSpec) -> None:
    """After the converge: the guests the upgrade's start stopped are started again once the job is
    done and the host runs 9's kernel (plan.upgrade_perform.guests_to_start), those still stopped
    then, once; the record is removed after (a start that fails is a warning, not kept for later)."""
    if not _performs(spec):
        return
    found = _job_fact()
    recorded = perform.parse_stopped_guests(found["guests"])
    kernel = (fact_once(PveVersion) or {}).get("running_kernel")
    guests = perform.guests_to_start(job(spec), kernel, _rebooted_for_upgrade(), recorded)
    if not guests:
        return
    start_stopped_guests(name="Start the GPU guests stopped for the Proxmox VE 8 -> 9 upgrade ("
                              + ", ".join(f"{KIND_LABEL[k]} {g}" for k, g in guests) + ")", guests=guests)


def _rebooted_for_upgrade() -> bool:
    """This run rebooted the host (the reboot stage) with the upgrade's reason among its reasons."""
    from facts.run_state import reboot_reasons, run_state

    return run_state().rebooting and any(kind == "upgrade" for kind, _ in reboot_reasons())


@operation(is_idempotent=False)
def start_stopped_guests(guests: list[tuple[str, int]]):
    """Start each guest of `guests` that is stopped now (one the converge started runs already),
    then forget the record (perform.GUESTS_FILE).

    + guests: [(kind, id)] from the record
    """
    guest_state_changes()
    for kind, gid in guests:
        yield FunctionCommand(_start_if_stopped, (kind, gid), {})
    yield StringCommand(f"rm -f -- {word(perform.GUESTS_FILE)}")


def _start_if_stopped(state, host, kind: str, gid: int) -> bool:
    tool, vmid = KIND_TOOL[kind], word(str(gid))
    ok, output = host.run_shell_command(StringCommand(
        f"if {tool} status {vmid} | grep -qx 'status: stopped'; then {tool} start {vmid}; fi"))
    if not ok:
        said = visible(" ".join(" ".join(output.stdout_lines + output.stderr_lines).split()))
        logger.warning(f"{host.name}: {KIND_LABEL[kind]} {gid} was stopped for the 8 -> 9 upgrade and did not start "
                       f"again: {said}")
    return True


def stop_host(message: str) -> None:
    """Stop this host's run here, the others' going on: logged, and the host failed (the run exits
    1). Not an exception: pyinfra's CLI ends every host's run on one raised while the deploy file
    loads (pyinfra_cli/util.py load_deploy_file: greenlet.get()); the last active host raises it all
    the same (pyinfra's fail_hosts ends a run with no host left with "No hosts remaining")."""
    if len(current_state.active_hosts) <= 1:
        from pyinfra.api.exceptions import DeployError

        raise DeployError(message)
    logger.error(message)
    current_state.fail_hosts({ctx_host.get()})


def restore_moved(spec: HostSpec, checked_now: bool) -> None:
    """After `confirm`: what the start did to the node's GPU guests with `reboot.guests: migrate`
    (perform.MOVED_FILE) is undone once its host checks passed on 9 (`checked=` read at the run's
    start, or the confirm of this run, which fails the host before this if they fail): the VMs moved
    come back, the guests stopped start (operations/reboot.py restore_guests), one at a time, the
    record rewritten after each."""
    if not _performs(spec):
        return
    moved = perform.parse_moved(_job_fact().get("moved") or [])
    current = job(spec)
    if not moved or current["status"] != "done" or not (current.get("checked") or checked_now):
        return
    cluster = _cluster()
    # the other node's connection (a node that waits, failed by stop_host, keeps it to the run's end)
    away = sorted({n for _, _, _, n in moved if n != (cluster.node or host.name)} - set(_run_nodes()))
    if away:  # restore_guests works through the other node's own connection
        logger.warning(f"{host.name}: the GPU guests moved away for the 8 -> 9 upgrade stay on node(s) "
                       f"{', '.join(away)}, which are not in this run: run with them to bring the guests back")
        return
    restore_moved_guests(name="Bring back the GPU guests moved for the Proxmox VE 8 -> 9 upgrade ("
                              + ", ".join(f"{KIND_LABEL.get(k, 'VM' if k.startswith('vm:') else 'CT')} {i}"
                                          for _, k, i, _ in moved) + ")",
                         cluster=str(cluster.name), node=cluster.node or host.name, moved=moved,
                         timeout=spec.guests.shutdown_timeout)


@operation(is_idempotent=False)
def restore_moved_guests(cluster: str, node: str, moved: list[tuple[str, str, int, str]], timeout: int):
    """Undo the moves of the upgrade's start, last first, each followed by the record's rewrite.

    + cluster, node: the node's cluster and node name (/etc/pve/.members)
    + moved: plan.upgrade_perform.parse_moved of the record
    + timeout: guests.shutdown_timeout
    """
    guest_state_changes()
    for index in reversed(range(len(moved))):
        yield FunctionCommand(_restore_one, (cluster, node, moved[index], moved[:index], timeout), {})


def _restore_one(state, host, cluster: str, node: str, entry: tuple[str, str, int, str],
                 left: list[tuple[str, str, int, str]], timeout: int) -> bool:
    from operations.reboot import ROLL_MOVED, restore_guests

    ROLL_MOVED[host.name] = [entry]
    return restore_guests(state, host, cluster, node, timeout, occasion="the 8 -> 9 upgrade") and _write_moved(host, left)


def confirm(spec: HostSpec) -> bool:
    """After the converge of a run where the job is done and unchecked, and 8's kernel no longer
    runs (or this run rebooted the host for the upgrade): the host checks (the roll's:
    plan.reboot.roll_check_lines), 8's kernel no longer running; passed -> `checked=` in the job's state,
    and the other nodes of its cluster may take their turn (plan.upgrade_perform.node_phase).
    Returns whether the run checks now."""
    if not _performs(spec):
        return False
    current = job(spec)
    if current["status"] != "done" or current.get("checked"):
        return False
    kernel = (fact_once(PveVersion) or {}).get("running_kernel")
    if (not kernel or perform.runs_8_kernel(str(kernel))) and not _rebooted_for_upgrade():
        return False
    checks = roll_check_lines(host_expectations(spec), [])
    confirm_upgrade(name=f"Host checks after the Proxmox VE 8 -> 9 upgrade ({len(checks)} check(s), 8's kernel gone)",
                    checks=checks)
    return True


@operation(is_idempotent=False)
def confirm_upgrade(checks: list[str]):
    """Run the host checks, 8's kernel gone; when they pass, record it in the job's state (`checked=`).

    + checks: plan.reboot.roll_check_lines of the host
    """
    yield FunctionCommand(_confirm, (checks,), {})


def _confirm(state, host, checks: list[str]) -> bool:
    ok, output = host.run_shell_command(StringCommand(f'echo "kernel=$(uname -r)"; {host_checks_command(checks)}'))
    lines = list(output.stdout_lines)
    kernel = lines[0][len("kernel="):].strip() if lines and lines[0].startswith("kernel=") else ""
    said = visible(" ".join(" ".join(lines[1:] + list(output.stderr_lines)).split()))
    if ok and (not kernel or perform.runs_8_kernel(kernel)):
        ok, said = False, f"it still runs kernel {kernel or '?'}, one of Proxmox VE 8's"
    if not ok:
        logger.error(f"{host.name}: the host checks after the 8 -> 9 upgrade failed: {said}; the other nodes of its "
                     "cluster do not start their upgrade until a run finds them passing")
        return False
    # the job's dir checked as every root-written path is (root's, 0700, no symlink on the way), the
    # state a regular file of it (not a link) before the line is added
    state_file = word(perform.STATE_FILE)
    done, _ = host.run_shell_command(StringCommand(
        root_dirs(("/var/lib/pvegpu", PRIVATE), (perform.STATE_DIR, PRIVATE))
        + f"[ -f {state_file} ] && [ ! -L {state_file} ] || exit 1\n"
        + f"printf 'checked=%s\\n' \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\" >> {state_file}"))
    if done:
        logger.info(f"{host.name}: host checks passed on kernel {kernel} after the 8 -> 9 upgrade "
                    f"({len(checks)} check(s))")
    return bool(done)


def _job_fact() -> dict:
    return fact_once(UpgradeJob) or UpgradeJob.default()


def after_upgrade(spec: HostSpec) -> None:
    """A finished job and the host still on 8's kernel: the reboot into 9's is due (per
    reboot.allowed, the reboot stage's business)."""
    if job(spec)["status"] != "done":
        return
    kernel = (fact_once(PveVersion) or {}).get("running_kernel")
    if kernel and kernel_pve_major(kernel) in (7, 8):
        from facts.run_state import need_reboot

        need_reboot("upgrade", f"the 8 -> 9 upgrade is done and the host runs 8's kernel {kernel}: boot 9's")


def preflight(spec: HostSpec) -> list[str]:
    """Refusals of what belongs to the other release than the host's (plan.releases)."""
    if not _asks(spec):
        return []
    kernel = spec.kernel
    return host_release_refusals(spec.proxmox_ve, kernel.version if kernel else None,
                                 kernel is not None and kernel.source.kind == "proxmox-git",
                                 fact_once(OsRelease), fact_once(PveVersion))


def _running_gpu_guests(spec: HostSpec) -> list[str]:
    state = guest_state()
    cts = [f"CT {c}" for c, ct in sorted(spec.containers.items()) if ct.gpus and state["lxc"].get(c) == "running"]
    vms = [f"VM {v}" for v, vm in sorted(spec.vms.items()) if vm.gpus and state["qemu"].get(v) == "running"]
    return cts + vms


def report(spec: HostSpec) -> list[str]:
    """Lines for the run's output: empty unless the spec says 9 and the check finds something
    (before the upgrade: always, with the rebuild note)."""
    if spec.proxmox_ve != 9:
        return []
    pve = fact_once(PveVersion)
    if not pve or pve["major"] not in (8, 9):
        return []
    upgraded = pve["major"] == 9
    # the raw lxc.* lines of each CT's main section (LxcConfigs keeps them in file order)
    raw = {ctid: "".join(f"{k}: {v}\n" for k, v in conf.get("lxc", []))
           for ctid, conf in (fact_once(LxcConfigs) or {}).items()}
    boot = (fact_once(BootStageFacts) or {}).get("boot_loader") or {}  # the boot stage's reading
    esps = boot.get("esps") or []
    view = HostView(upgraded=upgraded, proxmox_ve=(fact_once(PvePackages) or {}).get("proxmox-ve"),
                    running_kernel=pve.get("running_kernel"), cmdline_params=boot.get("params") or [],
                    cmdline_file=boot.get("config_file"),
                    pbt_systemd_boot=any(e.get("mode") == "uefi" for e in esps) if esps else None,
                    running_gpu_guests=[] if upgraded else _running_gpu_guests(spec),
                    kernel_updates=spec.kernel_updates)
    findings = upgrade_findings(fact_once(UpgradeState), raw, spec.nvidia.version if spec.nvidia else None, view)
    if upgraded and not findings:
        return []
    if upgraded:
        head = (f"upgrade check: the host runs Proxmox VE {pve['version']} now (proxmox_ve: 9); still due after the "
                "upgrade (pve8to9 --full checks more):")
    else:
        head = (f"upgrade check: the spec says Proxmox VE 9 (proxmox_ve: 9) and this host runs {pve['version']}; "
                "before the upgrade (pve8to9 --full checks more; run the upgrade in tmux or on the console, "
                "after a backup):")
    return [head] + [f"  - {f}" for f in findings]
