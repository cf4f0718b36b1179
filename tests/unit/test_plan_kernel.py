"""plan.kernel: build parallelism (incident 14), build identity, the stage's next action, pins."""

import os
import subprocess
from pathlib import Path

import pytest

from plan import kernel as plan
from plan.kernel import (
    build_dir,
    build_id,
    build_jobs,
    kernel_decision,
    localversion,
    package_globs,
    resolve_jobs,
)
from plan.render import render_template
from spec.models import KernelSpec

H200_MEMINFO = Path(__file__).resolve().parents[1] / "fixtures" / "h200-vm" / "meminfo.txt"
GIT = {"kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git", "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"}


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
    assert a != build_id(kernel(source={**GIT, "ref": "6e44995b70ade6101b876137b35f48a28216559d"}))
    assert a != build_id(kernel(config_fragments=["CONFIG_X=y"]))
    assert a != build_id(kernel(), base_config="tinyconfig")
    assert build_dir(kernel()).startswith("/var/lib/pvegpu/kernel-build/6.14.8-2-pve-")


def test_localversion():
    assert localversion(KernelSpec(version="6.1.192-pvegpu-ci", source={"kind": "tarball", "url": "/x", "sha256": "0" * 64})) == "-pvegpu-ci"


def facts(installed=(), running="6.8.12-4-pve", pinned=None, manifest_id=None, build=None, trial=None, armed=None,
          failed=None):
    return {
        "kernels": {"running": running, "installed": list(installed), "pinned": pinned},
        "installed_manifest": {"build_id": manifest_id} if manifest_id else None,
        "build": build or {"running": False, "rc": None, "debs": [], "manifest": None},
        "trial": trial, "armed": armed, "failed": failed,
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
    rel = "6.14.8-2-pve"
    assert kernel_decision(k, facts(inst, manifest_id=bid))["action"] == "trial"
    # set up and still ahead: /run still holds the armed marker
    assert kernel_decision(k, facts(inst, manifest_id=bid, trial=rel, armed=rel))["action"] == "await-reboot"
    # the boot happened (armed marker gone with /run) and came up on the old kernel: record it
    failed = kernel_decision(k, facts(inst, manifest_id=bid, trial=rel))
    assert failed["action"] == "finish" and "came up on 6.8.12-4-pve" in failed["why"]
    # ... and came up on the trial kernel: make it the default
    assert kernel_decision(k, facts(inst, running=rel, manifest_id=bid, trial=rel))["action"] == "finish"
    assert kernel_decision(k, facts(inst, running=rel, manifest_id=bid))["action"] == "pin"
    assert kernel_decision(k, facts(inst, running=rel, pinned=rel, manifest_id=bid))["action"] == "done"
    # same release installed from elsewhere (no manifest of ours): build it
    assert kernel_decision(k, facts(inst))["action"] == "build"


def test_a_failed_trial_is_reported_and_not_retried_until_the_spec_changes():
    k = kernel()
    bid = build_id(k)
    inst = ["6.8.12-4-pve", "6.14.8-2-pve"]
    record = {"release": "6.14.8-2-pve", "build_id": bid, "came_up_on": "6.8.12-4-pve"}
    d = kernel_decision(k, facts(inst, manifest_id=bid, pinned="6.8.12-4-pve", failed=record))
    assert d["action"] == "failed-trial"
    assert "came up on 6.8.12-4-pve" in d["why"] and "not tried again until the spec changes" in d["why"]
    # another build of the release (the spec changed): the old record does not stop it
    k2 = kernel(base_config="defconfig")
    assert kernel_decision(k2, facts(inst, manifest_id=build_id(k2, "defconfig"), failed=record), "defconfig")["action"] == "trial"


def test_a_trial_marker_without_the_armed_marker_after_a_failed_one_shot_is_not_awaited():
    """The markers are written after the one-shot: a one-shot that failed leaves none, and the
    next run sets the trial up again."""
    k = kernel()
    inst = ["6.8.12-4-pve", "6.14.8-2-pve"]
    assert kernel_decision(k, facts(inst, manifest_id=build_id(k)))["action"] == "trial"


def test_package_globs():
    assert package_globs("proxmox-git", "6.14.8-2-pve") == ["proxmox-kernel-6.14.8-2-pve_*.deb", "proxmox-headers-6.14.8-2-pve_*.deb"]
    assert package_globs("tarball", "6.1.192-x") == ["linux-image-6.1.192-x_*.deb", "linux-headers-6.1.192-x_*.deb"]




# -- the boot loader interface ------------------------------------------------------------

GRUB_OK = {"esps": False, "grubenv_abstraction": "", "grubenv_fs": "ext2", "grub_advanced_id": "7f3c",
           "grub_default": "saved"}


@pytest.mark.parametrize("build,loader,why", [
    ({"esps": True, "uefi": True}, "systemd-boot", None),
    ({"esps": True, "uefi": False}, None, "Advanced options"),  # GRUB on the ESPs (grub mode), no entry id
    ({"esps": True, "uefi": False, "grub_advanced_id": "7f3c", "grubenv_abstraction": "lvm"}, "grub-esp", None),
    (GRUB_OK, "grub", None),
    ({**GRUB_OK, "grubenv_abstraction": "lvm"}, None, "GRUB cannot write its environment there"),
    ({**GRUB_OK, "grubenv_abstraction": "diskfilter"}, None, "never cleared"),
    ({**GRUB_OK, "grubenv_abstraction": None}, None, "grub-probe could not tell"),
    ({**GRUB_OK, "grubenv_fs": "btrfs"}, None, "is on btrfs: GRUB cannot write its environment there"),
    ({**GRUB_OK, "grubenv_fs": "zfs"}, None, "never cleared"),
    ({**GRUB_OK, "grubenv_fs": None}, None, "could not tell the file system"),
    ({**GRUB_OK, "grubenv_fs": "xfs"}, "grub", None),
    ({**GRUB_OK, "grub_advanced_id": None}, None, "Advanced options"),
])
def test_trial_loader(build, loader, why):
    got, reason = plan.trial_loader(build)
    assert got == loader
    if why is None:
        assert reason is None
    else:
        assert reason is not None and why in reason


def test_grub_entry_ids_follow_proxmox_kernel_helper():
    entry = plan.grub_entry_id("6.14.11-9-bpo12-pve", "7f3c9a")
    assert entry == "gnulinux-advanced-7f3c9a>gnulinux-6.14.11-9-bpo12-pve-advanced-7f3c9a"
    assert plan.grub_release_of(entry) == "6.14.11-9-bpo12-pve"
    assert plan.grub_release_of("0") is None and plan.grub_release_of(None) is None


def test_default_and_oneshot_commands():
    assert plan.set_default_command("6.14.8-2-pve", "systemd-boot") == (
        "proxmox-boot-tool kernel pin 6.14.8-2-pve && proxmox-boot-tool refresh && "
        f"{{ [ ! -e {plan.LOADER_INFO} ] || bootctl set-default proxmox-6.14.8-2-pve.conf; }}")  # survives reinit
    assert plan.efi_default_command(None) == f"{{ [ ! -e {plan.LOADER_INFO} ] || bootctl set-default ''; }}"
    assert plan.set_default_command("6.14.8-2-pve", "grub", "ab") == (
        "grub-set-default 'gnulinux-advanced-ab>gnulinux-6.14.8-2-pve-advanced-ab'")
    assert plan.oneshot_command("6.14.8-2-pve", "grub", 10, "ab").endswith(" && grub-reboot pvegpu-trial-6.14.8-2-pve")
    one = plan.oneshot_command("6.14.8-2-pve", "systemd-boot", 10)
    assert one.startswith("unshare --mount --propagation private /bin/sh -c ")
    assert "pvegpu-trial-6.14.8-2-pve.conf" in one and "panic=10" not in one.split("-c", 1)[0]
    assert "--next-boot" not in one  # no pin: a next-boot pin becomes loader.conf's default at refresh


def _stubs(tmp_path: Path, **programs: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in programs.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def _paths(command: str, tmp_path: Path) -> str:
    for path in (plan.TRIAL_MARKER, plan.TRIAL_FAILED, plan.TRIAL_CHECKS, plan.TRIAL_LOG):
        command = command.replace(path, str(tmp_path / Path(path).name))
    return command


def test_finish_on_grub_makes_the_trial_the_default_when_it_runs(tmp_path):
    env = _stubs(tmp_path, uname="echo 6.14.8-2-pve", **{"grub-set-default": f'echo "$@" >> {tmp_path}/calls',
                                                        "grub-editenv": f'echo editenv "$@" >> {tmp_path}/calls'})
    (tmp_path / "trial-boot").write_text("6.14.8-2-pve\n")
    cmd = _paths(plan.finish_trial_command("6.14.8-2-pve", "grub", "b1d", "ab"), tmp_path)
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text() == ("gnulinux-advanced-ab>gnulinux-6.14.8-2-pve-advanced-ab\n"
                                                "editenv /boot/grub/grubenv unset next_entry\n")
    assert not (tmp_path / "trial-boot").exists() and not (tmp_path / "trial-failed").exists()


def test_finish_records_a_failed_trial_with_the_kernel_that_came_up(tmp_path):
    import json
    env = _stubs(tmp_path, uname="echo 6.8.12-4-pve", **{"grub-set-default": f'echo "$@" >> {tmp_path}/calls',
                                                        "grub-editenv": f'echo editenv "$@" >> {tmp_path}/calls'})
    (tmp_path / "trial-boot").write_text("6.14.8-2-pve\n")
    cmd = _paths(plan.finish_trial_command("6.14.8-2-pve", "grub", "b1d", "ab"), tmp_path).replace(
        "/var/log/journal", str(tmp_path / "no-journal"))
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "the trial boot of 6.14.8-2-pve came up on 6.8.12-4-pve" in r.stderr
    assert json.loads((tmp_path / "trial-failed").read_text()) == {
        "release": "6.14.8-2-pve", "build_id": "b1d", "came_up_on": "6.8.12-4-pve", "checks": "",
        "journal": f"not persistent (no {tmp_path}/no-journal): the trial boot left no log here; look at the console (BMC)"}
    assert (tmp_path / "calls").read_text() == "editenv /boot/grub/grubenv unset next_entry\n"  # no new default
    assert not (tmp_path / "trial-boot").exists()
    r = subprocess.run(["sh", "-c", _paths(plan.finish_trial_command("6.14.8-2-pve", "grub", "b1d", "ab", fail=False),
                                           tmp_path)], env=env, capture_output=True, text=True)
    assert r.returncode == 0


def test_finish_keeps_the_failed_trial_boots_journal_where_the_journal_is_persistent(tmp_path):
    """The evidence a later run reports: journalctl -b -1 (the trial boot) when /var/log/journal
    exists and that boot's kernel is the trial's; else why there is no log."""
    import json
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    env = _stubs(tmp_path, uname="echo 6.8.12-4-pve", **{
        "grub-editenv": "true",
        "journalctl": 'case "$*" in *-k*) echo "Linux version 6.14.8-2-pve (build@pve) (gcc 12.2.0) #1 SMP";; '
                      '*) echo "[    3.100000] pve kernel: zfs: pool rpool: cannot import";; esac'})
    (tmp_path / "trial-boot").write_text("6.14.8-2-pve\n")
    cmd = _paths(plan.finish_trial_command("6.14.8-2-pve", "grub", "b1d", "ab"), tmp_path)
    r = subprocess.run(["sh", "-c", cmd.replace("/var/log/journal", str(journal_dir))], env=env, capture_output=True,
                       text=True)
    assert r.returncode == 1
    failed = json.loads((tmp_path / "trial-failed").read_text())
    assert failed["journal"] == f"the trial boot log: {tmp_path}/trial-failed.log"
    assert "cannot import" in (tmp_path / "trial-failed.log").read_text()
    # the boot before this one was another kernel: the trial stopped before journald wrote anything
    env = _stubs(tmp_path, journalctl='echo "Linux version 6.8.12-4-pve (build@pve)"')
    (tmp_path / "trial-boot").write_text("6.14.8-2-pve\n")
    r = subprocess.run(["sh", "-c", cmd.replace("/var/log/journal", str(journal_dir))], env=env, capture_output=True,
                       text=True)
    assert "no boot of 6.14.8-2-pve in it" in json.loads((tmp_path / "trial-failed").read_text())["journal"]


def test_trial_is_made_the_default_only_when_the_host_checks_that_held_before_hold_on_it(tmp_path):
    """arm_trial_command records which expectations hold on the known-good kernel (the NVIDIA
    module of nvidia.version loaded, each GPU on its driver); finish makes the trial kernel the
    default only if they hold on it too, else records the failed checks (and it is not retried)."""
    import json
    proc = tmp_path / "nvidia-version"
    sysfs = tmp_path / "devices"
    for bdf, driver in (("0000:01:00.0", "nvidia"), ("0000:41:00.0", "vfio-pci"), ("0000:61:00.0", "nvidia")):
        (sysfs / bdf).mkdir(parents=True)
        (sysfs / bdf / "driver").symlink_to(f"/sys/bus/pci/drivers/{driver}")
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  595.71.05  Release Build\n")
    expect = {"nvidia": "595.71.05", "drivers": {"0000:01:00.0": "nvidia", "0000:41:00.0": "vfio-pci",
                                                 "0000:61:00.0": "vfio-pci"}}

    def local(command: str) -> str:
        command = command.replace("/proc/driver/nvidia/version", str(proc)).replace("/sys/bus/pci/devices", str(sysfs))
        return _paths(command, tmp_path).replace(plan.TRIAL_CHECKS, str(tmp_path / "trial-checks")).replace(
            plan.STATE_DIR, str(tmp_path)).replace(plan.TRIAL_ARMED, str(tmp_path / "armed"))

    r = subprocess.run(["sh", "-c", local(plan.arm_trial_command("6.14.8-2-pve", expect))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # 0000:61:00.0 is not on its driver now: not asked of the trial kernel either
    assert (tmp_path / "trial-checks").read_text() == ("nvidia 595.71.05\ngpu 0000:01:00.0 nvidia\n"
                                                      "gpu 0000:41:00.0 vfio-pci\n")
    env = _stubs(tmp_path, uname="echo 6.14.8-2-pve", **{"grub-set-default": f'echo "$@" >> {tmp_path}/calls',
                                                        "grub-editenv": "true"})
    # on the trial kernel the NVIDIA module did not load and 0000:01:00.0 has no driver
    proc.unlink()
    (sysfs / "0000:01:00.0" / "driver").unlink()
    k = KernelSpec(version="6.14.8-2-pve", source={"kind": "tarball", "url": "https://x.invalid/k.tar.xz", "sha256": "0" * 64})
    bid = plan.build_id(k)
    r = subprocess.run(["sh", "-c", local(plan.finish_trial_command("6.14.8-2-pve", "grub", bid, "ab"))], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "the trial boot of 6.14.8-2-pve came up on 6.14.8-2-pve, but the host checks failed" \
        in r.stderr, r.stderr
    failed = json.loads((tmp_path / "trial-failed").read_text())
    assert "nvidia 595.71.05 is not loaded" in failed["checks"] and "GPU 0000:01:00.0 is on no driver, not nvidia" \
        in failed["checks"]
    assert not (tmp_path / "calls").exists()  # not made the default
    # the next run: the trial kernel still runs, but it is reported, not pinned
    decision = plan.kernel_decision(k, {
        "kernels": {"installed": ["6.14.8-2-pve"], "running": "6.14.8-2-pve"},
        "installed_manifest": {"build_id": bid}, "failed": failed, "default": "6.8.12-4-pve"})
    assert decision["action"] == "failed-trial" and "the host checks failed: nvidia 595.71.05" in decision["why"]


def test_systemd_boot_trial_entry_adds_panic_only_to_its_own_entry(tmp_path):
    """templates/kernel-trial-entry.sh.j2 against two ESP dirs: `mount` links the dir in, as a
    mounted ESP; the default entry is untouched, the trial entry is chosen with bootctl."""
    esps = tmp_path / "esps"
    for uuid in ("AAAA-0001", "BBBB-0002"):
        (esps / uuid / "loader/entries").mkdir(parents=True)
        (esps / uuid / "loader/entries/proxmox-6.14.8-2-pve.conf").write_text(
            "title    Proxmox Virtual Environment\nversion  6.14.8-2-pve\noptions  root=ZFS=rpool/ROOT/pve-1 boot=zfs\n"
            "linux    /EFI/proxmox/6.14.8-2-pve/vmlinuz-6.14.8-2-pve\n")
    (tmp_path / "uuids").write_text("AAAA-0001\n\nBBBB-0002\n")
    env = _stubs(tmp_path, unshare='shift 3; exec "$@"',
                 mount=f'rmdir "$2" && ln -s {esps}/"${{1##*/}}" "$2"', umount='rm "$1" && mkdir "$1"',
                 bootctl=f'echo "$@" >> {tmp_path}/bootctl')
    def run(command):
        command = command.replace("/etc/kernel/proxmox-boot-uuids", str(tmp_path / "uuids"))
        return subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)
    r = run(plan.oneshot_command("6.14.8-2-pve", "systemd-boot", 7))
    assert r.returncode == 0, r.stderr
    for uuid in ("AAAA-0001", "BBBB-0002"):
        trial = (esps / uuid / "loader/entries/pvegpu-trial-6.14.8-2-pve.conf").read_text()
        assert "options  root=ZFS=rpool/ROOT/pve-1 boot=zfs panic=7\n" in trial
        assert "linux    /EFI/proxmox/6.14.8-2-pve/vmlinuz-6.14.8-2-pve" in trial
        assert "panic" not in (esps / uuid / "loader/entries/proxmox-6.14.8-2-pve.conf").read_text()
    assert (tmp_path / "bootctl").read_text() == "set-oneshot pvegpu-trial-6.14.8-2-pve.conf\n"
    r = run(plan.clear_oneshot_command("6.14.8-2-pve", "systemd-boot"))
    assert r.returncode == 0, r.stderr
    assert not list(esps.glob("*/loader/entries/pvegpu-trial-*"))
    # an ESP without the release's entry (refresh skipped it): no trial is set up
    r = run(plan.oneshot_command("6.99.1-1-pve", "systemd-boot", 7))
    assert r.returncode == 1 and "has no loader entry for 6.99.1-1-pve" in r.stderr
    assert (tmp_path / "bootctl").read_text().count("set-oneshot") == 1


def test_systemd_boot_trial_is_not_armed_unless_every_esp_boots_the_known_good_kernel(tmp_path):
    """Issue 38 2.2: oneshot_command(keep=) reads each ESP's loader.conf default right before the
    one-shot; one ESP that boots another entry (here `proxmox-*`, what reinit writes) and nothing
    is armed: no trial entry, no bootctl set-oneshot."""
    esps = tmp_path / "esps"
    for uuid, default in (("AAAA-0001", "proxmox-6.8.12-4-pve.conf"), ("BBBB-0002", "proxmox-*")):
        (esps / uuid / "loader/entries").mkdir(parents=True)
        (esps / uuid / "loader/loader.conf").write_text(f"timeout 3\ndefault {default}\n")
        (esps / uuid / "loader/entries/proxmox-6.14.8-2-pve.conf").write_text("options  root=ZFS=rpool/ROOT/pve-1\n")
    (tmp_path / "uuids").write_text("AAAA-0001\nBBBB-0002\n")
    env = _stubs(tmp_path, unshare='shift 3; exec "$@"',
                 mount=f'rmdir "$2" && ln -s {esps}/"${{1##*/}}" "$2"', umount='rm "$1" && mkdir "$1"',
                 bootctl=f'echo "$@" >> {tmp_path}/bootctl')
    command = plan.oneshot_command("6.14.8-2-pve", "systemd-boot", 7, keep="6.8.12-4-pve")
    command = command.replace("/etc/kernel/proxmox-boot-uuids", str(tmp_path / "uuids"))
    r = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "the ESP BBBB-0002 boots 'proxmox-*' by default, not the known-good " \
        "proxmox-6.8.12-4-pve.conf: no trial is armed" in r.stderr, r.stderr
    assert not list(esps.glob("*/loader/entries/pvegpu-trial-*")) and not (tmp_path / "bootctl").exists()
    (esps / "BBBB-0002/loader/loader.conf").write_text("default proxmox-6.8.12-4-pve.conf\n")
    r = subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "bootctl").read_text() == "set-oneshot pvegpu-trial-6.14.8-2-pve.conf\n"


def test_a_grub_trial_is_not_armed_unless_saved_entry_is_the_known_good_kernel(tmp_path):
    cmd, env = _grub_oneshot_env(tmp_path, SAVED + "menuentry 'pvegpu trial' $menuentry_id_option "
                                 "'pvegpu-trial-6.14.8-2-pve' {\n}\n", keep="6.8.12-4-pve")
    (Path(env["PATH"].split(":")[0]) / "grub-editenv").write_text(
        f"#!/bin/sh\ncat {tmp_path}/grubenv\n")
    (Path(env["PATH"].split(":")[0]) / "grub-editenv").chmod(0o755)
    (tmp_path / "grubenv").write_text("saved_entry=0\n")
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "saved_entry is not the known-good 6.8.12-4-pve" in r.stderr, r.stderr
    assert "grub-reboot" not in (tmp_path / "calls").read_text()
    (tmp_path / "grubenv").write_text(f"saved_entry={plan.grub_entry_id('6.8.12-4-pve', 'ab')}\n")
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text().endswith("grub-reboot pvegpu-trial-6.14.8-2-pve\n")


def _grub_oneshot_env(tmp_path: Path, cfg_text: str, keep: str | None = None) -> tuple[str, dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("update-grub", "grub-reboot"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho {name} "$@" >> {tmp_path}/calls\n')
        (bin_dir / name).chmod(0o755)
    cfg = tmp_path / "grub.cfg"
    cfg.write_text(cfg_text)
    cmd = (plan.oneshot_command("6.14.8-2-pve", "grub", 10, "ab", keep=keep).replace("/boot/grub/grub.cfg", str(cfg))
           .replace(plan.GRUB_TRIAL_SCRIPT, str(tmp_path / "42_pvegpu_trial")))
    return cmd, {"PATH": f"{bin_dir}:/usr/bin:/bin"}


SAVED = 'if [ "${next_entry}" ] ; then\nelse\n   set default="${saved_entry}"\nfi\n'


def test_a_grub_one_shot_needs_grub_default_saved_in_the_generated_config(tmp_path):
    cmd, env = _grub_oneshot_env(tmp_path, 'if [ "${next_entry}" ] ; then\nelse\n   set default="0"\nfi\n')
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "GRUB_DEFAULT is not saved" in r.stderr
    assert (tmp_path / "calls").read_text() == "update-grub\n"
    (tmp_path / "grub.cfg").write_text(SAVED + "menuentry 'pvegpu trial' $menuentry_id_option 'pvegpu-trial-6.14.8-2-pve' {\n}\n")
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text().endswith("grub-reboot pvegpu-trial-6.14.8-2-pve\n")
    assert os.access(tmp_path / "42_pvegpu_trial", os.X_OK)


def test_a_grub_one_shot_needs_its_trial_entry_in_the_generated_config(tmp_path):
    cmd, env = _grub_oneshot_env(tmp_path, SAVED)
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "wrote no trial entry pvegpu-trial-6.14.8-2-pve" in r.stderr
    assert "grub-reboot" not in (tmp_path / "calls").read_text()


# 10_linux's output with GRUB_DISABLE_SUBMENU=true (util/grub.d/10_linux.in: every kernel's entry
# at the top level, args GRUB_CMDLINE_LINUX then GRUB_CMDLINE_LINUX_DEFAULT); the fake prints it
# for the GRUB_* values it is given, as the real script does
FAKE_10_LINUX = r"""#!/bin/sh
[ "$GRUB_DISABLE_SUBMENU" = true ] || echo "submenu 'Advanced' \$menuentry_id_option 'gnulinux-advanced-ab' {"
echo 'function gfxmode {'
echo '}'
for v in 6.14.11-9-bpo12-pvegpu-pve 6.14.8-2-pve 6.14.8-2-pve-old; do
cat <<EOT
menuentry 'Proxmox VE GNU/Linux, with Linux $v' --class proxmox --class gnu-linux \$menuentry_id_option 'gnulinux-$v-advanced-ab' {
	load_video
	insmod gzio
	search --no-floppy --fs-uuid --set=root ab
	echo	'Loading Linux $v ...'
	linux	/boot/vmlinuz-$v root=/dev/mapper/pve-root ro $GRUB_CMDLINE_LINUX $GRUB_CMDLINE_LINUX_DEFAULT
	initrd	/boot/initrd.img-$v
}
EOT
done
echo 'Found linux image' >&2
"""


def test_grub_trial_script_prints_10_linux_entry_of_the_release_with_panic(tmp_path):
    """templates/grub-trial-entry.sh.j2 against a 10_linux that prints what the real one does:
    the release's own entry (root=, search, initrd) renamed to pvegpu-trial-<rel>, panic= last."""
    from plan.render import render_template
    linux = tmp_path / "10_linux"
    linux.write_text(FAKE_10_LINUX)
    linux.chmod(0o755)
    script = render_template("grub-trial-entry.sh.j2", release="6.14.8-2-pve", panic_s=7).replace(
        "/etc/grub.d/10_linux", str(linux))
    env = {"PATH": "/usr/bin:/bin", "GRUB_CMDLINE_LINUX": "intel_iommu=on", "GRUB_CMDLINE_LINUX_DEFAULT": "quiet"}
    r = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        "menuentry 'pvegpu trial (panic=7): Proxmox VE GNU/Linux, with Linux 6.14.8-2-pve' --class proxmox "
        "--class gnu-linux $menuentry_id_option 'pvegpu-trial-6.14.8-2-pve' {\n"
        "\tload_video\n\tinsmod gzio\n\tsearch --no-floppy --fs-uuid --set=root ab\n"
        "\techo\t'Loading Linux 6.14.8-2-pve ...'\n"
        "\tlinux\t/boot/vmlinuz-6.14.8-2-pve root=/dev/mapper/pve-root ro intel_iommu=on quiet panic=7\n"
        "\tinitrd\t/boot/initrd.img-6.14.8-2-pve\n}\n")
    # a release 10_linux does not list: nothing (the one-shot then refuses: no entry in grub.cfg)
    other = render_template("grub-trial-entry.sh.j2", release="6.99.1-1-pve", panic_s=7).replace(
        "/etc/grub.d/10_linux", str(linux))
    r = subprocess.run(["sh", "-c", other], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == ""


def test_clearing_a_grub_trial_removes_its_entry_script_and_regenerates(tmp_path):
    env = _stubs(tmp_path, **{"grub-editenv": f'echo editenv "$@" >> {tmp_path}/calls',
                              "update-grub": f'echo update-grub >> {tmp_path}/calls'})
    script = tmp_path / "42_pvegpu_trial"
    cmd = plan.clear_oneshot_command("6.14.8-2-pve", "grub").replace(plan.GRUB_TRIAL_SCRIPT, str(script))
    script.write_text("#!/bin/sh\n")
    r = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not script.exists()
    assert (tmp_path / "calls").read_text() == "editenv /boot/grub/grubenv unset next_entry\nupdate-grub\n"


# -- kernel.remove_old ---------------------------------------------------------------------

INSTALLED = ["proxmox-kernel-6.8.12-4-pve-signed", "proxmox-kernel-6.8.4-2-pve-signed", "proxmox-kernel-6.8",
             "proxmox-default-kernel", "pve-kernel-5.15.158-2-pve", "proxmox-kernel-6.14.11-9-bpo12-pve",
             "linux-image-6.1.0-57-amd64", "linux-image-amd64", "proxmox-kernel-6.8.12-4-pve-signed-dbgsym"]


def test_old_kernel_packages_are_what_is_installed_signed_included_never_running_or_default():
    assert plan.package_release("proxmox-kernel-6.8.12-4-pve-signed") == "6.8.12-4-pve"
    assert plan.package_release("proxmox-kernel-6.8") is None and plan.package_release("linux-image-amd64") is None
    old = plan.old_kernel_packages(INSTALLED, {"6.14.11-9-bpo12-pve", "6.8.12-4-pve"})
    assert old == ["linux-image-6.1.0-57-amd64", "proxmox-kernel-6.8.4-2-pve-signed", "pve-kernel-5.15.158-2-pve"]
    # the default (known-good) kernel stays too
    old = plan.old_kernel_packages(INSTALLED, {"6.14.11-9-bpo12-pve", "6.8.12-4-pve", "6.8.4-2-pve"})
    assert "proxmox-kernel-6.8.4-2-pve-signed" not in old


def test_purge_removes_exactly_the_old_kernels_or_nothing(tmp_path):
    """A meta package depending on an old kernel would go with it (and proxmox-ve with
    proxmox-default-kernel): apt's simulation says so and nothing is removed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = -s ]; then cat {tmp_path}/sim; else echo "$@" >> {tmp_path}/calls; fi\n')
    (bin_dir / "apt-get").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    pkgs = ["proxmox-kernel-6.8.4-2-pve-signed", "pve-kernel-5.15.158-2-pve"]
    (tmp_path / "sim").write_text("Purg pve-kernel-5.15.158-2-pve [5.15.158-2]\n"
                                  "Purg proxmox-kernel-6.8.4-2-pve-signed [6.8.4-2]\n")
    r = subprocess.run(["sh", "-c", plan.purge_command(pkgs)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "calls").read_text() == "-y purge proxmox-kernel-6.8.4-2-pve-signed pve-kernel-5.15.158-2-pve\n"
    (tmp_path / "calls").unlink()
    (tmp_path / "sim").write_text("Purg proxmox-ve [8.4.0]\nPurg proxmox-default-kernel [1.1.0]\n"
                                  "Purg proxmox-kernel-6.8.4-2-pve-signed [6.8.4-2]\nPurg pve-kernel-5.15.158-2-pve [5.15.158-2]\n")
    r = subprocess.run(["sh", "-c", plan.purge_command(pkgs)], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "would also remove: proxmox-default-kernel proxmox-ve" in r.stderr
    assert not (tmp_path / "calls").exists()


# -- the ZFS feature guard ------------------------------------------------------------------

def _zfs_host(tmp_path: Path, fstype: str, features: str, guids: list[str], module: bool = True) -> dict:
    ko = tmp_path / "zfs.ko"
    ko.write_bytes(b"\x7fELF\x00" + b"\x00".join(g.encode() for g in guids) + b"\x00")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    programs = {
        "findmnt": f'case "$*" in *FSTYPE*) echo {fstype};; *SOURCE*) echo rpool/ROOT/pve-1;; esac',
        "modinfo": f"echo {ko}" if module else "exit 1",
        "zpool": f"printf '%b' '{features}'",
    }
    for name, body in programs.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


POOL = ("size\\t1.7T\\nfeature@async_destroy\\tenabled\\nfeature@large_blocks\\tactive\\n"
        "feature@raidz_expansion\\tenabled\\nfeature@block_cloning\\tactive\\nfeature@fast_dedup\\tdisabled\\n")


def test_zfs_guard_names_the_root_pools_features_the_new_module_does_not_know(tmp_path):
    """OpenZFS zfeature_common.c: each feature is "<reverse-dns>:<name>" in the module's table;
    `zpool get` lists feature@<name> enabled/active/disabled."""
    old_module = ["com.delphix:async_destroy", "org.open-zfs:large_blocks", "com.delphix:embedded_data"]
    env = _zfs_host(tmp_path, "zfs", POOL, old_module)
    r = subprocess.run(["sh", "-c", plan.zfs_guard_command("6.14.11-9-bpo12-pvegpu-pve")], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert "does not support these features of the root pool rpool: raidz_expansion block_cloning;" in r.stderr
    new_module = old_module + ["org.openzfs:raidz_expansion", "com.fudosecurity:block_cloning"]
    env = _zfs_host(tmp_path, "zfs", POOL, new_module)  # fast_dedup is disabled: not needed
    r = subprocess.run(["sh", "-c", plan.zfs_guard_command("6.14.11-9-bpo12-pvegpu-pve")], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    env = _zfs_host(tmp_path, "ext4", POOL, [])  # no ZFS root: nothing to check
    assert subprocess.run(["sh", "-c", plan.zfs_guard_command("6.1.0-x")], env=env).returncode == 0
    env = _zfs_host(tmp_path, "zfs", POOL, [], module=False)
    r = subprocess.run(["sh", "-c", plan.zfs_guard_command("6.1.0-x")], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "has no zfs module" in r.stderr


# -- the driver x kernel gate ---------------------------------------------------------------

GATE_KERNEL = KernelSpec(version="6.14.11-9-bpo12-pvegpu-pve", source={
    "kind": "proxmox-git", "url": "git://git.proxmox.com/git/pve-kernel.git", "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"})


@pytest.mark.parametrize("action,trial_boot,loader,due", [
    ("build", True, "grub", True), ("attach", True, None, True), ("install", False, None, True),
    ("trial", True, "systemd-boot", True), ("trial", True, None, False), ("trial", False, "grub", False),
    ("await-reboot", True, "grub", False), ("finish", True, "grub", False), ("pin", True, "grub", False),
    ("done", True, "grub", False)])
def test_the_gate_runs_before_an_install_or_a_trial_only(action, trial_boot, loader, due):
    k = GATE_KERNEL.model_copy(update={"trial_boot": trial_boot})
    assert plan.gate_due(action, k, loader) is due


def test_a_gate_record_refuses_the_same_driver_source_and_kernel_build_only():
    bid = plan.build_id(GATE_KERNEL, "running")
    record = {"time": "2026-12-04T10:40:02Z", "version": "595.45.04", "archive_sha256": "a" * 64, "build_id": bid,
              "reason": "nvidia 595.45.04 could not be built for kernel 6.14.11-9-bpo12-pvegpu-pve: the build failed "
                        "(exit 2): kernel-open/common/inc/nv-linux.h:1730:10: fatal error: linux/of_gpio.h: No such file "
                        "or directory"}
    records = {GATE_KERNEL.version: record}
    refusal = plan.gate_refusal(GATE_KERNEL, "running", "595.45.04", "a" * 64, records)
    assert refusal is not None and refusal.startswith(
        f"kernel {GATE_KERNEL.version} (kernel.version) is refused: {record['reason']} (driver x kernel gate, ")
    assert f"rm {plan.GATE_DIR}/{GATE_KERNEL.version}.refused" in refusal
    assert plan.gate_refusal(GATE_KERNEL, "running", "595.71.05", "a" * 64, records) is None  # another driver
    assert plan.gate_refusal(GATE_KERNEL, "running", "595.45.04", "b" * 64, records) is None  # another source
    assert plan.gate_refusal(GATE_KERNEL, "defconfig", "595.45.04", "a" * 64, records) is None  # another build
    assert plan.gate_refusal(GATE_KERNEL, "running", "595.45.04", "a" * 64, {}) is None
def test_secure_boot_refusals_name_the_field():
    """Secure Boot on: shim verifies the image GRUB loads; the build needs kernel.signing with an
    enrolled cert, sbsign on the host, and no proxmox-boot-tool ESPs (shim + GRUB there)."""
    base = {"version": "6.14.11-9-bpo12-pvegpu-pve", "source": {"kind": "proxmox-git", "url": "https://example.invalid/k.git",
                                                                 "ref": "ad58d1445425ea4742e3470b2edbee35df0657e9"}}
    unsigned = KernelSpec(**base)
    signed = KernelSpec(**base, signing={"key": "/root/mok.pem", "cert": "/root/mok.der"})
    assert plan.secure_boot_refusal(unsigned, {"secure_boot": False}) is None
    assert "Set kernel.signing" in str(plan.secure_boot_refusal(unsigned, {"secure_boot": True}))
    for mok, words in (("not enrolled", "is not enrolled"), ("pending", "MokManager confirmation"),
                       ("blocked", "is blocked"), (None, "unknown")):
        why = plan.secure_boot_refusal(signed, {"secure_boot": True, "mok": mok, "sbsign": True})
        assert why and why.startswith("kernel.signing.cert /root/mok.der") and words in why
    assert "apt-get install sbsigntool" in str(plan.secure_boot_refusal(signed, {"secure_boot": True, "mok": "enrolled"}))
    assert "proxmox-boot-tool ESPs" in str(plan.secure_boot_refusal(
        signed, {"secure_boot": True, "mok": "enrolled", "sbsign": True, "esps": True}))
    assert plan.secure_boot_refusal(signed, {"secure_boot": True, "mok": "enrolled", "sbsign": True}) is None


def grub_esp_state(firmware: str) -> dict:
    """facts.loader.LoaderState of a host in proxmox-boot-tool's grub mode: the ESP holds GRUB's
    EFI binary (a UEFI install with Secure Boot on, then switched off) or only grub/ (legacy BIOS)."""
    has = ["EFI/proxmox/grubx64.efi", "grub"] if firmware == "uefi" else ["grub"]
    return {"firmware": firmware, "efivars": {}, "esp_list": ["2A4C-77E1"],
            "esps": [{"uuid": "2A4C-77E1", "mounted": True, "has": has, "loader_conf": None, "entries": [],
                      "grub_cfg": None, "grubenv": None}], "grub_cfg": None, "grubenv": None}


@pytest.mark.parametrize("firmware", ["uefi", "bios"])
def test_grub_on_esps_is_one_loader_decision_trial_on_the_esps_default_by_the_pin(firmware):
    """Issue 38 2.4: GRUB on proxmox-boot-tool's ESPs reads grub.cfg and grubenv there, never the
    root's /boot/grub/grubenv: the one-shot goes in every ESP's grubenv (a vfat file GRUB's
    save_env rewrites: whatever holds /boot/grub does not matter, LVM here), the default by the pin
    that refresh turns into GRUB_DEFAULT on the ESP (zz-proxmox-boot set_grub_default), no bootctl.
    Refused only without the Advanced-options id the pin names entries by."""
    build = {"esps": True, "uefi": firmware == "uefi", "grub_advanced_id": "7f3c", "grubenv_abstraction": "lvm",
             "grubenv_fs": "ext2"}
    mode = plan.host_loader(build, grub_esp_state(firmware))
    assert mode == plan.GRUB_ESP
    assert plan.trial_loader(build, mode) == (plan.GRUB_ESP, None)
    loader, why = plan.trial_loader({**build, "grub_advanced_id": None}, mode)
    assert loader is None and why is not None and "GRUB on the ESPs" in why and "Advanced options" in why
    assert plan.default_loader(build, mode) == (plan.GRUB_ESP, None)
    keep = plan.keep_default_command("6.8.12-11-pve", plan.GRUB_ESP)
    assert keep == "proxmox-boot-tool kernel pin 6.8.12-11-pve && proxmox-boot-tool refresh"
    assert "grub-set-default" not in keep and "bootctl" not in keep
    assert plan.default_release({"pinned": "6.8.12-11-pve"}, {"grub_saved": "x"}, plan.GRUB_ESP) == "6.8.12-11-pve"


def test_the_default_is_kept_by_name_on_every_loader_trial_or_not():
    """Issue 38 2.3: kernel.trial_boot: false must not make the new kernel the default: on ESPs
    the pin, on GRUB (LVM, btrfs, ZFS /boot included) saved_entry by entry id, never the index a
    stock install has (`0`, the newest entry); no entry id: refused."""
    assert plan.default_loader({"esps": ["5A1C-9E27"], "uefi": False}) == (plan.GRUB_ESP, None)
    assert plan.default_loader({"esps": ["5A1C-9E27"], "uefi": True}) == (plan.SYSTEMD_BOOT, None)
    assert plan.default_loader({"grub_advanced_id": "ab", "grubenv_abstraction": "lvm"}) == (plan.GRUB, None)
    loader, why = plan.default_loader({"grubenv_abstraction": "lvm"})
    assert loader is None and why is not None and "Advanced options" in why
    assert plan.default_release({}, {"grub_saved": "0"}, plan.GRUB) is None  # an index names no kernel: kept first
    keep = plan.keep_default_command("6.8.12-11-pve", plan.GRUB, "ab")
    assert keep.endswith("grub-set-default 'gnulinux-advanced-ab>gnulinux-6.8.12-11-pve-advanced-ab'")
    assert keep.startswith(plan.GRUB_KEEP_CHECK)


@pytest.mark.parametrize("booted_by_systemd_boot", [True, False])
def test_the_efi_default_is_set_only_where_systemd_boot_booted(tmp_path, booted_by_systemd_boot):
    """A legacy-BIOS ESP host (proxmox-boot-tool's GRUB mode) or GRUB has no LoaderInfo and no
    systemd-boot to read LoaderEntryDefault: its pin is the default, and the command must not fail
    there (it did: `bootctl set-default` has no EFI variables to write on such a host)."""
    log = tmp_path / "bootctl.log"
    (tmp_path / "bootctl").write_text(f'#!/bin/sh\necho "$*" >> {log}\n[ -d /sys/firmware/efi ] || exit 1\n')
    (tmp_path / "bootctl").chmod(0o755)
    info = tmp_path / "LoaderInfo"
    if booted_by_systemd_boot:
        info.write_bytes(b"\x06\x00\x00\x00s\x00")
    command = plan.efi_default_command("6.14.8-2-pve").replace(plan.LOADER_INFO, str(info))
    done = subprocess.run(["sh", "-c", command], env={"PATH": f"{tmp_path}:/usr/bin:/bin"}, capture_output=True)
    called = log.read_text() if log.exists() else ""
    if booted_by_systemd_boot:
        assert called == "set-default proxmox-6.14.8-2-pve.conf\n"
    else:
        assert done.returncode == 0 and called == ""


def test_a_trial_that_came_up_before_a_reset_is_set_up_again_once():
    """Issue 38 §3 (bug 4 of bench/power_cut.py): the trial kernel came up and its host checks held
    at that boot (pvegpu-kernel-trial.service wrote "<release> ok"), then a reset (a power cut) before
    the run's own check: the old kernel runs. That is no failed trial: set it up again, once; the
    same again, or a record of failed checks, is recorded as a failure."""
    k = kernel()
    bid = build_id(k)
    inst = ["6.8.12-4-pve", "6.14.8-2-pve"]
    rel = "6.14.8-2-pve"
    base = facts(inst, manifest_id=bid, trial=rel)
    again = kernel_decision(k, {**base, "trial_up": f"{rel} ok"})
    assert again["action"] == "trial" and again.get("retry") is True
    assert "came up and its host checks held at that boot" in again["why"] and "6.8.12-4-pve runs now" in again["why"]
    assert kernel_decision(k, {**base, "trial_up": f"{rel} ok", "trial_retried": rel})["action"] == "finish"
    assert kernel_decision(k, {**base, "trial_up": f"{rel} failed  nvidia 1 is not loaded;"})["action"] == "finish"
    assert kernel_decision(k, {**base, "trial_up": "6.14.9-1-pve ok"})["action"] == "finish"
    assert kernel_decision(k, base)["action"] == "finish"  # no record: it hung or panicked


def test_the_grub_esp_trial_sets_next_entry_on_every_esp_after_checking_the_known_good():
    """Issue 38 2.2 on GRUB on ESPs: the known-good re-asserted by the pin (a stale next-boot pin
    dropped: set_grub_default writes it over the pin), the trial entry through refresh's
    update-grub on each ESP, next_entry in each ESP's grubenv only after its default is checked;
    the pass pins, the clear unsets next_entry on each ESP and refreshes without the entry."""
    adv = "7f3c"
    reassert = plan.reassert_default_command("6.8.12-11-pve", plan.GRUB_ESP, adv)
    assert reassert.startswith("{ [ ! -e /etc/kernel/next-boot-pin ] || proxmox-boot-tool kernel unpin --next-boot; }")
    assert reassert.endswith("proxmox-boot-tool kernel pin 6.8.12-11-pve && proxmox-boot-tool refresh")
    arm = plan.oneshot_command("6.14.11-1-pve", plan.GRUB_ESP, 10, adv, keep="6.8.12-11-pve")
    assert "42_pvegpu_trial" in arm and "&& grub-reboot" not in arm and "update-grub &&" not in arm
    assert arm.index("proxmox-boot-tool refresh") < arm.index("unshare --mount")
    script = render_template("grub-esp-oneshot.sh.j2", mode="arm", entry="pvegpu-trial-6.14.11-1-pve",
                                  keep_id=plan.grub_entry_id("6.8.12-11-pve", adv))
    assert script.index('[ "$have" = "$keep_id" ]') < script.index('grub-editenv "$env" set "next_entry=$entry"')
    assert "keep_id='gnulinux-advanced-7f3c>gnulinux-6.8.12-11-pve-advanced-7f3c'" in script
    clear = plan.clear_oneshot_command("6.14.11-1-pve", plan.GRUB_ESP)
    assert "grub-editenv /boot/grub/grubenv" not in clear and "proxmox-boot-tool refresh" in clear
    finish = plan.finish_trial_command("6.14.11-1-pve", plan.GRUB_ESP, "bid", adv)
    assert "proxmox-boot-tool kernel pin 6.14.11-1-pve && proxmox-boot-tool refresh" in finish
    assert "grub-set-default" not in finish and "bootctl" not in finish


GRUB_EDITENV_STUB = r'''f=$1 cmd=$2; shift 2
case $cmd in
list) grep -v '^#' "$f" ;;
set) for kv; do grep -v "^${kv%%=*}=" "$f" > "$f.t" || true; echo "$kv" >> "$f.t"; mv "$f.t" "$f"; done ;;
unset) for n; do grep -v "^$n=" "$f" > "$f.t" || true; mv "$f.t" "$f"; done ;;
esac'''


def _grub_esps(tmp_path: Path, defaults: dict[str, str], no_env: str = "") -> tuple[Path, dict]:
    """ESP dirs in grub mode: grub/grub.cfg with the trial entry and `set default=` the given id,
    grub/grubenv a 1024-byte block (none on the ESP `no_env`)."""
    esps = tmp_path / "esps"
    for uuid, default in defaults.items():
        (esps / uuid / "grub").mkdir(parents=True)
        (esps / uuid / "grub/grub.cfg").write_text(
            'if [ "${next_entry}" ] ; then\n   set default="${next_entry}"\n   set next_entry=\n   save_env next_entry\n'
            f'else\n   set default="{default}"\nfi\n'
            "menuentry 'pvegpu trial' --class proxmox $menuentry_id_option 'pvegpu-trial-6.14.11-1-pve' {\n}\n")
        if uuid != no_env:
            body = "# GRUB Environment Block\n"
            (esps / uuid / "grub/grubenv").write_text(body + "#" * (1024 - len(body)))
    (tmp_path / "uuids").write_text("\n".join(defaults) + "\n")
    env = _stubs(tmp_path, unshare='shift 3; exec "$@"', mountpoint='[ -L "$2" ]',
                 mount=f'rmdir "$2" && ln -s {esps}/"${{1##*/}}" "$2"', umount='rm "$1" && mkdir "$1"',
                 **{"grub-editenv": GRUB_EDITENV_STUB})
    return esps, env


def test_grub_esp_one_shot_is_set_on_every_esp_only_when_each_boots_the_known_good(tmp_path):
    """Issue 38 2.2 on GRUB on ESPs: templates/grub-esp-oneshot.sh.j2 sets next_entry in every
    ESP's grubenv after checking that ESP's grub.cfg default is the known-good; an ESP that boots
    another default, or has no grubenv GRUB could clear next_entry in, arms nothing (an ESP armed
    before it is disarmed again); clear unsets it everywhere."""
    keep = plan.grub_entry_id("6.8.12-4-pve", "7f3c")
    arm = plan.grub_esp_oneshot_command("arm", "6.14.11-1-pve", keep)
    clear = plan.grub_esp_oneshot_command("clear", "6.14.11-1-pve")

    def run(command, env):
        command = command.replace("/etc/kernel/proxmox-boot-uuids", str(tmp_path / "uuids"))
        return subprocess.run(["sh", "-c", command], env=env, capture_output=True, text=True)

    def next_entry(esps, uuid):
        return [line for line in (esps / uuid / "grub/grubenv").read_text().splitlines() if line.startswith("next_entry=")]

    esps, env = _grub_esps(tmp_path, {"AAAA-0001": keep, "BBBB-0002": keep})
    r = run(arm, env)
    assert r.returncode == 0, r.stderr
    assert next_entry(esps, "AAAA-0001") == next_entry(esps, "BBBB-0002") == ["next_entry=pvegpu-trial-6.14.11-1-pve"]
    r = run(clear, env)
    assert r.returncode == 0, r.stderr
    assert next_entry(esps, "AAAA-0001") == next_entry(esps, "BBBB-0002") == []

    for second, no_env, why in ((plan.grub_entry_id("6.14.11-1-pve", "7f3c"), "", "by default, not the known-good"),
                                (keep, "BBBB-0002", "no 1024-byte grub/grubenv")):
        other = tmp_path / ("case-" + ("env" if no_env else "default"))
        other.mkdir()
        esps, env = _grub_esps(other, {"AAAA-0001": keep, "BBBB-0002": second}, no_env)
        r = subprocess.run(["sh", "-c", arm.replace("/etc/kernel/proxmox-boot-uuids", str(other / "uuids"))],
                           env=env, capture_output=True, text=True)
        assert r.returncode == 1 and why in r.stderr and "no trial is armed" in r.stderr, r.stderr
        assert next_entry(esps, "AAAA-0001") == []  # the first ESP was disarmed again
