"""Atomic, batched writes of the files pvegpu owns.

`managed_file` compares against the state read once by `facts.files.ManagedFiles` and, only
when content or mode differ, writes a temp file next to the target, keeps the previous
version as `<path>.pvegpu-prev`, and renames into place (an interrupted write never leaves a
half-written config). One remote command per changed file, none for an unchanged one.
"""

from __future__ import annotations

import base64
import hashlib

from pyinfra import host
from pyinfra.api import StringCommand, operation

from facts.files import FileTexts, ManagedFiles
from facts.once import read_fact
from facts.shell import operands, word
from operations.backup import is_dry, log_diff


def sha256_text(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def write_file_command(path: str, content: str, mode: str = "644", keep_previous: bool = True) -> str:
    """The one shell command that writes `content` to `path` atomically."""
    # a path may hold spec values (a unit's drop-in dir): coreutils' operands after '--'
    q = word(path)
    tmp = word(path + ".pvegpu-tmp")
    b64 = base64.b64encode(content.encode()).decode()
    keep = f"if [ -f {q} ]; then cp -p {operands([path, path + '.pvegpu-prev'])}; fi; " if keep_previous else ""
    # umask 022: a directory it makes is 0755 whatever the caller's umask (issue 39), the file gets `mode`
    return (
        f"umask 022 && mkdir -p {operands(path.rsplit('/', 1)[0] or '/')} && "
        f"printf %s {b64} | base64 -d > {tmp} && chmod {word(mode)} {operands(path + '.pvegpu-tmp')} && "
        f"{keep}mv -f {operands([path + '.pvegpu-tmp', path])}"
    )


def file_current(state: dict | None, content: str, mode: str) -> bool:
    """Whether a `ManagedFiles` entry already holds `content` with `mode` (the one up-to-date test)."""
    return bool(state and state.get("sha256") == sha256_text(content) and state.get("mode") == mode.lstrip("0"))


@operation()
def managed_file(path: str, content: str, mode: str = "644", state: dict | None = None, keep_previous: bool = True):
    """Make `path` hold exactly `content` with `mode`.

    + path: absolute path on the host
    + content: the full text (rendered from a template in templates/)
    + mode: octal mode string, e.g. "644"
    + state: this path's entry from `ManagedFiles` (read once per stage); fetched when omitted
    + keep_previous: keep the old version as `<path>.pvegpu-prev`

    .. code:: python

        files_state = read_fact(ManagedFiles, paths=[path])
        managed_file(name="nvidia options", path=path, content=text, state=files_state[path])
    """
    if state is None:
        state = read_fact(ManagedFiles, paths=[path]).get(path)
    if file_current(state, content, mode):
        host.noop(f"{path} is up to date")
        return
    if is_dry():  # show what would change (one read, only for a file that would change)
        log_diff(path, read_fact(FileTexts, paths=[path]).get(path), content)
    yield StringCommand(write_file_command(path, content, mode, keep_previous))


@operation()
def absent_file(path: str, state: dict | None = None):
    """Remove a file pvegpu once wrote (no-op when it is already gone)."""
    if state is None:
        state = read_fact(ManagedFiles, paths=[path]).get(path)
    if state is None:
        host.noop(f"{path} is absent")
        return
    yield StringCommand(f"rm -f {operands(path)}")


@operation()
def link_unit(link: str, target: str, current: str | None):
    """Enable a unit by its wants symlink (what `systemctl enable` does; systemd need not run)."""
    if current == target:
        host.noop(f"{link} -> {target}")
        return
    yield StringCommand(f"umask 022 && mkdir -p {operands(link.rsplit('/', 1)[0])} && ln -sfn {operands([target, link])}")
