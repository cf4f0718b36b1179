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


# Proxmox's own program the probe asks (proxmox-kernel-helper's shell script, real in the twin since
# issue 38): what it starts is Proxmox's cost of `status` and `kernel list`, the same on a node with or
# without pvegpu, and is counted apart (PROXMOX_PROGRAMS), not as the probe's
PROXMOX_TOOLS = ('"proxmox-boot-tool"', '"/usr/sbin/proxmox-boot-tool"')
PROXMOX_PROGRAMS = 80


def _programs(strace_log: str) -> tuple[list[str], list[str]]:
    """The argv (as strace writes it) of every execve that succeeded in an `strace -f` log (execve,
    clone, fork and vfork traced): the probe's own, and those a proxmox-boot-tool process or its
    descendants started (PROXMOX_TOOLS)."""
    pending: dict[str, str] = {}
    parent: dict[str, str] = {}
    execs: list[tuple[str, str]] = []
    for line in strace_log.splitlines():
        pid, _, rest = line.partition(" ")
        rest = rest.strip()
        # the child's pid as the twin's namespace numbers it, then (--decode-pids=pidns) as strace's does
        forked = re.match(r"(?:<\.\.\. )?(?:clone3?|v?fork)\b.*= \d+ /\* (\d+) in strace's PID NS \*/$", rest)
        if forked:
            parent[forked.group(1)] = pid
        elif rest.startswith("execve("):
            found = re.search(r"\[(.*)\], 0x", rest)
            argv = found.group(1) if found else rest
            if rest.endswith("<unfinished ...>"):
                pending[pid] = argv
            elif rest.endswith(" = 0"):
                execs.append((pid, argv))
        elif rest.startswith("<... execve resumed>") and pid in pending:
            argv = pending.pop(pid)
            if rest.endswith(" = 0"):
                execs.append((pid, argv))
    tool_pids: set[str] = set()
    own, proxmox = [], []
    for pid, argv in execs:
        chain, p = [], pid
        while p in parent:
            p = parent[p]
            chain.append(p)
        if any(c in tool_pids for c in chain):
            proxmox.append(argv)
            continue
        if argv.startswith(PROXMOX_TOOLS) or (argv.startswith('"unshare"') and "proxmox-boot-tool" in argv):
            if pid in tool_pids:  # the tool re-executing itself in its own mount namespace
                proxmox.append(argv)
                continue
            tool_pids.add(pid)
        own.append(argv)
    return own, proxmox


def test_the_kpro6_probe_starts_few_programs_and_gives_each_fact_its_own_value(twin_factory, tmp_path):
    if shutil.which("strace") is None:
        pytest.skip("needs strace (counts the programs the probe starts)")
    twin = twin_factory("kpro6", name=f"probe-{os.getpid()}")
    assert _ssh(twin, "pct start 200").returncode == 0
    requests = _requests()
    probe = combined_probe(requests)
    trace = tmp_path / "execve.log"
    tracer = subprocess.Popen(["strace", "-q", "-f", "-s", "4096", "-e", "trace=execve,clone,clone3,fork,vfork", "--decode-pids=pidns", "-o", str(trace),
                               "-p", str(_listener(twin))])
    try:
        time.sleep(1)
        run = _ssh(twin, str(probe().command))
        time.sleep(0.5)
    finally:
        tracer.terminate()
        tracer.wait(timeout=30)
    assert run.returncode == 0, run.stderr[-2000:]
    argvs, proxmox = _programs(trace.read_text())
    assert len(proxmox) <= PROXMOX_PROGRAMS, proxmox
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
