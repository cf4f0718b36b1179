"""The no-change converge's one probe on the kpro6 twin (CT 200 running): how many programs it
starts inside the host (each ~1-1.5 ms on a node), counted with strace on the twin's sshd, and
that every value it gives is what each fact gives run alone (issue 26 part 5)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from facts.hardware import PROBE_GROUPS, combined_probe, fact_command
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

# main's probe started 97 programs on a converged kpro6 twin (strace); 42 after facts.shared's
# readings over sets, the shell's read for small files, one uname, no od beside mokutil's verdict
MAX_PROGRAMS = 50
# whole files a probe may still read with a program: the cluster-wide ones that grow with the cluster
CAT_KEPT = ("/etc/pve/qemu-server/", "/etc/pve/mapping/pci.cfg", "/etc/pve/ha/resources.cfg")


def _requests() -> list:
    from operations import load_stages, upgrade
    from spec.load import inventory_hosts

    root = Path(__file__).resolve().parents[2]
    spec = dict(inventory_hosts(root / "inventories/twin.yml"))["kpro6"]["pvegpu_spec"]
    requests = [r for _, module in load_stages() if hasattr(module, "prefetch") for r in module.prefetch(spec)]
    requests += upgrade.prefetch(spec)
    return list({(fc.__module__, fc.__name__, repr(sorted(kw.items()))): (fc, kw) for fc, kw in requests}.values())


def _ssh(twin, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(runtime.ssh_command(twin.name, [f"sh -c {shlex.quote(command)}"]), capture_output=True,
                          text=True, timeout=120)


def _listener(twin) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            root = os.readlink(f"/proc/{entry}/root")
        except OSError:
            continue
        if "sshd" in cmdline and "listener" in cmdline and root == str(twin.root):
            return int(entry)
    raise AssertionError(f"no sshd listener of twin {twin.name}")


def _programs(strace_log: str) -> list[str]:
    """The argv (as strace writes it) of every execve that succeeded in an `strace -f` log."""
    pending: dict[str, str] = {}
    argvs = []
    for line in strace_log.splitlines():
        pid, _, rest = line.partition(" ")
        rest = rest.strip()
        if rest.startswith("execve("):
            found = re.search(r"\[(.*)\], 0x", rest)
            argv = found.group(1) if found else rest
            if rest.endswith("<unfinished ...>"):
                pending[pid] = argv
            elif rest.endswith(" = 0"):
                argvs.append(argv)
        elif rest.startswith("<... execve resumed>") and pid in pending:
            argv = pending.pop(pid)
            if rest.endswith(" = 0"):
                argvs.append(argv)
    return argvs


def test_the_kpro6_probe_starts_few_programs_and_gives_each_fact_its_own_value(twin_factory, tmp_path):
    if shutil.which("strace") is None:
        pytest.skip("needs strace (counts the programs the probe starts)")
    twin = twin_factory("kpro6", name=f"probe-{os.getpid()}")
    assert _ssh(twin, "pct start 200").returncode == 0
    requests = _requests()
    probe = combined_probe(requests)
    trace = tmp_path / "execve.log"
    tracer = subprocess.Popen(["strace", "-q", "-f", "-s", "4096", "-e", "trace=execve", "-o", str(trace),
                               "-p", str(_listener(twin))])
    try:
        time.sleep(1)
        run = _ssh(twin, str(probe().command))
        time.sleep(0.5)
    finally:
        tracer.terminate()
        tracer.wait(timeout=30)
    assert run.returncode == 0, run.stderr[-2000:]
    argvs = _programs(trace.read_text())
    # the session: sshd's re-exec, the login shell, its sh -c
    programs = [a for a in argvs if not a.startswith(('"/usr/sbin/sshd"', '"bash"', '"-bash"', '"sh", "-c"'))]
    # the probe's own plumbing, no reading: the one write's dd, and per group after the first its dd
    # and the two plain cats that pass the earlier groups' output on (facts.hardware._grouped)
    glue = [a for a in programs if a == '"cat"' or a == '"dd", "bs=4M", "iflag=fullblock", "status=none"']
    assert len(glue) <= 1 + 3 * (PROBE_GROUPS - 1), glue
    programs = [a for a in programs if a not in glue]
    assert len(programs) <= MAX_PROGRAMS, "\n".join(programs)
    # a CT file is read one directory at a time, each step's `stat .` (and `..`) the same argv
    # (facts.guest_state CT_PATH_FUNCTIONS ct_file: no symlink followed, issue 39 item 9)
    walk = ('"stat", "-c", "%d:%i", "."', '"stat", "-c", "%d:%i", ".."')
    once = [a for a in programs if a not in walk]
    assert len(once) == len(set(once)), sorted(a for a in once if once.count(a) > 1)
    assert not [a for a in programs if a.startswith(('"head"', '"tail"', '"sed"', '"cut"', '"sort"', '"uniq"'))]
    assert all(a.split(", ")[1].strip('"').startswith(CAT_KEPT) for a in programs if a.startswith('"cat"')), programs

    values = probe().process(run.stdout.splitlines())
    for (fact_class, kwargs), value in zip(requests, values, strict=True):
        fact = fact_class()
        lines = _ssh(twin, fact_command(fact, (), kwargs)).stdout.splitlines()
        assert value == (fact.process(lines) if lines else fact.default()), fact_class.__name__
