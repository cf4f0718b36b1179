"""operations.progress: long work reports progress at a steady rate, then the time it took, and
the time is kept on the host for the next run (and --dry)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import gevent.subprocess
from pyinfra_testing.util import get_command_string

from operations import progress


class LocalHost:
    """run_shell_command on this machine, cooperatively (pyinfra's runs are greenlets under gevent)."""

    name = "local"

    def __init__(self):
        self.commands = []

    def run_shell_command(self, command):
        text = get_command_string(command)
        self.commands.append(text)
        done = gevent.subprocess.run(["sh", "-c", text], capture_output=True, text=True)
        return done.returncode == 0, SimpleNamespace(stdout_lines=done.stdout.splitlines(),
                                                     stderr_lines=done.stderr.splitlines())


def test_describe_and_durations():
    assert progress.describe("nvidia 535 build for 6.1", 75, 12, 200, "  CC [M]  /src/nv.o") == (
        "nvidia 535 build for 6.1: 12 of ~200 objects (6%), 1 min 15 s elapsed, last: CC [M] /src/nv.o")
    assert progress.describe("CT install", 5) == "CT install: 5 s elapsed"
    assert progress.describe("kernel build", 3725, 7) == "kernel build: 7 objects built, 1 h 02 min elapsed"


def test_a_foreground_build_reports_between_start_and_end_and_records_its_time(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(progress, "RECORD_DIR", str(tmp_path / "durations"))
    log = tmp_path / "build.log"
    # a "build" writing one object line per 0.2 s for ~2 s
    command = f"for i in 1 2 3 4 5 6 7 8 9 10; do echo \"  CC [M]  /src/o$i.o\" >> {log}; sleep 0.2; done"
    host = LocalHost()
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        assert progress.run_reported(None, host, command, "nvidia 1.0 build for r", key="nvidia-1.0-r-src.tar",
                                     log=str(log), total=10, every_s=0.5) is True
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "local: nvidia 1.0 build for r: started (~10 objects last time)"
    reports = [line for line in lines if " objects (" in line and "elapsed" in line]
    assert 2 <= len(reports) <= 5, lines  # a steady rate, not one line per object
    assert lines[-1].startswith("local: nvidia 1.0 build for r: done in ") and lines[-1].endswith(", 10 objects")
    record = (tmp_path / "durations" / "nvidia-1.0-r-src.tar").read_text().split()
    assert record[:2] == ["seconds", "2"] and record[2:] == ["objects", "10"]
    # the record as the Durations fact reads it back
    facts = gevent.subprocess.run(["sh", "-c", progress.Durations.command.replace("/var/lib/pvegpu/durations", str(tmp_path / "durations"))],
                                  capture_output=True, text=True).stdout.splitlines()
    assert progress.Durations().process(facts) == {"nvidia-1.0-r-src.tar": {"seconds": 2, "objects": 10}}


def test_a_failing_foreground_command_fails_the_operation_with_its_stderr(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(progress, "RECORD_DIR", str(tmp_path / "durations"))
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        assert progress.run_reported(None, LocalHost(), "echo 'pvegpu: it broke' >&2; exit 3", "x build",
                                     key="x", every_s=5) is False
    assert "local: x build: failed after 0 s\npvegpu: it broke" in [r.getMessage() for r in caplog.records]
    assert not (tmp_path / "durations").exists()  # nothing recorded for a failed build


def test_detached_work_reports_elapsed_since_it_started_and_records(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(progress, "RECORD_DIR", str(tmp_path / "durations"))
    d = tmp_path / "b"
    d.mkdir()
    (d / "build.pid").write_text("1\n")
    (d / "build.log").write_text("  CC      a.o\n  LD      vmlinux\n")
    (d / "build.rc").write_text("0\n")
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        assert progress.follow_detached(None, LocalHost(), "kernel build", str(d), str(d / "build.log"),
                                        key="kernel-abc", poll_s=0.1, timeout_s=5) is True
    assert caplog.records[-1].getMessage().startswith("local: kernel build: done in ")
    assert (tmp_path / "durations" / "kernel-abc").read_text().endswith("objects 2\n")


def test_ct_probe_quotes_the_log_path():
    assert progress.ct_log_probe(200, "/var/log/it's.log") == (
        "echo; timeout -k 2 10 pct exec 200 -- sh -c 'tail -n 1 '\"'\"'/var/log/it'\"'\"'\"'\"'\"'\"'\"'\"'s.log'\"'\"' 2>/dev/null' 2>/dev/null; echo")


def test_announce_says_how_long_the_last_build_of_the_same_source_took(caplog):
    """What --dry prints when a build is planned: the record of the same key on this host, if any."""
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra_testing.util import FakeState, create_host

    records = {"nvidia-535-6.1-src.tar": {"seconds": 402, "objects": 212}}
    state = FakeState()
    fake = create_host(state, facts={"progress.Durations": records})
    with ctx_state.use(state), ctx_host.use(fake), caplog.at_level(logging.INFO, logger="pyinfra"):
        command = progress.reported("make", "nvidia 535 build for 6.1", key="nvidia-535-6.1-src.tar", log="/b/build.log")
        progress.announce("kernel 6.14 build", "kernel-other")
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [  # after "<host>: "
        "nvidia 535 build for 6.1: the last build of the same source on this host took 6 min 42 s, 212 objects",
        "kernel 6.14 build: no earlier build of the same source recorded on this host"]
    assert command.function is progress.run_reported and command.kwargs["total"] == 212  # the estimate


def test_announced_once_although_pyinfra_runs_the_operation_body_twice(caplog):
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra_testing.util import FakeState, create_host

    state = FakeState()
    state.is_executing = True  # the second pass: the change check already said it
    state.should_check_for_changes = lambda: True
    fake = create_host(state, facts={"progress.Durations": {"k": {"seconds": 9, "objects": 3}}})
    with ctx_state.use(state), ctx_host.use(fake), caplog.at_level(logging.INFO, logger="pyinfra"):
        command = progress.reported("make", "x build", key="k")
    assert caplog.records == [] and command.kwargs["total"] == 3
