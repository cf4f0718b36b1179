"""plan.kernel: build parallelism (incident 14), build identity, the stage's next action, pins."""

import subprocess
from pathlib import Path

import pytest

from plan.kernel import (
    build_dir,
    build_id,
    build_jobs,
    kernel_decision,
    localversion,
    package_globs,
    pin_for_good_command,
    resolve_jobs,
    trial_pin_command,
)
from spec.models import KernelSpec

H200_MEMINFO = Path(__file__).resolve().parents[1] / "fixtures" / "h200-vm" / "meminfo.txt"
GIT = {"kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git", "ref": "v6.14.8-2"}


def kernel(**kw) -> KernelSpec:
    return KernelSpec(**{"version": "6.14.8-2-pve", "source": GIT, **kw})


@pytest.mark.parametrize("cores,mem_gib,jobs", [
    (128, 256, 128),   # enough RAM for every core
    (128, 64, 32),     # incident 14: 128 cores but only 64 GiB -> 32 jobs, not 128
    (2, 24, 2),        # this CI machine
    (16, 3, 1),        # less than one job's worth of RAM still builds, with one job
    (None, 8, 1),      # unknown cores
])
def test_jobs_from_cores_and_ram(cores, mem_gib, jobs):
    assert build_jobs(cores, mem_gib * 1024 * 1024) == jobs


def test_jobs_from_real_meminfo():
    total_kib = next(int(l.split()[1]) for l in H200_MEMINFO.read_text().splitlines() if l.startswith("MemTotal:"))
    assert build_jobs(1000, total_kib) == total_kib // (2 * 1024 * 1024)
    assert resolve_jobs("auto", 4, total_kib) == min(4, total_kib // (2 * 1024 * 1024))
    assert resolve_jobs(3, 128, 1) == 3


def test_build_id_changes_with_ref_config_and_base():
    a = build_id(kernel())
    assert a == build_id(kernel())
    assert a != build_id(kernel(source={**GIT, "ref": "v6.14.8-3"}))
    assert a != build_id(kernel(config_fragments=["CONFIG_X=y"]))
    assert a != build_id(kernel(), base_config="tinyconfig")
    assert build_dir(kernel()).startswith("/var/lib/pvegpu/kernel-build/6.14.8-2-pve-")


def test_localversion():
    assert localversion(KernelSpec(version="6.1.192-pvegpu-ci", source={"kind": "tarball", "url": "/x", "sha256": "0" * 64})) == "-pvegpu-ci"


def facts(installed=(), running="6.8.12-4-pve", pinned=None, next_boot=None, manifest_id=None, build=None, trial=None):
    return {
        "kernels": {"running": running, "installed": list(installed), "pinned": pinned, "next_boot": next_boot},
        "installed_manifest": {"build_id": manifest_id} if manifest_id else None,
        "build": build or {"running": False, "rc": None, "debs": [], "manifest": None},
        "trial": trial,
    }


def test_decisions_through_a_trial_boot():
    k = kernel()
    bid = build_id(k)
    assert kernel_decision(k, facts())["action"] == "build"
    assert kernel_decision(k, facts(build={"running": True}))["action"] == "attach"
    done_build = {"running": False, "rc": 0, "debs": ["proxmox-kernel-6.14.8-2-pve_1_amd64.deb",
                                                      "proxmox-headers-6.14.8-2-pve_1_amd64.deb"], "manifest": {"build_id": bid}}
    assert kernel_decision(k, facts(build=done_build))["action"] == "install"
    # a finished build whose packages carry another release is not installed
    other = {**done_build, "debs": ["proxmox-kernel-6.14.8-2-bpo12-pve_6.14.8-2~bpo12+1_amd64.deb"]}
    wrong = kernel_decision(k, facts(build=other))
    assert wrong["action"] == "wrong-debs" and "proxmox-kernel-6.14.8-2-bpo12-pve_6.14.8-2~bpo12+1_amd64.deb" in wrong["why"]
    stale_build = {**done_build, "manifest": {"build_id": "other"}}
    assert kernel_decision(k, facts(build=stale_build))["action"] == "build"
    inst = ["6.8.12-4-pve", "6.14.8-2-pve"]
    assert kernel_decision(k, facts(inst, manifest_id=bid))["action"] == "trial"
    assert kernel_decision(k, facts(inst, manifest_id=bid, next_boot="6.14.8-2-pve", trial="6.14.8-2-pve"))["action"] == "await-reboot"
    # came up on the old one: next-boot pin consumed, trial marker still there
    failed = kernel_decision(k, facts(inst, manifest_id=bid, trial="6.14.8-2-pve"))
    assert failed["action"] == "failed-trial" and "came up on 6.8.12-4-pve" in failed["why"]
    assert kernel_decision(k, facts(inst, running="6.14.8-2-pve", manifest_id=bid))["action"] == "pin"
    assert kernel_decision(k, facts(inst, running="6.14.8-2-pve", pinned="6.14.8-2-pve", manifest_id=bid))["action"] == "done"
    # same release installed from elsewhere (no manifest of ours): build it
    assert kernel_decision(k, facts(inst))["action"] == "build"


def test_package_globs():
    assert package_globs("proxmox-git", "6.14.8-2-pve") == ["proxmox-kernel-6.14.8-2-pve_*.deb", "proxmox-headers-6.14.8-2-pve_*.deb"]
    assert package_globs("tarball", "6.1.192-x") == ["linux-image-6.1.192-x_*.deb", "linux-headers-6.1.192-x_*.deb"]


def test_pin_commands_quote_and_check_running_release(tmp_path):
    assert trial_pin_command("6.14.8-2-pve", "proxmox-boot-tool") == "proxmox-boot-tool kernel pin 6.14.8-2-pve --next-boot"
    assert trial_pin_command("6.1.0-x", "grub").startswith("grub-reboot 'Advanced options")
    # run the pin-for-good logic with stand-in uname/proxmox-boot-tool on PATH
    (tmp_path / "uname").write_text("#!/bin/sh\necho 6.8.12-4-pve\n")
    (tmp_path / "proxmox-boot-tool").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/pinned\n")
    for f in ("uname", "proxmox-boot-tool"):
        (tmp_path / f).chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    r = subprocess.run(["sh", "-c", pin_for_good_command("6.14.8-2-pve", "proxmox-boot-tool")], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "came up on 6.8.12-4-pve; the previous kernel stays pinned" in r.stderr
    assert not (tmp_path / "pinned").exists()
    (tmp_path / "uname").write_text("#!/bin/sh\necho 6.14.8-2-pve\n")
    r = subprocess.run(["sh", "-c", pin_for_good_command("6.14.8-2-pve", "proxmox-boot-tool").replace(
        "/var/lib/pvegpu/kernel/trial-boot", str(tmp_path / "marker"))], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / "pinned").read_text() == "kernel pin 6.14.8-2-pve\n"


def test_a_next_boot_pin_without_the_trial_marker_is_pinned_and_refreshed_again():
    """The marker is written after pin + refresh: a pin whose refresh failed is not awaited."""
    k = kernel()
    inst = ["6.8.12-4-pve", "6.14.8-2-pve"]
    d = kernel_decision(k, facts(inst, manifest_id=build_id(k), next_boot="6.14.8-2-pve"))
    assert d["action"] == "trial"


def test_pins_are_followed_by_refresh_where_esps_are_listed(tmp_path):
    """proxmox-boot-tool pin only writes the pin file when /etc/kernel/proxmox-boot-uuids exists
    (proxmox-kernel-helper pin_kernel()); the loader default changes at refresh."""
    assert trial_pin_command("6.14.8-2-pve", "proxmox-boot-tool", esps=True) == (
        "proxmox-boot-tool kernel pin 6.14.8-2-pve --next-boot && proxmox-boot-tool refresh")
    assert trial_pin_command("6.14.8-2-pve", "proxmox-boot-tool", esps=False) == (
        "proxmox-boot-tool kernel pin 6.14.8-2-pve --next-boot")  # no ESPs: pin runs update-grub itself
    (tmp_path / "uname").write_text("#!/bin/sh\necho 6.14.8-2-pve\n")
    (tmp_path / "proxmox-boot-tool").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\n")
    for f in ("uname", "proxmox-boot-tool"):
        (tmp_path / f).chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    cmd = pin_for_good_command("6.14.8-2-pve", "proxmox-boot-tool", esps=True).replace(
        "/var/lib/pvegpu/kernel/trial-boot", str(tmp_path / "marker"))
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and (tmp_path / "calls").read_text() == "kernel pin 6.14.8-2-pve\nrefresh\n"
