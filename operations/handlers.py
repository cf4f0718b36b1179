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

Four handlers, run in this order: `depmod` (the NVIDIA stage's installed modules, per release;
before the initramfs, whose hooks resolve modules through modules.dep), `update-initramfs`, the
boot loader refresh (it copies the new initrd to the ESPs), `systemctl daemon-reload` (unit files
and drop-ins the module-options, NVIDIA and NCCL stages write; only where systemd runs). A stage
whose own later step needs a side effect at once flushes it (`flush`): the NVIDIA stage runs
`depmod` for all its releases in one operation before its version check reads the module index,
and the end-of-run step does not run it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyinfra import host
from pyinfra.api import StringCommand, deploy, operation

from facts.files import ManagedFiles
from facts.once import fact_once
from facts.run_state import run_state
from facts.shell import operands, word
from operations.files import sha256_text, write_file_command
from plan.render import PUBLIC, root_dir_function

DEPMOD = "depmod"
INITRAMFS = "initramfs"
BOOT_REFRESH = "boot-refresh"
DAEMON_RELOAD = "daemon-reload"
# depmod first: initramfs-tools (bookworm) hook-functions manual_add_modules finds each module and
# its dependencies with `modprobe --set-version=<rel> --show-depends`, i.e. that release's modules.dep
ORDER = (DEPMOD, INITRAMFS, BOOT_REFRESH, DAEMON_RELOAD)  # the refresh syncs the (new) initrd to the ESPs: after it
# follows proxmox-kernel-helper src/proxmox-boot/proxmox-boot-sync (initramfs post-update hook): a
# manual update-initramfs already refreshes the ESPs, so BOOT_REFRESH depends on the cmdline only
STAMP_DIR = "/var/lib/pvegpu"
# systemd's sd_booted() test (src/libsystemd/sd-daemon/sd-daemon.c): /run/systemd/system exists
# only where systemd is PID 1; elsewhere units read their files when systemd starts
SYSTEMD_RELOAD = "if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi"
DEFAULT_COMMANDS = {DEPMOD: "depmod", INITRAMFS: "update-initramfs -u -k all",
                    BOOT_REFRESH: "proxmox-boot-tool refresh", DAEMON_RELOAD: SYSTEMD_RELOAD}
LABELS = {DAEMON_RELOAD: "systemctl daemon-reload"}  # the operation's name where the command is long
MODULES_ROOT = "/lib/modules/"
# Before one handler did it, the GPU binding stage kept its own stamp; the initramfs stamp
# replaces it (removed once the initramfs handler succeeded).
LEGACY_STAMPS = {INITRAMFS: ["/var/lib/pvegpu/gpu-binding-initramfs.stamp"]}


def stamp_path(handler: str) -> str:
    return f"{STAMP_DIR}/{handler}.stamp"


STAMP_PATHS = [stamp_path(h) for h in ORDER]


def _registry(target: Any) -> dict:
    """This run's handler registry (the run state's ``handlers``, `facts.run_state`)."""
    return run_state(target).handlers


def _entry(handler: str, target: Any) -> dict:
    """This run's registry entry of `handler` (created on first use); an unknown name is refused."""
    if handler not in ORDER:
        raise ValueError(f"pvegpu: unknown handler {handler!r} (one of {', '.join(ORDER)})")
    registry = _registry(target if target is not None else host)
    return registry.setdefault(handler, {"inputs": {}, "reasons": [], "command": DEFAULT_COMMANDS[handler]})


def depends_on(handler: str, path: str, content: str, mode: str, changed: bool, why: str,
               command: str | None = None, target: Any = None) -> None:
    """Record that `handler`'s side effect depends on `path` holding `content` with `mode`, and
    that it is needed this run (`why`) when `changed` (the stage's operation writes the file).

    + command: the side effect's command where the stage knows it (the boot loader's refresh)
    """
    entry = _entry(handler, target)
    entry["inputs"][path] = (sha256_text(content), mode.lstrip("0") or "0")
    if changed:
        notify(handler, why, target)
    if command:
        entry["command"] = command


def notify(handler: str, why: str, target: Any = None) -> None:
    """A reason for `handler` without a file it depends on (a file the stage removes: the stamp
    records the files that stay)."""
    reasons = _entry(handler, target)["reasons"]
    if why not in reasons:
        reasons.append(why)


def clear_reasons(handler: str, target: Any = None) -> None:
    """Forget `handler`'s reasons so far (the end-of-run step ran it for them); the files it depends
    on stay. A stage that declares again after the run's reboot (operations/nccl.py) starts here,
    so `flush` runs the side effect only for what that pass changes."""
    _entry(handler, target)["reasons"].clear()


def depmod_command(inputs: dict) -> str:
    """`depmod <release>` for each release whose module dir (/lib/modules/<release>/…) is an input;
    depmod indexes one release per call (kmod 30 tools/depmod.c do_depmod: the first operand is the
    one version, any further operands are module files to index instead of all; its getopt_long
    loop ends at '--')."""
    releases = sorted({path[len(MODULES_ROOT):].split("/", 1)[0] for path in inputs if path.startswith(MODULES_ROOT)})
    return " && ".join(f"depmod {operands(release)}" for release in releases) or "true"


def pending(target: Any = None) -> dict:
    """{handler: {"inputs": {path: (sha256, mode)}, "reasons": [...], "command": str}} (a copy)."""
    return {name: {"inputs": dict(e["inputs"]), "reasons": list(e["reasons"]), "command": e["command"]}
            for name, e in _registry(target if target is not None else host).items()}


def stamp_text(inputs: dict[str, tuple[str, str]]) -> str:
    """What the stamp holds: one `sha256 mode path` line per file, sorted by path."""
    return "".join(f"{sha} {mode} {path}\n" for path, (sha, mode) in sorted(inputs.items()))


def run_command(command: str, stamp: str, stamp_file: str, legacy: Sequence[str] = ()) -> str:
    """The side effect, then (only if it succeeded) its stamp; old stamps go with it."""
    cleanup = f" && rm -f {operands(list(legacy))}" if legacy else ""
    # the stamp's directory is root's alone (templates/root-dir.sh.j2), checked before the stamp is written
    stamp_dir = stamp_file.rsplit("/", 1)[0]
    return (f"{command} && {{\n{root_dir_function()}pvegpu_dir {word(stamp_dir)} {PUBLIC} && "
            f"{write_file_command(stamp_file, stamp, '644', False)}{cleanup}; }}")


@operation()
def run_handler(handler: str, command: str, stamp: str, reasons: list[str], state: dict | None = None):
    """Run one handler's side effect once, when a stage changed a file it depends on this run or
    its stamp records other files (a previous run did not finish it).

    + handler: one of ORDER
    + command: fixed words (update-initramfs -u -k all, proxmox-boot-tool refresh, update-grub,
      the guarded daemon-reload) or `depmod <release>` per release, each quoted
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
        command = depmod_command(entry["inputs"]) if handler == DEPMOD else entry["command"]
        label = LABELS.get(handler, command)
        stamp = stamp_text(entry["inputs"])
        reasons = list(entry["reasons"])
        state = stamps.get(stamp_path(handler))
        if not reasons and (state or {}).get("sha256") != sha256_text(stamp):
            reasons = [f"{stamp_path(handler)} records other files (a previous run stopped before it)" if state
                       else f"no {stamp_path(handler)} yet (its first run on this host, or a previous run stopped "
                            "before it)"]
        runs.append({
            "name": f"{label} once" + (f": {'; '.join(reasons)}" if reasons else ""),
            "handler": handler,
            "command": command,
            "stamp": stamp,
            "reasons": reasons,
            "state": state,
        })
    return runs


def flush(handler: str, target: Any = None) -> None:
    """Run `handler` now, if a stage declared it (a stage's later step needs it at once), and take
    it out of the registry: the end-of-run step runs it again only if a stage declares it anew."""
    target = target if target is not None else host
    registry = _registry(target)
    if handler not in registry:
        return
    for kwargs in handler_runs({handler: registry.pop(handler)}, fact_once(ManagedFiles, paths=STAMP_PATHS)):
        run_handler(**kwargs)


@deploy("pvegpu: side effects once per run")
def apply(spec) -> None:
    registry = pending()
    if not registry:  # no stage declared anything (a stage subset): not even the stamps are read
        return
    for kwargs in handler_runs(registry, fact_once(ManagedFiles, paths=STAMP_PATHS)):
        run_handler(**kwargs)
