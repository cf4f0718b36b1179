"""Which Proxmox VE major (Debian release) a kernel, a host and a spec belong to (pure).

A Proxmox VE major is one Debian release: 8 is bookworm (GCC 12), 9 is trixie (GCC 14). A kernel
built from a pve-kernel branch of one release is compiled by that release's GCC and packaged
against its user space; built on a host of the other release it gets the wrong compiler (the
NVIDIA stage then builds modules with a GCC the kernel was not built with) and the wrong
dependencies. So the spec's kernel, its `proxmox_ve` and the host's release must agree:

    kernel_pve_major("6.14.11-9-bpo12-pvegpu-pve") -> 8
    kernel_pve_major("7.0.14-14-pvegpu-pve") -> 9
    host_pve_major({"codename": "bookworm"}, {"major": 8}) -> 8
    host_release_refusals(spec, os_release, pve) -> ["kernel.version … is a Proxmox VE 9 kernel, …"]
"""

from __future__ import annotations

import re

PVE_CODENAME = {8: "bookworm", 9: "trixie"}
CODENAME_PVE = {name: major for major, name in PVE_CODENAME.items()}
# The GCC of each release (what Proxmox built that release's kernels with: their
# CONFIG_CC_VERSION_TEXT; Debian bookworm's gcc is 12.2.0, trixie's 14.2.0)
PVE_GCC = {8: "12", 9: "14"}
# pve-kernel debian/changelog of branch bookworm-6.14: 6.14.0-1, 6.14.0-2 and 6.14.4-1 were built for
# bookworm with KREL_EXTRA empty; commit 6a8fa6f ("bump version to 6.14.5-1~bpo12+1") set
# KREL_EXTRA=-bpo12 in its Makefile, so every later bookworm build is named …-bpo12-pve. Branch
# trixie-6.14 starts at 6.14.4-1+deb13u1 (the same KVNAME 6.14.4-1-pve rebuilt before 9.0, which
# shipped 6.14.8-2): 6.14.4-1 counts as 8's here, as pve8to9 reads a 6.14 before the upgrade.
EARLY_BOOKWORM_614 = ("6.14.0-1", "6.14.0-2", "6.14.4-1")
_PVE_RELEASE = re.compile(r"^(\d+)\.(\d+)\.(\d+)-(\d+)(-[0-9A-Za-z.+~-]*)?-pve$")
# the suffix pvegpu adds to KREL_EXTRA (facts.kernel.LOCAL_KREL_SUFFIX; not imported: spec uses this module)
_LOCAL_SUFFIX = "-pvegpu"


def kernel_pve_major(release: str) -> int | None:
    """The Proxmox VE major a Proxmox kernel release (`…-pve`, Proxmox's or pvegpu's `…-pvegpu-pve`)
    belongs to: 9 for trixie's, 8 for bookworm's (pve-kernel: `-bpo12` in KREL_EXTRA since 6a8fa6f,
    every release before 6.14, and 6.14's early bookworm builds), 7 before 6.2 (Proxmox VE 8.0
    shipped 6.2). None for a release that is not a Proxmox kernel's name (a tarball build's)."""
    match = _PVE_RELEASE.match(release)
    if match is None:
        return None
    major, minor = int(match.group(1)), int(match.group(2))
    extra = (match.group(5) or "").replace(_LOCAL_SUFFIX, "")
    if "-bpo12" in extra:
        return 8
    if (major, minor) < (6, 2):
        return 7
    if (major, minor) < (6, 14) or f"{major}.{minor}.{match.group(3)}-{match.group(4)}" in EARLY_BOOKWORM_614:
        return 8
    return 9


def why_major(release: str) -> str:
    """The reason kernel_pve_major gives its answer, in words (for refusals)."""
    major = kernel_pve_major(release)
    if major == 9:
        return "trixie: a 6.14 or newer pve-kernel without -bpo12"
    if "-bpo12" in release:
        return "bookworm, -bpo12"
    if any(release.startswith(early + "-") for early in EARLY_BOOKWORM_614):
        return "bookworm: an early 6.14 built before pve-kernel named bookworm builds -bpo12"
    return "bookworm: older than 6.14" if major == 8 else "older than Proxmox VE 8"


def spec_kernel_refusal(proxmox_ve: int | None, version: str, proxmox_git: bool) -> str | None:
    """The spec rule: a pve-kernel build (kernel.source.kind proxmox-git) must be of `proxmox_ve`'s
    release. None when it is, or when the spec names no major."""
    if proxmox_ve is None or not proxmox_git:
        return None
    major = kernel_pve_major(version)
    if major is None or major == proxmox_ve:
        return None
    if proxmox_ve == 9:
        return (f"{version} is a Proxmox VE {major} ({why_major(version)}) kernel, but proxmox_ve is 9; build a "
                "trixie branch of pve-kernel (e.g. master at 6e44995: 7.0.14-14-pvegpu-pve, or trixie-6.17 at "
                "74c6afb: 6.17.13-21-pvegpu-pve) with its ref")
    return (f"{version} is a Proxmox VE {major} ({why_major(version)}) kernel, but proxmox_ve is {proxmox_ve}; "
            "build a bookworm branch of pve-kernel (e.g. bookworm-6.14 at ad58d14: 6.14.11-9-bpo12-pvegpu-pve) with "
            "its ref")


def legacy_cgroup_param(params: list[str] | None) -> str | None:
    """The word of `params` that asks systemd for the legacy (v1/hybrid) cgroup layout:
    `systemd.unified_cgroup_hierarchy` with a false value (systemd parses it as a boolean:
    0/no/false/off; pve8to9's checklist greps /proc/cmdline for `…=0`)."""
    for word in params or []:
        key, sep, value = word.partition("=")
        if key == "systemd.unified_cgroup_hierarchy" and sep and value.lower() in ("0", "no", "false", "off", "n", "f"):
            return word
    return None


def host_pve_major(os_release: dict | None, pve: dict | None) -> int | None:
    """The Proxmox VE major of the host's user space: its Debian release (/etc/os-release
    VERSION_CODENAME), else pve-manager's major. None when neither is known."""
    codename = (os_release or {}).get("codename")
    if codename in CODENAME_PVE:
        return CODENAME_PVE[codename]
    return (pve or {}).get("major")


def host_release_refusals(proxmox_ve: int | None, kernel_version: str | None, proxmox_git: bool,
                          os_release: dict | None, pve: dict | None) -> list[str]:
    """Preflight refusals for what belongs to the other release than the host's: a pve-kernel build
    of the other release (it would be cloned and compiled with this release's GCC), a spec that
    says 8 on a host already on 9 (Proxmox has no way back)."""
    host = host_pve_major(os_release, pve)
    if host is None:
        return []
    codename = (os_release or {}).get("codename") or PVE_CODENAME.get(host, "?")
    refusals = []
    if proxmox_ve is not None and proxmox_ve < host:
        refusals.append(f"the spec says proxmox_ve: {proxmox_ve}, but this host runs Debian {codename} (Proxmox VE "
                        f"{host}): there is no way back to {proxmox_ve}; set proxmox_ve: {host}")
    major = kernel_pve_major(kernel_version) if kernel_version and proxmox_git else None
    if kernel_version and major is not None and major != host:
        later = f", or leave kernel: out until the {host} -> {major} upgrade is done" if major > host else ""
        refusals.append(
            f"kernel.version {kernel_version} is a Proxmox VE {major} kernel ({why_major(kernel_version)}), but this "
            f"host runs Debian {codename} (Proxmox VE {host}): its pve-kernel branch would be cloned and built here "
            f"with {codename}'s GCC {PVE_GCC.get(host, '?')}, not the GCC {PVE_GCC.get(major, '?')} of its own release, "
            f"and packaged against the wrong user space. Build a pve-kernel branch of {codename}{later}")
    return refusals
