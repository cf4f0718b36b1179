"""Stage 8 — NCCL environment (DESIGN.md §2.8; issue 8; INCIDENTS #7).

From the P2P verdict (HardwareProbe), the RDMA devices and the spec, `plan.nccl` gives every
NCCL variable with its reason. This stage logs them (they show in ``--dry``) and writes:

    /etc/nccl.conf                                    on the host (templates/nccl.conf.j2)
    /etc/nccl.conf inside each GPU container          through ``pct exec <ctid> -- sh -c '<atomic write>'``
    /etc/systemd/system/<unit>.d/pvegpu-nccl.conf      ``Environment=`` lines for spec.nccl.services
                                                      (templates/nccl-service-dropin.conf.j2); a
                                                      drop-in of a service no longer listed is removed
and declares the drop-ins to the daemon-reload handler (`operations.handlers`): one
``systemctl daemon-reload`` late in the run when a drop-in changed or went (only where systemd runs).

Containers: their root filesystem is not the host's, so the file goes in through ``pct exec``,
which needs the CT running. A stopped CT is skipped with a logged reason (its file is written on
a run while it runs). A CT whose ``/`` is the host's ``/`` (same device:inode: a ``pct`` that
runs commands on the host itself) is skipped too: writing "its" /etc/nccl.conf would overwrite
the host's.

After a reboot the run takes (`after_reboot`, called by deploy.py): the plan was made from facts
read before the run, when the GPUs may have had no driver (the run built nvidia.ko for the kernel
it boots: a new kernel, the 8 -> 9 upgrade, a driver change) and nvidia-smi listed none of them,
so no pair and no variable (on a SEV-SNP host, incident 7, no NCCL_P2P_DISABLE=1). Once the host
is back, the stage reads its facts again and runs the same operations against them; what already
holds is a no-op.

No-change cost: one remote command (`NcclState`: file states, RDMA list, systemd, drop-ins and
each running GPU CT's file) plus the HardwareProbe, read once per run for every stage (the run
state, `facts.run_state`; pyinfra 3 has no fact cache); the CT run state is this run's
`facts.guest_state.guest_state()` (read by the GPU stage).
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.operations import python

from facts.guest_state import guest_state, running_containers, with_ct_status
from facts.hardware import HardwareProbe, HostConfigProbe
from facts.nccl import DROPIN_NAME, NCCL_CONF, SYSTEMD_DIR, NcclState
from facts.once import fact_once, forget
from facts.run_state import reboot_reasons, run_state
from facts.shell import word
from operations import handlers
from operations.files import absent_file, file_current, managed_file, write_file_command
from plan.nccl import (
    PRECEDENCE,
    custom_allreduce_warnings,
    describe_nccl_environment,
    nccl_conf_lines,
    nccl_plan_for_spec,
    render_nccl_conf,
    unseen_gpus,
    vm_clique_warnings,
)
from plan.render import render_template
from plan.topology_report import verdict_from_hardware
from spec.values import systemd_unit

NCCL_CONF_MODE = "644"

def unit_name(service: str) -> str:
    """The full unit name for a spec entry: ``vllm`` → ``vllm.service`` (as systemctl reads it).

    Raises ValueError for what is not a unit name (a path, ``..``, spaces) — the name becomes a
    directory under /etc/systemd/system. The rules are spec.values.systemd_unit's (the spec
    loader refuses such a name before any connection).
    """
    return systemd_unit(service)


def dropin_path(unit: str) -> str:
    return f"{SYSTEMD_DIR}/{unit}.d/{DROPIN_NAME}"


def systemd_assignment(name: str, value: str) -> str:
    """One ``Environment=`` operand: double-quoted, with ``\\`` and ``"`` escaped and ``%``
    doubled (systemd expands %-specifiers in Environment=; it does not expand ``$``)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
    return f'"{name}={escaped}"'


def render_dropin(unit: str, env: dict[str, dict]) -> str:
    lines = [{"comment": line["comment"], "assignment": systemd_assignment(line["name"], line["value"])}
             for line in nccl_conf_lines(env)]
    return render_template("nccl-service-dropin.conf.j2", path=dropin_path(unit), unit=unit, environment=lines)


# ---------------------------------------------------------------- facts

def nccl_state(paths: list[str], ctids: list[int]) -> dict:
    """`NcclState` of the running CTs of `ctids`, with this run's CT run state added
    (`facts.guest_state.with_ct_status`): no `pct list` of its own. The fact looks into every CT
    of `ctids` (read in the first prefetch round, beside the guest state); only the running ones
    are kept (a stopped CT's init is not found: its entry says nothing)."""
    guests = guest_state()
    found = fact_once(NcclState, **_state_kwargs(paths, ctids))
    running = set(running_containers(guests, ctids))
    return with_ct_status({**found, "containers": {c: v for c, v in found["containers"].items() if c in running}},
                          guests)


def _state_kwargs(paths: list[str], ctids: list[int]) -> dict:
    """`NcclState`'s arguments: the host paths and the CTs of `ctids` (the spec's alone, so the
    stage's facts go in the first prefetch round; `nccl_state` keeps the running ones)."""
    return {"paths": paths, "ctids": sorted(int(c) for c in ctids)}


def hardware_facts(spec) -> dict:
    """The HardwareProbe result: the run's one reading (`fact_once`; deploy.py reads it up front
    with every stage's facts, and the GPU stage reads the same object), not another stage's memo."""
    return fact_once(HardwareProbe)


# ---------------------------------------------------------------- operations

@operation()
def container_nccl_conf(ctid: int, content: str, state: dict, mode: str = NCCL_CONF_MODE):
    """/etc/nccl.conf inside container `ctid`, written through `pct exec` (atomic temp+rename).

    + ctid: the container
    + content: the rendered file
    + state: `nccl_state()` as a whole (run state, host root, the CT's file)
    """
    status = state["status"].get(ctid)
    if not state["pct"]:
        host.noop(f"CT {ctid}: no pct on this host (not a Proxmox VE node); its {NCCL_CONF} is not written")
        return
    if status is None:
        host.noop(f"CT {ctid} does not exist on this node; its {NCCL_CONF} is written once it exists and runs")
        return
    if status != "running":
        host.noop(f"CT {ctid} is {status}: pct exec needs it running, so its {NCCL_CONF} is written by a run while it runs")
        return
    ct = state["containers"].get(ctid) or {}
    if not ct.get("readable"):
        logger.warning(f"{host.name}: CT {ctid}: could not read its {NCCL_CONF} through pct exec; writing it")
    elif ct.get("root") and ct["root"] == state["host_root"]:
        host.noop(f"CT {ctid} shares the host's root filesystem (pct exec runs on the host's /); "
                  f"writing its {NCCL_CONF} would overwrite the host's, so it is skipped")
        return
    current = ct.get("file")
    if file_current(current, content, mode):
        host.noop(f"CT {ctid}: {NCCL_CONF} is up to date")
        return
    script = write_file_command(NCCL_CONF, content, mode)
    yield StringCommand(f"pct exec {word(str(ctid))} -- sh -c {word(script)}")


# ---------------------------------------------------------------- plan → operations

def oldest(versions: list[str] | None) -> str | None:
    """The oldest NCCL found (its default level decides), None when none says its version."""
    return versions[0] if versions else None


def desired(spec, hardware: dict, rdma_devices: list[str], state: dict | None = None,
            qemu_configs: dict | None = None) -> dict:
    """What the stage should write, from facts and spec.

    .. code:: python

        {"plan": <plan.nccl.nccl_plan>, "host": "<nccl.conf text>",
         "containers": {200: "<nccl.conf text>"},
         "dropins": {"/etc/systemd/system/vllm.service.d/pvegpu-nccl.conf": ("vllm.service", "<text>")}}
    """
    roles = {bdf: gpu.role for bdf, gpu in spec.gpus.items()}
    verdict = verdict_from_hardware(hardware, roles)
    topology_nics = (hardware.get("topology") or {}).get("nics")
    # NCCL's default level depends on the CPU vendor (paths.cc: SYS on AMD with at most 2 GPUs)
    cpu_vendor = (hardware.get("cpu") or {}).get("vendor")
    # NCCL's default level also depends on its version: the libraries the NcclState fact found
    state = state or {}
    plan = nccl_plan_for_spec(
        verdict, spec, rdma_devices=rdma_devices, topology_nics=topology_nics, cpu_vendor=cpu_vendor,
        nccl_version=oldest(state.get("nccl_versions")),
        container_versions={str(ctid): oldest(ct.get("nccl_versions"))
                            for ctid, ct in (state.get("containers") or {}).items()})
    dropins = {}
    for service in spec.nccl.services:
        unit = unit_name(service)
        dropins[dropin_path(unit)] = (unit, render_dropin(unit, plan["host"]))
    return {
        "plan": plan,
        "service_warnings": custom_allreduce_warnings(plan["host"], state.get("exec_start") or {}),
        "vm_warnings": vm_clique_warnings(qemu_configs),
        "host": render_nccl_conf(plan["host"], "host"),
        "containers": {int(ctid): render_nccl_conf(env, f"container {ctid}") for ctid, env in plan["containers"].items()},
        "dropins": dropins,
    }


def stage_operations(want: dict, state: dict) -> list[tuple]:
    """The stage's operations as ``(operation, kwargs)`` in order; `apply` calls them."""
    # `{}` for a missing file: managed_file reads ManagedFiles again when given None
    ops: list[tuple] = [(managed_file, dict(name=f"NCCL: {NCCL_CONF}", path=NCCL_CONF, content=want["host"],
                                            mode=NCCL_CONF_MODE, state=state["files"].get(NCCL_CONF) or {}))]
    for ctid, content in sorted(want["containers"].items()):
        ops.append((container_nccl_conf, dict(name=f"NCCL: CT {ctid} {NCCL_CONF}", ctid=ctid,
                                              content=content, state=state)))
    for path, (unit, content) in sorted(want["dropins"].items()):
        ops.append((managed_file, dict(name=f"NCCL: environment of {unit}", path=path, content=content,
                                       mode="644", state=state["files"].get(path) or {})))
    for path in removed_dropins(want, state):
        ops.append((absent_file, dict(name=f"NCCL: remove {path} (service no longer in the spec)",
                                      path=path, state={"present": True})))
    return ops


def removed_dropins(want: dict, state: dict) -> list[str]:
    """Drop-ins on the host for services no longer in the spec."""
    return [path for path in state["dropins"] if path not in want["dropins"]]


def declare_reload(want: dict, state: dict, target=None) -> None:
    """The drop-ins take effect through the daemon-reload handler: each one it depends on, a reason
    for each that changes or goes this run."""
    for path, (unit, content) in sorted(want["dropins"].items()):
        handlers.depends_on(handlers.DAEMON_RELOAD, path, content, "644",
                            changed=not file_current(state["files"].get(path), content, "644"),
                            why=f"NCCL environment of {unit} changed", target=target)
    for path in removed_dropins(want, state):
        handlers.notify(handlers.DAEMON_RELOAD, f"{path} removed", target=target)


def describe(want: dict) -> list[str]:
    """The ``--dry`` lines: every variable per scope, with its reason."""
    lines = []
    scopes = [("host", want["plan"]["host"])] + [(f"CT {ctid}", env) for ctid, env in want["plan"]["containers"].items()]
    for scope, env in scopes:
        if not env:
            lines.append(f"NCCL ({scope}): no variables (profile none, no overrides)")
        lines += [f"NCCL ({scope}): {line}" for line in describe_nccl_environment(env)]
    lines += [f"NCCL: WARNING: {warning}" for warning in want.get("service_warnings") or []]
    lines += [f"NCCL: WARNING: {warning}" for warning in want.get("vm_warnings") or []]
    lines.append(f"NCCL: {PRECEDENCE}")
    return lines


# ---------------------------------------------------------------- stage protocol

def stage_targets(spec) -> tuple[list[int], list[str]]:
    """The CTs (with GPUs) and host paths the stage manages."""
    ctids = sorted(int(ctid) for ctid, ct in spec.containers.items() if ct.gpus)
    return ctids, [NCCL_CONF] + [dropin_path(unit_name(s)) for s in spec.nccl.services]


def prefetch(spec) -> list:
    """The facts this stage reads up front (deploy.py reads every stage's in one command): its
    NcclState too, whose arguments come from the spec alone (`_state_kwargs`)."""
    ctids, paths = stage_targets(spec)
    return [(HardwareProbe, {}), (HostConfigProbe, {}), (NcclState, _state_kwargs(paths, ctids))]


def preflight(spec) -> list[str]:
    refusals = []
    for service in spec.nccl.services:
        try:
            unit_name(service)
        except ValueError as error:
            refusals.append(f"nccl.services: {error}")
    return refusals


@deploy("NCCL environment")
def apply(spec) -> None:
    converge(spec)


def converge(spec, after_reboot: bool = False) -> None:
    """The stage's operations from this run's facts (`apply`), or, `after_reboot`, from facts read
    again on the rebooted host, where every operation runs at once (pyinfra executes an operation
    called while the run executes immediately: api/operation.py execute_immediately)."""
    hardware = hardware_facts(spec)
    ctids, paths = stage_targets(spec)
    state = nccl_state(paths, ctids)
    # the VM configs for `vm_clique_warnings` (the GPU stage's reading of the same probe)
    want = desired(spec, hardware, state["rdma_devices"], state,
                   qemu_configs=(fact_once(HostConfigProbe) or {}).get("qemu_configs"))
    prefix = "after the reboot: " if after_reboot else ""
    unseen = unseen_gpus({bdf: gpu.driver for bdf, gpu in spec.gpus.items()}, hardware.get("nvidia_gpus"))
    if unseen:
        if after_reboot:
            then = "still not listed after the reboot (the host checks say why)"
        elif spec.reboot.allowed and reboot_reasons():
            then = "planned again when this run's reboot is over"
        else:
            then = "converge again once they are on nvidia (after the pending reboot)"
        logger.warning(f"{host.name}: {prefix}NCCL: WARNING: planned without {', '.join(unseen)} (for the nvidia driver, "
                       f"not listed by nvidia-smi now): {then}")
    for line in describe(want):
        (logger.warning if "WARNING:" in line else logger.info)(f"{host.name}: {prefix}{line}")
    for op, kwargs in stage_operations(want, state):
        op(**kwargs)
    if not after_reboot:
        declare_reload(want, state)
        return
    if declare_reload_again(want, state):
        handlers.flush(handlers.DAEMON_RELOAD)


def declare_reload_again(want: dict, state: dict, target=None) -> bool:
    """After the reboot: the end-of-run step already ran the daemon-reload for the reasons declared
    before it; whether this pass needs it again (a drop-in it changes or removes)."""
    handlers.clear_reasons(handlers.DAEMON_RELOAD, target)
    declare_reload(want, state, target)
    return bool(handlers.pending(target).get(handlers.DAEMON_RELOAD, {}).get("reasons"))


def plan_again(spec) -> None:
    """`python.call` target: forget the readings made before the reboot, then converge again."""
    forget(HardwareProbe, NcclState)
    run_state().guests_changed()  # CTs start at boot (onboot) or not: read their state again
    converge(spec, after_reboot=True)


def after_reboot(spec) -> None:
    """deploy.py calls this when the run reboots the host: one operation after the reboot stage's
    that plans the NCCL environment again from the booted host's facts (`plan_again`)."""
    python.call(name="NCCL environment: planned again on the rebooted host", function=plan_again, spec=spec)
