"""Stage 7, guests: CT device entries, VM PCI mappings and hostpci lines, guest restarts.

Containers: `/etc/pve/lxc/<ctid>.conf` gets the device lines for exactly its GPUs
(`plan.guests`); root writes the file directly (raw `lxc.*` keys cannot go through the API),
atomically (`operations.files.write_file_command`). The CT operation reads its facts (all CT
configs, NVIDIA minors, char majors, run state: one command) when it runs — i.e. after the
GPU stage's rebind transaction — because minors shift when GPUs change driver. While a
rebind waits for the next boot, it uses the minors that boot will give
(`plan.gpus.boot_minors`). A running CT is restarted (pct stop + pct start) only when its set
of GPU nodes changed and those nodes exist now; CTs the rebind stopped are started again.

VMs: PCI resource mappings through `pvesh create|set /cluster/mapping/pci` (stale entries
corrected from the hardware facts), hostpci lines through `qm set`; VMs the rebind stopped
are started after their config matches, and a running VM whose GPUs changed is restarted
(only when its GPUs are on vfio-pci now, not when that waits for a boot).
"""

from __future__ import annotations

import re
import shlex

from pyinfra import host, logger
from pyinfra.api import FactBase, StringCommand, deploy, operation

from facts.devices import CharDeviceMajors, parse_char_majors
from facts.nvidia import NvidiaGpus, parse_gpu_information
from operations.files import write_file_command
from operations.gpus import parse_guest_state, stage_facts
from plan.guests import (
    config_gpu_nodes,
    map_string,
    merge_container_config,
    nvidia_majors,
    plan_mappings,
    plan_vm,
    pve_supports_dev_entries,
    render_container_devices,
    used_dev_indices,
)
from spec.models import HostSpec

LXC_DIR = "/etc/pve/lxc"
DEFAULT_GID = 44  # group_data/all.py PVEGPU_DEVICE_GID


def parse_container_state(lines: list[str]) -> dict:
    """`ContainerGpuState` output → ``{"configs": {200: "<raw text>"}, "nvidia": <NvidiaGpus>,
    "majors": <CharDeviceMajors>, "status": {200: "running"}}``."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        marker = re.match(r"^@@pvegpu (\S+)$", line)
        if marker:
            current = sections.setdefault(marker.group(1), [])
        elif current is not None:
            current.append(line)
    configs = {}
    for name, body in sections.items():
        m = re.match(r"^conf:.*/(\d+)\.conf$", name)
        if m:
            configs[int(m.group(1))] = "\n".join(body) + "\n" if body else ""
    status = parse_guest_state(["@@ pct", *sections.get("pct", [])])["status"]["lxc"]
    return {"configs": dict(sorted(configs.items())),
            "nvidia": parse_gpu_information(sections.get("nvidia", [])),
            "majors": parse_char_majors(sections.get("majors", [])),
            "status": status}


class ContainerGpuState(FactBase):
    """
    Raw CT configs, NVIDIA minors, char majors and CT run state, in one command.

    .. code:: python

        {"configs": {200: "arch: amd64\\n..."}, "nvidia": {"0000:01:00.0": {"minor": 0, ...}},
         "majors": {"nvidia": 195, "nvidia-uvm": 511, ...}, "status": {200: "running"}}
    """

    command = (
        f'for f in {LXC_DIR}/*.conf; do [ -r "$f" ] && {{ echo "@@pvegpu conf:$f"; cat "$f"; }}; done; '
        f"echo '@@pvegpu nvidia'; {NvidiaGpus.command}; "
        f"echo '@@pvegpu majors'; {CharDeviceMajors.command}; "
        "echo '@@pvegpu pct'; pct list 2>/dev/null; true"
    )

    @staticmethod
    def default() -> dict:
        return {"configs": {}, "nvidia": {}, "majors": {}, "status": {}}

    def process(self, output):
        return parse_container_state(output)


@operation()
def container_gpu_devices(wanted: dict[int, dict], dev_entries: bool, boot_minors: dict[str, int] | None = None,
                          start_after: list[int] | None = None):
    """Give each CT the device lines of exactly its GPUs; restart/start CTs as needed.

    + wanted: ``{200: {"gpus": ["0000:01:00.0"], "gid": 44}}``
    + dev_entries: PVE >= 8.1 `devN:` syntax, else raw `lxc.*` lines
    + boot_minors: minors to use while a rebind waits for a reboot (no restarts then)
    + start_after: CTs the rebind transaction stopped (started again here)
    """
    state = host.get_fact(ContainerGpuState)
    live_minors = {b: g["minor"] for b, g in state["nvidia"].items() if g.get("minor") is not None}
    minors = boot_minors if boot_minors is not None else live_minors
    majors = state["majors"]
    start_after = set(start_after or [])
    changed_any = False
    for ctid, want in sorted(wanted.items()):
        text = state["configs"].get(ctid)
        if text is None:
            logger.warning(f"{host.name}: CT {ctid} does not exist on this node; create it, then re-run")
            continue
        devices = render_container_devices(ctid, want["gpus"], minors, majors, dev_entries, want["gid"],
                                           used_dev_indices(text, nvidia_majors(majors)))
        for problem in devices.problems:
            logger.warning(f"{host.name}: {problem}")
        merged = merge_container_config(text, devices.lines, majors)
        running = state["status"].get(ctid) == "running"
        if merged.changed:
            changed_any = True
            # /etc/pve is pmxcfs (cluster-replicated): no .pvegpu-prev copies next to the config
            yield StringCommand(write_file_command(f"{LXC_DIR}/{ctid}.conf", merged.text, "640", keep_previous=False))
        nodes_changed = config_gpu_nodes(text) != config_gpu_nodes(merged.text)
        q = shlex.quote(str(ctid))
        if ctid in start_after and not running:
            changed_any = True
            yield f"pct start {q}"
        elif running and nodes_changed:
            if boot_minors is not None:
                logger.info(f"{host.name}: CT {ctid} gets its new GPUs at the pending reboot")
            elif devices.problems:
                logger.warning(f"{host.name}: CT {ctid} keeps running: its device set is incomplete")
            else:
                changed_any = True
                yield f"pct stop {q} && pct start {q}"
    if not changed_any:
        host.noop("every container passes exactly its GPUs")


@operation()
def pci_mappings(changes: list):
    """Create or correct PCI resource mappings (`plan.guests.MappingChange` list)."""
    if not changes:
        host.noop("PCI resource mappings match the hardware")
        return
    for change in changes:
        maps = " ".join(f"--map {shlex.quote(map_string(m))}" for m in change.maps)
        mid = shlex.quote(change.id)
        if change.action == "create":
            yield f"pvesh create /cluster/mapping/pci --id {mid} {maps}"
        else:
            yield f"pvesh set /cluster/mapping/pci/{mid} {maps}"


@operation()
def vm_hostpci(plan, start: bool = False, restart: bool = False):
    """Apply one VM's hostpci/machine changes (`plan.guests.VmPlan`) and start or restart it.

    + start: the rebind transaction stopped this VM; start it after the config is right
    + restart: the VM runs and its GPUs changed (and the new ones are on vfio-pci now)
    """
    q = shlex.quote(str(plan.vmid))
    if plan.changed:
        opts = " ".join(f"--{k} {shlex.quote(v)}" for k, v in plan.set_options.items())
        delete = f" --delete {shlex.quote(','.join(plan.delete))}" if plan.delete else ""
        yield f"qm set {q} {opts}{delete}".replace("  ", " ")
    if start:
        yield f"qm start {q}"
    elif restart and plan.changed:
        yield f"qm stop {q} && qm start {q}"
    if not plan.changed and not start:
        host.noop(f"VM {plan.vmid} passes exactly its GPUs")


# ---------------------------------------------------------------- stage protocol


def preflight(spec: HostSpec) -> list[str]:
    return []  # guest problems are reported while applying; the GPU stage refuses unsafe moves


@deploy("guests")
def apply(spec: HostSpec) -> None:
    if not spec.containers and not spec.vms:
        return
    facts = stage_facts(spec)
    hw, cfg, rebind, node = facts["hw"], facts["cfg"], facts["rebind"], facts["node"]
    pending_boot = bool(rebind.moves) and not rebind.live
    stopped = {(k, i) for k, i in rebind.stop}
    default_gid = host.data.get("PVEGPU_DEVICE_GID") or DEFAULT_GID

    if spec.containers:
        wanted = {ctid: {"gpus": list(ct.gpus), "gid": ct.gid if ct.gid is not None else default_gid}
                  for ctid, ct in spec.containers.items()}
        container_gpu_devices(
            name="guests: container GPU devices", wanted=wanted,
            dev_entries=pve_supports_dev_entries(cfg["pve_version"]),
            boot_minors=facts["config_minors"] if pending_boot else None,
            start_after=[i for k, i in stopped if k == "lxc"],
        )

    if spec.vms:
        pci = hw["pci_devices"]
        vm_gpus = [b for vm in spec.vms.values() for b in vm.gpus if b in pci]
        pci_mappings(name="guests: PCI resource mappings",
                     changes=plan_mappings(node, vm_gpus, pci, cfg["pci_mappings"]))
        status = facts["runtime"]["status"]["qemu"]
        for vmid, vm in sorted(spec.vms.items()):
            plan = plan_vm(vmid, node, [b for b in vm.gpus if b in pci], vm.machine, vm.allow_machine_change,
                           cfg["qemu_configs"].get(vmid), pci, set(spec.gpus))
            for line in plan.problems:
                logger.warning(f"{host.name}: {line}")
            for line in plan.notes:
                logger.info(f"{host.name}: {line}")
            if cfg["qemu_configs"].get(vmid) is None:
                continue
            vm_gpus_moving = any(m.bdf in vm.gpus for m in rebind.moves)
            vm_hostpci(name=f"guests: VM {vmid} GPUs", plan=plan,
                       start=("qemu", vmid) in stopped,
                       restart=status.get(vmid) == "running" and not (pending_boot and vm_gpus_moving))
