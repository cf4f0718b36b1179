"""Runtime of the digital twin: root cache, one overlay per twin, namespaces, sshd, reboots.

On disk (paths relative to the repository root):

    .cache/twin/root-<key>/          unpacked bookworm root, the overlay lowerdir (never written)
    .cache/twin/root-<key>.tar.zst   the same root as a tarball (what CI caches)
    .twin/<name>/upper, work         overlay upper/work dirs of one twin
    .twin/<name>/root                the twin's root (overlay, mounted in the host namespace)
    .twin/<name>/id_ed25519          per-twin client key (root login)
    .twin/<name>/twin.json           {"name", "profile", "address", "port", "key", "pid", "root",
                                      "live_sysfs", ...}
    .twin/<name>/uptime              what the twin reads as /proc/uptime (reset on each boot)
    .twin/<name>/boots               one line per boot: "<unix-time> <boot-number>"
    .twin/<name>/supervisor.log      supervisor and sshd output

    .twin/<name>/ct/<id>/            one LXC container's files (see "Containers" below)

Per twin, one supervisor process runs as pid 1 of its own pid, mount and uts namespaces
(`unshare --mount --pid --uts --fork --propagation private`). It mounts proc/sys/dev/run as
TWIN-CONTRACT.md says, runs `chroot <root> /usr/sbin/sshd -D -e`, and serves reboot requests
(`<root>/var/lib/twin/reboot-request`). Killing it takes every process and mount of the twin
with it; `stop` then unmounts the overlay and checks nothing is left.

/sys is the rendered tree (hw/sys, tests/twin/hardware.py), bind-mounted. By default it is
mounted read-only (bind, then remount ro, sub-mounts too): /proc/self/mountinfo shows `ro` for
/sys, a write fails with EROFS, and the product knows this host cannot rebind now (as in a
container); a GPU move then happens at the twin's reboot. A twin started with `live_sysfs=True`
(`twinctl start --live-sysfs`; twin.json "live_sysfs", kept across reboots) has /sys read-write
and, at each boot, a kernel model (tests/twin/livesys.py) serving `drivers/<drv>/unbind`,
`drivers/<drv>/bind` and `drivers_probe` synchronously through FUSE (/run/twin-sysfs in the
twin; needs /dev/fuse), with `modprobe` of a PCI driver module loading it in the model: a
shell rebinds a GPU as on a real host, and the change lasts until the next reboot, which
computes the binding from the persisted config again.

Fault knobs for tests: `set_fault(name, unbind_delay_s=N)` (`twinctl fault NAME --unbind-delay
N`; var/lib/twin/faults.json) makes each unbind of a live twin take N s; `kill_sshd(name)`
(`twinctl kill-sshd NAME`) SIGKILLs every sshd of the twin (every SSH connection drops) and the
supervisor starts the listener again within ~1 s, like systemd's Restart=on-failure for
Debian's ssh.service; processes started detached (setsid, stdio to files) live on.

Containers (the pct stand-in, tests/twin/standins/proxmox.py, does the per-CT work). Each boot the
supervisor also bind-mounts, in its own namespace (so they go with it, like the other mounts):

    .twin/<name>/ct          -> <root>/var/lib/twin/ct       rw, a host-fs dir: overlayfs cannot
                                                             take an upperdir on the twin's overlay
    .cache/twin/root-<key>   -> <root>/var/lib/twin/ctbase   ro, pristine bookworm: every CT's lowerdir

    ct/<id>/upper, work      the CT's own files (overlay upper/work): kept across `pct stop/start`
                             and twin reboots, gone with `runtime.stop`
    ct/<id>/root             the CT's root: overlay(lower=ctbase, upper, work), mounted in the
                             twin by `pct start` (or the first exec after a twin reboot), once,
                             as LXC does; `pct stop` and twin reboots unmount it. One overlay per
                             CT: two on the same upper/work dirs corrupt each other
    ct/<id>/devices.json     the CT's /dev nodes, snapshot by `pct start` from its config (devN:
                             entries, or lxc.mount.entry + lxc.cgroup2.devices.allow) with the
                             twin's majors/minors; dropped by `pct stop`/`shutdown`; taken again
                             by the first exec after a twin reboot (a CT still running then
                             counts as started at boot, with that boot's nodes)

`pct exec <id> -- CMD` (and push/pull) runs `unshare --mount --uts --propagation private` in the
twin and, on top of ct/<id>/root, mounts a tmpfs /dev with the basic nodes plus devices.json's,
the twin's /proc (rbind) and /sys (ro), a tmpfs /run holding /run/twin/ (the twin's
/var/lib/twin, its stand-in library and nvidia-smi, read-only, for the NVIDIA user space that
tests/twin/installer.py installs), then chroots. Those mounts vanish with the command.

Clusters (`start(..., cluster=C)`, `twinctl start NAME --cluster C`): twins of one cluster share
one /etc/pve, .twin/.cluster-C/pve, as pmxcfs gives every node of a cluster the same tree
(pve-cluster src/pmxcfs): `nodes/<node>/{lxc,qemu-server}/`, `mapping/`, `priv/` (its `lock/`
is the cluster lock: tests/twin/standins/twinstate.py cfs_lock), `ha/`, `.vmlist` (every guest,
its node and type, as pmxcfs status.c dumps it; rewritten by the stand-ins when a guest is
created). The twin's node name is its twin name. Each boot the supervisor bind-mounts the shared
tree at <root>/etc/pve and, over its placeholders, the node-local views pmxcfs gives as
symlinks (cfs-plug-link.c): `lxc`, `qemu-server` -> nodes/<node>/..., `local` -> nodes/<node>,
and `.members` (this node's name, the cluster's nodes, online = its twin runs and is not
rebooting, quorate = more than half online with one vote each: corosync votequorum's default),
.twin/<name>/members, rewritten in place whenever a twin of the cluster starts, stops, begins a
reboot or finishes booting; the shared tree's corosync.conf lists the nodes (quorum_votes 1). Guest ids are cluster-wide: a
profile guest whose id another node has is not seeded. The tree goes when the last twin stops.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.twin import livesys

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = REPO / ".cache" / "twin"
TWINS_DIR = REPO / ".twin"
SSH_PORT = 2222
DEFAULT_HARDWARE = "tests.twin.hardware"

SUITE = "bookworm"
COMPONENTS = ("main", "non-free", "non-free-firmware")
# Installed with apt inside the debootstrapped minbase root (apt resolves dependencies better
# than debootstrap --include). Everything a stage may run for real is here.
PACKAGES = (
    # login and the basic userland pyinfra's facts read
    "openssh-server", "python3", "procps", "psmisc", "iproute2", "pciutils", "kmod", "file",
    "less", "sudo", "ca-certificates",
    # boot chain (files, config generation; nothing boots): initramfs, grub config, udev rules,
    # systemd units (systemd-analyze verify; systemd does not run)
    "initramfs-tools", "udev", "systemd", "grub2-common", "grub-pc-bin",
    # building modules and kernels: real Debian 6.1 headers, compilers, kbuild's tools
    "linux-headers-amd64", "build-essential", "gcc", "make", "dpkg-dev", "fakeroot", "dkms",
    "ccache", "bc", "flex", "bison", "libelf-dev", "libssl-dev", "dwarves", "rsync", "cpio",
    "xz-utils", "zstd", "debhelper", "perl",
    # Secure Boot: sbsign/sbverify, the kernel stage signs its kernel image (Authenticode) with a MOK
    "sbsigntool",
)
# Headers of a second kernel release, unpacked (not installed) into the root: bookworm-security's
# 6.12 (the Debian kernel closest to Proxmox's 6.14, built with gcc-12), so the driver stage is
# proven for two releases from one source. Each name is a metapackage whose headers package is
# taken with its -common and linux-kbuild dependencies. Not `apt install`ed because the 6.12
# headers depend on their kernel image (~100 MB; its postinst builds an initramfs and its
# /boot/vmlinuz would be a kernel the boot stand-ins list): the twin has headers for a kernel it
# has not installed, as a host has for the kernel stage's release before its reboot.
EXTRA_HEADERS = ("linux-headers-6.12-amd64",)
CACHE_FORMAT = 1  # bump when the way the root is configured changes
# Debian suites a profile can name (`debian:` in tests/twin/profiles/*.yml; default SUITE). Each
# has its own cached root (its own cache key), so a trixie root never touches the bookworm one.
# trixie (Proxmox VE 9's base): the same package list; `gcc` is gcc-14 (14.2.0) and
# linux-headers-amd64 Debian's 6.12, built with gcc-14; its second release is trixie-backports' 7.x
# (a name `<meta>/<suite>` is taken from that suite: apt-pkg/cacheset.cc VersionContainerInterface::
# FromString reads `pkg/release` as that release's version, for apt-cache depends and apt-get download; the suite
# is in the root's apt sources only while the headers are downloaded), built with the same gcc-14:
# the open tree 595.45.04 does not build for it (tests/e2e/test_driver_build_trixie.py).
SUITES = ("bookworm", "trixie")
SUITE_EXTRA_HEADERS: dict[str, tuple[str, ...]] = {"trixie": ("linux-headers-amd64/trixie-backports",)}
# The boot layer, over the root above (its own cache key: cache_key; the root without it keeps
# base_key, so a cached base root is reused): proxmox-kernel-helper built from Proxmox's source at
# the version each release ships (scripts/upstream-sources.tsv; its Makefile's recipe, dpkg-buildpackage)
# and installed with dpkg, so proxmox-boot-tool, its kernel and initramfs hooks, its grub.d snippet,
# its dpkg triggers (interest in /usr/lib/grub, /usr/lib/shim, /usr/lib/systemd/boot) and its
# postinst (`proxmox-boot-tool reinit` on configure and triggered) run as shipped; with what it
# depends on (debian/control: dosfstools, gdisk) and what its systemd-boot mode runs: systemd's
# bootctl and the EFI binaries (bookworm: systemd-boot; trixie: systemd-boot-tools and
# systemd-boot-efi, what 9.x's debian/control suggests instead).
KERNEL_HELPER = {"bookworm": "proxmox-kernel-helper-8.1.4", "trixie": "proxmox-kernel-helper-9.2.0"}
BOOT_PACKAGES = {"bookworm": ("dosfstools", "gdisk", "systemd-boot"),
                 "trixie": ("dosfstools", "gdisk", "systemd-boot-tools", "systemd-boot-efi")}
BOOT_LAYER_FORMAT = 1  # bump when the way the boot layer is built changes
UPSTREAM_SOURCES = REPO / "scripts" / "upstream-sources.tsv"


class TwinError(RuntimeError):
    """A twin could not be started, stopped or found."""


class TwinLeak(TwinError):
    """Something of a stopped twin is still there (mount or process)."""


@dataclasses.dataclass(frozen=True)
class Twin:
    """A running twin, as written to `.twin/<name>/twin.json`."""

    name: str
    profile: str
    address: str
    port: int
    key: str  # path of the private key for root@address
    pid: int  # host pid of the supervisor (init of the twin's pid namespace)
    root: str  # the twin's root as seen from the host

    @property
    def dir(self) -> Path:
        return TWINS_DIR / self.name


def log(msg: str) -> None:
    print(f"twin: {msg}", file=sys.stderr, flush=True)


def require_root() -> None:
    if os.geteuid() != 0:
        raise TwinError(
            "the digital twin needs root (overlayfs, namespaces, chroot, mknod); "
            "run as root, e.g. `sudo tests/twin/twinctl ...` (CI runs as root)"
        )
    for tool in ("unshare", "chroot", "ssh-keygen", "tar", "zstd"):
        if not shutil.which(tool):
            raise TwinError(f"the twin needs `{tool}` on this machine (make debs)")


# ---------------------------------------------------------------------------------------------
# Root cache


def extra_headers(suite: str | None = None) -> tuple[str, ...]:
    suite = suite or SUITE
    return SUITE_EXTRA_HEADERS.get(suite, EXTRA_HEADERS if suite == "bookworm" else ())


def _base_spec(suite: str) -> dict:
    spec: dict[str, Any] = {"suite": suite, "components": COMPONENTS, "packages": sorted(PACKAGES),
                            "format": CACHE_FORMAT}
    if extra_headers(suite):
        spec["extra_headers"] = list(extra_headers(suite))
    return spec


def base_key(suite: str | None = None) -> str:
    """Key of a suite's root without the boot layer (debootstrap + PACKAGES + extra headers)."""
    return hashlib.sha256(json.dumps(_base_spec(suite or SUITE), sort_keys=True).encode()).hexdigest()[:16]


def upstream_sha256(name: str) -> str:
    """The sha256 scripts/upstream-sources.tsv lists for source `name` (what identifies the tree)."""
    for line in UPSTREAM_SOURCES.read_text().splitlines():
        cols = line.split("\t")
        if cols[0] == name and not line.startswith("#"):
            return cols[2]
    raise TwinError(f"no source named {name!r} in {UPSTREAM_SOURCES}")


def boot_layer(suite: str) -> dict | None:
    """What the suite's boot layer is built from (None: the suite has none)."""
    if suite not in KERNEL_HELPER:
        return None
    return {"kernel_helper": KERNEL_HELPER[suite], "sha256": upstream_sha256(KERNEL_HELPER[suite]),
            "packages": sorted(BOOT_PACKAGES[suite]), "format": BOOT_LAYER_FORMAT}


def cache_key(suite: str | None = None) -> str:
    """Key of a suite's cached root (default SUITE): what the root is built from, nothing else
    (the base root's inputs, then the boot layer's: helper source sha256, packages, format)."""
    suite = suite or SUITE
    spec = _base_spec(suite)
    layer = boot_layer(suite)
    if layer is None:
        return base_key(suite)
    spec["boot_layer"] = layer
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def debian_mirrors() -> tuple[str, str]:
    """(archive, security) URIs from this machine's apt sources; Debian's defaults otherwise."""
    archive, security = "http://deb.debian.org/debian", "http://deb.debian.org/debian-security"
    texts = []
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        if path.is_file() and path.suffix in (".list", ".sources"):
            texts.append(path.read_text(errors="replace"))
    for uri in re.findall(r"(?:^URIs:\s*|^deb\s+(?:\[[^]]*\]\s+)?)(\S+)", "\n".join(texts), re.M):
        if uri.rstrip("/").endswith("debian-security"):
            security = uri.rstrip("/")
        elif uri.rstrip("/").endswith("/debian"):
            archive = uri.rstrip("/")
    return archive, security


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def _build_root(target: Path, suite: str) -> None:
    """debootstrap minbase of `suite` into `target`, then apt-get install PACKAGES inside it."""
    archive, security = debian_mirrors()
    _run(["debootstrap", "--variant=minbase", f"--components={','.join(COMPONENTS)}",
          suite, str(target), archive])
    (target / "etc/apt/sources.list").unlink(missing_ok=True)
    (target / "etc/apt/sources.list.d/debian.sources").write_text(
        f"Types: deb\nURIs: {archive}\nSuites: {suite} {suite}-updates\n"
        f"Components: {' '.join(COMPONENTS)}\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        f"Types: deb\nURIs: {security}\nSuites: {suite}-security\n"
        f"Components: {' '.join(COMPONENTS)}\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    # Package scripts must never start daemons in the twin (a second sshd on :22 of every
    # address would escape the twin's loopback address).
    policy = target / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\n# twin: no service starts from package scripts\nexit 101\n")
    policy.chmod(0o755)
    shutil.copy("/etc/resolv.conf", target / "etc/resolv.conf")  # only while building
    # EXTRA_HEADERS: the headers package a metapackage names, its -common and kbuild packages,
    # downloaded and unpacked (their file trees) with nothing registered in dpkg's database
    extra_suites = sorted({name.split("/", 1)[1] for name in extra_headers(suite) if "/" in name})
    extra_sources = "/etc/apt/sources.list.d/pvegpu-extra-headers.sources"
    (target / "tmp/pvegpu-extra-headers.sh").write_text(
        "set -e\ncd /tmp\n"
        + (f"printf 'Types: deb\\nURIs: {archive}\\nSuites: {' '.join(extra_suites)}\\n"
           f"Components: {' '.join(COMPONENTS)}\\n"
           f"Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\\n' > {extra_sources}\n"
           "apt-get -q update\n" if extra_suites else "")
        + f"for meta in {' '.join(extra_headers(suite))}; do\n"
        "  h=$(apt-cache depends \"$meta\" | sed -n 's/^ *Depends: \\(linux-headers-.*\\)$/\\1/p' | head -n 1)\n"
        "  [ -n \"$h\" ] || { echo \"twin: $meta names no headers package\" >&2; exit 1; }\n"
        "  deps=$(apt-cache depends \"$h\" | sed -n 's/^ *Depends: \\(linux-headers-.*-common\\|linux-kbuild-.*\\)$/\\1/p')\n"
        "  apt-get -q download \"$h\" $deps\n"
        "done\n"
        # through tar --keep-directory-symlink: the packages' ./lib/ must not replace merged /usr's /lib link
        "for d in /tmp/*.deb; do dpkg-deb --fsys-tarfile \"$d\" | tar -C / --keep-directory-symlink -xf -; done\n"
        "rm -f /tmp/*.deb\n"
        # the extra suite leaves the root's sources and apt's lists as it came
        + (f"rm -f {extra_sources}\n"
           + "".join(f"rm -f /var/lib/apt/lists/*_dists_{s}_*\n" for s in extra_suites) if extra_suites else ""))
    script = (
        "set -e\n"
        f"mount -t proc proc {target}/proc\n"
        f"mount --rbind /dev {target}/dev\n"
        f"mount -t sysfs sysfs {target}/sys\n"
        f"chroot {target} /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "
        "DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 sh -c '"
        "apt-get -q update && "
        f"apt-get -q install -y --no-install-recommends {' '.join(PACKAGES)} && "
        f"{'sh /tmp/pvegpu-extra-headers.sh && ' if extra_headers(suite) else ''}rm -f /tmp/pvegpu-extra-headers.sh && "
        "apt-get clean'\n"
    )
    # Own mount+pid namespace: the build's mounts and any stray process die with it.
    _run(["unshare", "--mount", "--pid", "--fork", "--propagation", "private",
          "sh", "-c", script])
    (target / "etc/resolv.conf").write_text("# twin: no network inside the twin\n")
    for key_type in ("ed25519", "rsa", "ecdsa"):  # host keys: generated once, in the cache
        if not (target / f"etc/ssh/ssh_host_{key_type}_key").exists():
            raise TwinError(f"cache build: openssh-server did not generate {key_type} host key")
    (target / "run/sshd").mkdir(parents=True, exist_ok=True)


def _build_boot_layer(target: Path, suite: str) -> None:
    """The boot layer (KERNEL_HELPER, BOOT_PACKAGES) into the root `target`: the packages with apt,
    then proxmox-kernel-helper's .deb built from its source tree (fetched by URL + sha256:
    scripts/fetch-upstream.sh) as its Makefile does, and installed with dpkg (its preinst,
    postinst and triggers run)."""
    name = KERNEL_HELPER[suite]
    archive = subprocess.run([str(REPO / "scripts/fetch-upstream.sh"), name], check=True,
                             stdout=subprocess.PIPE, text=True).stdout.strip()
    shutil.copyfile(archive, target / "tmp/pvegpu-kernel-helper.tar.xz")
    (target / "tmp/pvegpu-boot-layer.sh").write_text(
        "set -e\n"
        f"apt-get -q update\napt-get -q install -y --no-install-recommends {' '.join(BOOT_PACKAGES[suite])}\n"
        "mkdir /tmp/pvegpu-kh && tar -C /tmp/pvegpu-kh -xJf /tmp/pvegpu-kernel-helper.tar.xz\n"
        f"cd /tmp/pvegpu-kh/{name}\n"
        # proxmox-kernel-helper Makefile: $(BUILDDIR) is src/ with debian/ copied in, $(DEB) runs
        # dpkg-buildpackage -b -uc -us there (then lintian, a check only: not installed here, so -d)
        "cp -a src build && cp -a debian build/\n"
        "cd build && dpkg-buildpackage -b -uc -us -d\n"
        "dpkg -i ../proxmox-kernel-helper_*_all.deb\n"
        "cd / && rm -rf /tmp/pvegpu-kh /tmp/pvegpu-kernel-helper.tar.xz && apt-get clean\n")
    shutil.copy("/etc/resolv.conf", target / "etc/resolv.conf")  # only while building
    script = (
        "set -e\n"
        f"mount -t proc proc {target}/proc\n"
        f"mount --rbind /dev {target}/dev\n"
        f"mount -t sysfs sysfs {target}/sys\n"
        f"chroot {target} /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "
        "DEBIAN_FRONTEND=noninteractive LC_ALL=C.UTF-8 sh /tmp/pvegpu-boot-layer.sh\n"
    )
    try:
        _run(["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "sh", "-c", script])
    finally:
        (target / "tmp/pvegpu-boot-layer.sh").unlink(missing_ok=True)
        (target / "etc/resolv.conf").write_text("# twin: no network inside the twin\n")
    if not (target / "usr/sbin/proxmox-boot-tool").exists():
        raise TwinError(f"cache build: {name} did not install proxmox-boot-tool")


def ensure_root_cache(suite: str | None = None) -> Path:
    """Return the unpacked cached root of `suite` (default SUITE; the overlay lowerdir),
    building or unpacking it if needed.

    Cold: debootstrap + apt (minutes, network to the Debian mirror). Warm tarball only: unpack.
    """
    require_root()
    suite = suite or SUITE
    if suite not in SUITES:
        raise TwinError(f"no twin root for Debian suite {suite!r} (known: {', '.join(SUITES)})")
    key = cache_key(suite)
    lower = CACHE_DIR / f"root-{key}"
    tarball = CACHE_DIR / f"root-{key}.tar.zst"
    if (lower / ".twin-complete").exists():
        return lower
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    # one lock per root: a concurrent start of the same root waits for its one build, while another
    # suite's root builds beside it (scripts/run-tests.sh builds bookworm's and trixie's at once)
    with open(CACHE_DIR / f"build-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (lower / ".twin-complete").exists():
            return lower
        building = CACHE_DIR / f"root-{key}.building"
        _remove_tree(building)
        building.mkdir()
        t0 = time.monotonic()
        base_tarball = CACHE_DIR / f"root-{base_key(suite)}.tar.zst"
        if tarball.exists():
            log(f"unpacking cached root {tarball.name}")
            _run(["tar", "-C", str(building), "--numeric-owner", "--xattrs", "-I", "zstd -T0",
                  "-xpf", str(tarball)])
        else:
            if base_tarball != tarball and base_tarball.exists():  # the base root cached: only the layer is new
                log(f"unpacking cached base root {base_tarball.name}")
                _run(["tar", "-C", str(building), "--numeric-owner", "--xattrs", "-I", "zstd -T0",
                      "-xpf", str(base_tarball)])
            else:
                if not shutil.which("debootstrap"):
                    raise TwinError("building the twin's root needs debootstrap (make debs)")
                log(f"building root cache {key} (debootstrap {suite} + {len(PACKAGES)} packages)")
                _build_root(building, suite)
            if boot_layer(suite) is not None:
                log(f"root cache {key}: boot layer ({KERNEL_HELPER[suite]} from source, {' '.join(BOOT_PACKAGES[suite])})")
                _build_boot_layer(building, suite)
            part = tarball.with_suffix(".part")
            _run(["tar", "-C", str(building), "--numeric-owner", "--xattrs", "-I", "zstd -T0 -3",
                  "-cpf", str(part), "."])
            part.rename(tarball)
        (building / ".twin-complete").write_text(f"{key}\n")
        _remove_tree(lower)
        building.rename(lower)
        log(f"root cache ready in {time.monotonic() - t0:.1f} s: {lower}")
    return lower


def _remove_tree(path: Path) -> None:
    if not path.exists():
        return
    if any(m.startswith(str(path) + "/") or m == str(path) for m in host_mounts()):
        raise TwinError(f"refusing to delete {path}: something is mounted below it")
    shutil.rmtree(path)


def host_mounts() -> list[str]:
    """Mount points of this process's mount namespace, in mount order."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4]
        points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point))
    return points


# ---------------------------------------------------------------------------------------------
# Mounting (ctypes: the supervisor mounts a dozen things per boot; no fork per mount)

_libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = (
    0x1, 0x2, 0x4, 0x8, 0x20, 0x1000, 0x4000)
MNT_DETACH = 0x2


def _mount(source: str, target: Path, fstype: str | None = None, flags: int = 0,
           data: str | None = None) -> None:
    rc = _libc.mount(source.encode(), str(target).encode(),
                     fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                     data.encode() if data else None)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target} ({fstype or 'bind'}): {os.strerror(err)}")


def _umount(target: str, flags: int = 0) -> None:
    if _libc.umount2(target.encode(), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def mounts_below(path: Path) -> list[str]:
    """Mount points strictly below `path` in this mount namespace, deepest (latest) first."""
    prefix = str(path).rstrip("/") + "/"
    return [m for m in reversed(host_mounts()) if m.startswith(prefix)]


def _unmount_tree(path: Path, including_self: bool = False) -> None:
    points = mounts_below(path)
    if including_self and str(path) in host_mounts():
        points.append(str(path))
    for point in points:
        # EBUSY right after a run (seen once under load: a dying sshd child still in the root)
        # clears within a couple of seconds: retry for up to ~8 s before calling it a leak
        for attempt in range(160):
            try:
                _umount(point)
                break
            except OSError as e:
                if e.errno == errno.EINVAL:  # already gone (covered mount went with its parent)
                    break
                if e.errno != errno.EBUSY or attempt == 159:
                    raise
                time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# Hardware hooks (tests.twin.hardware by default; a test may pass the path of a stand-in .py)


def load_hardware(spec: str) -> ModuleType:
    """Import the hardware module: a dotted module name or the path of a .py file."""
    if spec.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location("twin_hardware_standin", spec)
        assert module_spec is not None and module_spec.loader is not None, spec
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        return module
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return importlib.import_module(spec)


# ---------------------------------------------------------------------------------------------
# Processes


def _ns(pid: int, kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/{'ns/' + kind}")
    except OSError:
        return None


def _alive(pid: int, pid_ns: str | None = None) -> bool:
    """True when `pid` runs (not a zombie) and, given `pid_ns`, is still in that namespace."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        return False
    return pid_ns is None or _ns(pid, "pid") == pid_ns


def twin_processes(spec: dict) -> list[int]:
    """Host pids that belong to the twin: chrooted in its dir, or in its pid or mount namespace
    while its supervisor lives. Once the supervisor is gone the kernel frees the namespaces and
    may give their numbers to new ones (another twin's, a `pct exec`'s): a process that merely
    shares the number is not the twin's."""
    tdir = str(TWINS_DIR / spec["name"]) + "/"
    found = []
    ns_valid = bool(spec.get("pid")) and _alive(spec["pid"], spec.get("pid_ns"))
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        if ns_valid and spec.get("pid_ns") and _ns(pid, "pid") == spec["pid_ns"] and _alive(pid):
            found.append(pid)
        elif ns_valid and spec.get("mnt_ns") and _ns(pid, "mnt") == spec["mnt_ns"] and _alive(pid):
            found.append(pid)
        else:
            try:
                if (os.readlink(f"/proc/{pid}/root") + "/").startswith(tdir) and _alive(pid):
                    found.append(pid)
            except OSError:
                pass
    return found


def leftovers(name: str) -> dict:
    """What of twin `name` still exists: {"mounts": [mount points], "processes": [host pids]}."""
    tdir = TWINS_DIR / name
    spec_file = tdir / "twin.json"
    spec = json.loads(spec_file.read_text()) if spec_file.exists() else {"name": name}
    mounts = [m for m in host_mounts() if m == str(tdir) or m.startswith(str(tdir) + "/")]
    return {"mounts": mounts, "processes": twin_processes(spec)}


# ---------------------------------------------------------------------------------------------
# Starting and stopping (host side)

_spawned: dict[int, subprocess.Popen] = {}  # unshare processes this process started (to reap)


def _read_spec(name: str) -> dict | None:
    path = TWINS_DIR / name / "twin.json"
    return json.loads(path.read_text()) if path.exists() else None


def _write_spec(tdir: Path, spec: dict) -> None:
    tmp = tdir / "twin.json.tmp"
    tmp.write_text(json.dumps(spec, indent=2) + "\n")
    tmp.rename(tdir / "twin.json")


def running(name: str) -> bool:
    spec = _read_spec(name)
    return bool(spec and spec.get("pid") and _alive(spec["pid"], spec.get("pid_ns")))


def _in_use(spec: dict) -> bool:
    """Running, or being started by a live process (its address and name are taken)."""
    if spec.get("pid"):
        return _alive(spec["pid"], spec.get("pid_ns"))
    return bool(spec.get("starter")) and _alive(spec["starter"])


def status() -> list[dict]:
    """Every twin with a directory under .twin/: its twin.json plus {"running": bool}."""
    result = []
    for spec_file in sorted(TWINS_DIR.glob("*/twin.json")):
        spec = json.loads(spec_file.read_text())
        spec["running"] = running(spec["name"])
        result.append(spec)
    return result


# Machine-wide claims of twin addresses: the starter takes an flock on its address's file when it
# picks the address, hands that lock to the supervisor (an inherited descriptor), and the
# supervisor holds it for the twin's whole life, reboots included (sshd is down then and the port
# looks free); twins of other checkouts of the repository on this machine see the claim. Taken
# only by the supervisor, seconds after the pick (root install, keys), two checkouts starting
# twins at once picked the same address: each test's ssh met the other twin's sshd.
ADDRESS_CLAIMS = Path("/run/lock/pvegpu-twins")


def _claim_file(address: str) -> int:
    ADDRESS_CLAIMS.mkdir(parents=True, exist_ok=True)
    return os.open(ADDRESS_CLAIMS / address, os.O_RDWR | os.O_CREAT, 0o644)


def _take_claim(address: str) -> int | None:
    """An open descriptor holding the address's claim, or None when another process holds it."""
    fd = _claim_file(address)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _pick_address() -> tuple[str, int]:
    """The first free 127.0.0.N and the descriptor holding its claim (ADDRESS_CLAIMS)."""
    taken = {s["address"] for s in status() if _in_use(s)}
    for n in range(2, 255):
        address = f"127.0.0.{n}"
        if address in taken:
            continue
        claim = _take_claim(address)
        if claim is None:
            continue
        with socket.socket() as probe:  # something else (a stale sshd) may listen there
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as sshd does
            try:
                probe.bind((address, SSH_PORT))
            except OSError:
                os.close(claim)
                continue
        return address, claim
    raise TwinError("no free 127.0.0.N address for another twin")


def _wait_for_sshd(address: str, pid: int, log_file: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            raise TwinError(f"twin supervisor died during start; log:\n{_tail(log_file)}")
        try:
            with socket.create_connection((address, SSH_PORT), timeout=1) as conn:
                if conn.recv(64).startswith(b"SSH-2.0-"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TwinError(f"sshd of the twin did not answer on {address}:{SSH_PORT} within "
                    f"{timeout:.0f} s; log:\n{_tail(log_file)}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


SSHD_TWIN_CONFIG = """\
# Written by the twin runtime. First value wins in sshd_config, and this file is included
# before the rest, so these hold whatever the deploy does to /etc/ssh.
ListenAddress {address}:{port}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
PidFile /run/sshd.pid
"""


def _prepare_root(root: Path, name: str, address: str, key: Path) -> None:
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    authorized = ssh_dir / "authorized_keys"
    authorized.write_text(key.with_suffix(".pub").read_text())
    authorized.chmod(0o600)
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/sshd_config.d/00-twin.conf").write_text(
        SSHD_TWIN_CONFIG.format(address=address, port=SSH_PORT))
    (root / "etc/hostname").write_text(f"{name}\n")
    hosts = root / "etc/hosts"
    hosts.write_text(f"127.0.0.1\tlocalhost\n{address}\t{name}\n")
    (root / "var/lib/twin").mkdir(parents=True, exist_ok=True)


def start(name: str, profile: str, address: str | None = None,
          hardware: str = DEFAULT_HARDWARE, owner: int | None = None, live_sysfs: bool = False,
          cluster: str | None = None, upgraded_upper: Path | None = None,
          address_hold: int | None = None, saved_upper: Path | None = None) -> Twin:
    """Start twin `name` with hardware `profile`; returns once its sshd answers.

    `hardware` is the module providing install(root, profile) and render(root): a dotted
    name or a .py path (tests use stand-ins). `owner`: pid of a process whose death makes
    the twin stale (see stop_orphans). `live_sysfs`: /sys read-write with the kernel model
    (tests/twin/livesys.py) serving driver rebinds; False: /sys read-only (module docstring).
    `upgraded_upper`: the upper dir of a stopped twin, pruned by upgrade_in_place: it becomes this
    twin's upper over the new profile's root and the profile's packages are seeded over it
    (hardware.upgrade_install), not a fresh install. `address_hold`: an fd holding the claim of
    `address` (upgrade_in_place); else start takes the claim itself once the address is chosen.
    The supervisor inherits it (ADDRESS_CLAIMS). `saved_upper`: an upper dir saved by save_upper
    (a twin of the same name, profile and address, stopped): a copy of it becomes this twin's
    upper, nothing is installed (its files are in it): the same host again, booted from its disk.
    Raises TwinError; cleans up after itself.
    """
    require_root()
    if live_sysfs and not os.path.exists("/dev/fuse"):
        raise TwinError("a twin with live_sysfs serves its /sys rebind files through FUSE: "
                        "this machine has no /dev/fuse (modprobe fuse)")
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,30}", name):
        raise TwinError(f"twin name {name!r}: use 1-31 of a-z 0-9 -, starting alnum")
    if cluster is not None and not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,30}", cluster):
        raise TwinError(f"cluster name {cluster!r}: use 1-31 of a-z 0-9 -, starting alnum")
    if address is not None and not re.fullmatch(r"127\.0\.0\.(\d+)", address):
        raise TwinError(f"twin address {address!r}: must be 127.0.0.N (N >= 2)")
    if address is not None and not 2 <= int(address.rsplit(".", 1)[1]) <= 254:
        raise TwinError(f"twin address {address!r}: N must be 2..254 (127.0.0.1 is never used)")
    t0 = time.monotonic()
    # the profile's Debian suite (hardware.profile_suite; a test's hardware module without it: SUITE)
    suite = getattr(load_hardware(hardware), "profile_suite", lambda _p: SUITE)(profile)
    lower = ensure_root_cache(suite)
    t_cache = time.monotonic() - t0
    tdir = TWINS_DIR / name
    TWINS_DIR.mkdir(exist_ok=True)
    claim: int | None = None  # the address's claim until the supervisor holds it (ADDRESS_CLAIMS)
    with open(TWINS_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # address choice and twin.json are one step
        if _in_use(_read_spec(name) or {}):
            raise TwinError(f"twin {name} is already running (twinctl stop {name})")
        if tdir.exists():
            stop(name)  # stale leftovers of a crashed run
        if address is None:
            address, claim = _pick_address()
        elif any(_in_use(s) and s["address"] == address for s in status()):
            raise TwinError(f"{address} is in use by another twin")
        elif address_hold is not None:
            claim = address_hold  # upgrade_in_place kept it across its stop
        else:
            claim = _take_claim(address)
            if claim is None:  # its sshd would answer this twin's ssh
                raise TwinError(f"{address} is claimed by a twin of another checkout")
        root, key = tdir / "root", tdir / "id_ed25519"
        for sub in ("upper", "work", "root"):
            if sub == "upper" and upgraded_upper is not None:
                tdir.mkdir(parents=True, exist_ok=True)
                shutil.move(str(upgraded_upper), tdir / "upper")
            elif sub == "upper" and saved_upper is not None:
                tdir.mkdir(parents=True, exist_ok=True)
                _run(["cp", "-a", "--reflink=auto", str(saved_upper), str(tdir / "upper")])
            else:
                (tdir / sub).mkdir(parents=True)
        spec: dict[str, Any] = {"name": name, "profile": profile, "address": address, "port": SSH_PORT,
                "key": str(key), "pid": None, "root": str(root), "hardware": hardware,
                "lower": str(lower), "owner": owner, "starter": os.getpid(),
                "live_sysfs": bool(live_sysfs), "cluster": cluster}
        _write_spec(tdir, spec)
    try:
        _mount("overlay", root, "overlay", 0,
               f"lowerdir={lower},upperdir={tdir / 'upper'},workdir={tdir / 'work'}")
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@twin-{name}",
              "-f", str(key)])
        _prepare_root(root, name, address, key)
        set_pve_delay(root, os.environ.get("PVEGPU_TWIN_PVE_DELAY"))
        (tdir / "uptime").write_text("0.00 0.00".ljust(40) + "\n")
        if upgraded_upper is not None:
            load_hardware(hardware).upgrade_install(root, profile)
        elif saved_upper is not None:
            pass  # installed before it was saved
        elif cluster is None:
            load_hardware(hardware).install(root, profile)
        else:
            shared = cluster_pve(cluster)
            with open(TWINS_DIR / ".lock", "w") as lock:  # one seeding of the shared tree at a time
                fcntl.flock(lock, fcntl.LOCK_EX)
                for sub in ("nodes", "mapping", "priv/lock", "ha", "lxc", "qemu-server", "local"):
                    (shared / sub).mkdir(parents=True, exist_ok=True)
                (root / "etc/pve").mkdir(parents=True, exist_ok=True)
                load_hardware(hardware).install(root, profile, node=name, pve_dir=shared)
                write_vmlist(shared)
                write_members(cluster, also=name)
                join_ssh_trust(root, name, shared)
        log_file = tdir / "supervisor.log"
        with open(log_file, "ab") as out:
            proc = subprocess.Popen(
                ["unshare", "--mount", "--pid", "--uts", "--fork", "--propagation", "private",
                 "--kill-child=SIGKILL", sys.executable, "-m", "tests.twin.runtime",
                 "supervise", str(tdir)],
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO),
                               **({"PVEGPU_TWIN_CLAIM_FD": str(claim)} if claim is not None else {})},
                pass_fds=() if claim is None else (claim,), stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        _spawned[proc.pid] = proc
        spec["unshare_pid"] = proc.pid
        spec["pid"] = _child_of(proc)
        spec["pid_ns"], spec["mnt_ns"] = _ns(spec["pid"], "pid"), _ns(spec["pid"], "mnt")
        spec["started"] = time.time()
        _write_spec(tdir, spec)
        _wait_for_sshd(address, spec["pid"], log_file)
        # started once the supervisor has recorded the boot (it does so right after sshd answers): a
        # caller that reboots at once counts boots from there (a race seen under load)
        _wait_until(lambda: (tdir / "boots").exists(), 10)
    except BaseException:
        try:
            stop(name)
        except Exception as cleanup_error:  # report the first error, keep the second visible
            log(f"cleanup after failed start of {name} failed too: {cleanup_error}")
        raise
    finally:
        if claim is not None:
            os.close(claim)  # the supervisor holds the claim now (or the start failed: released)
    log(f"{name} ({profile}) up on {address}:{SSH_PORT} in {time.monotonic() - t0:.2f} s "
        f"(root cache {t_cache:.2f} s)")
    return Twin(name=name, profile=profile, address=address, port=SSH_PORT, key=str(key),
                pid=spec["pid"], root=str(root))


def _owned_paths(lower: Path) -> set[str]:
    """The paths dpkg's packages of root `lower` own (var/lib/dpkg/info/*.list), relative, under the
    merged /usr where the root links bin, sbin, lib, lib64 to it."""
    merged = {top: f"usr/{top}" for top in ("bin", "sbin", "lib", "lib64") if (lower / top).is_symlink()}
    owned = set()
    for listing in (lower / "var/lib/dpkg/info").glob("*.list"):
        for line in listing.read_text(errors="replace").splitlines():
            rel = line.strip().lstrip("/")
            if not rel:
                continue
            top, _, rest = rel.partition("/")
            owned.add(f"{merged[top]}/{rest}" if top in merged and rest else rel)
    return owned


def save_upper(name: str, dest: Path) -> None:
    """Stop twin `name` (as `stop` does: its processes killed, its mounts gone) and keep its upper
    dir (everything the twin wrote over the root cache) at `dest`, for start(saved_upper=dest)."""
    stop(name, keep=True)
    tdir = TWINS_DIR / name
    if dest.exists():
        _remove_tree(dest)
    shutil.move(str(tdir / "upper"), dest)
    shutil.rmtree(tdir)


def upgrade_in_place(name: str, profile: str) -> Twin:
    """Move a stopped-and-kept twin's state onto `profile`'s root as a distribution upgrade leaves a
    host (8 -> 9: Proxmox's "Upgrade from 8 to 9": sources moved to trixie, `apt dist-upgrade`, reboot).

    What the upgrade replaces goes: every file of the old root's dpkg packages (their trixie
    versions are in the new root: gcc-14, the libraries, dpkg's own database) except under /etc,
    where dpkg keeps a conffile the admin changed (its conffile prompt's default answer: keep yours).
    What no package owns stays as it was: /etc/pve, /etc/modprobe.d, /etc/kernel/cmdline,
    /var/lib/pvegpu, the NVIDIA modules built for 8's kernel under /lib/modules/<8 kernel> (8's
    kernel packages stay installed: dist-upgrade does not remove them), the driver's user space.
    Nothing is built for 9's kernel: its /lib/modules has what its package ships (the twin: none).
    Then the new profile's packages are seeded (hardware.upgrade_install) and the twin boots it,
    as the reboot the guide ends with."""
    require_root()
    spec = _read_spec(name)
    if not spec or not _in_use(spec):
        raise TwinError(f"twin {name} is not running: nothing to upgrade")
    if spec.get("cluster"):
        raise TwinError(f"twin {name} is a cluster node: upgrade_in_place moves single twins only")
    old_lower = Path(spec["lower"])
    # the address stays this twin's across the stop and the start: a twin another checkout starts
    # in between would otherwise find it free (its sshd would answer this twin's ssh)
    hold = _claim_file(spec["address"])
    stop(name, keep=True)
    try:
        fcntl.flock(hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(hold)
        raise TwinError(f"twin {name}: {spec['address']} was claimed by another twin while it stopped") from None
    tdir = TWINS_DIR / name
    kept = TWINS_DIR / f".{name}.upper-upgrading"
    _remove_tree(kept)
    shutil.move(str(tdir / "upper"), kept)
    shutil.rmtree(tdir)
    try:
        _prune_upgraded(kept, _owned_paths(old_lower))
    except BaseException:
        shutil.rmtree(kept, ignore_errors=True)
        os.close(hold)
        raise
    return start(name, profile, address=spec["address"], hardware=spec["hardware"],
                 owner=spec.get("owner"), live_sysfs=bool(spec.get("live_sysfs")), upgraded_upper=kept,
                 address_hold=hold)


def _prune_upgraded(kept: Path, owned: set[str]) -> None:
    """Drop from upper dir `kept` what the distribution upgrade replaces (upgrade_in_place)."""
    shutil.rmtree(kept / "var/lib/dpkg", ignore_errors=True)  # dpkg's database: the new root's, rewritten
    for dirpath, dirnames, filenames in os.walk(kept):
        rel_dir = os.path.relpath(dirpath, kept)
        if rel_dir == "etc" or rel_dir.startswith("etc/"):
            dirnames[:] = []
            continue
        for entry in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            rel = os.path.normpath(os.path.join(rel_dir, entry))
            if rel in owned:  # a file, symlink or whiteout over an old package's path
                os.unlink(os.path.join(dirpath, entry))


def set_pve_delay(root: Path | str, seconds: str | float | None) -> None:
    """Make the twin's Proxmox CLIs (pct, qm, pvesh, pveversion) wait `seconds` before they
    start, like the real Perl programs (0.3-0.6 s on a node); None or 0: no delay (default).
    PVEGPU_TWIN_PVE_DELAY at `start` sets it; the stand-ins read it at every call."""
    target = Path(root) / "var/lib/twin/pve-delay"
    if seconds is None or float(seconds) <= 0:
        target.unlink(missing_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"{float(seconds)}\n")


def set_fault(name: str, unbind_delay_s: float = 0.0, no_cluster_rejoin: bool = False,
              probe_fails: tuple[str, ...] = (), pve8to9_fails: tuple[str, ...] = ()) -> None:
    """Fault knobs of running twin `name`, read by its kernel model (tests/twin/livesys.py) at each
    write: `unbind_delay_s` makes every driver unbind take that long; read by its supervisor at each
    boot: `no_cluster_rejoin` keeps a cluster twin offline in its cluster after it booted (corosync
    does not come up); read by its kernel model at each boot (tests/twin/hardware.py compute):
    `probe_fails` (PCI addresses) makes the driver's probe of those devices fail; read by the
    pve8to9 stand-in (standins/proxmox.py): `pve8to9_fails`, FAIL lines it reports. 0/False/() turns
    a knob off."""
    root = Path(spec_of(name)["root"])
    faults: dict[str, Any] = {"unbind_delay_s": float(unbind_delay_s)} if unbind_delay_s else {}
    if no_cluster_rejoin:
        faults["no_cluster_rejoin"] = True
    if probe_fails:
        faults["probe_fails"] = list(probe_fails)
    if pve8to9_fails:
        faults["pve8to9_fails"] = list(pve8to9_fails)
    target = root / "var/lib/twin/faults.json"
    tmp = target.with_name("faults.json.tmp")
    tmp.write_text(json.dumps(faults) + "\n")
    tmp.rename(target)


def reset(name: str) -> None:
    """Press the reset button of running twin `name`: a reboot without asking the twin (whose
    kernel may hang with no sshd: tests/twin/hardware.py no-boot); the supervisor serves it
    like any reboot request."""
    spec = spec_of(name)
    (Path(spec["root"]) / REBOOT_REQUEST).write_text("reset button\n")


def reboot(name: str, timeout: float = 180.0) -> str:
    """Reboot running twin `name` as an operator does, `reboot` over SSH (the twin's reboot
    stand-in asks the supervisor), and wait until it has booted again (its .twin/<name>/boots
    grew) and, a cluster twin, is online in its cluster again (no .twin/<name>/offline: the
    supervisor's cluster_presence, corosync seeing the node come back). The boot's line."""
    boots, offline = twin_dir(name) / "boots", twin_dir(name) / "offline"
    before = len(_read_text(boots).splitlines())
    done = ssh_run(name, ["reboot"], retry_s=0)
    if done.returncode != 0:
        raise TwinError(f"twin {name}: reboot exited {done.returncode}: {done.stderr.strip()}")
    in_cluster = bool(spec_of(name).get("cluster"))
    if not _wait_until(lambda: len(_read_text(boots).splitlines()) > before
                       and not (in_cluster and offline.exists()), timeout):
        raise TwinError(f"twin {name} did not boot again {timeout:.0f} s after its reboot (log: "
                        f"{twin_dir(name) / 'supervisor.log'})")
    line = _read_text(boots).splitlines()[-1]
    if line.endswith(" hung"):
        raise TwinError(f"twin {name}: its boot hung (tests/twin/hardware.py no-boot; `reset` it)")
    return line


def kill_sshd(name: str) -> list[int]:
    """SIGKILL every sshd process of running twin `name` (the listener and every session: each
    SSH connection drops); its supervisor starts the listener again within ~1 s, as systemd
    restarts Debian's ssh.service (Restart=on-failure). Returns the host pids killed."""
    spec = spec_of(name)
    killed = []
    for pid in twin_processes(spec):
        if _read_text(Path(f"/proc/{pid}/comm")).strip() == "sshd":
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def count_pve_calls(root: Path | str, on: bool) -> list[str]:
    """Start (on=True: an empty log) or stop counting the twin's pct/qm/pvesh/pveversion calls; returns
    the calls logged so far (one line each: program and arguments)."""
    marker, log_file = Path(root) / "var/lib/twin/pve-count", Path(root) / "var/lib/twin/pve-calls.log"
    calls = log_file.read_text().splitlines() if log_file.exists() else []
    if on:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("")
        log_file.write_text("")
    else:
        marker.unlink(missing_ok=True)
        log_file.unlink(missing_ok=True)
    return calls


def _child_of(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """Host pid of the process `unshare --fork` forked (init of the new pid namespace)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        if proc.poll() is not None:
            raise TwinError(f"unshare exited with {proc.returncode} before starting the twin")
        time.sleep(0.01)
    raise TwinError("unshare did not fork the twin's supervisor")


def stop(name: str, keep: bool = False) -> None:
    """Stop twin `name` by PID, unmount its overlay, check nothing is left, delete its dir.

    Raises TwinLeak when a mount or process of the twin survives.
    """
    require_root()
    tdir = TWINS_DIR / name
    spec = _read_spec(name) or {"name": name}
    pid = spec.get("pid")
    if pid and _alive(pid, spec.get("pid_ns")):
        os.kill(pid, signal.SIGTERM)  # supervisor unmounts and kills the twin's processes
        if not _wait_until(lambda: not _alive(pid), 5.0):
            log(f"{name}: supervisor {pid} ignored SIGTERM; SIGKILL")
            os.kill(pid, signal.SIGKILL)  # the pid namespace dies with its init
    unshare_pid = spec.get("unshare_pid")
    if unshare_pid in _spawned:
        # unshare exits once its child's pid namespace is torn down, which takes long on a loaded
        # machine (CI: the builds lane compiling beside it); what must not survive is checked next
        # (twin_processes), so a slow unshare is waited for, then killed, never a failure of its own
        proc = _spawned.pop(unshare_pid)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log(f"{name}: unshare {unshare_pid} still waiting on its namespace after 30 s; SIGKILL")
            proc.kill()
            proc.wait(timeout=10)
    if not _wait_until(lambda: not twin_processes(spec), 5.0):
        for leftover in twin_processes(spec):
            os.kill(leftover, signal.SIGKILL)
        _wait_until(lambda: not twin_processes(spec), 5.0)
    if tdir.exists():
        _unmount_tree(tdir, including_self=True)
    left = leftovers(name)
    if left["mounts"] or left["processes"]:
        what = {pid: " ".join(_read_text(Path(f"/proc/{pid}/cmdline")).split("\0")).strip()
                + f" [{_read_text(Path(f'/proc/{pid}/wchan'))}]" for pid in left["processes"]}
        raise TwinLeak(f"twin {name} left {left} behind: {what}")
    if not keep and tdir.exists():
        shutil.rmtree(tdir)
    cluster = spec.get("cluster")
    if cluster:
        if tdir.exists():
            (tdir / "offline").touch()
        if any(_in_use(s) and s.get("cluster") == cluster for s in status() if s["name"] != name):
            write_members(cluster)
        elif not keep:
            shutil.rmtree(cluster_pve(cluster).parent, ignore_errors=True)


def join_ssh_trust(root: Path, node: str, shared: Path) -> None:
    """Root SSH trust between the nodes of a cluster twin, as `pvecm add` leaves it (pve-cluster
    src/PVE/Cluster/Setup.pm): root's own RSA key (setup_rootsshconfig), the shared
    /etc/pve/priv/authorized_keys holding every node's key and root's old authorized_keys
    (setup_ssh_keys, ssh_merge_keys) with /root/.ssh/authorized_keys a link to it, and the node's
    host key in /etc/pve/nodes/<node>/ssh_known_hosts (ssh_create_node_known_hosts), which
    PVE::SSHInfo's ssh options name. Only for the twin: root's ~/.ssh/config sends ssh to the twins'
    sshd port (SSH_PORT), where a real node's sshd listens on 22."""
    ssh_dir = root / "root/.ssh"
    key = ssh_dir / "id_rsa"
    if not key.exists():
        _run(["ssh-keygen", "-q", "-t", "rsa", "-b", "2048", "-N", "", "-C", f"root@{node}", "-f", str(key)])
    priv = shared / "priv"
    priv.mkdir(mode=0o700, exist_ok=True)
    cluster_keys = priv / "authorized_keys"
    old = (ssh_dir / "authorized_keys")
    lines = cluster_keys.read_text().splitlines() if cluster_keys.exists() else []
    if old.is_file() and not old.is_symlink():
        lines += old.read_text().splitlines()
    lines.append(key.with_suffix(".pub").read_text().strip())
    cluster_keys.write_text("".join(f"{line}\n" for line in dict.fromkeys(line for line in lines if line.strip())))
    cluster_keys.chmod(0o600)
    if old.exists() or old.is_symlink():
        old.unlink()
    old.symlink_to("/etc/pve/priv/authorized_keys")
    host_key = (root / "etc/ssh/ssh_host_rsa_key.pub").read_text().split()
    (shared / "nodes" / node).mkdir(parents=True, exist_ok=True)
    (shared / "nodes" / node / "ssh_known_hosts").write_text(f"{node} {host_key[0]} {host_key[1]}\n")
    (ssh_dir / "config").write_text(f"Port {SSH_PORT}\n")
    (ssh_dir / "config").chmod(0o640)


def cluster_pve(cluster: str) -> Path:
    """The shared /etc/pve of cluster `cluster` (module docstring, "Clusters")."""
    return TWINS_DIR / f".cluster-{cluster}" / "pve"


def write_vmlist(pve: Path) -> None:
    """<pve>/.vmlist from the guest configs under nodes/ (pmxcfs status.c: {"version", "ids":
    {vmid: {"node", "type", "version"}}})."""
    ids = {}
    for conf in sorted(pve.glob("nodes/*/*/*.conf")):
        kind = {"qemu-server": "qemu", "lxc": "lxc"}.get(conf.parent.name)
        if kind and conf.stem.isdigit():
            ids[conf.stem] = {"node": conf.parent.parent.name, "type": kind, "version": 1}
    (pve / ".vmlist").write_text(json.dumps({"version": 1, "ids": ids}, indent=1) + "\n")


def write_members(cluster: str, also: str | None = None) -> None:
    """Every running member twin's .twin/<name>/members (bind-mounted as its /etc/pve/.members),
    written in place; pmxcfs status.c's layout. The cluster's nodes are every twin that ever
    joined it (.twin/.cluster-C/nodes.json; corosync's nodelist is configuration, a node that is
    down stays in it, offline). `also`: a twin being started (joins; online already)."""
    registry = cluster_pve(cluster).parent / "nodes.json"
    nodes = json.loads(registry.read_text()) if registry.exists() else {}
    specs = {s["name"]: s for s in status() if s.get("cluster") == cluster}
    if also and also in specs:
        nodes.setdefault(also, specs[also]["address"])
        registry.write_text(json.dumps(nodes, indent=1) + "\n")
    # online: its twin runs and is not rebooting (the supervisor marks .twin/<name>/offline)
    online = {n: int(n == also or (n in specs and bool(specs[n].get("pid"))
                                   and not (TWINS_DIR / n / "offline").exists())) for n in nodes}
    nodelist = {n: {"id": i + 1, "online": online[n], "ip": nodes[n]} for i, n in enumerate(sorted(nodes))}
    quorate = int(sum(online.values()) * 2 > len(nodes))  # one vote each (votequorum's default)
    # the cluster's corosync.conf (pve-cluster writes it to /etc/pve at `pvecm add`; PVE/Corosync.pm
    # create_conf: secauth on, config_version counted up at each node's join by atomic_write_conf)
    (cluster_pve(cluster) / "corosync.conf").write_text(
        f"totem {{\n  cluster_name: {cluster}\n  config_version: {len(nodes)}\n  secauth: on\n  version: 2\n}}\n\nnodelist {{\n"
        + "".join(f"  node {{\n    name: {n}\n    nodeid: {i + 1}\n    quorum_votes: 1\n    ring0_addr: {nodes[n]}\n  }}\n"
                  for i, n in enumerate(sorted(nodes)))
        + "}\n\nquorum {\n  provider: corosync_votequorum\n}\n")
    for name in sorted(nodes):
        target = TWINS_DIR / name / "members"
        if name not in specs or not target.parent.exists():
            continue
        text = json.dumps({"nodename": name, "version": len(nodes),
                           "cluster": {"name": cluster, "version": 1, "nodes": len(nodes), "quorate": quorate},
                           "nodelist": nodelist}, indent=1) + "\n"
        with open(target, "a+") as f:  # in place: the twin's bind mount keeps this inode
            f.seek(0)
            f.truncate()
            f.write(text)


def stop_orphans() -> list[str]:
    """Stop twins whose owner process is gone (a test run that was killed); their names."""
    stopped = []
    for spec in status():
        if spec.get("owner") and not _alive(spec["owner"]):
            stop(spec["name"])
            stopped.append(spec["name"])
    return stopped


def _wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def spec_of(name: str) -> dict:
    spec = _read_spec(name)
    if not spec or not running(name):
        raise TwinError(f"twin {name} is not running (twinctl status)")
    return spec


_SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]


def ssh_run(name: str, command: list[str], timeout: float = 120, retry_s: float = 20,
            pause_s: float = 0.5) -> subprocess.CompletedProcess:
    """`command` on twin `name` over SSH, captured; ssh's own failure (exit 255: sshd not yet up
    after a reboot or a restart) is retried for `retry_s` seconds."""
    deadline = time.monotonic() + retry_s
    while True:
        done = subprocess.run(ssh_command(name, command), capture_output=True, text=True, timeout=timeout)
        if done.returncode != 255 or time.monotonic() > deadline:
            return done
        time.sleep(pause_s)


def ssh_command(name: str, command: list[str]) -> list[str]:
    """The ssh command line that runs `command` as root in running twin `name`."""
    spec = spec_of(name)
    return ["ssh", "-i", spec["key"], "-p", str(spec["port"]), *_SSH_OPTIONS,
            f"root@{spec['address']}", *command]


def scp_command(name: str, source: str, dest: str) -> list[str]:
    """The scp command line that copies local file `source` to `dest` in running twin `name`."""
    spec = spec_of(name)
    return ["scp", "-q", "-i", spec["key"], "-P", str(spec["port"]), *_SSH_OPTIONS,
            source, f"root@{spec['address']}:{dest}"]


def twin_dir(name: str) -> Path:
    """.twin/<name>: logs, key, twin.json, and ct/<id>/upper (a container's own files)."""
    return TWINS_DIR / name


# ---------------------------------------------------------------------------------------------
# Supervisor (runs as pid 1 of the twin's namespaces)

REBOOT_REQUEST = "var/lib/twin/reboot-request"
STANDIN_SERVER = "usr/local/lib/twin/standind.py"  # tests/twin/standins/standind.py
STANDIN_SOCKET = "run/twin/standins.sock"
BOOT_JOBS = "run/twin/boot-jobs"  # tests/twin/standins/boot.py BOOT_JOBS: the boot's jobs still run


class Supervisor:
    """Boots the twin (mounts + sshd), serves reboot requests, shuts down on SIGTERM."""

    def __init__(self, tdir: Path):
        self.dir = tdir
        self.spec = json.loads((tdir / "twin.json").read_text())
        self.root = Path(self.spec["root"])
        self.sshd: int | None = None
        self.standins: int | None = None
        # the boot's onboot starts (pve-guests.service) while they run; the Popen is kept so that
        # subprocess never waits for it itself (reap() must see it end)
        self.guests: subprocess.Popen | None = None
        self.kernel: livesys.KernelModel | None = None  # the model of this boot (live_sysfs twins)
        self.standin_restarts = 0
        self.boot_time = 0.0
        self.boots = 0
        self.hung = False  # the last boot's kernel hung (no sshd until a reset)
        self.stopping = False

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        # held (never closed) until this process ends: the starter's, inherited, else taken now
        inherited = os.environ.pop("PVEGPU_TWIN_CLAIM_FD", None)
        claim = int(inherited) if inherited else _claim_file(self.spec["address"])
        try:
            fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{self.spec['name']}: {self.spec['address']} is claimed by a twin of another checkout")
        self.boot()
        uptime_fd = os.open(self.dir / "uptime", os.O_WRONLY)
        while not self.stopping:
            self.reap()
            # written in place at a fixed length (padded after the numbers): a reader never
            # sees an empty or half-written file
            up = time.monotonic() - self.boot_time
            os.pwrite(uptime_fd, f"{up:.2f} {up * 2:.2f}".ljust(40).encode() + b"\n", 0)
            if (self.root / REBOOT_REQUEST).exists():
                self.reboot()
            elif self.sshd is None and not self.hung:
                log(f"{self.spec['name']}: sshd exited; starting it again")
                time.sleep(0.5)
                self.start_sshd()
            elif self.standins is None and not self.hung and self.standin_restarts < 3 and (self.root / STANDIN_SERVER).exists():
                self.standin_restarts += 1  # the stand-ins run their own Python meanwhile (client.c)
                log(f"{self.spec['name']}: stand-in server exited; starting it again")
                self.start_standins()
            time.sleep(0.1)
        self.kill_all()
        self.unmount_all()
        log(f"{self.spec['name']}: shut down")

    def _request_stop(self, *_):
        self.stopping = True

    def boot(self) -> None:
        # like a real boot, the hostname comes from the root's /etc/hostname
        hostname = _read_text(self.root / "etc/hostname").strip() or self.spec["name"]
        socket.sethostname(hostname)
        self.mount_all()
        self.boot_time = time.monotonic()
        hardware = load_hardware(self.spec["hardware"])
        self.hung = bool(getattr(hardware, "hung", lambda root: False)(self.root))
        if self.hung:  # the kernel never reached user space: no sshd until a reset (reset(name))
            self.boots += 1
            with open(self.dir / "boots", "a") as boots:
                boots.write(f"{time.time():.3f} {self.boots} hung\n")
            log(f"{self.spec['name']}: boot {self.boots} hung (tests/twin/hardware.py no-boot); waiting for a reset")
            return
        if (self.root / STANDIN_SERVER).exists():
            self.start_standins()
        self.run_boot_units(hardware)
        booting = self.start_guests()
        self.start_sshd()
        self.wait_for_sshd()  # the twin's boot counts as done when the host answers on SSH
        if booting:  # its guests start now, sshd answering meanwhile, as on a real node
            self.guests = subprocess.Popen(booting, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
                                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.boots += 1
        with open(self.dir / "boots", "a") as boots:
            boots.write(f"{time.time():.3f} {self.boots}\n")
        self.cluster_presence(True)
        log(f"{self.spec['name']}: boot {self.boots} done")

    def cluster_presence(self, online: bool) -> None:
        """A cluster twin leaves its cluster while it reboots and is back once booted (the other
        nodes' .members say so: corosync sees the node go and come)."""
        cluster = self.spec.get("cluster")
        if not cluster:
            return
        marker = self.dir / "offline"
        faults = _read_text(self.root / "var/lib/twin/faults.json")
        if online and faults and json.loads(faults).get("no_cluster_rejoin"):
            log(f"{self.spec['name']}: fault no_cluster_rejoin: stays offline in cluster {cluster}")
            return
        if online:
            marker.unlink(missing_ok=True)
        else:
            marker.touch()
        write_members(cluster, also=self.spec["name"] if online else None)

    def reboot(self) -> None:
        log(f"{self.spec['name']}: reboot requested")
        t0 = time.monotonic()
        self.cluster_presence(False)
        self.kill_all()
        self.unmount_all()
        t1 = time.monotonic()
        try:
            load_hardware(self.spec["hardware"]).render(self.root)
        except Exception:  # keep the twin reachable; the log says why hardware is stale
            log(f"{self.spec['name']}: render failed:\n{traceback.format_exc()}")
        t2 = time.monotonic()
        self.boot()
        (self.root / REBOOT_REQUEST).unlink(missing_ok=True)
        with open(self.dir / "reboots", "a") as reboots:  # "<requested> <booted>" (unix times) per reboot
            reboots.write(f"{time.time() - (time.monotonic() - t0):.3f} {time.time():.3f}\n")
        log(f"{self.spec['name']}: rebooted in {time.monotonic() - t0:.2f} s (shutdown "
            f"{t1 - t0:.2f} s, render {t2 - t1:.2f} s)")

    def start_guests(self) -> list[str] | None:
        """The command that starts the guests whose config says `onboot: 1` (tests/twin/standins/
        proxmox.py onboot, as pve-guests.service), after the node's `startall-onboot-delay`
        (/etc/pve/nodes/<node>/config: pve-manager bin/pve-startall-delay, the unit's ExecStartPre),
        each start followed by its `startup: up=` delay (3 s for a VM without one); the others stay
        stopped. boot() runs it in the background once sshd answers, in the twin's PID namespace like
        every process of this boot: as on a real node, where nothing orders sshd after
        pve-guests.service, a client can log in while guests are not started yet, and `systemctl
        is-system-running` says "starting" until the node delay, the last start and its delay are
        done (the BOOT_JOBS marker, removed when reap() collects it). None: not a Proxmox twin."""
        if not (self.root / "usr/local/lib/twin/proxmox.py").exists():
            return None
        (self.root / BOOT_JOBS).parent.mkdir(parents=True, exist_ok=True)
        (self.root / BOOT_JOBS).write_text("pve-guests.service\n")  # before sshd: no login sees it done early
        return ["chroot", str(self.root), "/usr/bin/python3", "-ISB", "-c",
                "import sys; sys.path.insert(0, '/usr/local/lib/twin'); import proxmox; proxmox.onboot()"]

    def start_sshd(self) -> None:
        proc = subprocess.Popen(
            ["chroot", str(self.root), "/usr/sbin/sshd", "-D", "-e"],
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL)
        self.sshd = proc.pid  # reaped by reap(), not by Popen

    def start_standins(self) -> None:
        """The stand-in server (tests/twin/standins/standind.py); up once its socket exists
        (until then, or if it never comes, the stand-ins run their Python themselves)."""
        socket_path = self.root / STANDIN_SOCKET
        proc = subprocess.Popen(
            ["chroot", str(self.root), "/usr/bin/python3", "-ISB", "/" + STANDIN_SERVER],
            env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self.standins = proc.pid  # reaped by reap(), not by Popen
        deadline = time.monotonic() + 5
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    def wait_for_sshd(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                socket.create_connection((self.spec["address"], self.spec["port"]), 1).close()
                return
            except OSError:
                time.sleep(0.02)
        log(f"{self.spec['name']}: sshd not listening after {timeout:.0f} s")

    def reap(self) -> None:
        """As pid 1, collect every exited process (orphans are reparented here)."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.sshd:
                self.sshd = None
            if pid == self.standins:
                self.standins = None
            if self.guests is not None and pid == self.guests.pid:  # the boot's jobs are done: `systemctl is-system-running` says running
                self.guests = None
                (self.root / BOOT_JOBS).unlink(missing_ok=True)
                log(f"{self.spec['name']}: onboot guests started")

    def kill_all(self) -> None:
        """SIGKILL every process of the twin but this one; wait until all are reaped."""
        if self.kernel is not None:
            self.kernel.close()  # a write still in the model (slow unbind) ends, changing nothing
            self.kernel = None
        proc_dir = self.root / "proc"  # the namespace's own procfs
        deadline = time.monotonic() + 10
        while True:
            pids = [int(p) for p in os.listdir(proc_dir) if p.isdigit() and p != "1"]
            if not pids:
                break
            if time.monotonic() > deadline:
                raise TwinError(f"processes {pids} of the twin would not die")
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
            self.reap()
        self.sshd = None
        self.standins = None
        self.guests = None

    def mount_all(self) -> None:
        root, hw = self.root, self.root / "var/lib/twin/hw"
        _mount("proc", root / "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if (hw / "proc").is_dir():
            for entry in sorted((hw / "proc").iterdir()):
                if entry.name == "uptime":
                    continue  # the runtime's own, live file (below)
                target = root / "proc" / entry.name
                if target.exists() and target.is_dir() == entry.is_dir():
                    _mount(str(entry), target, flags=MS_BIND | MS_REC)
                else:
                    log(f"hw/proc/{entry.name}: no such {'dir' if entry.is_dir() else 'file'} "
                        "in procfs to cover; skipped")
        _mount(str(self.dir / "uptime"), root / "proc/uptime", flags=MS_BIND)
        if (hw / "sys").is_dir():
            _mount(str(hw / "sys"), root / "sys", flags=MS_BIND | MS_REC)
            if not self.spec.get("live_sysfs"):
                # read-only, as in a container: the product reads "ro" for /sys in mountinfo and
                # knows it cannot rebind now
                for point in [str(root / "sys"), *reversed(mounts_below(root / "sys"))]:
                    _mount("none", Path(point), flags=MS_BIND | MS_REMOUNT | MS_RDONLY)
        else:  # never show the machine's real sysfs in the twin
            log("no rendered hw/sys; /sys is an empty tmpfs")
            _mount("sysfs", root / "sys", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=755")
        nvram, efivars = root / "var/lib/twin/efivars", root / "sys/firmware/efi/efivars"
        if nvram.is_dir() and efivars.is_dir():
            # the NVRAM model (tests/twin/hardware.py EFIVARS), read-write as efivarfs is
            _mount(str(nvram), efivars, flags=MS_BIND)
        self.mount_dev(hw / "dev.json")
        self.esp_devices(hw / "esp-devices")
        _mount("run", root / "run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=64m")
        for sub in ("sshd", "lock"):
            (root / "run" / sub).mkdir(mode=0o755, exist_ok=True)
        self.mount_containers()
        self.mount_cluster()
        if self.spec.get("live_sysfs") and (hw / "sys").is_dir():
            from tests.twin import livesys

            self.kernel = livesys.serve(root, log)

    def mount_cluster(self) -> None:
        """A cluster twin's /etc/pve: the shared tree, then its node-local views (module docstring)."""
        cluster = self.spec.get("cluster")
        if not cluster:
            return
        shared, pve, node = cluster_pve(cluster), self.root / "etc/pve", self.spec["name"]
        _mount(str(shared), pve, flags=MS_BIND)
        for view, source in (("lxc", f"nodes/{node}/lxc"), ("qemu-server", f"nodes/{node}/qemu-server"),
                             ("local", f"nodes/{node}")):
            _mount(str(shared / source), pve / view, flags=MS_BIND)
        members = self.dir / "members"
        if not members.exists():
            members.write_text("{}\n")
        (pve / ".members").touch()
        _mount(str(members), pve / ".members", flags=MS_BIND)

    def mount_containers(self) -> None:
        """CT files (host fs, rw) and the pristine root every CT overlays (ro); module docstring."""
        ct, base = self.root / "var/lib/twin/ct", self.root / "var/lib/twin/ctbase"
        (self.dir / "ct").mkdir(exist_ok=True)
        for point in (ct, base):
            point.mkdir(parents=True, exist_ok=True)
        _mount(str(self.dir / "ct"), ct, flags=MS_BIND)
        _mount(self.spec["lower"], base, flags=MS_BIND)
        _mount("none", base, flags=MS_BIND | MS_REMOUNT | MS_RDONLY)

    def mount_dev(self, dev_json: Path) -> None:
        dev = self.root / "dev"
        _mount("dev", dev, "tmpfs", MS_NOSUID, "mode=755,size=16m")
        basics = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8),
                  "urandom": (1, 9), "tty": (5, 0)}
        for node, (major, minor) in basics.items():
            os.mknod(dev / node, 0o666 | 0o020000, os.makedev(major, minor))
            os.chmod(dev / node, 0o666)
        (dev / "pts").mkdir()
        _mount("devpts", dev / "pts", "devpts", MS_NOSUID | MS_NOEXEC,
               "newinstance,ptmxmode=0666,mode=620,gid=5")
        os.symlink("pts/ptmx", dev / "ptmx")
        (dev / "shm").mkdir()
        _mount("shm", dev / "shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
        for fd, link in enumerate(("stdin", "stdout", "stderr")):
            os.symlink(f"/proc/self/fd/{fd}", dev / link)
        os.symlink("/proc/self/fd", dev / "fd")
        nodes = json.loads(dev_json.read_text()) if dev_json.exists() else []
        for node in nodes:
            path = Path(node["path"])
            if path.parts[:2] != ("/", "dev") or ".." in path.parts:
                raise TwinError(f"hw/dev.json: {path} is not below /dev")
            target = self.root / path.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            mode = node.get("mode", 0o666)  # an int, or an octal string like "0660"
            mode = int(mode, 8) if isinstance(mode, str) else mode
            os.mknod(target, mode | 0o020000, os.makedev(node["major"], node["minor"]))
            os.chmod(target, mode)

    def esp_devices(self, table: Path) -> None:
        """The ESP partitions of this boot (hw/esp-devices: tests/twin/hardware.py esp_devices):
        a block node /dev/<name> each and the link udev makes, /dev/disk/by-uuid/<uuid>. Only the
        node's type and number are real: the stand-ins (tests/twin/standins/esp.sh) answer for it,
        nothing opens it."""
        dev = self.root / "dev"
        for line in _read_text(table).splitlines():
            name, uuid, _disk, _size = line.split()
            major, minor = 8, 16 * (ord(name[2]) - ord("a")) + int(name[3:])
            os.mknod(dev / name, 0o660 | 0o060000, os.makedev(major, minor))
            (dev / "disk/by-uuid").mkdir(parents=True, exist_ok=True)
            os.symlink(f"../../{name}", dev / "disk/by-uuid" / uuid)

    def run_boot_units(self, hardware: ModuleType) -> None:
        """The hardware module's boot units (tests/twin/hardware.py boot_units), in the root, in
        order; within a unit each command after the one before succeeded; their output goes to the log."""
        for unit in getattr(hardware, "boot_units", lambda root: [])(self.root):
            for argv in unit:
                done = subprocess.run(["chroot", str(self.root), *argv], stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                           "LANG": "C.UTF-8"})
                log(f"{self.spec['name']}: boot unit {' '.join(argv)}: exit {done.returncode}\n{done.stdout.rstrip()}")
                if done.returncode != 0:
                    break

    def unmount_all(self) -> None:
        _unmount_tree(self.root)


# ---------------------------------------------------------------------------------------------
# Command line (tests/twin/twinctl runs this)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="twinctl", description="Digital twins of GPU hosts.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("start", help="start a twin")
    p.add_argument("name")
    p.add_argument("--profile", required=True)
    p.add_argument("--address", help="127.0.0.N, N >= 2 (default: the first free one)")
    p.add_argument("--hardware", default=DEFAULT_HARDWARE, help=argparse.SUPPRESS)
    p.add_argument("--live-sysfs", action="store_true",
                   help="/sys read-write, driver rebinds served by the twin's kernel model")
    p.add_argument("--cluster", help="share /etc/pve with the other twins of this cluster")
    p = sub.add_parser("fault", help="set a fault knob of a running twin")
    p.add_argument("name")
    p.add_argument("--unbind-delay", type=float, default=0.0, metavar="S",
                   help="each driver unbind takes S seconds (0: off)")
    p.add_argument("--no-cluster-rejoin", action="store_true",
                   help="a cluster twin stays offline in its cluster after its next boots")
    p.add_argument("--probe-fails", action="append", default=[], metavar="BDF",
                   help="the driver's probe of this PCI device fails at the next boots (repeatable)")
    p = sub.add_parser("reboot", help="reboot a twin (`reboot` on it) and wait until it is booted and back in its cluster")
    p.add_argument("name")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the boot (default 180)")
    p = sub.add_parser("kill-sshd", help="SIGKILL every sshd of a twin (it starts again in ~1 s)")
    p.add_argument("name")
    p = sub.add_parser("stop", help="stop a twin and remove its files")
    p.add_argument("name")
    p.add_argument("--keep", action="store_true", help="keep .twin/<name> (upper dir, logs)")
    sub.add_parser("status", help="list twins")
    p = sub.add_parser("cache", help="build or unpack the cached root of a Debian suite")
    p.add_argument("--suite", choices=SUITES, default=SUITE)
    p = sub.add_parser("busy", help="mark a GPU of a twin as held by a process")
    p.add_argument("name")
    p.add_argument("bdf")
    p.add_argument("--holder", default="nvidia-persistenced")
    p = sub.add_parser("ssh", help="run a command in a twin as root (twinctl ssh NAME -- CMD)")
    p.add_argument("name")
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    p = sub.add_parser("supervise", help=argparse.SUPPRESS)
    p.add_argument("dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "supervise":
            Supervisor(Path(args.dir)).run()
        elif args.command == "start":
            twin = start(args.name, args.profile, args.address, args.hardware, live_sysfs=args.live_sysfs,
                         cluster=args.cluster)
            print(json.dumps(dataclasses.asdict(twin)))
        elif args.command == "stop":
            stop(args.name, keep=args.keep)
        elif args.command == "status":
            for spec in status():
                state = "running" if spec["running"] else "stopped"
                print(f"{spec['name']}\t{spec['profile']}\t{spec['address']}:{spec['port']}"
                      f"\t{state}\tpid={spec['pid']}")
        elif args.command == "fault":
            set_fault(args.name, unbind_delay_s=args.unbind_delay, no_cluster_rejoin=args.no_cluster_rejoin,
                      probe_fails=tuple(args.probe_fails))
        elif args.command == "reboot":
            reboot(args.name, args.timeout)
            print(f"{args.name}: rebooted")
        elif args.command == "kill-sshd":
            print(" ".join(map(str, kill_sshd(args.name))))
        elif args.command == "cache":
            print(ensure_root_cache(args.suite))
        elif args.command == "busy":
            spec = spec_of(args.name)
            load_hardware(spec["hardware"]).mark_busy(Path(spec["root"]), args.bdf, args.holder)
        elif args.command == "ssh":
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            os.execvp("ssh", ssh_command(args.name, cmd))
    except TwinError as e:
        print(f"twinctl: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
