"""What the guests stage (operations/guests.py) reads besides the run state of the guests:
the CT configs with the NVIDIA minors, char majors and caps nodes they refer to
(`ContainerGpuState`), and the PCI mappings every VM config of the cluster references
(`VmMappingReferences`)."""

from __future__ import annotations

import re

from facts.base import ShellFact
from facts.devices import CharDeviceMajors, parse_char_majors
from facts.nvidia import NvidiaGpus, parse_gpu_information
from facts.sections import SECTION, parse_sections, section_echo, split_sections
from facts.shared import EACH_FILE, read_file

LXC_DIR = "/etc/pve/lxc"


def parse_container_state(lines: list[str]) -> dict:
    """`ContainerGpuState` output → ``{"configs": {200: "<raw text>"}, "nvidia": <NvidiaGpus>,
    "majors": <CharDeviceMajors>, "caps": [...]}``."""
    sections = split_sections(lines)
    configs = {}
    for name, body in sections.items():
        m = re.match(r"^conf:.*/(\d+)\.conf$", name)
        if m:
            configs[int(m.group(1))] = "\n".join(body) + "\n" if body else ""
    return {"configs": dict(sorted(configs.items())),
            **parse_sections(lines, {"nvidia": parse_gpu_information, "majors": parse_char_majors,
                                     "caps": lambda body: [line.strip() for line in body if line.strip()]})}


class ContainerGpuState(ShellFact):
    """
    Raw CT configs, NVIDIA minors, char majors and the caps nodes, in one command (the CT run
    state comes from `facts.guest_state.guest_state()`, read once per run).

    .. code:: python

        {"configs": {200: "arch: amd64\\n..."}, "nvidia": {"0000:01:00.0": {"minor": 0, ...}},
         "majors": {"nvidia": 195, "nvidia-uvm": 511, ...},
         "caps": ["/dev/nvidia-caps/nvidia-cap1", ...]}   # the caps nodes that exist
    """

    command = (
        f'for f in {LXC_DIR}/*.conf; do [ -r "$f" ] && {{ echo "{SECTION}conf:$f"; {read_file(EACH_FILE)}; }}; done; '
        f"{section_echo('nvidia')}; {NvidiaGpus.command}; "
        f"{section_echo('majors')}; {CharDeviceMajors.command}; "
        f"{section_echo('caps')}; for f in /dev/nvidia-caps/*; do [ -e \"$f\" ] && echo \"$f\"; done; true"
    )

    @staticmethod
    def default() -> dict:
        return {"configs": {}, "nvidia": {}, "majors": {}, "caps": []}

    def process(self, output):
        return parse_container_state(output)


class VmMappingReferences(ShellFact):
    """
    PCI mapping ids each VM config of the cluster references, in its main section and in
    its snapshot/pending sections.

    .. code:: python

        {("kpro6", 300): {"main": ["pvegpu-kpro6-0000-81-00-0"], "sections": ["gpu0"]}}
    """

    command = ('for f in /etc/pve/nodes/*/qemu-server/*.conf; do [ -r "$f" ] && '
               f'{{ echo "{SECTION}$f"; grep -E "^\\[|mapping=" "$f"; }}; done; true')

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_mapping_references(output)


def parse_mapping_references(lines: list[str]) -> dict:
    """`VmMappingReferences` output → its shape (see there)."""
    refs: dict = {}
    for path, body in split_sections(lines).items():
        marker = re.match(r"^/etc/pve/nodes/([^/]+)/qemu-server/(\d+)\.conf$", path)
        if not marker:
            continue
        current = refs.setdefault((marker.group(1), int(marker.group(2))), {"main": [], "sections": []})
        in_section = False
        for line in body:
            if line.startswith("["):
                in_section = True
                continue
            for mid in re.findall(r"mapping=([A-Za-z0-9_.-]+)", line):
                current["sections" if in_section else "main"].append(mid)
    return refs
