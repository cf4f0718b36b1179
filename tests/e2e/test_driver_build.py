"""The NVIDIA driver and module-options stages on a twin, for real (issue 6, "Done when").

Debian's 535 NVIDIA module tree (nvidia-kernel-source, in the twin root at
/usr/src/nvidia-kernel.tar.xz; bookworm has no nvidia-open-kernel-source) stands in for the
open-gpu-kernel-modules archive, served from that local path with its sha256, and is built
against the twin's real Debian 6.1 headers with gcc-12 and ccache (minutes on two cores).

One twin, in order: three refusals before anything is installed (checksum, toolchain,
firmware), the real build + install, the options file / unit checks, the same refusals again
with installed modules left byte-for-byte untouched, and a second run that compiles nothing.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import REPO, run_pyinfra
from tests.twin import runtime

pytestmark = [pytest.mark.twin, pytest.mark.slow]

PROFILE = "kpro6"
TARBALL = "/usr/src/nvidia-kernel.tar.xz"
STAGES_DEPLOY = """\
from pyinfra import host
from pyinfra.api.exceptions import DeployError
from operations import module_options, nvidia
spec = host.data.pvegpu_spec
refusals = nvidia.preflight(spec) + module_options.preflight(spec)
if refusals:
    raise DeployError("pvegpu preflight refused; nothing was changed:\\n  - " + "\\n  - ".join(refusals))
nvidia.apply(spec)
module_options.apply(spec)
"""


def twin_sh(twin, command: str, check: bool = True) -> str:
    done = subprocess.run(runtime.ssh_command(twin.name, [command]), capture_output=True, text=True, timeout=600)
    if check and done.returncode != 0:
        raise AssertionError(f"in twin: {command}\n{done.stdout}{done.stderr}")
    return done.stdout


def write_inventory(tmp: Path, twin, release: str, nvidia: dict) -> str:
    spec = {"hosts": {"drv": {"ssh": {"hostname": twin.address, "port": twin.port, "user": "root", "key": twin.key},
                              "node": "kpro6", "nvidia": nvidia}}}
    yml = tmp / "drv.yml"
    yml.write_text(json.dumps(spec))  # JSON is YAML
    inv = tmp / "drv_inventory.py"
    overrides = {"drv": {"ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off",
                         "pvegpu_nvidia_releases": [release]}}
    inv.write_text("from spec.load import inventory_hosts\n"
                   f"hosts = inventory_hosts({str(yml)!r}, overrides={overrides!r})\n")
    return str(inv)


@pytest.fixture
def driver_twin(twin_factory, twin_root_cache, tmp_path):
    twin = twin_factory(PROFILE)
    root = Path(twin_root_cache)
    releases = sorted(p.name for p in (root / "lib/modules").iterdir() if (p / "build").exists())
    assert releases, "the twin root has no kernel headers"
    status = (root / "var/lib/dpkg/status").read_text()
    version = status.split("Package: nvidia-kernel-source\n", 1)[1].split("Version: ", 1)[1].split("-", 1)[0]
    sha = hashlib.sha256((root / TARBALL.lstrip("/")).read_bytes()).hexdigest()
    deploy = tmp_path / "driver_stages.py"
    deploy.write_text(STAGES_DEPLOY)
    return twin, releases[-1], version, sha, str(deploy)


def nvidia_spec(version: str, sha: str, **over) -> dict:
    spec = {"version": version, "modules_source": {"url": TARBALL, "sha256": sha}, "firmware": False,
            "uvm_disable_hmm": True, "nvreg": {"NVreg_EnableGpuFirmware": 1}, "persistenced": False}
    spec.update(over)
    return spec


def installed_state(twin, release: str) -> str:
    return twin_sh(twin, f"find /lib/modules/{release}/updates -type f -exec sha256sum {{}} + 2>/dev/null | sort; "
                         f"ls -l --time-style=+%s /lib/modules/{release}/modules.dep 2>/dev/null", check=False)


def refusals(twin, tmp: Path, release: str, version: str, sha: str, deploy: str) -> None:
    """Checksum, toolchain and firmware refusals: each stops the run with its message."""
    inv = write_inventory(tmp, twin, release, nvidia_spec(version, "0" * 64))
    run = run_pyinfra(inv, deploy)
    assert run.rc != 0 and f"has sha256 {sha} but the spec says {'0' * 64}" in run.output, run.output[-3000:]

    conf = f"/lib/modules/{release}/build/include/config/auto.conf"
    twin_sh(twin, f"cp {conf} /root/auto.conf.orig && "
                  f"sed -i 's/^CONFIG_CC_VERSION_TEXT=.*/CONFIG_CC_VERSION_TEXT=gcc-13 (Debian 13.2.0-25) 13.2.0/' {conf}")
    try:
        run = run_pyinfra(write_inventory(tmp, twin, release, nvidia_spec(version, sha)), deploy)
        assert run.rc != 0 and "apt install gcc-13" in run.output and "incident 1" in run.output, run.output[-3000:]
    finally:
        twin_sh(twin, f"cp /root/auto.conf.orig {conf}")

    twin_sh(twin, "mkdir -p /lib/firmware/nvidia/535.261.03 && echo stale > /lib/firmware/nvidia/535.261.03/gsp_ga10x.bin")
    try:
        run = run_pyinfra(write_inventory(tmp, twin, release, nvidia_spec(version, sha, firmware=True)), deploy)
        assert run.rc != 0 and "found GSP firmware only for 535.261.03" in run.output, run.output[-3000:]
    finally:
        twin_sh(twin, "rm -rf /lib/firmware/nvidia")


def test_driver_builds_installs_refuses_and_skips(driver_twin, tmp_path):
    twin, release, version, sha, deploy = driver_twin
    assert twin_sh(twin, f"modinfo -k {release} -F version nvidia 2>/dev/null || true").strip() == ""

    # 1. refusals before anything is installed
    refusals(twin, tmp_path, release, version, sha, deploy)
    assert installed_state(twin, release).strip() == "", "a refused run installed something"

    # 2. the real build and install
    inv = write_inventory(tmp_path, twin, release, nvidia_spec(version, sha))
    run = run_pyinfra(inv, deploy)
    assert run.rc == 0, run.output[-5000:]
    assert twin_sh(twin, f"modinfo -k {release} -F version nvidia").strip() == version
    vermagic = twin_sh(twin, f"modinfo -k {release} -F vermagic nvidia").split()
    assert vermagic[0] == release
    assert twin_sh(twin, f"modinfo -k {release} -n nvidia").strip() == \
        f"/lib/modules/{release}/updates/pvegpu-nvidia/nvidia.ko"
    assert twin_sh(twin, f"modinfo -k {release} -F version nvidia-uvm").strip() == version

    # 3. module options and the boot unit
    config = twin_sh(twin, "modprobe -c | grep -E '^options (nvidia|nvidia_uvm) '")
    assert "options nvidia_uvm uvm_disable_hmm=1" in config.splitlines()
    assert "options nvidia NVreg_EnableGpuFirmware=1" in config.splitlines()
    verify = subprocess.run(runtime.ssh_command(twin.name, [
        "systemd-analyze verify --man=no /etc/systemd/system/pvegpu-nvidia-nodes.service"]),
        capture_output=True, text=True)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    assert twin_sh(twin, "readlink /etc/systemd/system/multi-user.target.wants/pvegpu-nvidia-nodes.service").strip() \
        == "/etc/systemd/system/pvegpu-nvidia-nodes.service"

    # 4. refusals for a new version leave the installed modules untouched
    before = installed_state(twin, release)
    assert "nvidia.ko" in before
    refusals(twin, tmp_path, release, "535.309.99", sha, deploy)
    assert installed_state(twin, release) == before

    # 5. a second run compiles nothing and changes nothing
    ccache_before = twin_sh(twin, "CCACHE_DIR=/var/cache/pvegpu/ccache ccache --print-stats | grep -E '^(cache_miss|direct_cache_hit|preprocessed_cache_hit)'")
    run = run_pyinfra(inv, deploy)
    assert run.rc == 0, run.output[-3000:]
    assert run.changed == 0, run.output[-3000:]
    assert f"nvidia {version} is installed for {release}" in run.output
    assert installed_state(twin, release) == before
    assert twin_sh(twin, "ls /var/tmp/pvegpu/nvidia-build/*/* 2>/dev/null || true").strip() == ""
    assert twin_sh(twin, "CCACHE_DIR=/var/cache/pvegpu/ccache ccache --print-stats | grep -E '^(cache_miss|direct_cache_hit|preprocessed_cache_hit)'") \
        == ccache_before, "the second run ran the compiler"
