"""What the NCCL stage (operations/nccl.py) compares against: its host files, the RDMA
devices, systemd, the pvegpu drop-ins and each running GPU container's /etc/nccl.conf, in one
command (`NcclState`)."""

from __future__ import annotations

import re
from typing import Any

from pyinfra.api import FactBase

from facts.files import ManagedFiles
from facts.guest_state import ct_root_loop
from facts.sections import SECTION, split_sections
from facts.shared import ROOT_ID, take
from facts.shell import word

NCCL_CONF = "/etc/nccl.conf"
SYSTEMD_DIR = "/etc/systemd/system"
DROPIN_NAME = "pvegpu-nccl.conf"


# Where an NCCL library says its version in its name: Debian/Ubuntu's libnccl2
# (/usr/lib/<triplet>/libnccl.so.2.X.Y) and pip's nvidia-nccl-cu* wheel (its dist-info directory
# in the system Python's package dirs; venvs elsewhere are not searched).
LIBNCCL_GLOBS = ("/usr/lib/*/libnccl.so.2.*", "/usr/lib64/libnccl.so.2.*", "/usr/local/lib/libnccl.so.2.*",
                 "/usr/lib/python3*/*-packages/nvidia_nccl_cu*-*.dist-info",
                 "/usr/local/lib/python3*/*-packages/nvidia_nccl_cu*-*.dist-info")
_LIBNCCL_LIST = (f"for f in {' '.join(LIBNCCL_GLOBS)}; do "
                 'if [ -e "$f" ]; then echo "libnccl $f"; fi; done')
# the same in a CT's root ($r, facts.guest_state.ct_root_loop), printed as paths in the CT
# (names only through no symlink of the CT's: facts.guest_state CT_PATH_FUNCTIONS ct_in)
_LIBNCCL_LIST_IN_CT = (f"for f in {' '.join(chr(34) + '$r' + chr(34) + g for g in LIBNCCL_GLOBS)}; do "
                       'if { [ -e "$f" ] || [ -L "$f" ]; } && ct_in "$f"; then echo "libnccl ${f#"$r"}"; fi; done')


def nccl_version_of(path: str) -> str | None:
    """``2.26.5`` from a libnccl file or wheel dist-info path (None when it says none)."""
    match = (re.search(r"libnccl\.so\.(2\.\d+\.\d+)$", path)
             or re.search(r"nvidia_nccl_cu\d+-(2\.\d+\.\d+)[^/]*\.dist-info$", path))
    return match.group(1) if match else None


def _dropin_units(paths: list[str]) -> list[str]:
    """The units whose pvegpu drop-in is among `paths` (``/etc/systemd/system/<unit>.d/…``)."""
    units = []
    for path in paths:
        match = re.fullmatch(rf"{re.escape(SYSTEMD_DIR)}/([^/]+)\.d/{re.escape(DROPIN_NAME)}", path)
        if match:
            units.append(match.group(1))
    return units


def _versions(lines: list[str]) -> list[str]:
    found = {nccl_version_of(line.split(" ", 1)[1].strip()) for line in lines if line.startswith("libnccl ")}
    return sorted((v for v in found if v), key=lambda v: tuple(int(x) for x in v.split(".")))


def _ct_probe(path: str) -> str:
    """Shell for `facts.guest_state.ct_root_loop` (``$r``: the CT's root): the root's identity,
    then the file's mode and sha256, or MISSING (also for a link, in the file's name or in a directory
    above it, or for what is no regular file: nothing is followed out of the CT nor waited on, and the
    stage's write through `pct exec` replaces it), then the CT's NCCL libraries (their paths in the CT).
    `ct_file` (facts.guest_state CT_PATH_FUNCTIONS) prints the mode and the digest."""
    return (f'[ -n "$root" ] && echo "$root"; ct_file {word(path)} || echo MISSING; {_LIBNCCL_LIST_IN_CT}')


def parse_nccl_state(lines: list[str]) -> dict:
    """`NcclState` output → the shape its docstring shows."""
    sections = split_sections(lines)
    files = ManagedFiles().process(sections.get("files", []))
    containers = {}
    for key, body in sections.items():
        m = re.match(r"^ct (\d+)$", key)
        if not m:
            continue
        values = [v.strip() for v in body if v.strip() and not v.startswith("libnccl ")]
        entry: dict[str, Any] = {"root": values[0] if values else None, "file": None, "readable": False,
                                 "nccl_versions": _versions(body)}
        if len(values) >= 2 and values[1] == "MISSING":
            entry["readable"] = True
        elif len(values) >= 3 and re.match(r"^[0-7]{1,4}$", values[1]) and re.match(r"^[0-9a-f]{64}$", values[2]):
            entry.update(readable=True, file={"mode": values[1], "sha256": values[2]})
        containers[int(m.group(1))] = entry
    root = [v.strip() for v in sections.get("root", []) if v.strip()]
    return {
        "files": files,
        "rdma_devices": sorted(v.strip() for v in sections.get("rdma", []) if v.strip()),
        "systemd_running": any(v.strip() == "running" for v in sections.get("systemd", [])),
        "dropins": sorted(v.strip() for v in sections.get("dropins", []) if v.strip()),
        "host_root": root[0] if root else None,
        "nccl_versions": _versions(sections.get("libnccl", [])),
        "exec_start": {key[len("unit "):]: [v.strip() for v in body if v.strip().startswith("ExecStart=")]
                       for key, body in sections.items() if key.startswith("unit ")},
        "containers": containers,
    }


class NcclState(FactBase):
    """Everything the NCCL stage compares against, in one remote command.

    + paths: host files of the stage (/etc/nccl.conf and the drop-ins)
    + ctids: the running GPU containers, each read through its init's root for its file
      (`facts.guest_state.ct_root_loop`; `nccl_state`
      picks them from this run's guest state and adds it to the result)

    .. code:: python

        {"files": {"/etc/nccl.conf": {"mode": "644", "sha256": "9f86…"}, "/etc/…/pvegpu-nccl.conf": None},
         "rdma_devices": ["mlx5_0"],            # names under /sys/class/infiniband
         "systemd_running": True,               # /run/systemd/system exists
         "dropins": ["/etc/systemd/system/vllm.service.d/pvegpu-nccl.conf"],   # all pvegpu drop-ins present
         "host_root": "64:5472336",             # device:inode of the host's /
         "nccl_versions": ["2.26.5"],           # NCCL libraries found (LIBNCCL_GLOBS), oldest first
         "exec_start": {"vllm.service": ["ExecStart=/opt/vllm/bin/vllm serve … --tensor-parallel-size 2"]},
         "containers": {200: {"root": "65:34", "readable": True, "nccl_versions": [],
                              "file": {"mode": "644", "sha256": "…"} | None}}}   # the CTs asked
    """

    def command(self, paths: list[str], ctids: list[int]) -> str:
        parts = [
            f"echo '{SECTION}files'; {ManagedFiles().command(paths)}",
            # the names `ls -1 /sys/class/infiniband` lists (a device's link, broken or not), by the glob
            f"echo '{SECTION}rdma'; for f in /sys/class/infiniband/*; do "
            '{ [ -e "$f" ] || [ -L "$f" ]; } && echo "${f##*/}"; done',
            f"echo '{SECTION}systemd'; if [ -d /run/systemd/system ]; then echo running; fi",
            f"echo '{SECTION}dropins'; for f in {SYSTEMD_DIR}/*.d/{DROPIN_NAME}; do if [ -f \"$f\" ]; then echo \"$f\"; fi; done",
            f"echo '{SECTION}root'; {take(ROOT_ID)}; printf '%s\\n' \"${ROOT_ID}\"",
            f"echo '{SECTION}libnccl'; {_LIBNCCL_LIST}",
        ]
        # each drop-in's service: its ExecStart= lines (what it runs: vLLM/SGLang custom allreduce)
        parts += [f"echo '{SECTION}unit {unit}'; systemctl cat -- {word(unit)} 2>/dev/null | grep '^ExecStart='"
                  for unit in _dropin_units(paths)]
        return "; ".join(parts) + "; " + ct_root_loop(ctids, _ct_probe(NCCL_CONF)) + "true"

    def process(self, output):
        return parse_nccl_state(list(output))

    @staticmethod
    def default() -> dict:
        return parse_nccl_state([])
