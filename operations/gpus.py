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
  apply: ONE remote script (`set -eu`): stop the running guests that use a moving GPU (a clean
  `qm/pct shutdown --timeout <guests.shutdown_timeout>`, a hard `stop` only when that times
  out) → check holders again → per function: driver_override, unbind (the write runs in the
  background and is abandoned after 30 s: unbind can hang in the kernel on some 595 drivers),
  drivers_probe, verify the new driver. On any failure it prints every moving function's
  current driver and exits non-zero; nothing after it runs. With `proxmox_api` in the spec the
  guests are shut down through the API first (`operations.proxmox`, one FunctionCommand each,
  in the same operation) and the script starts at the holder check. Guests it stopped are
  started by the guests stage, after their configs match the new binding (PVE would otherwise
  rebind a VM's old GPU).

Where sysfs cannot rebind (no real sysfs: the twin's /sys is a rendered tree, where writes to
unbind/bind do nothing), the rebind is persisted only and reported as a reboot reason
("gpu-binding"); the hardware takes the new binding at the next boot. The guests stage then
renders CT device entries for the minors that boot will give (`plan.gpus.boot_minors`).
On a real host the same run rebinds live.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from pyinfra import host, logger
from pyinfra.api import FactBase, StringCommand, deploy, operation

from facts.base import ShellFact
from facts.files import ManagedFiles
from facts.guest_state import (
    GUEST_STATE_COMMAND,
    GuestState,
    guest_state_changes,
    parse_guest_state,
    remember_guest_state,
)
from facts.hardware import HardwareProbe, HostConfigProbe
from facts.kernel import split_sections
from facts.once import fact_once
from facts.proxmox import HaResources, NodeName, PvePackages
from operations import handlers
from operations.files import managed_file, sha256_text
from operations.proxmox import PveApi, api_of, guest_stop_commands, shutdown_shell, wait_stopped_shell
from plan.gpus import (
    Bindings,
    RebindPlan,
    boot_minors,
    desired_bindings,
    holders_of,
    identity_domain_refusals,
    parse_compute_apps,
    parse_fuser,
    plan_rebind,
)
from plan.guest_control import node_refusal, stop_checks
from plan.reboot import need_reboot
from plan.render import render_template
from spec.models import GuestPolicy, HostSpec

RULES_PATH = "/etc/udev/rules.d/60-pvegpu-gpu-binding.rules"
INITRAMFS_HOOK_PATH = "/etc/initramfs-tools/hooks/pvegpu-gpu-binding"
# the stage's files (written in this order): one fact. The initramfs that carries them is rebuilt
# by the INITRAMFS handler, whose stamp records what the last successful update-initramfs put
# there (a run that wrote the rules but failed before or in update-initramfs retries it next run).
STAGE_FILES = [RULES_PATH, INITRAMFS_HOOK_PATH]
UNBIND_TIMEOUT_S = 30
SHUTDOWN_TIMEOUT_S: int = GuestPolicy.model_fields["shutdown_timeout"].default  # the one default: the model's
_MEMO = "_pvegpu_gpu_stage"


# ---------------------------------------------------------------- stage-local facts


def parse_guest_runtime(lines: list[str]) -> dict:
    """Output of `GuestRuntime.command` → ``{"sysfs_live": True, "status": {"pct": True, "lxc":
    {200: "running"}, "qemu": {300: "stopped"}}}`` ("status": a `facts.guest_state.GuestState`)."""
    sysfs = [line.strip() for line in split_sections(lines).get("sysfs", [])]
    return {"sysfs_live": sysfs[:1] == ["sysfs"], "status": parse_guest_state(lines)}


class GuestRuntime(ShellFact):
    """
    Whether /sys can rebind devices live, and which guests run (`GuestState` in the same command;
    `stage_facts` keeps it as this run's `facts.guest_state.guest_state()`).

    .. code:: python

        {"sysfs_live": True, "status": {"pct": True, "lxc": {200: "running"}, "qemu": {300: "stopped"}}}
    """

    command = f"echo '@@ sysfs'; stat -f -c %T /sys 2>/dev/null; {GUEST_STATE_COMMAND}; true"

    @staticmethod
    def default() -> dict:
        return {"sysfs_live": False, "status": GuestState.default()}

    def process(self, output):
        return parse_guest_runtime(list(output))


class GpuHolders(FactBase):
    """
    Processes holding GPUs: nvidia-smi compute apps (any GPU it sees) and `fuser -v` on the
    given /dev/nvidiaN nodes.

    .. code:: python

        {"compute_apps": {"0000:81:00.0": ["python3 (pid 4242)"]},
         "fuser": {"/dev/nvidia0": ["nvidia-persistenced (pid 812)"]}}
    """

    def command(self, nodes):
        fuser = f"fuser -v {' '.join(shlex.quote(n) for n in nodes)} 2>&1" if nodes else "true"
        return ("echo '@@ apps'; nvidia-smi --query-compute-apps=gpu_bus_id,pid,process_name "
                f"--format=csv,noheader 2>/dev/null; echo '@@ fuser'; {fuser}; true")

    @staticmethod
    def default() -> dict:
        return {"compute_apps": {}, "fuser": {}}

    def process(self, output):
        sections: dict[str, list[str]] = {"apps": [], "fuser": []}
        current = None
        for line in output:
            if line.strip() in ("@@ apps", "@@ fuser"):
                current = sections[line.strip()[3:]]
            elif current is not None:
                current.append(line)
        return {"compute_apps": parse_compute_apps(sections["apps"]), "fuser": parse_fuser(sections["fuser"])}


# ---------------------------------------------------------------- facts + plan, once per run


def stage_facts(spec: HostSpec) -> dict:
    """Facts and decisions of stages 6 and 7, read once per run (pyinfra 3 has no fact cache).

    .. code:: python

        {"hw": <HardwareProbe>, "cfg": <HostConfigProbe>, "runtime": <GuestRuntime>,
         "node": "kpro6", "bindings": Bindings, "rebind": RebindPlan, "holders": {bdf: [..]},
         "config_minors": {bdf: minor},   # minors the guest configs must use
         "host_node": "kpro6", "packages": <PvePackages>, "ha": <HaResources>,
         "stop_refusals": [..], "ha_wait": [("qemu", 300, "vm:300")]}   # plan.guest_control
    """
    memo = host.data.get(_MEMO)
    if memo is not None:
        return memo
    hw = fact_once(HardwareProbe)
    cfg = fact_once(HostConfigProbe)
    runtime = fact_once(GuestRuntime)
    remember_guest_state(runtime["status"])  # the run's guest state: no stage reads pct/qm list again
    host_node = fact_once(NodeName)  # Proxmox's node name: the host's, not the spec's
    node = host_node or spec.node or host.data.get("pvegpu_node") or host.name
    pci = hw["pci_devices"]
    bindings = desired_bindings(spec, pci)
    rebind = plan_rebind(spec, node, bindings, pci, hw["nvidia_gpus"], cfg["lxc_configs"], cfg["qemu_configs"],
                         cfg["pci_mappings"], runtime["status"], runtime["sysfs_live"])
    holders: dict[str, list[str]] = {}
    if rebind.moves:
        nodes = sorted({f"/dev/nvidia{hw['nvidia_gpus'][m.bdf]['minor']}" for m in rebind.moves
                        if hw["nvidia_gpus"].get(m.bdf, {}).get("minor") is not None})
        found = host.get_fact(GpuHolders, nodes=nodes)
        holders = holders_of([m.bdf for m in rebind.moves], hw["nvidia_gpus"], found["compute_apps"], found["fuser"])
    if rebind.moves and not rebind.live:
        config_minors = boot_minors(bindings, pci)
    else:
        config_minors = {b: g["minor"] for b, g in hw["nvidia_gpus"].items() if g.get("minor") is not None}
    ha = fact_once(HaResources)
    stop_refusals, ha_wait = stop_checks(rebind.stop, cfg["lxc_configs"], cfg["qemu_configs"], ha)
    memo = {"hw": hw, "cfg": cfg, "runtime": runtime, "node": node, "bindings": bindings,
            "rebind": rebind, "holders": holders, "config_minors": config_minors,
            "host_node": host_node, "packages": fact_once(PvePackages), "ha": ha,
            "stop_refusals": stop_refusals, "ha_wait": ha_wait}
    setattr(host.data, _MEMO, memo)
    return memo


def binding_rules(bindings: Bindings) -> str:
    """The udev rule file (only functions with a driver; 'leave unbound' gets no line)."""
    return render_template("gpu-binding.rules.j2",
                           bindings=[(b, d) for b, d in sorted(bindings.drivers.items()) if d])


# ---------------------------------------------------------------- the rebind transaction


def rebind_script(plan: RebindPlan, nvidia: dict[str, dict], timeout_s: int = UNBIND_TIMEOUT_S,
                  sysfs: str = "/sys", stop_guests: bool = True, shutdown_timeout: int = SHUTDOWN_TIMEOUT_S,
                  ha_wait: Sequence[tuple[str, int, str]] = ()) -> str:
    """The one shell script of a runtime rebind (see module docstring). Every value quoted;
    `sysfs` is a parameter so tests can run the script against a scratch tree; `stop_guests`
    False when the guests were stopped through the API before it; `ha_wait`: HA resources HA
    is stopping (`plan.guest_control.stop_checks`): not shut down here, waited for."""
    q = shlex.quote
    bdfs = " ".join(q(m.bdf) for m in plan.moves)
    lines = [
        "set -eu",
        f"S={q(sysfs)}",
        f"report() {{ for b in {bdfs}; do d=$(readlink \"$S/bus/pci/devices/$b/driver\" 2>/dev/null || true); "
        'echo "pvegpu: $b is bound to ${d##*/}" >&2; done; }',
        'fail() { echo "pvegpu: rebind stopped: $1" >&2; report; exit 1; }',
        # A write to unbind can block in the kernel: run it in the background, detached from our
        # output (a stuck writer must not keep the SSH channel open), and give up after the timeout.
        f'sysfs_write() {{ ( echo "$2" > "$1" ) </dev/null >/dev/null 2>&1 & p=$!; n=0; while kill -0 $p 2>/dev/null; do '
        f'n=$((n+1)); [ $n -le {timeout_s * 10} ] || fail "writing $2 to $1 did not finish in {timeout_s} s '
        f'(pid $p is stuck in the kernel)"; sleep 0.1; done; wait $p || fail "writing $2 to $1 failed"; }}',
    ]
    waiting = {(kind, gid): sid for kind, gid, sid in ha_wait}
    for kind, gid in (plan.stop if stop_guests else []):
        if (kind, gid) not in waiting:
            lines.append(f"{shutdown_shell(kind, gid, shutdown_timeout)} || fail {q(f'could not stop {kind} {gid}')}")
    for (kind, gid), sid in waiting.items():
        lines.append(f"{wait_stopped_shell(kind, gid, shutdown_timeout)} || fail "
                     + q(f"{'CT' if kind == 'lxc' else 'VM'} {gid} is still running: HA resource {sid} did not stop "
                         f"it within {shutdown_timeout} s (ha-manager status; or take it out of HA: "
                         f"ha-manager remove {sid})"))
    nodes = [f"/dev/nvidia{nvidia[m.bdf]['minor']}" for m in plan.moves
             if nvidia.get(m.bdf, {}).get("minor") is not None]
    for node in nodes:
        lines.append(f"if fuser -s {q(node)} 2>/dev/null; then fail \"{node} is held: "
                     f"$(fuser -v {q(node)} 2>&1 | tail -n +2 | tr -s ' ' | tr '\\n' ';')\"; fi")
    for m in plan.moves:
        lines.append(
            f"h=$(nvidia-smi --query-compute-apps=gpu_bus_id,pid,process_name --format=csv,noheader 2>/dev/null "
            f"| grep -i {q(m.bdf[5:])} || true); [ -z \"$h\" ] || fail \"{m.bdf} is held by: $h\"")
    for m in plan.moves:
        dev = f"$S/bus/pci/devices/{m.bdf}"
        if m.wanted:
            lines.append(f"modprobe {q(m.wanted.replace('-', '_'))} || fail {q(f'cannot load {m.wanted}')}")
        # "none" names no driver: a function meant to stay unbound is never probed again
        lines.append(f"sysfs_write \"{dev}/driver_override\" {q(m.wanted or 'none')}")
        if m.current:
            lines.append(f"sysfs_write \"$S/bus/pci/drivers/\"{q(m.current)}/unbind {q(m.bdf)}")
        if m.wanted:
            lines.append(f"sysfs_write \"$S/bus/pci/drivers_probe\" {q(m.bdf)}")
        want = m.wanted or ""
        expected = m.wanted or "no driver"
        lines.append(f"d=$(readlink \"{dev}/driver\" 2>/dev/null || true); [ \"${{d##*/}}\" = {q(want)} ] "
                     f"|| fail {q(f'{m.bdf} is not bound to {expected} after the rebind')}")
    lines.append("report")
    return "\n".join(lines) + "\n"


@operation()
def rebind_gpus(plan: RebindPlan, nvidia: dict[str, dict], api: PveApi | None = None,
                shutdown_timeout: int = SHUTDOWN_TIMEOUT_S, ha_wait: list | None = None):
    """Run the rebind transaction for `plan.moves` (one remote command; with `api`, a guest
    shutdown through the Proxmox API before it for each guest in `plan.stop`).

    + plan: `plan.gpus.RebindPlan` (live)
    + nvidia: `NvidiaGpus` fact (minors of the GPUs leaving nvidia)
    + api: `operations.proxmox.PveApi`, or None to stop guests with qm/pct in the script
    + shutdown_timeout: seconds a guest gets to shut down before it is stopped hard
    + ha_wait: ``[("qemu", 300, "vm:300")]`` HA resources HA is stopping: waited for, not shut down
    """
    if not plan.moves:
        host.noop("every GPU is bound to the driver its role needs")
        return
    guest_state_changes()  # it stops guests (through the API or in the script)
    waiting = {(kind, gid) for kind, gid, _ in ha_wait or []}
    if api is not None:
        for kind, gid in plan.stop:
            if (kind, gid) not in waiting:
                yield from guest_stop_commands(api, kind, gid, shutdown_timeout)
    script = rebind_script(plan, nvidia, stop_guests=api is None, shutdown_timeout=shutdown_timeout,
                           ha_wait=list(ha_wait or []))
    yield StringCommand("sh", "-c", shlex.quote(script))


# ---------------------------------------------------------------- stage protocol


def stage_fact_requests() -> list:
    """What `stage_facts` reads up front (the guests and NCCL stages read it too)."""
    return [(HardwareProbe, {}), (HostConfigProbe, {}), (GuestRuntime, {}), (NodeName, {}), (PvePackages, {}),
            (HaResources, {})]


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
    for line in rebind.dry_lines():
        logger.info(f"{host.name}: {line}")
    files = {
        RULES_PATH: (binding_rules(bindings), "644"),
        INITRAMFS_HOOK_PATH: (render_template("initramfs-gpu-binding-hook.j2", rules_path=RULES_PATH), "755"),
    }
    state = fact_once(ManagedFiles, paths=STAGE_FILES)
    for path, (content, mode) in files.items():
        managed_file(name=f"GPU binding: {path}", path=path, content=content, mode=mode, state=state.get(path))
        current = state.get(path) or {}
        handlers.depends_on(handlers.INITRAMFS, path, content, mode,
                            changed=(current.get("sha256"), current.get("mode")) != (sha256_text(content), mode),
                            why=f"{path} changed (GPU binding)")
    if rebind.moves and rebind.live:
        rebind_gpus(name="GPU binding: rebind transaction", plan=rebind, nvidia=facts["hw"]["nvidia_gpus"],
                    api=api_of(spec, facts["node"]), shutdown_timeout=spec.guests.shutdown_timeout,
                    ha_wait=facts["ha_wait"])
    elif rebind.moves:
        for m in rebind.moves:
            need_reboot(host, "gpu-binding", f"{m} (persisted; this host cannot rebind through /sys now)")
