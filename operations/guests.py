"""Stage 6, guests: CT device entries, VM PCI mappings and hostpci lines, guest restarts.

Containers: `/etc/pve/lxc/<ctid>.conf` gets the device lines for exactly its GPUs
(`plan.guests`); root writes the file directly (raw `lxc.*` keys cannot go through the API),
atomically (`operations.files.write_file_command`). The CT operation reads its facts (all CT
configs, NVIDIA minors, char majors: one command) when it runs — i.e. after the GPU stage's
rebind transaction — because minors shift when GPUs change driver; the CT run state is this
run's `facts.guest_state.guest_state()`, read again when the rebind stopped guests. While a
rebind waits for the next boot, it uses the minors that boot will give
(`plan.gpus.boot_minors`). A running CT is restarted (shutdown, then start) only when its set
of GPU nodes changed and those nodes exist now; CTs the rebind stopped are started again. On
pve-container >= 6.0.4 a change that only adds `devN` entries goes through `pct set`/the API
instead, which hotplugs them into the running CT (no restart). Raw cgroup v1 `lxc.cgroup.*`
lines of a GPU CT are reported with their `lxc.cgroup2.*` fix (ignored on Proxmox VE 9).

VMs: PCI resource mappings (`/cluster/mapping/pci`; entries that no longer match the hardware
corrected from the facts), hostpci lines (VM config); VMs the rebind stopped are started after
their config matches, and a running VM whose GPUs changed is restarted (only when its GPUs
are on vfio-pci now, not when that waits for a boot). Mappings pvegpu created (`pvegpu-*`,
entries only for this node) that no VM in the spec uses and no VM config of the cluster
references (snapshots and pending changes included, after this run's hostpci changes) are
deleted, after the VM configs; mappings with other names are never touched, only reported
when they point at the spec's GPUs.

Every Proxmox write (mappings, VM configs, guest start/shutdown/stop) goes through the
Proxmox API when the spec has `proxmox_api`, else over SSH with `pvesh`/`qm`/`pct`
(`operations.proxmox`). A guest is stopped with a clean shutdown (`guests.shutdown_timeout`
seconds), and hard-stopped only when that times out. CT configs are written as files either
way (raw `lxc.*` keys cannot go through the API).
"""

from __future__ import annotations

import re

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, OperationError, StringCommand, deploy, operation

from facts.guest_state import guest_state
from facts.guests import LXC_DIR, ContainerGpuState, VmMappingReferences
from facts.once import fact_unless_changed, read_fact
from facts.shell import word
from operations.backup import PCI_CFG, backup_command, keep_config, log_diff, pci_cfg_after, vm_config_after
from operations.files import write_file_command
from operations.gpus import (
    SHUTDOWN_TIMEOUT_S,
    close_rebind_journal,
    guest_control_refusals,
    node_of,
    stage_fact_requests,
    stage_facts,
)
from operations.proxmox import (
    MERGE_TRIES,
    PveApi,
    PveWrite,
    api_merge_mapping,
    api_of,
    guest_start_commands,
    guest_stop_commands,
    write_commands,
)
from plan.guest_control import CONFIG_LOCK_FILE, CONFIG_LOCK_TIMEOUT_S, config_lock, ha_resource, lock_refusal
from plan.guests import (
    MappingChange,
    config_gpu_nodes,
    current_dev_entries,
    gpu_pool_ids,
    hotplug_additions,
    is_unprivileged,
    legacy_cgroup_keys,
    map_string,
    mapping_references,
    merge_container_config,
    nvidia_majors,
    plan_bar_fit,
    plan_mappings,
    plan_pool_mappings,
    plan_stale_mappings,
    plan_stale_pools,
    plan_vm,
    pve_hotplugs_dev_entries,
    pve_supports_dev_entries,
    render_container_devices,
    used_dev_indices,
    vm_mappings_after,
)
from plan.render import render_template
from spec.models import HostSpec


def ha_restart_refusal(kind: str, gid: int, sid: str) -> str:
    """Why pvegpu does not restart an HA-managed guest, and what to do instead."""
    label, tool = ("CT", "pct") if kind == "lxc" else ("VM", "qm")
    return (f"{label} {gid} needs a restart for its new GPUs but is HA resource {sid}: `{tool} shutdown/start` "
            f"would only queue requests with the HA manager, so pvegpu changes nothing for it. Stop it through HA "
            f"(`ha-manager set {sid} --state stopped`, wait until it is stopped) or take it out of HA "
            f"(`ha-manager remove {sid}`), re-run, then `ha-manager set {sid} --state started`")


def locked_config_write(kind: str, gid: int, path: str, text: str) -> str:
    """Write a guest config the way Proxmox's tools do: holding the guest's config flock (so a
    GUI/API edit cannot interleave), and only while the config carries no `lock:` (checked under
    that flock; a lock makes the command fail naming it)."""
    lock = CONFIG_LOCK_FILE[kind].format(gid=gid)
    q = word
    label = "CT" if kind == "lxc" else "VM"
    locked = q(f"pvegpu: {label} {gid} is locked (") + '"$l"' + q("): its config is not written; re-run when the lock is gone")
    # Proxmox's own lock dir lies in the 1777 /run/lock (pve-container, qemu-server take the same
    # path), so templates/root-dir.sh.j2 would refuse its parent: the dir itself must be root's, no
    # symlink, not group/other writable, else a local user who made it first could plant the lock file
    # as a symlink that `9>` truncates (issue 39)
    lock_dir = lock.rsplit("/", 1)[0]
    d = q(lock_dir)
    unsafe = q(f"pvegpu: the lock directory {lock_dir} is not root's alone (a symlink, another owner or "
               "writable by others); nothing was written")
    return (f"{{ [ -d {d} ] || mkdir -m 755 {d}; }} && [ ! -L {d} ] && [ \"$(stat -c %u {d})\" = 0 ] && "
            f"[ $((0$(stat -c %a {d}) & 022)) -eq 0 ] || {{ echo {unsafe} >&2; exit 1; }}; "
            f"( flock -w {CONFIG_LOCK_TIMEOUT_S} 9 || "
            f"{{ echo {q(f'pvegpu: cannot get the config lock {lock} of {label} {gid} (held by another task)')} >&2; exit 1; }}; "
            f"l=$(sed -n '/^\\[/q;s/^lock:[[:space:]]*//p' {q(path)} 2>/dev/null); "
            f"[ -z \"$l\" ] || {{ echo {locked} >&2; exit 1; }}; "
            f"{backup_command(path)} && "  # the previous config kept outside pmxcfs (operations/backup.py)
            f"{write_file_command(path, text, '640', keep_previous=False)} ) 9>{q(lock)}")


@operation()
def container_gpu_devices(wanted: dict[int, dict], dev_entries: bool, boot_minors: dict[str, int] | None = None,
                          start_after: list[int] | None = None, api: PveApi | None = None,
                          shutdown_timeout: int = SHUTDOWN_TIMEOUT_S, ha: dict | None = None,
                          hotplug: bool = False, node: str = "localhost"):
    """Give each CT the device lines of exactly its GPUs; restart/start CTs as needed.

    + wanted: ``{200: {"gpus": ["0000:01:00.0"], "gid": 44, "extra": ["uvm-tools"]}}``
    + dev_entries: `devN:` syntax (pve-container >= 5.0.7), else raw `lxc.*` lines
    + hotplug: pve-container >= 6.0.4: a running CT whose change only adds `devN` entries gets them
      through `pct set`/the API, which hotplugs them (no restart; HA needs no stop either)
    + node: the Proxmox node (API paths)
    + boot_minors: minors to use while a rebind waits for a reboot (no restarts then)
    + start_after: CTs the rebind transaction stopped (started again here)
    + api: `operations.proxmox.PveApi` for start/shutdown, or None for pct over SSH
    + shutdown_timeout: seconds a CT gets to shut down before it is stopped hard
    + ha: `HaResources`; a running HA-managed CT that would need a restart is refused (nothing written)
    """
    # read as it executes, unless no operation before it ran a command (then the prefetched
    # reading, which holds: a no-change run spends no round trip on it)
    state = fact_unless_changed(ContainerGpuState)
    # this run's CT run state; read again when an earlier operation started or stopped guests
    status = guest_state()["lxc"]
    live_minors = {b: g["minor"] for b, g in state["nvidia"].items() if g.get("minor") is not None}
    minors = boot_minors if boot_minors is not None else live_minors
    majors = state["majors"]
    to_start = set(start_after or [])
    changed_any = False
    locked: list[str] = []
    for ctid, want in sorted(wanted.items()):
        text = state["configs"].get(ctid)
        if text is None:
            logger.warning(f"{host.name}: CT {ctid} does not exist on this node; create it, then re-run")
            continue
        devices = render_container_devices(ctid, want["gpus"], minors, majors, dev_entries, want["gid"],
                                           used_dev_indices(text, nvidia_majors(majors)),
                                           caps_present=state.get("caps"),
                                           # kept indices make a GPU added to a CT only added
                                           # lines; without hotplug the compact numbering stays
                                           current=current_dev_entries(text, nvidia_majors(majors)) if hotplug else None,
                                           extra=want.get("extra", ()), unprivileged=is_unprivileged(text))
        for problem in devices.problems:
            logger.warning(f"{host.name}: {problem}")
        merged = merge_container_config(text, devices.lines, majors)
        for finding in legacy_cgroup_keys(ctid, merged.text):
            logger.warning(f"{host.name}: {finding}")
        running = status.get(ctid) == "running"
        adds = hotplug_additions(merged) if hotplug and running and boot_minors is None \
            and not devices.problems and ctid not in to_start else None
        lock = re.search(r"^lock:\s*(\S+)", text.split("\n[", 1)[0], re.M)
        if lock and (merged.changed or ctid in to_start):
            # a backup/migration/snapshot holds it: neither its config nor its run state is ours to change
            locked.append(lock_refusal("lxc", ctid, lock.group(1), "write its config or stop/start it"))
            continue
        managed = ha_resource(ha or {}, "lxc", ctid)
        if managed and running and boot_minors is None and not devices.problems and adds is None \
                and config_gpu_nodes(text) != config_gpu_nodes(merged.text):
            locked.append(ha_restart_refusal("lxc", ctid, managed[0]))
            continue
        if adds:
            changed_any = True
            log_diff(f"{LXC_DIR}/{ctid}.conf", text, merged.text)
            logger.info(f"{host.name}: CT {ctid} runs: its new device entries are hotplugged "
                        f"({', '.join(k for k, _ in adds)}), no restart")
            yield StringCommand(backup_command(f"{LXC_DIR}/{ctid}.conf"))
            shell = " ".join([f"pct set {word(str(ctid))}", *(f"--{k} {word(v)}" for k, v in adds)])
            yield from write_commands(api, PveWrite("set", f"/nodes/{node}/lxc/{ctid}/config", tuple(adds)), shell)
            continue
        if merged.changed:
            changed_any = True
            # /etc/pve is pmxcfs (cluster-replicated): no .pvegpu-prev copies next to the config;
            # the previous one is kept under /var/lib/pvegpu/backup (operations/backup.py)
            log_diff(f"{LXC_DIR}/{ctid}.conf", text, merged.text)
            yield StringCommand(locked_config_write("lxc", ctid, f"{LXC_DIR}/{ctid}.conf", merged.text))
        nodes_changed = config_gpu_nodes(text) != config_gpu_nodes(merged.text)
        if ctid in to_start and not running:
            changed_any = True
            yield from guest_start_commands(api, "lxc", ctid)
        elif running and merged.changed and not nodes_changed:
            # pve-container takes no device away from a running CT: the new set applies at its next start
            logger.info(f"{host.name}: CT {ctid} runs: its device entries change without a GPU change "
                        f"(now {len(devices.lines)} line(s)); the new set applies at its next start")
        elif running and nodes_changed:
            if boot_minors is not None:
                logger.info(f"{host.name}: CT {ctid} gets its new GPUs at the pending reboot")
            elif devices.problems:
                logger.warning(f"{host.name}: CT {ctid} keeps running: its device set is incomplete")
            else:
                changed_any = True
                yield from guest_stop_commands(api, "lxc", ctid, shutdown_timeout)
                yield from guest_start_commands(api, "lxc", ctid)
    if locked:
        raise OperationError("; ".join(locked))
    if not changed_any:
        host.noop("every container passes exactly its GPUs")


def mapping_merge_command(change: MappingChange, cfg: str = PCI_CFG) -> str:
    """The SSH command that merges this node's entries of a mapping (templates/mapping-merge.sh.j2)."""
    script = render_template("mapping-merge.sh.j2", cfg=cfg, id=change.id, node=change.node,
                             maps=[map_string(m) for m in change.maps], tries=MERGE_TRIES,
                             description=change.description)
    return f"/bin/sh -c {word(script)}"


def mapping_commands(api: PveApi | None, change: MappingChange) -> list:
    """The write of one `MappingChange`: a merge of this node's entries (other nodes' entries as
    they are when it runs, never as the facts saw them: no lost update when nodes of a cluster
    converge at once), or the deletion of an id."""
    if change.action == "merge":
        if api is None:
            return [StringCommand(mapping_merge_command(change))]
        return [FunctionCommand(api_merge_mapping, (api, change.id, change.node, [map_string(m) for m in change.maps]),
                                {"description": change.description})]
    return write_commands(api, PveWrite("delete", f"/cluster/mapping/pci/{change.id}"))


@operation()
def pci_mappings(changes: list, api: PveApi | None = None, unchanged: str = "PCI resource mappings match the hardware"):
    """Merge this node's entries into PCI resource mappings, or delete mappings
    (`plan.guests.MappingChange` list).

    + api: `operations.proxmox.PveApi`, or None for pvesh over SSH
    """
    if not changes:
        host.noop(unchanged)
        return
    for change in changes:
        yield from mapping_commands(api, change)


def vm_config_write(node: str, plan) -> tuple[PveWrite, str]:
    """One VM's config change as an API write and as the `qm set` line SSH runs."""
    params = tuple(plan.set_options.items()) + ((("delete", ",".join(plan.delete)),) if plan.delete else ())
    q = word(str(int(plan.vmid)))  # an int >= 100; option values as PveWrite.pvesh says
    shell = " ".join([f"qm set {q}", *(f"--{k} {word(v)}" for k, v in params)])
    return PveWrite("set", f"/nodes/{node}/qemu/{plan.vmid}/config", params), shell


@operation()
def vm_hostpci(plan, start: bool = False, restart: bool = False, node: str = "localhost",
               api: PveApi | None = None, shutdown_timeout: int = SHUTDOWN_TIMEOUT_S):
    """Apply one VM's hostpci/machine changes (`plan.guests.VmPlan`) and start or restart it.

    + start: the rebind transaction stopped this VM; start it after the config is right
    + restart: the VM runs and its GPUs changed (and the new ones are on vfio-pci now)
    + node: the Proxmox node (API paths); api: `PveApi`, or None for qm over SSH
    + shutdown_timeout: seconds the VM gets to shut down before it is stopped hard
    """
    if plan.changed:
        write, shell = vm_config_write(node, plan)
        yield from write_commands(api, write, shell)
    if start:
        yield from guest_start_commands(api, "qemu", plan.vmid)
    elif restart and plan.changed:
        yield from guest_stop_commands(api, "qemu", plan.vmid, shutdown_timeout)
        yield from guest_start_commands(api, "qemu", plan.vmid)
    if not plan.changed and not start:
        host.noop(f"VM {plan.vmid} passes exactly its GPUs")


# ---------------------------------------------------------------- stage protocol


def prefetch(spec: HostSpec) -> list:
    """The facts this stage reads up front (deploy.py reads every stage's in one command)."""
    # ContainerGpuState is read inside its operation, which pyinfra runs when it executes; read
    # here too, the operation takes this reading while no earlier operation ran a command
    # (facts.once.fact_unless_changed), else reads its own
    requests = stage_fact_requests() if spec.containers or spec.vms or spec.gpus else []
    return requests + [(ContainerGpuState, {})] if spec.containers else requests


def preflight(spec: HostSpec) -> list[str]:
    # other guest problems are reported while applying; the GPU stage refuses unsafe moves
    refusals: list[str] = []
    if spec.proxmox_api is not None:
        api = PveApi(spec.proxmox_api, node_of(spec))
        problem = api.problem()
        if problem:
            refusals.append(problem)
        insecure = api.warning()
        if insecure:
            logger.warning(f"{host.name}: {insecure}")
    if spec.containers or spec.vms or spec.gpus:
        facts = stage_facts(spec)
        if not spec.gpus:  # with GPUs, the GPU stage's preflight says it
            refusals += guest_control_refusals(spec, facts)
        refusals += locked_vm_refusals(spec, facts)
        refusals += bar_fit_refusals(spec, facts)
    return refusals


def bar_fit_refusals(spec: HostSpec, facts: dict) -> list[str]:
    """VMs whose GPUs' BARs no window their firmware can open holds, whatever `cpu` pvegpu sets
    (`plan.guests.plan_bar_fit`): refused before anything changes, with the numbers."""
    pci = facts["hw"]["pci_devices"]
    refusals = []
    for vmid, vm in sorted(spec.vms.items()):
        config = facts["cfg"]["qemu_configs"].get(vmid)
        gpus = [b for b in vm.gpus if b in pci]
        if config is None or not gpus:
            continue
        _, problems, _ = plan_bar_fit(vmid, gpus, config, pci, host_phys_bits(facts["hw"]))
        refusals += problems
    return refusals


def host_phys_bits(hw: dict) -> int | None:
    """The host CPU's physical address bits (CpuInfo in the HardwareProbe), for the BAR fit."""
    return (hw.get("cpu") or {}).get("phys_bits")


def locked_vm_refusals(spec: HostSpec, facts: dict) -> list[str]:
    """VMs of the spec whose config this run would change (or that it would restart) while
    their config carries a `lock:` (qm refuses both then: "VM is locked (backup)"), and running
    HA-managed VMs it would restart (qm would only queue HA requests)."""
    refusals = []
    cfg, pci = facts["cfg"], facts["hw"]["pci_devices"]
    running = facts["runtime"]["status"]["qemu"]
    pending_boot = bool(facts["rebind"].moves) and not facts["rebind"].live
    for vmid, vm in sorted(spec.vms.items()):
        config = cfg["qemu_configs"].get(vmid)
        lock = config_lock(config)
        managed = ha_resource(facts["ha"], "qemu", vmid)
        if config is None or not (lock or managed):
            continue
        plan = plan_vm(vmid, facts["node"], [b for b in vm.gpus if b in pci], vm.machine, vm.allow_machine_change,
                       config, pci, set(spec.gpus), host_phys_bits=host_phys_bits(facts["hw"]), pool=vm.pool,
                       running=running.get(vmid) == "running",
                       pools=gpu_pool_ids(cfg.get("pci_mappings") or {}, {v.pool for v in spec.vms.values() if v.pool}))
        if lock and (plan.changed or ("qemu", vmid) in facts["rebind"].stop):
            refusals.append(lock_refusal("qemu", vmid, lock, "change its config or stop/start it"))
        elif managed and plan.changed and running.get(vmid) == "running" \
                and not (pending_boot and any(m.bdf in vm.gpus for m in facts["rebind"].moves)):
            refusals.append(ha_restart_refusal("qemu", vmid, managed[0]))
    return refusals


@deploy("guests")
def apply(spec: HostSpec) -> None:
    if not spec.containers and not spec.vms and not spec.gpus:
        return
    facts = stage_facts(spec)
    hw, cfg, rebind, node = facts["hw"], facts["cfg"], facts["rebind"], facts["node"]
    api = api_of(spec, node)
    timeout = spec.guests.shutdown_timeout
    pending_boot = bool(rebind.moves) and not rebind.live
    stopped = {(k, i) for k, i in rebind.stop}
    stopped |= set(facts["recovery"].start)  # an earlier transaction stopped them; still down (plan.rebind)
    for kind, gid, sid in facts["ha_wait"]:  # HA stopped them and keeps them stopped: not ours to start
        stopped.discard((kind, gid))
        logger.info(f"{host.name}: {'CT' if kind == 'lxc' else 'VM'} {gid} stays stopped: HA resource {sid} requests "
                    f"that; start it with ha-manager set {sid} --state started")

    if spec.containers:
        wanted = {ctid: {"gpus": list(ct.gpus), "gid": ct.gid, "extra": list(ct.extra_devices)}
                  for ctid, ct in spec.containers.items()}
        container_gpu_devices(
            name="guests: container GPU devices", wanted=wanted,
            dev_entries=pve_supports_dev_entries(facts["packages"]),
            hotplug=pve_hotplugs_dev_entries(facts["packages"]), node=node,
            boot_minors=facts["config_minors"] if pending_boot else None,
            start_after=[i for k, i in stopped if k == "lxc"], api=api, shutdown_timeout=timeout,
            ha=facts["ha"],
        )

    pci = hw["pci_devices"]
    status = facts["runtime"]["status"]["qemu"]
    all_pools = gpu_pool_ids(cfg["pci_mappings"], {vm.pool for vm in spec.vms.values() if vm.pool})
    plans = {vmid: plan_vm(vmid, node, [b for b in vm.gpus if b in pci], vm.machine, vm.allow_machine_change,
                           cfg["qemu_configs"].get(vmid), pci, set(spec.gpus), host_phys_bits=host_phys_bits(hw),
                           pool=vm.pool, running=status.get(vmid) == "running", pools=all_pools)
             for vmid, vm in sorted(spec.vms.items())}
    # per-node mappings: VMs without a pool, and pooled VMs that run on theirs until stopped
    vm_gpus = [b for vmid, vm in spec.vms.items() for b in vm.gpus
               if b in pci and (not vm.pool or plans[vmid].per_node_kept)]
    pools: dict[str, list[str]] = {}
    for vm in spec.vms.values():
        if vm.pool:
            pools.setdefault(vm.pool, []).extend(b for b in vm.gpus if b in pci)
    planned_main: dict[int, set[str]] = {}
    if spec.vms:
        stale_pools = plan_stale_pools(node, set(pools), cfg["pci_mappings"])
        for change in stale_pools:
            logger.info(f"{host.name}: {change.reason}")
        changes = plan_mappings(node, vm_gpus, pci, cfg["pci_mappings"]) + \
            plan_pool_mappings(node, pools, pci, cfg["pci_mappings"]) + stale_pools
        if changes:  # issue 19: the previous pci.cfg kept, and --dry shows the diff
            keep_config(name=f"guests: keep {PCI_CFG}", path=PCI_CFG, after=lambda t: pci_cfg_after(t, changes))
        pci_mappings(name="guests: PCI resource mappings", changes=changes, api=api)
        for vmid, plan in plans.items():
            for line in plan.problems:
                logger.warning(f"{host.name}: {line}")
            for line in plan.notes:
                logger.info(f"{host.name}: {line}")
            if cfg["qemu_configs"].get(vmid) is None:
                continue
            vm = spec.vms[vmid]
            planned_main[vmid] = vm_mappings_after(cfg["qemu_configs"][vmid], plan)
            vm_gpus_moving = any(m.bdf in vm.gpus for m in rebind.moves)
            if plan.changed:  # issue 19: the previous VM config kept, and --dry shows the diff
                conf = f"/etc/pve/nodes/{node}/qemu-server/{vmid}.conf"
                keep_config(name=f"guests: keep {conf}", path=conf,
                            after=lambda t, p=plan: vm_config_after(t, p.set_options, p.delete))
            vm_hostpci(name=f"guests: VM {vmid} GPUs", plan=plan,
                       start=("qemu", vmid) in stopped,
                       restart=status.get(vmid) == "running" and not (pending_boot and vm_gpus_moving),
                       node=node, api=api, shutdown_timeout=timeout)
    remove_stale_mappings(spec, node, vm_gpus, cfg["pci_mappings"], planned_main, api, set(pools))
    journal = facts["journal"]
    if journal.exists or (rebind.moves and rebind.live):  # the guests the transaction stopped run again
        close_rebind_journal(name="guests: close the GPU rebind journal", journal=journal,
                             live_rebind=bool(rebind.moves and rebind.live))


def remove_stale_mappings(spec: HostSpec, node: str, vm_gpus: list[str], existing: dict[str, dict],
                          planned_main: dict[int, set[str]], api: PveApi | None, pools: set[str] | None = None) -> None:
    """Delete this node's `pvegpu-*` mappings nothing uses any more (after the VM configs);
    report other mappings that point at the spec's GPUs. The cluster's VM configs are read
    only when there is a candidate (no extra remote command otherwise)."""
    pools = pools or set()
    stale = plan_stale_mappings(node, existing, vm_gpus, {}, set(spec.gpus), candidates_only=True, pools=pools)
    references: dict[str, list[str]] = {}
    if stale.delete:
        references = mapping_references(read_fact(VmMappingReferences), node, planned_main)
        stale = plan_stale_mappings(node, existing, vm_gpus, references, set(spec.gpus), pools=pools)
    for line in stale.notes:
        logger.warning(f"{host.name}: {line}")
    for change in stale.delete:
        logger.info(f"{host.name}: {change.reason}")
    if stale.delete:  # issue 19: the previous pci.cfg kept, and --dry shows the diff
        keep_config(name=f"guests: keep {PCI_CFG}", path=PCI_CFG,
                    after=lambda t: pci_cfg_after(t, stale.delete))
    if stale.delete or any(m.startswith("pvegpu-") for m in existing):
        pci_mappings(name="guests: stale pvegpu PCI mappings", changes=stale.delete, api=api,
                     unchanged="no stale pvegpu PCI mapping")
