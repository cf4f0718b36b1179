"""Whole-run guarantees on fresh twins: --dry changes nothing, converge, a second converge
reports no changes, host checks pass. Same on the GRUB/Intel twin and on kpro6's hardware on
Proxmox VE 9.2 (kpro6-pve9: trixie root, GCC 14, pve-container 6.1)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import manifest_diff, root_manifest, run_host_checks, run_pyinfra
from tests.twin import runtime

# each profile's GPU container (inventories/twin.yml)
CONTAINER = {"kpro6": 200, "intel2": 201, "kpro6-pve9": 200}

pytestmark = [pytest.mark.twin]


@pytest.mark.parametrize("profile", ["kpro6", "intel2", "kpro6-pve9"])
def test_dry_converge_idempotent_checks(twin_factory, profile):
    twin = twin_factory(profile, name=f"e2e-{profile}")
    env = {"PVEGPU_TWINS": twin.name}
    upper = Path(twin.root).parent / "upper"
    assert upper.is_dir(), f"twin overlay upper dir missing: {upper}"

    before = root_manifest(upper)
    dry = run_pyinfra("inventories/twin.py", "deploy.py", "--dry", env=env)
    assert dry.rc == 0, dry.output[-4000:]
    assert f"pvegpu plan for {twin.name}" in dry.output
    changed = manifest_diff(before, root_manifest(upper))
    assert not changed, "--dry changed the twin:\n" + "\n".join(changed[:40])

    first = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert first.rc == 0, first.output[-6000:]

    second = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert second.rc == 0, second.output[-6000:]
    assert second.totals.get("error", 0) == 0
    assert second.changed == 0, "second run changed something:\n" + second.output[-6000:]
    # every fact round trip costs a user on a far host: the budget of issue 9
    assert 0 < second.remote_commands <= 40, f"no-change converge sent {second.remote_commands} commands"
    # the stages' facts arrive in at most two commands (facts.once.prefetch: one before the
    # preflights, one before the applies), not one per stage
    probes = re.findall(r"Running command on [^\n]*@@pvegpu-section ", second.output)
    assert 1 <= len(probes) <= 2, f"{len(probes)} commands carry batched probe sections, want 1-2"
    assert second.remote_commands <= 6, f"no-change converge sent {second.remote_commands} commands, want <= 6"

    checks = run_host_checks("inventories/twin.py", env=env)
    assert checks.returncode == 0, checks.stdout[-6000:] + checks.stderr[-2000:]

    # as on a serving host, its GPU container runs: a no-change converge still starts no Proxmox
    # CLI (pct, qm, pvesh, pveversion; pct exec included), each a Perl start-up of 0.3-0.6 s on a
    # real node (issue 26 part 5): guests, versions and the CT's files are read without them
    subprocess.run(runtime.ssh_command(twin.name, [f"pct start {CONTAINER[profile]}"]), check=True,
                   capture_output=True, timeout=120)
    running = run_pyinfra("inventories/twin.py", "deploy.py", env=env)  # the CT's NCCL file
    assert running.rc == 0, running.output[-6000:]
    runtime.count_pve_calls(twin.root, True)
    again = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    calls = runtime.count_pve_calls(twin.root, False)
    assert again.rc == 0 and again.changed == 0, again.output[-6000:]
    assert calls == [], f"a no-change converge with CT {CONTAINER[profile]} running started Proxmox CLIs: {calls}"
    # and it reads everything in one prefetch round: every stage's facts take their arguments from
    # the spec (the CT ones keep the running CTs), and the CT operation takes that round's reading
    # while nothing before it ran (facts.once.fact_unless_changed)
    assert again.remote_commands == 1, f"no-change converge sent {again.remote_commands} commands, want 1"
