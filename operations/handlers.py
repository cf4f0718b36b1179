"""Side effects once per run, handler style (DESIGN.md §1, "Handlers").

Several stages write files that only take effect once a slow side effect runs: the boot stage's
vfio/nouveau files, the module-options file and the GPU binding rule and hook all need
`update-initramfs -u -k all` (tens of seconds per installed kernel, plus an ESP sync); the boot
stage's command line needs the boot loader refresh (`proxmox-boot-tool refresh` or
`update-grub`). Instead of each stage running it after its own write, a stage *declares*, while
its operations are generated, the files the side effect depends on and why it would be needed:

    handlers.depends_on(INITRAMFS, path, content, mode, changed=<the stage writes it this run>,
                        why="vfio early load changed")

and this stage, run after every other stage and before the reboot policy decides, yields one
operation per handler: `update-initramfs` first, then the refresh (it copies the initrd to the
ESPs). A handler runs when a stage changes one of its files this run, or when its stamp
(/var/lib/pvegpu/<handler>.stamp, the sha256, mode and path of every file it depends on, written
only after the side effect succeeded) records other files than today's: a run that wrote a file
but stopped before or in the side effect retries it next run. A run that changes nothing runs
nothing (no extra remote command: the stamps are read with the stages' facts up front).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from pyinfra import host
from pyinfra.api import StringCommand, deploy, operation

from facts.files import ManagedFiles
from facts.once import fact_once
from facts.run_state import run_state
from operations.files import sha256_text, write_file_command

INITRAMFS = "initramfs"
BOOT_REFRESH = "boot-refresh"
ORDER = (INITRAMFS, BOOT_REFRESH)  # the refresh syncs the (new) initrd to the ESPs: after it
# follows proxmox-kernel-helper src/proxmox-boot/proxmox-boot-sync (initramfs post-update hook): a
# manual update-initramfs already refreshes the ESPs, so BOOT_REFRESH depends on the cmdline only
STAMP_DIR = "/var/lib/pvegpu"
DEFAULT_COMMANDS = {INITRAMFS: "update-initramfs -u -k all", BOOT_REFRESH: "proxmox-boot-tool refresh"}
# Before one handler did it, the GPU binding stage kept its own stamp; the initramfs stamp
# replaces it (removed once the initramfs handler succeeded).
LEGACY_STAMPS = {INITRAMFS: ["/var/lib/pvegpu/gpu-binding-initramfs.stamp"]}


def stamp_path(handler: str) -> str:
    return f"{STAMP_DIR}/{handler}.stamp"


STAMP_PATHS = [stamp_path(h) for h in ORDER]


def _registry(target: Any) -> dict:
    """This run's handler registry (the run state's ``handlers``, `facts.run_state`)."""
    return run_state(target).handlers


def depends_on(handler: str, path: str, content: str, mode: str, changed: bool, why: str,
               command: str | None = None, target: Any = None) -> None:
    """Record that `handler`'s side effect depends on `path` holding `content` with `mode`, and
    that it is needed this run (`why`) when `changed` (the stage's operation writes the file).

    + command: the side effect's command where the stage knows it (the boot loader's refresh)
    """
    if handler not in ORDER:
        raise ValueError(f"pvegpu: unknown handler {handler!r} (one of {', '.join(ORDER)})")
    target = target if target is not None else host
    registry = _registry(target)
    entry = registry.setdefault(handler, {"inputs": {}, "reasons": [], "command": DEFAULT_COMMANDS[handler]})
    entry["inputs"][path] = (sha256_text(content), mode.lstrip("0") or "0")
    if changed and why not in entry["reasons"]:
        entry["reasons"].append(why)
    if command:
        entry["command"] = command


def pending(target: Any = None) -> dict:
    """{handler: {"inputs": {path: (sha256, mode)}, "reasons": [...], "command": str}} (a copy)."""
    return {name: {"inputs": dict(e["inputs"]), "reasons": list(e["reasons"]), "command": e["command"]}
            for name, e in _registry(target if target is not None else host).items()}


def stamp_text(inputs: dict[str, tuple[str, str]]) -> str:
    """What the stamp holds: one `sha256 mode path` line per file, sorted by path."""
    return "".join(f"{sha} {mode} {path}\n" for path, (sha, mode) in sorted(inputs.items()))


def run_command(command: str, stamp: str, stamp_file: str, legacy: Sequence[str] = ()) -> str:
    """The side effect, then (only if it succeeded) its stamp; old stamps go with it."""
    cleanup = "".join(f" && rm -f {shlex.quote(p)}" for p in legacy)
    return f"{command} && {write_file_command(stamp_file, stamp, '644', False)}{cleanup}"


@operation()
def run_handler(handler: str, command: str, stamp: str, reasons: list[str], state: dict | None = None):
    """Run one handler's side effect once, when a stage changed a file it depends on this run or
    its stamp records other files (a previous run did not finish it).

    + handler: INITRAMFS or BOOT_REFRESH
    + command: fixed words (update-initramfs -u -k all, proxmox-boot-tool refresh, update-grub)
    + stamp: `stamp_text` of the files it depends on
    + reasons: why, from the stages (empty: only the stamp can call for it)
    + state: `ManagedFiles` entry of its stamp file
    """
    if not reasons and state and state.get("sha256") == sha256_text(stamp):
        host.noop(f"{handler}: no stage changed what it depends on")
        return
    yield StringCommand(run_command(command, stamp, stamp_path(handler), LEGACY_STAMPS.get(handler, [])))


def prefetch(spec) -> list:
    """The stamps (deploy.py reads every stage's facts in one command)."""
    return [(ManagedFiles, {"paths": STAMP_PATHS})]


def handler_runs(registry: dict, stamps: dict) -> list[dict]:
    """The `run_handler` arguments for each handler a stage declared, in ORDER (pure).

    registry: `pending()`; stamps: `ManagedFiles` of STAMP_PATHS.
    """
    runs = []
    for handler in ORDER:
        entry = registry.get(handler)
        if not entry:
            continue
        stamp = stamp_text(entry["inputs"])
        reasons = list(entry["reasons"])
        state = stamps.get(stamp_path(handler))
        if not reasons and (state or {}).get("sha256") != sha256_text(stamp):
            reasons = [f"{stamp_path(handler)} records other files (a previous run stopped before it)"]
        runs.append({
            "name": f"{entry['command']} once" + (f": {'; '.join(reasons)}" if reasons else ""),
            "handler": handler,
            "command": entry["command"],
            "stamp": stamp,
            "reasons": reasons,
            "state": state,
        })
    return runs


@deploy("pvegpu: side effects once per run")
def apply(spec) -> None:
    registry = pending()
    if not registry:  # no stage declared anything (a stage subset): not even the stamps are read
        return
    for kwargs in handler_runs(registry, fact_once(ManagedFiles, paths=STAMP_PATHS)):
        run_handler(**kwargs)
