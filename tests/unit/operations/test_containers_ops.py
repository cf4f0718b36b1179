"""Container user space stage: the fact and the install command run in a real shell on a fake
node whose running CT has its own root (its /usr an overlay of the host's) and init, read through
/proc/<init>/root and written by a `pct` that enters it, with a small stand-in of NVIDIA's .run
that honours the flags pvegpu passes."""

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from operations import containers
from plan.containers import INSTALLER_FLAGS, plan_userspace
from spec.models import ContainerSpec
from tests.unit.operations.fake_node import FakeNode
from tests.unit.operations.oprun import NO_BUILDS, run_op
from tests.unit.operations.test_nccl_ops import read_in_shell

VERSION = "595.71.05"

# A .run as far as pvegpu uses it: refuses to build modules, installs the NVML/CUDA libraries.
TEST_RUN = r"""#!/bin/sh
version=@VERSION@
case " $* " in *" --no-kernel-modules "*) ;; *) echo "would build kernel modules" >&2; exit 1 ;; esac
[ -n "$PVEGPU_TEST_INSTALLER_FAIL" ] && exit 3
d=/usr/lib/x86_64-linux-gnu
mkdir -p $d
rm -f $d/libnvidia-ml.so.* $d/libcuda.so.*
echo nvml > $d/libnvidia-ml.so.$version && ln -sf libnvidia-ml.so.$version $d/libnvidia-ml.so.1
echo cuda > $d/libcuda.so.$version
echo "$*" > /installer-flags
"""

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                                reason="needs root (mount namespace, overlay, chroot)")


@pytest.fixture
def node(tmp_path):
    """A fake node (tests/unit/operations/fake_node.py): CT 200 running with its own root and
    init, CT 201 stopped; the installer at a local path."""
    fake = FakeNode(tmp_path)
    root = fake.ct(200, "running")
    fake.ct(201, "stopped")
    run = tmp_path / f"NVIDIA-Linux-x86_64-{VERSION}.run"
    run.write_text(TEST_RUN.replace("@VERSION@", VERSION))
    yield {"fake": fake.dir, "node": fake, "root": root, "env": fake.env, "run": run,
           "sha": hashlib.sha256(run.read_bytes()).hexdigest(), "cache": tmp_path / "cache"}
    fake.stop()


def shell(command, env):
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, env=env)


def read_state(node, ctids=(200, 201)):
    """`container_userspace_state` on the fake node: the guest state read first, then every CT of
    the spec looked into through its init's root (the fact's arguments come from the spec alone, so
    it goes in the first prefetch round), no Proxmox CLI started; only the running CT is kept."""
    calls = node["node"].calls()
    state, commands = read_in_shell(node["env"], containers.container_userspace_state, list(ctids))
    assert "for id in 200 201; do" in commands[1] and node["node"].calls() == calls
    assert sorted(state["containers"]) == [200]  # 201 is stopped: its init is not found, nothing kept
    return state


def test_fact_parses_stopped_and_missing_containers_and_host_driver():
    fact = containers.ContainerUserspace()
    nvrm = (f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {VERSION}  Release Build  "
            "(dvs-builder@U16-I3-A03-02-4)  Mon May 13 17:10:33 UTC 2024")  # the real line's shape
    state = fact.process(["@@ root", "64:2", "@@ host-driver", nvrm, "@@ ct 200",
                          "root 65:34", "arch x86_64", "glibc yes",
                          f"lib /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}"])
    assert state == {"host_root": "64:2", "host_driver": VERSION,
                     "containers": {200: {"root": "65:34", "arch": "x86_64", "glibc": True,
                                          "libs": [f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}"]}}}
    # its init was not found (the CT stopped since): no answer, not an empty CT
    failed = fact.process(["@@ ct 200"])
    assert failed["containers"] == {} and failed["host_driver"] is None


def test_install_command_quotes_values_and_passes_the_no_modules_flags():
    commands, _ = run_op(containers.container_userspace, ctid=200, action="install", reason="r", version=VERSION,
                         installer_url="/srv/it's here.run", sha256="a" * 64,
                         cached="/var/cache/pvegpu/sources/x.run", check_nvml=False, facts=NO_BUILDS)
    assert len(commands) == 1
    cmd = commands[0]
    assert "'/srv/it'\"'\"'s here.run'" in cmd
    assert "pct push 200 /var/cache/pvegpu/sources/x.run" in cmd
    assert f"sh /root/.pvegpu-NVIDIA-Linux-x86_64-{VERSION}.run {' '.join(INSTALLER_FLAGS)}" in cmd
    assert "nvidia-smi" not in cmd  # the host does not run this version yet: NVML cannot work
    assert run_op(containers.container_userspace, ctid=200, action="ok", reason="CT 200 has it",
                  version=VERSION, facts=NO_BUILDS) == ([], "CT 200 has it")


@needs_root
def test_install_into_the_containers_own_root_then_nothing_to_do(node):
    env = node["env"]
    state = read_state(node)
    assert state["status"] == {200: "running", 201: "stopped"}
    assert state["containers"][200]["libs"] == [] and state["containers"][200]["root"] != state["host_root"]
    cts = {200: ContainerSpec(gpus=["0000:01:00.0"]), 201: ContainerSpec(gpus=["0000:21:00.0"])}
    steps = plan_userspace(VERSION, cts, state)
    assert [(s.ctid, s.action) for s in steps] == [(200, "install"), (201, "skip")]

    cached = str(node["cache"] / f"{node['sha']}-installer.run")
    commands, _ = run_op(containers.container_userspace, ctid=200, action="install", reason=steps[0].reason,
                         version=VERSION, installer_url=str(node["run"]), sha256=node["sha"], cached=cached,
                         check_nvml=False, facts=NO_BUILDS)
    done = shell(commands[0], env)
    assert done.returncode == 0, done.stderr
    upper = node["root"] / ".usr-upper/lib/x86_64-linux-gnu"
    assert (upper / f"libnvidia-ml.so.{VERSION}").exists(), "installed in the CT's root"
    assert not Path(f"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}").exists(), "not in the host's /usr"
    assert (node["root"] / "installer-flags").read_text().split() == list(INSTALLER_FLAGS)
    assert not (node["root"] / f"root/.pvegpu-NVIDIA-Linux-x86_64-{VERSION}.run").exists(), "installer removed"

    again = plan_userspace(VERSION, cts, read_state(node))
    assert [(s.ctid, s.action) for s in again] == [(200, "ok"), (201, "skip")]


@needs_root
def test_failed_install_reports_removes_the_installer_and_bad_checksum_pushes_nothing(node):
    env = dict(node["env"], PVEGPU_TEST_INSTALLER_FAIL="1")
    cached = str(node["cache"] / f"{node['sha']}-installer.run")
    cmd = containers.install_command(200, VERSION, str(node["run"]), node["sha"], cached, check_nvml=False)
    failed = shell(cmd, env)
    assert failed.returncode != 0
    assert f"the NVIDIA {VERSION} installer failed in CT 200 (exit 3)" in failed.stderr
    assert not (node["root"] / f"root/.pvegpu-NVIDIA-Linux-x86_64-{VERSION}.run").exists()

    calls_before = (node["fake"] / "calls").read_text()
    bad = containers.install_command(200, VERSION, str(node["run"]), "b" * 64,
                                     str(node["cache"] / "other.run"), check_nvml=False)
    refused = shell(bad, node["env"])
    assert refused.returncode != 0 and "checksum mismatch" in refused.stderr
    assert (node["fake"] / "calls").read_text() == calls_before, "nothing reached the container"


@needs_root
@pytest.mark.parametrize("smi_says, ok", [
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", True),  # nodes pending
    ("Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 580.95", False),
])
def test_after_install_only_a_version_mismatch_fails_the_run(node, smi_says, ok):
    # written through the CT's mounted root (its init's view), as a file of the CT
    smi = Path(f"/proc/{(node['fake'] / 'ct200.pid').read_text().strip()}/root/usr/local/bin/nvidia-smi")
    smi.parent.mkdir(parents=True, exist_ok=True)
    smi.write_text(f"#!/bin/sh\nprintf '%s\\n' '{smi_says}'\nexit 9\n")
    smi.chmod(0o755)
    cached = str(node["cache"] / f"{node['sha']}-installer.run")
    cmd = containers.install_command(200, VERSION, str(node["run"]), node["sha"], cached, check_nvml=True)
    done = shell(cmd, node["env"])
    assert (done.returncode == 0) is ok, done.stderr
    if not ok:
        assert "pvegpu: nvidia-smi fails in CT 200 after installing 595.71.05" in done.stderr
        assert "version mismatch" in done.stderr
