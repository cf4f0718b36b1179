"""GPU topology as the NVIDIA driver reports it (`nvidia-smi topo`)."""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from facts.base import ShellFact
from facts.shell import word

# nvidia-smi underlines the matrix header with ANSI escapes, even into a pipe.
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# Header cells after the device columns; they contain spaces, so they are cut off before splitting.
TOPO_TRAILING_HEADERS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
P2P_KINDS = {"r": "read", "w": "write", "n": "nvlink", "a": "atomics", "p": "pcie", "rw": "read/write"}


def strip_ansi(line: str) -> str:
    return ANSI_ESCAPE.sub("", line)


def _none_if_na(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return None if value in ("", "N/A") else value


def _find_matrix_header(lines: list[str], affinity: bool | None) -> tuple[int, list[str]] | None:
    """Index and device names of the first matrix header line (`GPU0 GPU1 … [CPU Affinity …]`).

    ``affinity``: True = the header must have the affinity columns (topo -m), False = must not
    (topo -p2p), None = either.
    """
    for index, line in enumerate(lines):
        text = line.strip()
        if affinity is not None and ("Affinity" in text) != affinity:
            continue
        for trailing in TOPO_TRAILING_HEADERS:
            text = text.replace(trailing, " ")
        names = text.split()
        if names and names[0] == "GPU0" and all(re.fullmatch(r"[A-Za-z][\w.:-]*", n) for n in names):
            if len(set(names)) == len(names):
                return index, names
    return None


def parse_topo_matrix(output_lines: list[str]) -> dict:
    """Pure parser of `nvidia-smi topo -m` (shape: see `GpuTopology`)."""
    lines = [strip_ansi(line) for line in output_lines]
    found = _find_matrix_header(lines, affinity=True) or _find_matrix_header(lines, affinity=None)
    if not found:
        return GpuTopology.default()
    header_index, devices = found
    links: dict[str, dict[str, str]] = {}
    cpu_affinity: dict[str, str | None] = {}
    numa_affinity: dict[str, str | None] = {}
    gpu_numa_id: dict[str, str | None] = {}
    for line in lines[header_index + 1:]:
        tokens = line.split()
        if not tokens:
            continue
        if tokens[0].rstrip(":") == "Legend":
            break
        if tokens[0] not in devices or tokens[0] in links:
            continue
        name, cells = tokens[0], tokens[1:]
        links[name] = {
            other: cell
            for other, cell in zip(devices, cells, strict=False)  # cells also hold the affinity columns
            if other != name and cell != "X"
        }
        extra = cells[len(devices):]
        cpu_affinity[name] = _none_if_na(extra[0] if len(extra) > 0 else None)
        numa_affinity[name] = _none_if_na(extra[1] if len(extra) > 1 else None)
        gpu_numa_id[name] = _none_if_na(extra[2] if len(extra) > 2 else None)

    nics: dict[str, str | None] = {}
    legend = {}
    for line in lines[header_index + 1:]:
        match = re.match(r"^\s*(NIC\d+):\s*(\S+)\s*$", line)
        if match:
            legend[match.group(1)] = match.group(2)
    for device in devices:
        if device.startswith("GPU"):
            continue
        # Old drivers print the NIC's own name (mlx5_0) as the column; new ones NICn + a legend.
        nics[device] = legend.get(device, None if re.fullmatch(r"NIC\d+", device) else device)
    return {
        "devices": devices,
        "links": links,
        "cpu_affinity": cpu_affinity,
        "numa_affinity": numa_affinity,
        "gpu_numa_id": gpu_numa_id,
        "nics": nics,
    }


def parse_p2p_matrix(output_lines: list[str]) -> dict[str, dict[str, str]]:
    """Pure parser of one `nvidia-smi topo -p2p <kind>` matrix (shape: see `GpuP2P`)."""
    lines = [strip_ansi(line) for line in output_lines]
    found = _find_matrix_header(lines, affinity=False)
    if not found:
        return {}
    header_index, devices = found
    matrix: dict[str, dict[str, str]] = {}
    for line in lines[header_index + 1:]:
        tokens = line.split()
        if not tokens:
            continue
        if tokens[0].rstrip(":") == "Legend" or tokens[0] in matrix:
            break
        if tokens[0] not in devices:
            continue
        name = tokens[0]
        matrix[name] = {
            other: cell
            for other, cell in zip(devices, tokens[1:], strict=False)  # a short row: the cells it has
            if other != name and cell != "X"
        }
    return matrix


class GpuTopology(ShellFact):
    """
    The driver's topology matrix, `nvidia-smi topo -m`.

    .. code:: python

        {
            "devices": ["GPU0", "GPU1", "NIC0"],
            "links": {"GPU0": {"GPU1": "SYS", "NIC0": "NODE"}, "GPU1": {...}, "NIC0": {...}},
            "cpu_affinity": {"GPU0": "0-15", "NIC0": None},
            "numa_affinity": {"GPU0": "0", "NIC0": None},
            "gpu_numa_id": {"GPU0": None},
            "nics": {"NIC0": "mlx5_0"},
        }

    ``links`` holds each ordered pair exactly as printed (SYS, NODE, PHB, PXB, PIX, NV4, …);
    `N/A` or empty affinities are ``None``. Old drivers name NICs in the header (``mlx5_0``),
    which then maps to itself in ``nics``. No driver or no GPU: the empty default.
    """

    command = "nvidia-smi topo -m 2>/dev/null || true"

    def requires_command(self, *args, **kwargs) -> str:
        return "nvidia-smi"

    @staticmethod
    def default() -> dict:
        return {
            "devices": [],
            "links": {},
            "cpu_affinity": {},
            "numa_affinity": {},
            "gpu_numa_id": {},
            "nics": {},
        }

    def process(self, output):
        return parse_topo_matrix(output)


class GpuP2P(FactBase):
    """
    The driver's peer-to-peer capability matrix, `nvidia-smi topo -p2p <kind>`.

    + kind: ``r`` (read), ``w`` (write), ``n`` (NVLink), ``a`` (atomics), ``p`` (PCIe)

    .. code:: python

        {"GPU0": {"GPU1": "OK"}, "GPU1": {"GPU0": "CNS"}}

    Codes as printed: OK, CNS, GNS, TNS, NS, DR, U. No driver or no GPU: ``{}``.
    """

    def command(self, kind: str = "r") -> str:
        if kind not in P2P_KINDS:
            raise ValueError(f"GpuP2P kind must be one of {sorted(P2P_KINDS)}, not {kind!r}")
        return f"nvidia-smi topo -p2p {word(kind)} 2>/dev/null || true"

    def requires_command(self, *args, **kwargs) -> str:
        return "nvidia-smi"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_p2p_matrix(output)


def parse_bus_ids(output_lines: list[str]) -> list[str]:
    """`nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader` → sorted BDFs as the spec writes
    them: ``"00000000:01:00.0"`` → ``"0000:01:00.0"`` (NVML's 8-digit domain, lower case)."""
    out = []
    for line in output_lines:
        value = line.strip().split(",")[0].strip()
        match = re.match(r"^([0-9A-Fa-f]{4,8}):([0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])$", value)
        if match:
            out.append(f"{int(match.group(1), 16):04x}:{match.group(2).lower()}")
    return sorted(out)
