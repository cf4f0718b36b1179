"""Container user space: which GPU containers need the host's NVIDIA user space installed (pure).

A container on the host's nvidia driver talks to the host's kernel module through its own copy of
the driver's user space (libcuda, libnvidia-ml, nvidia-smi). NVML refuses to start when the two
versions differ ("Driver/library version mismatch", INCIDENTS #6), so each GPU container gets
exactly the host's version from the host's own NVIDIA-Linux-x86_64-<version>.run, run inside the
container with ``--no-kernel-modules``.

Input: the spec's containers and `operations.containers.container_userspace_state()` (the
`ContainerUserspace` fact with the CT run state)::

    {"pct": True, "host_root": "64:2",
     "status": {200: "running", 201: "stopped"},
     "containers": {200: {"root": "65:34", "glibc": True, "arch": "x86_64",
                          "libs": ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.95.05"]}}}

Output: one `CtUserspace` per container the spec gives GPUs, in CT id order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
NVML_RE = re.compile(r"/libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)$")

# nvidia-installer flags for a container: no modules (the host's are used), nothing that needs the
# host's kernel, init system or distribution hooks.
INSTALLER_FLAGS = ("--silent", "--no-kernel-modules", "--no-kernel-module-source", "--no-nouveau-check",
                   "--no-x-check", "--no-systemd", "--no-dkms", "--no-distro-scripts")


@dataclass(frozen=True)
class CtUserspace:
    """What to do about one container's user space.

    action: "install" (run the installer inside), "ok" (has exactly `version`), "skip" (cannot or
    must not be done now; `reason` says why, and whether a later run does it).
    """

    ctid: int
    action: str
    reason: str
    have: tuple[str, ...] = ()
    warn: bool = False  # a skip a later run will not fix by itself (the operator must act)


def installed_versions(libs: list[str]) -> list[str]:
    """NVML library versions among `libs` (paths), sorted, unique."""
    return sorted({m.group(1) for p in libs if (m := NVML_RE.search(p))})


def plan_userspace(version: str, containers: dict, state: dict) -> list[CtUserspace]:
    """One step per container that has GPUs and wants its user space managed.

    + version: the host's driver version (spec nvidia.version)
    + containers: ``{ctid: ContainerSpec}`` (userspace_driver: None = managed, the spec checked
      that an installer exists when it is True; the caller drops containers it must not manage)
    + state: `operations.containers.container_userspace_state()`
    """
    steps = []
    for ctid in sorted(containers):
        if not containers[ctid].gpus:
            continue
        status = state.get("status", {}).get(ctid)
        ct = state.get("containers", {}).get(ctid)
        if not state.get("pct"):
            steps.append(CtUserspace(ctid, "skip", "no pct on this host (not a Proxmox VE node)"))
        elif status is None:
            steps.append(CtUserspace(ctid, "skip", f"CT {ctid} does not exist on this node; create it, then re-run"))
        elif status != "running":
            steps.append(CtUserspace(ctid, "skip", f"CT {ctid} is {status}: its NVIDIA user space is checked and "
                                                   "installed by a run while it runs (pct exec needs it running)"))
        elif ct is None:
            steps.append(CtUserspace(ctid, "skip", f"CT {ctid} did not answer through pct exec; re-run when it does",
                                     warn=True))
        elif ct.get("root") and ct["root"] == state.get("host_root"):
            steps.append(CtUserspace(ctid, "skip", f"CT {ctid} shares the host's root filesystem; installing into it "
                                                   "would change the host's user space"))
        elif ct.get("arch") and ct["arch"] != "x86_64":
            steps.append(CtUserspace(ctid, "skip", f"CT {ctid} is {ct['arch']}; the NVIDIA installer is for x86_64",
                                     warn=True))
        elif not ct.get("glibc", True):
            steps.append(CtUserspace(ctid, "skip", f"CT {ctid} has no glibc (musl, e.g. Alpine?); NVIDIA's user space "
                                                   "needs glibc: use a glibc distribution or set userspace_driver: false",
                                     warn=True))
        else:
            have = tuple(installed_versions(ct.get("libs") or []))
            if have == (version,):
                steps.append(CtUserspace(ctid, "ok", f"CT {ctid} has NVIDIA user space {version}", have))
            elif not have:
                steps.append(CtUserspace(ctid, "install", f"CT {ctid} has no NVIDIA user space; installing {version}",
                                         have))
            else:
                steps.append(CtUserspace(ctid, "install", f"CT {ctid} has NVIDIA user space {', '.join(have)}, the host's "
                                                          f"driver is {version} (NVML refuses a mismatch); installing "
                                                          f"{version}", have))
    return steps


def ct_installer_path(version: str) -> str:
    """Where the installer is pushed inside a container (removed after the install)."""
    return f"/root/.pvegpu-NVIDIA-Linux-x86_64-{version}.run"
