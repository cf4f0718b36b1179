"""Power cuts (issue 38 §3), a representative subset of bench/power_cut.py's full sweep: the twin's
power is cut (tests/e2e/power_cut.py power_cut: every process stopped at once, then the reset
button; no sync, no unmount) when a given step of a real sequence begins; the twin boots what its
firmware model chooses; the next converge must leave it on a kernel with its NVIDIA driver,
converged, host checks green, and a reboot after that must come up the same.

Each cut point names its step as the real programs print it (pyinfra's operation and command
lines, dpkg's own log, apt's and the hooks' output); a step that does not come in the run fails
the test (the sequence changed: look again at bench/power_cut.py's recording)."""

from __future__ import annotations

import pytest

from tests.e2e import power_cut as pc
from tests.e2e.test_kernel_trial_e2e import RELEASE

pytestmark = [pytest.mark.twin]


def cut(case: pc.Case, tmp_path, point: tuple[str, int, float]) -> pc.Outcome:
    # a step that names the twin says "{name}"; the name has one width, as a step's key is its first
    # 200 characters (power_cut._key): a shorter name made a point given as a prefix of its line one
    # character short of the key the run's line has, and the cut never came (CI 2026-12-06, pcut-1552)
    name = f"pcut-{id(case) % 100000:05d}"
    outcome = pc.cut_once(case, name, tmp_path, (pc._key(point[0].replace("{name}", name)), point[1], point[2]))
    assert "was not reached" not in " ".join(outcome.problems), outcome.line()
    return outcome


def test_kernel_trial_cut_right_after_dpkg_installed_the_kernel(twin_root_cache, tmp_path):
    """The trial kernel hangs. A cut as dpkg marks our kernel package installed (its postinst, the
    real zz-proxmox-boot's refresh, ran) and before the stage recorded the build's manifest: the
    loader boots the old kernel (pinned before the install); the next converge takes the package
    for ours and sets up the trial (before: refused it as "not built by pvegpu" on every run), the
    trial kernel hangs once, the host ends on the old kernel with its driver."""
    case = pc.KernelTrial(hangs=True)
    outcome = cut(case, tmp_path, (f"dpkg: status installed proxmox-kernel-{RELEASE}:amd64 6.14.11-9~bpo12+1", 1, 0.0))
    assert outcome.after_cut[-1] == "6.14.8-2-pve proxmox-6.14.8-2-pve.conf up", outcome.line()
    assert not outcome.bad and not outcome.problems, outcome.line()


def test_kernel_trial_cut_after_the_trial_kernel_came_up_before_the_run_checked_it(twin_root_cache, tmp_path):
    """The trial kernel boots fine; the power goes as the run reconnects to check it (its second
    `uname -s`, after the reboot), before it makes the kernel the default: the loader boots the
    old default. Before: the next converge recorded a failed trial ("came up on 6.14.8-2-pve") and
    never tried the kernel again (bench/power_cut.py bug 4). pvegpu-kernel-trial.service recorded at
    the trial boot that the kernel came up with its host checks, so the converge sets the trial up
    again, the kernel passes it and becomes the default."""
    case = pc.KernelTrial()
    outcome = cut(case, tmp_path, ("Running command on {name}: (pty=False) sh -c 'uname -s'", 2, 0.0))
    assert outcome.after_cut[0].startswith(f"{RELEASE} ") and outcome.after_cut[-1].startswith("6.14.8-2-pve "), \
        outcome.line()
    assert any("setting the trial up again (once)" in entry for entry in outcome.log), outcome.line()
    assert not outcome.bad and not outcome.problems, outcome.line()
    assert outcome.final == RELEASE, outcome.line()


def test_grub_esp_kernel_trial_cut_right_after_next_entry_was_armed(twin_root_cache, tmp_path):
    """GRUB from the ESP (kpro6-grubesp: proxmox-boot-tool's grub mode, UEFI); the trial kernel
    hangs. The power goes as the stage writes the trial's boot unit, right after it set
    `next_entry` in the ESP's grubenv (templates/grub-esp-oneshot.sh.j2): GRUB boots the trial
    entry once and clears next_entry (save_env on the vfat ESP), the kernel hangs, one reset boots
    the pinned known-good entry; the next converge records the failed trial and leaves the host on
    the old kernel with its NVIDIA modules, converged, and a reboot comes up there again."""
    case = pc.KernelTrial(hangs=True, profile="kpro6-grubesp")
    outcome = cut(case, tmp_path, ("Running command on {name}: (pty=False) sh -c 'umask 022 && mkdir -p -- "
                                   "/var/lib/pvegpu/kernel && printf %s IyEvYmluL3NoCiMgcHZlZ3B1IGtlcm5lbCBzdGFnZSAo"
                                   "cHZlZ3B1LWtlcm5lbC10cmlhbC5zZXJ2aWNlIHJ1bnMgd", 1, 0.0))
    assert outcome.after_cut[0] == f"{RELEASE} pvegpu-trial-{RELEASE} hung", outcome.line()
    assert outcome.after_cut[-1].startswith("6.14.8-2-pve gnulinux-6.14.8-2-pve-advanced-"), outcome.line()
    assert len(outcome.after_cut) == 2, outcome.line()  # next_entry boots once: one reset is enough
    assert not outcome.bad and not outcome.problems, outcome.line()
    assert outcome.final == "6.14.8-2-pve", outcome.line()


HOOK_STEP = ("run-parts: executing /etc/kernel/postinst.d/00pvegpu-nvidia 6.12.118+deb12-amd64 "
             "/boot/vmlinuz-6.12.118+deb12-amd64", 1, 2.0)


def test_full_upgrade_cut_while_the_kernel_hook_builds(twin_root_cache, tmp_path):
    """`apt full-upgrade` with a Proxmox kernel, its headers and a systemd-boot-efi upgrade in one
    transaction, cut while pvegpu's kernel hook builds nvidia for the new kernel. The hook runs
    first in run-parts' order, before initramfs-tools' hook (whose update-initramfs runs
    proxmox-kernel-helper's proxmox-boot-sync, the first to copy the new kernel onto the ESP):
    the old kernel boots, with its driver (before: the new one, without NVIDIA modules). The
    converge finishes the kernel packages dpkg left half-configured (their hooks: the build, the
    ESP refresh) and the host ends on a kernel with its driver."""
    case = pc.FullUpgrade()
    outcome = cut(case, tmp_path, HOOK_STEP)
    assert outcome.after_cut[-1].startswith("6.1.0-57-amd64 "), outcome.line()
    assert not outcome.bad and not outcome.problems, outcome.line()
    # the same host (saved before the upgrade) cut as dpkg has unpacked the kernel: the metas and
    # proxmox-default-headers unpacked, not configured; the stage's `apt-get install
    # proxmox-default-headers` met "dpkg was interrupted" on every run before it finished them first
    # (a cut a moment sooner, as dpkg logs the state but has not yet cleared its reinst-required
    # flag, is the next test's)
    outcome = cut(case, tmp_path, ("dpkg: status unpacked proxmox-kernel-6.12.118+deb12-amd64-signed:amd64 1", 1, 0.0))
    assert outcome.after_cut[-1].startswith("6.1.0-57-amd64 "), outcome.line()
    assert not outcome.bad and not outcome.problems, outcome.line()


def test_full_upgrade_cut_while_dpkg_unpacks_the_kernel(twin_root_cache, tmp_path):
    """The same upgrade cut as dpkg begins unpacking the kernel image: dpkg leaves it
    half-installed (reinst-required), the old kernel boots. `dpkg --configure -a` refuses such a
    package, and neither `apt --fix-broken install` nor the interrupted `apt full-upgrade` unpacks
    it again (before: the converge only named it, and after the operator's apt run dpkg still had
    it, the kernel metas unconfigured behind it). The converge unpacks it again
    (`apt-get install --reinstall` of dpkg's version), its hooks build nvidia for it."""
    case = pc.FullUpgrade()
    outcome = cut(case, tmp_path, ("dpkg: status half-installed proxmox-kernel-6.12.118+deb12-amd64-signed:amd64 1",
                                   1, 0.0))
    assert outcome.after_cut[-1].startswith("6.1.0-57-amd64 "), outcome.line()
    # (the window is dpkg's unpack of a small package: a freeze that comes late finds it unpacked,
    # which the test before covers; on the code before, a cut inside it left the problems below)
    assert not outcome.bad and not outcome.problems, outcome.line()


def test_full_upgrade_fails_cut_while_the_kernel_hook_builds(twin_root_cache, tmp_path):
    """The same transaction where nvidia cannot be built for the new kernel (bench/power_cut.py
    --case full-upgrade-fails), cut as pvegpu's hook begins and again while it builds: 6.12 is
    not on the ESP yet, 6.1 boots with its driver, the converge finishes the kernel package (the
    hook fails again and pins 6.1) and the host stays on 6.1 with its driver. Before: the hook ran
    after initramfs-tools' ESP refresh, 6.12 booted without modules and every converge failed at
    the NVIDIA stage (docs/bench.md bug 3: 1 of 1 cut left without GPUs)."""
    case = pc.FullUpgrade(fails=True)
    for point in ((HOOK_STEP[0], 1, 0.0), (HOOK_STEP[0], 1, 0.5)):
        outcome = cut(case, tmp_path, point)
        assert outcome.after_cut[-1].startswith("6.1.0-57-amd64 "), outcome.line()
        assert not outcome.bad and not outcome.problems, outcome.line()


def test_driver_upgrade_cut_while_the_user_space_is_installed(twin_root_cache, tmp_path):
    case = pc.DriverUpgrade()
    outcome = cut(case, tmp_path, ("--> Starting operation: NVIDIA driver | NVIDIA user space and GSP firmware 595.82.01",
                                   1, 0.0))
    assert not outcome.bad and not outcome.problems, outcome.line()
