"""What the container user-space stage (operations/containers.py) reads: the host's root and
driver version and, in each running container's root (through its init, no `pct exec`), its
NVML libraries."""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from facts.guest_state import ct_root_loop
from facts.nvidia import LIB_DIRS, NvidiaDriver, parse_driver_version
from facts.sections import SECTION, split_sections
from facts.shared import ROOT_ID, UNAME, take

# Run by the host's shell with $r the CT's root (facts.guest_state.ct_root_loop): its root's
# identity, arch, glibc, NVML libraries (regular files only: a link is not followed out of the CT),
# each name reached through no symlink of the CT's (facts.guest_state CT_PATH_FUNCTIONS ct_in: a
# merged-/usr CT's /lib64 and /lib are links, so the loader and libc are looked for under /usr too).
_GLIBC_LOADERS = ("/usr/lib64/ld-linux-x86-64.so.2", "/lib64/ld-linux-x86-64.so.2")
_GLIBC_LIBCS = ("/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib/x86_64-linux-gnu/libc.so.6")
_CT_PROBE = (
    f'echo "root $root"; {take(UNAME["m"])}; echo "arch ${UNAME["m"]}"; g=no; '
    f"for f in {' '.join(chr(34) + '$r' + chr(34) + p for p in _GLIBC_LOADERS)}; do "
    'if { [ -L "$f" ] || [ -e "$f" ]; } && ct_in "${f%/*}"; then g=yes; fi; done; '
    f"for f in {' '.join(chr(34) + '$r' + chr(34) + p for p in _GLIBC_LIBCS)}; do "
    'if [ -f "$f" ] && ct_in "$f"; then g=yes; fi; done; echo "glibc $g"; '
    f"for f in {' '.join(chr(34) + '$r' + chr(34) + d + '/libnvidia-ml.so.*' for d in LIB_DIRS)}; do "
    '[ -f "$f" ] && ct_in "$f" && echo "lib ${f#"$r"}"; done; true'
)


def parse_container_userspace(lines: list[str]) -> dict:
    """`ContainerUserspace` output → the dict documented on the fact."""
    sections = split_sections(lines)
    containers = {}
    for name, body in sections.items():
        m = re.match(r"^ct (\d+)$", name)
        if not m:
            continue
        ct: dict = {"libs": []}
        for line in body:
            key, _, value = line.partition(" ")
            if key == "root":
                ct["root"] = value.strip()
            elif key == "arch":
                ct["arch"] = value.strip()
            elif key == "glibc":
                ct["glibc"] = value.strip() == "yes"
            elif key == "lib":
                ct["libs"].append(value.strip())
        if "root" in ct:  # else its init was not found (the CT is not running)
            containers[int(m.group(1))] = ct
    driver = (parse_driver_version(sections.get("host-driver", [])) or {}).get("version")
    return {
        "host_root": (sections.get("root") or [""])[0].strip() or None,
        "host_driver": driver,
        "containers": containers,
    }


class ContainerUserspace(FactBase):
    """The host's root and driver version and, inside each given container, its NVML libraries,
    in one command.

    + ctids: the running containers to look into (each through its init's root:
      `facts.guest_state.ct_root_loop`; `container_userspace_state`
      picks them from this run's guest state and adds it to the result)

    .. code:: python

        {"host_root": "64:2", "host_driver": "595.71.05",   # /proc/driver/nvidia/version
         "containers": {200: {"root": "65:34", "arch": "x86_64", "glibc": True,
                              "libs": ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.595.71.05"]}}}
    """

    def command(self, ctids: list[int]) -> str:
        loop = ct_root_loop(ctids, _CT_PROBE)
        return (
            f"echo '{SECTION}root'; {take(ROOT_ID)}; printf '%s\\n' \"${ROOT_ID}\"; "
            f"echo '{SECTION}host-driver'; {NvidiaDriver.command}; {loop}true"
        )

    def process(self, output):
        return parse_container_userspace(list(output))

    @staticmethod
    def default() -> dict:
        return parse_container_userspace([])
