"""The one per-host run state: what this run has read from a host and what it has decided about it.

pyinfra 3 keeps no per-run state of ours and its `host.data` hands out copies, so everything a
run remembers about a host lives in ONE object on the host's `Host` (which exists for exactly one
run), created on first use:

- ``facts``: fact readings, ``(module, class, kwargs) -> value`` (`facts.once.fact_once`,
  `facts.once.prefetch`);
- ``guests``: the node's guest run state (`facts.guest_state.guest_state`), None when stale;
- ``memos``: decisions a stage derived from facts and shares with later stages (e.g. the GPU
  stage's bindings and rebind plan, `operations.gpus.stage_facts`), by stage name;
- ``reboot``: reboot reasons the stages report (`need_reboot`), read by the reboot stage;
- ``trial_boot``: the kernel a trial boot selects this run (`record_trial_boot`);
- ``rebooting``: the reboot stage reboots the host this run (then deploy.py has the stages with an
  ``after_reboot`` plan again on the booted host);
- ``handlers``: what the run's slow side effects depend on (`operations.handlers`).

**One rule for when a reading is stale.** Stages read facts while operations are *generated*,
before anything on the host changes (pyinfra generates every operation before it executes the
first), so every reading holds for the whole run, except the guest run state once an operation
*executing* has started or stopped a guest (or rebound GPUs): `guests_changed()` drops it and the
next `guest_state()` reads it again. Facts an operation needs after earlier operations changed the
host are read in that operation, not kept here; while no operation of the run has run a command
on the host (`nothing_executed`), a reading taken up front still holds there too
(`facts.once.fact_unless_changed`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pyinfra import host as current_host
from pyinfra import state as current_state

_ATTR = "_pvegpu_run_state"


@dataclass
class RunState:
    facts: dict[tuple, Any] = field(default_factory=dict)
    guests: dict | None = None
    memos: dict[str, Any] = field(default_factory=dict)
    reboot: list[tuple[str, str]] = field(default_factory=list)
    trial_boot: dict | None = None
    rebooting: bool = False
    handlers: dict[str, Any] = field(default_factory=dict)

    def need_reboot(self, kind: str, detail: str) -> None:
        """A stage found a reason to reboot (reported once, in the order found)."""
        if (kind, detail) not in self.reboot:
            self.reboot.append((kind, detail))

    def guests_changed(self) -> None:
        """An operation is about to start or stop a guest: while executing, the guest reading is
        dropped (while generating, nothing runs: it stays)."""
        if current_state.is_executing:
            self.guests = None


def run_state(host: Any = None) -> RunState:
    """The run state of `host` (default: the host pyinfra is working on), created on first use."""
    h = current_host if host is None else host
    found = getattr(h, _ATTR, None)
    if found is None:
        found = RunState()
        setattr(h, _ATTR, found)
    return found


def nothing_executed(host: Any = None) -> bool:
    """True while no operation of this run has run a command on `host` (default: the current one):
    every operation pyinfra has completed there generated no command (a no-op), so the host is as
    the run's up-front facts read it. pyinfra records each completed operation's commands per host
    (pyinfra/api/operations.py run_host_op -> OperationMeta.set_complete; `executed` = any)."""
    h = current_host if host is None else host
    ops = getattr(current_state, "ops", {}).get(h, {})  # a state that ran nothing (tests) has none
    return not any(data.operation_meta.executed for data in ops.values())


def need_reboot(kind: str, detail: str, host: Any = None) -> None:
    run_state(host).need_reboot(kind, detail)


def reboot_reasons(host: Any = None) -> list[tuple[str, str]]:
    return list(run_state(host).reboot)


def record_trial_boot(release: str, pin_tool: str, esps: bool = False, host: Any = None, **details: Any) -> None:
    """The kernel stage selected `release` for the next boot only (a trial); the reboot stage's
    check after the reboot needs it (`operations.reboot`). `pin_tool`: the loader of the trial
    (plan.kernel.SYSTEMD_BOOT/GRUB); `details`: build_id, advanced_id (plan.kernel.finish_trial_command)."""
    run_state(host).trial_boot = {"release": release, "pin_tool": pin_tool, "esps": esps, **details}


def trial_boot_of(host: Any = None) -> dict | None:
    return run_state(host).trial_boot
