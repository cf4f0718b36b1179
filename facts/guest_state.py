"""Run state of this node's guests (their configs, lxc's running CTs, the VMs' pid files: as
pve-container and qemu-server decide it, without `pct list` / `qm list`), read once per host
per run while nothing changes it.

Four stages need the CT run state, so `guest_state()` keeps one reading per host for the run
(it starts no Proxmox CLI: `pct list` / `qm list` are Perl programs, 0.3-0.5 s each). An
operation that yields a command starting or stopping a guest calls `guest_state_changes()`
right before it (`operations.proxmox.guest_stop_commands` / `guest_start_commands` do, and the
GPU stage's rebind transaction); the next `guest_state()` while executing reads again.

Why a reading taken while operations are generated may be used while they execute: pyinfra
generates every operation (the stages' `apply()`, and each operation body up to its first
command when it checks for changes) before it executes the first one, so nothing on the host
changes in between. A command yielded while generating is not run, so only a yield while
executing makes the reading stale. (The reboot stage's `server.reboot` restarts guests too;
it runs last and nothing reads guest state after it.)

The reading is the run state's ``guests`` (`facts.run_state`: one object per host per run).

    {"pct": True,                               # pct exists (a Proxmox VE node)
     "lxc": {200: "running", 201: "stopped"},   # configs + `lxc-ls --active`
     "qemu": {300: "running"}}                  # configs + pid files
"""

from __future__ import annotations

from typing import Any

from facts.base import ShellFact
from facts.once import read_fact
from facts.run_state import run_state
from facts.sections import SECTION, split_sections
from facts.shared import CT_PIDS, UNAME, ct_init_pids, take
from facts.shell import word

# The guests without `pct list` / `qm list` (Perl programs). A node's guests are the configs
# under /etc/pve/nodes/<node>/ (pve-cluster's vmlist holds a guest under the node whose directory
# has its config: pve-container PVE/LXC.pm and qemu-server PVE/QemuServer.pm config_list); the
# node is `uname -n` up to its first dot (pve-common INotify nodename).
# A CT runs while lxc's monitor socket for it exists: pve-container PVE/LXC.pm
# list_active_containers reads /proc/net/unix for it, as lxc's own list_active_containers
# (src/lxc/lxccontainer.c) does for `lxc-ls --active`, a C program, asked here.
# A VM runs when its pid file names a live process whose argv[0] ends in kvm (or is
# qemu-system-*) and whose -pidfile is that file (qemu-server PVE/QemuServer/Helpers.pm
# vm_running_locally / parse_cmdline).
GUEST_STATE_COMMAND = (
    f"{take(UNAME['n'])}; n=${UNAME['n']}; "
    "n=${n%%.*}; if command -v pct >/dev/null 2>&1; then echo '@@ lxc'; "
    "for f in /etc/pve/nodes/\"$n\"/lxc/*.conf; do [ -e \"$f\" ] || continue; f=${f##*/}; echo \"${f%.conf}\"; done; "
    "echo '@@ lxc-active'; lxc-ls --active -1 2>/dev/null; fi; "
    "echo '@@ qemu'; for f in /etc/pve/nodes/\"$n\"/qemu-server/*.conf; do [ -e \"$f\" ] || continue; "
    "id=${f##*/}; id=${id%.conf}; p=/var/run/qemu-server/$id.pid; s=stopped; "
    "if { read -r pid < \"$p\"; } 2>/dev/null && [ -n \"$pid\" ] && tr '\\0' '\\n' < /proc/\"$pid\"/cmdline 2>/dev/null | "
    "awk -v p=\"$p\" 'NR == 1 { ok = ($0 ~ /kvm$/ || $0 ~ /(^|\\/)qemu-system-[^\\/]+$/) } "
    "prev == \"-pidfile\" && $0 == p { hit = 1 } { prev = $0 } END { exit !(ok && hit) }'; "
    "then s=running; fi; echo \"$id $s\"; done"
)


# Shell functions for a `ct_root_loop` body (issue 39 item 9). Through /proc/<pid>/root an absolute
# symlink anywhere inside the CT resolves against the host's / (the lookup's root is the caller's),
# and a FIFO blocks whoever opens it: a CT's root user could make a probe read a host file or hang.
#   ct_in PATH    PATH (under $r) has no symlink among its components below $r (the last one
#                 included): a name the CT has, not one it points elsewhere. Tests names only.
#   ct_file PATH  for /etc/x in the CT: prints its mode, then its sha256, when it is a regular file
#                 reached through no symlink; else fails. It descends from the CT's root one directory
#                 at a time (cd) and checks that each one's `..` is the directory it came from (a
#                 component swapped for a symlink meanwhile lands elsewhere and stops it); the file
#                 is then opened relative to that directory with O_NOFOLLOW and O_NONBLOCK
#                 (dd iflag=nofollow,nonblock: a symlink fails, a FIFO does not block the open) under
#                 `timeout 5` (nor the reads).
CT_PATH_FUNCTIONS = (
    'ct_in() { ci_rest=${1#"$r"}; ci_path=$r; while [ -n "$ci_rest" ]; do ci_rest=${ci_rest#/}; '
    'ci_name=${ci_rest%%/*}; case "$ci_rest" in */*) ci_rest=${ci_rest#*/};; *) ci_rest=;; esac; '
    '[ -n "$ci_name" ] || continue; ci_path=$ci_path/$ci_name; [ -L "$ci_path" ] && return 1; done; return 0; }; '
    'ct_file() { ( cd "$r/" || exit 1; here=$(stat -c %d:%i .) || exit 1; p=${1#/}; '
    'while case "$p" in */*) true;; *) false;; esac; do n=${p%%/*}; p=${p#*/}; '
    '[ -n "$n" ] || continue; [ ! -L "$n" ] && [ -d "$n" ] && cd "./$n" || exit 1; '
    '[ "$(stat -c %d:%i ..)" = "$here" ] || exit 1; here=$(stat -c %d:%i .) || exit 1; done; '
    '[ -f "$p" ] && [ ! -L "$p" ] || exit 1; stat -c %a -- "$p" || exit 1; '
    'h=$(timeout 5 dd if="./$p" iflag=nofollow,nonblock status=none | sha256sum) || exit 1; echo "${h%% *}"; ) }'
)


def ct_root_loop(ctids, body: str) -> str:
    """Shell: for each CT of `ctids`, its section marker (``@@ ct <id>``), then `body` run by the
    host's shell with ``$r`` the CT's root as the CT's own processes see it, ``/proc/<init>/root``,
    and ``$root`` that root's device:inode (`stat -L`, empty where it failed)
    (the init pid as pve-container PVE/LXC.pm find_lxc_pid gets it: `lxc-info -n <id> -p`, a C
    program; with -H and one filter it prints the bare number, lxc src/lxc/tools/lxc_info.c). No
    `pct exec` (Perl) and no program of the CT runs. A CT whose init is not found prints its
    marker alone. Through /proc/<pid>/root an absolute symlink inside the CT still resolves on
    the host: `body` reaches the CT's files through `CT_PATH_FUNCTIONS` (defined before the loop):
    `ct_in` for a name, `ct_file` for a file's mode and digest; nothing it reads follows a symlink
    or blocks on a FIFO."""
    ids = " ".join(word(str(int(c))) for c in ctids)
    if not ids:
        return ""
    # the pids and roots through facts.shared: a probe whose facts look into the same CTs asks
    # lxc-info (and stat) once per CT
    return (f"{ct_init_pids(ctids)}; {CT_PATH_FUNCTIONS}; for id in {ids}; do echo \"{SECTION}ct $id\"; "
            f'pid=; root=; for e in ${CT_PIDS}; do case "$e" in "$id":*) e=${{e#*:}}; pid=${{e%%:*}}; root=${{e#*:}};; esac; done; '
            "[ -n \"$pid\" ] || continue; "
            f"r=/proc/$pid/root; {body}; done; ")


def parse_guest_state(lines: list[str]) -> dict:
    """The `@@ lxc` / `@@ lxc-active` / `@@ qemu` sections of `GUEST_STATE_COMMAND`'s output
    (other sections are skipped) → the shape in the module docstring."""
    sections = split_sections(lines)
    parsed: dict[str, Any] = {"pct": "lxc" in sections, "lxc": {}, "qemu": {}}
    active = {line.strip() for line in sections.get("lxc-active", [])}
    for line in sections.get("lxc", []):
        if line.strip().isdigit():
            parsed["lxc"][int(line)] = "running" if line.strip() in active else "stopped"
    for line in sections.get("qemu", []):
        tokens = line.split()
        if len(tokens) == 2 and tokens[0].isdigit() and tokens[1] in ("running", "stopped"):
            parsed["qemu"][int(tokens[0])] = tokens[1]  # VMID STATUS
    return parsed


class GuestState(ShellFact):
    """
    Which guests this node has and whether they run (`GUEST_STATE_COMMAND`: configs, lxc's
    running CTs, the VMs' pid files; no Proxmox CLI).

    .. code:: python

        {"pct": True, "lxc": {200: "running"}, "qemu": {300: "stopped"}}
    """

    command = GUEST_STATE_COMMAND + "; true"

    @staticmethod
    def default() -> dict:
        return {"pct": False, "lxc": {}, "qemu": {}}

    def process(self, output):
        return parse_guest_state(list(output))


def guest_state() -> dict:
    """This host's `GuestState`: the reading kept for this run, else read now (and kept)."""
    run = run_state()
    if run.guests is None:
        run.guests = read_fact(GuestState)
    return run.guests


def remember_guest_state(current: dict) -> None:
    """Keep `current` (a `GuestState` just read, e.g. inside a combined fact) for this run."""
    run_state().guests = current


def guest_state_changes() -> None:
    """Call right before yielding a command that starts, stops or shuts down a guest: while
    executing, the kept reading is dropped (while generating, nothing runs: it stays)."""
    run_state().guests_changed()


def running_containers(current: dict, ctids) -> list[int]:
    """The CTs of `ctids` that `current` (a `GuestState`) shows running, sorted."""
    return sorted(int(c) for c in ctids if current["lxc"].get(int(c)) == "running")


def with_ct_status(found: dict, guests: dict) -> dict:
    """A stage's fact about its CTs (`NcclState`, `ContainerUserspace`) plus the node's CT run
    state from `guests` (a `GuestState`), the shape the stage decides on::

        {**found, "pct": True,                  # pct exists (a Proxmox VE node)
                  "status": {200: "running"}}   # `pct list`
    """
    return {**found, "pct": guests["pct"], "status": dict(guests["lxc"])}
