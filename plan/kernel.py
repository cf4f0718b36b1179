"""What the kernel stage does, from spec + facts (pure: no I/O, no host state).

    build_jobs(cores, mem_total_kib)               -> 12     # -j: min(cores, RAM / 2 GiB), >= 1
    build_id(kernel_spec, base_config)             -> "3f0c…"  # source + ref/sha + config, hashed
    build_dir(kernel_spec, base_config)            -> "/var/lib/pvegpu/kernel-build/6.14.8-2-pve-3f0c1a2b3c4d"
    kernel_decision(kernel_spec, facts, base_config) -> {"action": "build"|"attach"|"install"|"trial"|"await-reboot"|
                                                   "finish"|"pin"|"done"|"failed-trial"|"wrong-debs", "why": …}
    release_from_makefile(pve_kernel_makefile_text) -> "6.14.11-9-bpo12-pve"   # Proxmox's release of a ref (facts.kernel)
    built_release_from_makefile(text)              -> "6.14.11-9-bpo12-pvegpu-pve"  # what our build of it produces
    build_memory_max_kib(mem_total_kib, jobs)      -> MemoryMax= of the detached build
    package_globs(kind, release)                   -> ["linux-image-6.1.0-pvegpu_*.deb", …]
    boot loader interface (one trial = one boot; see the section below):
    trial_loader(build_facts)                      -> ("systemd-boot"|"grub", None) or (None, why not)
    set_default_command(release, loader, adv_id)   # the default for good
    oneshot_command(release, loader, panic_s, adv_id)  # the next boot only (systemd-boot: with panic=)
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
    LOCAL_KREL_SUFFIX,
    STATE_DIR,
    TRIAL_ARMED,
    TRIAL_FAILED,
    TRIAL_MARKER,
    built_release_from_makefile,
    makefile_variables,
    release_from_makefile,
)

# The kernel stage's host paths and pve-kernel's Makefile reader live with the fact that reads
# them (facts.kernel); plan.kernel names them too, for its own use and its callers'.
from facts.shell import operands, word
from spec.models import KernelSpec

GIB_KIB = 1024 * 1024
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


def debs_of_release(kind: str, release: str, debs: list[str]) -> bool:
    """Did a build leave the packages of `release` (package_globs) among `debs`?"""
    return all(any(fnmatch.fnmatch(d, g) for d in debs) for g in package_globs(kind, release))


def package_globs(kind: str, release: str) -> list[str]:
    """The .debs a build leaves in its build dir (relative names, shell globs)."""
    if kind == "proxmox-git":
        # pve-kernel's `make deb`: proxmox-kernel-<rel>_*.deb, proxmox-headers-<rel>_*.deb
        return [f"proxmox-kernel-{release}_*.deb", f"proxmox-headers-{release}_*.deb"]
    return [f"linux-image-{release}_*.deb", f"linux-headers-{release}_*.deb"]


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
            return {"action": "finish",
                    "why": f"the trial boot of {release} came up on {running}: the loader's one-shot was used and "
                           f"{default or running} stays the default; recording it (not tried again until the spec changes)"}
        if running == release:
            if default != release:
                return {"action": "pin", "why": f"{release} is running; make it the default for good"}
            return {"action": "done", "why": f"{release} (built from the same source and config) is installed, running and the default"}
        if failed.get("release") == release and failed.get("build_id") == wanted:
            return {"action": "failed-trial",
                    "why": f"the trial boot of {release} came up on {failed.get('came_up_on')}; {default or running} "
                           f"stays the default and {release} is not tried again until the spec changes "
                           f"(look at the console/journal of that boot; rm {TRIAL_FAILED} to try again)"}
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
#   grub-set-default.in, through grub-editenv). Entries are named by their ids, as
#   proxmox-kernel-helper set_grub_default() names them.

SYSTEMD_BOOT = "systemd-boot"
GRUB = "grub"
TRIAL_ENTRY_PREFIX = "pvegpu-trial-"
GRUBENV = "/boot/grub/grubenv"
REFRESH = "proxmox-boot-tool refresh"
# grub-mkconfig writes GRUB_DEFAULT=saved as `set default="${saved_entry}"` (00_header.in); without
# it grub-set-default changes nothing and the newest kernel stays the default
GRUB_SAVED_CHECK = ("{ grep -q 'set default=\"${saved_entry}\"' /boot/grub/grub.cfg || { echo 'pvegpu: GRUB_DEFAULT "
                    "is not saved in the generated /boot/grub/grub.cfg (the boot stage writes it in "
                    "/etc/default/grub.d/pvegpu.cfg): no trial without it' >&2; exit 1; }; }")


def trial_entry(release: str) -> str:
    """The systemd-boot loader entry of a trial boot (a file name on each ESP)."""
    return f"{TRIAL_ENTRY_PREFIX}{release}.conf"


def grub_entry_id(release: str, advanced_id: str) -> str:
    """GRUB's id path of a kernel's entry in the "Advanced options" submenu that grub-mkconfig's
    10_linux writes: `gnulinux-advanced-<dev>>gnulinux-<rel>-advanced-<dev>` (the form
    proxmox-kernel-helper set_grub_default() uses; <dev> is read from /boot/grub/grub.cfg)."""
    return f"gnulinux-advanced-{advanced_id}>gnulinux-{release}-advanced-{advanced_id}"


def grub_release_of(entry: str | None) -> str | None:
    """The kernel release a grub_entry_id names (None for anything else)."""
    match = re.match(r"^gnulinux-advanced-(.+)>gnulinux-(.+)-advanced-\1$", entry or "")
    return match.group(2) if match else None


def set_default_command(release: str, loader: str, advanced_id: str | None = None) -> str:
    """Make `release` the loader default for good (every later boot)."""
    if loader == SYSTEMD_BOOT:
        # proxmox-boot-tool (proxmox-kernel-helper bin/proxmox-boot-tool) reads the release as "$2",
        # no '--': a leading '-' is refused (kernel.version starts with a digit at load)
        return f"proxmox-boot-tool kernel pin {operands(release, '')} && {REFRESH}"
    if not advanced_id:
        raise ValueError("a GRUB default needs the Advanced-options id of /boot/grub/grub.cfg")
    # grub-set-default/grub-reboot (grub util/grub-set-default.in): any '-*' is an unknown option,
    # no '--'; the entry id starts with 'gnulinux-'
    return f"grub-set-default {operands(grub_entry_id(release, advanced_id), '')}"


def oneshot_command(release: str, loader: str, panic_s: int, advanced_id: str | None = None) -> str:
    """Boot `release` once, at the next boot only; the default stays where it is.

    systemd-boot: the trial entry (templates/kernel-trial-entry.sh.j2, panic=<panic_s>) on every
    ESP and the one-shot variable. GRUB: `grub-reboot` (next_entry); GRUB's entries all share
    GRUB_CMDLINE_LINUX*, so a GRUB trial carries no panic= of its own."""
    if loader == SYSTEMD_BOOT:
        return trial_entry_command(release, "arm", panic_s)
    if not advanced_id:
        raise ValueError("a GRUB one-shot needs the Advanced-options id of /boot/grub/grub.cfg")
    return f"update-grub && {GRUB_SAVED_CHECK} && grub-reboot {operands(grub_entry_id(release, advanced_id), '')}"


def clear_oneshot_command(release: str, loader: str) -> str:
    """Forget a trial: its systemd-boot entries, or GRUB's next_entry (grub-editenv unset)."""
    if loader == SYSTEMD_BOOT:
        return trial_entry_command(release, "clear", 0)
    return f"grub-editenv {GRUBENV} unset next_entry"


def trial_entry_command(release: str, mode: str, panic_s: int) -> str:
    from plan.render import render_template
    script = render_template("kernel-trial-entry.sh.j2", release=release, mode=mode, entry=trial_entry(release),
                             panic_s=int(panic_s))
    return f"unshare --mount --propagation private /bin/sh -c {word(script)}"


def trial_loader(build: dict) -> tuple[str | None, str | None]:
    """(loader, None) where a one-boot trial can be set up, else (None, why not).

    `build`: KernelStageFacts["build"]. systemd-boot where proxmox-boot-tool lists ESPs on a UEFI
    boot; GRUB where it reads /boot/grub/grubenv from a plain file system: GRUB cannot write
    its environment block on LVM or RAID (diskfilter), so next_entry would stay set and the trial
    kernel would boot at every reset (Debian's grub-reboot warns of exactly this)."""
    if build.get("esps"):
        if build.get("uefi"):
            return SYSTEMD_BOOT, None
        return None, ("proxmox-boot-tool keeps GRUB on ESPs here (legacy BIOS boot): its grubenv is on the ESP "
                      "and no one-shot is set up for it")
    abstraction = build.get("grubenv_abstraction")
    if abstraction is None:
        return None, (f"grub-probe could not tell what holds {GRUBENV}: whether GRUB can clear next_entry "
                      "after one boot is unknown")
    if {"lvm", "diskfilter"} & set(abstraction.split()):
        return None, (f"{GRUBENV} is on {abstraction}: GRUB cannot write its environment there, so a grub-reboot "
                      "one-shot is never cleared and a trial kernel that does not come up would boot at every reset")
    if not build.get("grub_advanced_id"):
        return None, "/boot/grub/grub.cfg has no 'Advanced options' submenu id (gnulinux-advanced-…) to name entries by"
    # GRUB_DEFAULT=saved comes with the boot stage's drop-in, written earlier in the same run; the
    # one-shot checks the regenerated grub.cfg for it (GRUB_SAVED_CHECK)
    return GRUB, None


def default_release(kernels: dict, build: dict, loader: str | None) -> str | None:
    """The kernel the loader boots by default: the pin (systemd-boot), grubenv saved_entry (GRUB)."""
    if loader == GRUB:
        return grub_release_of(build.get("grub_saved"))
    return kernels.get("pinned")


def arm_trial_command(release: str) -> str:
    """Mark the trial as set up: TRIAL_MARKER (kept) and TRIAL_ARMED (under /run, a tmpfs: gone at
    the next boot, so a later run tells "not rebooted yet" from "the trial boot happened")."""
    r = word(release + "\n")
    return (f"mkdir -p {word(STATE_DIR)} {word(TRIAL_ARMED.rsplit('/', 1)[0])} && "
            f"printf %s {r} > {word(TRIAL_MARKER)} && printf %s {r} > {word(TRIAL_ARMED)}")


def finish_trial_command(release: str, loader: str, wanted_build_id: str, advanced_id: str | None = None,
                         fail: bool = True) -> str:
    """After the boot a trial was set up for: if the host runs `release`, make it the default for
    good; else keep the evidence (TRIAL_FAILED: the release, its build id, the kernel that came
    up) so later runs report it and do not try again until the spec changes. Either way the
    trial's one-shot is cleared and the marker goes. `fail`: exit 1 after a failed trial."""
    q = word(release)
    clear = clear_oneshot_command(release, loader)
    record = (f"printf '{{\"release\": \"%s\", \"build_id\": \"%s\", \"came_up_on\": \"%s\"}}\\n' {q} "
              f"{word(wanted_build_id)} \"$(uname -r)\" > {word(TRIAL_FAILED)}")
    message = word(f"pvegpu: the trial boot of {release} came up on ")
    tail = word("; the default stays on the known-good kernel and the trial is not tried again until "
                       f"the spec changes (rm {TRIAL_FAILED} to try again)")
    return (
        f'if [ "$(uname -r)" = {q} ]; then {set_default_command(release, loader, advanced_id)} && {clear} && '
        f"rm -f {word(TRIAL_MARKER)} {word(TRIAL_FAILED)}; "
        f"else {record} && {clear} && rm -f {word(TRIAL_MARKER)} && "
        f'echo {message}"$(uname -r)"{tail} >&2{"; exit 1" if fail else ""}; fi'
    )


def keep_default_command(known_good: str, loader: str, advanced_id: str | None = None) -> str:
    """Before a kernel package is installed: make the known-good (running) kernel the default, so
    the package's postinst (zz-proxmox-boot / zz-update-grub) does not make the new one the
    default: without a pin, zz-proxmox-boot writes `default proxmox-*` (the newest entry), and
    with GRUB_DEFAULT=saved and no saved_entry GRUB boots the first entry (the newest)."""
    return set_default_command(known_good, loader, advanced_id)


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



def zfs_guard_command(release: str) -> str:
    """Fails, naming the features, when / is on a ZFS pool with a feature enabled or active that
    the ZFS module of `release` does not know (templates/kernel-zfs-guard.sh.j2); else nothing."""
    from plan.render import render_template
    return f"/bin/sh -c {word(render_template('kernel-zfs-guard.sh.j2', release=release))}"
