"""facts.hardware: a batched probe's sections run in groups at once (`_grouped`), with the output
the sections print one after another: same bytes, same order, same values.

Run with the real dash (the /bin/sh of Debian and Proxmox hosts), over fake facts whose commands
sleep, print blank lines at their end, no newline at their end, NUL bytes, more than a pipe holds
(64 KiB), or read stdin."""

from __future__ import annotations

import shutil
import subprocess
import time
from itertools import pairwise

import pytest
from pyinfra.api import FactBase

from facts.hardware import (
    PROBE_GROUPS,
    SECTION_MARKER,
    HardwareProbe,
    SectionedProbe,
    combined_probe,
    fact_command,
    section_weight,
    split_groups,
)

DASH = shutil.which("dash") or "dash"
pytestmark = pytest.mark.skipif(shutil.which("dash") is None, reason="needs dash (the hosts' /bin/sh)")

SLEEP = 0.3


def _fact(name: str, command: str, requires: str | None = None) -> type[FactBase]:
    """A fact whose value is its output's lines (no output: [])."""
    return type(name, (FactBase,), {
        "__module__": __name__, "command": command,
        "process": lambda self, output: list(output), "default": staticmethod(list),
        "requires_command": lambda self, *a, **k: requires,
    })


def _dash(command: str) -> tuple[bytes, float, subprocess.CompletedProcess]:
    start = time.monotonic()
    proc = subprocess.run([DASH, "-c", command], capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
    return proc.stdout, time.monotonic() - start, proc


def _alone(fact_class: type[FactBase]) -> bytes:
    """What the fact's own command prints, run alone (stderr dropped, as a section drops it)."""
    return subprocess.run([DASH, "-c", f"( {fact_command(fact_class())} ) 2>/dev/null"], capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=60).stdout


def _command(fact: FactBase) -> str:
    assert isinstance(fact.command, str)
    return fact.command


def _expected(facts: list[type[FactBase]]) -> bytes:
    """The probe's output as the sections print it one after another: marker, the fact's bytes."""
    return b"".join(f"{SECTION_MARKER}c{i}\n".encode() + _alone(fc) for i, fc in enumerate(facts))


def test_sections_run_at_once_and_give_what_each_fact_gives_alone():
    facts = [_fact(f"Sleepy{i}", f"sleep {SLEEP}; echo 'value {i}'; echo 'second line {i}'") for i in range(8)]
    probe = combined_probe([(fc, {}) for fc in facts])
    out, wall, proc = _dash(_command(probe()))
    serial = SLEEP * len(facts)  # one after another: 2.4 s at least
    assert proc.returncode == 0
    # four groups of two: ~0.6 s; well under the serial sum however loaded the machine
    assert wall < serial / 2, f"{wall:.2f} s for sections that sleep {serial:.1f} s in all"
    assert out == _expected(facts)  # every byte, the sections in their order
    values = probe().process(out.decode().splitlines())
    assert values == [[f"value {i}", f"second line {i}"] for i in range(8)]


def test_a_sectioned_probe_runs_its_sections_in_groups_too():
    class Sleepy(SectionedProbe):
        abstract = False
        sections = {f"k{i}": (_fact(f"SleepyKey{i}", f"sleep {SLEEP}; echo {i}"), ()) for i in range(4)}

    out, wall, _ = _dash(_command(Sleepy()))
    assert wall < SLEEP * 4 / 2, f"{wall:.2f} s"
    lines = out.decode().splitlines()
    assert [line for line in lines if line.startswith(SECTION_MARKER)] == [f"{SECTION_MARKER}k{i}" for i in range(4)]
    assert Sleepy().process(lines) == {f"k{i}": [str(i)] for i in range(4)}


def test_output_comes_through_byte_for_byte_in_the_sections_order():
    """Later groups finish first (the first sleeps); their output waits, whole, for its turn:
    blank lines at a section's end, no newline at its end, NUL bytes (a shell variable would
    lose them: dash's command substitution drops NULs), more than a pipe holds."""
    facts = [
        _fact("SlowFirst", "sleep 0.4; printf 'first\\n\\n\\n'"),
        _fact("NoNewline", "printf 'no newline at the end'"),
        _fact("BlankTail", "printf 'x\\n\\n\\n\\n'"),
        _fact("Nul", "printf 'a\\000b\\n\\000'"),
        _fact("Big", "i=0; while [ $i -lt 3000 ]; do echo \"line $i of a long section, padded to some length\"; "
                     "i=$((i+1)); done; printf 'end without newline'"),
        _fact("Stdin", "cat; echo 'after cat'"),  # reads stdin: must not take another group's output
        _fact("Stderr", "echo out; echo err >&2; false"),
        _fact("Empty", "true"),
    ]
    probe = combined_probe([(fc, {}) for fc in facts])
    out, _, proc = _dash(_command(probe()))
    expected = _expected(facts)
    assert len(_alone(facts[4])) > 128 * 1024 and b"\0" in expected
    assert out == expected
    assert proc.returncode == 0 and proc.stderr == b""
    # and in four groups: each rule above crosses a group boundary somewhere
    assert _command(probe()).count("3<&0") == PROBE_GROUPS - 1


def test_more_than_the_buffer_holds_still_comes_in_order():
    """A group printing more than its dd holds (4 MiB) waits in the pipe for its turn: slower, same bytes."""
    facts = [_fact("Slow", "sleep 0.3; echo slow"),
             _fact("Huge", "head -c 5000000 /dev/zero | tr '\\0' 'y'; echo"),
             _fact("After", "echo after")]
    out, _, proc = _dash(_command(combined_probe([(fc, {}) for fc in facts])()))
    assert proc.returncode == 0 and out == _expected(facts)


def test_one_section_runs_as_before():
    probe = combined_probe([(_fact("One", "echo one"), {})])
    assert "3<&0" not in _command(probe()) and _dash(_command(probe()))[0] == f"{SECTION_MARKER}c0\none\n".encode()


def test_a_missing_program_skips_its_section_in_any_group():
    facts = [_fact("A", "echo a"), _fact("B", "echo b", requires="pvegpu-no-such-program"), _fact("C", "echo c")]
    out, _, _ = _dash(_command(combined_probe([(fc, {}) for fc in facts])()))
    assert out == f"{SECTION_MARKER}c0\na\n{SECTION_MARKER}c1\n{SECTION_MARKER}c2\nc\n".encode()


def test_the_shared_readings_are_taken_once_before_the_groups(tmp_path):
    """facts.shared's prelude runs before the pipeline; every group's sections find its variable."""
    from facts.shared import uname

    log = tmp_path / "uname.log"
    fake = tmp_path / "uname"
    fake.write_text(f"#!/bin/sh\necho called >> {log}\necho 9.9.9-test\n")
    fake.chmod(0o755)
    facts = [_fact(f"Uname{i}", f"sleep 0.1; {uname('r')}") for i in range(4)]
    command = _command(combined_probe([(fc, {}) for fc in facts])())
    out = subprocess.run([DASH, "-c", command], capture_output=True, timeout=60, stdin=subprocess.DEVNULL,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin"}).stdout.decode()
    assert out.splitlines() == [line for i in range(4) for line in (f"{SECTION_MARKER}c{i}", "9.9.9-test")]
    assert log.read_text() == "called\n"


def test_the_pipeline_is_plain_posix_sh():
    if shutil.which("shellcheck") is None:
        pytest.skip("needs shellcheck")
    facts = [_fact(f"Plain{i}", f"echo {i}") for i in range(6)]
    command = _command(combined_probe([(fc, {}) for fc in facts])())
    check = subprocess.run(["shellcheck", "-s", "sh", "-"], input=command, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


@pytest.mark.parametrize(("weights", "groups", "starts"), [
    ([1] * 10, 4, [0, 2, 4, 7]),  # balanced by count, contiguous (ties: earlier starts)
    ([1] * 3, 4, [0, 1, 2]),  # never an empty group
    ([1], 4, [0]),
    ([1, 1, 11, 11, 11, 1], 4, [0, 2, 3, 4]),  # the slow ones apart, the order kept
    ([1] * 12 + [11, 11], 4, [0, 6, 12, 13]),
    ([1, 1, 1, 1], 1, [0]),
])
def test_split_groups(weights, groups, starts):
    got = split_groups(weights, groups)
    assert got == starts
    bounds = got + [len(weights)]
    heaviest = max(sum(weights[a:b]) for a, b in pairwise(bounds))
    assert heaviest == min_max(weights, min(groups, len(weights)))


def min_max(weights: list[int], k: int) -> int:
    """The lightest heaviest group over every contiguous split into k groups (brute force)."""
    from itertools import combinations

    best = None
    for cuts in combinations(range(1, len(weights)), k - 1):
        bounds = [0, *cuts, len(weights)]
        heaviest = max(sum(weights[a:b]) for a, b in pairwise(bounds))
        best = heaviest if best is None else min(best, heaviest)
    assert best is not None
    return best


def test_the_hardware_probe_puts_each_nvidia_smi_call_in_its_own_group():
    """`topo -m`, `topo -p2p r` and `-p2p w` (25-53 ms each on an H200 host) run side by side."""
    keys = list(HardwareProbe.sections)
    weights = [section_weight(fact_command(fc(), args)) for fc, args in HardwareProbe.sections.values()]
    assert [k for k, w in zip(keys, weights, strict=True) if w > 1] == ["topology", "p2p_read", "p2p_write"]
    starts = split_groups(weights, PROBE_GROUPS)
    group_of = {key: sum(1 for s in starts if s <= i) for i, key in enumerate(keys)}
    assert len({group_of["topology"], group_of["p2p_read"], group_of["p2p_write"]}) == 3
    assert HardwareProbe().command.count("nvidia-smi topo") == 3
