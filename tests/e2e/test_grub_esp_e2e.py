"""Issue 38 item 2.4 on the kpro6 twin: an ESP in proxmox-boot-tool's grub mode (EFI/proxmox/
grubx64.efi on it, as `proxmox-boot-tool init <part> grub` leaves it on a UEFI host installed with
Secure Boot; zz-proxmox-boot update_esp_func then keeps GRUB there, whose grub.cfg and grubenv are
the ESP's). The kernel stage takes the loader from the ESP's mode (plan.loader), not from "UEFI and
ESPs": a one-boot trial is refused at preflight naming kernel.trial_boot, and nothing on the host
changes. Before, the stage armed a systemd-boot one-shot that this GRUB never reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.harness import root_manifest
from tests.e2e.test_kernel_trial_e2e import ESP, RELEASE, converge, seed_finished_build, twin_run

pytestmark = [pytest.mark.twin]


def test_a_trial_on_grub_esps_is_refused_before_any_change(twin_factory, tmp_path):
    twin = twin_factory("kpro6", name="grubesp-kpro6")
    root = Path(twin.root)
    seed_finished_build(root, tmp_path)
    grub_efi = root / ESP / "EFI/proxmox/grubx64.efi"
    grub_efi.parent.mkdir(parents=True, exist_ok=True)
    grub_efi.write_bytes(b"MZ")  # GRUB's EFI binary as grub-install puts it there (its content is not read)
    before = root_manifest(root)
    run = converge(twin.name, stages="operations.kernel,operations.reboot")
    assert run.rc != 0, run.output[-4000:]
    assert "kernel.trial_boot is on, but a trial that is one boot cannot be set up on this host" in run.output, \
        run.output[-4000:]
    assert "GRUB on the ESPs" in run.output and "kernel.trial_boot: false" in run.output, run.output[-4000:]
    assert f"vmlinuz-{RELEASE}" not in twin_run(twin.name, "ls", "/boot").split()
    after = root_manifest(root)
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert changed == [], changed[:20]
