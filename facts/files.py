"""State of the files pvegpu manages, for many paths in one remote command.

pyinfra's stock `files.template`/`files.put` cost several round trips per file; stages
instead read all their files' state at once with `ManagedFiles` and compare locally.
"""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

_MARK = "==> pvegpu-file "


class ManagedFiles(FactBase):
    """Mode and sha256 of each path; a symlink's target; None when it does not exist (or is
    neither a regular file nor a symlink).

    .. code:: python

        {"/etc/modprobe.d/pvegpu-nvidia.conf": {"mode": "644", "sha256": "9f86d0..."},
         "/etc/systemd/system/multi-user.target.wants/x.service": {"link": "/etc/systemd/system/x.service"},
         "/etc/nccl.conf": None}
    """

    def command(self, paths):
        parts = []
        for p in paths:
            q = shlex.quote(p)
            parts.append(
                f"echo {shlex.quote(_MARK + p)}; "
                f"if [ -L {q} ]; then echo LINK; readlink {q}; "
                f"elif [ -f {q} ]; then stat -c %a {q}; sha256sum < {q} | cut -d' ' -f1; else echo MISSING; fi"
            )
        return "; ".join(parts) or "true"

    def process(self, output):
        result: dict[str, dict | None] = {}
        current = None
        values: list[str] = []
        for line in list(output) + [_MARK]:
            if line.startswith(_MARK):
                if current is not None:
                    if len(values) >= 2 and values[0] == "LINK":
                        result[current] = {"link": values[1]}
                    elif len(values) >= 2 and values[0] != "MISSING":
                        result[current] = {"mode": values[0], "sha256": values[1]}
                    else:
                        result[current] = None
                current = line[len(_MARK):] or None
                values = []
            elif line.strip():
                values.append(line.strip())
        return result
