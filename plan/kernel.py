"""What the kernel stage does, from spec + facts (pure: no I/O, no host state).

    build_jobs(cores, mem_total_kib)               -> 12     # -j: min(cores, RAM / 2 GiB), >= 1
    build_id(kernel_spec, base_config)             -> "3f0c…"  # source + ref/sha + config, hashed
    build_dir(kernel_spec, base_config)            -> "/var/lib/pvegpu/kernel-build/6.14.8-2-pve-3f0c1a2b3c4d"
    kernel_decision(kernel_spec, facts, base_config) -> {"action": "build"|"install"|"trial"|"pin"|"done"|"failed-trial"|"wrong-debs", "why": …}
    release_from_makefile(pve_kernel_makefile_text) -> "6.14.11-9-bpo12-pve"   # the release a ref builds (facts.kernel)
    build_memory_max_kib(mem_total_kib, jobs)      -> MemoryMax= of the detached build
    package_globs(kind, release)                   -> ["linux-image-6.1.0-pvegpu_*.deb", …]
    trial_pin_command(release, pin_tool, esps) / pin_for_good_command(release, pin_tool, esps)
                                                   # + `proxmox-boot-tool refresh` where ESPs are listed

Incident 14: `-j` = cores (128) with ~2 GiB per compile job killed a machine; jobs come from
RAM as well. Incident 1: a kernel and its modules built by different GCCs left kpro6
unbootable, so the build runs on the host with its own gcc and records it in a manifest.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import shlex

# The kernel stage's host paths and pve-kernel's Makefile reader live with the fact that reads
# them (facts.kernel); plan.kernel names them too, for its own use and its callers'.
from facts.kernel import BUILD_ROOT, STATE_DIR, TRIAL_MARKER, makefile_variables, release_from_makefile  # noqa: F401
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
            f"(KVNAME of its Makefile, read from {where}); set kernel.version: {source_release} or pin another ref")


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
    "trial": release|None (TRIAL_MARKER content)}.

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
        if running == release:
            if kernels.get("pinned") != release:
                return {"action": "pin", "why": f"{release} is running; pin it for good"}
            return {"action": "done", "why": f"{release} (built from the same source and config) is installed, running and pinned"}
        if trial == release and kernels.get("next_boot") != release:
            # the next-boot pin is gone (proxmox-boot-cleanup clears it at every boot) and the
            # host runs another kernel: the trial did not come up
            return {"action": "failed-trial",
                    "why": f"the trial boot of {release} came up on {running}; {kernels.get('pinned') or running} stays pinned "
                           f"(look at the console/journal of that boot; rm {TRIAL_MARKER} to try again)"}
        if not kernel.trial_boot:
            return {"action": "done", "why": f"{release} is installed (trial_boot is off; not pinned)"}
        if kernels.get("next_boot") == release and trial == release:
            # pinned and refreshed in one operation that writes the marker last: a pin whose
            # refresh failed has no marker and is done again
            return {"action": "await-reboot", "why": f"{release} is installed and pinned for the next boot only"}
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


REFRESH = "proxmox-boot-tool refresh"
CLEANUP_UNIT = "proxmox-boot-cleanup.service"


def keep_default_command(running: str) -> str:
    """Pin the running kernel for good before a new one is installed where ESPs are listed.

    Without a pin, the ESP sync a kernel package's postinst runs (zz-proxmox-boot) sets the
    loader default to `proxmox-*`, which systemd-boot resolves to the newest kernel: the new
    one would become the default before its trial. With the pin it stays the fallback."""
    return f"proxmox-boot-tool kernel pin {shlex.quote(running)}"


def trial_pin_command(release: str, pin_tool: str, esps: bool = False) -> str:
    """Boot `release` once, next boot only (the default stays on the old kernel).

    proxmox-boot-tool with listed ESPs only writes the pin file; the loader default changes
    at `refresh` (follows proxmox-kernel-helper proxmox-boot-tool pin_kernel()), so refresh
    follows. Without ESPs, pin itself sets the GRUB default and runs update-grub."""
    q = shlex.quote(release)
    if pin_tool == "proxmox-boot-tool":
        return f"proxmox-boot-tool kernel pin {q} --next-boot" + (f" && {REFRESH}" if esps else "")
    # plain GRUB: a one-shot default (needs GRUB_DEFAULT=saved) by menu entry title
    return f"grub-reboot {shlex.quote('Advanced options for Debian GNU/Linux>Debian GNU/Linux, with Linux ' + release)}"


def pin_for_good_command(release: str, pin_tool: str, esps: bool = False) -> str:
    """Pin `release` only when it is the one running (then refresh where ESPs are listed, so
    the loader default is it); else say so and fail (old stays pinned)."""
    q = shlex.quote(release)
    if pin_tool == "proxmox-boot-tool":
        pin = f"proxmox-boot-tool kernel pin {q}" + (f" && {REFRESH}" if esps else "")
        if esps:
            # proxmox-boot-cleanup.service (unpin --next-boot + refresh) may still run right after
            # the boot; its refresh must not land after ours: wait while it is activating
            pin = (f"for _ in $(seq 60); do [ \"$(systemctl show -p ActiveState --value {CLEANUP_UNIT} "
                   f"2>/dev/null)\" = activating ] || break; sleep 1; done; {pin}")
    else:
        pin = f"grub-set-default {shlex.quote('Advanced options for Debian GNU/Linux>Debian GNU/Linux, with Linux ' + release)}"
    message = shlex.quote(f"pvegpu: the trial boot of {release} came up on ")
    tail = shlex.quote("; the previous kernel stays pinned")
    return (
        f'if [ "$(uname -r)" = {q} ]; then {pin} && rm -f {shlex.quote(TRIAL_MARKER)}; '
        f'else echo {message}"$(uname -r)"{tail} >&2; exit 1; fi'
    )
