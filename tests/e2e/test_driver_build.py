"""The NVIDIA driver and module-options stages on a twin, for real (issue 6, "Done when").

What is built: Debian bookworm's non-free `nvidia-kernel-source` 535.309.01
(/usr/src/nvidia-kernel.tar.xz in the twin root). That is NVIDIA's *proprietary* kernel
module tree (the interface layer compiled here, plus NVIDIA's prebuilt nv-kernel.o), not the
open-gpu-kernel-modules tree: bookworm has no `nvidia-open-kernel-source`. It goes through the
same Makefile/Kbuild/conftest path as the open tree, so the spec says `open: false`, which the
stage allows on a host without Blackwell GPUs: the twin is intel2 (RTX A6000s). It is served
from that local path with its sha256 and built against the twin's real Debian 6.1 headers
(linux-headers-6.1.0-57-amd64 + -common) with gcc-12 and ccache: ~6-12 min on two cores.

One twin, in order: the real build + install; the options file and boot unit; checksum,
toolchain and firmware refusals for another version, each leaving the installed modules
byte-for-byte untouched; a second run that compiles nothing and changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import REPO, run_pyinfra
from tests.twin import runtime

pytestmark = [pytest.mark.twin, pytest.mark.slow]

PROFILE = "intel2"  # RTX A6000 (10de:2230): not Blackwell, so the proprietary tree may be built
RELEASE = "6.1.0-57-amd64"  # the twin root's Debian headers (the booted 6.8.12-11-pve has none)
TARBALL = "/usr/src/nvidia-kernel.tar.xz"
STAGES = {"PVEGPU_STAGES": "operations.nvidia,operations.module_options"}
STAGE_DEPLOY = str(REPO / "tests/e2e/stage_deploy.py")
CCACHE_STATS = ("CCACHE_DIR=/var/cache/pvegpu/ccache ccache --print-stats "
                "| grep -E '^(cache_miss|direct_cache_hit|preprocessed_cache_hit)[[:space:]]'")


def twin_sh(twin, command: str, check: bool = True) -> str:
    done = subprocess.run(runtime.ssh_command(twin.name, [command]), capture_output=True, text=True, timeout=600)
    if check and done.returncode != 0:
        raise AssertionError(f"in twin: {command}\n{done.stdout}{done.stderr}")
    return done.stdout


def write_inventory(tmp: Path, twin, nvidia: dict) -> str:
    spec = {"hosts": {twin.name: {"ssh": {"hostname": twin.address, "port": twin.port, "user": "root",
                                          "key": twin.key},
                                  "node": "intel2", "nvidia": nvidia}}}
    yml = tmp / "driver.yml"
    yml.write_text(json.dumps(spec))  # JSON is YAML
    inv = tmp / "driver_inventory.py"
    overrides = {twin.name: {"ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off"}}
    inv.write_text("from spec.load import inventory_hosts\n"
                   f"hosts = inventory_hosts({str(yml)!r}, overrides={overrides!r})\n")
    return str(inv)


def nvidia_spec(version: str, sha: str, **over) -> dict:
    spec = {"version": version, "open": False, "releases": [RELEASE],
            "modules_source": {"url": f"file://{TARBALL}", "sha256": sha}, "firmware": False,
            "uvm_disable_hmm": True, "nvreg": {"NVreg_EnableGpuFirmware": 1}, "persistenced": False}
    spec.update(over)
    return spec


def deploy(tmp: Path, twin, nvidia: dict):
    return run_pyinfra(write_inventory(tmp, twin, nvidia), STAGE_DEPLOY, env=STAGES)


def installed_state(twin) -> str:
    """Checksums of the installed modules and of depmod's index: any install or depmod changes it."""
    return twin_sh(twin, f"cd /lib/modules/{RELEASE} && find updates -type f -exec sha256sum {{}} + | sort; "
                         "sha256sum modules.dep modules.dep.bin", check=False)


@pytest.fixture
def driver_twin(twin_factory, twin_root_cache):
    root = Path(twin_root_cache)
    # build is an absolute link (-> /usr/src/linux-headers-…) that only resolves inside the twin
    assert (root / f"usr/src/linux-headers-{RELEASE}/Makefile").exists(), f"the twin root has no {RELEASE} headers"
    status = (root / "var/lib/dpkg/status").read_text()
    version = re.search(r"^Package: nvidia-kernel-source\n(?:.+\n)*?Version: (\d+\.\d+\.\d+)", status, re.M).group(1)
    sha = hashlib.sha256((root / TARBALL.lstrip("/")).read_bytes()).hexdigest()
    twin = twin_factory(PROFILE)
    # The profile seeds its own driver's NVML library (570.x); without an installer in the spec
    # the stage rightly refuses user space of another version, so this twin stands for a host
    # with no NVIDIA user space yet. Its seeded GSP firmware stays (the firmware refusal uses it).
    twin_sh(twin, "rm -f /usr/lib/x86_64-linux-gnu/libnvidia-ml.so*")
    seeded_fw = twin_sh(twin, "ls /lib/firmware/nvidia").split()
    return twin, version, sha, seeded_fw


def test_driver_builds_installs_refuses_and_skips(driver_twin, tmp_path):
    twin, version, sha, seeded_fw = driver_twin
    assert twin_sh(twin, f"modinfo -k {RELEASE} -F version nvidia 2>/dev/null || true").strip() == ""

    # 1. the real build and install
    run = deploy(tmp_path, twin, nvidia_spec(version, sha))
    assert run.rc == 0, run.output[-5000:]
    assert twin_sh(twin, f"modinfo -k {RELEASE} -F version nvidia").strip() == version
    assert twin_sh(twin, f"modinfo -k {RELEASE} -F vermagic nvidia").split()[0] == RELEASE
    assert twin_sh(twin, f"modinfo -k {RELEASE} -n nvidia").strip() == \
        f"/lib/modules/{RELEASE}/updates/pvegpu-nvidia/nvidia.ko"
    assert twin_sh(twin, f"modinfo -k {RELEASE} -F version nvidia-uvm").strip() == version
    assert "cache_miss" in twin_sh(twin, CCACHE_STATS), "the build did not go through ccache"
    # progress while it built (issue 20): at least one report between its start and its end
    what = f"nvidia {version} build for {RELEASE}"
    building = run.output[run.output.index(f"{what}: started"):run.output.index(f"{what}: done in ")]
    assert re.search(rf"{re.escape(what)}: \d+ objects built, .* elapsed", building), building[-3000:]

    # 2. module options and the boot unit
    config = twin_sh(twin, "modprobe -c | grep -E '^options (nvidia|nvidia_uvm) '").splitlines()
    assert "options nvidia_uvm uvm_disable_hmm=1" in config
    assert "options nvidia NVreg_EnableGpuFirmware=1" in config
    verify = subprocess.run(runtime.ssh_command(twin.name, [
        "systemd-analyze verify --man=no /etc/systemd/system/pvegpu-nvidia-nodes.service"]),
        capture_output=True, text=True)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    assert twin_sh(twin, "readlink /etc/systemd/system/multi-user.target.wants/pvegpu-nvidia-nodes.service").strip() \
        == "/etc/systemd/system/pvegpu-nvidia-nodes.service"

    # 3. refusals for another version: each stops the run and leaves the installed modules untouched
    before = installed_state(twin)
    assert "updates/pvegpu-nvidia/nvidia.ko" in before
    other = "535.309.99"
    run = deploy(tmp_path, twin, nvidia_spec(other, "0" * 64))
    assert run.rc != 0 and f"has sha256 {sha} but the spec says {'0' * 64}" in run.output, run.output[-3000:]
    assert installed_state(twin) == before

    conf = f"/lib/modules/{RELEASE}/build/include/config/auto.conf"
    twin_sh(twin, f"cp {conf} /root/auto.conf.orig && "
                  f"sed -i 's/^CONFIG_CC_VERSION_TEXT=.*/CONFIG_CC_VERSION_TEXT=gcc-13 (Debian 13.2.0-25) 13.2.0/' {conf}")
    try:
        run = deploy(tmp_path, twin, nvidia_spec(other, sha))
        assert run.rc != 0 and "apt install gcc-13" in run.output and "incident 1" in run.output, run.output[-3000:]
    finally:
        twin_sh(twin, f"cp /root/auto.conf.orig {conf}")
    assert installed_state(twin) == before

    assert seeded_fw, "the intel2 profile seeds its driver's GSP firmware"
    run = deploy(tmp_path, twin, nvidia_spec(other, sha, firmware=True))
    assert run.rc != 0 and f"GSP firmware for {other} is missing" in run.output \
        and f"found GSP firmware only for {', '.join(sorted(seeded_fw))}" in run.output, run.output[-3000:]
    assert installed_state(twin) == before

    # 4. a second run of the same spec compiles nothing and changes nothing
    ccache_before = twin_sh(twin, CCACHE_STATS)
    run = deploy(tmp_path, twin, nvidia_spec(version, sha))
    assert run.rc == 0, run.output[-3000:]
    assert run.changed == 0, run.output[-3000:]
    assert f"nvidia {version} is installed for {RELEASE}" in run.output
    assert installed_state(twin) == before
    assert twin_sh(twin, "ls /var/tmp/pvegpu/nvidia-build/*/* 2>/dev/null || true").strip() == ""
    assert twin_sh(twin, CCACHE_STATS) == ccache_before, "the second run ran the compiler"
