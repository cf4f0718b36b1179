"""Test-run accounting for every test under tests/.

PVEGPU_TEST_CPU=FILE: after each test (setup, call and teardown together), append one line
`<nodeid>\t<wall s>\t<cpu s of pytest>\t<cpu s of reaped children>` to FILE. CPU seconds
(user + system, resource.getrusage) show where a run spends the machine, robust to other load
on it; the children's share counts processes (pyinfra, ssh, twin supervisors and what ran in
them) once they are waited for, so a twin's work lands on the test that stops it.

Temporary dirs: run as root, the tests' tmp_path lies under the repository's .cache/pytest/<pid>
when every directory from / down to .cache is root's and not group/other writable, else (a clone
under /tmp, as CI may make) under /var/cache/pvegpu-tests/<pid>; never under /tmp: the scripts pvegpu runs as root refuse a directory below a world-writable one
(templates/root-dir.sh.j2, issue 39), and the unit tests run those scripts in tmp_path.
"""

from __future__ import annotations

import os
import resource
import shutil
import stat
import time
from pathlib import Path

import pytest

_CACHE = Path(__file__).resolve().parents[1] / ".cache"
_FALLBACK = Path("/var/cache/pvegpu-tests")


def _root_only(path: Path) -> bool:
    """Every directory from / down to `path`: no symlink, root's, not group/other writable."""
    for p in (path, *path.parents):
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return False
    return True


def pytest_configure(config):
    if os.geteuid() != 0 or config.option.basetemp is not None:
        return
    _CACHE.mkdir(mode=0o755, exist_ok=True)
    if _root_only(_CACHE):
        base = _CACHE / "pytest"
    elif _root_only(_FALLBACK.parent):
        base = _FALLBACK
    else:
        return
    base.mkdir(mode=0o755, exist_ok=True)
    if not _root_only(base):
        return
    config.option.basetemp = str(base / str(os.getpid()))
    config.stash[_BASETEMP] = config.option.basetemp


_BASETEMP = pytest.StashKey[str]()


def pytest_unconfigure(config):
    given = config.stash.get(_BASETEMP, None)
    if not given:
        return
    # never through a mount a test left behind (removed with what is mounted there otherwise)
    with open("/proc/self/mountinfo") as mounts:
        if any(line.split()[4].startswith(given + "/") for line in mounts):
            return
    shutil.rmtree(given, ignore_errors=True)


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("PVEGPU_TEST_CPU")
    if not path:
        return (yield)
    wall, own, children = time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    try:
        return (yield)
    finally:
        with open(path, "a") as out:
            out.write(f"{item.nodeid}\t{time.monotonic() - wall:.2f}\t"
                      f"{_cpu(resource.RUSAGE_SELF) - own:.2f}\t{_cpu(resource.RUSAGE_CHILDREN) - children:.2f}\n")
