"""pvegpu entry point: converge a Proxmox VE GPU host to its spec.

    pyinfra inventories/kpro6.py deploy.py --dry    # preview
    pyinfra inventories/kpro6.py deploy.py          # converge

Flow (DESIGN.md section 1): the spec was validated when the inventory loaded (spec.load),
before any connection. Here, per host: take the host's run lock (operations/runlock.py; another
live run stops this one), print a plan summary, run every stage's `preflight`
(read-only checks over facts; any refusal stops the run before a single change), then each
stage's `apply` in the order of DESIGN.md section 2 (`operations.STAGES`); last, the run's objects
are frozen for the garbage collector (compat/gc_after_planning.py). A stage module that cannot be
found stops the run before anything is read (`operations.load_stages`): a typo must not silently
drop a stage.

Stage protocol (one module per concern under operations/):
    prefetch(spec) -> [(fact, kwargs)]  # facts it reads up front (all stages': one command); optional
    prefetch_apply(spec) -> [(fact, kwargs)]  # same, after the preflights (may use their facts); optional
    preflight(spec) -> list[str]   # refusals, in words; optional
    apply(spec) -> None            # yields pyinfra operations; reports reboot reasons via plan.reboot
                                   # and what a slow side effect (update-initramfs, the boot loader
                                   # refresh) depends on via operations.handlers (run once, late)
    after_reboot(spec) -> None     # when the run reboots the host: operations after the reboot that
                                   # plan again from the booted host's facts; optional
"""

from pyinfra import host, logger
from pyinfra.api.exceptions import DeployError

from compat.gc_after_planning import keep_planned_objects
from compat.jinja_cache import use_template_cache
from compat.pyinfra_speedups import install as install_speedups
from compat.ssh_socket import send_at_once
from compat.terminal_output import install as escape_command_output
from facts.once import prefetch
from facts.run_state import run_state
from operations import MissingStage, load_stages, run_stages, runlock, upgrade
from operations.backup import is_dry, show_dry_diffs
from plan.render import template_environment
from plan.summary import spec_summary

install_speedups()  # pyinfra's operation order without reading source per frame (same order)
use_template_cache(template_environment())  # compiled templates kept between runs (compat/jinja_cache.py)
escape_command_output()  # a command's output pyinfra prints has its control characters escaped (compat/terminal_output.py)

spec = host.data.get("pvegpu_spec")
if spec is None:
    raise DeployError(
        f"pvegpu: host {host.name} has no spec (host data 'pvegpu_spec'); "
        "use an inventory from inventories/ that loads a .yml spec"
    )

# This host's SSH requests go out at once instead of behind TCP's Nagle algorithm (each channel
# of a command opened ~40 ms late: compat/ssh_socket.py)
send_at_once(host)

# One run per host at a time (operations/runlock.py): the lock's keeper starts on the host now and
# takes the lock while the stages load here (nothing of the host is read before `hold`).
runlock.begin(host)
try:
    stages = load_stages()
except BaseException as e:
    runlock.abandon(host)
    if isinstance(e, MissingStage):
        raise DeployError(str(e)) from None
    raise

# A live holder stops this run here, before anything is read or changed; a dead one is reported
# as stale and taken over.
runlock.hold(host, logger.warning)

for line in spec_summary(host.name, spec):
    logger.info(line)

# Every stage's up-front facts in one remote command (facts.once.prefetch); the stages then
# find them with fact_once instead of one round trip each.
prefetch([request for _, module in stages if hasattr(module, "prefetch") for request in module.prefetch(spec)]
         + upgrade.prefetch(spec))

# what belongs to the other Debian release than the host's (operations/upgrade.py, plan/releases.py)
refusals = [f"[release] {r}" for r in upgrade.preflight(spec)]
for name, module in stages:
    if hasattr(module, "preflight"):
        refusals += [f"[{name}] {r}" for r in module.preflight(spec)]
# proxmox_ve: 9: what to fix before the 8 -> 9 upgrade and what is due after it (read-only; operations/upgrade.py)
for line in upgrade.report(spec):
    logger.warning(f"{host.name}: {line}")

# proxmox_ve_upgrade: perform (operations/upgrade.py): a failed earlier upgrade, or the upgrade's
# preflight on a host still on 8, refuses here like any stage
refusals += [f"[upgrade] {r}" for r in upgrade.perform_preflight(spec)]
if refusals:
    raise DeployError(
        f"pvegpu preflight refused host {host.name}; nothing was changed:\n  - " + "\n  - ".join(refusals)
    )
# an upgrade job that runs: reported, and nothing else is changed on this host while it runs; a
# node of a cluster whose upgrade would start now waits while another node is in its upgrade, or
# another starts its own in this run (one node at a time; turn_wait claims the turn). Either
# stops this host only: the other hosts of the run go on (upgrade.stop_host)
upgrade_stops = upgrade.running(spec)
if not upgrade_stops:
    upgrade_waits = upgrade.turn_wait(spec)
    upgrade_stops = upgrade_waits and f"{upgrade_waits}; nothing was changed on {host.name}"
if upgrade_stops:
    upgrade.stop_host(f"pvegpu: host {host.name}: {upgrade_stops}")
elif upgrade.starts(spec):
    # the preflight passed: back up, start the upgrade detached; the converge waits for the next run
    upgrade.start(spec)
    if is_dry():
        logger.warning(f"{host.name}: the preflight of the Proxmox VE 8 -> 9 upgrade passed; a run without --dry "
                       "starts it (proxmox_ve_upgrade: perform)")
    else:
        logger.warning(f"{host.name}: the Proxmox VE 8 -> 9 upgrade starts detached on the host; run again to "
                       "follow it, and once it is done the run converges the host on 9")
else:
    upgrade.after_upgrade(spec)  # a finished upgrade: the reboot into 9's kernel is due

    # What the applies read once the run's state is known (e.g. which CTs run): one more command.
    prefetch([request for _, module in stages if hasattr(module, "prefetch_apply")
              for request in module.prefetch_apply(spec)])

    run_stages(host, stages, "apply", spec)  # each stage's operations apart from the others' (operations.run_stages)

    # The reboot stage reboots the host this run: a stage whose plan reads what a boot changes (the GPUs
    # on their driver, the topology nvidia-smi reports) plans again once the host is back.
    if run_state().rebooting:
        run_stages(host, stages, "after_reboot", spec)

    # the GPU guests the 8 -> 9 upgrade's start stopped: started again once the host runs 9's kernel
    upgrade.restart_guests(spec)
    # on 9's kernel after the upgrade: its host checks, once; passed, the next node of its cluster may
    # start, and the GPU guests moved away for it (reboot.guests: migrate) come back
    upgrade.restore_moved(spec, upgrade.confirm(spec))

# --dry: every file and Proxmox config that would change, as a unified diff (operations/backup.py)
if is_dry():
    show_dry_diffs()

# The run's Python objects are all made: the garbage collector leaves them alone from here on
# (compat.gc_after_planning). Saves the final collections at exit (~0.1 s of a no-change run).
keep_planned_objects()
