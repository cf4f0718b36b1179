"""Boot-loader packages in Debian's shapes, for the twin (issue 38 §1: "grub, shim and
systemd-boot-efi upgrades exist as packages that fire proxmox-kernel-helper's trigger").

proxmox-kernel-helper's debian/triggers declares `interest-noawait` in /usr/lib/grub,
/usr/lib/systemd/boot and /usr/lib/shim; its debian/postinst runs `proxmox-boot-tool reinit` on
`triggered`. dpkg activates the trigger when a package unpacks files below one of those paths, so
what matters of each package here is its name, its version and where its files land (Debian's
layout; facts only, the contents are placeholders):

- grub-efi-amd64-bin (source grub2, the version of grub-common): /usr/lib/grub/x86_64-efi/ with
  its modinfo.sh (grub-install reads the platform from it) and the modules;
- grub-efi-amd64-signed (source grub-efi-amd64-signed, version 1+<grub2 version with '-' as '+'>):
  /usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed;
- grub-pc-bin: installed in the twin root for real (tests/twin/runtime.py PACKAGES): its
  upgrade is its own files again under a higher version (`repack_command`);
- shim-signed: /usr/lib/shim/shimx64.efi.signed (bookworm-security's 1.51~1+deb12u1+16.1-2~deb12u1).

Deviations the twin needs: no Depends (grub-common's exact version pin, shim's mokutil and
shim-helpers): the twin root has grub-common at one version and nothing reaches a mirror; no
maintainer scripts (Debian's grub-efi-amd64 postinst, not modelled, would run grub-install, which
proxmox-kernel-helper's grub-install wrapper turns into reinit + refresh too).
"""

from __future__ import annotations

from pathlib import Path

from tests.twin.kernel_packages import _package

# shim-signed of bookworm (bookworm-security); the twin's upgrade installs it over an earlier build
SHIM_SIGNED = {"bookworm": "1.51~1+deb12u1+16.1-2~deb12u1"}


def signed_version(grub_version: str) -> str:
    """grub-efi-amd64-signed's version for a grub2 version (Debian's template: 1+<version>, '-' as '+')."""
    return "1+" + grub_version.replace("-", "+")


def grub_efi_amd64_bin(out: Path, version: str) -> Path:
    files = {"usr/lib/grub/x86_64-efi/modinfo.sh": f"grub_modinfo_target_cpu=x86_64\ngrub_modinfo_platform=efi\n"
                                                   f"grub_package_version={version}\n"}
    for mod in ("normal", "linux", "part_gpt", "fat", "loadenv", "search_fs_uuid"):
        files[f"usr/lib/grub/x86_64-efi/{mod}.mod"] = f"twin placeholder: GRUB module {mod} {version}\n"
    return _package(out, "grub-efi-amd64-bin", version, "amd64", "GRand Unified Bootloader, version 2 (EFI-AMD64 modules)",
                    files, Source="grub2")


def grub_efi_amd64_signed(out: Path, grub_version: str) -> Path:
    version = signed_version(grub_version)
    return _package(out, "grub-efi-amd64-signed", version, "amd64", "GRand Unified Bootloader, version 2 (EFI-AMD64 version, signed)",
                    {"usr/lib/grub/x86_64-efi-signed/grubx64.efi.signed": f"twin placeholder: signed GRUB {version}\n"})


def shim_signed(out: Path, version: str) -> Path:
    return _package(out, "shim-signed", version, "amd64", "Secure Boot chain-loading bootloader (Microsoft-signed binary)",
                    {"usr/lib/shim/shimx64.efi.signed": f"twin placeholder: shim {version}\n"})


def repack_command(package: str) -> str:
    """Shell, run in the twin: an upgrade of an installed package, its files again under the version
    `<installed>+twin1`, installed with dpkg (its files below a trigger path fire the trigger)."""
    return ("set -e\n"
            f"d=$(mktemp -d /root/{package}.XXXXXX)\n"
            f"v=$(dpkg-query -W -f '${{Version}}' {package})\n"
            'mkdir -p "$d/DEBIAN"\n'
            f'dpkg-query -L {package} | while read -r f; do if [ -f "$f" ] && [ ! -L "$f" ]; then install -D "$f" "$d$f"; fi; done\n'
            f"printf 'Package: {package}\\nVersion: %s+twin1\\nArchitecture: amd64\\nMaintainer: t <t@example.invalid>\\n"
            f"Description: {package} (upgrade)\\n' \"$v\" > \"$d/DEBIAN/control\"\n"
            'dpkg-deb -Zgzip -b "$d" "$d.deb" >/dev/null\n'
            'dpkg -i "$d.deb"\n'
            'rm -rf "$d" "$d.deb"\n')
