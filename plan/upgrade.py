"""The 8 -> 9 upgrade check of a GPU host (pure): what pve-manager's `pve8to9` (PVE/CLI/pve8to9.pm,
stable-8 8.4.x and master 9.x) warns about that pvegpu causes or can fix, each finding with its
fix. Run while the spec says `proxmox_ve: 9`, before the upgrade (the host runs 8) and after it
(the host runs 9: what is due then, such as removing systemd-boot and unpinning 8's kernel before
the reboot, operations/upgrade.py); read-only.

    upgrade_findings(state, lxc_configs, nvidia_version, host=HostView(...)) -> ["dkms status lists …; fix: …", …]
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from plan.guests import legacy_cgroup_keys
from plan.kernel import grub_release_of
from plan.releases import kernel_pve_major, legacy_cgroup_param

# pve8to9 `$min_pve_major, $min_pve_minor, $min_pve_pkgrel = (8, 4, 0)`: check_pve_packages fails
# a proxmox-ve package older than 8.4-0
MIN_PROXMOX_VE = (8, 4, 0)
# the kernel meta-packages whose hold keeps 9's kernel out of the dist-upgrade (proxmox-kernel-meta:
# proxmox-default-kernel depends on proxmox-kernel-X.Y, which depends on the newest ABI of X.Y;
# plan.kernel_hook.hold_packages holds these for kernel_updates: hold)
_KERNEL_META = re.compile(r"^(proxmox-default-(kernel|headers)|proxmox-(kernel|headers)-\d+\.\d+|pve-kernel-\d+\.\d+)$")


def _bookworm_kernel(release: str) -> bool:
    """A kernel of Proxmox VE 8 (plan/releases.py: -bpo12, before 6.14, and 6.14's early bookworm
    builds 6.14.0-1/6.14.0-2/6.14.4-1, named before pve-kernel 6a8fa6f set KREL_EXTRA=-bpo12)."""
    return kernel_pve_major(release) in (7, 8)


def proxmox_ve_too_old(version: str | None) -> bool:
    """pve8to9 check_pve_packages: proxmox-ve `8.4.0` or `8.4-1` against MIN_PROXMOX_VE."""
    match = re.match(r"^(\d+)\.(\d+)[.-](\d+)", version or "")
    if match is None:
        return False
    return tuple(int(g) for g in match.groups()) < MIN_PROXMOX_VE


@dataclass
class HostView:
    """What the check reads beside `UpgradeState` (operations/upgrade.py fills it from the facts)."""

    upgraded: bool = False                     # pve-manager is 9 (pve8to9's $upgraded)
    proxmox_ve: str | None = None              # the proxmox-ve package's version
    running_kernel: str | None = None          # `uname -r`
    cmdline_params: list[str] = field(default_factory=list)  # the configured kernel command line
    cmdline_file: str | None = None            # where it is configured (/etc/kernel/cmdline, /etc/default/grub)
    pbt_systemd_boot: bool | None = None       # proxmox-boot-tool status: an ESP set up for systemd-boot (uefi)
    running_gpu_guests: list[str] = field(default_factory=list)  # ["CT 200", "VM 300"]: the spec's GPU guests that run
    kernel_updates: str = "follow"             # the spec's kernel_updates


def _pin_findings(state: dict, host: HostView) -> list[str]:
    findings = []
    after = host.upgraded
    pins = []
    if state.get("pin") and _bookworm_kernel(state["pin"]):
        # plan.kernel set_default_command: where systemd-boot boots, pvegpu's pin is also the EFI variable
        # LoaderEntryDefault, which systemd-boot prefers over loader.conf: an unpin alone leaves it
        pins.append(("proxmox-boot-tool pins", state["pin"],
                     "proxmox-boot-tool kernel unpin && proxmox-boot-tool refresh, and on a systemd-boot host "
                     "bootctl set-default '' (pvegpu's pin is also the EFI default entry)"))
    saved = grub_release_of(state.get("grub_saved"))
    if saved and _bookworm_kernel(saved):
        # plan.kernel set_default_command: pvegpu's kernel stage makes its kernel GRUB's saved default
        pins.append(("GRUB's saved default (grubenv saved_entry, set by grub-set-default: pvegpu's kernel stage "
                     "sets it on a GRUB host) is", saved,
                     "grub-editenv /boot/grub/grubenv unset saved_entry (GRUB_DEFAULT=saved without saved_entry boots "
                     "the first entry, the newest kernel)"))
    for what, release, fix in pins:
        if after:
            findings.append(
                f"{what} kernel {release}, a Proxmox VE 8 kernel, and the host runs Proxmox VE 9 now: the next boot "
                f"would start 8's kernel under 9's user space (no NVIDIA modules are built for it on 9). Fix now, "
                f"before the reboot: {fix}; set kernel.version to a trixie build to have pvegpu pin its own again")
        else:
            findings.append(
                f"{what} kernel {release}, a Proxmox VE 8 kernel: after the upgrade the host would keep booting it "
                f"(no NVIDIA modules are built for 8's kernels on 9, and pve8to9 expects 6.14 or newer). Fix before "
                f"the reboot into 9: {fix} (set kernel.version to a trixie build to have pvegpu pin its own again)")
    return findings


def _bootloader_findings(state: dict, host: HostView) -> list[str]:
    """pve8to9 check_bootloader, branch by branch."""
    sd_boot = state.get("systemd_boot")
    if not state.get("efi"):
        return ["the systemd-boot package is installed on a legacy-boot (BIOS) host, where pve8to9 calls it "
                "unnecessary. Fix: apt remove systemd-boot"] if sd_boot else []
    findings = []
    if state.get("boot_uuids"):
        # not yet upgraded and an ESP set up for systemd-boot: pve8to9 skips ("still needed for bootctl")
        if sd_boot and not host.upgraded and host.pbt_systemd_boot is not False:
            return ["the systemd-boot meta-package is installed on this proxmox-boot-tool host: pve8to9 fails on it "
                    "once the host runs 9 (it causes problems on upgrades of other boot-related packages). Fix: right "
                    "after the upgrade, apt remove systemd-boot (Proxmox's 8 to 9 upgrade guide, sd-boot-warning)"]
    else:
        if not state.get("grub_efi"):
            findings.append("the host boots with UEFI, but the grub-efi-amd64 meta-package is not installed: pve8to9 "
                            "warns that new GRUB versions will not be installed to /boot/efi. Fix: apt install "
                            "grub-efi-amd64")
        if state.get("removable") and not state.get("removable_updated"):
            findings.append("a removable loader /boot/efi/EFI/BOOT/BOOTX64.efi is there, but GRUB's packages are not "
                            "set to update it (debconf grub2/force_efi_extra_removable is not true): the firmware may "
                            "keep starting the old GRUB after the upgrade (pve8to9 check_bootloader). Fix: echo "
                            "'grub-efi-amd64 grub2/force_efi_extra_removable boolean true' | debconf-set-selections -v "
                            "-u, then apt install --reinstall grub-efi-amd64")
    if sd_boot:
        when = "now (the host runs 9)" if host.upgraded else "before the upgrade"
        findings.append(f"the systemd-boot meta-package is installed: pve8to9 fails on it (it causes problems on "
                        f"upgrades of other boot-related packages). Fix {when}: apt remove systemd-boot (Proxmox's 8 "
                        "to 9 upgrade guide, sd-boot-warning)")
    return findings


def upgrade_findings(state: dict, lxc_configs: dict[int, str], nvidia_version: str | None = None,
                     host: HostView | None = None) -> list[str]:
    """Findings of the upgrade check, each a sentence ending in its fix.

    + state: `facts.upgrade.UpgradeState`
    + lxc_configs: {ctid: config text} (`LxcConfigs`)
    + nvidia_version: the spec's driver (the note on the rebuild after the upgrade), or None
    + host: what else the check reads (HostView); default: a host on 8 of which nothing else is known
    """
    host = host or HostView()
    after = host.upgraded
    findings = []
    # pve8to9 check_pve_packages: proxmox-ve >= 8.4-0 before the upgrade
    if not after and proxmox_ve_too_old(host.proxmox_ve):
        findings.append(f"proxmox-ve is {host.proxmox_ve}: pve8to9 fails below 8.4-0 (Proxmox upgrades to 9 only "
                        "from the latest 8.4). Fix: apt update && apt full-upgrade on 8's repositories, reboot, run "
                        "this again")
    # pve8to9 check_virtual_guests: running guests ("consider migrating or stopping them")
    if not after and host.running_gpu_guests:
        findings.append(f"GPU guests run ({', '.join(host.running_gpu_guests)}): pve8to9 warns about running guests; "
                        "the upgrade replaces the kernel and the NVIDIA modules under them and ends in a reboot. Fix: "
                        "stop them (or migrate the VMs) before the upgrade")
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
    findings += _bootloader_findings(state, host)
    findings += _pin_findings(state, host)
    # after the upgrade: still on 8's kernel (pve8to9 check_pve_packages: "missing reboot?!")
    if after and host.running_kernel and _bookworm_kernel(host.running_kernel):
        findings.append(f"the host runs Proxmox VE 9 on kernel {host.running_kernel}, a Proxmox VE 8 kernel: pve8to9 "
                        "expects 6.14 or newer once upgraded. Fix: reboot into 9's kernel (after the unpin above, if "
                        "any), then converge: pvegpu builds the NVIDIA modules for it")
    # kernel meta-packages on hold: a dist-upgrade keeps them back (apt never upgrades a held package)
    held = [p for p in state.get("holds") or [] if _KERNEL_META.match(p)]
    if held:
        ours = (" (pvegpu holds them: kernel_updates: hold; set kernel_updates: follow and converge to release "
                "exactly its holds, or)" if host.kernel_updates == "hold" else ". Fix:")
        release = f"apt-mark unhold {' '.join(held)}"
        if after:
            findings.append(f"{', '.join(held)} are on hold: the dist-upgrade kept the kernel meta-packages back, so "
                            f"9's kernel series may be missing{ours} {release} && apt full-upgrade, then reboot into "
                            "9's kernel")
        else:
            findings.append(f"{', '.join(held)} are on hold: the dist-upgrade to 9 keeps them back, so 9's kernel "
                            f"(proxmox-default-kernel of trixie) is not installed and the host boots 8's kernel on "
                            f"9{ours} {release} before the dist-upgrade; hold again on 9 if wanted")
    # pve8to9 checklist: systemd.unified_cgroup_hierarchy=0 on /proc/cmdline fails
    # check_containers_cgroup_compat ("support for the hybrid cgroup hierarchy is removed in Proxmox VE 9")
    legacy = legacy_cgroup_param(host.cmdline_params)
    if legacy:
        where = f" in {host.cmdline_file}" if host.cmdline_file else ""
        findings.append(f"the kernel command line{where} has {legacy}, the legacy (cgroup v1) layout, which Proxmox VE "
                        "9 removed (pve8to9 fails on it). Fix: take it out of iommu.params if it is there; on 9 "
                        "pvegpu's boot stage drops it from the line it writes")
    # pve8to9 check_virtual_guests: CTs with lxc.cgroup keys, ignored under the unified cgroup v2 layout
    for ctid in sorted(lxc_configs):
        findings += legacy_cgroup_keys(ctid, lxc_configs[ctid])
    if nvidia_version and not after:
        findings.append(
            f"9's kernel needs nvidia {nvidia_version} built with GCC 14 (Proxmox builds its 9.x kernels with "
            "trixie's gcc-14; modules of another GCC are refused). pvegpu's kernel hook builds it during the "
            "dist-upgrade with that kernel's own compiler, in the kernel's postinst where gcc-14 and g++-14 are "
            "configured by then, else in apt's pass after the dpkg run (a real apt full-upgrade on the twin, "
            "tests/e2e/test_dist_upgrade_e2e.py); it pins no kernel of the other release. Fix: keep gcc and g++ "
            "(build-essential) and proxmox-default-headers installed, so the upgrade brings gcc-14, g++-14 and 9's "
            "headers; before the reboot, if the login notice or a --dry run still names 9's kernel, converge "
            "first (it builds for 9's kernel, then reboots into it where reboot.allowed)")
    return findings
