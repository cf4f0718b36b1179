"""The 8 -> 9 upgrade check of a GPU host (pure): what pve-manager's `pve8to9` warns about that
pvegpu causes or can fix, each finding with its fix. Run while the spec says `proxmox_ve: 9` and
the host still runs Proxmox VE 8 (operations/upgrade.py); read-only.

    upgrade_findings(state, lxc_configs, nvidia_version) -> ["dkms status lists …; fix: …", …]
"""

from __future__ import annotations

import re

from plan.guests import legacy_cgroup_keys


def _bookworm_kernel(release: str) -> bool:
    """A kernel of Proxmox VE 8: pve-kernel's bookworm branches mark theirs -bpo12; before 6.14
    every Proxmox kernel was a bookworm one (9.0 shipped 6.14, pve8to9 check_pve_packages)."""
    if "-bpo12" in release:
        return True
    match = re.match(r"^(\d+)\.(\d+)", release)
    if match is None:
        return False
    return (int(match.group(1)), int(match.group(2))) < (6, 14)


def upgrade_findings(state: dict, lxc_configs: dict[int, str], nvidia_version: str | None = None) -> list[str]:
    """Findings of the upgrade check, each a sentence ending in its fix.

    + state: `facts.upgrade.UpgradeState`
    + lxc_configs: {ctid: config text} (`LxcConfigs`)
    + nvidia_version: the spec's driver (the note on the rebuild after the upgrade), or None
    """
    findings = []
    # pve8to9 check_dkms_modules: "dkms modules found, this might cause issues during upgrade"
    if state.get("dkms"):
        names = ", ".join(state["dkms"])
        nvidia = any(line.lower().startswith("nvidia") for line in state["dkms"])
        findings.append(
            f"dkms status lists {names}: pve8to9 warns that DKMS modules may break the upgrade (they are rebuilt "
            "for the new kernel while apt is half way through)"
            + ("; an NVIDIA DKMS module is a second nvidia.ko beside pvegpu's, which builds the driver per kernel "
               "with the kernel's own GCC" if nvidia else "")
            + ". Fix: remove them before the upgrade (dkms remove <name>/<version> --all, or purge the package "
              "that installed them)")
    # pve8to9 check_bootloader: on a proxmox-boot-tool host the systemd-boot meta-package fails the
    # check once upgraded ("will cause problems on upgrades of other boot-related packages")
    if state.get("systemd_boot") and state.get("efi") and state.get("boot_uuids"):
        findings.append(
            "the systemd-boot meta-package is installed on this proxmox-boot-tool host: pve8to9 fails on it once "
            "the host runs 9 (it causes problems on upgrades of other boot-related packages). Fix: right after "
            "the upgrade, apt remove systemd-boot (Proxmox's 8 to 9 upgrade guide, sd-boot-warning)")
    elif state.get("systemd_boot") and not state.get("efi"):
        findings.append("the systemd-boot package is installed on a legacy-boot (BIOS) host, where pve8to9 calls it "
                        "unnecessary. Fix: apt remove systemd-boot")
    pin = state.get("pin")
    if pin and _bookworm_kernel(pin):
        findings.append(
            f"proxmox-boot-tool pins kernel {pin}, a Proxmox VE 8 kernel: after the upgrade the host would keep "
            "booting it (no NVIDIA modules are built for 8's kernels on 9, and pve8to9 expects 6.14 or newer). "
            "Fix: proxmox-boot-tool kernel unpin before the reboot into 9 (set kernel.version to a trixie build "
            "to have pvegpu pin its own again)")
    # pve8to9 check_virtual_guests: CTs with lxc.cgroup keys, ignored under the unified cgroup v2 layout
    for ctid in sorted(lxc_configs):
        findings += legacy_cgroup_keys(ctid, lxc_configs[ctid])
    if nvidia_version:
        findings.append(
            f"after the upgrade the converge builds nvidia {nvidia_version} for 9's kernel with GCC 14 (Proxmox "
            "builds its 9.x kernels with trixie's gcc-14; modules of another GCC are refused). Fix: install gcc-14 "
            "and g++-14 with the upgrade (build-essential on trixie) and keep proxmox-default-headers installed, "
            "then run the converge before relying on the GPUs")
    return findings
