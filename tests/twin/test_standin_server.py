"""The stand-in server (tests/twin/standins/standind.py) and its client (client.c) answer
exactly as the Python stand-ins run directly: same stdout, stderr and exit status, the
caller's environment honoured, and the call really served by the server (the client executes
nothing else)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.twin import hardware

pytestmark = pytest.mark.skipif(hardware.standin_client() is None, reason="no C compiler to build the client")

CALLS = [
    ("usr/local/bin/uname", ["-r"]),
    ("usr/local/bin/uname", ["--version"]),  # the stand-in executes the real uname
    ("usr/local/sbin/pct", ["list"]),
    ("usr/local/sbin/pct", ["status", "999"]),  # refused: exit status and message
    ("usr/local/sbin/qm", ["list"]),
    ("usr/local/bin/pveversion", ["-v"]),
    ("usr/local/sbin/grub-probe", ["--target=abstraction", "/boot/grub"]),  # refused: no grubenv_abstraction
    ("usr/local/bin/nvidia-smi", ["-L"]),
    ("usr/local/bin/nvidia-smi", ["topo", "-m"]),
    ("usr/local/bin/nvidia-smi", ["--no-such-option"]),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A kpro6 root with its stand-ins, and a server for it on a socket of its own."""
    root = tmp_path_factory.mktemp("served") / "kpro6"
    hardware.install(root, "kpro6")
    sock = root.parent / "standins.sock"
    env = {**os.environ, "TWIN_ROOT": str(root)}
    server = subprocess.Popen([sys.executable, "-ISB", str(root / "usr/local/lib/twin/standind.py"), str(sock)],
                              env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    assert server.stderr is not None  # stderr=PIPE
    while not sock.exists():
        assert server.poll() is None and time.monotonic() < deadline, server.stderr.read().decode()
        time.sleep(0.02)
    try:
        yield root, sock
    finally:
        server.terminate()
        server.wait(10)


def _run(root, sock, program, args, cwd=None, extra_env=None):
    env = {**os.environ, "TWIN_ROOT": str(root), **(extra_env or {})}
    if sock:
        env["TWIN_STANDIN_SOCKET"] = str(sock)
    return subprocess.run([str(root / program), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("program,args", CALLS, ids=[" ".join([p.rsplit("/", 1)[1], *a]) for p, a in CALLS])
def test_server_answers_as_the_python_stand_in(served, program, args):
    root, sock = served
    direct = _run(root, None, program, args)
    via = _run(root, sock, program, args)
    assert (via.returncode, via.stdout, via.stderr) == (direct.returncode, direct.stdout, direct.stderr)


def test_refusals_keep_their_status(served):
    root, sock = served
    assert _run(root, sock, "usr/local/sbin/pct", ["status", "999"]).returncode != 0


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_the_server_runs_the_call(served, tmp_path):
    root, sock = served
    log = tmp_path / "trace"
    env = {**os.environ, "TWIN_ROOT": str(root), "TWIN_STANDIN_SOCKET": str(sock)}
    subprocess.run(["strace", "-f", "-qq", "-e", "trace=execve", "-o", str(log), str(root / "usr/local/sbin/pct"), "list"],
                   env=env, check=True, capture_output=True, timeout=60)
    execs = [line for line in log.read_text().splitlines() if "execve(" in line and "= 0" in line]
    assert len(execs) == 1, execs  # the client itself; no Python started


def test_without_a_server_the_client_runs_the_python_itself(served, tmp_path):
    root, _ = served
    gone = tmp_path / "no-server.sock"
    assert _run(root, gone, "usr/local/bin/uname", ["-r"]).stdout == _run(root, None, "usr/local/bin/uname", ["-r"]).stdout
    assert _run(root, gone, "usr/local/bin/uname", ["-r"]).returncode == 0


def test_the_callers_environment_reaches_the_stand_in(served, tmp_path):
    root, sock = served
    # TWIN_CT set without a CT to look at: nvidia-smi answers as inside a CT (it refuses)
    direct = _run(root, None, "usr/local/bin/nvidia-smi", ["-L"], cwd=tmp_path, extra_env={"TWIN_CT": "1"})
    via = _run(root, sock, "usr/local/bin/nvidia-smi", ["-L"], cwd=tmp_path, extra_env={"TWIN_CT": "1"})
    assert (via.returncode, via.stdout, via.stderr) == (direct.returncode, direct.stdout, direct.stderr)
    assert via.stdout != _run(root, sock, "usr/local/bin/nvidia-smi", ["-L"]).stdout
