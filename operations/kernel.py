"""Stage 2, kernel: build the spec's kernel on the host with its own gcc, install the .debs
next to the running kernel, and trial-boot the new one (pinned for good only once it came up).

A build takes an hour or more on a real host, so it runs detached: a transient systemd unit
(`systemd-run --unit pvegpu-kernel-build`, with MemoryMax= so an OOM kills the build and not the
host) where systemd runs, else `setsid nohup` (the twin has no running systemd). For
proxmox-git the release is pve-kernel's Makefile KVNAME at the pinned ref (preflight refuses a
spec version that disagrees); pins are followed by `proxmox-boot-tool refresh` where ESPs are
listed (the pin alone only writes the pin file there). The deploy waits, printing progress from the build log; a re-run
while the build runs attaches to it instead of starting a second one. The build dir holds
build.sh, build.log, build.pid, build.rc (exit status), the .debs and manifest.json
(compiler, source ref/sha, config hash); the manifest of an installed build is kept in
/var/lib/pvegpu/kernel/<release>.json so a re-run skips what is already there.

Facts: one batched remote command (`facts.kernel.KernelStageFacts`).
"""

from __future__ import annotations

import shlex

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, deploy, operation

from facts.kernel import KernelStageFacts
from facts.once import fact_once
from facts.run_state import need_reboot, record_trial_boot
from operations import progress
from operations.files import write_file_command
from plan import kernel as plan
from plan.render import render_template
from spec.models import HostSpec, KernelSpec

POLL_S = 10.0
BUILD_TIMEOUT_S = 6 * 3600


def base_config_of(kernel: KernelSpec) -> str:
    """`running` (the booted kernel's /boot/config-*), `tinyconfig`/`defconfig`/`allnoconfig`,
    or a path on the host (spec field `kernel.base_config`)."""
    return kernel.base_config or "running"


def start_build_command(build_dir: str, systemd: bool, memory_max_kib: int | None = None) -> str:
    """Start build.sh detached; a no-op when it already runs (a re-run attaches instead).
    Under systemd the unit gets MemoryMax= (an OOM kills the build's cgroup, not the host).
    (templates/kernel-build-start.sh.j2)"""
    return render_template("kernel-build-start.sh.j2", build_dir=build_dir, systemd=systemd, unit=plan.BUILD_UNIT,
                           memory_max_kib=int(memory_max_kib) if memory_max_kib else None)


def build_script(k: KernelSpec, base: str, jobs: int, build_dir: str) -> str:
    """build.sh of one build (templates/kernel-build.sh.j2): the spec's values, each quoted there."""
    return render_template(
        "kernel-build.sh.j2", build_dir=build_dir, version=k.version, kind=k.source.kind, jobs=int(jobs),
        ccache=k.ccache, base_config=base, fragments=list(k.config_fragments),
        url=k.source.url, sha256=k.source.sha256 or "", ref=k.source.ref or "", localversion=plan.localversion(k),
        pkgversion="1")


def wait_for_build(state, host, build_dir: str, total: int | None, poll_s: float = POLL_S,
                   timeout_s: float = BUILD_TIMEOUT_S, key: str | None = None):
    """Follow a detached build until build.rc appears, reporting progress (operations.progress);
    False (op fails) on error."""
    return progress.follow_detached(state, host, "kernel build", build_dir, f"{build_dir}/build.log", key=key,
                                    total=total, poll_s=poll_s, timeout_s=timeout_s)


@operation()
def build_kernel(build_dir: str, script: str, manifest_in: str, systemd: bool, total: int | None, start: bool = True,
                 memory_max_kib: int | None = None, record: str | None = None):
    """Write build.sh + manifest template, start the build detached (unless it runs), wait for it.

    + build_dir: scratch dir of this build (plan.kernel.build_dir)
    + script: rendered templates/kernel-build.sh.j2
    + manifest_in: rendered templates/kernel-build-manifest.json.j2 (placeholders filled by build.sh)
    + systemd: run as a transient systemd unit (else setsid nohup)
    + total: objects of an earlier build of the same config, for progress (None: unknown)
    + start: False to attach to a build that already runs
    + memory_max_kib: MemoryMax= of the systemd unit (plan.kernel.build_memory_max_kib)
    + record: key under which the build's time is kept (operations.progress)
    """
    if start:
        yield StringCommand(write_file_command(f"{build_dir}/build.sh", script, "755", keep_previous=False))
        yield StringCommand(write_file_command(f"{build_dir}/manifest.json.in", manifest_in, "644", keep_previous=False))
        yield StringCommand(start_build_command(build_dir, systemd, memory_max_kib))
    yield FunctionCommand(wait_for_build, (build_dir, total), {"key": record} if record else {})


@operation()
def install_kernel(build_dir: str, release: str, kind: str, keep_default: str | None = None):
    """dpkg -i the build's image + headers .debs (the running kernel stays installed) and keep
    its manifest in /var/lib/pvegpu/kernel/<release>.json.

    + keep_default: pin this (running) kernel first, so the ESP sync the package's postinst
      runs keeps it the loader default (set where ESPs are listed and nothing is pinned)
    """
    d = shlex.quote(build_dir)
    if keep_default:
        yield StringCommand(plan.keep_default_command(keep_default))
    globs = " ".join(f"{d}/{g}" for g in plan.package_globs(kind, release))
    manifest = shlex.quote(f"{plan.STATE_DIR}/{release}.json")
    yield StringCommand(f"DEBIAN_FRONTEND=noninteractive dpkg -i {globs}")
    yield StringCommand(f"mkdir -p {shlex.quote(plan.STATE_DIR)} && cp {d}/manifest.json {manifest}")


@operation()
def trial_boot(release: str, pin_tool: str, esps: bool = False, keep_default: str | None = None):
    """Select `release` for the next boot only (pin, then refresh where ESPs are listed) and
    leave a marker the next run checks (written last: a failed refresh leaves none).

    + keep_default: pin this (running) kernel for good first, so a trial that fails falls back
      to it after proxmox-boot-cleanup's refresh (set where ESPs are listed and nothing is pinned)
    """
    if keep_default:
        yield StringCommand(plan.keep_default_command(keep_default))
    yield StringCommand(plan.trial_pin_command(release, pin_tool, esps))
    yield StringCommand(write_file_command(plan.TRIAL_MARKER, release + "\n", "644", keep_previous=False))


@operation()
def pin_kernel(release: str, pin_tool: str, esps: bool = False):
    """Pin `release` for good (it is running), refreshed where ESPs are listed."""
    yield StringCommand(plan.pin_for_good_command(release, pin_tool, esps))


@operation()
def remove_old_kernels(releases: list[str], kind: str):
    """Purge the given releases' image packages (opt-in: spec.kernel.remove_old)."""
    if not releases:
        host.noop("no old kernels to remove")
        return
    prefix = "proxmox-kernel-" if kind == "proxmox-git" else "linux-image-"
    packages = " ".join(shlex.quote(prefix + r) for r in releases)
    yield StringCommand(f"DEBIAN_FRONTEND=noninteractive apt-get -y purge {packages}")


def stage_facts(k: KernelSpec) -> dict:
    base = base_config_of(k)
    return fact_once(KernelStageFacts, **fact_args(k, base))


def fact_args(k: KernelSpec, base: str) -> dict:
    args: dict[str, str | None] = {"build_dir": plan.build_dir(k, base), "release": k.version}
    if k.source.kind == "proxmox-git":
        args.update(url=k.source.url, ref=k.source.ref)
    return args


def preflight(spec: HostSpec) -> list[str]:
    k = spec.kernel
    if k is None:
        return []
    if k.source.kind == "proxmox-git" and k.config_fragments:
        return ["kernel.config_fragments apply to tarball builds; a proxmox-git build uses the Proxmox "
                "kernel's own config (patch the repository or build from a tarball instead)"]
    facts = stage_facts(k)
    refusals = []
    source = facts.get("source")
    if source:
        refusal = plan.release_refusal(k, source["release"], f"{host.name}:{source['from']}")
        if refusal:
            refusals.append(refusal)
    decision = plan.kernel_decision(
        k, {"kernels": facts["kernels"], "installed_manifest": facts["build"]["installed_manifest"],
            "build": facts["build"], "trial": facts["build"]["trial"]}, base_config_of(k))
    if decision["action"] == "wrong-debs":
        refusals.append(decision["why"])
    if k.source.kind == "proxmox-git" and decision["action"] == "build" and facts["build"].get("headers_installed"):
        # pve-kernel debian/control: Build-Conflicts: proxmox-headers-<KVNAME>; mk-build-deps would remove them
        refusals.append(f"proxmox-headers-{k.version} is installed and pve-kernel's debian/control Build-Conflicts "
                        f"with it: building {k.version} again would remove the headers the NVIDIA stage builds "
                        f"against; purge them first (apt-get purge proxmox-headers-{k.version}) or build another KREL")
    return refusals


def prefetch(spec: HostSpec) -> list:
    """The facts this stage reads (deploy.py reads every stage's in one command)."""
    k = spec.kernel
    if k is None:
        return []
    return [(KernelStageFacts, fact_args(k, base_config_of(k))), *progress.prefetch()]


@deploy("pvegpu: kernel")
def apply(spec: HostSpec) -> None:
    k = spec.kernel
    if k is None:
        return
    base = base_config_of(k)
    build_dir = plan.build_dir(k, base)
    facts = stage_facts(k)
    build = facts["build"]
    decision = plan.kernel_decision(
        k, {"kernels": facts["kernels"], "installed_manifest": build["installed_manifest"],
            "build": build, "trial": build["trial"]}, base)
    pin_tool = "proxmox-boot-tool" if build["pbt"] else "grub"
    action = decision["action"]
    logger.info(f"{host.name}: kernel {k.version}: {decision['why']}")

    if action in ("build", "attach"):
        jobs = plan.resolve_jobs(k.jobs, build["cores"], build["mem_total_kib"])
        manifest_in = render_template(
            "kernel-build-manifest.json.j2", build_id=plan.build_id(k, base), version=k.version, kind=k.source.kind,
            url=k.source.url, ref=k.source.ref or k.source.sha256, base_config=base,
            fragments=list(k.config_fragments), jobs=jobs)
        last = progress.announce(f"kernel {k.version} build", f"kernel-{plan.build_id(k, base)}")
        total = (build["manifest"] or {}).get("objects") or (last or {}).get("objects") or None
        build_kernel(
            name=f"Build kernel {k.version} ({k.source.kind}, -j{jobs}, detached)",
            build_dir=build_dir, script=build_script(k, base, jobs, build_dir), manifest_in=manifest_in,
            systemd=build["systemd"], total=total, start=action == "build", record=f"kernel-{plan.build_id(k, base)}",
            memory_max_kib=plan.build_memory_max_kib(build["mem_total_kib"], jobs),
        )
    esps = build["esps"] and pin_tool == "proxmox-boot-tool"
    running = facts["kernels"].get("running")
    # where nothing is pinned, the running kernel is pinned first: the ESP sync of a kernel
    # package's postinst (and proxmox-boot-cleanup's refresh after a trial) would otherwise make
    # `proxmox-*`, the newest kernel, the default (follows zz-proxmox-boot set_systemd_boot_default)
    keep = running if esps and k.trial_boot and not facts["kernels"].get("pinned") and running else None
    if action in ("build", "attach", "install"):
        install_kernel(name=f"Install kernel {k.version} packages" + (f" ({running} pinned as the default first)" if keep else ""),
                       build_dir=build_dir, release=k.version, kind=k.source.kind, keep_default=keep)
    if action in ("build", "attach", "install", "trial") and k.trial_boot:
        trial_boot(name=f"Trial boot {k.version} on the next boot only" + (" (pin + refresh)" if esps else ""),
                   release=k.version, pin_tool=pin_tool, esps=esps, keep_default=keep if action == "trial" else None)
        action = "await-reboot"
    if action == "await-reboot":
        record_trial_boot(k.version, pin_tool, esps)
        need_reboot("kernel", f"{k.version} is installed and selected for the next boot only (trial)")
    elif action == "pin":
        pin_kernel(name=f"Pin kernel {k.version} for good" + (" (pin + refresh)" if esps else ""),
                   release=k.version, pin_tool=pin_tool, esps=esps)
    elif action == "failed-trial":
        logger.warning(f"{host.name}: {decision['why']}")
    elif action == "wrong-debs":  # refused at preflight; nothing to do here
        logger.error(f"{host.name}: kernel: {decision['why']}")
    if k.remove_old and action in ("done", "pin"):
        old = [r for r in facts["kernels"].get("installed", []) if r not in (k.version, running)]
        remove_old_kernels(name="Remove old kernels", releases=old, kind=k.source.kind)
