"""Text a container controls reaches pvegpu's output with its control characters escaped (issue 39
item 8): `plan.terminal.visible`, the CT installer's progress and failure output
(operations/progress.py with a `pct` that answers like a hostile CT), and pyinfra's own printing
of a command's output (compat/terminal_output.py)."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path
from queue import Queue
from types import SimpleNamespace
from typing import Any

import gevent.subprocess
import pytest
from pyinfra_testing.util import get_command_string

from operations import progress
from plan.terminal import visible, visible_lines

CLEAR = "\x1b[2J\x1b[H"                      # ED: clear the screen, cursor home
OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"          # OSC 52: write the operator's clipboard
TITLE = "\x1b]0;pwned\x1b\\"                  # OSC 0 ended by ST
C1_CSI = "\x9b31m"                            # CSI as one C1 character


def test_visible_escapes_controls_and_keeps_text():
    assert visible(f"a{CLEAR}b") == "a\\x1b[2J\\x1b[Hb"
    assert visible(OSC52) == "\\x1b]52;c;cm0gLXJmIH4=\\x07"
    assert visible(TITLE) == "\\x1b]0;pwned\\x1b\\"
    assert visible(C1_CSI) == "\\x9b31m"
    assert visible("del\x7f nul\x00 bs\x08 vt\x0b ff\x0c") == "del\\x7f nul\\x00 bs\\x08 vt\\x0b ff\\x0c"
    # a lone CR would let the text overwrite the line it is printed on; CRLF is a line end
    assert visible("ok\rFAKE") == "ok\\x0dFAKE" and visible("a\r\nb") == "a\nb"
    # bidi overrides/isolates and the Unicode line separators reorder or break what is shown
    assert visible("x\u202eevil\u2066y\u2028z") == "x\\u202eevil\\u2066y\\u2028z"
    # newline, tab, UTF-8 text and printable ASCII stay as they are
    text = "CC [M]  /src/nv.o\tcafé — 日本\nnext line \\x1b literal"
    assert visible(text) == text
    assert visible_lines(["\x1b[1m", "ok"]) == ["\\x1b[1m", "ok"]


class LocalHost:
    """run_shell_command on this machine, cooperatively (pyinfra runs greenlets under gevent)."""

    name = "local"

    def __init__(self, env):
        self.env = env

    def run_shell_command(self, command):
        done = gevent.subprocess.run(["sh", "-c", get_command_string(command)], capture_output=True, env=self.env)
        # lines split at \n only, as pyinfra reads an SSH channel (a CR stays in its line)
        return done.returncode == 0, SimpleNamespace(stdout_lines=done.stdout.decode().split("\n")[:-1],
                                                     stderr_lines=done.stderr.decode().split("\n")[:-1])


@pytest.fixture
def hostile_pct(tmp_path: Path) -> dict:
    """A `pct` on PATH whose CT writes escape sequences: into the installer log the progress probe
    tails (pct exec ... sh -c 'tail -n 1 LOG'), and to stderr when the installer runs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pct = bin_dir / "pct"
    pct.write_text("#!/bin/sh\n"
                   "# pct exec <ct> -- sh -c 'tail -n 1 <log>': the CT's log line\n"
                   "case \"$*\" in *tail*) printf 'installing\\033[2J\\033]52;c;cm0gLXJmIH4=\\007 \\302\\2336n\\n'; exit 0;; esac\n"
                   "sleep 1\n"
                   "printf 'ERROR: \\033]0;pwned\\033\\\\ \\033[31mred\\033[0m\\roverwritten\\n' >&2\n"
                   "exit 1\n")
    pct.chmod(pct.stat().st_mode | stat.S_IXUSR)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_an_esc_in_a_cts_output_reaches_pvegpus_output_escaped(hostile_pct, caplog, monkeypatch, tmp_path):
    """The CT installer's path (operations/containers.py): its log's last line in the progress
    reports (`progress.ct_log_probe` through pct exec) and its `pct exec` stderr when it fails."""
    monkeypatch.setattr(progress, "RECORD_DIR", str(tmp_path / "durations"))
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        ok = progress.run_reported(None, LocalHost(hostile_pct), "pct exec 200 -- sh /root/.pvegpu-x.run",
                                   "NVIDIA 1.0 user space in CT 200", probe=progress.ct_log_probe(200, "/var/log/x.log"),
                                   every_s=0.3)
    assert ok is False
    out = "\n".join(r.getMessage() for r in caplog.records)
    assert "\x1b" not in out and "\x07" not in out and "\x9b" not in out and "\r" not in out
    assert "last: installing\\x1b[2J\\x1b]52;c;cm0gLXJmIH4=\\x07 \\x9b6n" in out
    assert "ERROR: \\x1b]0;pwned\\x1b\\ \\x1b[31mred\\x1b[0m\\x0doverwritten" in out


def test_pyinfra_prints_a_failed_commands_output_escaped(caplog, monkeypatch):
    """pyinfra's own printing (a failed StringCommand's lines; -v output as it arrives), with the
    wrappers deploy.py installs; the lines pvegpu reads stay as the host wrote them."""
    import pyinfra.api.facts as pyinfra_facts
    import pyinfra.api.operations as pyinfra_operations
    import pyinfra.connectors.util as connector_util

    from compat import terminal_output

    saved = (pyinfra_operations.print_host_combined_output, pyinfra_facts.print_host_combined_output,
             connector_util.read_buffer)
    try:
        terminal_output.install()
        assert terminal_output.install() is False  # once per process; each host's deploy.py calls it
        output = connector_util.CommandOutput([connector_util.OutputLine("stderr", f"pct: {CLEAR}{OSC52}"),
                                               connector_util.OutputLine("stdout", f"x{C1_CSI}")])
        host: Any = SimpleNamespace(print_prefix="[kpro6] ")  # what print_host_combined_output reads of a Host
        with caplog.at_level(logging.ERROR, logger="pyinfra"):
            pyinfra_operations.print_host_combined_output(host, output)
            pyinfra_facts.print_host_combined_output(host, output)
        printed = "\n".join(r.getMessage() for r in caplog.records)
        assert "\x1b[2J" not in printed and "\x07" not in printed and "\x9b" not in printed
        assert "pct: \\x1b[2J\\x1b[H\\x1b]52;c;cm0gLXJmIH4=\\x07" in printed and "x\\x9b31m" in printed
        assert output.stderr_lines == [f"pct: {CLEAR}{OSC52}"]  # what facts parse is untouched
        # -v: each line as it arrives (pyinfra's CLI sets click.echo as its echo)
        import pyinfra.api.output as pyinfra_output

        echoed: list = []
        monkeypatch.setattr(pyinfra_output, "_echo", lambda message=None, **kw: echoed.append(message))
        queue: Queue = Queue()
        connector_util.read_buffer("stderr", [f"{OSC52}warn\n"], queue, print_output=True,
                                   print_func=lambda line: f"[kpro6] {line}")
        assert echoed == ["[kpro6] \\x1b]52;c;cm0gLXJmIH4=\\x07warn"]
        assert queue.get().line == f"{OSC52}warn"
    finally:
        (pyinfra_operations.print_host_combined_output, pyinfra_facts.print_host_combined_output,
         connector_util.read_buffer) = saved


def test_the_wrappers_refuse_a_pyinfra_that_does_not_fit():
    from compat import terminal_output

    modules = terminal_output._modules()
    assert terminal_output.refusal(modules) is None  # the pinned pyinfra fits
    odd = dict(modules, **{"pyinfra.connectors.util": SimpleNamespace(read_buffer=lambda name, io: None)})
    assert terminal_output.refusal(odd) == "pyinfra.connectors.util.read_buffer takes (name, io)"


def test_a_ct_log_that_never_answers_does_not_hold_the_report_loop(tmp_path, monkeypatch):
    """The CT's owner makes the installer log a FIFO (or anything that blocks a read): the progress
    probe gives up after CT_PROBE_TIMEOUT_S and the operation ends when its command does (issue 39)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pct = bin_dir / "pct"
    pct.write_text("#!/bin/sh\ncase \"$*\" in *tail*) exec sleep 300;; esac\nexit 0\n")
    pct.chmod(pct.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    monkeypatch.setattr(progress, "RECORD_DIR", str(tmp_path / "durations"))
    monkeypatch.setattr(progress, "CT_PROBE_TIMEOUT_S", 1)
    started = time.monotonic()
    with gevent.Timeout(30, AssertionError("the report loop waited on the CT's log")):
        ok = progress.run_reported(None, LocalHost(env), "sleep 1", "NVIDIA 1.0 user space in CT 200",
                                   probe=progress.ct_log_probe(200, "/var/log/x.log"), every_s=0.2)
    assert ok is True and time.monotonic() - started < 10
