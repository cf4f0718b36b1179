"""Facts of the GPU rebind transaction (stage 5): whether /sys can rebind now, which guests run,
who holds a GPU, and the journal an earlier transaction left (`plan.rebind`).

Whether this host can rebind live is read from how /sys is mounted: a read-only /sys (a
container, or the twin without its kernel model) cannot take driver_override/unbind/bind
writes, so the binding is persisted and applied at the next boot; a read-write one can.
"""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from facts.base import ShellFact
from facts.guest_state import GUEST_STATE_COMMAND, GuestState, parse_guest_state
from facts.sections import parse_sections, split_sections
from facts.shared import read_file
from facts.shell import word

# The rebind transaction's host paths (plan.rebind writes them; `RebindJournal` reads them).
STATE_DIR = "/var/lib/pvegpu/rebind"
JOURNAL = f"{STATE_DIR}/journal"
LOCK = "/run/pvegpu/rebind.lock"

# mountinfo: field 5 is the mount point, field 6 its options; the last /sys line is the one on top
# (follows the kernel's Documentation/filesystems/proc.rst "/proc/<pid>/mountinfo")
SYSFS_MOUNT_COMMAND = "awk '$5 == \"/sys\" {o = $6} END {print o}' /proc/self/mountinfo 2>/dev/null"


def sysfs_writable(lines: list[str]) -> bool:
    """The `@@ sysfs` section: the options of /sys's mount, e.g. ``rw,nosuid,nodev,noexec,relatime``."""
    opts = [line.strip() for line in lines if line.strip()]
    return bool(opts) and opts[-1].split(",")[0] == "rw"


def parse_guest_runtime(lines: list[str]) -> dict:
    """Output of `GuestRuntime.command` → ``{"sysfs_live": True, "status": {"pct": True, "lxc":
    {200: "running"}, "qemu": {300: "stopped"}}}`` ("status": a `facts.guest_state.GuestState`)."""
    return {"sysfs_live": sysfs_writable(split_sections(lines).get("sysfs", [])),
            "status": parse_guest_state(lines)}


class GuestRuntime(ShellFact):
    """
    Whether /sys can rebind devices live (mounted read-write), and which guests run
    (`GuestState` in the same command; `operations.gpus.stage_facts` keeps it as this run's
    `facts.guest_state.guest_state()`).

    .. code:: python

        {"sysfs_live": True, "status": {"pct": True, "lxc": {200: "running"}, "qemu": {300: "stopped"}}}
    """

    command = f"echo '@@ sysfs'; {SYSFS_MOUNT_COMMAND}; {GUEST_STATE_COMMAND}; true"

    @staticmethod
    def default() -> dict:
        return {"sysfs_live": False, "status": GuestState.default()}

    def process(self, output):
        return parse_guest_runtime(list(output))


def parse_compute_apps(lines: list[str]) -> dict[str, list[str]]:
    """`nvidia-smi --query-compute-apps=gpu_bus_id,pid,process_name --format=csv,noheader` →
    ``{"0000:01:00.0": ["python3 (pid 4242)"]}`` (nvidia-smi prints 8-digit domains)."""
    held: dict[str, list[str]] = {}
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not re.match(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$", parts[0]):
            continue
        domain, rest = parts[0].split(":", 1)
        bdf = f"{int(domain, 16):04x}:{rest}".lower()
        held.setdefault(bdf, []).append(f"{parts[2]} (pid {parts[1]})")
    return held


def parse_fuser(lines: list[str]) -> dict[str, list[str]]:
    """`fuser -v /dev/nvidiaN ...` (stderr) → ``{"/dev/nvidia0": ["nvidia-persistenced (pid 812)"]}``."""
    held: dict[str, list[str]] = {}
    current = None
    for line in lines:
        match = re.match(r"^(/\S+?):\s*(.*)$", line)
        rest = line
        if match:
            current, rest = match.group(1), match.group(2)
        if current is None:
            continue
        tokens = rest.split()
        # USER PID ACCESS COMMAND (the header line has USER PID ACCESS COMMAND literally)
        if len(tokens) >= 4 and tokens[1].isdigit():
            held.setdefault(current, []).append(f"{' '.join(tokens[3:])} (pid {tokens[1]})")
    return held


class GpuHolders(FactBase):
    """
    Processes holding GPUs: nvidia-smi compute apps (any GPU it sees) and `fuser -v` on the
    given /dev/nvidiaN nodes.

    .. code:: python

        {"compute_apps": {"0000:81:00.0": ["python3 (pid 4242)"]},
         "fuser": {"/dev/nvidia0": ["nvidia-persistenced (pid 812)"]}}
    """

    def command(self, nodes):
        fuser = f"fuser -v {' '.join(word(n) for n in nodes)} 2>&1" if nodes else "true"
        return ("echo '@@ apps'; nvidia-smi --query-compute-apps=gpu_bus_id,pid,process_name "
                f"--format=csv,noheader 2>/dev/null; echo '@@ fuser'; {fuser}; true")

    @staticmethod
    def default() -> dict:
        return {"compute_apps": {}, "fuser": {}}

    def process(self, output):
        found = parse_sections(output, {"apps": parse_compute_apps, "fuser": parse_fuser})
        return {"compute_apps": found["apps"], "fuser": found["fuser"]}


def parse_journal(lines: list[str]) -> dict:
    """Output of `RebindJournal.command` → ``{"lines": [...], "running": bool, "systemd": bool}``
    (no journal: no lines; running: a runner holds the lock; systemd: it runs as the init, so the
    runner becomes a unit). `plan.rebind.journal_of` makes a `plan.rebind.Journal` of it."""
    sections = split_sections(lines)
    runner = [line.strip() for line in sections.get("runner", []) if line.strip()]
    return {"lines": [line.rstrip("\n") for line in sections.get("journal", []) if line.strip()],
            "running": runner[:1] == ["running"],
            "systemd": [line.strip() for line in sections.get("systemd", [])][:1] == ["yes"]}


class RebindJournal(ShellFact):
    """
    The journal of the last rebind transaction that no run has closed yet, whether its runner
    still holds the lock (``running``), and whether systemd runs (the runner's launcher). Reads
    only: ``flock -n`` on a lock file that does not exist is not tried (it would create it).

    .. code:: python

        {"lines": ["2026-12-03T18:40:01Z begin 2026-12-03T184001Z-kpro6 pid=4242", ...],
         "running": False, "systemd": True}
    """

    # systemd runs when /run/systemd/system exists (what sd_booted() checks)
    command = (f"if [ -f {JOURNAL} ]; then echo '@@ journal'; {read_file(JOURNAL)}; fi; echo '@@ runner'; "
               f"if [ -e {LOCK} ] && ! flock -n {LOCK} true 2>/dev/null; then echo running; else echo idle; fi; "
               "echo '@@ systemd'; [ -d /run/systemd/system ] && echo yes; true")

    @staticmethod
    def default() -> dict:
        return {"lines": [], "running": False, "systemd": False}

    def process(self, output):
        return parse_journal(list(output))
