"""NVIDIA kernel driver state from /proc/driver/nvidia (no nvidia-smi needed)."""

from __future__ import annotations

import re

from facts.base import ShellFact

GPU_INFORMATION_MARKER = "== "


def parse_driver_version(output_lines: list[str]) -> dict | None:
    """Pure parser of /proc/driver/nvidia/version (shape: see `NvidiaDriver`)."""
    result = None
    for line in output_lines:
        match = re.match(
            r"^NVRM version:\s+NVIDIA UNIX (Open )?(?:Kernel Module for )?(\S+)\s+(?:Kernel Module\s+)?"
            r"(\d+(?:\.\d+)+)\s",
            line + " ",
        )
        if match:
            result = {
                "version": match.group(3),
                "open": bool(match.group(1)),
                "arch": match.group(2),
                "gcc": None,
            }
            continue
        match = re.match(r"^GCC version:.*?gcc version (\d+(?:\.\d+)+)", line)
        if match and result is not None:
            result["gcc"] = match.group(1)
    return result


def parse_gpu_information(output_lines: list[str]) -> dict[str, dict]:
    """Pure parser of /proc/driver/nvidia/gpus/*/information blocks (shape: see `NvidiaGpus`)."""
    gpus: dict[str, dict] = {}
    current: dict | None = None

    def finish(block: dict | None) -> None:
        if block and block.get("bdf"):
            gpus[block.pop("bdf")] = block

    for line in output_lines:
        marker = re.match(r"^== .*/gpus/([0-9a-fA-F:.]+)/information\s*$", line)
        if marker:
            finish(current)
            current = {"bdf": marker.group(1).lower(), "model": None, "minor": None,
                       "uuid": None, "firmware": None, "vbios": None}
            continue
        match = re.match(r"^([A-Za-z][A-Za-z ]*?):\s*(.*?)\s*$", line)
        if not match:
            continue
        key, value = match.groups()
        if current is None:  # a single file without the marker line
            current = {"bdf": None, "model": None, "minor": None, "uuid": None,
                       "firmware": None, "vbios": None}
        if key == "Model":
            current["model"] = value
        elif key == "Bus Location":
            current["bdf"] = value.lower()
        elif key == "Device Minor" and value.isdigit():
            current["minor"] = int(value)
        elif key == "GPU UUID":
            current["uuid"] = value
        elif key == "GPU Firmware":
            current["firmware"] = value if value not in ("", "N/A") else None
        elif key == "Video BIOS":
            current["vbios"] = value
    finish(current)
    return gpus


def parse_colon_params(output_lines: list[str]) -> dict[str, str]:
    """`Name: value` lines (e.g. /proc/driver/nvidia/params) → ``{"Name": "value"}``."""
    params: dict[str, str] = {}
    for line in output_lines:
        match = re.match(r"^([A-Za-z]\w*):\s?(.*?)\s*$", line)
        if match:
            params[match.group(1)] = match.group(2)
    return params


class NvidiaDriver(ShellFact):
    """
    The loaded NVIDIA kernel module, from /proc/driver/nvidia/version.

    .. code:: python

        {"version": "580.159.04", "open": True, "arch": "x86_64", "gcc": "15.3.0"}

    ``None`` when no driver is loaded.
    """

    command = "cat /proc/driver/nvidia/version 2>/dev/null || true"

    def process(self, output):
        return parse_driver_version(output)


class NvidiaGpus(ShellFact):
    """
    GPUs the NVIDIA driver has bound, from /proc/driver/nvidia/gpus/<bdf>/information.

    .. code:: python

        {"0000:00:06.0": {"model": "NVIDIA H200", "minor": 0, "uuid": "GPU-e567…",
                          "firmware": "580.159.04", "vbios": "96.00.a5.00.1a"}}

    ``minor`` is the N of /dev/nvidiaN (it shifts when GPUs move to vfio-pci). ``{}`` without
    a driver.
    """

    command = (
        "for f in /proc/driver/nvidia/gpus/*/information; do "
        '[ -r "$f" ] && { echo "== $f"; cat "$f"; }; '
        "done; true"
    )

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_gpu_information(output)


class NvidiaDriverParams(ShellFact):
    """
    The NVIDIA module's effective parameters, /proc/driver/nvidia/params.

    .. code:: python

        {"EnableResizableBar": "0", "DmaRemapPeerMmio": "1", "RegistryDwords": '""', …}
    """

    command = "cat /proc/driver/nvidia/params 2>/dev/null || true"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_colon_params(output)
