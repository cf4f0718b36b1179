"""The rebind transaction run detached on the host, its journal, and what a later run does with
a journal an earlier one left (issue 19, part 2). Pure: strings and data, no I/O.

One transaction = one runner script (`templates/rebind.sh.j2`) that the GPU stage writes to
`RUNNER` and starts detached under `flock LOCK` (a transient systemd unit where systemd runs,
else `setsid`); the deploy then follows `JOURNAL` until the runner writes an end line. The
runner survives a dropped SSH connection or a killed deploy and completes or rolls back alone.

Journal lines: ``<UTC time> <event> <args…>``::

    begin <txid> pid=<pid>            the runner holds LOCK
    stopped <lxc|qemu> <id> [carried|api]   a guest pvegpu stopped (carried: by an earlier
                                      transaction and still down; api: through the Proxmox API)
    ha-stopped <kind> <id> <sid>      HA stopped it; HA keeps it stopped (not ours to start)
    move <bdf> <from> <to>            about to move one function
    moved <bdf> <to>                  verified on the new driver
    bound <bdf> <driver>              the state of every function at the end
    failed <reason>                   the forward path stopped here; a rollback follows
    rollback / restored <bdf> <drv> / restore-failed <bdf> <drv> <why>
    restarted <kind> <id> / start-failed <kind> <id>
    done | rolledback | rollback-failed <why>   the end (done: guests stay stopped until the
                                      guests stage has written their configs and starts them)

A journal stays until the run that owns its guests has started them (`close_command`); the next
transaction archives a journal it finds (its guests still down are carried over).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from facts.rebind import JOURNAL, LOCK, STATE_DIR  # the paths the RebindJournal fact reads
from facts.shell import word
from plan.gpus import Move, RebindPlan
from plan.render import PRIVATE, PUBLIC, render_template, root_dirs

RUNNER = f"{STATE_DIR}/run.sh"
HISTORY = f"{STATE_DIR}/history"
KEEP = 10  # archived journals kept
UNIT = "pvegpu-rebind"
UNBIND_TIMEOUT_S = 30
START_TIMEOUT_S = 30  # the runner writes `begin` within this after its start
END_EVENTS = ("done", "rolledback", "rollback-failed")
LABEL = {"lxc": "CT", "qemu": "VM"}


def _module(driver: str) -> str:
    return driver.replace("-", "_")


def runner_script(plan: RebindPlan, nvidia: dict[str, dict], txid: str, *, shutdowns: Sequence[dict] = (),
                  ha_waits: Sequence[dict] = (), api_stopped: Sequence[tuple[str, int]] = (),
                  carried: Sequence[tuple[str, int]] = (), timeout_s: int = UNBIND_TIMEOUT_S,
                  sysfs: str = "/sys", journal: str = JOURNAL) -> str:
    """The runner (`templates/rebind.sh.j2`). `shutdowns`: ``{"kind", "gid", "shell"}`` per guest
    it shuts down; `ha_waits`: ``{"kind", "gid", "sid", "shell", "message"}`` per HA resource HA
    is stopping; `api_stopped`: guests already shut down through the API (recorded, restarted on a
    rollback); `carried`: guests an earlier transaction stopped that are still down (recorded
    only: their configs may not match the hardware yet, so a rollback leaves them to the guests
    stage). `sysfs` and `journal` are parameters so tests run it against a scratch tree."""
    moves = [{"index": i, "bdf": m.bdf, "current": m.current, "wanted": m.wanted,
              "current_module": _module(m.current or ""), "wanted_module": _module(m.wanted or "")}
             for i, m in enumerate(plan.moves)]
    nodes = [f"/dev/nvidia{nvidia[m.bdf]['minor']}" for m in plan.moves
             if nvidia.get(m.bdf, {}).get("minor") is not None]
    return render_template("rebind.sh.j2", txid=txid, journal=journal, sysfs=sysfs,
                           bdfs=" ".join(m.bdf for m in plan.moves), moves=moves, nodes=nodes,
                           timeout_s=int(timeout_s), shutdowns=list(shutdowns), ha_waits=list(ha_waits),
                           api_stopped=list(api_stopped), carried=list(carried))


def archive_command(state_dir: str = STATE_DIR, keep: int = KEEP) -> str:
    """Move the journal (if any) into history/ under a UTC timestamp, keep the newest `keep`."""
    q = word
    j, h = q(f"{state_dir}/journal"), q(f"{state_dir}/history")
    return (f"if [ -f {j} ]; then mkdir -p -m 700 {h} && mv {j} {h}/\"$(date -u +%Y%m%dT%H%M%SZ)-$$.journal\"; fi; "
            f"ls -1t {h} 2>/dev/null | tail -n +{int(keep) + 1} | while read -r old; do rm -f {h}/\"$old\"; done")


def start_command(script: str, txid: str, systemd: bool, state_dir: str = STATE_DIR, lock: str = LOCK,
                  start_timeout_s: int = START_TIMEOUT_S, keep: int = KEEP) -> str:
    """Archive a journal left by an earlier transaction, write the runner, start it detached,
    then follow the journal until an end line: exit 0 on ``done``, 1 otherwise (printing the
    journal as it grows). A second transaction while one runs is refused."""
    q = word
    d, j, r, lk = q(state_dir), q(f"{state_dir}/journal"), q(f"{state_dir}/run.sh"), q(lock)
    if systemd:  # a transient unit: outside the SSH session's cgroup, its output in the journal
        launch = (f"systemctl reset-failed {UNIT} >/dev/null 2>&1; "
                  f"systemd-run --unit {UNIT} --collect --quiet flock {lk} /bin/sh {r} || exit 1")
    else:  # no running systemd (containers, the twin): a new session, stdio to a file
        launch = f"setsid flock {lk} /bin/sh {r} </dev/null >>{d}/output 2>&1 &"
    end = "|".join(END_EVENTS)
    return "\n".join([
        "set -u",
        root_dirs((state_dir, PRIVATE), (f"{state_dir}/history", PRIVATE), (lock.rsplit("/", 1)[0], PUBLIC)),
        f"if [ -e {lk} ] && ! flock -n {lk} true; then "
        f"echo 'pvegpu: another rebind transaction is running on this host; see '{j} >&2; exit 1; fi",
        archive_command(state_dir, keep),
        f"cat > {r} <<'PVEGPU_RUNNER_END'\n{script}PVEGPU_RUNNER_END",
        f"chmod 700 {r}",
        launch,
        # follow: first the runner's `begin` (it holds the lock from then on), then every new line
        f"n=0; while ! grep -q ' begin '{q(txid)}' ' {j} 2>/dev/null; do n=$((n+1)); "
        f"[ $n -le {int(start_timeout_s) * 10} ] || {{ echo 'pvegpu: the rebind runner did not start' >&2; exit 1; }}; "
        "sleep 0.1; done",
        "seen=0",
        "while :; do",
        f"  total=$(wc -l < {j})",
        f"  if [ \"$total\" -gt \"$seen\" ]; then tail -n +$((seen + 1)) {j} | head -n $((total - seen)) "
        "| sed 's/^/pvegpu rebind: /'; seen=$total; fi",
        # the last line printed, not the journal's last: an end line that came after the count is
        # printed by the next turn (read from the file once more), never skipped
        f"  last=$(head -n \"$seen\" {j} | tail -n 1 | cut -d' ' -f2)",
        f"  case $last in {end}) break ;; esac",
        f"  if flock -n {lk} true; then sleep 0.2; last=$(tail -n 1 {j} | cut -d' ' -f2); "
        f"case $last in {end}) continue ;; esac; "
        "echo 'pvegpu: the rebind runner ended without finishing' >&2; exit 1; fi",
        "  sleep 0.2",
        "done",
        '[ "$last" = done ]',
    ]) + "\n"


def close_command(state_dir: str = STATE_DIR, keep: int = KEEP) -> str:
    """Archive the journal once its guests are back (the guests stage has started them)."""
    return archive_command(state_dir, keep) + "; true"


# ---------------------------------------------------------------- a journal a later run reads


@dataclass
class Journal:
    """A journal as the `RebindJournal` fact read it (`facts.rebind.parse_journal`)."""

    lines: list[str] = field(default_factory=list)
    running: bool = False  # a runner holds the lock now

    def events(self) -> list[tuple[str, list[str]]]:
        out = []
        for line in self.lines:
            parts = line.split()
            if len(parts) >= 2:
                out.append((parts[1], parts[2:]))
        return out

    @property
    def exists(self) -> bool:
        return bool(self.lines)

    @property
    def started(self) -> str:
        return self.lines[0].split()[0] if self.lines else ""

    @property
    def end(self) -> str | None:
        """``done``, ``rolledback``, ``rollback-failed`` or None (running, or interrupted)."""
        for event, _ in reversed(self.events()):
            if event in END_EVENTS:
                return event
        return None

    def stopped(self) -> list[tuple[str, int]]:
        """Guests pvegpu stopped that this journal does not show started again."""
        out: list[tuple[str, int]] = []
        for event, args in self.events():
            if len(args) < 2 or args[0] not in LABEL or not args[1].isdigit():
                continue
            guest = (args[0], int(args[1]))
            if event == "stopped" and guest not in out:
                out.append(guest)
            elif event == "restarted" and guest in out:
                out.remove(guest)
        return out

    def failure(self) -> str:
        for event, args in self.events():
            if event in ("failed", "rollback-failed"):
                return " ".join(args)
        return ""

    def moved(self) -> list[str]:
        return [f"{a[0]} -> {a[1]}" for e, a in self.events() if e == "moved" and len(a) >= 2]


def journal_of(found: dict) -> Journal:
    """The `Journal` of a `facts.rebind.RebindJournal` reading."""
    return Journal(lines=list(found["lines"]), running=found["running"])


@dataclass
class Recovery:
    """What this run does about a journal an earlier transaction left."""

    lines: list[str]
    start: list[tuple[str, int]]  # guests pvegpu stopped that are still down: started by the guests stage
    close: bool  # the journal is archived once they run


def recovery(journal: Journal, status: dict[str, dict[int, str]], ha_managed: Sequence[tuple[str, int]] = ()) -> Recovery:
    """Report an earlier transaction's journal and pick the guests to start again: those it
    stopped, did not restart, that are stopped now and not HA resources (HA decides those)."""
    if not journal.exists:
        return Recovery([], [], False)
    end = journal.end
    if journal.running:
        how = "is still running"
    elif end == "done":
        how = "completed"
    elif end == "rolledback":
        how = f"failed ({journal.failure()}) and was rolled back"
    elif end == "rollback-failed":
        how = f"failed and could not be rolled back ({journal.failure()})"
    else:
        last = journal.lines[-1].split(None, 1)[1] if journal.lines else ""
        how = f"was interrupted (its runner ended without finishing, e.g. the host rebooted) after: {last}"
    lines = [f"the GPU rebind transaction started {journal.started} by an earlier run {how}"
             + (f"; moved: {', '.join(journal.moved())}" if journal.moved() else "")
             + f" (journal: {JOURNAL})"]
    start = [g for g in journal.stopped()
             if status.get(g[0], {}).get(g[1]) == "stopped" and g not in set(ha_managed)]
    if start:
        lines.append("guests it stopped that are still down, started again once their configs match: "
                     + ", ".join(f"{LABEL[k]} {i}" for k, i in start))
    return Recovery(lines, start, not journal.running)


def transaction_id(now_iso: str, host_name: str) -> str:
    """A name for one transaction (in the journal's `begin` line)."""
    safe = "".join(c if c.isalnum() or c in "-." else "-" for c in str(host_name))
    return f"{now_iso.replace(':', '')}-{safe}"


__all__ = ["Journal", "Move", "Recovery", "close_command", "journal_of", "recovery", "runner_script", "start_command",
           "transaction_id"]
