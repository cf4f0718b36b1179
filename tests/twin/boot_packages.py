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

Trixie (Proxmox VE 9), read from trixie's main/binary-amd64 Packages index (the twin's trixie root
keeps it under /var/lib/apt/lists): grub2 2.12-9+deb13u4, grub-efi-amd64-signed 1+2.12+9+deb13u4
(the same '-' as '+' template), shim-signed 1.51~1+deb13u1+16.1-2~deb13u1, systemd-boot-efi
257.13-1~deb13u1. One shape changed: since grub2 2.12-3 the EFI images moved out of -bin into
grub-efi-amd64-unsigned (Replaces/Breaks grub-efi-amd64-bin (<< 2.12-3~); -bin Depends on it),
installed as /usr/lib/grub/x86_64-efi/monolithic/grub{,net,gcd}x64.efi (what grub-efi-amd64-signed's
debian/Makefile `check` compares its signed image with): still below /usr/lib/grub, so its upgrade
fires the same trigger. proxmox-kernel-helper 9.2.0's debian/triggers keeps the three interest
paths of 8.1.4 (/usr/lib/grub, /usr/lib/systemd/boot, /usr/lib/shim).

Deviations the twin needs: no Depends (grub-common's exact version pin, shim's mokutil and
shim-helpers): the twin root has grub-common at one version and nothing reaches a mirror; no
maintainer scripts (Debian's grub-efi-amd64 postinst, not modelled, would run grub-install, which
proxmox-kernel-helper's grub-install wrapper turns into reinit + refresh too).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.twin.kernel_packages import _package

# shim-signed of each suite (bookworm: bookworm-security's; trixie: trixie main's); the twin's
# upgrade installs it over an earlier build
SHIM_SIGNED = {"bookworm": "1.51~1+deb12u1+16.1-2~deb12u1", "trixie": "1.51~1+deb13u1+16.1-2~deb13u1"}
# grub2 (grub-common, grub-efi-amd64-bin) as each suite's main ships it
GRUB2 = {"bookworm": "2.06-13+deb12u2", "trixie": "2.12-9+deb13u4"}
# systemd-boot-efi (source systemd) as each suite's main ships it
SYSTEMD_BOOT_EFI = {"bookworm": "252.39-1~deb12u2", "trixie": "257.13-1~deb13u1"}
# the grub2 version from which the EFI images are grub-efi-amd64-unsigned's (debian/control Replaces)
UNSIGNED_SPLIT = "2.12-3~"


def signed_version(grub_version: str) -> str:
    """grub-efi-amd64-signed's version for a grub2 version (Debian's template: 1+<version>, '-' as '+')."""
    return "1+" + grub_version.replace("-", "+")


def has_unsigned_split(version: str) -> bool:
    """Whether grub2 `version` ships its EFI images as grub-efi-amd64-unsigned (>= 2.12-3~, by
    dpkg's order; trixie's 2.12-9+deb13u4 does, bookworm's 2.06-13+deb12u2 does not)."""
    return subprocess.run(["dpkg", "--compare-versions", version, "ge", UNSIGNED_SPLIT]).returncode == 0


def grub_efi_amd64_unsigned(out: Path, version: str) -> Path:
    files = {f"usr/lib/grub/x86_64-efi/monolithic/{image}": f"twin placeholder: GRUB image {image} {version}\n"
             for image in ("grubx64.efi", "gcdx64.efi", "grubnetx64.efi")}
    return _package(out, "grub-efi-amd64-unsigned", version, "amd64",
                    "GRand Unified Bootloader, version 2 (EFI-AMD64 images)", files, Source="grub2",
                    Replaces="grub-efi-amd64-bin (<< 2.12-3~)", Breaks="grub-efi-amd64-bin (<< 2.12-3~)")


def grub_efi_debs(out: Path, version: str) -> list[Path]:
    """The packages of one grub2 `version`'s EFI upgrade, in one `dpkg -i`: -bin and -signed, and
    from 2.12-3 on -unsigned (which -bin Depends on)."""
    debs = [grub_efi_amd64_bin(out, version), grub_efi_amd64_signed(out, version)]
    return debs + [grub_efi_amd64_unsigned(out, version)] if has_unsigned_split(version) else debs


def grub_efi_amd64_bin(out: Path, version: str) -> Path:
    depends = "grub-efi-amd64-unsigned" if has_unsigned_split(version) else None
    files = {"usr/lib/grub/x86_64-efi/modinfo.sh": f"grub_modinfo_target_cpu=x86_64\ngrub_modinfo_platform=efi\n"
                                                   f"grub_package_version={version}\n"}
    for mod in ("normal", "linux", "part_gpt", "fat", "loadenv", "search_fs_uuid"):
        files[f"usr/lib/grub/x86_64-efi/{mod}.mod"] = f"twin placeholder: GRUB module {mod} {version}\n"
    description = "GRand Unified Bootloader, version 2 (EFI-AMD64 modules)"
    if depends:
        return _package(out, "grub-efi-amd64-bin", version, "amd64", description, files, Source="grub2", Depends=depends)
    return _package(out, "grub-efi-amd64-bin", version, "amd64", description, files, Source="grub2")


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
