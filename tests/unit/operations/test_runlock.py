"""The run lock's keeper (operations/runlock.py), run here with bash and flock on a temp dir:
the second keeper is refused and told the holder; a keeper whose run ends without 'done'
leaves a record the next one reports as stale; 'done' removes the record."""

from __future__ import annotations

import subprocess
import time
from typing import IO

import pytest

from operations import runlock


def start(tmp_path, pid: str, timeout_s: int = 60) -> tuple[subprocess.Popen, tuple]:
    me = {"user": "alice", "machine": "laptop", "since": "2026-12-03T15:00:00Z", "pid": pid, "mode": "converge"}
    proc = subprocess.Popen(["sh", "-c", runlock.keeper_command(me, timeout_s, lock_dir=str(tmp_path / "lk"))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines = []
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == "END":
            break
    return proc, runlock.parse_reply(lines)


def stdin(proc: subprocess.Popen) -> IO[str]:
    """The keeper's stdin (start() opens it as a text pipe)."""
    assert proc.stdin is not None
    return proc.stdin


def test_second_keeper_is_refused_and_told_the_holder(tmp_path):
    first, (state, info, stale) = start(tmp_path, "111")
    assert state == "locked" and not stale and info["keeper"].isdigit()
    second, (state2, holder, _) = start(tmp_path, "222")
    assert state2 == "held" and second.wait(5) == 0
    assert holder["pid"] == "111" and holder["user"] == "alice" and holder["machine"] == "laptop"
    msg = runlock.held_message("kpro6", holder)
    assert "alice@laptop (pid 111, converge) since 2026-12-03T15:00:00Z" in msg and "nothing was read or changed" in msg
    stdin(first).write("done\n")
    stdin(first).flush()
    assert first.wait(5) == 0
    assert not (tmp_path / "lk" / "holder").exists(), "a run that ends removes its record"
    third, (state3, _, stale3) = start(tmp_path, "333")
    assert state3 == "locked" and stale3 == {}, "after a clean end nothing is stale"
    stdin(third).close()
    third.wait(5)


@pytest.mark.parametrize("how", ["closed", "silent", "keeper-killed"])
def test_a_dead_holder_is_stale_and_said(tmp_path, how):
    first, (state, info, _) = start(tmp_path, "111", timeout_s=1)
    assert state == "locked"
    if how == "closed":
        stdin(first).close()
    elif how == "silent":
        time.sleep(1.5)
    else:
        first.kill()
    first.wait(5)
    second, (state2, _, stale) = start(tmp_path, "222")
    assert state2 == "locked", "a dead holder does not block"
    assert stale["pid"] == "111"
    msg = runlock.stale_message("kpro6", stale)
    assert "alice@laptop (pid 111, converge)" in msg and "ended without finishing" in msg
    want = {"closed": "the connection closed before the run ended", "silent": "no word from the run for 1 s",
            "keeper-killed": "its lock keeper on the host is gone"}[how]
    assert want in msg, msg
    stdin(second).write("done\n")
    stdin(second).close()
    second.wait(5)


def test_keeper_command_quotes_the_record():
    me = {"user": "x'; reboot #", "machine": "m", "since": "s", "pid": "1", "mode": "--dry"}
    cmd = runlock.keeper_command(me)
    assert "'x'\"'\"'; reboot #'" in cmd


def test_heartbeat_outside_pyinfra_context_says_a_lost_lock(caplog, monkeypatch):
    """The heartbeat greenlet runs outside pyinfra's host context (seen in `make demo`: the
    reboot stage ended the keeper and reading the context-bound `host` raised in the greenlet)."""
    import gevent
    from pyinfra import host as context_host

    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)  # one beat, then the check: not 5 s of waiting

    class Chan:
        closed = False

        def sendall(self, data):
            pass

        def exit_status_ready(self):
            return True  # the keeper on the host ended (the host rebooted)

    keeper = runlock._Keeper.__new__(runlock._Keeper)
    # what __init__ keeps of the host (the code before kept the context-bound proxy as .host)
    keeper.__dict__.update(_chan=Chan(), _proc=None, _done=False, host_name="kpro6", host=context_host)
    greenlet = gevent.spawn(keeper.beat)
    with caplog.at_level("WARNING", logger="pyinfra"):
        greenlet.join(timeout=runlock.HEARTBEAT_S + 5)
    assert greenlet.successful(), greenlet.exception
    assert any("kpro6: pvegpu lost its run lock" in r.getMessage() for r in caplog.records)


def test_a_run_waits_for_a_rebind_runner_an_earlier_run_left_going(tmp_path):
    """plan.rebind: a detached rebind runner holds rebind.lock; the next run's keeper says WAIT and
    takes the run lock only once the runner has let go (so no fact is read mid-transaction)."""
    (tmp_path / "lk").mkdir()
    runner = subprocess.Popen(["flock", str(tmp_path / "lk" / "rebind.lock"), "sleep", "1.5"])
    time.sleep(0.3)
    t0 = time.monotonic()
    second, (state, _, _) = start(tmp_path, "222")
    assert state == "locked" and time.monotonic() - t0 >= 1.0, "it waited for the runner"
    assert runner.wait(5) == 0
    stdin(second).write("done\n")
    stdin(second).close()
    second.wait(5)


def test_wait_is_said_as_it_happens():
    said: list[str] = []

    class Reader:
        host_name = "kpro6"
        _reader = iter(["WAIT\n", "LOCKED 12\n", "END\n"])

    lines = runlock._Keeper.first_lines(Reader(), said.append)  # type: ignore[arg-type]
    assert runlock.parse_reply(lines)[0] == "locked"
    assert said and "rebind transaction" in said[0] and said[0].startswith("kpro6: ")


class _FakeKeeper:
    """Stands in for runlock._Keeper: records when it is started, read and released."""

    events: list[str] = []

    def __init__(self, host, command: str):
        self.events.append(f"start {host.name}")

    def first_lines(self, log=None) -> list[str]:
        self.events.append("read")
        return ["LOCKED 42\n", "END\n"]

    def beat(self) -> None:
        pass

    def release(self) -> None:
        self.events.append("release")


class _FakeHost:
    def __init__(self, name: str):
        self.name = name
        self.connector = type("Connector", (), {"disconnect": lambda self: None})()


@pytest.fixture
def fake_keeper(monkeypatch):
    _FakeKeeper.events = []
    monkeypatch.setattr(runlock, "_Keeper", _FakeKeeper)
    monkeypatch.setattr(runlock, "_HELD", {})
    monkeypatch.setattr(runlock, "_PENDING", {})
    monkeypatch.setattr(runlock.atexit, "register", lambda f: None)
    return _FakeKeeper.events


def test_begin_starts_the_keeper_and_hold_reads_its_answer(fake_keeper):
    """deploy.py starts the keeper before it loads the stages: the keeper takes the lock on the host
    meanwhile, and only `hold` waits for its answer (one keeper, not a second one)."""
    host = _FakeHost("kpro6")
    runlock.begin(host)
    assert fake_keeper == ["start kpro6"], "begin starts the keeper and does not wait for it"
    runlock.hold(host, lambda line: None)
    assert fake_keeper == ["start kpro6", "read"]
    assert "kpro6" in runlock._HELD and "kpro6" not in runlock._PENDING
    runlock.begin(host)  # held already: no second keeper
    assert fake_keeper == ["start kpro6", "read"]


def test_a_run_that_stops_before_hold_lets_its_keeper_go(fake_keeper):
    host = _FakeHost("kpro6")
    runlock.begin(host)
    runlock.abandon(host)
    assert fake_keeper == ["start kpro6", "release"] and runlock._PENDING == {}
    runlock.hold(host, lambda line: None)  # a later hold starts its own keeper
    assert fake_keeper == ["start kpro6", "release", "start kpro6", "read"]
