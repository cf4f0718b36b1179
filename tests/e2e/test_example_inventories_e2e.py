"""Issue 42: every shipped example spec `--dry`s on its twin profile, as a user's first command.

Each host of inventories/*.yml (git-tracked) runs `pyinfra … deploy.py --dry` against a twin of its
profile (tests/twin/profiles/<name>.yml: the file's name, else the host's): the
spec as shipped, only its ssh connection swapped for the twin's (tests/e2e/harness.spec_inventory),
loaded as the inventory loads it. The run may refuse only what the example leaves to its user on
purpose (EXPECTED_REFUSALS, each with the comment of the example that says so); anything else it
refuses, or a traceback, fails. The twin's root is unchanged afterwards (manifest).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from spec.load import load_spec_file
from tests.e2e.harness import manifest_diff, root_manifest, run_pyinfra, spec_inventory
from tests.twin import runtime

REPO = Path(__file__).resolve().parents[2]
PROFILES = {p.stem for p in (REPO / "tests/twin/profiles").glob("*.yml")}
TRACKED = subprocess.run(["git", "ls-files", "inventories/*.yml"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
EXAMPLES = [(yml, host) for yml in TRACKED for host in load_spec_file(REPO / yml)]
# (example, host) -> the refusals it ships with on purpose; the example's comment says why
EXPECTED_REFUSALS: dict[tuple[str, str], list[str]] = {
    # "Used to run facts and the host checks that apply to a plain GPU host" (its comment): no
    # nvidia.installer (the firmware's source) and no headers on that VM, so a converge refuses both
    ("inventories/h200-vm.yml", "@local"): ["no headers at /lib/modules/", "GSP firmware for 580.159.04 is missing"],
}


def profile_of(yml: str, host: str) -> str:
    for name in (Path(yml).stem, host):  # the file names its profile (kpro6-pve9.yml: host kpro6), else the host
        if name in PROFILES:
            return name
    raise AssertionError(f"{yml} host {host}: no twin profile of that name in tests/twin/profiles")


@pytest.mark.twin
@pytest.mark.parametrize("yml,host", EXAMPLES, ids=[f"{Path(y).stem}-{h}" for y, h in EXAMPLES])
def test_example_dry_runs_on_its_twin_profile(twin_factory, tmp_path, yml, host):
    profile = profile_of(yml, host)
    twin = twin_factory(profile)
    spec = load_spec_file(REPO / yml)[host].model_dump(mode="json", exclude_none=True, exclude={"ssh"})
    inventory = spec_inventory(tmp_path, twin, spec, "example")
    root = runtime.spec_of(twin.name)["root"]
    before = root_manifest(root)
    result = run_pyinfra(inventory, "deploy.py", "--dry", env={"PYTHONPATH": str(REPO)}, timeout=600)
    assert "Traceback" not in result.output, result.output[-4000:]
    expected = EXPECTED_REFUSALS.get((yml, host), [])
    if expected:
        assert result.rc != 0, result.output[-4000:]
        refused = [line for line in result.output.splitlines() if line.startswith("  - [")]
        assert refused and all(any(e in line for e in expected) for line in refused), result.output[-4000:]
    else:
        assert result.rc == 0, result.output[-4000:]
    assert manifest_diff(before, root_manifest(root)) == [], "--dry changed the twin"


def test_each_example_has_the_profile_it_is_written_for():
    assert profile_of("inventories/kpro6-pve9.yml", "kpro6") == "kpro6-pve9"
    assert profile_of("inventories/kpro6.yml", "kpro6") == "kpro6"
    assert profile_of("inventories/twin.yml", "intel2") == "intel2"
    assert profile_of("inventories/h200-vm.yml", "@local") == "h200-vm"


@pytest.mark.twin
def test_the_pve9_example_on_a_bookworm_host_is_refused_before_the_clone(twin_factory, tmp_path):
    """Issue 40 item 3: inventories/kpro6-pve9.yml (proxmox_ve: 9, pve-kernel master, a 9 kernel)
    on a host still on bookworm: the --dry refuses the kernel of the other release from the host's
    /etc/os-release before anything is cloned or built (on main it planned the clone of master and
    a build with bookworm's GCC 12), and still prints the upgrade check; the twin is unchanged."""
    twin = twin_factory("kpro6")
    spec = load_spec_file(REPO / "inventories/kpro6-pve9.yml")["kpro6"].model_dump(mode="json", exclude_none=True,
                                                                                exclude={"ssh"})
    inventory = spec_inventory(tmp_path, twin, spec, "example")
    root = runtime.spec_of(twin.name)["root"]
    before = root_manifest(root)
    result = run_pyinfra(inventory, "deploy.py", "--dry", env={"PYTHONPATH": str(REPO)}, timeout=600)
    assert "Traceback" not in result.output, result.output[-4000:]
    assert result.rc != 0, result.output[-4000:]
    assert ("[release] kernel.version 7.0.14-14-pvegpu-pve is a Proxmox VE 9 kernel (trixie: a 6.14 or newer "
            "pve-kernel without -bpo12), but this host runs Debian bookworm (Proxmox VE 8)") in result.output, \
        result.output[-4000:]
    assert "upgrade check: the spec says Proxmox VE 9 (proxmox_ve: 9) and this host runs 8." in result.output
    assert manifest_diff(before, root_manifest(root)) == [], "--dry changed the twin"
    assert not list(Path(root, "var/lib/pvegpu/kernel-build").glob("*/src")), "a pve-kernel clone was made"
