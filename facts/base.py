"""Shared base of the facts whose command is one fixed shell string."""

from __future__ import annotations

from pyinfra.api import FactBase


class ShellFact(FactBase):
    """A fact whose `command` is a plain string, not a method: pyinfra 3.10 runs it as is
    (pyinfra/api/facts.py `_make_command` calls `command` only when it is callable), and the
    stages splice it into their one-command probes (``f"{NvidiaDriver.command}; ..."``)."""

    abstract = True
    # pyinfra types `command` as a method; a fixed string is the other form it accepts (above).
    command: str  # type: ignore[assignment]
