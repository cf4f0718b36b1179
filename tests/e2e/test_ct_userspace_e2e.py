"""Container user space on the kpro6 and intel2 twins (issue 7 part 5): a running GPU container gets exactly
the host's NVIDIA user space from the host's installer, `nvidia-smi` inside sees exactly its GPUs,
a drifted container (another version installed inside) is found, previewed without change, and
fixed; a converged one is left alone."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from facts.gpu import parse_bus_ids
from tests.e2e.harness import manifest_diff, root_manifest, run_host_checks, run_pyinfra
from tests.twin import runtime

pytestmark = [pytest.mark.twin]

# inventories/twin.yml: each twin's GPU container, its GPUs and the host's nvidia.version
CASES = {
    "kpro6": (200, ["0000:01:00.0", "0000:21:00.0", "0000:41:00.0", "0000:61:00.0"], "595.71.05"),
    "intel2": (201, ["0000:19:00.0"], "570.172.08"),
}


def ssh(name: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(runtime.ssh_command(name, [command]), capture_output=True, text=True, timeout=120)


def smi_bus_ids(name: str, ctid: int) -> tuple[int, list[str]]:
    out = ssh(name, f"pct exec {ctid} -- nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader")
    ids = parse_bus_ids(out.stdout.splitlines()) if out.returncode == 0 else []
    return out.returncode, ids or [out.stdout + out.stderr]


@pytest.mark.parametrize("profile", sorted(CASES))
def test_container_gets_the_hosts_user_space_and_drift_is_fixed(twin_factory, tmp_path, profile):
    ctid, ct_gpus, version = CASES[profile]
    twin = twin_factory(profile, name=f"ctu-{profile}")
    env = {"PVEGPU_TWINS": twin.name}
    first = run_pyinfra("inventories/twin.py", "deploy.py", env=env)  # devices, bindings (reboots once)
    assert first.rc == 0, first.output[-4000:]
    assert f"CT {ctid} is stopped" in first.output, "a stopped CT is skipped with its reason"

    assert ssh(twin.name, f"pct start {ctid}").returncode == 0
    install = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert install.rc == 0, install.output[-4000:]
    assert f"CT {ctid} has no NVIDIA user space; installing {version}" in install.output
    rc, ids = smi_bus_ids(twin.name, ctid)
    assert rc == 0 and ids == ct_gpus, ids
    host_ls = ssh(twin.name, f"pct exec {ctid} -- ls /root/.pvegpu-NVIDIA-Linux-x86_64-{version}.run")
    assert host_ls.returncode != 0, "the pushed installer is removed from the CT"

    # the NCCL stage reached the same running CT's own root
    assert f"/etc/nccl.conf (container {ctid})" in ssh(twin.name, f"pct exec {ctid} -- cat /etc/nccl.conf").stdout
    assert (runtime.twin_dir(twin.name) / f"ct/{ctid}/upper/etc/nccl.conf").is_file()

    again = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert again.rc == 0 and again.changed == 0, again.output[-4000:]
    checks = run_host_checks("inventories/twin.py", env=env)
    assert checks.returncode == 0, checks.stdout[-4000:]
    # the CT checks ran (they skip, with these reasons, when no GPU CT runs)
    assert "no GPU container runs" not in checks.stdout and "no running container whose" not in checks.stdout

    # drift: someone installs another driver's user space inside the CT
    from tests.twin import installer

    installer.build("580.95.05", Path(twin.root) / "root")  # the twin's root is visible from here
    other = "/root/NVIDIA-Linux-x86_64-580.95.05.run"
    drift = ssh(twin.name, f"pct push {ctid} {other} /root/other.run && "
                           f"pct exec {ctid} -- sh /root/other.run --silent --no-kernel-modules && "
                           f"pct exec {ctid} -- rm -f /root/other.run && rm -f {other}")
    assert drift.returncode == 0, drift.stderr
    rc, msg = smi_bus_ids(twin.name, ctid)
    assert rc != 0 and "Driver/library version mismatch" in msg[0]
    broken = run_host_checks("inventories/twin.py", env=env)
    assert broken.returncode == 1
    assert f"CT {ctid} has NVIDIA user space 580.95.05 but the host runs driver {version}" in broken.stdout

    ct_dir = runtime.twin_dir(twin.name) / f"ct/{ctid}/upper"
    before = root_manifest(ct_dir)
    dry = run_pyinfra("inventories/twin.py", "deploy.py", "--dry", env=env)
    assert dry.rc == 0, dry.output[-4000:]
    assert "580.95.05" in dry.output and "mismatch" in dry.output
    assert manifest_diff(before, root_manifest(ct_dir)) == [], "--dry changed the CT"

    fixed = run_pyinfra("inventories/twin.py", "deploy.py", env=env)
    assert fixed.rc == 0 and fixed.changed >= 1, fixed.output[-4000:]
    rc, ids = smi_bus_ids(twin.name, ctid)
    assert rc == 0 and ids == ct_gpus, ids


def test_twin_inventory_pins_the_twin_installers_sha256(tmp_path):
    """inventories/twin.yml's nvidia.installer is the file the twin places at /opt/nvidia."""
    import hashlib

    from spec.load import load_spec_file
    from tests.e2e.harness import REPO
    from tests.twin import installer

    for name, spec in load_spec_file(REPO / "inventories" / "twin.yml").items():
        if spec.nvidia is None or spec.nvidia.installer is None:
            continue
        built = installer.build(spec.nvidia.version, tmp_path)
        assert spec.nvidia.installer.url == f"/opt/nvidia/{built.name}", name
        assert spec.nvidia.installer.sha256 == hashlib.sha256(built.read_bytes()).hexdigest(), (
            f"{name}: inventories/twin.yml pins another sha256 than tests/twin/installer.py builds")
