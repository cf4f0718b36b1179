"""Test-run accounting for every test under tests/.

PVEGPU_TEST_CPU=FILE: after each test (setup, call and teardown together), append one line
`<nodeid>\t<wall s>\t<cpu s of pytest>\t<cpu s of reaped children>` to FILE. CPU seconds
(user + system, resource.getrusage) show where a run spends the machine, robust to other load
on it; the children's share counts processes (pyinfra, ssh, twin supervisors and what ran in
them) once they are waited for, so a twin's work lands on the test that stops it.
"""

from __future__ import annotations

import os
import resource
import time

import pytest


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
