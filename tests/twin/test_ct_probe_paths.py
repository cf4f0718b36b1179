"""Issue 39 item 9: the facts that look into a running CT through /proc/<init>/root (facts.nccl
NcclState, facts.containers ContainerUserspace; facts.guest_state CT_PATH_FUNCTIONS) read nothing of
the host's through a symlink the CT's root user planted, and wait on no FIFO.

Through /proc/<pid>/root an absolute symlink anywhere in the CT resolves against the host's /: a CT
whose /etc is a link to a host directory made the NCCL probe report the host file's mode and digest,
one whose /usr/lib/x86_64-linux-gnu is a link made the user-space probe list the host's NVML library
as the CT's. Each case plants the link (or FIFO) in CT 200's root from the twin (what root in the CT
could do), runs the fact's own command over ssh under a timeout, and parses it with the fact.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from facts.containers import ContainerUserspace
from facts.nccl import NCCL_CONF, NcclState
from facts.shell import word
from tests.twin import runtime

pytestmark = pytest.mark.twin

CT = 200
CT_ROOT = f"/var/lib/twin/ct/{CT}/root"
HOST_CONF = "NCCL_P2P_DISABLE=1  # the host's file, not the CT's\n"


@pytest.fixture(scope="module")
def twin(twin_root_cache):
    name = f"ctp-{os.getpid()}"
    twin = runtime.start(name, "kpro6", owner=os.getpid())
    try:
        sh(twin, f"pct start {CT} && mkdir -p /srv/hostdir && printf %s '{HOST_CONF}' > /srv/hostdir/nccl.conf "
                 "&& mkdir -p /srv/hostlib && cp /bin/true /srv/hostlib/libnvidia-ml.so.595.71.05")
        yield twin
    finally:
        runtime.stop(name)


def sh(twin, cmd: str, timeout: int = 60) -> str:
    r = subprocess.run(runtime.ssh_command(twin.name, [cmd]), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def nccl_probe(twin) -> dict:
    command = NcclState().command([NCCL_CONF], [CT])
    return NcclState().process(sh(twin, f"sh -c {word(command)}", timeout=30).splitlines())["containers"][CT]


def userspace_probe(twin) -> dict:
    command = ContainerUserspace().command([CT])
    return ContainerUserspace().process(sh(twin, f"sh -c {word(command)}", timeout=30).splitlines())[
        "containers"][CT]


def test_the_cts_own_file_is_read(twin):
    sh(twin, f"printf 'NCCL_IB_DISABLE=1\\n' > {CT_ROOT}/etc/nccl.conf && chmod 640 {CT_ROOT}/etc/nccl.conf")
    entry = nccl_probe(twin)
    assert entry["readable"] and entry["file"]["mode"] == "640"
    expected = sh(twin, f"sha256sum < {CT_ROOT}/etc/nccl.conf").split()[0]
    assert entry["file"]["sha256"] == expected
    assert userspace_probe(twin)["glibc"] is True  # a merged-/usr CT: /lib64 and /lib are links


def test_a_symlinked_directory_in_the_ct_does_not_lead_to_the_hosts_file(twin):
    """The CT's /etc a link to a host directory: on main's probe the host file's digest came back."""
    sh(twin, f"cd {CT_ROOT} && mv etc etc.real && ln -s /srv/hostdir etc")
    try:
        entry = nccl_probe(twin)
    finally:
        sh(twin, f"cd {CT_ROOT} && rm etc && mv etc.real etc")
    host_sum = sh(twin, "sha256sum < /srv/hostdir/nccl.conf").split()[0]
    assert entry["file"] is None, f"the probe read the host's {NCCL_CONF} ({host_sum}) through the CT's /etc link"


def test_a_symlinked_file_in_the_ct_is_not_followed(twin):
    sh(twin, f"ln -sfn /srv/hostdir/nccl.conf {CT_ROOT}/etc/nccl.conf")
    try:
        entry = nccl_probe(twin)
    finally:
        sh(twin, f"rm -f {CT_ROOT}/etc/nccl.conf")
    assert entry["file"] is None and entry["readable"]  # MISSING: the stage's pct exec write replaces it


def test_a_fifo_in_the_ct_is_not_waited_on(twin):
    sh(twin, f"rm -f {CT_ROOT}/etc/nccl.conf && mkfifo {CT_ROOT}/etc/nccl.conf")
    try:
        entry = nccl_probe(twin)  # sh's timeout: 30 s
    finally:
        sh(twin, f"rm -f {CT_ROOT}/etc/nccl.conf")
    assert entry["file"] is None


def test_a_symlinked_library_directory_does_not_list_the_hosts_library(twin):
    """The CT's /usr/lib/x86_64-linux-gnu a link to a host directory holding an NVML library: on
    main's probe that library was listed as the CT's (and the stage would skip its install)."""
    d = f"{CT_ROOT}/usr/lib/x86_64-linux-gnu"
    sh(twin, f"mv {d} {d}.real && ln -s /srv/hostlib {d}")
    try:
        entry = userspace_probe(twin)
    finally:
        sh(twin, f"rm {d} && mv {d}.real {d}")
    assert entry["libs"] == [], entry
