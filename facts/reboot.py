"""What a rolling reboot reads of a node when its turn comes (operations/reboot.py): read while
operations execute, not as a pyinfra fact, since the nodes rebooted before it changed it.

`NODE_GUESTS_COMMAND` prints, in `facts.sections` sections: this node's guests with their status
(`qm list`, `pct list`), their configs, the cluster's PCI mappings and HA resources, this node's
PCI reservations and its view of the cluster (.members); `parse_node_guests` reads it back.
"""

from __future__ import annotations

import json
import re

from facts.proxmox import parse_guest_configs, parse_ha_resources, parse_pci_mappings
from facts.sections import section_echo, split_sections

# qemu-server PVE/QemuServer/PCI.pm reserve_pci_usage(): `<pci id> <vmid> pid:<pid>|time:<t>` per
# device a VM on this node holds (node-local, under /run)
PCI_RESERVATIONS = "/run/qemu-server/pci-id-reservations"

NODE_GUESTS_COMMAND = "; ".join([
    section_echo("qm list"), "qm list 2>/dev/null",
    section_echo("pct list"), "pct list 2>/dev/null",
    section_echo("reservations"), f"cat {PCI_RESERVATIONS} 2>/dev/null",
    section_echo("mappings"), "cat /etc/pve/mapping/pci.cfg 2>/dev/null",
    section_echo("ha"), "cat /etc/pve/ha/resources.cfg 2>/dev/null",
    section_echo("members"), "cat /etc/pve/.members 2>/dev/null",
    # the node's Proxmox VE release: pve-manager's version, read from dpkg (as facts.proxmox.PveVersion)
    section_echo("pve"), "dpkg-query -W -f='${Version}\\n' pve-manager 2>/dev/null",
    'for f in /etc/pve/qemu-server/*.conf; do [ -r "$f" ] && { echo "@@ qemu $f"; cat "$f"; }; done',
    'for f in /etc/pve/lxc/*.conf; do [ -r "$f" ] && { echo "@@ lxc $f"; cat "$f"; }; done',
    "true",
])


def parse_guest_list(lines: list[str], kind: str) -> dict[int, str]:
    """`qm list` / `pct list` → ``{vmid: status}``; the header and anything not starting with an
    id are skipped. qemu-server PVE/CLI/qm.pm list prints VMID, NAME, STATUS, MEM, BOOTDISK, PID (an
    unnamed VM is "VM <id>", two words: the status is the fourth word from the end); pve-container
    PVE/CLI/pct.pm list prints VMID, Status, Lock, Name (the status second)."""
    out: dict[int, str] = {}
    for line in lines:
        words = line.split()
        if len(words) >= (6 if kind == "qemu" else 2) and words[0].isdigit():
            out[int(words[0])] = words[-4] if kind == "qemu" else words[1]
    return out


def parse_node_guests(output_lines: list[str]) -> dict:
    """NODE_GUESTS_COMMAND's output →

    .. code:: python

        {"status": {"qemu": {300: "running"}, "lxc": {200: "stopped"}},
         "configs": {"qemu": {300: <facts.proxmox.parse_guest_config>}, "lxc": {...}},
         "reserved": {"0000:81:00.0": 300}, "mappings": <parse_pci_mappings>,
         "ha": <parse_ha_resources>, "members": {...} or {},
         "pve_major": 8}                      # pve-manager's major; None: not read
    """
    sections = split_sections(output_lines)
    reserved: dict[str, int] = {}
    for line in sections.get("reservations", []):
        m = re.match(r"^(\S+)\s+(\d+)\s", line + " ")
        if m:
            reserved[m.group(1)] = int(m.group(2))
    configs: dict[str, dict[int, dict]] = {}
    for kind in ("qemu", "lxc"):
        mine = [line for name, body in sections.items() if name.startswith(kind + " ")
                for line in [f"@@ {name.split(' ', 1)[1]}", *body]]
        configs[kind] = parse_guest_configs(mine, kind)
    try:
        members = json.loads("\n".join(sections.get("members", [])) or "{}")
    except ValueError:
        members = {}
    return {"status": {"qemu": parse_guest_list(sections.get("qm list", []), "qemu"),
                       "lxc": parse_guest_list(sections.get("pct list", []), "lxc")},
            "configs": configs, "reserved": reserved,
            "mappings": parse_pci_mappings(sections.get("mappings", [])),
            "ha": parse_ha_resources(sections.get("ha", [])), "members": members,
            "pve_major": next((int(m.group(1)) for line in sections.get("pve", [])
                               if (m := re.match(r"^(\d+)\.", line.strip()))), None)}
