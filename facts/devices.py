"""Character device majors and NVIDIA device nodes (incident 4: nvidia-uvm's major is dynamic)."""

from __future__ import annotations

import re

from facts.base import ShellFact
from facts.shared import read_file


def parse_char_majors(output_lines: list[str]) -> dict[str, int]:
    """Pure parser of /proc/devices, character devices only (shape: see `CharDeviceMajors`)."""
    majors: dict[str, int] = {}
    for line in output_lines:
        if line.strip().startswith("Block devices"):
            break
        match = re.match(r"^\s*(\d+)\s+(\S+)\s*$", line)
        if match:
            # A name registered twice (seen: infiniband_verbs) keeps its first, lowest major.
            majors.setdefault(match.group(2), int(match.group(1)))
    return majors


def parse_device_listing(output_lines: list[str]) -> dict[str, dict]:
    """Pure parser of `ls -l /dev/nvidia*` (shape: see `NvidiaDeviceNodes`)."""
    nodes: dict[str, dict] = {}
    directory = "/dev"
    for line in output_lines:
        header = re.match(r"^(/\S+):\s*$", line)
        if header:
            directory = header.group(1)
            continue
        match = re.match(
            r"^([cb])[-rwxsStT]{9}\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s+\S+\s+\S+\s+\S+\s+(\S+)\s*$",
            line,
        )
        if not match:
            continue
        kind, major, minor, name = match.groups()
        path = name if name.startswith("/") else f"{directory}/{name}"
        nodes[path] = {"type": "char" if kind == "c" else "block",
                       "major": int(major), "minor": int(minor)}
    return nodes


class CharDeviceMajors(ShellFact):
    """
    Character device majors by driver name, from /proc/devices (block devices are ignored).

    .. code:: python

        {"nvidia": 195, "nvidiactl": 195, "nvidia-uvm": 238, "nvidia-caps": 241, …}
    """

    command = read_file("/proc/devices")

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_char_majors(output)


class NvidiaDeviceNodes(ShellFact):
    """
    The /dev/nvidia* device nodes that exist, with their numbers (compare with
    `CharDeviceMajors` to catch a stale node after nvidia-uvm's major moved).

    .. code:: python

        {"/dev/nvidia0": {"type": "char", "major": 195, "minor": 0},
         "/dev/nvidia-caps/nvidia-cap1": {"type": "char", "major": 241, "minor": 1}}
    """

    command = "ls -l /dev/nvidia* 2>/dev/null || true"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_device_listing(output)
