"""One pvegpu run per host at a time (issue 19, part 1), with two real concurrent
`pyinfra … deploy.py` processes against a kpro6 twin.

A is a converge; once its lock keeper runs on the twin, A is frozen (SIGSTOP) so it holds the
host for as long as the test needs. Then:

- a second run (``--dry``, and a converge) refuses before reading or changing anything and
  names A: user@machine, pid, since when; A, thawed, finishes; the run after it is quiet and
  reports nothing stale;
- A dies (pyinfra SIGKILLed, its keeper killed on the host, or its link silent past the
  heartbeat timeout): the next run is not blocked, says the holder was stale and who it was,
  and converges; the run after it changes nothing.
"""

from __future__ import annotations

import getpass
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.harness import PYINFRA, REPO, manifest_diff, run_pyinfra
from tests.e2e.test_faults import twin_pids, upper_manifest, wait_for

pytestmark = [pytest.mark.twin]

INVENTORY = "inventories/twin.py"


def start_run(twin, *args: str, env: dict | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PVEGPU_TWINS": twin.name, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", **(env or {})}
    return subprocess.Popen([PYINFRA, "-y", "--debug", INVENTORY, "deploy.py", *args], cwd=REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def frozen_holder(twin, env: dict | None = None) -> subprocess.Popen:
    """Run A: a converge, stopped (SIGSTOP) as soon as its lock keeper runs on the twin."""
    a = start_run(twin, env=env)
    marker = f" {a.pid} converge "

    def holds() -> bool:
        # the keeper's process appears before it has taken the flock and written its record (the
        # twin's /run, read through the keeper's own root): wait for the record, else killing
        # the keeper early leaves nothing for the next run to call stale
        for pid in twin_pids(twin, cmdline_has=marker):
            try:
                if f"pid={a.pid}\n" in Path(f"/proc/{pid}/root/run/pvegpu/holder").read_text():
                    return True
            except OSError:
                pass
        return False

    assert wait_for(lambda: holds() or a.poll() is not None, timeout=60, step=0.01)
    assert a.stdout is not None  # stdout=PIPE
    assert a.poll() is None, "run A ended before it could be held:\n" + a.stdout.read()[-3000:]
    os.kill(a.pid, signal.SIGSTOP)
    return a


def again(twin, *args: str, env: dict | None = None):
    return run_pyinfra(INVENTORY, "deploy.py", *args, env={"PVEGPU_TWINS": twin.name, **(env or {})})


def me() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


def test_a_second_run_refuses_and_names_the_holder(twin_factory):
    twin = twin_factory("kpro6", name="lock-held")
    a = frozen_holder(twin)
    try:
        before = upper_manifest(twin)
        for args in (("--dry",), ()):
            b = again(twin, *args)
            assert b.rc != 0, b.output[-3000:]
            assert f"host {twin.name} is held by another pvegpu run: {me()} (pid {a.pid}, converge) since " in b.output, \
                b.output[-3000:]
            assert "nothing was read or changed" in b.output
            assert b.remote_commands == 0, "the refused run read facts"
        assert not manifest_diff(before, upper_manifest(twin)), "a refused run changed the twin"
    finally:
        os.kill(a.pid, signal.SIGCONT)
    out, _ = a.communicate(timeout=600)
    assert a.returncode == 0, out[-3000:]
    quiet = again(twin)
    assert quiet.rc == 0 and quiet.changed == 0, quiet.output[-3000:]
    assert "ended without finishing" not in quiet.output, "a run that ended cleanly was reported stale"


@pytest.mark.parametrize("death", ["pyinfra-killed", "keeper-killed", "link-silent"])
def test_a_dead_holder_is_stale_said_and_does_not_block(twin_factory, death):
    twin = twin_factory("kpro6", name=f"lock-{death[:6]}")
    env = {"PVEGPU_LOCK_TIMEOUT_S": "2"} if death == "link-silent" else None
    a = frozen_holder(twin, env=env)
    try:
        if death == "pyinfra-killed":
            os.kill(a.pid, signal.SIGKILL)
        elif death == "keeper-killed":
            for pid in twin_pids(twin, cmdline_has=f" {a.pid} converge "):
                os.kill(pid, signal.SIGKILL)
        else:
            time.sleep(3.5)  # A frozen: no heartbeat for longer than its keeper waits
        a_pid = a.pid
        b = again(twin)
        assert b.rc == 0, b.output[-3000:]
        assert f"the previous pvegpu run, {me()} (pid {a_pid}, converge) since " in b.output, b.output[-3000:]
        want = {"pyinfra-killed": "the connection closed before the run ended",
                "keeper-killed": "its lock keeper on the host is gone",
                "link-silent": "no word from the run for 2 s"}[death]
        assert want in b.output and "Its lock was stale and is taken over" in b.output, b.output[-3000:]
    finally:
        if a.poll() is None:
            os.kill(a.pid, signal.SIGKILL)
            os.kill(a.pid, signal.SIGCONT)
        a.communicate(timeout=60)
    quiet = again(twin)
    assert quiet.rc == 0 and quiet.changed == 0, quiet.output[-3000:]
    assert "ended without finishing" not in quiet.output
