"""State of the files pvegpu manages, for many paths in one remote command.

pyinfra's stock `files.template`/`files.put` cost several round trips per file; stages
instead read all their files' state at once with `ManagedFiles` and compare locally.
"""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from facts.shared import FILE_SUMS, take_set
from facts.shell import word

_MARK = "==> pvegpu-file "
_MODES = "==> pvegpu-modes"  # then `stat -c '%a %n'` of every regular file
_SUMS = "==> pvegpu-sums"  # then `sha256sum` of every regular file (facts.shared.FILE_SUMS prints it)


class ManagedFiles(FactBase):
    """Mode and sha256 of each path; a symlink's target; None when it does not exist (or is
    neither a regular file nor a symlink).

    .. code:: python

        {"/etc/modprobe.d/pvegpu-nvidia.conf": {"mode": "644", "sha256": "9f86d0..."},
         "/etc/systemd/system/multi-user.target.wants/x.service": {"link": "/etc/systemd/system/x.service"},
         "/etc/nccl.conf": None}
    """

    def command(self, paths):
        # Regular files are read by one `stat` and one `sha256sum` for all of them (a program per
        # file before: 3 per file), through facts.shared's FILE_SUMS reading: a probe whose
        # sections read managed files takes it once over all their paths, and each section prints
        # the whole reading (`process` keeps the paths its own markers name). A symlink's target
        # is one `readlink` (rare: the stages manage few links).
        if not paths:
            return "true"
        for p in paths:
            if "\n" in p or "\r" in p:
                raise ValueError(f"ManagedFiles: a path with a line break cannot be read back: {p!r}")
        quoted = [word(p) for p in paths]
        return (
            f"m=; for f in {' '.join(quoted)}; do printf '%s\\n' {word(_MARK)}\"$f\"; "
            'if [ -L "$f" ]; then echo LINK; readlink -- "$f"; '
            'elif [ -f "$f" ]; then echo FILE; m=1; else echo MISSING; fi; done; '
            f"if [ -n \"$m\" ]; then {take_set(FILE_SUMS, quoted)}; echo {word(_MODES)}; "
            f"printf '%s\\n' \"${FILE_SUMS}\"; fi"
        )

    def process(self, output):
        blocks: dict[str, list[str]] = {}
        modes: dict[str, str] = {}
        sums: dict[str, str] = {}
        current: list[str] | None = None
        part = "blocks"
        for line in output:
            if line.startswith(_MARK):
                part = "blocks"
                current = blocks.setdefault(line[len(_MARK):], []) if line[len(_MARK):] else None
            elif line == _MODES:
                part = "modes"
            elif line == _SUMS:
                part = "sums"
            elif part == "modes":
                mode, _, name = line.partition(" ")
                modes[name] = mode
            elif part == "sums":
                digest, name = _sha256sum_line(line)
                if name is not None:
                    sums[name] = digest
            elif current is not None and line.strip():
                current.append(line.strip())
        result: dict[str, dict | None] = {}
        for path, values in blocks.items():
            if len(values) >= 2 and values[0] == "LINK":
                result[path] = {"link": values[1]}
            elif values[:1] == ["FILE"]:
                ok = path in modes and path in sums  # a file gone or unreadable since the test
                result[path] = {"mode": modes[path], "sha256": sums[path]} if ok else None
            elif len(values) >= 2 and values[0] != "MISSING":  # the per-file form (recordings)
                result[path] = {"mode": values[0], "sha256": values[1]}
            else:
                result[path] = None
        return result


def _sha256sum_line(line: str) -> tuple[str, str | None]:
    """(digest, file name) of one line of GNU `sha256sum FILE...`: a name with a backslash or a
    line break is escaped and the line starts with a backslash."""
    escaped = line.startswith("\\")
    if escaped:
        line = line[1:]
    digest, sep, name = line.partition("  ")
    if not sep:
        return line, None
    if escaped:
        name = re.sub(r"\\(.)", lambda m: {"n": "\n", "r": "\r"}.get(m.group(1), m.group(1)), name)
    return digest, name


class FileTexts(FactBase):
    """The text of each path (None when it is not a readable file); read only by ``--dry``
    to show the diff of a file that would change (operations/backup.py).

    .. code:: python

        {"/etc/pve/qemu-server/300.conf": "boot: order=scsi0\n...", "/etc/nccl.conf": None}
    """

    def command(self, paths):
        parts = []
        for p in paths:
            if "\n" in p or "\r" in p:
                raise ValueError(f"FileTexts: a path with a line break cannot be read back: {p!r}")
            q = word(p)
            parts.append(f"echo {word(_TEXT + p)}; if [ -f {q} ] && [ -r {q} ]; then "
                         f"base64 -w0 < {q}; echo; else echo MISSING; fi")
        return "; ".join(parts) + "; true" if parts else "true"

    def process(self, output):
        return parse_file_texts(output)


_TEXT = "==> pvegpu-text "


def parse_file_texts(lines: list[str]) -> dict[str, str | None]:
    import base64

    out: dict[str, str | None] = {}
    path = None
    for line in lines:
        if line.startswith(_TEXT):
            path = line[len(_TEXT):]
            out[path] = None
        elif path is not None and out[path] is None and line.strip() and line.strip() != "MISSING":
            out[path] = base64.b64decode(line.strip()).decode(errors="replace")
    return out
