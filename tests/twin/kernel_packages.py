"""Kernel packages in Proxmox's shapes, for the twin (issue 38 §1: "Proxmox's package shapes for real").

Names, relations and maintainer scripts follow pve-kernel (bookworm-6.14 and trixie-6.17 trees in
../shared/sources; facts only, the scripts here are written anew):

- debian/signing-template/control.in: `proxmox-kernel-<rel>-signed` (what Proxmox VE >= 8.1
  installs) Provides `linux-image-<rel>-amd64, proxmox-kernel-<rel>`, Conflicts and Replaces
  `proxmox-kernel-<rel>`; its relations are the unsigned image's (signing-template/rules.in
  copies Depends/Recommends/Suggests/Breaks) and its maintainer scripts are the unsigned ones
  (debian/rules copies proxmox-kernel.{postinst,prerm,postrm}.in into the template).
- debian/control.in: `proxmox-kernel-<rel>` (unsigned: what a pve-kernel build on the host makes)
  Provides `linux-image-<rel>-amd64, pve-kernel-<rel>`, Depends `busybox, initramfs-tools |
  linux-initramfs-tool`; `proxmox-headers-<rel>` Provides `linux-headers-<rel>-amd64,
  pve-headers-<rel>` and depends on nothing of the image, so apt may unpack and configure it
  after the image; `proxmox-kernel-X.Y` Depends `pve-firmware, proxmox-kernel-<rel>-signed |
  proxmox-kernel-<rel>`; `proxmox-headers-X.Y` Depends `proxmox-headers-<rel>`.
- proxmox-kernel-meta (as facts/kernel_hook.py reads it): `proxmox-default-kernel` Depends
  `proxmox-kernel-X.Y`, `proxmox-default-headers` Depends `proxmox-headers-X.Y`.
- debian/proxmox-kernel.postinst.in: on configure only, nothing under /proxmox_install_mode,
  `depmod <rel>`, then `run-parts --verbose --exit-on-error --arg=<rel> --arg=/boot/vmlinuz-<rel>
  /etc/kernel/postinst.d` (a failure fails the postinst). proxmox-kernel.prerm.in: on remove,
  /etc/kernel/prerm.d the same way. proxmox-kernel.postrm.in: except on upgrade,
  /etc/kernel/postrm.d, then the initrd files go; on purge the generated modules.* files too.
- debian/proxmox-headers.postinst.in: does nothing in any case (no kernel hook runs when the
  headers are configured). The headers package carries /usr/src/linux-headers-<rel> and the
  link /usr/lib/modules/<rel>/build to it (debian/rules .headers_install_mark).
- debian/proxmox-kernel-meta.postinst.in (the X.Y package): /boot/pve/{vmlinuz,initrd.img}-X.Y
  links to the release's files; its postrm removes /boot/pve/*-<rel> links.

Deviations the twin needs: `busybox` is left out of the image's Depends (the twin root has no
busybox package and nothing reaches a mirror), and `pve-firmware` is an empty package of its own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

MAINTAINER = "pvegpu tests <tests@example.invalid>"
# pve-kernel debian/control.in Depends of proxmox-kernel-<rel>, less busybox (see above)
IMAGE_DEPENDS = "initramfs-tools | linux-initramfs-tool"


def build_deb(tree: Path, out: Path, compression: str = "gzip") -> Path:
    subprocess.run(["dpkg-deb", "--root-owner-group", f"-Z{compression}", "--build", str(tree), str(out)],
                   check=True, capture_output=True)
    return out


def _control(package: str, version: str, arch: str, description: str, **fields: str) -> str:
    lines = [f"Package: {package}", f"Version: {version}", f"Architecture: {arch}", f"Maintainer: {MAINTAINER}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in fields.items() if value]
    return "\n".join(lines + [f"Description: {description}"]) + "\n"


def _package(out: Path, package: str, version: str, arch: str, description: str,
             files: Mapping[str, bytes | str] | None = None, links: dict[str, str] | None = None,
             trees: dict[str, Path] | None = None, scripts: dict[str, str] | None = None,
             compression: str = "gzip", **fields: str) -> Path:
    tree = out / f"{package}_{version}.tree"
    if tree.exists():
        shutil.rmtree(tree)
    (tree / "DEBIAN").mkdir(parents=True)
    for dest, src in (trees or {}).items():
        shutil.copytree(src, tree / dest, symlinks=True)
    for path, content in (files or {}).items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (tree / path).write_bytes(content)
        else:
            (tree / path).write_text(content)
    for path, target in (links or {}).items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, tree / path)
    (tree / "DEBIAN/control").write_text(_control(package, version, arch, description, **fields))
    for name, text in (scripts or {}).items():
        (tree / "DEBIAN" / name).write_text(text)
        (tree / "DEBIAN" / name).chmod(0o755)
    deb = build_deb(tree, out / f"{package}_{version.replace(':', '%3a')}_{arch}.deb", compression)
    shutil.rmtree(tree)
    return deb


def image_scripts(release: str) -> dict[str, str]:
    """postinst, prerm and postrm of a Proxmox kernel image (signed and unsigned alike), as
    pve-kernel's debian/proxmox-kernel.{postinst,prerm,postrm}.in behave (sh instead of Perl)."""
    image = f"/boot/vmlinuz-{release}"
    hooks = (f'  echo "Examining /etc/kernel/%s.d." >&2\n'
             f"  run-parts --verbose --exit-on-error --arg={release} --arg={image} /etc/kernel/%s.d \\\n"
             f'    || {{ echo "Failed to process /etc/kernel/%s.d" >&2; exit 1; }}\n')
    postinst = ("#!/bin/sh\n# twin: pve-kernel debian/proxmox-kernel.postinst.in\n"
                'case "$1" in *configure*) ;; *) exit 0;; esac\n'
                "[ -e /proxmox_install_mode ] && exit 0\n"
                f"depmod {release}\n"
                "if [ -d /etc/kernel/postinst.d ]; then\n" + hooks % (("postinst",) * 3) + "fi\nexit 0\n")
    prerm = ("#!/bin/sh\n# twin: pve-kernel debian/proxmox-kernel.prerm.in\n"
             'case "$1" in *remove*) ;; *) exit 0;; esac\n'
             "[ -e /proxmox_install_mode ] && exit 0\n"
             "if [ -d /etc/kernel/prerm.d ]; then\n" + hooks % (("prerm",) * 3) + "fi\nexit 0\n")
    postrm = ("#!/bin/sh\n# twin: pve-kernel debian/proxmox-kernel.postrm.in\n"
              'case "$1" in *upgrade*) exit 0;; esac\n'
              "if [ -d /etc/kernel/postrm.d ]; then\n" + hooks % (("postrm",) * 3) + "fi\n"
              f"rm -f /boot/initrd.img-{release} /boot/initrd.img-{release}.bak /var/lib/initramfs-tools/{release}\n"
              'case "$1" in *purge*) ;; *) exit 0;; esac\n'
              f"for f in /lib/modules/{release}/modules.*; do\n"
              f'  case "${{f##*/}}" in modules.order|modules.builtin|modules.builtin.modinfo) ;; *) rm -f "$f";; esac\n'
              "done\n"
              f"rmdir /lib/modules/{release} 2>/dev/null\nexit 0\n")
    return {"postinst": postinst, "prerm": prerm, "postrm": postrm}


def image(out: Path, release: str, version: str, files: Mapping[str, bytes | str], signed: bool = True,
          links: dict[str, str] | None = None, depends: str = IMAGE_DEPENDS, compression: str = "gzip") -> Path:
    """The kernel image package of `release`: `files` are its contents (boot/vmlinuz-<rel>,
    boot/config-<rel>, lib/modules/<rel>/…). signed: proxmox-kernel-<rel>-signed (Proxmox's
    repositories), else proxmox-kernel-<rel> (a pve-kernel build)."""
    unsigned = f"proxmox-kernel-{release}"
    if signed:
        return _package(out, f"{unsigned}-signed", version, "amd64", "Proxmox Kernel Image (signed)", files, links,
                        scripts=image_scripts(release), compression=compression, Depends=depends,
                        Provides=f"linux-image-{release}-amd64, {unsigned}", Conflicts=unsigned, Replaces=unsigned)
    return _package(out, unsigned, version, "amd64", "Proxmox Kernel Image", files, links,
                    scripts=image_scripts(release), compression=compression, Depends=depends,
                    Provides=f"linux-image-{release}-amd64, pve-kernel-{release}")


def headers(out: Path, release: str, version: str, files: Mapping[str, bytes | str] | None = None,
            tree: Path | None = None, extra_trees: dict[str, Path] | None = None, build_link: bool = True,
            compression: str = "gzip", depends: str = "") -> Path:
    """proxmox-headers-<rel>: /usr/src/linux-headers-<rel> (a copy of `tree` and/or `files`
    under it) and, with build_link, /usr/lib/modules/<rel>/build pointing there. No maintainer
    scripts: the real postinst does nothing. `extra_trees`: more directories it carries
    ({path in the package: source}), e.g. the kbuild scripts Debian's headers link to. `depends`:
    a package carrying the tree instead (the twin's dist-upgrade: Debian's real headers package)."""
    src = f"usr/src/linux-headers-{release}"
    trees = {**({src: tree} if tree is not None else {}), **(extra_trees or {})}
    return _package(out, f"proxmox-headers-{release}", version, "amd64", "Proxmox Kernel Headers",
                    {f"{src}/{p}": c for p, c in (files or {}).items()},
                    {f"usr/lib/modules/{release}/build": f"/{src}"} if build_link else None, trees,
                    compression=compression, Provides=f"linux-headers-{release}-amd64, pve-headers-{release}",
                    Depends=depends)


def series_metas(out: Path, series: str, release: str, version: str) -> list[Path]:
    """proxmox-kernel-X.Y and proxmox-headers-X.Y pointing at `release`."""
    meta_postinst = ("#!/bin/sh\n# twin: pve-kernel debian/proxmox-kernel-meta.postinst.in\nset -e\n"
                     'if [ "$1" = configure ]; then\n  mkdir -p /boot/pve\n'
                     f"  ln -sf /boot/vmlinuz-{release} /boot/pve/vmlinuz-{series}\n"
                     f"  ln -sf /boot/initrd.img-{release} /boot/pve/initrd.img-{series}\nfi\nexit 0\n")
    meta_postrm = ("#!/bin/sh\n# twin: pve-kernel debian/proxmox-kernel-meta.postrm.in\nset -e\n"
                   f"rm -f /boot/pve/vmlinuz-{release} /boot/pve/initrd.img-{release}\nexit 0\n")
    return [
        _package(out, f"proxmox-kernel-{series}", version, "all", "Latest Proxmox Kernel Image",
                 scripts={"postinst": meta_postinst, "postrm": meta_postrm},
                 Provides=f"linux-image-amd64, linux-image-generic, wireguard-modules (=1.0.0), pve-kernel-{series}",
                 Replaces=f"pve-kernel-{series}",
                 Depends=f"pve-firmware, proxmox-kernel-{release}-signed | proxmox-kernel-{release}"),
        _package(out, f"proxmox-headers-{series}", version, "all", "Latest Proxmox Kernel Headers",
                 Provides=f"linux-headers-amd64, linux-headers-generic, pve-headers-{series}",
                 Replaces=f"pve-headers-{series}", Depends=f"proxmox-headers-{release}"),
    ]


def default_metas(out: Path, series: str | None, version: str) -> list[Path]:
    """proxmox-default-kernel and proxmox-default-headers (proxmox-kernel-meta) on `series`
    (None: depending on nothing, for a host whose running kernel is not a package here)."""
    return [_package(out, "proxmox-default-kernel", version, "all", "Default Proxmox Kernel Image",
                     Depends=f"proxmox-kernel-{series}" if series else ""),
            _package(out, "proxmox-default-headers", version, "all", "Default Proxmox Kernel Headers",
                     Depends=f"proxmox-headers-{series}" if series else "")]


def pve_firmware(out: Path, version: str = "3.15-1") -> Path:
    """pve-firmware, which proxmox-kernel-X.Y depends on: empty here (the twin loads no firmware)."""
    return _package(out, "pve-firmware", version, "all", "twin stand-in of pve-firmware (no files)")


def release_chain(out: Path, release: str, series: str, version: str, meta_version: str,
                  image_files: Mapping[str, bytes | str], headers_kwargs: dict | None = None,
                  signed: bool = True) -> list[Path]:
    """Everything `apt-get install proxmox-default-kernel proxmox-default-headers` pulls for
    `release` from a Proxmox repository: image (-signed), headers, the X.Y and default metas."""
    return [image(out, release, version, image_files, signed=signed),
            headers(out, release, version, **(headers_kwargs or {})),
            *series_metas(out, series, release, meta_version), *default_metas(out, series, meta_version)]
