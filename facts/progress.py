"""How long each long build took on this host: the records operations/progress.py keeps
(`RECORD_DIR/<key>`, a ``seconds N`` and an ``objects N`` line), read back as one fact."""

from __future__ import annotations

from facts.base import ShellFact
from facts.sections import SECTION, split_sections
from facts.shared import EACH_FILE, read_file

RECORD_DIR = "/var/lib/pvegpu/durations"


def parse_durations(lines: list[str]) -> dict:
    """Pure parser of `Durations` output: a ``@@ <key>`` section per record, its
    ``seconds N`` / ``objects N`` lines."""
    records: dict = {}
    for key, body in split_sections(lines).items():
        current = records.setdefault(key, {"seconds": None, "objects": None})
        for line in body:
            name, _, value = line.partition(" ")
            if name in ("seconds", "objects") and value.strip().isdigit():
                current[name] = int(value.strip())
    return records


class Durations(ShellFact):
    """How long each recorded build took on this host (`RECORD_DIR`).

    .. code:: python

        {"kernel-3f0c…": {"seconds": 3720, "objects": 4817},
         "nvidia-535.309.01-6.1.0-57-amd64-8c1f…": {"seconds": 402, "objects": 212}}
    """

    command = (f"for f in {RECORD_DIR}/*; do [ -f \"$f\" ] || continue; "
               f"case \"$f\" in *.part) continue;; esac; echo \"{SECTION}${{f##*/}}\"; {read_file(EACH_FILE)}; done; true")

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_durations(list(output))
