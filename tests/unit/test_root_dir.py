"""Issue 39 item 1: templates/root-dir.sh.j2 `pvegpu_dir`, the one helper every path pvegpu writes as
root goes through (plan/render.py root_dirs; included by the NVIDIA build, the driver x kernel gate,
the kernel hook and the kernel build).

The rendered function runs as root in a private mount namespace on a fresh tmpfs at /mnt (mode 0755,
root's: the whole path from / is then root-only, as /var/lib and /var/cache are on a host), and is
checked against what a local user can plant there: a symlink in the path, a directory of another
owner, a group- or world-writable one (a 1777 dir like /var/tmp), a file in the way; and that what it
creates gets the mode asked for under umask 000.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from plan.render import render_template, root_dirs

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root (a mount namespace; the helper checks for owner root)")


def run_in_tmpfs(setup: str, body: str) -> subprocess.CompletedProcess:
    """`setup` (umask 022) then `body` (after the helper's function, umask 000) as root with a fresh tmpfs on /mnt;
    prints the mode/owner of every path under /mnt afterwards."""
    script = (f"set -u; mount -t tmpfs -o mode=0755 pvegpu-test /mnt || exit 99; cd /mnt; umask 022; {setup}\n"
              + "umask 000\n" + render_template("root-dir.sh.j2") + body
              + "\nrc=$?; find /mnt -mindepth 1 -printf '%p %u %m %y\\n' | sort; exit $rc\n")
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=60)


def listing(out: str) -> dict[str, tuple[str, str, str]]:
    return {p: (u, m, y) for p, u, m, y in (line.split() for line in out.splitlines() if line.startswith("/mnt/"))}


@needs_root
def test_it_creates_the_path_with_explicit_modes_under_umask_000():
    r = run_in_tmpfs("", "pvegpu_dir /mnt/var/cache/pvegpu/nvidia-build 700 && pvegpu_dir /mnt/var/lib/pvegpu/x 755")
    assert r.returncode == 0, r.stderr
    found = listing(r.stdout)
    assert found["/mnt/var"] == ("root", "755", "d")
    assert found["/mnt/var/cache/pvegpu"] == ("root", "755", "d")
    assert found["/mnt/var/cache/pvegpu/nvidia-build"] == ("root", "700", "d")
    assert found["/mnt/var/lib/pvegpu/x"] == ("root", "755", "d")


@needs_root
def test_an_existing_directory_gets_the_mode_asked_for():
    r = run_in_tmpfs("mkdir -m 755 -p /mnt/state", "pvegpu_dir /mnt/state 700")
    assert r.returncode == 0, r.stderr
    assert listing(r.stdout)["/mnt/state"] == ("root", "700", "d")


@needs_root
@pytest.mark.parametrize("setup, culprit, why", [
    # a local user's symlink where a component should be (onto /lib/modules, say)
    ("mkdir -m 755 /mnt/real /mnt/var; ln -s /mnt/real /mnt/var/pvegpu", "/mnt/var/pvegpu", "is a symlink"),
    # the last component a symlink
    ("mkdir -m 755 -p /mnt/var/pvegpu /mnt/real; ln -s /mnt/real /mnt/var/pvegpu/nvidia-build",
     "/mnt/var/pvegpu/nvidia-build", "is a symlink"),
    # a directory someone else created first (the 1777 /var/tmp case: www-data made /var/tmp/pvegpu)
    ("mkdir -m 755 -p /mnt/var/pvegpu; chown 65534:65534 /mnt/var/pvegpu", "/mnt/var/pvegpu",
     "is owned by uid 65534, not root"),
    # a world-writable parent (sticky or not): anyone could rename entries under a non-sticky one,
    # plant new ones under either
    ("mkdir -m 1777 /mnt/var", "/mnt/var", "(mode 1777) is writable by group or others"),
    ("mkdir -m 775 -p /mnt/var/pvegpu", "/mnt/var/pvegpu", "(mode 775) is writable by group or others"),
    ("mkdir -m 755 /mnt/var; touch /mnt/var/pvegpu", "/mnt/var/pvegpu", "is not a directory"),
])
def test_it_refuses_what_a_local_user_can_plant(setup, culprit, why):
    r = run_in_tmpfs(setup, "pvegpu_dir /mnt/var/pvegpu/nvidia-build 700 && echo MADE")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "MADE" not in r.stdout
    assert f"refusing /mnt/var/pvegpu/nvidia-build as a root directory: {culprit} {why}" in r.stderr
    # nothing was created through or beside what it refused
    assert not [p for p in listing(r.stdout) if p.startswith(("/mnt/real/", "/mnt/var/pvegpu/nvidia-build/"))]


@needs_root
def test_a_relative_path_or_a_dot_component_is_refused():
    r = run_in_tmpfs("", "pvegpu_dir var/x 700; a=$?; pvegpu_dir /mnt/a/../b 700; echo \"rc $a $?\"")
    assert "rc 1 1" in r.stdout
    assert "not an absolute path" in r.stderr and "has a .. component" in r.stderr


@needs_root
def test_root_dirs_stops_the_command_at_the_first_refusal():
    r = run_in_tmpfs("mkdir -m 1777 /mnt/tmp",
                     "(\n" + root_dirs(("/mnt/ok", "700"), ("/mnt/tmp/pvegpu", "700")) + "echo RAN\n)")
    assert r.returncode == 1
    assert "RAN" not in r.stdout
    assert listing(r.stdout)["/mnt/ok"] == ("root", "700", "d")
    assert "/mnt/tmp/pvegpu" not in listing(r.stdout)


def test_nothing_is_written_under_tmp_or_var_tmp():
    """The review's line (issue 39): no template, operation or plan names /tmp or /var/tmp, and every
    mktemp makes its file under root's own /run/pvegpu (which the script checked with pvegpu_dir)."""
    root = Path(__file__).resolve().parents[2]
    found = []
    for folder in ("templates", "operations", "plan"):
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or path.suffix not in (".j2", ".py"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]  # comments may name them (what is not done)
                if re.search(r"(?<![\w/])/(var/)?tmp\b", code):
                    found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
                for call in re.findall(r"mktemp[^)]*", code):
                    if "/run/pvegpu" not in call:
                        found.append(f"{path.relative_to(root)}:{number}: {call}")
                    elif "pvegpu_dir /run/pvegpu" not in path.read_text():
                        found.append(f"{path.relative_to(root)}:{number}: /run/pvegpu is not checked first")
    assert found == []
