"""Keep the templates' compiled code between runs, as Python keeps modules' in __pycache__.

jinja2 compiles a template to Python code the first time a process asks for it: ~2 ms each here
(all 29 of templates/ in 65 ms), and a no-change converge of the kpro6 twin renders 8 of them to
compare with what the host has. jinja2's `FileSystemBytecodeCache` (jinja2 3.1, bccache.py)
keeps that code in files named by the template's name, each checked against the sha1 of the
template's source and the Python version (a changed template or another Python compiles again).

`use_template_cache(env)` gives `env` such a cache under the runner's user cache directory
(`$XDG_CACHE_HOME/pvegpu/jinja`, else `~/.cache/pvegpu/jinja`, made 0700: only its user can put
code there, the same user who runs pvegpu). A directory that cannot be made leaves `env` without
a cache; a file that cannot be written or read back is compiled again, never an error.

A cached file is code this process runs (jinja2 unmarshals it and executes it), so only what the
runner's own user wrote is used (issue 39 item 2): the directory must be a real directory (no
symlink) owned by the process's effective uid and writable by nobody else, else no cache at all;
each file is opened without following a link and used only when it is a regular file of that uid
that no group or other can write, else the template is compiled afresh (and its file replaced).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import jinja2
from jinja2.bccache import Bucket


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pvegpu" / "jinja"


def only_mine(st: os.stat_result, kind: int) -> bool:
    """`st` is of file type `kind` (stat.S_IFDIR, S_IFREG), owned by this process's effective uid,
    and no group or other may write it: nobody but the runner can have put code there."""
    return (stat.S_IFMT(st.st_mode) == kind and st.st_uid == os.geteuid()
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


class _QuietCache(jinja2.FileSystemBytecodeCache):
    """jinja2's file cache, where a failure to read or write a file only costs a compile, and a
    file someone else could have written is not read."""

    def load_bytecode(self, bucket: Bucket) -> None:
        # jinja2 bccache.py FileSystemBytecodeCache.load_bytecode opens the file by name; here it
        # is opened without following a link and checked on the descriptor that is read
        try:
            fd = os.open(self._get_cache_filename(bucket), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # absent, a link, unreadable: compile
            return
        with os.fdopen(fd, "rb") as f:
            if not only_mine(os.fstat(fd), stat.S_IFREG):
                return  # not the runner's own file: compile (dump_bytecode replaces it)
            try:
                bucket.load_bytecode(f)
            except Exception:  # not jinja's (marshal refuses it): compile again
                bucket.reset()

    def dump_bytecode(self, bucket: Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:  # full or read-only: this run compiled it, the next one will too
            pass


def use_template_cache(env: jinja2.Environment, directory: Path | None = None) -> bool:
    """Give `env` the file cache of compiled templates in `directory` (default `cache_dir()`);
    False (and no cache) when the directory cannot be made or written, or is not the runner's own
    (a link, another owner, writable by group or others)."""
    directory = directory or cache_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError:
        return False
    if not only_mine(st, stat.S_IFDIR) or not os.access(directory, os.W_OK | os.X_OK):
        return False
    env.bytecode_cache = _QuietCache(str(directory))
    return True
