"""Text from elsewhere, made safe to print on the operator's terminal (issue 39 item 8).

A container's installer log, the stderr of `pct exec`, a build log's last line, the rebind
journal: pvegpu prints such text in its output, and a terminal acts on the control characters
in it (ESC [2J clears the screen, OSC 52 writes the operator's clipboard, CSI moves the cursor
over earlier lines). `visible` writes each such character as ``\\xNN`` (``\\uNNNN`` above 0xff):
the C0 controls except newline and tab, DEL, the C1 controls (0x80-0x9f, which a UTF-8 terminal
may take as CSI/OSC too), and the Unicode characters that reorder or break a line on screen
(bidi embeddings/overrides/isolates, line/paragraph separator). A carriage return ends a line
only before a newline (CRLF becomes LF); a lone one, which would let the text overwrite what
is printed before it on the same line, is escaped too. Everything else is kept as it is.

One helper, used wherever such text is printed: operations/progress.py (the log's last line, a
failed command's stderr, the tail of a failed detached build), the rebind journal's lines,
the kernel hook's failure lines, the host checks after a reboot, the config diffs, and pyinfra's
own printing of a command's output (compat/terminal_output.py). The shell twin for build logs
is templates/nvidia-first-error.sh.j2.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# C0 without \t and \n, DEL, C1; bidi controls (U+200E/F marks, U+202A-202E, U+2066-2069); the
# Unicode line and paragraph separators
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group(0))
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def visible(text: str) -> str:
    """`text` with every control character escaped (see the module docstring); CRLF -> LF."""
    return _UNSAFE.sub(_escape, text.replace("\r\n", "\n"))


def visible_lines(lines: Iterable[str]) -> list[str]:
    """`visible` of each line."""
    return [visible(line) for line in lines]
