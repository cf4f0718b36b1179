"""PCI devices from sysfs (no pciutils needed) and ACS control on bridges."""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from facts.base import ShellFact
from facts.shell import word

BDF = r"(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
SYSFS_ATTRIBUTES = (
    "vendor device subsystem_vendor subsystem_device class revision numa_node local_cpulist "
    "current_link_speed current_link_width max_link_speed max_link_width"
)
# Hex attributes reported without their 0x prefix.
HEX_ATTRIBUTES = ("vendor", "device", "subsystem_vendor", "subsystem_device", "class", "revision")
# ACS Control register bits 0-6, in this order (PCIe spec; the kernel's include/uapi/linux/pci_regs.h
# PCI_ACS_SV .. PCI_ACS_DT), named as lspci prints them.
ACS_FLAGS = ("SrcValid", "TransBlk", "ReqRedir", "CmpltRedir", "UpstreamFwd", "EgressCtrl", "DirectTrans")
# Flags that send peer traffic up to the root complex instead of across the switch.
ACS_REDIRECT_FLAGS = ("ReqRedir", "CmpltRedir", "EgressCtrl")
# PCIe extended capability ID of ACS (pci_regs.h PCI_EXT_CAP_ID_ACS); its control word sits at +6.
ACS_EXT_CAP_ID = 0x000D


def full_bdf(address: str) -> str:
    """`c1:00.0` → `0000:c1:00.0` (lspci without -D and user listings leave the domain out)."""
    address = address.lower()
    return address if address.count(":") == 2 else f"0000:{address}"


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if re.fullmatch(r"-?\d+", value) else None


def _new_pci_device(realpath: str) -> dict:
    parts = [part for part in realpath.split("/") if part]
    root = next((part for part in parts if re.fullmatch(r"pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}", part)), None)
    chain = [part.lower() for part in parts if re.fullmatch(BDF, part)]
    return {
        "vendor": None,
        "device": None,
        "subsystem_vendor": None,
        "subsystem_device": None,
        "class": None,
        "revision": None,
        "driver": None,
        "numa_node": None,
        "local_cpulist": None,
        "iommu_group": None,
        "physfn": None,
        "link": {"speed": None, "width": None, "max_speed": None, "max_width": None},
        "bars": {},
        "root": root,
        "bridges": chain[:-1],
    }


def _set_resource(device: dict, index: int, line: str) -> bool:
    """One line of a function's `resource` table (index = line number); False if not one."""
    match = re.match(r"^\s*0x([0-9a-fA-F]+)\s+0x([0-9a-fA-F]+)\s+0x([0-9a-fA-F]+)\s*$", line)
    if not match:
        return False
    start, end = int(match.group(1), 16), int(match.group(2), 16)
    # Lines 0-5 are the BARs; 6 is the ROM and later ones bridge windows.
    if index <= 5 and end > start:
        device["bars"][index] = end - start + 1
    return True


def _set_attribute(device: dict, name: str, value: str) -> None:
    if name in HEX_ATTRIBUTES:
        device[name] = value[2:].lower() if value.lower().startswith("0x") else value.lower()
    elif name == "numa_node":
        node = _int_or_none(value)
        device[name] = node if node is not None and node >= 0 else None
    elif name == "local_cpulist":
        device[name] = value or None
    elif name == "current_link_speed":
        device["link"]["speed"] = value or None
    elif name == "max_link_speed":
        device["link"]["max_speed"] = value or None
    elif name == "current_link_width":
        device["link"]["width"] = _int_or_none(value)
    elif name == "max_link_width":
        device["link"]["max_width"] = _int_or_none(value)


def parse_pci_devices(output_lines: list[str]) -> dict[str, dict]:
    """Pure parser of the sysfs listing `PciDevices.command` prints (shape: see `PciDevices`):
    `== BDF -> path` headers with their `driver|iommu_group|physfn -> target` links, then
    `BDF/attribute:value` lines. Also reads the per-function form (`attribute: value` lines and a
    `resource:` table under each header) that scripts/record-gpu-host.sh records."""
    devices: dict[str, dict] = {}
    current: dict | None = None
    resource_index: int | None = None
    resource_of: dict[str, int] = {}  # BDF -> next resource line index (grep form)
    for line in output_lines:
        header = re.match(rf"^== ({BDF}) -> (\S+)\s*$", line)
        if header:
            current = devices[header.group(1).lower()] = _new_pci_device(header.group(2))
            resource_index = None
            continue
        grepped = re.match(rf"^({BDF})/([a-z_]+):(.*)$", line)
        if grepped:  # the fact's own form: `BDF/attribute:value` (after every header)
            bdf, name, value = grepped.group(1).lower(), grepped.group(2), grepped.group(3)
            if bdf not in devices:
                continue
            if name == "resource":
                index = resource_of.get(bdf, 0)
                resource_of[bdf] = index + 1
                _set_resource(devices[bdf], index, value)
            else:
                _set_attribute(devices[bdf], name, value.strip())
            current, resource_index = None, None
            continue
        if current is None:
            continue
        if line.strip() == "resource:":
            resource_index = 0
            continue
        if resource_index is not None:
            if _set_resource(current, resource_index, line):
                resource_index += 1
                continue
            resource_index = None
        link = re.match(r"^(driver|iommu_group|physfn) -> (\S+)\s*$", line)
        if link:
            name, target = link.group(1), link.group(2).rstrip("/").rsplit("/", 1)[-1]
            if name == "iommu_group":
                current[name] = _int_or_none(target)
            else:
                current[name] = target
            continue
        attribute = re.match(r"^([a-z_]+): ?(.*?)\s*$", line)
        if attribute:
            _set_attribute(current, *attribute.groups())
    return devices


def acs_entry(ctl_word: int) -> dict:
    """A PciAcs entry from the ACS Control register's value."""
    ctl = {flag: bool(ctl_word >> bit & 1) for bit, flag in enumerate(ACS_FLAGS)}
    return {
        "status": "enabled" if any(ctl.values()) else "disabled",
        "redirect": any(ctl[flag] for flag in ACS_REDIRECT_FLAGS),
        "ctl": ctl,
    }


def parse_acs(output_lines: list[str]) -> dict[str, dict]:
    """Pure parser of `bridge <bdf>` and `acs <bdf> <control|none|short> <words>` lines (the
    sysfs config walk) plus `lspci -vvv` text (shape: see `PciAcs`). What config space says wins
    over lspci for the same function."""
    result: dict[str, dict] = {}
    from_config: set[str] = set()
    current: str | None = None

    def unknown() -> dict:
        return {"status": "unknown", "redirect": None, "ctl": None}

    for line in output_lines:
        clique = re.match(rf"^clique ({BDF}) (?:(\d+) (\d+)|(none)|(short))\s*$", line)
        if clique:
            bdf = full_bdf(clique.group(1))
            result[bdf] = {"status": "gpu", "redirect": None, "ctl": None,
                           "clique": int(clique.group(2)) if clique.group(2) else None,
                           "clique_version": int(clique.group(3)) if clique.group(3) else None,
                           "clique_read": not clique.group(5)}
            from_config.add(bdf)
            current = None
            continue
        walked = re.match(rf"^acs ({BDF}) (\d+|none|short) (\d+)\s*$", line)
        if walked:
            bdf, value = full_bdf(walked.group(1)), walked.group(2)
            if value == "short":  # only the first 64 bytes: not root, or the device is gone
                result.setdefault(bdf, unknown())
                continue
            from_config.add(bdf)
            result[bdf] = (acs_entry(int(value)) if value.isdigit()
                           else {"status": "absent", "redirect": False, "ctl": None})
            current = None
            continue
        bridge = re.match(rf"^bridge ({BDF})\s*$", line)
        if bridge:
            result.setdefault(full_bdf(bridge.group(1)), unknown())
            current = None
            continue
        header = re.match(rf"^({BDF})\s+\S", line)
        if header:
            current = full_bdf(header.group(1))
            if current in from_config:
                current = None
                continue
            # Seen by lspci with its capabilities readable: no ACSCtl line means no ACS capability.
            result[current] = {"status": "absent", "redirect": False, "ctl": None}
            continue
        if current is None:
            continue
        if "Capabilities: <access denied>" in line:
            result[current] = unknown()
            continue
        match = re.match(r"^\s*ACSCtl:\s*(.*)$", line)
        if match:
            ctl = {
                flag: sign == "+"
                for flag, sign in re.findall(r"(\w+)([+-])", match.group(1))
                if flag in ACS_FLAGS
            }
            result[current] = {
                "status": "enabled" if any(ctl.values()) else "disabled",
                "redirect": any(ctl.get(flag, False) for flag in ACS_REDIRECT_FLAGS),
                "ctl": ctl,
            }
    return result


class PciDevices(ShellFact):
    """
    Every PCI function, read from sysfs (works without pciutils, also in VMs).

    .. code:: python

        {"0000:41:00.0": {
            "vendor": "10de", "device": "2bb5", "subsystem_vendor": "10de",
            "subsystem_device": "204e", "class": "030200", "revision": "a1",
            "driver": "nvidia",            # or None
            "numa_node": 0,                # None for -1
            "local_cpulist": "0-31",
            "iommu_group": 12,             # None with the IOMMU off (and in most VMs)
            "physfn": None,                # the PF's BDF for an SR-IOV VF
            "link": {"speed": "32.0 GT/s PCIe", "width": 16,
                     "max_speed": "32.0 GT/s PCIe", "max_width": 16},
            "bars": {0: 67108864, 1: 137438953472, 3: 33554432},   # index -> bytes
            "root": "pci0000:40",          # the root complex (host bridge)
            "bridges": ["0000:40:01.1"],   # upstream bridges, root port first
        }}
    """

    # Two parts, no program per PCI function (a host with 8 GPUs has hundreds): shell builtins
    # resolve each function's sysfs links (`cd -P`; the parser keeps only a link's last
    # component), then ONE grep prints every attribute and resource table as `BDF/attr:value`;
    # `-m 6` (per file) keeps a table's BAR lines 0-5, the only ones read (not the ROM, bridge
    # windows and SR-IOV BARs: more than half of the lines on a GPU host).
    command = (
        "for d in /sys/bus/pci/devices/*; do "
        '[ -e "$d" ] || continue; '
        'cd -P "$d" 2>/dev/null || continue; '
        'echo "== ${d##*/} -> $PWD"; '
        'for l in driver iommu_group physfn; do '
        '[ -e "$d/$l" ] && cd -P "$d/$l" 2>/dev/null && echo "$l -> $PWD"; done; '
        "done; "
        "cd /sys/bus/pci/devices 2>/dev/null && grep -H -s -m 6 '' "
        + " ".join(f"*/{a}" for a in SYSFS_ATTRIBUTES.split())
        + " */resource; true"
    )

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_pci_devices(output)


# The walk of every bridge's config words, in plain POSIX awk (mawk: no bitwise operators, so
# h & 65535 is h % 65536, h >> 20 & 4092 is the 12-bit offset less its low 2 bits). Prints
# `bridge <bdf>` and `acs <bdf> <control|none|short> <words read>` per bridge, at the end; exit 1
# when a bridge read short (lspci is asked then). Two input forms:
# - one od for all bridges: `stat -c '%s %n'` lines (each config's size and path), `==`, then
#   od's words of all configs in that order, cut by the sizes; where they do not add up (a reader
#   that gets less, a read error) or a size is missing: exit 2, nothing printed;
# - `-v framed=1`, one od per bridge (the fallback): `@ <path>` before each config's words, a
#   bridge's size being what its od read.
# The configs of NVIDIA display functions (`-v gpus=<their paths>`) ride in the same od: for each,
# the standard capability list from the pointer at 0x34 (byte 0 the ID, byte 1 the next offset)
# is walked to NVIDIA's Virtual P2P Approval capability - a vendor-specific one (ID 9) with the
# signature "P2P" in bytes 3-5 and the GPUDirect clique ID in bits 3-6 of byte 6 (version in bits
# 0-2), as open-gpu-kernel-modules chipset_pcie.c reads it (nvpcie.h NV_PCI_VIRTUAL_P2P_APPROVAL_*)
# and QEMU's hw/vfio/pci-quirks.c vfio_add_nv_gpudirect_cap() writes it for x-nv-gpudirect-clique
# (at 0xC8, or 0xD4 where MSI-X sits at 0xC8): `clique <bdf> <id> <version>`, `clique <bdf> none`,
# or `clique <bdf> short` (under 256 bytes read); a short GPU does not ask lspci.
_ACS_AWK = (
    'BEGIN { ng = split(gpus, gl, " "); for (i = 1; i <= ng; i++) G[gl[i]] = 1 } '
    'framed && $1 == "@" { p = $2; gp[++nb] = (p in G); sub(/\\/config$/, "", p); sub(/.*\\//, "", p); bdf[nb] = p; '
    "size[nb] = 0; next } "
    "framed { for (i = 1; i <= NF; i++) { w[++nw] = $i; size[nb] += 4 } next } "
    'phase == 0 && $0 == "==" { phase = 1; next } '
    "phase == 0 { size[++nb] = $1; p = $2; gp[nb] = (p in G); sub(/\\/config$/, \"\", p); sub(/.*\\//, \"\", p); "
    "bdf[nb] = p; total += $1 / 4; next } "
    "{ for (i = 1; i <= NF; i++) w[++nw] = $i } "
    "END { if (nb != want || (!framed && (phase != 1 || nw != total))) exit 2; base = 0; short = 0; "
    "for (j = 1; j <= nb; j++) { n = size[j] / 4; b = bdf[j]; "
    "if (gp[j]) { r = \"short\"; if (n >= 64) { r = \"none\"; o = w[base + 14] % 256; o -= o % 4; k = 0; "
    "while (o >= 64 && o <= 248 && k < 48) { h = w[base + o / 4 + 1]; x = w[base + o / 4 + 2]; "
    "if (h % 256 == 9 && int(h / 16777216) == 80 && x % 65536 == 20530) { "
    "r = int(x / 524288) % 16 \" \" int(x / 65536) % 8; break } "
    "o = int(h / 256) % 256; o -= o % 4; k++ } } "
    "out = out \"clique \" b \" \" r \"\\n\"; base += n; continue } "
    "out = out \"bridge \" b \"\\n\"; "
    "if (n < 64) { short = 1; out = out \"acs \" b \" short \" n \"\\n\"; base += n; continue } "
    "r = \"none\"; if (n >= 1024) { o = 256; k = 0; "
    "while (o >= 256 && k < 960) { h = w[base + o / 4 + 1]; if (h == 0 || h == 4294967295) break; "
    "if (h % 65536 == 13) { r = int(w[base + o / 4 + 2] / 65536); break } "
    "x = int(h / 1048576); o = x - x % 4; k++ } } "
    "out = out \"acs \" b \" \" r \" \" n \"\\n\"; base += n } "
    "printf \"%s\", out; exit short }"
)


class PciAcs(ShellFact):
    """
    ACS control of every PCI bridge (and of any function lspci shows ACS for, where it is asked),
    and the GPUDirect clique a hypervisor gave each NVIDIA GPU (read in the same `od`).

    .. code:: python

        {"0000:40:01.1": {"status": "enabled",   # enabled | disabled | absent | unknown
                          "redirect": True,      # ReqRedir/CmpltRedir/EgressCtrl set: P2P goes up
                          "ctl": {"SrcValid": True, "TransBlk": False, "ReqRedir": True, …}},
         "0000:00:01.0": {"status": "unknown", "redirect": None, "ctl": None},
         # an NVIDIA GPU: the hypervisor's GPUDirect clique from its config space (a guest's GPU
         # with QEMU's x-nv-gpudirect-clique); None where it has none, clique_read False when
         # fewer than 256 bytes were read (not root)
         "0000:01:00.0": {"status": "gpu", "redirect": None, "ctl": None, "clique": 1,
                          "clique_version": 0, "clique_read": True}}

    Bridges come from sysfs, ACS from each bridge's own config space (sysfs `config`, all bridges'
    in one `od`, cut by the sizes `stat` gives, else one `od` per bridge; root reads all 4096 bytes): one awk walks the extended capability list from
    offset 0x100 (header: ID in bits 0-15, next offset in bits 20-31, as the kernel's
    drivers/pci/pci.c pci_find_next_ext_capability() does) to the ACS capability (ID 0x000D) and
    prints its control word (bits 16-31 of the word at +4: the register at +6), as
    `acs <bdf> <control|none|short> <words read>`. `od -tu4` reads host byte order: config space
    is little-endian, as are the amd64/arm64 hosts Proxmox VE runs on. A 256-byte config (a
    conventional PCI bridge) has no ACS ("absent"); a 64-byte one is what a non-root reader
    gets ("unknown"), and only then `lspci -D -n -vvv` is asked (`-n`: numeric IDs, no parse of
    pci.ids); without lspci, or on "<access denied>", such a bridge stays "unknown".
    """

    command = (
        # every bridge's config in ONE od (and one stat for their sizes): awk cuts the words per
        # bridge by its size and walks each list; where the words read do not add up to the sizes
        # (a reader that gets less, a read error) one od per bridge feeds the same walk.
        # The size sysfs gives `config` is what root reads: 4096 where the device has extended
        # config space, else 256 (linux drivers/pci/pci-sysfs.c pci_dev_config_attr_bin_size and
        # pci_read_config, which gives a non-admin reader 64 bytes, or 128 for a CardBus bridge)
        # NVIDIA display functions' configs (vendor 0x10de, class 0x03xxxx) follow the bridges'
        # in the same od, for the GPUDirect clique capability (`_ACS_AWK`); sysfs paths hold no
        # space or glob character, so their list splits on spaces
        "u=; g=; set --; for d in /sys/bus/pci/devices/*; do "
        'c=; { read -r c; } 2>/dev/null < "$d/class"; '
        'case "$c" in 0x0604*) set -- "$@" "$d/config";; 0x03*) v=; { read -r v; } 2>/dev/null < "$d/vendor"; '
        '[ "$v" = 0x10de ] && g="$g $d/config";; esac; done; set -- "$@" $g; '
        f"if [ $# -gt 0 ]; then w='{_ACS_AWK}'; "
        "{ stat -L -c '%s %n' -- \"$@\"; echo ==; od -An -tu4 -v -- \"$@\"; } 2>/dev/null | "
        "awk -v want=$# -v gpus=\"$g\" \"$w\"; "
        # else one od per config, every config walked by the same awk
        "case $? in 0) ;; 1) u=1;; *) for f do echo \"@ $f\"; od -An -tu4 -v -- \"$f\" 2>/dev/null; done | "
        "awk -v want=$# -v gpus=\"$g\" -v framed=1 \"$w\"; [ $? -eq 1 ] && u=1;; esac; fi; "
        'if [ -n "$u" ] && command -v lspci >/dev/null 2>&1; then '
        "lspci -D -n -vvv 2>/dev/null | grep -E '^[[:xdigit:]]|ACSCtl|access denied'; "
        "fi; true"
    )

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_acs(output)


# Where distributions keep the PCI ID database (Debian's pci.ids package: /usr/share/misc).
PCI_IDS_PATHS = ("/usr/share/misc/pci.ids", "/usr/share/hwdata/pci.ids", "/usr/share/pci.ids")
_PCI_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{4}$")
# Prints the vendor lines of the wanted vendors and the device lines of the wanted IDs of
# pci.ids ("vvvv  name", then "<TAB>dddd  name" under it); stops at the class list ("C xx").
# Plain POSIX awk (Debian's mawk): no interval expressions.
_PCI_IDS_AWK = (
    'BEGIN { n = split(want, w, " "); for (i = 1; i <= n; i++) { split(w[i], p, ":"); V[p[1]] = 1; W[w[i]] = 1 } } '
    "/^C / { exit } "
    '/^[0-9a-f][0-9a-f][0-9a-f][0-9a-f]  / { v = $1; if (v in V) print "vendor " v " " substr($0, 7); next } '
    '/^\\t[0-9a-f][0-9a-f][0-9a-f][0-9a-f]  / { if ((v ":" $1) in W) print "device " v ":" $1 " " substr($0, 8) }'
)


def parse_pci_id_names(output_lines: list[str]) -> dict:
    """Pure parser of `PciIdNames` output (shape: see there)."""
    result: dict = {"database": None, "vendors": {}, "devices": {}}
    for line in output_lines:
        kind, _, rest = line.strip("\r\n").partition(" ")
        if kind == "file":
            result["database"] = rest.strip() or None
        elif kind == "vendor":
            vendor, _, name = rest.partition(" ")
            if re.fullmatch(r"[0-9a-f]{4}", vendor) and name.strip():
                result["vendors"][vendor] = name.strip()
        elif kind == "device":
            ids, _, name = rest.partition(" ")
            if _PCI_ID.match(ids) and name.strip():
                result["devices"][ids] = name.strip()
    return result


class PciIdNames(FactBase):
    """
    Names of PCI vendor:device IDs from the host's PCI ID database (pci.ids, the file lspci
    names devices from), for devices no driver names (a GPU bound to vfio-pci).

    + ids: ``["10de:2bb5", …]`` (vendor:device, hex)

    .. code:: python

        {"database": "/usr/share/misc/pci.ids",      # None: no database on the host
         "vendors": {"10de": "NVIDIA Corporation"},
         "devices": {"10de:2230": "GA102GL [RTX A6000]"}}   # IDs the database does not know are absent
    """

    def command(self, ids: list[str]) -> str:
        wanted = sorted({i.lower() for i in ids})
        bad = [i for i in wanted if not _PCI_ID.match(i)]
        if bad:
            raise ValueError(f"PciIdNames: not a vendor:device ID: {', '.join(bad)}")
        return (
            f"for f in {' '.join(PCI_IDS_PATHS)}; do [ -r \"$f\" ] || continue; echo \"file $f\"; "
            f"awk -v want={word(' '.join(wanted))} {word(_PCI_IDS_AWK)} \"$f\"; break; done; true"
        )

    @staticmethod
    def default() -> dict:
        return parse_pci_id_names([])

    def process(self, output):
        return parse_pci_id_names(list(output))
