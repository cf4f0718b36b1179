"""The one section-marker convention of every multi-section command.

A command that prints several parts prints a marker line before each: ``@@ NAME`` (`SECTION`),
e.g. ``echo '@@ firmware'`` or ``echo "@@ $f"`` in a loop over files. `split_sections` cuts
the output back into ``{NAME: [lines]}``; `parse_sections` also hands each known section to its
parser (the one reader of "split, then parse every named section").

A batched probe (`facts.hardware.SectionedProbe`, `facts.hardware.combined_probe`, and the
stage facts built like them) runs whole facts' commands as its sections, and those print
``@@ `` markers of their own; its markers are ``@@pvegpu-section NAME`` (`PROBE_SECTION`), so
a nested fact's ``@@ `` lines stay inside its section and go to that fact's parser as they are.
Neither prefix is a prefix of the other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from facts.shell import word

SECTION = "@@ "
PROBE_SECTION = "@@pvegpu-section "


def section_echo(name: str, marker: str = SECTION) -> str:
    """The shell that prints the marker line of section `name` (quoted as one word)."""
    return f"echo {word(marker + name)}"


def split_sections(output_lines: Iterable[str], marker: str = SECTION,
                   names: Iterable[str] | None = None) -> dict[str, list[str]]:
    """Lines after `marker` lines, by the name that follows the marker (stripped); lines
    before the first marker are dropped, a repeated name continues its section. With `names`,
    only a marker of one of them starts a section; another marker line is a line of the section
    it is in (a nested probe's own markers: see `parse_sections`)."""
    known = None if names is None else set(names)
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in output_lines:
        if line.startswith(marker) and (known is None or line[len(marker):].strip() in known):
            current = sections.setdefault(line[len(marker):].strip(), [])
        elif current is not None:
            current.append(line)
    return sections


def parse_sections(output_lines: Iterable[str], parsers: Mapping[str, Callable[[list[str]], Any]],
                   marker: str = SECTION, nested: bool = False) -> dict[str, Any]:
    """``{NAME: parser(lines of section NAME)}`` for each NAME of `parsers`, in their order (cut
    by `split_sections` with `marker`). A section the output lacks goes to its parser as no
    lines; a section no parser names is not read. `nested`: only the parsers' names cut, so a
    section whose fact prints `marker` lines of its own (facts.kernel.KernelStageFacts, a probe
    in `facts.hardware.combined_probe`'s batch) gets them whole."""
    sections = split_sections(output_lines, marker, parsers if nested else None)
    return {name: parse(sections.get(name, [])) for name, parse in parsers.items()}
