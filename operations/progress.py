"""Progress of long work on a host, in the pyinfra output: the kernel build, the NVIDIA module
build and the container user-space install.

One mechanism, the kernel build's: the work writes a log on the host; the deploy reads that
log at a steady rate (every `REPORT_EVERY_S` seconds, not once per object) and reports what is
being built, how far (objects built out of those the last build of the same source made, where
the work counts objects), the time elapsed and the log's last line; then a final line with the
time taken. The time and object count of a finished build are kept on the host
(`RECORD_DIR/<key>`), so the next run has an estimate and `--dry` says how long the last build of
the same source took there.

Two ways to wait, the same reports:

- `follow_detached`: work that runs detached on the host (the kernel build: `build.rc` appears
  when it ends; a re-run attaches to it).
- `run_reported`: a command run in the foreground over SSH (the NVIDIA build, the installer in a
  container), with the log read beside it on a second SSH channel of the same connection
  (pyinfra runs under gevent: both are greenlets).

The records are one fact (`facts.progress.Durations`), read with the stages' other facts (`prefetch`).
Log lines and stderr come from the work (a CT's installer among them): printed through
`plan.terminal.visible`, their control characters escaped.
"""

from __future__ import annotations

import os
import re
import time

import gevent
from pyinfra import host as current_host
from pyinfra import logger
from pyinfra import state as current_state
from pyinfra.api import FunctionCommand, StringCommand

from facts.once import fact_once
from facts.progress import RECORD_DIR, Durations
from facts.shell import word
from plan.render import PUBLIC, root_dirs
from plan.terminal import visible, visible_lines

# Seconds between two progress lines (PVEGPU_PROGRESS_EVERY_S: tests use a few seconds).
REPORT_EVERY_S = float(os.environ.get("PVEGPU_PROGRESS_EVERY_S") or 30)
# Lines kbuild prints per object it makes (` CC [M]  drivers/…/x.o`): the kernel's and NVIDIA's.
OBJECT_LINE = r"^\s+(CC|AS|LD|AR|CC \[M\]|LD \[M\])\s"


def duration_words(seconds: float | None) -> str:
    """``3 h 02 min``, ``12 min 05 s``, ``42 s``."""
    if seconds is None:
        return "unknown"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"


def describe(what: str, elapsed: float, built: int | None = None, total: int | None = None,
             last: str | None = None) -> str:
    """One progress line: ``kernel build: 1200 of ~4800 objects (25%), 3 min 10 s elapsed, last: CC fs/x.o``."""
    parts = []
    if built is not None:
        if total:
            parts.append(f"{built} of ~{total} objects ({min(100, 100 * built // total)}%)")
        else:
            parts.append(f"{built} objects built")
    parts.append(f"{duration_words(elapsed)} elapsed")
    line = f"{what}: " + ", ".join(parts)
    if last:  # a log line of the work (a CT's installer log too): its control characters escaped
        line += ", last: " + re.sub(r"\s+", " ", visible(last)).strip()[:120]
    return line


def record_key(*parts: str) -> str:
    """A file name for a build's record: its identifying parts, anything odd replaced."""
    return re.sub(r"[^0-9A-Za-z._-]+", "_", "-".join(p for p in parts if p))[:200]


def record_command(key: str, seconds: float, objects: int | None) -> str:
    path = word(f"{RECORD_DIR}/{record_key(key)}")
    text = word(f"seconds {int(round(seconds))}\nobjects {objects if objects is not None else ''}\n")
    return root_dirs((RECORD_DIR, PUBLIC)) + f"printf '%s' {text} > {path}.part && mv -f {path}.part {path}"


def prefetch() -> list:
    """The fact to add to a stage's prefetch list (read once with the other facts)."""
    return [(Durations, {})]


def last_run(key: str) -> dict | None:
    """``{"seconds", "objects"}`` of the last finished build of `key` on this host, or None."""
    return (fact_once(Durations) or {}).get(record_key(key))


def announce(what: str, key: str) -> dict | None:
    """Log how long the last build of the same source took on this host (also under --dry)."""
    last = last_run(key)
    if last and last.get("seconds") is not None:
        objects = f", {last['objects']} objects" if last.get("objects") else ""
        logger.info(f"{current_host.name}: {what}: the last build of the same source on this host took "
                    f"{duration_words(last['seconds'])}{objects}")
    else:
        logger.info(f"{current_host.name}: {what}: no earlier build of the same source recorded on this host")
    return last


def log_probe(log: str | None, count: bool = True) -> str:
    """Shell printing two lines: the log's object lines so far (empty when not counted) and its last line."""
    if not log:
        return "echo; echo"
    q = word(log)
    counted = f"grep -c -E {word(OBJECT_LINE)} {q} 2>/dev/null || true" if count else "echo"
    return f"{counted}; tail -n 1 {q} 2>/dev/null; echo"


def _read_probe(host, probe: str) -> tuple[int | None, str | None]:
    ok, output = host.run_shell_command(StringCommand(probe))
    lines = list(getattr(output, "stdout_lines", []) or []) if ok else []
    built = int(lines[0]) if lines and lines[0].strip().isdigit() else None
    last = lines[1].strip() if len(lines) > 1 and lines[1].strip() else None
    return built, last


def run_reported(state, host, command: str, what: str, key: str | None = None, log: str | None = None,
                 probe: str | None = None, total: int | None = None, every_s: float | None = None) -> bool:
    """FunctionCommand body: run `command` on the host (as a StringCommand would) and, while it
    runs, report progress from `log` (or the two lines `probe` prints: objects so far, last
    line) every `every_s`; then a final line with the time taken, and on success record it
    under `key`. `total`: the objects of the last build of the same source (`announce`'s
    record), for the share done. False (the operation fails) when the command fails; its stderr
    is logged."""
    every_s = REPORT_EVERY_S if every_s is None else every_s
    probe = probe or log_probe(log)
    started = time.monotonic()
    logger.info(f"{host.name}: {what}: started" + (f" (~{total} objects last time)" if total else ""))
    work = gevent.spawn(host.run_shell_command, StringCommand(command))
    built = None
    while not work.ready():
        work.join(timeout=every_s)
        if work.ready():
            break
        built, last = _read_probe(host, probe)
        logger.info(f"{host.name}: " + describe(what, time.monotonic() - started, built, total, last))
    ok, output = work.get()
    elapsed = time.monotonic() - started
    if not ok:
        stderr = list(getattr(output, "stderr_lines", []) or [])
        logger.error(f"{host.name}: {what}: failed after {duration_words(elapsed)}"
                     + ("\n" + "\n".join(visible_lines(stderr[-40:])) if stderr else ""))
        return False
    if log:
        built, _ = _read_probe(host, probe)
    logger.info(f"{host.name}: {what}: done in {duration_words(elapsed)}" + (f", {built} objects" if built else ""))
    if key:
        host.run_shell_command(StringCommand(record_command(key, elapsed, built)))
    return True


def follow_detached(state, host, what: str, run_dir: str, log: str, key: str | None = None,
                    total: int | None = None, poll_s: float = 10.0, timeout_s: float = 6 * 3600,
                    every_s: float | None = None) -> bool:
    """FunctionCommand body for detached work that writes `run_dir`/build.pid when it starts and
    `run_dir`/build.rc (its exit status) when it ends: poll every `poll_s`, report progress every
    `every_s` (elapsed since build.pid was written, so also when attaching to work already
    running), then a final line; on success record the time under `key`. False on failure (the
    log's last lines are logged) or timeout."""
    every_s = REPORT_EVERY_S if every_s is None else every_s
    d = word(run_dir)
    probe = (f"cat {d}/build.rc 2>/dev/null || echo pending; "
             f"echo $(( $(date +%s) - $(stat -c %Y {d}/build.pid 2>/dev/null || date +%s) )); "
             + log_probe(log))
    deadline = time.monotonic() + timeout_s
    last_report = None
    while time.monotonic() < deadline:
        ok, output = host.run_shell_command(StringCommand(probe))
        lines = list(getattr(output, "stdout_lines", []) or []) if ok else []
        status = lines[0].strip() if lines else "pending"
        elapsed = int(lines[1]) if len(lines) > 1 and lines[1].strip().lstrip("-").isdigit() else 0
        built = int(lines[2]) if len(lines) > 2 and lines[2].strip().isdigit() else None
        last = lines[3].strip() if len(lines) > 3 and lines[3].strip() else None
        if status != "pending":
            if status == "0":
                logger.info(f"{host.name}: {what}: done in {duration_words(elapsed)}" + (f", {built} objects" if built else ""))
                if key:
                    host.run_shell_command(StringCommand(record_command(key, elapsed, built)))
                return True
            _, tail = host.run_shell_command(StringCommand(f"tail -n 30 {word(log)}"))
            logger.error(f"{host.name}: {what} failed (exit {status}) after {duration_words(elapsed)}; "
                         f"last lines of {log}:\n" + "\n".join(visible_lines(getattr(tail, "stdout_lines", []) or [])))
            return False
        now = time.monotonic()
        if last_report is None or now - last_report >= every_s:
            logger.info(f"{host.name}: " + describe(what, elapsed, built or 0, total, last))
            last_report = now
        time.sleep(min(poll_s, every_s))
    logger.error(f"{host.name}: {what} still running after {timeout_s:.0f} s; re-run the deploy to attach")
    return False


def reported(command: str, what: str, key: str | None = None, log: str | None = None, probe: str | None = None):
    """What an operation yields instead of ``StringCommand(command)`` to have it report progress
    (`run_reported`). Called while the operation is generated: says how long the last build of
    the same source took here (also under --dry) and takes its object count as the estimate."""
    # pyinfra runs an operation's body twice: to see whether it changes anything, then to execute
    # it; say it once
    said_already = getattr(current_state, "is_executing", False) and _checks_for_changes()
    last = (last_run(key) if said_already else announce(what, key)) if key else None
    return FunctionCommand(run_reported, (command, what),
                           {"key": key, "log": log, "probe": probe, "total": (last or {}).get("objects")})


def _checks_for_changes() -> bool:
    check = getattr(current_state, "should_check_for_changes", None)
    return bool(check()) if callable(check) else False


# How long the progress probe waits for a container's answer: the log is the CT's file, and its
# owner can make it a FIFO or a file system that never answers; the report loop waits on the probe
# (run_reported), so an unbounded read would hold the deploy after the install ended.
CT_PROBE_TIMEOUT_S = 10


def ct_log_probe(ctid: int, log: str) -> str:
    """`log_probe` for a log inside a running container (`pct exec`): its last line, no objects;
    given up after CT_PROBE_TIMEOUT_S (coreutils `timeout`, host side: it ends `pct exec`)."""
    inside = f"tail -n 1 {word(log)} 2>/dev/null"
    return (f"echo; timeout -k 2 {int(CT_PROBE_TIMEOUT_S)} pct exec {word(str(int(ctid)))} -- sh -c {word(inside)} "
            "2>/dev/null; echo")
