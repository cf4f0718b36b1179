"""An ESC in a CT's output (issue 39 item 8) on the kpro6 twin: a container whose `sh` writes escape
sequences (a screen clear, an OSC 52 clipboard write, a title change, a C1 CSI) into what pvegpu
shows while it installs the NVIDIA user space there (the installer log's last line, read with
`pct exec`, and the installer's stderr when it fails): pvegpu's output has them escaped, none raw."""

from __future__ import annotations

import subprocess

import pytest

from tests.e2e.harness import run_pyinfra
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

CTID = 200
# the CT's /usr/bin/sh: the installer run (sh /root/.pvegpu-NVIDIA-...run) sleeps, then fails with
# escape sequences on stderr; the progress probe (sh -c 'tail -n 1 <log>') gets a hostile log line;
# everything else (pct push, the NCCL stage's write) runs dash as sh would
HOSTILE_SH = r"""#!/usr/bin/dash
case "$1" in
  /root/.pvegpu-NVIDIA-*) sleep 4
    printf 'ERROR: \033[2J\033]52;c;cm0gLXJmIH4=\007\033]0;pwned\033\\ \302\2336n\rFAKE-OK\n' >&2; exit 1;;
  -c) case "$2" in *nvidia-installer.log*)
    printf 'building \033[2J\033]52;c;cm0gLXJmIH4=\007 done\n'; exit 0;; esac;;
esac
exec /usr/bin/dash "$@"
"""


def ssh(name: str, command: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(runtime.ssh_command(name, [command]), capture_output=True, text=True, timeout=120,
                          input=stdin)


def test_an_esc_in_a_cts_output_reaches_pvegpus_output_escaped(twin_factory):
    twin = twin_factory("kpro6", name="ctesc-kpro6")
    env = {"PVEGPU_TWINS": twin.name, "PVEGPU_PROGRESS_EVERY_S": "1"}
    first = run_pyinfra("inventories/twin.py", "deploy.py", env=env)  # devices, bindings (reboots once)
    assert first.rc == 0, first.output[-4000:]
    assert ssh(twin.name, f"pct start {CTID}").returncode == 0
    planted = ssh(twin.name, f"pct exec {CTID} -- /usr/bin/dash -c 'cat > /usr/bin/sh.new && chmod 755 /usr/bin/sh.new "
                             "&& mv -f /usr/bin/sh.new /usr/bin/sh'", stdin=HOSTILE_SH)
    assert planted.returncode == 0, planted.stderr

    run = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert run.rc != 0, "the installer failed in the CT"
    out = run.output
    for raw in ("\x1b[2J", "\x1b]52", "\x07", "\x1b]0;pwned", "\x9b", "\rFAKE-OK"):
        assert raw not in out, f"{raw!r} reached the output"
    assert "last: building \\x1b[2J\\x1b]52;c;cm0gLXJmIH4=\\x07 done" in out, out[-4000:]
    assert "ERROR: \\x1b[2J\\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b]0;pwned\\x1b\\ \\x9b6n\\x0dFAKE-OK" in out, out[-4000:]
