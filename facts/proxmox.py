"""Proxmox VE: version, guest configs (/etc/pve) and PCI resource mappings."""

from __future__ import annotations

import re

from facts.base import ShellFact
from facts.sections import split_sections
from facts.shared import EACH_FILE, UNAME, dpkg_show, read_file, take, uname

# `pveversion` and `pveversion -v` are Perl programs (0.3-0.6 s each on a node). What they print
# comes from the dpkg database: each package's installed version (pve-manager PVE/API2/APT.pm
# versions, through AptPkg), and pveversion's own version is pve-manager's (bin/pveversion prints
# PVE::pvecfg version_text, the version pve-manager was built as). dpkg-query reads the same
# database without Perl. The packages: what the stages read and what an operator looks for beside.
PVE_PACKAGES = ("proxmox-ve", "pve-manager", "pve-container", "qemu-server", "pve-qemu-kvm", "lxc-pve",
                "libpve-guest-common-perl", "pve-cluster", "pve-ha-manager", "proxmox-kernel-helper",
                "zfsutils-linux")
DPKG_VERSIONS = "dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n'"
# dpkg's status abbreviation: wanted action, package state, error flag (dpkg-query(1), --list);
# state `i` is installed (pveversion -v says "not correctly installed" for the others)
_DPKG_LINE = re.compile(r"^([uihrp])([ncHUFWti])([ R]) (\S+) (\S+)$")


def parse_dpkg_versions(output_lines: list[str]) -> dict[str, str]:
    """`DPKG_VERSIONS` output → ``{"pve-manager": "8.4.1", "pve-container": "5.2.7", …}``: the
    packages dpkg has installed, each with its Debian version (a package dpkg does not know is
    not printed at all: dpkg-query says so on stderr)."""
    packages: dict[str, str] = {}
    for line in output_lines:
        match = _DPKG_LINE.match(line.rstrip("\n"))
        if match and match.group(2) == "i":
            packages[match.group(4)] = match.group(5)
    return packages


def parse_pve_version(output_lines: list[str]) -> dict | None:
    """`PveVersion` output (pve-manager's dpkg line, then `kernel <uname -r>`) → its shape;
    ``None`` without an installed pve-manager (not a Proxmox VE node)."""
    version = parse_dpkg_versions(output_lines).get("pve-manager")
    kernel = next((line.split(None, 1)[1].strip() for line in output_lines
                   if line.startswith("kernel ") and len(line.split(None, 1)) == 2), None)
    match = re.match(r"^(\d+)\.(\d+)", version or "")
    if not version or not match:
        return None
    return {"version": version, "major": int(match.group(1)), "minor": int(match.group(2)),
            "running_kernel": kernel}


def debian_version_key(version: str) -> tuple:
    """A sort key for the upstream part of Debian versions such as `5.0.12` / `9.2.0-7`
    (numbers compare as numbers; enough for Proxmox's own package versions)."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("~")[0]))


def parse_device_entry(value: str) -> dict:
    """`/dev/nvidia0,gid=44,mode=0666` (a CT's devN) → ``{"path": "/dev/nvidia0", "gid": "44", …}``."""
    entry: dict[str, str] = {}
    for index, part in enumerate(value.split(",")):
        key, sep, item = part.partition("=")
        if sep:
            entry[key.strip()] = item.strip()
        elif index == 0:
            entry["path"] = part.strip()
    return entry


def parse_hostpci_entry(value: str) -> dict:
    """`mapping=gpu0,pcie=1` or `0000:01:00.0;0000:01:00.1,pcie=1` → mapping, host BDFs, options."""
    mapping = None
    hosts: list[str] = []
    options: dict[str, str] = {}
    for index, part in enumerate(value.split(",")):
        key, sep, item = part.partition("=")
        if not sep and index == 0:
            key, item = "host", part
        if key == "host":
            hosts = [h if h.count(":") == 2 or not re.match(r"^[0-9a-fA-F]{2}:", h) else f"0000:{h}"
                     for h in item.strip().split(";") if h]
        elif key == "mapping":
            mapping = item.strip()
        else:
            options[key.strip()] = item.strip()
    return {"mapping": mapping, "host": hosts, "pcie": options.get("pcie") == "1", "options": options}


def parse_guest_config(lines: list[str], kind: str) -> dict:
    """One /etc/pve/{lxc,qemu-server}/<id>.conf. Snapshot ([name]) and [pending] sections are
    kept as raw lines, untouched."""
    config: dict = {"options": {}, "lxc": [], "comments": [], "snapshots": {}}
    if kind == "lxc":
        config["devices"] = {}
    else:
        config["hostpci"] = {}
    snapshot: list[str] | None = None
    for line in lines:
        section = re.match(r"^\[([^\]]+)\]\s*$", line)
        if section:
            snapshot = config["snapshots"].setdefault(section.group(1), [])
            continue
        if snapshot is not None:
            snapshot.append(line)
            continue
        if not line.strip():
            continue
        if line.lstrip().startswith("#"):
            config["comments"].append(line)
            continue
        match = re.match(r"^([\w.\-]+)\s*[:=]\s?(.*?)\s*$", line)
        if not match:
            continue
        key, value = match.groups()
        if key.startswith("lxc."):
            config["lxc"].append([key, value])
        elif kind == "lxc" and re.fullmatch(r"dev\d+", key):
            config["devices"][key] = parse_device_entry(value)
        elif kind == "qemu" and re.fullmatch(r"hostpci\d+", key):
            config["hostpci"][key] = parse_hostpci_entry(value)
        else:
            config["options"][key] = value
    return config


def parse_guest_configs(output_lines: list[str], kind: str) -> dict[int, dict]:
    """`@@ /etc/pve/…/<id>.conf` sections → ``{id: config}``."""
    configs: dict[int, dict] = {}
    for name, lines in split_sections(output_lines).items():
        match = re.search(r"(\d+)\.conf$", name)
        if match:
            configs[int(match.group(1))] = parse_guest_config(lines, kind)
    return dict(sorted(configs.items()))


def parse_pci_mappings(output_lines: list[str]) -> dict[str, dict]:
    """Pure parser of /etc/pve/mapping/pci.cfg (shape: see `PciMappings`)."""
    mappings: dict[str, dict] = {}
    current: dict | None = None
    for line in output_lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            name = line.strip().split(":", 1)[-1].strip() if ": " in line else line.strip()
            current = mappings.setdefault(name, {"map": [], "description": None, "mdev": False, "options": {}})
            continue
        if current is None:
            continue
        key, _, value = line.strip().partition(" ")
        value = value.strip()
        if key == "map":
            current["map"].append(dict(
                part.split("=", 1) for part in value.split(",") if "=" in part
            ))
        elif key == "description":
            current["description"] = value
        elif key == "mdev":
            current["mdev"] = value in ("1", "true")
        else:
            current["options"][key] = value
    return mappings


def _config_files_command(directory: str, builtin: bool = False) -> str:
    """Each config of `directory`, after its `@@ <path>` marker: through the shell's `read` where
    `builtin` (facts.shared.read_file: no program per file), else one `cat` per file."""
    read = read_file(EACH_FILE) if builtin else 'cat "$f"'
    return f'for f in {directory}/*.conf; do [ -r "$f" ] && {{ echo "@@ $f"; {read}; }}; done; true'


class PveVersion(ShellFact):
    """
    The Proxmox VE version: pve-manager's installed version (what `pveversion` prints, read
    from dpkg without starting Perl) and the running kernel.

    .. code:: python

        {"version": "8.2.4", "major": 8, "minor": 2, "running_kernel": "6.8.12-1-pve"}

    ``None`` on a host without Proxmox VE.
    """

    # dpkg-query fails for a package dpkg does not know: no kernel line then (no Proxmox VE here)
    # (dpkg-query's answer and `uname -r` through facts.shared: one of each per probe)
    command = f"{dpkg_show(['pve-manager'])} && {{ {take(UNAME['r'])}; echo \"kernel ${UNAME['r']}\"; }}; true"

    def requires_command(self, *args, **kwargs) -> str:
        return "dpkg-query"

    def process(self, output):
        return parse_pve_version(list(output))


class PvePackages(ShellFact):
    """
    Installed versions of the Proxmox VE packages (`PVE_PACKAGES`; what `pveversion -v` lists,
    read from dpkg without starting Perl).

    .. code:: python

        {"proxmox-ve": "8.4.0", "pve-manager": "8.4.11", "pve-container": "5.3.0",
         "qemu-server": "8.4.1", …}

    ``{}`` on a host without Proxmox VE.
    """

    command = f"{dpkg_show(list(PVE_PACKAGES))}; true"  # DPKG_VERSIONS' answer (facts.shared)

    def requires_command(self, *args, **kwargs) -> str:
        return "dpkg-query"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_dpkg_versions(list(output))


def parse_node_name(output_lines: list[str]) -> str | None:
    """`uname -n` → the Proxmox node name: the host name up to its first dot."""
    # follows pve-common PVE/INotify.pm nodename(): uname's nodename with the domain part cut off
    for line in output_lines:
        if line.strip():
            return line.strip().split(".", 1)[0] or None
    return None


class NodeName(ShellFact):
    """
    The name this host has as a Proxmox node (`uname -n` without the domain).

    .. code:: python

        "kpro6"
    """

    command = uname("n")  # `uname -n` (facts.shared)

    def process(self, output):
        return parse_node_name(list(output))


def parse_ha_resources(output_lines: list[str]) -> dict[str, dict]:
    """Pure parser of /etc/pve/ha/resources.cfg (section config: `vm: 300` / `ct: 200` headers,
    tab-indented `key value` lines) → ``{"vm:300": {"type": "vm", "id": 300, "state": "started",
    "options": {...}}}``. A resource without `state` is `started` (pve-ha-manager
    PVE/HA/Resources.pm: the state's default)."""
    resources: dict[str, dict] = {}
    current: dict | None = None
    for line in output_lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        header = re.match(r"^(\S+):\s*(\S+)\s*$", line)
        if header and not line[0].isspace():
            kind, name = header.group(1).lower(), header.group(2)
            current = {"type": kind, "id": int(name) if name.isdigit() else name, "state": "started", "options": {}}
            resources[f"{kind}:{name}"] = current
            continue
        if current is None:
            continue
        key, _, value = line.strip().partition(" ")
        if key == "state":
            # "enabled" is an old alias of "started" (PVE/HA/Config.pm)
            current["state"] = "started" if value.strip() == "enabled" else value.strip()
        else:
            current["options"][key] = value.strip()
    return resources


class HaResources(ShellFact):
    """
    The cluster's HA resources, /etc/pve/ha/resources.cfg.

    .. code:: python

        {"vm:300": {"type": "vm", "id": 300, "state": "started", "options": {"group": "gpu"}},
         "ct:200": {"type": "ct", "id": 200, "state": "stopped", "options": {}}}
    """

    command = "cat /etc/pve/ha/resources.cfg 2>/dev/null || true"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_ha_resources(list(output))


class LxcConfigs(ShellFact):
    """
    Every container config on this node, /etc/pve/lxc/<ctid>.conf, parsed.

    .. code:: python

        {129: {"options": {"arch": "amd64", "cores": "8", "unprivileged": "1", …},
               "devices": {"dev0": {"path": "/dev/nvidia0", "gid": "44"}},
               "lxc": [["lxc.cgroup2.devices.allow", "c 195:* rwm"],      # raw, in file order
                       ["lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind,optional,create=file"]],
               "comments": ["#GPU container", "#dev1%3A /dev/nvidia1"],
               "snapshots": {"before-driver": ["arch: amd64", …]}}}   # raw lines, untouched
    """

    # a CT config is a few hundred bytes; ContainerGpuState reads the same files
    command = _config_files_command("/etc/pve/lxc", builtin=True)

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_guest_configs(output, "lxc")


class QemuConfigs(ShellFact):
    """
    Every VM config on this node, /etc/pve/qemu-server/<vmid>.conf, parsed.

    .. code:: python

        {200: {"options": {"machine": "q35", "memory": "65536", …},
               "hostpci": {"hostpci0": {"mapping": "gpu0", "host": [], "pcie": True,
                                        "options": {"pcie": "1"}}},
               "lxc": [], "comments": [], "snapshots": {}}}
    """

    command = _config_files_command("/etc/pve/qemu-server")

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_guest_configs(output, "qemu")


class PciMappings(ShellFact):
    """
    Cluster PCI resource mappings, /etc/pve/mapping/pci.cfg (incident 11).

    .. code:: python

        {"gpu0": {"map": [{"node": "kpro6", "path": "0000:01:00.0", "id": "10de:2bb5",
                           "subsystem-id": "10de:204e", "iommugroup": "12"}],
                  "description": "GPU 0", "mdev": False, "options": {}}}
    """

    command = "cat /etc/pve/mapping/pci.cfg 2>/dev/null || true"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_pci_mappings(output)
