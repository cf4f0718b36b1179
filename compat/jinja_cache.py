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
"""

from __future__ import annotations

import os
from pathlib import Path

import jinja2
from jinja2.bccache import Bucket


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pvegpu" / "jinja"


class _QuietCache(jinja2.FileSystemBytecodeCache):
    """jinja2's file cache, where a failure to read or write a file only costs a compile."""

    def load_bytecode(self, bucket: Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # unreadable, or not jinja's (pickle/marshal refuse it): compile again
            bucket.reset()

    def dump_bytecode(self, bucket: Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:  # full or read-only: this run compiled it, the next one will too
            pass


def use_template_cache(env: jinja2.Environment, directory: Path | None = None) -> bool:
    """Give `env` the file cache of compiled templates in `directory` (default `cache_dir()`);
    False (and no cache) when the directory cannot be made or written."""
    directory = directory or cache_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return False
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    env.bytecode_cache = _QuietCache(str(directory))
    return True
