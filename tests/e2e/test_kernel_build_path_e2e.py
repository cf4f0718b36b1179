"""The kernel build path on the kpro6 twin, without compiling (issue 27 part 4): a proxmox-git
build is coming and the twin's root lacks git, devscripts and equivs (its apt lists have them).
`--dry` shows the stage installing exactly those with apt before the build, and changes
nothing; a real run installs them first, and where apt cannot (the twin has no network) it
stops there, naming them: nothing was cloned or built."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from plan import kernel as plan
from spec.models import KernelSpec
from tests.e2e.harness import run_pyinfra
from tests.e2e.test_kernel_trial_e2e import KERNEL, quiet_address

pytestmark = [pytest.mark.twin]

STAGES = "operations.kernel"
MISSING = "git devscripts equivs"  # not in the twin root (tests/twin/runtime.py PACKAGES)


def test_build_packages_installed_before_the_build_dry_then_real(twin_factory):
    twin = twin_factory("kpro6", address=quiet_address())
    root = Path(twin.root)
    free = shutil.disk_usage(root).free // 1024
    k = KernelSpec(**KERNEL)
    if free < plan.build_space_kib(k):
        pytest.skip(f"{free} KiB free here: the stage would refuse the build for space (its own unit test)")
    status = (root / "var/lib/dpkg/status").read_bytes()
    build = root / plan.build_dir(k, "running").lstrip("/")
    env = {"PVEGPU_TWINS": twin.name, "PVEGPU_STAGES": STAGES, "PVEGPU_E2E_KERNEL": json.dumps(KERNEL),
           "PVEGPU_E2E_NO_REBOOT": "1"}

    dry = run_pyinfra("inventories/twin.py", "tests/e2e/stage_deploy.py", "--dry", env=env, timeout=600)
    assert dry.rc == 0, dry.output[-4000:]
    assert f"Install the kernel build's packages: {MISSING}" in dry.output, dry.output[-4000:]
    assert dry.output.index("Install the kernel build's packages") < dry.output.index("Build kernel")
    assert (root / "var/lib/dpkg/status").read_bytes() == status and not build.exists(), "--dry changed the twin"

    real = run_pyinfra("inventories/twin.py", "tests/e2e/stage_deploy.py", env=env, timeout=600)
    assert real.rc != 0
    assert f"pvegpu: apt could not install {MISSING}, which the kernel build needs; nothing was built" in real.output, \
        real.output[-4000:]
    assert not (build / "build.sh").exists() and not (build / "src").exists()
