"""A driver upgrade on a twin ends with the driver the host runs (issue 28 part 3).

kpro6's twin boots with nvidia 595.71.05 loaded. The test puts nvidia 595.82.01 on its disk as a
run that built and installed it would have (the module, with depmod), places the twin's .run of
that version, and runs the NVIDIA stage and the reboot policy alone (tests/e2e/stage_deploy.py):
user space of the new version is installed over a loaded old module, so the stage declares a
reboot; `--dry` shows it and changes nothing; with reboot.allowed the twin reboots once and then
runs the new module; a further run changes nothing and has no reboot pending; the stage's host
check of versions passes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import PYTEST, REPO, run_pyinfra
from tests.twin import installer, runtime

pytestmark = [pytest.mark.twin]

OLD, NEW = "595.71.05", "595.82.01"
STAGES = "operations.nvidia,operations.reboot"


def twin_sh(twin, command: str) -> str:
    done = subprocess.run(runtime.ssh_command(twin.name, [command]), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"in twin {twin.name}: {command}\n{done.stdout}{done.stderr}"
    return done.stdout


def modinfo_c(fields: dict[str, str]) -> str:
    """C source of an object whose .modinfo section modinfo/depmod read like a module's."""
    body = "".join(f"{k}={v}".replace('"', '\\"') + "\\0" for k, v in fields.items())
    return f'__attribute__((section(".modinfo"), used)) static const char modinfo[] = "{body}";\n'


def test_upgrade_over_a_loaded_driver_reboots_once_into_it(twin_factory, tmp_path):
    twin = twin_factory("kpro6", name=f"i28up-{os.getpid() % 10000}")
    root = Path(twin.root)
    release = twin_sh(twin, "uname -r").strip()
    assert f"  {OLD}  " in twin_sh(twin, "cat /proc/driver/nvidia/version")
    (root / "root/new-nvidia.c").write_text(modinfo_c({
        "version": NEW, "license": "Dual MIT/GPL", "name": "nvidia",
        "vermagic": f"{release} SMP preempt mod_unload modversions "}))
    moddir = f"/lib/modules/{release}/updates/pvegpu-nvidia"
    twin_sh(twin, f"gcc -c /root/new-nvidia.c -o {moddir}/nvidia.ko && depmod {release}")
    run = installer.build(NEW, root / "opt/nvidia")
    spec = {"hosts": {twin.name: {
        "ssh": {"hostname": twin.address, "port": twin.port, "user": "root", "key": twin.key},
        "node": "kpro6", "reboot": {"allowed": True},
        "nvidia": {"version": NEW, "persistenced": False,
                   "installer": {"url": f"/opt/nvidia/{run.name}",
                                 "sha256": hashlib.sha256(run.read_bytes()).hexdigest()}}}}}
    (tmp_path / "upgrade.yml").write_text(json.dumps(spec))
    inventory = tmp_path / "inventory.py"
    overrides = {twin.name: {"ssh_known_hosts_file": "/dev/null", "ssh_strict_host_key_checking": "off"}}
    inventory.write_text("from spec.load import inventory_hosts\n"
                         f"hosts = inventory_hosts({str(tmp_path / 'upgrade.yml')!r}, overrides={overrides!r})\n")
    env = {"PVEGPU_STAGES": STAGES}
    reason = f"nvidia {OLD} is loaded but {NEW} is installed for {release}"

    dry = run_pyinfra(str(inventory), "tests/e2e/stage_deploy.py", "--dry", env=env)
    assert dry.rc == 0, dry.output[-4000:]
    assert f"{twin.name}: reboot pending" in dry.output and reason in dry.output, dry.output[-4000:]
    assert not (root / f"usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{NEW}").exists(), "--dry installed"

    first = run_pyinfra(str(inventory), "tests/e2e/stage_deploy.py", env=env)
    assert first.rc == 0, first.output[-4000:]
    assert reason in first.output and "Reboot for 1 reason(s): nvidia" in first.output, first.output[-4000:]
    assert f"  {NEW}  " in twin_sh(twin, "cat /proc/driver/nvidia/version"), "the reboot did not load the new module"
    assert twin_sh(twin, "ls /usr/lib/x86_64-linux-gnu/").split().count(f"libnvidia-ml.so.{NEW}") == 1

    second = run_pyinfra(str(inventory), "tests/e2e/stage_deploy.py", env=env)
    assert second.rc == 0, second.output[-4000:]
    assert second.changed == 0 and f"{twin.name}: no reboot pending" in second.output, second.output[-4000:]

    # the stage's version check on the host after the reboot: module, loaded driver, firmware, user space
    checks = subprocess.run([PYTEST, "-q", "-p", "no:cacheprovider", "tests/host/test_nvidia.py", "--inventory",
                             str(inventory), "-k", "versions_are_equal"], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert checks.returncode == 0 and "1 passed" in checks.stdout, checks.stdout[-3000:]
