"""Nothing of a guest config lost (issue 19, part 3).

Before pvegpu changes a CT config, a VM config or /etc/pve/mapping/pci.cfg, the file's
current content is copied outside pmxcfs, to

    /var/lib/pvegpu/backup/<the file's path>/<UTC time>      e.g.
    /var/lib/pvegpu/backup/etc/pve/lxc/200.conf/20261203T151502.123456789Z

keeping the newest `KEEP` copies per file (`backup_command`, one shell command yielded just
before the write). `--dry` (and a converge) prints the unified diff of every file and Proxmox
config that would change (`log_diff`): CT configs and pvegpu's host files from their full
text, VM configs and pci.cfg from the file as it is and the change `qm set` / `pvesh` would
make to it (`vm_config_after`, `pci_cfg_after`). The values of secret keys of a guest config
(`SECRET_KEYS`: cipassword, args, a CT's environment) are printed as `**********`.

Putting one back by hand (docs/howto/restore-backup.md): copy the backup over the file,
e.g. ``cp /var/lib/pvegpu/backup/etc/pve/lxc/200.conf/<time> /etc/pve/lxc/200.conf``.
"""

from __future__ import annotations

import difflib
import sys

from pyinfra import host, logger
from pyinfra.api import StringCommand, operation

from facts.once import read_fact
from facts.shell import word
from plan.render import PRIVATE, root_dir_function
from plan.terminal import visible

BACKUP_ROOT = "/var/lib/pvegpu/backup"
PCI_CFG = "/etc/pve/mapping/pci.cfg"
KEEP = 10


def backup_dir(path: str, root: str = BACKUP_ROOT) -> str:
    return root + "/" + path.lstrip("/")


def backup_command(path: str, keep: int = KEEP, root: str = BACKUP_ROOT) -> str:
    """Copy `path` (if it exists) to its backup directory and keep the newest `keep` copies."""
    q, d = word(path), word(backup_dir(path, root))
    # the backup tree is root's alone, 0700 (templates/root-dir.sh.j2): configs may hold secrets
    return (f"{{\n{root_dir_function()}if [ -f {q} ]; then pvegpu_dir {word(root)} {PRIVATE} && "
            f"pvegpu_dir {d} {PRIVATE} && "
            f"cp -- {q} {d}/\"$(date -u +%Y%m%dT%H%M%S.%NZ)\" && "
            f"ls -1 {d} | sort | head -n -{int(keep)} | while read -r old; do rm -f {d}/\"$old\"; done; fi; }}")


def is_dry() -> bool:
    """pyinfra 3 keeps --dry in its CLI only; the deploy reads it from the command line."""
    return "--dry" in sys.argv


# Guest config keys whose values a diff of a Proxmox config never prints (issue 39 item 6): the
# diff is taken on the real text, then each such line shows its key and MASK, so a change of the
# value still shows as a -/+ pair.
# - cipassword: qemu-server's own API never returns it (PVE/API2/Qemu.pm: GET config and pending
#   give '**********', the create/update task log '<hidden>'); a hash of the guest's password.
# - args: the raw QEMU command line; pvegpu never writes it, and it is where secrets reach QEMU
#   (-object secret,data=..., a -spice/-vnc password=) that qemu-server cannot see to mask.
# - env, lxc.environment, lxc.environment.runtime: a container's environment (pve-container
#   src/PVE/LXC/Config.pm: `env`, and the raw lxc keys it lets through), where tokens are put.
SECRET_KEYS = frozenset({"cipassword", "args", "env", "lxc.environment", "lxc.environment.runtime"})
MASK = "**********"  # what qemu-server's API shows for cipassword


def mask_secret(line: str) -> str:
    """One line of a Proxmox guest config (a diff line: ' ', '-' or '+' first) with the value of a
    SECRET_KEYS key replaced by MASK; a commented-out line (`#key%3A value`, PVE's escaped colon)
    too. Other lines as they are."""
    sign, body = (line[:1], line[1:]) if line[:1] in (" ", "-", "+") else ("", line)
    text = body.lstrip("#")
    key, sep, _ = text.partition(":")
    if not sep and "%3A" in text:
        key, sep, _ = text.partition("%3A")
    if sep and key.strip() in SECRET_KEYS:
        return f"{sign}{body[:len(body) - len(text)]}{key}{sep} {MASK}"
    return line


def diff_lines(path: str, before: str | None, after: str) -> list[str]:
    lines = list(difflib.unified_diff((before or "").splitlines(), after.splitlines(),
                                      fromfile=f"{path} (now)" if before is not None else "/dev/null",
                                      tofile=f"{path} (after)", lineterm=""))
    if not path.startswith("/etc/pve/"):
        return lines
    return lines[:2] + [line if line.startswith("@@") else mask_secret(line) for line in lines[2:]]


_SHOWN: set[tuple] = set()  # (host, path, diff): pyinfra may run an operation's body twice


def log_diff(path: str, before: str | None, after: str, note: str = "") -> None:
    lines = diff_lines(path, before, after)
    key = (host.name, path, tuple(lines))
    if not lines or key in _SHOWN:
        return
    _SHOWN.add(key)
    logger.info(f"{host.name}: {path} would change{note}:" if is_dry() else f"{host.name}: {path} changes{note}:")
    for line in lines:
        logger.info(f"    {visible(line)}")  # a config's text, as it is on the host


@operation()
def keep_config(path: str, after=None):
    """Keep `path`'s current content under BACKUP_ROOT before a later operation of this run
    changes it through Proxmox (`qm set`, `pvesh`, the API). With --dry, print the diff to
    `after(current text)` instead (one read of the file).

    + path: the Proxmox config that is about to change
    + after: function of the current text giving the text after the change (for the diff)
    """
    if is_dry():
        from facts.files import FileTexts

        before = read_fact(FileTexts, paths=[path]).get(path)
        if after is not None:
            log_diff(path, before, after(before or ""))
    yield StringCommand(backup_command(path))


def _main_and_rest(text: str) -> tuple[list[str], list[str]]:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("["):
            return lines[:i], lines[i:]
    return lines, []


def vm_config_after(text: str, set_options: dict[str, str], delete: list[str]) -> str:
    """The VM config after `qm set` of `set_options` and `--delete` of `delete`, main section
    only (a running VM gets them as pending until its restart, which the run does).
    follows qemu-server PVE/QemuServer.pm write_vm_config(): 'key: value' lines, keys sorted,
    description first as '#' comments"""
    main, rest = _main_and_rest(text)
    comments = [line for line in main if line.startswith("#")]
    options: dict[str, str] = {}
    for line in main:
        if line.startswith("#") or ":" not in line:
            continue
        key, _, value = line.partition(":")
        options[key.strip()] = value.strip()
    for key in delete:
        options.pop(key, None)
    options.update(set_options)
    out = comments + [f"{k}: {v}" for k, v in sorted(options.items())]
    if rest:
        out += [""] + [line for line in rest]
    return "\n".join(out) + "\n"


def pci_cfg_after(text: str, changes) -> str:
    """/etc/pve/mapping/pci.cfg after the `plan.guests.MappingChange`s (merge, delete).
    follows pve-guest-common src/PVE/Mapping/PCI.pm format_section_header(): the id alone on
    its line, then tab-indented 'map <key=value,...>' lines; a blank line between sections"""
    from plan.guests import map_string

    sections: dict[str, list[str]] = {}
    order: list[str] = []
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            current = line.strip()
            order.append(current)
            sections[current] = []
        elif current is not None:
            sections[current].append(line)
    for change in changes:
        if change.action == "delete":
            sections.pop(change.id, None)
            order = [o for o in order if o != change.id]
            continue
        lines = sections.get(change.id, [])
        kept = [line for line in lines if not line.strip().startswith("map ")]
        others = [line for line in lines if line.strip().startswith("map ")
                  and f"node={change.node}" not in line.strip()[4:].split(",")]  # merge: other nodes' entries stay
        if change.id not in sections:
            order.append(change.id)
        sections[change.id] = others + [f"\tmap {map_string(m)}" for m in change.maps] + kept
    return "".join(f"{name}\n" + "".join(f"{line}\n" for line in sections[name]) + "\n" for name in order)


def show_dry_diffs() -> None:
    """--dry: run every operation body of this host as far as it goes without executing
    anything, so each prints the diff of what it would change (pyinfra 3 runs them only for its
    change detection, which `-y` skips). Bodies read facts; none changes the host."""
    state = host.state
    for op_hash, op_data in list(state.ops.get(host, {}).items()):
        try:
            for _ in op_data.command_generator():
                pass
        except Exception as exc:  # a body that needs an earlier operation's effect: no diff
            logger.debug(f"{host.name}: no --dry diff for operation {op_hash}: {exc}")
