"""The first error of a failed NVIDIA build (templates/nvidia-first-error.sh.j2), the line the
kernel hook and the kernel stage's driver x kernel gate quote: run here with sh on real build logs
(tests/fixtures/nvidia-build-log/, each says how it was recorded)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from plan.render import render_template

LOGS = Path(__file__).resolve().parent.parent / "fixtures/nvidia-build-log"


def first_error(text: str, tmp_path: Path) -> str:
    log = tmp_path / "build.log"
    log.write_text(text)
    script = render_template("nvidia-first-error.sh.j2") + 'first_error "$1"\n'
    done = subprocess.run(["sh", "-c", script, "sh", str(log)], capture_output=True, text=True, check=True)
    assert done.stderr == ""
    return done.stdout


def recorded(name: str) -> str:
    """A fixture's log, less its two header lines (# source:, # machine:)."""
    lines = (LOGS / name).read_text().splitlines(keepends=True)
    assert lines[0].startswith("# source: ") and lines[1].startswith("# machine: ")
    return "".join(lines[2:])


def test_the_real_595_45_04_build_against_a_kernel_without_of_gpio_h(tmp_path):
    # conftest lines, "In file included from", the compiler's caret lines and make's own
    # "*** ... Error 1" lines come around it; the first diagnostic is the one quoted, its path
    # cut at the tree's kernel-open/
    assert first_error(recorded("595.45.04-kernel-without-of_gpio.txt"), tmp_path) == (
        "kernel-open/common/inc/nv-linux.h:1730:10: fatal error: linux/of_gpio.h: No such file or directory\n")


def test_a_build_that_stops_before_any_compile_quotes_make(tmp_path):
    # no compiler diagnostic: make's first *** line (here: kbuild wants src/'s nv-kernel.o_binary)
    assert first_error(recorded("595.45.04-src-not-built.txt"), tmp_path) == (
        "make[4]: *** No rule to make target '/opt/nv/open-gpu-kernel-modules-595.45.04/kernel-open/nvidia/"
        "nv-kernel.o_binary', needed by '/opt/nv/open-gpu-kernel-modules-595.45.04/kernel-open/nvidia/nv-kernel.o'."
        "  Stop.\n")


@pytest.mark.parametrize("text", ["", "  CONFTEST: drm_available\n  CC [M]  /t/kernel-open/nvidia/nv.o\n"
                                      "/t/kernel-open/nvidia/nv.c:12:5: warning: unused variable 'x'\n"])
def test_a_log_without_an_error_gives_nothing(tmp_path, text):
    assert first_error(text, tmp_path) == ""


def test_a_missing_log_gives_nothing(tmp_path):
    script = render_template("nvidia-first-error.sh.j2") + 'first_error "$1"\n'
    done = subprocess.run(["sh", "-c", script, "sh", str(tmp_path / "none.log")], capture_output=True, text=True)
    assert (done.stdout, done.stderr) == ("", "")


def test_an_esc_in_the_error_line_is_printed_escaped(tmp_path):
    """issue 39 item 8: the quoted line goes to a terminal (apt's, pvegpu's): ESC [2J, an OSC 52
    clipboard write, a C1 CSI (UTF-8 \\xc2\\x9b), DEL and a lone CR come out as \\xNN; tab, UTF-8
    text and the rest stay."""
    line = ("/t/kernel-open/nvidia/nv.c:1:1: error: \x1b[2J\x1b]52;c;cm0gLXJmIH4=\x07 bad\tx \xc2\x9b6n"
            " caf\xc3\xa9 \x7f\rover")
    log = tmp_path / "build.log"
    log.write_bytes(line.encode("latin-1") + b"\n")
    script = render_template("nvidia-first-error.sh.j2") + 'first_error "$1"\n'
    done = subprocess.run(["sh", "-c", script, "sh", str(log)], capture_output=True, check=True)
    assert done.stdout == (b"kernel-open/nvidia/nv.c:1:1: error: \\x1b[2J\\x1b]52;c;cm0gLXJmIH4=\\x07 bad\tx "
                           b"\\xc2\\x9b6n caf\xc3\xa9 \\x7f\\x0dover\n")
