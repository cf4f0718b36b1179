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


# S_IFMT, S_IFCHR, S_IFBLK (the kernel's include/uapi/linux/stat.h): the file type in stat's %f
_S_IFMT, _S_IFCHR, _S_IFBLK = 0o170000, 0o020000, 0o060000


def parse_device_listing(output_lines: list[str]) -> dict[str, dict]:
    """Pure parser of `NvidiaDeviceNodes.command`: `stat -c '%f %t %T %n'` lines (raw mode, major
    and minor in hex, path: coreutils stat's fixed formats, the same under every locale and
    TIME_STYLE), and `ls -l` listings as people paste them, whatever their time style: the number
    pair `major, minor` and the last word (shape: see `NvidiaDeviceNodes`)."""
    nodes: dict[str, dict] = {}
    directory = "/dev"
    for line in output_lines:
        stat = re.match(r"^([0-9a-f]+) ([0-9a-f]+) ([0-9a-f]+) (/\S+)$", line.strip())
        if stat:
            kind = int(stat.group(1), 16) & _S_IFMT
            if kind in (_S_IFCHR, _S_IFBLK):
                nodes[stat.group(4)] = {"type": "char" if kind == _S_IFCHR else "block",
                                        "major": int(stat.group(2), 16), "minor": int(stat.group(3), 16)}
            continue
        header = re.match(r"^(/\S+):\s*$", line)
        if header:
            directory = header.group(1)
            continue
        # ls -l: mode, links, owner, group, "major, minor", then a date in the host's time style
        # (`Dec  2 12:32`, `2025-08-17 01:47:58`, …: two to four words) and the name, the last word
        match = re.match(r"^([cb])[-rwxsStT]{9}\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s+\S.*?\s(\S+)\s*$", line)
        if not match:
            continue
        letter, major, minor, name = match.groups()
        path = name if name.startswith("/") else f"{directory}/{name}"
        nodes[path] = {"type": "char" if letter == "c" else "block",
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

    # each node and each node of a /dev/nvidia* directory (nvidia-caps/), by stat's fixed formats:
    # `ls -l` printed dates in the host's TIME_STYLE and locale, two or three words (issue 43)
    command = "stat -c '%f %t %T %n' -- /dev/nvidia* /dev/nvidia*/* 2>/dev/null; true"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_device_listing(output)
