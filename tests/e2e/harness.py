"""Helpers for whole-run tests against twins: run pyinfra, read its summary, count remote
commands, and take a manifest of a twin's root to prove `--dry` changed nothing."""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
PYTEST = str(Path(sys.executable).with_name("pytest"))

# Written by sshd on every login (utmp/wtmp accounting) or by the twin runtime on every boot;
# not configuration, and not something a deploy writes.
VOLATILE = (
    "var/log/wtmp", "var/log/btmp", "var/log/lastlog", "run/", "tmp/", "var/tmp/",
    "var/lib/twin/uptime", "root/.cache/",
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class PyinfraRun:
    rc: int
    output: str
    totals: dict[str, int]  # {"success": changed ops, "error": n, "no_change": n}
    remote_commands: int  # commands pyinfra sent (facts + operations), from --debug lines

    @property
    def changed(self) -> int:
        return self.totals.get("success", 0)


def spec_inventory(tmp: Path, twin, host: dict, name: str) -> str:
    """A pyinfra inventory of one twin from a spec written as `<name>.yml` (JSON is YAML): the
    twin's ssh block plus the spec fields `host`, loaded by spec.load as a user's inventory is, with
    the twin's host key not checked. Returns the inventory's path (`<name>_inventory.py`)."""
    import json

    spec = {"hosts": {twin.name: {"ssh": {"hostname": twin.address, "port": twin.port, "user": "root",
                                          "key": twin.key}, **host}}}
    yml = tmp / f"{name}.yml"
    yml.write_text(json.dumps(spec))
    inv = tmp / f"{name}_inventory.py"
    overrides = {twin.name: {"ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off"}}
    inv.write_text("from spec.load import inventory_hosts\n"
                   f"hosts = inventory_hosts({str(yml)!r}, overrides={overrides!r})\n")
    return str(inv)


def write_tarball(archive: Path, top: str, files: dict[str, str]) -> Path:
    """A .tar.gz at `archive` of `files` ({path: text}) under `top`/, each 0644 with one fixed
    mtime (an upstream source archive as the stages fetch it)."""
    with tarfile.open(archive, "w:gz") as tar:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{top}/{path}")
            info.size, info.mode, info.mtime = len(data), 0o644, 1700000000
            tar.addfile(info, BytesIO(data))
    return archive


def parse_totals(output: str) -> dict[str, int]:
    """pyinfra's "Grand total" row: Hosts, Success (changed), Error, No Change ('-' = 0)."""
    for line in reversed(_ANSI.sub("", output).splitlines()):
        if line.strip().startswith("Grand total"):
            cols = line.split()[2:]
            nums = [0 if c == "-" else int(c) for c in cols[:4]]
            return dict(zip(("hosts", "success", "error", "no_change"), nums, strict=False))  # a short row: the columns it has
    return {}


def run_pyinfra(inventory: str, deploy: str = "deploy.py", *args: str, env: dict | None = None,
                timeout: int = 1800) -> PyinfraRun:
    """Run the pyinfra CLI like a user does (with --debug to count remote commands)."""
    full_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    proc = subprocess.run(
        [PYINFRA, "-y", "--debug", inventory, deploy, *args],
        cwd=REPO, capture_output=True, text=True, env=full_env, timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    commands = len(re.findall(r"Running command on ", out))
    return PyinfraRun(proc.returncode, out, parse_totals(out), commands)


def run_host_checks(inventory: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTEST, "-q", "-p", "no:cacheprovider", "tests/host", "--inventory", inventory],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout,
    )


def root_manifest(root: str | Path, volatile: tuple[str, ...] = VOLATILE) -> dict[str, tuple]:
    """{relative path: (type, mode, sha256 or link target)} for every entry under root,
    not crossing into proc/sys/dev (the twin's rendered hardware mounts) and skipping VOLATILE."""
    root = Path(root)
    out: dict[str, tuple] = {}
    hashes = _HASHES.pop(str(root), {})
    _HASHES[str(root)] = hashes  # the newest last; the oldest roots' hashes go
    while len(_HASHES) > 4:
        del _HASHES[next(iter(_HASHES))]
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in ("proc", "sys", "dev")]
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if rel.startswith(volatile) or rel + "/" in volatile:
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("f", stat.S_IMODE(st.st_mode), _sha256(path, st, hashes))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("o", st.st_mode)
    return out


# Per root (the last few manifested), the sha256 of each regular file by what changes whenever its
# content does: device, inode, size, mtime and ctime. A write sets ctime to now and nothing sets it
# back, so a file with the same five was not written since; one whose ctime is within 2 s of its
# hashing could still be written in the same clock tick, and is hashed again next time. A root's
# second manifest (after a --dry run) then reads only what changed.
_HASHES: dict[str, dict[tuple[int, int, int, int, int], str]] = {}
RECENT_NS = 2_000_000_000


def _sha256(path: str, st: os.stat_result, hashes: dict[tuple[int, int, int, int, int], str]) -> str:
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key in hashes:
        return hashes[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if time.time_ns() - st.st_ctime_ns > RECENT_NS:
        hashes[key] = h.hexdigest()
    return h.hexdigest()


def manifest_diff(before: dict, after: dict) -> list[str]:
    lines = []
    for p in sorted(set(before) | set(after)):
        if before.get(p) != after.get(p):
            lines.append(f"{p}: {before.get(p)} -> {after.get(p)}")
    return lines
