"""Stage 7, container user space — the host's exact NVIDIA user space in each GPU container.

After the guests stage gave each CT its device nodes (and restarted it when they changed), every
running GPU container gets the user space of exactly the host's driver version (spec
``nvidia.version``) from the host's verified installer (spec ``nvidia.installer``, cached on the
host by sha256 like the NVIDIA stage does)::

    pct push <ctid> <cached .run> /root/.pvegpu-NVIDIA-Linux-x86_64-<ver>.run
    pct exec <ctid> -- sh <that> --silent --no-kernel-modules ...   (plan.containers.INSTALLER_FLAGS)
    pct exec <ctid> -- rm -f <that>
    then: libnvidia-ml.so.<ver> is there, and NVML inside reports no version mismatch when the host runs <ver>

A CT is managed when the spec gives it GPUs and ``userspace_driver`` is true, or unset with an
installer configured. Stopped CTs are skipped with the reason (pct exec needs a running CT; a run
while it runs installs it). No-change cost: one remote command (`ContainerUserspace`); the CT run
state is this run's `facts.guest_state.guest_state()` (read by the GPU stage).
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import deploy, operation

from facts.containers import ContainerUserspace
from facts.guest_state import guest_state, running_containers, with_ct_status
from facts.once import fact_once
from facts.shell import word
from operations import progress
from operations.nvidia import cached_source, fetch_source_command
from plan.containers import INSTALLER_FLAGS, LIB_DIRS, ct_installer_path, plan_userspace
from spec.models import HostSpec


def container_userspace_state(ctids: list[int]) -> dict:
    """`ContainerUserspace` of the running CTs of `ctids`, with this run's CT run state added
    (`facts.guest_state.with_ct_status`): no `pct list` of its own. The fact looks into every CT
    of `ctids` (read in the first prefetch round, beside the guest state); only the running ones
    are kept."""
    guests = guest_state()
    found = fact_once(ContainerUserspace, **_userspace_kwargs(ctids))
    running = set(running_containers(guests, ctids))
    return with_ct_status({**found, "containers": {c: v for c, v in found["containers"].items() if c in running}},
                          guests)


def _userspace_kwargs(ctids: list[int]) -> dict:
    """`ContainerUserspace`'s arguments: the CTs of `ctids` (the spec's alone, so the stage's
    facts go in the first prefetch round; `container_userspace_state` keeps the running ones)."""
    return {"ctids": sorted(int(c) for c in ctids)}


def prefetch(spec: HostSpec) -> list:
    """The facts this stage reads up front (deploy.py reads every stage's in one command)."""
    managed = managed_containers(spec)
    return [(ContainerUserspace, _userspace_kwargs(sorted(managed))), *progress.prefetch()] if managed else []


def install_command(ctid: int, version: str, installer_url: str, sha256: str, cached: str,
                    check_nvml: bool) -> str:
    """One shell command: fetch+verify the installer on the host (if not cached), push it into the
    CT, run it without kernel modules, remove it, check the library (and, when the host runs
    `version`, that NVML inside does not report a driver/library version mismatch). Every value
    is quoted."""
    # pct parses with Getopt::Long (pve-common JSONSchema.pm get_options): its operands here are the
    # CT id (an int >= 100 from the spec) and absolute paths pvegpu makes, never an option
    q_ct, inside = word(str(int(ctid))), ct_installer_path(version)
    q_in = word(inside)
    flags = " ".join(INSTALLER_FLAGS)
    lib_check = " || ".join(f"[ -e {word(f'{d}/libnvidia-ml.so.{version}')} ]" for d in LIB_DIRS)
    failed = word(f"pvegpu: the NVIDIA {version} installer failed in CT {ctid} (exit ")
    failed_tail = word("); see /var/log/nvidia-installer.log inside it")
    nolib = word(f"pvegpu: after the install CT {ctid} has no libnvidia-ml.so.{version}")
    nvml = word(f"pvegpu: nvidia-smi fails in CT {ctid} after installing {version}: ")
    parts = [
        f"( {fetch_source_command(installer_url, sha256, cached)} )",
        f"pct push {q_ct} {word(cached)} {q_in} --perms 0700",
        f"{{ pct exec {q_ct} -- sh {q_in} {flags}; rc=$?; pct exec {q_ct} -- rm -f {q_in}; "
        f"[ $rc -eq 0 ] || {{ echo {failed}\"$rc\"{failed_tail} >&2; exit 1; }}; }}",
        f"{{ pct exec {q_ct} -- sh -c {word(lib_check)} || {{ echo {nolib} >&2; exit 1; }}; }}",
    ]
    if check_nvml:
        # Only NVML's verdict on the versions is this stage's to judge: nvidia-smi also fails while
        # the CT's device nodes wait for a pending reboot (the guests stage reports that).
        parts.append(f"{{ out=$(pct exec {q_ct} -- nvidia-smi -L 2>&1) || case \"$out\" in "
                     f"*'version mismatch'*) echo {nvml}\"$out\" >&2; exit 1;; esac; }}")
    return " && ".join(parts)


@operation()
def container_userspace(ctid: int, action: str, reason: str, version: str, installer_url: str = "",
                        sha256: str = "", cached: str = "", check_nvml: bool = True):
    """NVIDIA user space `version` in container `ctid` (a `plan.containers.CtUserspace` decision).

    + installer_url, sha256: the spec's nvidia.installer; cached: its verified copy on the host
    + check_nvml: the host runs `version` now, so NVML inside must not report a version mismatch
    """
    if action != "install":
        host.noop(reason)
        return
    yield progress.reported(install_command(ctid, version, installer_url, sha256, cached, check_nvml),
                            f"NVIDIA {version} user space in CT {ctid}", key=f"ct-userspace-{version}-{sha256[:16]}",
                            probe=progress.ct_log_probe(ctid, "/var/log/nvidia-installer.log"))


def managed_containers(spec: HostSpec) -> dict:
    """The spec's containers whose user space pvegpu installs (see the module docstring)."""
    has_installer = spec.nvidia is not None and spec.nvidia.installer is not None
    return {ctid: ct for ctid, ct in spec.containers.items()
            if ct.gpus and has_installer and ct.userspace_driver is not False}


# ---------------------------------------------------------------- stage protocol


def preflight(spec: HostSpec) -> list[str]:
    return []  # the spec load refuses userspace_driver: true without an installer


@deploy("container user space")
def apply(spec: HostSpec) -> None:
    managed = managed_containers(spec)
    unmanaged = sorted(c for c, ct in spec.containers.items() if ct.gpus and c not in managed)
    if unmanaged and spec.nvidia is not None and spec.nvidia.installer is None:
        logger.info(f"{host.name}: CT {', '.join(map(str, unmanaged))}: NVIDIA user space not managed "
                    "(no nvidia.installer); the CT must bring exactly the host's driver version itself")
    if not managed:
        return
    nv = spec.nvidia
    installer = nv.installer if nv is not None else None
    if nv is None or installer is None:  # managed_containers: only with an nvidia.installer
        return
    state = container_userspace_state(sorted(managed))
    for step in plan_userspace(nv.version, managed, state):
        if step.warn:
            logger.warning(f"{host.name}: {step.reason}")
        elif step.action != "ok":
            logger.info(f"{host.name}: {step.reason}")
        container_userspace(name=f"CT {step.ctid}: NVIDIA user space {nv.version}", ctid=step.ctid,
                            action=step.action, reason=step.reason, version=nv.version,
                            installer_url=installer.url, sha256=installer.sha256,
                            cached=cached_source(installer),
                            check_nvml=state.get("host_driver") == nv.version)
