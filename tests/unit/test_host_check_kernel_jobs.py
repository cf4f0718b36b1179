"""Incident 14's host check (tests/host/test_boot.py::test_kernel_build_jobs_fit_the_hosts_memory)
on a stand-in target: the build record of the pinned kernel, `nproc` and /proc/meminfo (the H200
VM's, recorded), as the check reads them on a host."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from plan.kernel import STATE_DIR
from spec.models import KernelSpec
from tests.host.test_boot import test_kernel_build_jobs_fit_the_hosts_memory as check

MEMINFO = [line for line in (Path(__file__).parents[1] / "fixtures/h200-vm/meminfo.txt").read_text().splitlines()
           if not line.startswith("# ")]
RELEASE = "6.14.8-2-pvegpu"


class Host:
    name = "h200"

    def __init__(self, jobs_spec, recorded_jobs, cores, meminfo=MEMINFO):
        source = {"kind": "tarball", "url": "/srv/linux.tar.xz", "sha256": "0" * 64}
        self.spec = SimpleNamespace(kernel=KernelSpec(version=RELEASE, source=source, jobs=jobs_spec))
        self.files = {} if recorded_jobs is None else {f"{STATE_DIR}/{RELEASE}.json": json.dumps({"jobs": recorded_jobs})}
        self.output = f"{cores}\n" + next(line for line in meminfo if line.startswith("MemTotal:")) + "\n"

    def read(self, path):
        return self.files.get(path)

    def run(self, command):
        assert command == "nproc; grep '^MemTotal:' /proc/meminfo"
        return 0, self.output


def test_auto_jobs_within_cores_and_memory_pass():
    check(Host("auto", recorded_jobs=16, cores=16))  # 126 GiB: 62 jobs by memory, 16 by cores


def test_auto_jobs_beyond_what_memory_feeds_fail_in_a_sentence():
    meminfo = ["MemTotal:       67108864 kB"]  # 64 GiB: 32 jobs
    with pytest.raises(AssertionError) as failed:
        check(Host("auto", recorded_jobs=128, cores=128, meminfo=meminfo))
    assert str(failed.value).startswith(f"h200: kernel {RELEASE} was built with -j128; 128 cores and 64 GiB of RAM "
                                        "allow -j32")
    assert "incident 14" in str(failed.value)


def test_an_explicit_spec_jobs_is_what_the_build_must_have_used():
    check(Host(8, recorded_jobs=8, cores=128))
    with pytest.raises(AssertionError, match="built with -j12, but the spec sets jobs: 8"):
        check(Host(8, recorded_jobs=12, cores=128))


def test_no_build_record_or_no_kernel_skips():
    with pytest.raises(pytest.skip.Exception, match="no pvegpu build record"):
        check(Host("auto", recorded_jobs=None, cores=16))
    host = Host("auto", recorded_jobs=16, cores=16)
    host.spec = SimpleNamespace(kernel=None)
    with pytest.raises(pytest.skip.Exception, match="pins no kernel"):
        check(host)
