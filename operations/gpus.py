"""Stage 5, GPU assignment: per-address driver binding, persisted and (when safe) applied now.

Persisted: `/etc/udev/rules.d/60-pvegpu-gpu-binding.rules` sets each function's
`driver_override` on its "add" event; an initramfs hook carries the rule into the initramfs
so it acts during early coldplug, before nvidia/vfio-pci probe (vfio-pci itself is loaded
early by the boot stage's modules-load file; not duplicated here). `update-initramfs -u -k all`
runs once at the end of the run when the rule or hook changed, or when the initramfs does not
carry them yet (`operations.handlers`, INITRAMFS: its stamp records what the last successful
run put there).

Now (runtime rebind transaction), only when a GPU changes driver:
  preflight: refuse when a moving GPU is held by a process (nvidia-smi compute apps, `fuser
  -v /dev/nvidiaN`), naming the holder — nothing is changed; refuse when a guest using it is
  running and `guests.allow_stop` is false, when such a guest's config is locked, when it is an
  HA resource HA is not stopping, and when the spec's node is not the host's
  (`plan.guest_control`); an HA resource HA is already stopping is waited for, not shut down.
  apply: ONE runner script (`templates/rebind.sh.j2`, `plan.rebind`), written to
  /var/lib/pvegpu/rebind/run.sh and started DETACHED from the SSH session (a transient systemd
  unit `pvegpu-rebind`, else `setsid`) under `flock /run/pvegpu/rebind.lock`; the deploy follows
  its journal (/var/lib/pvegpu/rebind/journal) to the end. The runner: stop the running guests
  that use a moving GPU (a clean `qm/pct shutdown --timeout <guests.shutdown_timeout>`, a hard
  `stop` only when that times out) → check holders again → per function: driver_override,
  unbind (the write runs in the background and is abandoned after 30 s: unbind can hang in the
  kernel on some 595 drivers), drivers_probe, verify the new driver. On any failure it puts every
  function back on its driver (its old driver_override too) and starts the guests it stopped;
  the operation fails. A dropped connection or a killed deploy does not stop it: it completes or
  rolls back alone. With `proxmox_api` in the spec the guests are shut down through the API first
  (one FunctionCommand each, in the same operation; the runner records them). Guests a completed
  transaction stopped are started by the guests stage after their configs match the new binding
  (PVE would otherwise rebind a VM's old GPU); then the journal is archived
  (/var/lib/pvegpu/rebind/history/, newest 10).
  Next run: a journal still there is reported (completed / rolled back / interrupted, what
  moved), its guests still down are started by the guests stage once their configs match, and a
  new transaction carries them. A run that finds a runner still running waits for it first
  (`operations.runlock`).

Where /sys cannot rebind (mounted read-only: a container, the twin without its kernel model),
the rebind is persisted only and reported as a reboot reason ("gpu-binding"); the hardware takes
the new binding at the next boot. The guests stage then renders CT device entries for the minors
that boot will give (`plan.gpus.boot_minors`). On a real host the same run rebinds live.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation

from facts.files import ManagedFiles
from facts.guest_state import guest_state_changes, remember_guest_state
from facts.hardware import HardwareProbe, HostConfigProbe
from facts.once import fact_once, read_fact
from facts.proxmox import HaResources, NodeName, PvePackages
from facts.rebind import GpuHolders, GuestRuntime, RebindJournal
from facts.run_state import need_reboot, run_state
from facts.shell import word
from operations import handlers
from operations.files import file_current, managed_file
from operations.proxmox import PveApi, api_of, guest_stop_commands, shutdown_shell, wait_stopped_shell
from plan.gpus import (
    Bindings,
    RebindPlan,
    boot_minors,
    desired_bindings,
    holders_of,
    identity_domain_refusals,
    plan_rebind,
)
from plan.guest_control import ha_resource, node_refusal, stop_checks
from plan.rebind import Journal, close_command, journal_of, recovery, runner_script, start_command, transaction_id
from plan.render import render_template
from plan.terminal import visible
from spec.models import GuestPolicy, HostSpec

RULES_PATH = "/etc/udev/rules.d/60-pvegpu-gpu-binding.rules"
INITRAMFS_HOOK_PATH = "/etc/initramfs-tools/hooks/pvegpu-gpu-binding"
# the stage's files (written in this order): one fact. The initramfs that carries them is rebuilt
# by the INITRAMFS handler, whose stamp records what the last successful update-initramfs put
# there (a run that wrote the rules but failed before or in update-initramfs retries it next run).
STAGE_FILES = [RULES_PATH, INITRAMFS_HOOK_PATH]
UNBIND_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_S: int = GuestPolicy.model_fields["shutdown_timeout"].default  # the one default: the model's


# ---------------------------------------------------------------- facts + plan, once per run


def stage_facts(spec: HostSpec) -> dict:
    """Facts and decisions of stages 6 and 7, read once per run (pyinfra 3 has no fact cache).

    .. code:: python

        {"hw": <HardwareProbe>, "cfg": <HostConfigProbe>, "runtime": <GuestRuntime>,
         "node": "kpro6", "bindings": Bindings, "rebind": RebindPlan, "holders": {bdf: [..]},
         "config_minors": {bdf: minor},   # minors the guest configs must use
         "host_node": "kpro6", "packages": <PvePackages>, "ha": <HaResources>,
         "stop_refusals": [..], "ha_wait": [("qemu", 300, "vm:300")],   # plan.guest_control
         "journal": plan.rebind.Journal, "systemd": True, "recovery": plan.rebind.Recovery}     # an earlier transaction's journal
    """
    run = run_state()
    if "gpus" in run.memos:
        return run.memos["gpus"]
    hw = fact_once(HardwareProbe)
    cfg = fact_once(HostConfigProbe)
    runtime = fact_once(GuestRuntime)
    remember_guest_state(runtime["status"])  # the run's guest state: no stage reads pct/qm list again
    host_node = fact_once(NodeName)  # Proxmox's node name: the host's, not the spec's
    node = node_of(spec)
    pci = hw["pci_devices"]
    bindings = desired_bindings(spec, pci)
    rebind = plan_rebind(spec, node, bindings, pci, hw["nvidia_gpus"], cfg["lxc_configs"], cfg["qemu_configs"],
                         cfg["pci_mappings"], runtime["status"], runtime["sysfs_live"])
    holders: dict[str, list[str]] = {}
    if rebind.moves:
        nodes = sorted({f"/dev/nvidia{hw['nvidia_gpus'][m.bdf]['minor']}" for m in rebind.moves
                        if hw["nvidia_gpus"].get(m.bdf, {}).get("minor") is not None})
        found = read_fact(GpuHolders, nodes=nodes)
        holders = holders_of([m.bdf for m in rebind.moves], hw["nvidia_gpus"], found["compute_apps"], found["fuser"])
    if rebind.moves and not rebind.live:
        config_minors = boot_minors(bindings, pci)
    else:
        config_minors = {b: g["minor"] for b, g in hw["nvidia_gpus"].items() if g.get("minor") is not None}
    ha = fact_once(HaResources)
    stop_refusals, ha_wait = stop_checks(rebind.stop, cfg["lxc_configs"], cfg["qemu_configs"], ha)
    found = fact_once(RebindJournal)
    journal = journal_of(found)
    status = runtime["status"]
    ha_managed = [(k, i) for k in ("lxc", "qemu") for i in status.get(k, {}) if ha_resource(ha, k, i)]
    memo = {"journal": journal, "systemd": found["systemd"], "recovery": recovery(journal, status, ha_managed),
            "hw": hw, "cfg": cfg, "runtime": runtime, "node": node, "bindings": bindings,
            "rebind": rebind, "holders": holders, "config_minors": config_minors,
            "host_node": host_node, "packages": fact_once(PvePackages), "ha": ha,
            "stop_refusals": stop_refusals, "ha_wait": ha_wait}
    run.memos["gpus"] = memo  # the guests, containers and NCCL stages read the same
    return memo


def node_of(spec: HostSpec) -> str:
    """The Proxmox node name pvegpu uses for this host (the one place it is decided): the host's
    own (`uname -n` without the domain), else the spec's `node`, the inventory's, the host name."""
    return fact_once(NodeName) or spec.node or host.data.get("pvegpu_node") or host.name


def binding_rules(bindings: Bindings) -> str:
    """The udev rule file (only functions with a driver; 'leave unbound' gets no line)."""
    return render_template("gpu-binding.rules.j2",
                           bindings=[(b, d) for b, d in sorted(bindings.drivers.items()) if d])


# ---------------------------------------------------------------- the rebind transaction


def rebind_script(plan: RebindPlan, nvidia: dict[str, dict], txid: str = "test", timeout_s: int = UNBIND_TIMEOUT_S,
                  sysfs: str = "/sys", stop_guests: bool = True, shutdown_timeout: int = SHUTDOWN_TIMEOUT_S,
                  ha_wait: Sequence[tuple[str, int, str]] = (), carried: Sequence[tuple[str, int]] = (),
                  journal: str | None = None) -> str:
    """The detached runner of one rebind transaction (`plan.rebind.runner_script`), with the
    guest shutdowns (`qm/pct shutdown`, a hard `stop` when that times out) and HA waits spelled
    out. `stop_guests` False when the guests were shut down through the API before it (they are
    recorded as stopped by pvegpu); `ha_wait`: HA resources HA is stopping (waited for, never
    shut down); `carried`: guests an earlier transaction stopped that are still down."""
    waiting = {(kind, gid): sid for kind, gid, sid in ha_wait}
    own = [(k, g) for k, g in plan.stop if (k, g) not in waiting]
    shutdowns = [{"kind": k, "gid": int(g), "shell": shutdown_shell(k, g, shutdown_timeout)}
                 for k, g in (own if stop_guests else [])]
    ha_waits = [{"kind": k, "gid": int(g), "sid": sid, "shell": wait_stopped_shell(k, g, shutdown_timeout),
                 "message": f"{'CT' if k == 'lxc' else 'VM'} {g} is still running: HA resource {sid} did not stop "
                            f"it within {shutdown_timeout} s (ha-manager status; or take it out of HA: "
                            f"ha-manager remove {sid})"}
                for (k, g), sid in waiting.items()]
    extra = {"journal": journal} if journal else {}
    return runner_script(plan, nvidia, txid, shutdowns=shutdowns, ha_waits=ha_waits,
                         api_stopped=[] if stop_guests else own, carried=list(carried), timeout_s=timeout_s,
                         sysfs=sysfs, **extra)


@operation()
def rebind_gpus(plan: RebindPlan, nvidia: dict[str, dict], api: PveApi | None = None,
                shutdown_timeout: int = SHUTDOWN_TIMEOUT_S, ha_wait: list | None = None,
                carried: list | None = None, systemd: bool = False, txid: str | None = None):
    """Run the rebind transaction for `plan.moves`: write the runner, start it detached from
    this SSH session (`plan.rebind.start_command`) and follow its journal to its end (with
    `api`, each guest in `plan.stop` is shut down through the API before it).

    + plan: `plan.gpus.RebindPlan` (live)
    + nvidia: `NvidiaGpus` fact (minors of the GPUs leaving nvidia)
    + api: `operations.proxmox.PveApi`, or None to stop guests with qm/pct in the runner
    + shutdown_timeout: seconds a guest gets to shut down before it is stopped hard
    + ha_wait: ``[("qemu", 300, "vm:300")]`` HA resources HA is stopping: waited for, not shut down
    + carried: ``[("lxc", 200)]`` guests an earlier transaction stopped that are still down
    + systemd: start the runner as a transient unit (else setsid)
    + txid: the transaction's name in the journal
    """
    if not plan.moves:
        host.noop("every GPU is bound to the driver its role needs")
        return
    guest_state_changes()  # it stops guests (through the API or in the runner)
    waiting = {(kind, gid) for kind, gid, _ in ha_wait or []}
    if api is not None:
        for kind, gid in plan.stop:
            if (kind, gid) not in waiting:
                yield from guest_stop_commands(api, kind, gid, shutdown_timeout)
    txid = txid or transaction_id(datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), host.name)
    script = rebind_script(plan, nvidia, txid, stop_guests=api is None, shutdown_timeout=shutdown_timeout,
                           ha_wait=list(ha_wait or []), carried=list(carried or []))
    yield StringCommand("sh", "-c", word(start_command(script, txid, systemd)))


@operation()
def close_rebind_journal(journal: Journal, live_rebind: bool):
    """Archive the rebind journal once the guests it stopped run again (after the guests stage).

    + journal: `plan.rebind.Journal` this run found (empty: none)
    + live_rebind: this run started a transaction (its journal exists only while executing)
    """
    if not journal.exists and not live_rebind:
        host.noop("no rebind journal to close")
        return
    yield StringCommand(close_command())


# ---------------------------------------------------------------- stage protocol


def stage_fact_requests() -> list:
    """What `stage_facts` reads up front (the guests and NCCL stages read it too)."""
    return [(HardwareProbe, {}), (HostConfigProbe, {}), (GuestRuntime, {}), (NodeName, {}), (PvePackages, {}),
            (HaResources, {}), (RebindJournal, {})]


def prefetch(spec: HostSpec) -> list:
    """The facts this stage reads (deploy.py reads every stage's in one command)."""
    return stage_fact_requests() + [(ManagedFiles, {"paths": STAGE_FILES})] if spec.gpus else []


def preflight(spec: HostSpec) -> list[str]:
    if not spec.gpus:
        return []
    facts = stage_facts(spec)
    refusals = list(facts["bindings"].refusals)
    hw = facts["hw"]
    refusals += identity_domain_refusals(hw.get("pci_devices") or {}, hw.get("iommu") or {}, hw.get("sev_snp"))
    rebind: RebindPlan = facts["rebind"]
    refusals += guest_control_refusals(spec, facts)
    if facts["journal"].running:
        refusals.append(f"a GPU rebind transaction is still running on the host (started "
                        f"{facts['journal'].started}); wait for it to end (tail -f "
                        f"/var/lib/pvegpu/rebind/journal) and re-run")
    for kind, gid in rebind.blocked:
        refusals.append(f"{'CT' if kind == 'lxc' else 'VM'} {gid} is running and uses a GPU that changes driver, "
                        f"but guests.allow_stop is false; stop it yourself or allow stopping")
    for bdf, who in sorted(facts["holders"].items()):
        refusals.append(f"GPU {bdf} must change driver but is held by {', '.join(who)}; stop that process "
                        f"(nvidia-persistenced: systemctl stop nvidia-persistenced) and re-run")
    return refusals


def guest_control_refusals(spec: HostSpec, facts: dict) -> list[str]:
    """The node name and the guests the rebind would stop, checked as Proxmox would
    (`plan.guest_control`): a wrong spec node, a locked guest, an HA resource HA is not stopping."""
    refusal = node_refusal(spec.node, facts["host_node"], host.name)
    return ([refusal] if refusal else []) + list(facts["stop_refusals"])


@deploy("GPU assignment")
def apply(spec: HostSpec) -> None:
    if not spec.gpus:
        return
    facts = stage_facts(spec)
    bindings: Bindings = facts["bindings"]
    rebind: RebindPlan = facts["rebind"]
    for line in facts["recovery"].lines:  # a journal an earlier transaction left (commands' words in it)
        logger.warning(f"{host.name}: {visible(line)}")
    for line in rebind.dry_lines():
        logger.info(f"{host.name}: {line}")
    files = {
        RULES_PATH: (binding_rules(bindings), "644"),
        INITRAMFS_HOOK_PATH: (render_template("initramfs-gpu-binding-hook.j2", rules_path=RULES_PATH), "755"),
    }
    state = fact_once(ManagedFiles, paths=STAGE_FILES)
    for path, (content, mode) in files.items():
        managed_file(name=f"GPU binding: {path}", path=path, content=content, mode=mode, state=state.get(path))
        handlers.depends_on(handlers.INITRAMFS, path, content, mode,
                            changed=not file_current(state.get(path), content, mode),
                            why=f"{path} changed (GPU binding)")
    if rebind.moves and rebind.live:
        rebind_gpus(name="GPU binding: rebind transaction", plan=rebind, nvidia=facts["hw"]["nvidia_gpus"],
                    api=api_of(spec, facts["node"]), shutdown_timeout=spec.guests.shutdown_timeout,
                    ha_wait=facts["ha_wait"], carried=facts["recovery"].start,
                    systemd=facts["systemd"])
    elif rebind.moves:
        for m in rebind.moves:
            need_reboot("gpu-binding", f"{m} (persisted; this host cannot rebind through /sys now)")
