"""What the kernel stage does, from spec + facts (pure: no I/O, no host state).

    build_jobs(cores, mem_total_kib)               -> 12     # -j: min(cores, RAM / 2 GiB), >= 1
    build_id(kernel_spec, base_config)             -> "3f0c…"  # source + ref/sha + config, hashed
    build_dir(kernel_spec, base_config)            -> "/var/lib/pvegpu/kernel-build/6.14.8-2-pve-3f0c1a2b3c4d"
    kernel_decision(kernel_spec, facts, base_config) -> {"action": "build"|"attach"|"install"|"trial"|"await-reboot"|
                                                   "finish"|"pin"|"done"|"failed-trial"|"wrong-debs", "why": …}
    release_from_makefile(pve_kernel_makefile_text) -> "6.14.11-9-bpo12-pve"   # Proxmox's release of a ref (facts.kernel)
    built_release_from_makefile(text)              -> "6.14.11-9-bpo12-pvegpu-pve"  # what our build of it produces
    build_memory_max_kib(mem_total_kib, jobs)      -> MemoryMax= of the detached build
    build_tools(kernel_spec)                       -> ["git", "make", "dpkg-dev", …]  # Debian packages build.sh runs
    missing_tools(kernel_spec, needs)              -> (to install with apt, with no apt candidate)
    build_space_kib(kernel_spec, base_config)      -> KiB free a build needs under BUILD_ROOT (measured: BUILD_SPACE_KIB)
    package_globs(kind, release)                   -> ["linux-image-6.1.0-pvegpu_*.deb", …]
    boot loader interface (one trial = one boot; see the section below):
    host_loader(build_facts, loader_state)         -> "systemd-boot"|"grub"|"grub-esp"  # plan.loader's one decision
    trial_loader(build_facts, loader)              -> ("systemd-boot"|"grub"|"grub-esp", None) or (None, why not)
    set_default_command(release, loader, adv_id)   # the default for good
    oneshot_command(release, loader, panic_s, adv_id)  # the next boot only, with panic=
    clear_oneshot_command(release, loader)
    finish_trial_command(release, loader, build_id, adv_id)  # after the boot: default, or record the failure

Incident 14: `-j` = cores (128) with ~2 GiB per compile job killed a machine; jobs come from
RAM as well. Incident 1: a kernel and its modules built by different GCCs left kpro6
unbootable, so the build runs on the host with its own gcc and records it in a manifest.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re

from facts.kernel import (  # noqa: F401
    BUILD_ROOT,
    GATE_DIR,
    LOCAL_KREL_SUFFIX,
    STATE_DIR,
    TRIAL_ARMED,
    TRIAL_CHECKS,
    TRIAL_FAILED,
    TRIAL_LOG,
    TRIAL_MARKER,
    TRIAL_PENDING,
    TRIAL_RETRIED,
    TRIAL_UNIT,
    TRIAL_UNIT_NAME,
    TRIAL_UP,
    TRIAL_UP_SCRIPT,
    TRIAL_WANTS,
    built_release_from_makefile,
    makefile_variables,
    release_from_makefile,
)

# The kernel stage's host paths and pve-kernel's Makefile reader live with the fact that reads
# them (facts.kernel); plan.kernel names them too, for its own use and its callers'.
from facts.shell import operands, word
from plan import loader as loader_plan
from plan.nvidia import signing_key_refusal
from plan.render import PRIVATE, PUBLIC, root_dirs
from plan.render import render_template as _render_raw
from spec.models import KernelSpec

GIB_KIB = 1024 * 1024
# The kernel build's ccache (templates/kernel-build.sh.j2): a directory and a cap of its own, so a
# kernel build never evicts the NVIDIA module builds' cache (operations.nvidia CCACHE_DIR, ccache's
# default 5 GB). The cap holds one full Proxmox build's objects: Debian's 6.12 -dbg package (the
# DWARF of every module and vmlinux of a distro config) installs 6.4 GiB; ccache stores its
# results zstd-compressed (ccache's default), so one build's objects fit with room for a second ref.
CCACHE_DIR = "/var/cache/pvegpu/ccache-kernel"
CCACHE_MAX_SIZE = "12G"
PER_JOB_KIB = 2 * GIB_KIB
BUILD_UNIT = "pvegpu-kernel-build"
# a kbuild output line that produced one object / target


def build_jobs(cores: int | None, mem_total_kib: int | None, per_job_kib: int = PER_JOB_KIB) -> int:
    """Parallel compile jobs: never more than cores, never more than RAM / ~2 GiB, at least 1."""
    by_cores = cores if cores and cores > 0 else 1
    by_mem = (mem_total_kib or 0) // per_job_kib
    return max(1, min(by_cores, by_mem))


def resolve_jobs(spec_jobs: int | str, cores: int | None, mem_total_kib: int | None) -> int:
    if spec_jobs == "auto":
        return build_jobs(cores, mem_total_kib)
    return max(1, int(spec_jobs))


def localversion(kernel: KernelSpec) -> str:
    """LOCALVERSION for `make bindeb-pkg`: what follows the tree's own version in the release
    (`6.1.192` + `-pvegpu-ci` = `6.1.192-pvegpu-ci`; empty when the spec names no suffix)."""
    match = re.match(r"^\d+\.\d+(?:\.\d+)?(.*)$", kernel.version)
    return match.group(1) if match else ""


def build_id(kernel: KernelSpec, base_config: str = "running") -> str:
    """What identifies a build: same id = same kernel, nothing to rebuild."""
    source = kernel.source
    identity = {
        "version": kernel.version,
        "kind": source.kind,
        "url": source.url,
        "ref": source.ref,
        "sha256": source.sha256,
        "base_config": base_config,
        "fragments": list(kernel.config_fragments),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def config_hash(kernel: KernelSpec, base_config: str = "running") -> str:
    text = base_config + "\n" + "\n".join(kernel.config_fragments)
    return hashlib.sha256(text.encode()).hexdigest()


def build_dir(kernel: KernelSpec, base_config: str = "running") -> str:
    return f"{BUILD_ROOT}/{kernel.version}-{build_id(kernel, base_config)[:12]}"


def release_refusal(kernel: KernelSpec, source_release: str | None, where: str) -> str | None:
    """The preflight refusal when spec kernel.version is not what the pinned source builds."""
    if kernel.source.kind != "proxmox-git" or not source_release or source_release == kernel.version:
        return None
    return (f"kernel.version is {kernel.version}, but pve-kernel at ref {kernel.source.ref} builds {source_release} "
            f"(KVNAME of its Makefile with KREL_EXTRA + {LOCAL_KREL_SUFFIX}: our packages never carry the names of "
            f"Proxmox's, which would replace them; read from {where}); set kernel.version: {source_release} or pin another ref")


def build_memory_max_kib(mem_total_kib: int | None, jobs: int, per_job_kib: int = PER_JOB_KIB) -> int | None:
    """MemoryMax= of the detached build unit: what its jobs need plus 2 GiB for the rest of the
    build (linking, packaging), never more than RAM less max(2 GiB, 1/8): an OOM then kills
    the build's cgroup, not the guests or sshd (incident 14). None when RAM is unknown."""
    if not mem_total_kib:
        return None
    wanted = jobs * per_job_kib + 2 * GIB_KIB
    ceiling = mem_total_kib - max(2 * GIB_KIB, mem_total_kib // 8)
    return max(per_job_kib, min(wanted, ceiling))


# The Debian packages build.sh itself runs, before (proxmox-git) mk-build-deps installs the
# Build-Depends of pve-kernel's debian/control at the ref (its README: devscripts, then
# mk-build-deps on the generated control). The stage installs the missing ones with apt before it
# starts a build (operations.kernel install_build_tools), or refuses when apt has no candidate.
PROXMOX_GIT_TOOLS = (
    "git",  # clone, checkout, submodules; pve-kernel's Makefile (debian.prepared) runs git rev-parse
    "make",
    "dpkg-dev",  # the Makefile's include /usr/share/dpkg/pkg-info.mk; dpkg-buildpackage, dpkg-checkbuilddeps
    "build-essential",  # dpkg-checkbuilddeps adds build-essential:native (dpkg Dpkg/Vendor/Debian.pm builtin-build-depends)
    "devscripts",  # mk-build-deps
    "equivs",  # equivs-build, which mk-build-deps runs (devscripts only recommends it)
)
# `make bindeb-pkg` of a kernel.org/Debian tarball: the Build-Depends the kernel's own
# scripts/package/mkdebian writes (bc, rsync, kmod, cpio, bison, flex, libelf-dev, libssl-dev),
# the compiler and dpkg-dev (dpkg-buildpackage), xz to unpack
TARBALL_TOOLS = ("make", "build-essential", "dpkg-dev", "xz-utils", "bc", "rsync", "kmod", "cpio", "bison", "flex",
                 "libelf-dev", "libssl-dev")


def build_tools(kernel: KernelSpec) -> list[str]:
    """The Debian packages a build of `kernel` needs before it starts (see PROXMOX_GIT_TOOLS)."""
    tools = list(PROXMOX_GIT_TOOLS if kernel.source.kind == "proxmox-git" else TARBALL_TOOLS)
    if kernel.source.kind == "tarball" and kernel.source.url.startswith(("http://", "https://")):
        tools.append("curl")
    if kernel.ccache:
        tools.append("ccache")
    return tools


def missing_tools(kernel: KernelSpec, needs: dict) -> tuple[list[str], list[str]]:
    """(packages apt installs, packages apt has no candidate for) among build_tools(kernel) that
    are not installed. `needs`: KernelStageFacts["needs"] ({"installed": [...], "candidates":
    {package: version or None}, "unasked": [...]}); a package apt was not asked about is left to
    apt-get (install_tools_command stops with the list when it cannot)."""
    installed = set(needs.get("installed") or [])
    candidates = needs.get("candidates") or {}
    missing = [t for t in build_tools(kernel) if t not in installed]
    unavailable = [t for t in missing if t in candidates and not candidates[t]]
    return [t for t in missing if t not in unavailable], unavailable


def tools_refusal(kernel: KernelSpec, needs: dict) -> str | None:
    """The preflight refusal when a package the build needs is missing and apt cannot install it."""
    _, unavailable = missing_tools(kernel, needs)
    if not unavailable:
        return None
    return (f"the kernel build ({kernel.source.kind}) needs {', '.join(unavailable)}, not installed, and apt has no "
            f"candidate for {'it' if len(unavailable) == 1 else 'them'} (apt-get update, or add the Debian repository "
            "that has them); nothing was built")


# Free space a build needs under BUILD_ROOT, checked before it starts (space_refusal). How each
# figure was measured (2026-12-04, on this repo's CI machine):
# - the tarball source CI builds (Debian's linux-source-6.1, 6.1.192): source.tar 139 MB; unpacked,
#   1.30 GB of file bytes in 83,731 files (`xz -dc | tar -tv`, sizes summed): ~1.5 GiB on disk.
# - a tinyconfig build of it (tests/e2e/test_kernel_build.py, `du -sk` of the twin's build dir
#   every 45 s): 1,607,104 KiB once unpacked, 1,773,564 KiB at its peak (objects and .debs
#   included) = 1.7 GiB -> 3 GiB.
# - a distro config (a Proxmox kernel: Ubuntu's annotations config, debug info on): its objects
#   carry DWARF once as .o and again linked into each .ko and vmlinux; Debian's 6.12 -dbg package
#   (that DWARF alone, from bookworm-security's Packages: Installed-Size 6,710,153 KiB) gives
#   2 x 6.4 = 12.8 GiB of objects, plus the packaging trees and .debs (~1.5 GiB: the 6.1 image
#   package installs 0.4 GiB, and dpkg-buildpackage's debian/<pkg> trees hold it again).
#   A tarball build with such a config: 1.5 + 12.8 + 1.5 = 15.8 GiB -> 20 GiB.
# - proxmox-git adds, per pve-kernel's Makefile and debian/rules: the ubuntu-kernel submodule's
#   worktree and its full-history git objects (a linux.git clone: ~5 GiB, not measured here), a
#   `cp -a` of the worktree into BUILD_DIR and debian/rules' KERNEL_SRC_COPY for the headers
#   (3 x 1.6 GiB) -> 15.8 + 5 + 4.8 = 25.6 GiB -> 32 GiB.
BUILD_SPACE_KIB = {"tiny": 3 * GIB_KIB, "tarball": 20 * GIB_KIB, "proxmox-git": 32 * GIB_KIB}


def build_space_kib(kernel: KernelSpec, base_config: str = "running") -> int:
    """KiB of free space a build of `kernel` needs under BUILD_ROOT (BUILD_SPACE_KIB)."""
    if kernel.source.kind == "proxmox-git":
        return BUILD_SPACE_KIB["proxmox-git"]
    return BUILD_SPACE_KIB["tiny" if base_config in ("tinyconfig", "allnoconfig") else "tarball"]


def space_refusal(kernel: KernelSpec, base_config: str, needs: dict) -> str | None:
    """The preflight refusal when the file system of BUILD_ROOT has less free than the build needs."""
    free, where = needs.get("free_kib"), needs.get("free_path") or BUILD_ROOT
    wanted = build_space_kib(kernel, base_config)
    if free is None or free >= wanted:
        return None
    return (f"the kernel build of {kernel.version} needs {wanted / GIB_KIB:.1f} GiB free under {BUILD_ROOT}, and the "
            f"file system of {where} has {free / GIB_KIB:.1f} GiB free; free some space there (old build dirs under "
            f"{BUILD_ROOT} can go), nothing was built")


def install_tools_command(packages: list[str]) -> str:
    """apt-get install of the build's missing packages; on failure it says which and stops."""
    names = " ".join(word(p) for p in packages)
    message = word(f"pvegpu: apt could not install {' '.join(packages)}, which the kernel build needs; "
                          "nothing was built")
    return (f"DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {names} "
            f"|| {{ echo {message} >&2; exit 1; }}")


def debs_of_release(kind: str, release: str, debs: list[str]) -> bool:
    """Did a build leave the packages of `release` (package_globs) among `debs`?"""
    return all(any(fnmatch.fnmatch(d, g) for d in debs) for g in package_globs(kind, release))


def package_globs(kind: str, release: str) -> list[str]:
    """The .debs a build leaves in its build dir (relative names, shell globs)."""
    if kind == "proxmox-git":
        # pve-kernel's `make deb`: proxmox-kernel-<rel>_*.deb, proxmox-headers-<rel>_*.deb
        return [f"proxmox-kernel-{release}_*.deb", f"{headers_package(kind, release)}_*.deb"]
    return [f"linux-image-{release}_*.deb", f"{headers_package(kind, release)}_*.deb"]


def headers_package(kind: str, release: str) -> str:
    """The headers package a build of `release` leaves (pve-kernel: proxmox-headers-<rel>; bindeb-pkg: linux-headers-<rel>)."""
    return f"proxmox-headers-{release}" if kind == "proxmox-git" else f"linux-headers-{release}"


# -- the driver x kernel gate ---------------------------------------------------------------
#
# Before the stage installs its kernel or sets up its trial boot, nvidia.version is built against
# that kernel's headers (operations/kernel.py nvidia_gate, templates/kernel-nvidia-gate.sh.j2, which
# includes the NVIDIA stage's build script); a kernel the driver cannot build for is refused and the
# refusal recorded on the host (facts.kernel.GATE_DIR), so a later run refuses it at preflight,
# quoting the first compile error, until the driver, its source or the kernel build changes.

def gate_due(action: str, kernel: KernelSpec, loader: str | None) -> bool:
    """Does the stage's next step install the kernel or arm its trial (the gate runs first)?"""
    return action in ("build", "attach", "install") or (action == "trial" and kernel.trial_boot and bool(loader))


def gate_refusal(kernel: KernelSpec, base_config: str, nvidia_version: str, archive_sha256: str,
                 records: dict[str, dict]) -> str | None:
    """The preflight refusal when the gate already refused this kernel build for this driver and
    source (`facts.kernel.NvidiaGateRecords`); a record of another driver, source or kernel build
    does not count (the gate runs again)."""
    rec = records.get(kernel.version)
    if not rec or (rec.get("version"), rec.get("archive_sha256"), rec.get("build_id")) != (
            nvidia_version, archive_sha256, build_id(kernel, base_config)):
        return None
    return (f"kernel {kernel.version} (kernel.version) is refused: {rec['reason']} (driver x kernel gate, "
            f"{rec['time']}); it was not installed and is not booted. Pick a driver version that builds for it "
            f"(nvidia.version) or another kernel; rm {GATE_DIR}/{kernel.version}.refused to try the same again")


def kernel_decision(kernel: KernelSpec, facts: dict, base_config: str = "running") -> dict:
    """The one thing the stage does next, and why (in words).

    `facts`: {"kernels": <ProxmoxKernels>, "installed_manifest": dict|None (for kernel.version),
    "build": {"running": bool, "rc": int|None, "debs": [names], "manifest": dict|None},
    "trial": release|None (TRIAL_MARKER), "armed": release|None (TRIAL_ARMED),
    "failed": dict|None (TRIAL_FAILED), "default": the loader's default release (`default_release`)}.

    .. code:: python

        {"action": "build", "why": "6.14.8-2-pve is not installed"}
    """
    release = kernel.version
    kernels = facts.get("kernels") or {}
    installed = release in (kernels.get("installed") or [])
    wanted = build_id(kernel, base_config)
    manifest = facts.get("installed_manifest") or {}
    build = facts.get("build") or {}
    running = kernels.get("running")
    if installed and manifest.get("build_id") == wanted:
        trial = facts.get("trial")
        armed = facts.get("armed")
        failed = facts.get("failed") or {}
        default = facts["default"] if "default" in facts else kernels.get("pinned")
        if trial == release and armed != release:
            # the boot the trial was set up for happened (TRIAL_ARMED lives on a tmpfs)
            if running == release:
                return {"action": "finish", "why": f"the trial boot of {release} came up; make it the default for good"}
            if facts.get("trial_up") == f"{release} ok" and facts.get("trial_retried") != release:
                # pvegpu-kernel-trial.service recorded it at that boot: a reset (a power cut) came
                # between that boot and the run's check, not a hang or panic of the kernel
                return {"action": "trial",
                        "why": f"the trial boot of {release} came up and its host checks held at that boot "
                               f"({TRIAL_UNIT_NAME}), but the host was reset before a run made it the default and "
                               f"{running} runs now: setting the trial up again (once)", "retry": True}
            return {"action": "finish",
                    "why": f"the trial boot of {release} came up on {running}: the loader's one-shot was used and "
                           f"{default or running} stays the default; recording it (not tried again until the spec changes)"}
        if failed.get("release") == release and failed.get("build_id") == wanted and default != release:
            # evidence kept by finish_trial_command: the kernel that came up, the host checks that
            # failed on the trial kernel, what the journal kept of the trial boot
            checks = f", but the host checks failed:{failed['checks']}" if failed.get("checks") else ""
            journal = f"; journal: {failed['journal']}" if failed.get("journal") else ""
            return {"action": "failed-trial",
                    "why": f"the trial boot of {release} came up on {failed.get('came_up_on')}{checks}; "
                           f"{default or running} stays the default and {release} is not tried again until the spec "
                           f"changes{journal} (rm {TRIAL_FAILED} to try again)"}
        if running == release:
            if default != release:
                return {"action": "pin", "why": f"{release} is running; make it the default for good"}
            return {"action": "done", "why": f"{release} (built from the same source and config) is installed, running and the default"}
        if trial == release:
            return {"action": "await-reboot", "why": f"{release} is installed and chosen for the next boot only (trial)"}
        if not kernel.trial_boot:
            return {"action": "done", "why": f"{release} is installed (trial_boot is off; not made the default)"}
        return {"action": "trial", "why": f"{release} is installed but not booted yet"}
    why = f"{release} is not installed" if not installed else f"{release} is installed but built from another source or config"
    if build.get("running"):
        return {"action": "attach", "why": f"{why}; a build is already running on the host: waiting for it"}
    if build.get("rc") == 0 and (build.get("manifest") or {}).get("build_id") == wanted and build.get("debs"):
        if not debs_of_release(kernel.source.kind, release, build["debs"]):
            return {"action": "wrong-debs",
                    "why": f"the build finished but produced {', '.join(sorted(build['debs']))}, not the packages of "
                           f"{release} ({', '.join(package_globs(kernel.source.kind, release))}); kernel.version must be "
                           f"the release the source builds"}
        return {"action": "install", "why": f"{why}; the build of it finished earlier: installing"}
    return {"action": "build", "why": why}


# -- the boot loader interface: "make X the default", "boot X once" ------------------------
#
# One trial is one boot. The default stays on the known-good kernel; the trial kernel is chosen
# for the next boot only, with panic=<s> on its command line; it becomes the default only once
# the host came up on it. Both loaders' one-shots are cleared by the loader as it reads them:
# - systemd-boot (proxmox-boot-tool ESPs, UEFI): the EFI variable LoaderEntryOneShot, read and
#   deleted before anything else decides (systemd src/boot/efi/boot.c config_load_defaults /
#   config_default_entry_select); then LoaderEntryDefault, then loader.conf `default`, which
#   `proxmox-boot-tool kernel pin` + `refresh` write (zz-proxmox-boot set_systemd_boot_default).
#   The one-shot names a trial entry of our own (TRIAL_ENTRY_PREFIX), a copy of the entry
#   refresh wrote with panic= added, so the default entry's options stay untouched.
# - GRUB: grubenv `next_entry`, which the generated header boots and clears (grub
#   util/grub.d/00_header.in), else `saved_entry` when GRUB_DEFAULT=saved (grub-mkconfig turns
#   it into ${saved_entry}). grub-reboot / grub-set-default write them (util/grub-reboot.in,
#   grub-set-default.in, through grub-editenv). Kernel entries are named by their ids, as
#   proxmox-kernel-helper set_grub_default() names them. GRUB's kernel entries all share
#   GRUB_CMDLINE_LINUX*, so the one-shot names a trial entry of our own (GRUB_TRIAL_SCRIPT, a
#   /etc/grub.d script that grub-mkconfig runs: 10_linux's entry of the release with panic= added).

SYSTEMD_BOOT = loader_plan.SYSTEMD_BOOT
GRUB = loader_plan.GRUB  # GRUB reading /boot/grub
GRUB_ESP = loader_plan.GRUB_ESP  # GRUB from proxmox-boot-tool's ESPs (its grub mode)
TRIAL_ENTRY_PREFIX = "pvegpu-trial-"
GRUBENV = "/boot/grub/grubenv"
GRUB_CFG = "/boot/grub/grub.cfg"
# after 10_linux and Debian's 40_custom/41_custom: never entry 0 (an unset saved_entry boots entry 0)
GRUB_TRIAL_SCRIPT = "/etc/grub.d/42_pvegpu_trial"
REFRESH = "proxmox-boot-tool refresh"


def keep_on_esps_command(release: str, kind: str, esps: bool) -> str | None:
    """What keeps a kernel that is not Proxmox's package on the ESPs (issue 38 item 2.8), else None.

    proxmox-kernel-helper's refresh syncs only the kernels of `kernel_keep_versions`
    (proxmox-boot/functions: Proxmox's proxmox-/pve-kernel packages, the running one, the pins and
    the manual list): a tarball build's `linux-image-<rel>` is synced once by its own postinst and
    dropped from the ESPs by the next refresh, so its trial entry would have no kernel to boot.
    `kernel add` (bin/proxmox-boot-tool add_kernel) puts it on the manual list, then refresh."""
    if kind != "tarball" or not esps:
        return None
    # add_kernel reads the release as "$3", no '--': a leading '-' is refused (kernel.version starts with a digit)
    return f"proxmox-boot-tool kernel add {operands(release, '')} && {REFRESH}"
# grub-mkconfig writes GRUB_DEFAULT=saved as `set default="${saved_entry}"` (00_header.in); without
# it grub-set-default changes nothing and the newest kernel stays the default
GRUB_SAVED_CHECK = ("{ grep -q 'set default=\"${saved_entry}\"' /boot/grub/grub.cfg || { echo 'pvegpu: GRUB_DEFAULT "
                    "is not saved in the generated /boot/grub/grub.cfg (the boot stage writes it in "
                    "/etc/default/grub.d/pvegpu.cfg): no trial without it' >&2; exit 1; }; }")


def trial_entry(release: str) -> str:
    """The systemd-boot loader entry of a trial boot (a file name on each ESP)."""
    return f"{TRIAL_ENTRY_PREFIX}{release}.conf"


def grub_trial_id(release: str) -> str:
    """The id of the GRUB trial entry of a kernel release (a top-level menuentry of grub.cfg)."""
    return f"{TRIAL_ENTRY_PREFIX}{release}"


def grub_entry_id(release: str, advanced_id: str) -> str:
    """GRUB's id path of a kernel's entry in the "Advanced options" submenu that grub-mkconfig's
    10_linux writes: `gnulinux-advanced-<dev>>gnulinux-<rel>-advanced-<dev>` (the form
    proxmox-kernel-helper set_grub_default() uses; <dev> is read from /boot/grub/grub.cfg)."""
    return f"gnulinux-advanced-{advanced_id}>gnulinux-{release}-advanced-{advanced_id}"


def grub_release_of(entry: str | None) -> str | None:
    """The kernel release a grub_entry_id names (None for anything else)."""
    match = re.match(r"^gnulinux-advanced-(.+)>gnulinux-(.+)-advanced-\1$", entry or "")
    return match.group(2) if match else None


# systemd-boot's default for good is kept twice: the proxmox-boot-tool pin (loader.conf's `default`,
# written by refresh: zz-proxmox-boot set_systemd_boot_default) and the EFI variable
# LoaderEntryDefault (`bootctl set-default`), which systemd-boot prefers over loader.conf's default
# (boot.c config_default_entry_select). `proxmox-boot-tool reinit` (proxmox-kernel-helper's postinst
# on configure and on its trigger: any grub, shim or systemd-boot-efi upgrade) rewrites loader.conf
# to `default proxmox-*` without a refresh (init_bootloader), so the pin alone lets the newest
# kernel (a refused trial, one without NVIDIA modules) boot until the next refresh; the variable
# survives it. The entry is the one refresh writes (zz-proxmox-boot copy_and_config_kernels).
LOADER_ENTRY_PREFIX = "proxmox-"


def loader_entry(release: str) -> str:
    """The systemd-boot entry proxmox-boot-tool refresh writes for a release (its id on the ESPs)."""
    return f"{LOADER_ENTRY_PREFIX}{release}.conf"


# systemd-boot's LoaderInfo variable: present only where systemd-boot booted this system (boot.c
# writes it at every boot); a GRUB or legacy-BIOS host (proxmox-boot-tool's grub mode) has none
LOADER_INFO = "/sys/firmware/efi/efivars/LoaderInfo-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"


def efi_default_command(release: str | None) -> str:
    """Set (or, None, clear) systemd-boot's EFI default entry (systemd bootctl verb_set_efivar:
    an empty id deletes LoaderEntryDefault), where systemd-boot booted this system (as the kernel
    hook's efi_default does); elsewhere nothing to do."""
    # the id starts with "proxmox-": never an option; '' is bootctl's "clear"
    set_it = f"bootctl set-default {word(loader_entry(release)) if release else chr(39) * 2}"
    return f"{{ [ ! -e {LOADER_INFO} ] || {set_it}; }}"


def set_default_command(release: str, loader: str, advanced_id: str | None = None) -> str:
    """Make `release` the loader default for good (every later boot)."""
    if loader in (SYSTEMD_BOOT, GRUB_ESP):
        # proxmox-boot-tool (proxmox-kernel-helper bin/proxmox-boot-tool) reads the release as "$2",
        # no '--': a leading '-' is refused (kernel.version starts with a digit at load); in grub
        # mode refresh writes the pin as GRUB_DEFAULT (zz-proxmox-boot set_grub_default) and there
        # is no systemd-boot EFI default
        pin = f"proxmox-boot-tool kernel pin {operands(release, '')} && {REFRESH}"
        return pin if loader == GRUB_ESP else f"{pin} && {efi_default_command(release)}"
    if not advanced_id:
        raise ValueError("a GRUB default needs the Advanced-options id of /boot/grub/grub.cfg")
    # grub-set-default/grub-reboot (grub util/grub-set-default.in): any '-*' is an unknown option,
    # no '--'; the entry id starts with 'gnulinux-'
    return f"grub-set-default {operands(grub_entry_id(release, advanced_id), '')}"


def oneshot_command(release: str, loader: str, panic_s: int, advanced_id: str | None = None,
                    keep: str | None = None) -> str:
    """Boot `release` once, at the next boot only, with panic=<panic_s>; the default stays where it is.

    systemd-boot: the trial entry (templates/kernel-trial-entry.sh.j2) on every ESP and the
    one-shot variable. GRUB: the trial entry script (templates/grub-trial-entry.sh.j2) in
    /etc/grub.d, update-grub, then `grub-reboot` (next_entry) of that entry. `keep`: the known-good
    release the loader must boot by default; checked right before the one-shot is set (every ESP's
    loader.conf and LoaderEntryDefault, or grubenv's saved_entry), else nothing is armed (issue 38 2.2)."""
    if loader == SYSTEMD_BOOT:
        return trial_entry_command(release, "arm", panic_s, keep)
    if not advanced_id:
        raise ValueError("a GRUB one-shot needs the Advanced-options id of /boot/grub/grub.cfg")
    from plan.render import render_template
    script = render_template("grub-trial-entry.sh.j2", release=release, panic_s=int(panic_s))
    ident = grub_trial_id(release)
    tmp = word(GRUB_TRIAL_SCRIPT + ".tmp")
    if loader == GRUB_ESP:
        # grub mode: refresh runs update-grub with each ESP on /boot (zz-proxmox-boot update_esp_func),
        # which puts the trial entry in each ESP's grub.cfg; then next_entry in each ESP's grubenv
        return (f"printf '%s\\n' {word(script)} > {tmp} && chmod 755 {tmp} && mv {tmp} {word(GRUB_TRIAL_SCRIPT)} && "
                f"{REFRESH} && {grub_esp_oneshot_command('arm', release, grub_entry_id(keep, advanced_id) if keep else None)}")
    line = word(f"$menuentry_id_option '{ident}'")
    missing = word(f"pvegpu: update-grub wrote no trial entry {ident} in {GRUB_CFG} "
                          f"(10_linux lists no entry for {release}): no trial")
    verify = ""
    if keep:
        saved = word(f"saved_entry={grub_entry_id(keep, advanced_id)}")
        wrong = word(f"pvegpu: {GRUBENV}'s saved_entry is not the known-good {keep} "
                     f"({grub_entry_id(keep, advanced_id)}): no trial is armed")
        verify = f"{{ grub-editenv {GRUBENV} list | grep -qxF {saved} || {{ echo {wrong} >&2; exit 1; }}; }} && "
    return (f"printf '%s\\n' {word(script)} > {tmp} && chmod 755 {tmp} && mv {tmp} {word(GRUB_TRIAL_SCRIPT)} && "
            f"update-grub && {GRUB_SAVED_CHECK} && "
            f"{{ grep -qF {line} {GRUB_CFG} || {{ echo {missing} >&2; exit 1; }}; }} && "
            f"{verify}grub-reboot {word(ident)}")


def grub_esp_oneshot_command(mode: str, release: str, keep_id: str | None = None) -> str:
    """GRUB's one-shot on every ESP in proxmox-boot-tool's grub mode (templates/grub-esp-oneshot.sh.j2):
    `arm` checks each ESP's grub.cfg (the trial entry, the known-good `keep_id` as its default) and
    grubenv, then sets next_entry there; `clear` unsets next_entry on each."""
    from plan.render import render_template
    script = render_template("grub-esp-oneshot.sh.j2", mode=mode, entry=grub_trial_id(release), keep_id=keep_id)
    return f"unshare --mount --propagation private /bin/sh -c {word(script)}"


def clear_oneshot_command(release: str, loader: str) -> str:
    """Forget a trial: its systemd-boot entries, or GRUB's next_entry (grub-editenv unset; on every
    ESP in grub mode) and its trial entry (the script goes, update-grub, or in grub mode refresh,
    writes grub.cfg without it)."""
    if loader == SYSTEMD_BOOT:
        return trial_entry_command(release, "clear", 0)
    script = word(GRUB_TRIAL_SCRIPT)
    if loader == GRUB_ESP:
        return (f"{grub_esp_oneshot_command('clear', release)} && "
                f"if [ -e {script} ]; then rm -f {script} && {REFRESH}; fi")
    return (f"grub-editenv {GRUBENV} unset next_entry && "
            f"if [ -e {script} ]; then rm -f {script} && update-grub; fi")


def trial_entry_command(release: str, mode: str, panic_s: int, keep: str | None = None) -> str:
    from plan.render import render_template
    script = render_template("kernel-trial-entry.sh.j2", release=release, mode=mode, entry=trial_entry(release),
                             panic_s=int(panic_s), keep=keep, loader_entry_prefix=LOADER_ENTRY_PREFIX)
    return f"unshare --mount --propagation private /bin/sh -c {word(script)}"


# File systems GRUB cannot save_env on (grub-core/commands/loadenv.c check_blocklists: the env block
# must be plain sectors of the one disk GRUB read it from, else "sparse file not allowed"); the list
# is Debian grub-common 2.06's util/grub.d/00_header.in check_writable, as `grub-probe --target=fs` names them.
GRUB_UNWRITABLE_FS = frozenset({"btrfs", "cpiofs", "newc", "odc", "romfs", "squash4", "tarfs", "zfs"})


def host_loader(build: dict, loader_state: dict | None = None) -> str:
    """The one loader decision (plan.loader.host_loader) for the kernel stage: from the loader's own
    reading (`facts.loader.LoaderState`: each ESP's mode as refresh sets it up) where there is one,
    else from the build facts (ESPs listed: systemd-boot under UEFI, GRUB on them under BIOS)."""
    if loader_state:
        return loader_plan.loader_of_state(loader_state)
    return loader_plan.host_loader("uefi" if build.get("uefi") else "bios", [], bool(build.get("esps")))


def trial_loader(build: dict, loader: str | None = None) -> tuple[str | None, str | None]:
    """(loader, None) where a one-boot trial can be set up, else (None, why not).

    `build`: KernelStageFacts["build"]; `loader`: `host_loader` (else from `build`). systemd-boot
    where proxmox-boot-tool keeps it on the ESPs; GRUB where it reads /boot/grub/grubenv from a
    plain file system: GRUB cannot write its environment block on LVM or RAID (diskfilter) nor on
    btrfs, ZFS and the read-only file systems (GRUB_UNWRITABLE_FS), so next_entry would stay set and
    the trial kernel would boot at every reset (Debian's grub-reboot warns of exactly this). Not
    GRUB on ESPs (proxmox-boot-tool's grub mode, GRUB_ESP): it reads grub.cfg and grubenv from each
    ESP's grub/ (grub-install --boot-directory there), a vfat file system where GRUB's save_env
    clears next_entry; the one-shot goes in every ESP's grubenv (grub_esp_oneshot_command, which
    arms nothing on an ESP whose grubenv GRUB could not rewrite)."""
    loader = loader or host_loader(build)
    if loader == GRUB_ESP:
        if not build.get("grub_advanced_id"):
            return None, ("proxmox-boot-tool keeps GRUB on the ESPs here, and /boot/grub/grub.cfg has no 'Advanced "
                          "options' submenu id (gnulinux-advanced-…), from which its pin names the known-good entry")
        return GRUB_ESP, None
    if loader == SYSTEMD_BOOT:
        return SYSTEMD_BOOT, None
    abstraction = build.get("grubenv_abstraction")
    if abstraction is None:
        return None, (f"grub-probe could not tell what holds {GRUBENV}: whether GRUB can clear next_entry "
                      "after one boot is unknown")
    if {"lvm", "diskfilter"} & set(abstraction.split()):
        return None, (f"{GRUBENV} is on {abstraction}: GRUB cannot write its environment there, so a grub-reboot "
                      "one-shot is never cleared and a trial kernel that does not come up would boot at every reset")
    fs = build.get("grubenv_fs")
    if fs is None:
        return None, (f"grub-probe could not tell the file system of {GRUBENV}: whether GRUB can clear next_entry "
                      "after one boot is unknown")
    if fs in GRUB_UNWRITABLE_FS:
        return None, (f"{GRUBENV} is on {fs}: GRUB cannot write its environment there, so a grub-reboot "
                      "one-shot is never cleared and a trial kernel that does not come up would boot at every reset")
    if not build.get("grub_advanced_id"):
        return None, "/boot/grub/grub.cfg has no 'Advanced options' submenu id (gnulinux-advanced-…) to name entries by"
    # GRUB_DEFAULT=saved comes with the boot stage's drop-in, written earlier in the same run; the
    # one-shot checks the regenerated grub.cfg for it (GRUB_SAVED_CHECK)
    return GRUB, None


def default_loader(build: dict, loader: str | None = None) -> tuple[str | None, str | None]:
    """(loader, None): how the loader's default is set by name on this host, trial or not; else
    (None, why not). `loader`: `host_loader` (else from `build`). ESPs: the pin (`kernel pin` +
    `refresh`; proxmox-kernel-helper's zz-proxmox-boot writes it as loader.conf's default for
    systemd-boot (SYSTEMD_BOOT, with the EFI default too), or, in its grub mode (GRUB_ESP), as the
    GRUB_DEFAULT of /etc/default/grub.d/proxmox-kernel-pin.cfg before update-grub with the ESP on
    /boot (set_grub_default; the boot stage leaves GRUB_DEFAULT alone there). GRUB on /boot:
    grubenv's saved_entry by entry id (grub-set-default writes it from the running system on any
    file system; only GRUB itself cannot write there, which matters for a one-shot alone). Never an
    index: with the boot stage's GRUB_DEFAULT=saved on a stock install saved_entry is `0`, the
    first entry, which 10_linux makes the newest kernel."""
    loader = loader or host_loader(build)
    if loader in (SYSTEMD_BOOT, GRUB_ESP):
        return loader, None
    if not build.get("grub_advanced_id"):
        return None, "/boot/grub/grub.cfg has no 'Advanced options' submenu id (gnulinux-advanced-…) to name entries by"
    return GRUB, None


def default_release(kernels: dict, build: dict, loader: str | None, loader_state: dict | None = None) -> str | None:
    """The kernel the loader boots by default: the pin (ESPs), grubenv saved_entry (GRUB on /boot).
    On ESPs the pin counts only where the loader's own default (`loader_state`, plan.loader
    next_boot without its one-shots: LoaderEntryDefault, loader.conf, the ESP's grub.cfg) boots it
    on every ESP: a `bootctl set-default` or loader.conf edit to another kernel is no default of ours."""
    if loader == GRUB:
        return grub_release_of(build.get("grub_saved"))
    pinned = kernels.get("pinned")
    if pinned and loader_state:
        booted = [c["release"] for c in loader_plan.next_boot(loader_state, once=False)]
        if booted and any(r != pinned for r in booted):
            return None
    return pinned


def host_expectations(spec) -> dict:
    """What the host checks that matter expect of a kernel, from the spec (HostSpec): the NVIDIA
    module's version loaded (nvidia.version) and each GPU on its role's driver.
    {"nvidia": "595.71.05" | None, "drivers": {"0000:01:00.0": "nvidia", "0000:41:00.0": "vfio-pci"}}"""
    return {"nvidia": spec.nvidia.version if getattr(spec, "nvidia", None) else None,
            "drivers": {bdf: g.driver for bdf, g in sorted((getattr(spec, "gpus", None) or {}).items()) if g.driver}}


def arm_trial_command(release: str, expect: dict | None = None) -> str:
    """Mark the trial as set up: TRIAL_MARKER (kept) and TRIAL_ARMED (under /run, a tmpfs: gone at
    the next boot, so a later run tells "not rebooted yet" from "the trial boot happened"). And
    TRIAL_CHECKS: which of `expect` (host_expectations) hold now, on the known-good kernel; the
    trial kernel is made the default only if they hold on it too (finish_trial_command)."""
    r = word(release + "\n")
    expect = expect or {}
    lines = []
    if expect.get("nvidia"):
        v = word(expect["nvidia"])
        lines.append(f"grep -qwF -- {v} /proc/driver/nvidia/version 2>/dev/null && echo nvidia {v}")
    for bdf, driver in (expect.get("drivers") or {}).items():
        b, d = word(bdf), word(driver)
        lines.append(f'[ "$(basename "$(readlink /sys/bus/pci/devices/{b}/driver)")" = {d} ] && echo gpu {b} {d}')
    record = "{ " + "; ".join([*lines, "true"]) + "; }"
    return (root_dirs((STATE_DIR, PRIVATE), (TRIAL_ARMED.rsplit('/', 1)[0], PUBLIC))
            + f"rm -f {word(TRIAL_UP)} && {record} > {word(TRIAL_CHECKS)} && "
            f"printf %s {r} > {word(TRIAL_MARKER)} && printf %s {r} > {word(TRIAL_ARMED)}")


# What only a trial needs on the host, removed once it is decided (finish_trial_command, pin):
# the boot unit that records the trial kernel's boot, its script, its record, the retry marker
DISARM = " ".join(word(p) for p in (TRIAL_UNIT, TRIAL_WANTS, TRIAL_UP_SCRIPT, TRIAL_UP, TRIAL_RETRIED))


def trial_up_files() -> dict[str, tuple[str, str]]:
    """The boot unit a trial arms ({path: (content, mode)}): pvegpu-kernel-trial.service, which at
    the trial kernel's boot records that it came up and whether the host checks hold
    (templates/kernel-trial-up.sh.j2), so a reset before the run's own check is told from a kernel
    that hung or panicked."""
    from plan.render import render_template

    script = render_template("kernel-trial-up.sh.j2", marker=TRIAL_MARKER, up=TRIAL_UP, checks_file=TRIAL_CHECKS)
    unit = render_template("kernel-trial-up.service.j2", marker=TRIAL_MARKER, script=TRIAL_UP_SCRIPT)
    return {TRIAL_UP_SCRIPT: (script, "700"), TRIAL_UNIT: (unit, "644")}


# The host checks after a boot, one loop for both users: the trial kernel (TRIAL_CHECKS: what held
# on the known-good kernel) and each node of a rolling reboot (plan.reboot.roll_check_lines: what
# the reboot was for). Reads lines from stdin: `nvidia <ver>`, `gpu <bdf> <driver>`, `kernel
# <release>`, `cmdline <word>`, `nocmdline <word>`; prints what does not hold and fails.
HOST_CHECKS_LOOP = _render_raw("host-checks-loop.sh.j2").strip()

# The host checks of the trial kernel: each line of TRIAL_CHECKS must hold again (prints what does not)
TRIAL_CHECKS_COMMAND = f"if [ -f {TRIAL_CHECKS} ]; then {{ {HOST_CHECKS_LOOP}; }} < {TRIAL_CHECKS}; fi"


def host_checks_command(lines: list[str]) -> str:
    """HOST_CHECKS_LOOP over `lines` (each `<what> <a> [<b>]`): fails printing what does not hold."""
    return f"printf '%s\\n' {' '.join(word(line) for line in lines) or word('')} | {{ {HOST_CHECKS_LOOP}; }}"


# Evidence of a trial that did not come up, kept for the next runs: the trial boot's last journal
# lines when the journal is persistent (/var/log/journal; systemd journald.conf Storage=auto keeps
# it only there) and holds a boot of the trial kernel (the boot before this one: journalctl -b -1;
# its kernel's first message names the release), else why there is none
_JOURNAL_EVIDENCE = (
    "if [ ! -d /var/log/journal ]; then journal='not persistent (no /var/log/journal): the trial boot left no log "
    "here; look at the console (BMC)'; "
    "elif journalctl -b -1 -k -o cat --no-pager 2>/dev/null | grep -m 1 '^Linux version ' | grep -qF \"Linux version $rel \"; "
    f"then journalctl -b -1 -n 40 -o short-monotonic --no-pager > {TRIAL_LOG} 2>&1; journal='the trial boot log: {TRIAL_LOG}'; "
    "else journal=\"persistent, but no boot of $rel in it (journalctl --list-boots): it stopped before journald wrote "
    "to /var/log/journal (initramfs)\"; fi"
)


def finish_trial_command(release: str, loader: str, wanted_build_id: str, advanced_id: str | None = None,
                         fail: bool = True) -> str:
    """After the boot a trial was set up for: if the host runs `release` and the host checks that
    held on the known-good kernel hold on it too (TRIAL_CHECKS: the NVIDIA module loads, every GPU
    on its driver), make it the default for good; else keep the evidence (TRIAL_FAILED: the
    release, its build id, the kernel that came up, the failed checks, what the journal kept of
    the trial boot, TRIAL_LOG) so later runs report it and do not try again until the spec
    changes. Either way the trial's one-shot is cleared and the marker goes. `fail`: exit 1 after
    a failed trial."""
    q = word(release)
    clear = clear_oneshot_command(release, loader)
    record = (f"printf '{{\"release\": \"%s\", \"build_id\": \"%s\", \"came_up_on\": \"%s\", \"checks\": \"%s\", "
              f"\"journal\": \"%s\"}}\\n' {q} {word(wanted_build_id)} \"$(uname -r)\" "
              f"\"$(printf %s \"$checks\" | tr -d '\"\\\\')\" \"$(printf %s \"$journal\" | tr -d '\"\\\\')\" > {word(TRIAL_FAILED)}")
    message = word(f"pvegpu: the trial boot of {release} came up on ")
    tail = word("; the default stays on the known-good kernel and the trial is not tried again until "
                       f"the spec changes (rm {TRIAL_FAILED} to try again)")
    return (
        f"rel={q}; checks=; journal=; "
        f'if [ "$(uname -r)" = {q} ] && checks=$({TRIAL_CHECKS_COMMAND}); then {zfs_guard_command(release)} && '
        f"{set_default_command(release, loader, advanced_id)} && {clear} && "
        f"rm -f {word(TRIAL_MARKER)} {word(TRIAL_PENDING)} {word(TRIAL_FAILED)} {word(TRIAL_CHECKS)} {DISARM}; "
        f'else if [ "$(uname -r)" != {q} ]; then checks=; {_JOURNAL_EVIDENCE}; '
        "else journal='the trial kernel is running'; fi; "
        f"{record} && {clear} && rm -f {word(TRIAL_MARKER)} {word(TRIAL_PENDING)} {word(TRIAL_CHECKS)} {DISARM} && "
        f'echo {message}"$(uname -r)"${{checks:+", but the host checks failed:$checks"}}{tail} >&2'
        f'{"; exit 1" if fail else ""}; fi'
    )


# GRUB_DEFAULT as the install's update-grub will read it (grub util/grub-mkconfig.in sources
# /etc/default/grub, then /etc/default/grub.d/*.cfg, where the boot stage's drop-in sets it)
GRUB_KEEP_CHECK = ("{ ( . /etc/default/grub; for f in /etc/default/grub.d/*.cfg; do [ -e \"$f\" ] && . \"$f\"; done; "
                   "[ \"$GRUB_DEFAULT\" = saved ] ) >/dev/null 2>&1 || { echo 'pvegpu: GRUB_DEFAULT is not saved "
                   "(the boot stage writes it in /etc/default/grub.d/pvegpu.cfg): GRUB would boot the new kernel, its "
                   "first entry, so it is not installed' >&2; exit 1; }; }")


def keep_default_command(known_good: str, loader: str, advanced_id: str | None = None) -> str:
    """Before a kernel package is installed (trial or not, `default_loader`): make the known-good
    (running) kernel the default by name, so the package's postinst (zz-proxmox-boot /
    zz-update-grub) does not make the new one the default: without a pin, zz-proxmox-boot writes
    `default proxmox-*` (the newest entry), and with GRUB_DEFAULT=saved and no saved_entry, or an
    index one such as a stock install's `0`, GRUB boots the first entry (the newest). On GRUB the
    configuration must say GRUB_DEFAULT=saved, else nothing is installed."""
    command = set_default_command(known_good, loader, advanced_id)
    return f"{GRUB_KEEP_CHECK} && {command}" if loader == GRUB else command


NEXT_BOOT_PIN = "/etc/kernel/next-boot-pin"  # proxmox-kernel-helper functions NEXT_BOOT_PIN (`kernel pin --next-boot`)


def reassert_default_command(known_good: str, loader: str, advanced_id: str | None = None) -> str:
    """Right before a trial is armed: make the known-good kernel the default again by name,
    whatever moved it since the install (issue 38 2.2: a kernel hook's pin moved onto the trial
    kernel) and drop a stale `kernel pin --next-boot` (2.9): zz-proxmox-boot set_systemd_boot_default
    (in grub mode set_grub_default, as GRUB_DEFAULT on each ESP)
    writes the next-boot pin, not the pin, as loader.conf's default until proxmox-boot-cleanup.service
    removes it at a boot that reached user space. The refresh also rewrites every ESP's entries from
    /etc/kernel/cmdline (zz-proxmox-boot copy_and_config_kernels), so the trial entry, a copy of the
    release's entry, carries today's options (2.9). oneshot_command(keep=) then verifies it."""
    command = keep_default_command(known_good, loader, advanced_id)
    if loader == GRUB:
        return command
    # proxmox-boot-tool unpin_kernel: --next-boot removes only NEXT_BOOT_PIN (the pin stays)
    return f"{{ [ ! -e {NEXT_BOOT_PIN} ] || proxmox-boot-tool kernel unpin --next-boot; }} && {command}"


def trial_pending_command(release: str) -> str:
    """Mark `release` as the kernel under a trial before its package is installed (TRIAL_PENDING),
    so the kernel hook (templates/kernel-postinst-nvidia.sh.j2, run by its postinst) never makes it the
    default: only the trial's pass does (finish_trial_command)."""
    return root_dirs((STATE_DIR, PRIVATE)) + f"printf '%s\\n' {word(release)} > {word(TRIAL_PENDING)}"


# -- kernel.remove_old ---------------------------------------------------------------------

# Kernel image packages and the release each carries: Proxmox's proxmox-kernel-<rel>-signed (and
# the unsigned proxmox-kernel-<rel>), the older pve-kernel-<rel>, Debian's linux-image-<rel>
# (-unsigned); proxmox-kernel-helper kernel_keep_versions() reads the same names. Series and
# default meta packages (proxmox-kernel-6.8, proxmox-default-kernel, linux-image-amd64) carry no
# release and never match.
_KERNEL_PACKAGE = re.compile(r"^(?:proxmox-kernel-|pve-kernel-|linux-image-)(\d+\.\d+(?:\.\d+)?-\S+?)(?:-signed|-unsigned)?$")


def package_release(package: str) -> str | None:
    if package.endswith(("-dbg", "-dbgsym")):
        return None
    match = _KERNEL_PACKAGE.match(package)
    return match.group(1) if match else None


def old_kernel_packages(packages: list[str], keep: set[str | None]) -> list[str]:
    """The installed kernel image packages whose release is not in `keep` (the running kernel,
    the loader default, the spec's), sorted."""
    return sorted(p for p in packages if package_release(p) and package_release(p) not in keep)


def purge_command(packages: list[str]) -> str:
    """apt-get purge of exactly `packages`: a simulation first, and nothing is removed when apt
    would remove more (a meta package such as proxmox-default-kernel, and proxmox-ve with it,
    depending on one of them)."""
    names = " ".join(word(p) for p in packages)
    wanted = word("\n".join(sorted(packages)))
    return (f"sim=$(apt-get -s -y purge {names} | awk '/^(Remv|Purg) / {{print $2}}' | sort -u); "
            f'if [ "$sim" != {wanted} ]; then echo "pvegpu: kernel.remove_old: apt would also remove: '
            f"$(printf '%s\\n' \"$sim\" | grep -vxF -e {' -e '.join(word(p) for p in packages)} | tr '\\n' ' ')"
            f'; nothing removed" >&2; exit 1; fi; '
            f"DEBIAN_FRONTEND=noninteractive apt-get -y purge {names}")



# mokutil --test-key states that leave the kernel unbootable under Secure Boot (facts.nvidia.parse_mok)
MOK_REFUSED = {
    "not enrolled": "is not enrolled as a machine owner key (mokutil --test-key)",
    "pending": "is imported but not enrolled: its MokManager confirmation at boot was never done",
    "blocked": "is blocked (in dbx or MokListX)",
    "not DER": "is not a DER certificate, so whether it is enrolled cannot be told (openssl x509 -outform DER)",
}


def secure_boot_refusal(kernel: KernelSpec, build: dict) -> str | None:
    """With Secure Boot on, why the spec's kernel cannot be booted, naming the field; else None.

    Proxmox boots a Secure Boot host through shim + GRUB (pve-docs system-booting.adoc), and shim
    verifies the kernel image GRUB loads: the stage's build must be signed (kernel.signing, sbsign)
    with a certificate the firmware trusts, the MOK list (`mokutil --test-key`)."""
    if not build.get("secure_boot"):
        return None
    if kernel.signing is None:
        return (f"Secure Boot is on: shim verifies the kernel image GRUB loads, and the build of {kernel.version} is "
                "not signed, so it would not boot. Set kernel.signing (key: a PEM private key, cert: its DER "
                "certificate, enrolled with mokutil --import and confirmed in MokManager at the next boot), or turn "
                "Secure Boot off in the firmware, or keep Proxmox's signed kernels (drop spec.kernel)")
    key_refusal = signing_key_refusal("kernel.signing.key", kernel.signing.key, build.get("signing_key_mode"))
    if key_refusal:
        return key_refusal
    cert = kernel.signing.cert
    mok = build.get("mok")
    if mok in MOK_REFUSED:
        return (f"kernel.signing.cert {cert} {MOK_REFUSED[mok]}; with Secure Boot on, shim would refuse the kernel "
                f"{kernel.version} signed with it. Enroll it (mokutil --import {cert}, then confirm in MokManager at "
                "the next boot) or name an enrolled one")
    if mok not in ("enrolled", "in db"):
        return (f"kernel.signing.cert {cert}: whether it is enrolled is unknown (no answer from mokutil --test-key); "
                "with Secure Boot on an unenrolled key leaves the kernel unbootable. Install mokutil")
    if not build.get("sbsign"):
        return "kernel.signing is set but sbsign is not installed on the host: apt-get install sbsigntool"
    if build.get("esps"):
        return ("Secure Boot is on and this host boots from proxmox-boot-tool ESPs, which Proxmox runs through shim + "
                "GRUB there; the kernel stage sets up a one-boot trial only with GRUB from /boot/grub or systemd-boot")
    return None


def sign_command(release: str, key: str, cert: str) -> str:
    """Sign /boot/vmlinuz-<release> with kernel.signing (templates/kernel-sign.sh.j2)."""
    from plan.render import render_template
    return f"/bin/sh -c {word(render_template('kernel-sign.sh.j2', release=release, key=key, cert=cert))}"


def zfs_guard_command(release: str) -> str:
    """Fails, naming the features, when / is on a ZFS pool with a feature enabled or active that
    the ZFS module of `release` does not know (templates/kernel-zfs-guard.sh.j2); else nothing."""
    from plan.render import render_template
    return f"/bin/sh -c {word(render_template('kernel-zfs-guard.sh.j2', release=release))}"
