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
    not crossing into proc/sys/dev (the twin's rendered hardware mounts) and skipping VOLATILE.

    A twin's root is an overlay over its read-only cached root: there the same manifest is the
    cached root's (walked once, kept beside it in .cache/twin) with the overlay's upper dir laid
    over it as overlayfs lays it (whiteouts delete, opaque dirs hide what is below) and the mounts
    under root walked whole; anything that merge cannot follow (redirected or metacopy entries,
    several lower dirs) is walked whole. PVEGPU_E2E_MANIFEST_CHECK=1 walks whole as well and
    fails on any difference."""
    root = Path(root)
    hashes = _HASHES.pop(str(root), {})
    _HASHES[str(root)] = hashes  # the newest last; the oldest roots' hashes go
    while len(_HASHES) > 4:
        del _HASHES[next(iter(_HASHES))]
    merged = _overlay_manifest(root, hashes)
    if merged is None or os.environ.get("PVEGPU_E2E_MANIFEST_CHECK") == "1":
        whole = _walk_manifest(root, root, hashes, top=True)
        if merged is not None and merged != whole:
            raise AssertionError(f"overlay manifest of {root} differs from the whole walk: "
                                 f"{manifest_diff(whole, merged)[:20]}")
        merged = whole
    return {rel: entry for rel, entry in merged.items()
            if not (rel.startswith(volatile) or rel + "/" in volatile)}


def _entry(path: str, st: os.stat_result, hashes: dict) -> tuple:
    if stat.S_ISLNK(st.st_mode):
        return ("l", os.readlink(path))
    if stat.S_ISREG(st.st_mode):
        return ("f", stat.S_IMODE(st.st_mode), _sha256(path, st, hashes))
    if stat.S_ISDIR(st.st_mode):
        return ("d", stat.S_IMODE(st.st_mode))
    return ("o", st.st_mode)


def _walk_manifest(top_dir: Path, root: Path, hashes: dict, top: bool = False) -> dict[str, tuple]:
    """Every entry under top_dir keyed relative to root (os.walk: into mounts, not into symlinked
    dirs); at root's own top, not into proc/sys/dev."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(top_dir):
        if top and dirpath == str(top_dir):
            dirnames[:] = [d for d in dirnames if d not in ("proc", "sys", "dev")]
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = _entry(path, os.lstat(path), hashes)
    return out


def _unescape(field: str) -> str:  # /proc/self/mountinfo writes space, tab, newline, backslash as \ooo
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of this process's mounts, in mount order."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out.append((_unescape(fields[4]), fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""))
    return out


# The cached roots' manifests: {(lower dir, its .twin-complete's inode and mtime): manifest}
_LOWER: dict[tuple, dict[str, tuple]] = {}
_OVERLAY_XATTRS = ("trusted.overlay.", "user.overlay.")


def _xattr(path: str, name: str) -> bytes | None:
    for prefix in _OVERLAY_XATTRS:
        try:
            return os.getxattr(path, prefix + name, follow_symlinks=False)
        except OSError:
            continue
    return None


def _lower_manifest(lower: Path, hashes: dict) -> dict[str, tuple] | None:
    """The manifest of a complete cached twin root (tests/twin/runtime.py never writes one again),
    from memory, from its file beside it, or walked and written there."""
    import json
    import pickle

    try:
        st = os.stat(lower / ".twin-complete")
    except OSError:
        return None  # not a cached twin root: nothing says it stays as it is
    key = (str(lower), st.st_ino, st.st_mtime_ns)
    if key in _LOWER:
        return _LOWER[key]
    kept = lower.with_name(lower.name + ".manifest")
    try:
        with open(kept, "rb") as f:
            stored_key, manifest = pickle.load(f)
        if stored_key != json.dumps(key):
            raise ValueError("another root")
    except (OSError, ValueError, EOFError, pickle.UnpicklingError):
        manifest = _walk_manifest(lower, lower, {}, top=True)
        part = kept.with_name(f"{kept.name}.{os.getpid()}")
        with open(part, "wb") as f:
            pickle.dump((json.dumps(key), manifest), f)
        os.replace(part, kept)
    _LOWER[key] = manifest
    return manifest


def _overlay_manifest(root: Path, hashes: dict) -> dict[str, tuple] | None:
    """root's manifest from its overlay's layers (None: not an overlay this can merge)."""
    real = os.path.realpath(root)
    mounts = _mounts()
    here = [(fstype, opts) for point, fstype, opts in mounts if point == real]
    if not here or here[-1][0] != "overlay":
        return None
    opts = dict(o.split("=", 1) for o in here[-1][1].split(",") if "=" in o)
    lower, upper = opts.get("lowerdir", ""), opts.get("upperdir")
    if not upper or not lower or ":" in lower or "\\" in lower + upper:
        return None
    base = _lower_manifest(Path(lower), hashes)
    if base is None:
        return None
    out = dict(base)
    # the mounts under root but outside proc/sys/dev: walked whole (the outermost of each nest)
    skip = tuple(os.path.join(real, d) for d in ("proc", "sys", "dev"))
    subs: list[str] = []
    for point, _fstype, _opts in mounts:
        if point.startswith(real + "/") and not any(point == d or point.startswith(d + "/") for d in skip):
            if not any(point == s or point.startswith(s + "/") for s in subs):
                subs.append(point)

    def drop(rel: str) -> None:  # rel and everything below it (only a dir has anything below)
        if out.pop(rel, ("",))[0] == "d":
            below = rel + "/"
            for k in [k for k in out if k.startswith(below)]:
                del out[k]

    top_skip = {"proc", "sys", "dev"}
    sub_rels = {os.path.relpath(s, real) for s in subs}
    for dirpath, dirnames, filenames in os.walk(upper):
        rel_dir = os.path.relpath(dirpath, upper)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d not in top_skip]
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            st = os.lstat(path)
            if _xattr(path, "redirect") is not None or _xattr(path, "metacopy") is not None:
                return None  # content that lives elsewhere in the lower: walk whole
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # a whiteout: gone from the merged view
                drop(rel)
                continue
            if stat.S_ISDIR(st.st_mode):
                if _xattr(path, "opaque") == b"y" or out.get(rel, ("d",))[0] != "d":
                    drop(rel)  # an opaque dir (or one over a lower non-dir) hides what is below it
            else:
                drop(rel)
            out[rel] = _entry(path, st, hashes)
        # a mount point's own dir is walked with its mount below
        dirnames[:] = [d for d in dirnames if (d if rel_dir == "." else f"{rel_dir}/{d}") not in sub_rels]
    for sub in subs:
        rel = os.path.relpath(sub, real)
        drop(rel)
        out[rel] = _entry(sub, os.lstat(sub), hashes)
        if os.path.isdir(sub) and not os.path.islink(sub):
            out.update(_walk_manifest(Path(sub), Path(real), hashes))
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
