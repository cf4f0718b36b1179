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
    outcome = pc.cut_once(case, f"pcut-{id(case) % 100000}", tmp_path, (pc._key(point[0]), point[1], point[2]))
    assert "was not reached" not in " ".join(outcome.problems), outcome.line()
    return outcome


def test_kernel_trial_cut_in_the_kernel_postinst_then_at_the_trial_reboot(twin_root_cache, tmp_path):
    """The trial kernel hangs. A cut inside the kernel package's postinst (zz-proxmox-boot's
    refresh) and one as the reboot into the trial is asked for: neither leaves the hanging
    kernel where the loader boots it twice; the converge ends on the old kernel with its driver."""
    case = pc.KernelTrial(hangs=True)
    for point in [(f"dpkg: status half-configured proxmox-kernel-{RELEASE}:amd64 6.14.11-9~bpo12+1", 1, 1.5),
                  ("Running command on {twin}: (pty=False) sh -c '( sleep 1 && reboot ) </dev/null >/dev/null 2>&1 &'",
                   1, 0.5)]:
        outcome = cut(case, tmp_path, _named(case, point))
        assert not outcome.bad and not outcome.problems, outcome.line()


def test_full_upgrade_cut_while_the_kernel_hook_builds(twin_root_cache, tmp_path):
    """`apt full-upgrade` with a Proxmox kernel, its headers and a systemd-boot-efi upgrade in one
    transaction, cut while pvegpu's kernel hook builds nvidia for the new kernel (after
    initramfs-tools' post-update hook already put that kernel on the ESP)."""
    case = pc.FullUpgrade()
    outcome = cut(case, tmp_path, ("run-parts: executing /etc/kernel/postinst.d/pvegpu-nvidia 6.12.118+deb12-amd64 "
                                   "/boot/vmlinuz-6.12.118+deb12-amd64", 1, 2.0))
    assert not outcome.bad and not outcome.problems, outcome.line()


def test_driver_upgrade_cut_while_the_user_space_is_installed(twin_root_cache, tmp_path):
    case = pc.DriverUpgrade()
    outcome = cut(case, tmp_path, ("--> Starting operation: NVIDIA driver | NVIDIA user space and GSP firmware 595.82.01",
                                   1, 0.0))
    assert not outcome.bad and not outcome.problems, outcome.line()


def _named(case: pc.Case, point: tuple[str, int, float]) -> tuple[str, int, float]:
    """`{twin}` in a step's key is the twin's name (pyinfra prints the host's name)."""
    return (point[0].replace("{twin}", f"pcut-{id(case) % 100000}"), point[1], point[2])
