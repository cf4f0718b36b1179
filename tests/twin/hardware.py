"""Hardware half of the digital twin: a profile (YAML) plus the configuration persisted in the
twin's root become a rendered sysfs/procfs view, device nodes and the state the stand-ins read.

Public API (see /work/notes/TWIN-CONTRACT.md):
    install(root, profile)      once per fresh root: profile, stand-ins, /etc/pve seed, the twin's
                                NVIDIA installer of the profile's driver version at
                                /opt/nvidia/NVIDIA-Linux-x86_64-<version>.run (tests/twin/installer.py),
                                render
    render(root)                one "boot": re-read persisted config, rewrite root/var/lib/twin/hw/
    mark_busy(root, bdf, holder="nvidia-persistenced") / clear_busy(root, bdf=None)
    load_profile(name_or_path) -> dict

Profile shape (tests/twin/profiles/<name>.yml; every key below is used by render):
    name, node                      profile name, Proxmox node name (hostname)
    extends: <profile>              optional: that profile's data with this file's keys over it
    debian: bookworm|trixie         the twin root's Debian suite (default bookworm; PVE 9: trixie)
    cpu: {vendor_id, model_name, family, model, stepping, microcode, mhz, cache_kb, sockets,
          cores_per_socket, threads_per_core, flags: "fpu ... sev_snp", bugs, address_sizes}
    numa_nodes: {0: "0-31,64-95", ...}          node -> cpulist
    memory_kib: int  |  meminfo: "<verbatim /proc/meminfo>"
    kernel: {release, version: "#1 SMP ...", builder: "build@proxmox", gcc, ld,
             installed: [releases], pci_iov: bool (13/17-line `resource` vs 7/11)}
    boot: {loader: systemd-boot|grub|none, cmdline: "<configured args>", root: "<root= for grub>",
           esp_uuid: "5A1C-9E27" | esp_uuids: [...]}   (the ESPs: partitions sdX2 at each boot,
           esp_devices; systemd-boot's choice: esp_boot_entry; the NVRAM: EFIVARS)
    pve: {version, repoid, kernel_helper, ...} | null (not a Proxmox host)
    iommu: {vendor: amd|intel|none, default_domain: DMA|DMA-FQ|identity, default_on: bool}
    modules_loaded: [names loaded at boot before modules-load.d]
    module_params: {module: {param: default}}   (/sys/module/<m>/parameters/<p>)
    nvidia: {version, open, builder, build_date, gcc, cuda_version, params: {...},
             nodes_at_boot: [uvm, caps]}          nodes a boot creates without any unit
    char_devices / block_devices: [[major, name], ...] (base lists; nvidia majors added)
    char_majors: {nvidia-uvm: 511, nvidia-caps: 510, vfio: 509, ...}
    p2p: {r: OK, w: OK, n: NS, a: NS, p: OK, legend_dr: bool}
    pci: [ {bdf, parent: <bridge bdf>|null, vendor, device, subsystem: "vvvv:dddd", class,
            revision, numa_node, irq, bridge: root_port|switch_upstream|switch_downstream,
            secondary_bus, link: {speed, width, max_speed, max_width},
            bars: [{index, start, size, flags}], rom: {start, size},
            iommu_group, driver, gpu: {name, uuid, serial, vbios, memory_mib, power_limit_w,
            compute_cap}, nic: "mlx5_0", acs_cap: 0x5f, acs_ctl: 0x00} ]
            (acs_cap: the bridge's ACS Capability bits, rendered into its sysfs `config`;
            acs_ctl: its Control bits, default what the kernel enables with the IOMMU on)
    guests: {lxc: {vmid: "<pct.conf text>"}, qemu: {vmid: "<qm.conf text>"}}
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import yaml

from tests.twin import installer

HERE = Path(__file__).resolve().parent
PROFILES_DIR = HERE / "profiles"
STANDINS_DIR = HERE / "standins"
TWIN_DIR = "var/lib/twin"

# stand-in source -> paths inside the twin root (one program may answer to several names)
STANDIN_PATHS = {
    "nvidia_smi.py": ["usr/local/bin/nvidia-smi"],
    "proxmox.py": ["usr/local/sbin/pct", "usr/local/sbin/qm", "usr/local/sbin/pvesh",
                   "usr/local/bin/pveversion", "usr/local/sbin/ha-manager", "usr/local/bin/pvecm",
                   "usr/local/bin/lxc-ls", "usr/local/bin/lxc-info",
                   # pve-manager's upgrade checklist (its format; standins/proxmox.py pve8to9)
                   "usr/local/bin/pve8to9"],
    # (proxmox-boot-tool, zz-proxmox-boot and bootctl are the real programs: the root's boot layer,
    # tests/twin/runtime.py KERNEL_HELPER; what they cannot have in a chroot is standins/esp.sh)
    "boot.py": ["usr/local/sbin/update-grub",
                "usr/local/sbin/reboot", "usr/local/sbin/shutdown", "usr/local/bin/systemctl",
                # the real names point at systemctl; absolute callers must reach the stand-in too
                "usr/sbin/reboot", "usr/sbin/shutdown",
                # grub-probe (--target=abstraction)
                "usr/local/sbin/grub-probe",
                # grub-mkconfig's Linux entries (a grub.d script of ours runs it by itself)
                "etc/grub.d/10_linux"],
    "hostdev.py": ["usr/local/bin/fuser", "usr/local/bin/nvidia-modprobe", "usr/local/bin/uname",
                   "usr/local/sbin/modprobe", "usr/local/bin/mokutil",
                   # OpenZFS's zpool (get) and findmnt of / (the profile's ZFS root: zfs.root)
                   "usr/local/sbin/zpool", "usr/local/bin/findmnt"],
}
# Stand-ins that are shell scripts run in the caller's process (standins/<name> -> paths)
SHELL_STANDIN_PATHS = {"esp.sh": ["usr/local/bin/mount", "usr/local/bin/umount", "usr/local/bin/lsblk",
                                 "usr/local/sbin/blkid", "usr/local/bin/bootctl", "usr/local/bin/systemd-detect-virt",
                                 "usr/local/sbin/grub-install.real"]}
# The Python stand-ins as modules (the stand-in server imports them) and as programs (run
# directly where the server is not reachable); each program path gets the small client
# (standins/client.c) when it can be built, else the Python program itself.
STANDIN_LIB_DIR = "usr/local/lib/twin"
STANDIN_SERVER = "standind.py"
CLIENT_SOURCE = STANDINS_DIR / "client.c"
CLIENT_CACHE = HERE.parents[1] / ".cache" / "twin"

BINDING_RULES = "etc/udev/rules.d/60-pvegpu-gpu-binding.rules"
RULE_RE = re.compile(r'KERNEL=="(?P<bdf>[0-9a-fA-F:.]+)".*ATTR\{driver_override\}="(?P<drv>[^"]*)"')

BASE_CHAR_DEVICES = [
    [1, "mem"], [4, "/dev/vc/0"], [4, "tty"], [4, "ttyS"], [5, "/dev/tty"], [5, "/dev/console"],
    [5, "/dev/ptmx"], [5, "ttyprintk"], [7, "vcs"], [10, "misc"], [13, "input"], [21, "sg"],
    [29, "fb"], [89, "i2c"], [128, "ptm"], [136, "pts"], [180, "usb"], [189, "usb_device"],
    [202, "cpu/msr"], [203, "cpu/cpuid"], [226, "drm"], [236, "ttyMAX"], [240, "hidraw"],
    [241, "ttyDBC"], [242, "bsg"], [243, "watchdog"], [244, "remoteproc"], [245, "ptp"],
    [246, "pps"], [247, "rtc"], [248, "dma_heap"], [249, "dax"], [250, "dimmctl"],
    [251, "ndctl"], [252, "tpm"], [253, "tpm"], [254, "gpiochip"],
]
BASE_BLOCK_DEVICES = [[7, "loop"], [8, "sd"], [9, "md"], [65, "sd"], [66, "sd"], [67, "sd"],
                      [128, "sd"], [230, "zvol"], [252, "device-mapper"], [253, "virtblk"],
                      [254, "mdp"], [259, "blkext"]]

# kernel resource flags (include/linux/ioport.h + PCI_BASE_ADDRESS bits) as seen in real sysfs
BAR_FLAGS = {"mem32": 0x40200, "mem32pref": 0x42208, "mem64": 0x140204, "mem64pref": 0x14220C,
             "io": 0x40101, "rom": 0x46200}

MODULE_SYSFS_NAMES = {"vfio-pci": "vfio_pci"}


# ---------------------------------------------------------------- profile + persisted config

def _overlay(base: dict, over: dict) -> dict:
    """`base` with `over`'s keys put over it: mappings merged key by key, anything else replaced."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _overlay(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_profile(name_or_path) -> dict:
    """A profile's data; `extends: <profile>` takes that profile's data and puts this file's keys
    over it (mappings merged, lists replaced): kpro6-pve9 is kpro6's hardware on Proxmox VE 9."""
    p = Path(name_or_path)
    if not p.suffix:
        p = PROFILES_DIR / f"{name_or_path}.yml"
    with open(p) as f:
        data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    parent = data.pop("extends", None)
    return _overlay(load_profile(parent), data) if parent else data


def profile_suite(name_or_path) -> str:
    """The Debian suite of a profile's twin root: `debian:` (PVE 9: trixie), else bookworm (PVE 8)."""
    return str(load_profile(name_or_path).get("debian") or "bookworm")


def _read(root: Path, rel: str) -> str | None:
    try:
        return (root / rel.lstrip("/")).read_text()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _symlink(link: Path, target: str) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(target, link)


def _glob_text(root: Path, pattern: str) -> list[tuple[str, str]]:
    out = []
    for p in sorted(root.glob(pattern)):
        if p.is_file():
            out.append((p.name, p.read_text(errors="replace")))
    return out


def persisted_bindings(root: Path) -> dict[str, str]:
    """{bdf: driver} from the udev driver_override rules (and driverctl overrides)."""
    out: dict[str, str] = {}
    text = _read(root, BINDING_RULES) or ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        m = RULE_RE.search(line)
        if m:
            out[_norm_bdf(m["bdf"])] = m["drv"]
    for name, text in _glob_text(root, "etc/driverctl.d/pci-*"):
        out[_norm_bdf(name[len("pci-"):])] = text.strip()
    return out


def modules_load(root: Path) -> list[str]:
    """Module names listed in /etc/modules-load.d/*.conf and /etc/modules, '-' normalised."""
    names = []
    files = _glob_text(root, "etc/modules-load.d/*.conf")
    etc_modules = _read(root, "etc/modules")
    if etc_modules:
        files.append(("modules", etc_modules))
    for _, text in files:
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith(";"):
                names.append(line.split()[0].replace("-", "_"))
    return names


def modprobe_options(root: Path) -> dict[str, dict[str, str]]:
    """{module: {param: value}} from `options` lines in modprobe.d (later files win)."""
    files: dict[str, str] = {}
    for d in ("lib/modprobe.d", "usr/lib/modprobe.d", "run/modprobe.d", "etc/modprobe.d"):
        for name, text in _glob_text(root, f"{d}/*.conf"):
            files[name] = text  # same name in a later dir overrides (modprobe.d(5))
    opts: dict[str, dict[str, str]] = {}
    for name in sorted(files):
        for line in files[name].replace("\\\n", " ").splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) >= 2 and words[0] == "options":
                mod = words[1].replace("-", "_")
                for kv in words[2:]:
                    k, _, v = kv.partition("=")
                    opts.setdefault(mod, {})[k] = v.strip('"')
    return opts


def installed_kernels(root: Path) -> list[str]:
    rels = []
    for p in (root / "boot").glob("vmlinuz-*"):
        rel = p.name[len("vmlinuz-"):]
        if (root / "lib/modules" / rel).is_dir():
            rels.append(rel)
    return sorted(rels, key=_version_key)


def _version_key(rel: str):
    return [int(x) if x.isdigit() else x for x in re.split(r"[.\-+~]", rel)]


ESP_LIST = "etc/kernel/proxmox-boot-uuids"
# The ESPs' vfat file systems: one directory per partition UUID, kept across reboots; each boot
# they are partitions /dev/sdX2 with /dev/disk/by-uuid/<uuid> (ESP_DEVICES, esp_devices) that the
# block-device stand-ins (tests/twin/standins/esp.sh) answer for and mount
ESP_ROOT = f"{TWIN_DIR}/esp"
ESP_DEVICES = f"{TWIN_DIR}/hw/esp-devices"
ESP_SIZE = 1 << 30  # the Proxmox installer's ESP: 1 GiB (proxmox-boot-tool refuses < 256 MiB)
# Releases that do not come up on this twin, one per line: `<release> [hangs|panics]` (default
# hangs). A kernel that hangs stays hung until a reset (`reset(root)` from outside the twin: the
# twin has no sshd then); one that panics resets by itself when its command line has panic=N
# (N > 0; the kernel's panic timeout, and initramfs-tools scripts/functions panic() reboots
# when panic= is set), else it waits like a hang. Each reset makes the boot loader choose again.
NO_BOOT = f"{TWIN_DIR}/boot/no-boot"
BOOT_ATTEMPTS = f"{TWIN_DIR}/boot/attempts"  # one line per boot attempt: "<release> <entry> <outcome>"
# The twin's NVRAM: one file per variable, named and laid out as efivarfs shows it (<name>-<guid>:
# 4 bytes of attributes, little-endian, then the data; linux fs/efivarfs). Bound read-write on
# /sys/firmware/efi/efivars at each boot (tests/twin/runtime.py Supervisor.mount_all), where the
# real bootctl reads and writes it; variables without EFI_VARIABLE_NON_VOLATILE go at each reset.
EFIVARS = f"{TWIN_DIR}/efivars"
LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"
GLOBAL_GUID = "8be4df61-93ca-11d2-aa0d-00e098032b8c"
EFI_NV, EFI_BS, EFI_RT = 0x1, 0x2, 0x4
GRUBENV = "boot/grub/grubenv"
MAX_ATTEMPTS = 8  # a reset loop longer than this is reported as one (the host never comes up)


def _entry_fields(text: str) -> dict:
    fields = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            fields[key] = value.strip()
    return fields


def _efivar(root: Path, name: str, consume: bool, guid: str = LOADER_GUID) -> str | None:
    """A string variable of the NVRAM (UTF-16LE, up to its NUL), deleted as it is read when `consume`."""
    path = root / EFIVARS / f"{name}-{guid}"
    if not path.exists():
        return None
    data = path.read_bytes()[4:]
    if consume:
        path.unlink()
    text = data.decode("utf-16-le", "replace")
    return text.split("\x00", 1)[0]


def set_efivar(root: Path, name: str, data: bytes, attrs: int, guid: str = LOADER_GUID) -> None:
    """Write a variable as efivarfs holds it: the attribute word, then the data."""
    path = root / EFIVARS / f"{name}-{guid}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<I", attrs) + data)


def _utf16z(text: str) -> bytes:
    return text.encode("utf-16-le") + b"\x00\x00"


def strverscmp_improved(root: Path, a: str, b: str) -> int:
    """systemd's own strverscmp_improved() (src/fundamental/string-util-fundamental.c), the order
    systemd-boot sorts its entries in, answered by the twin root's systemd: `systemd-analyze
    compare-versions` (src/analyze/analyze-compare-versions.c, systemd >= 252: exit 0 equal, 11
    newer, 12 older); a root without systemd (a bare root of the unit tests) asks this machine's.
    <0, 0, >0 as a is older, the same, newer."""
    command = ["systemd-analyze", "compare-versions", "--", a, b]
    if (root / "usr/bin/systemd-analyze").is_file():
        command = ["chroot", str(root), "/usr/bin/systemd-analyze", *command[1:]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if done.returncode not in (0, 11, 12):
        raise RuntimeError(f"systemd-analyze compare-versions {a} {b} in {root}: rc {done.returncode} {done.stderr}")
    return {0: 0, 11: 1, 12: -1}[done.returncode]


def _esp_entries(root: Path) -> tuple[list[dict], str | None] | None:
    """(entries in systemd-boot's order, loader.conf default) of the first listed ESP with a
    loader.conf (the ESP the firmware starts systemd-boot from). Follows systemd v252
    src/boot/efi/boot.c: config_entry_add_from_file (the id is the file name, lowercased; an
    entry whose `linux` file is not on the ESP is left out), config_entry_compare (without
    sort-key, as Proxmox writes them: by id, newest first by strverscmp_improved) and
    config_defaults_load_from_file (`default`, lowercased)."""
    uuids = [u.strip() for u in (_read(root, ESP_LIST) or "").splitlines() if u.strip()]
    for uuid in uuids:
        esp = root / ESP_ROOT / uuid
        conf = _read(esp, "loader/loader.conf")
        if conf is None:
            continue
        entries = []
        for p in (esp / "loader/entries").glob("*.conf"):
            fields = _entry_fields(p.read_text())
            linux = fields.get("linux", "")
            if not linux or not (esp / linux.lstrip("/")).is_file():
                continue
            entries.append({"file": p.name, "id": p.name.lower(), "version": fields.get("version", p.stem),
                            "options": fields.get("options", ""), "linux": linux})
        entries.sort(key=functools.cmp_to_key(lambda x, y: -strverscmp_improved(root, x["id"], y["id"])))
        default = None
        for line in conf.splitlines():
            words = line.split(None, 1)
            if len(words) == 2 and words[0] == "default":
                default = words[1].strip().lower()
        return entries, default
    return None


def esp_boot_entry(root: Path, consume: bool = False) -> dict | None:
    """The loader entry systemd-boot starts from the first listed ESP, chosen as systemd v252
    src/boot/efi/boot.c does: config_load_defaults reads LoaderEntryOneShot and deletes it
    (`consume`), then config_default_entry_select takes the first entry (in _esp_entries' order)
    whose id matches, as a glob (efi_fnmatch), the one-shot, else the EFI variable
    LoaderEntryDefault, else loader.conf's `default`, else the first entry. None when no ESP is
    listed or it holds no bootable entry. {"file": "proxmox-6.14.8-2-pve.conf", "id", "version",
    "options": "root=…", "linux"}"""
    found = _esp_entries(root)
    oneshot = _efivar(root, "LoaderEntryOneShot", consume)
    if found is None or not found[0]:
        return None
    entries, default = found
    for pattern in (oneshot, _efivar(root, "LoaderEntryDefault", False), default):
        if pattern:
            match = next((e for e in entries if fnmatch.fnmatchcase(e["id"], pattern.lower())), None)
            if match is not None:
                return match
    return entries[0]


def loader_variables(root: Path, profile: dict, entry: dict | None) -> None:
    """What systemd-boot (boot.c export_variables, config_load_all_entries, efi_main) and the
    firmware leave in the NVRAM for the booted system: at a reset the variables without
    EFI_VARIABLE_NON_VOLATILE go; then SecureBoot, LoaderInfo ("systemd-boot <version>", the
    version of the root's systemd-boot EFI binary package), LoaderFirmwareType, LoaderEntries
    (the ids, NUL-separated), LoaderEntrySelected, LoaderFeatures. Only where the profile boots
    with UEFI; the loader variables only when systemd-boot started an entry."""
    if not is_efi(profile):
        return
    nvram = root / EFIVARS
    if nvram.is_dir():
        for p in nvram.iterdir():
            data = p.read_bytes() if p.is_file() else b""
            if len(data) < 4 or not struct.unpack("<I", data[:4])[0] & EFI_NV:
                p.unlink()
    set_efivar(root, "SecureBoot", b"\x01" if _secure_boot(root, profile) else b"\x00", EFI_BS | EFI_RT, GLOBAL_GUID)
    if profile["boot"]["loader"] != "systemd-boot" or entry is None:
        return
    status = _read(root, "var/lib/dpkg/status") or ""
    m = re.search(r"^Package: systemd-boot-efi\n(?:[^\n]+\n)*?Version: (\S+)", status, re.M)
    found = _esp_entries(root)
    volatile = EFI_BS | EFI_RT
    set_efivar(root, "LoaderInfo", _utf16z(f"systemd-boot {m.group(1) if m else 'unknown'}"), volatile)
    set_efivar(root, "LoaderFirmwareType", _utf16z("UEFI 2.70"), volatile)
    set_efivar(root, "LoaderEntries", b"".join(_utf16z(e["id"]) for e in (found[0] if found else [])), volatile)
    set_efivar(root, "LoaderEntrySelected", _utf16z(entry["id"]), volatile)
    # boot.c efi_main: EFI_LOADER_FEATURE_CONFIG_TIMEOUT … _DEVICETREE (bits 0-10)
    set_efivar(root, "LoaderFeatures", struct.pack("<Q", (1 << 11) - 1), volatile)


def _entry_release(entry: dict) -> str:
    m = re.search(r"vmlinuz-(\S+)$", entry.get("linux", ""))
    return m.group(1) if m else entry["version"]


def _grubenv(root: Path, rel: str = GRUBENV) -> dict:
    """grubenv's variables (GRUB's environment block: `# GRUB Environment Block`, name=value
    lines, padded with '#' to 1024 bytes)."""
    env = {}
    for line in (_read(root, rel) or "").splitlines():
        if line and not line.startswith("#") and "=" in line:
            name, _, value = line.partition("=")
            env[name] = value
    return env


def _write_grubenv(root: Path, env: dict, rel: str = GRUBENV) -> None:
    body = "# GRUB Environment Block\n" + "".join(f"{k}={v}\n" for k, v in env.items())
    _write(root / rel, body + "#" * max(0, 1024 - len(body.encode())))


def _grub_menu(cfg: str) -> list[dict]:
    """Top-level items of a grub.cfg: menuentries {"title", "id", "linux"} and submenus
    {"title", "id", "items"} (the form grub-mkconfig's 10_linux writes)."""
    top: list[dict] = []
    stack: list[list] = [top]
    for line in cfg.splitlines():
        m = re.match(r"^\s*(menuentry|submenu)\s+'([^']*)'.*?(?:\$menuentry_id_option\s+'([^']*)')?\s*\{\s*$", line)
        if m:
            item: dict = {"title": m.group(2), "id": m.group(3) or m.group(2)}
            if m.group(1) == "submenu":
                item["items"] = []
            stack[-1].append(item)
            stack.append(item.get("items", item.setdefault("_body", [])))
            continue
        if re.match(r"^\s*\}\s*$", line) and len(stack) > 1:
            stack.pop()
            continue
        m = re.match(r"^\s*linux\s+(\S+)\s*(.*)$", line)
        if m and len(stack) > 1 and isinstance(stack[-2], list):
            owner = stack[-2][-1] if stack[-2] else None
            if owner is not None and "items" not in owner:
                owner["linux"], owner["args"] = m.group(1), m.group(2)
    return top


def _grub_resolve(menu: list[dict], default: str) -> dict | None:
    """GRUB's default: an index, a title or an id, `>` separating submenu levels."""
    items = menu
    found = None
    for part in default.split(">"):
        found = None
        if part.isdigit():
            found = items[int(part)] if int(part) < len(items) else None
        else:
            found = next((i for i in items if part in (i["id"], i["title"])), None)
        if found is None:
            return None
        items = found.get("items", [])
    return found if found is not None and "linux" in found else None


# grub-core/commands/loadenv.c check_blocklists: save_env writes the env block's sectors in place,
# which GRUB cannot on LVM/RAID nor on file systems whose blocks it does not map to one disk's sectors
# (Debian grub-common 2.06 util/grub.d/00_header.in check_writable lists them)
GRUB_UNWRITABLE_FS = ("btrfs", "cpiofs", "newc", "odc", "romfs", "squash4", "tarfs", "zfs")


def grubenv_writable(profile: dict) -> bool:
    """Whether GRUB's save_env succeeds on the profile's /boot/grub (boot.grubenv_abstraction, boot.grubenv_fs)."""
    boot = profile.get("boot") or {}
    return (boot.get("grubenv_abstraction") not in ("lvm", "diskfilter")
            and (boot.get("grubenv_fs") or "ext2") not in GRUB_UNWRITABLE_FS)


def grub_esp_prefix(root: Path, profile: dict) -> str | None:
    """GRUB's $prefix on a host in proxmox-boot-tool's grub mode (profile boot.loader grub-esp), as
    a path in the twin root: grub/ of the ESP the firmware starts GRUB from. grub-install (run by
    proxmox-kernel-helper bin/proxmox-boot-tool init_bootloader with --boot-directory on the ESP)
    puts GRUB's image on each ESP with its prefix there; the twin's firmware starts the first
    listed ESP's (UEFI: EFI/proxmox/grubx64.efi, the NVRAM entry grub-install adds; legacy BIOS:
    the first disk's boot code). None where no listed ESP has GRUB."""
    mark = "EFI/proxmox/grubx64.efi" if is_efi(profile) else "grub"
    for uuid in [u.strip() for u in (_read(root, ESP_LIST) or "").splitlines() if u.strip()]:
        if (root / ESP_ROOT / uuid / mark).exists():
            return f"{ESP_ROOT}/{uuid}/grub"
    return None


def grub_boot_entry(root: Path, profile: dict, consume: bool = False) -> dict | None:
    """The entry GRUB boots, as the grub.cfg update-grub wrote runs (util/grub.d/00_header.in):
    grubenv next_entry when set, cleared by save_env (`consume`; GRUB cannot write its
    environment on LVM, RAID, btrfs or ZFS: `grubenv_writable`, then it stays set), else the
    header's `set default=`, ${saved_entry} expanded; an unknown default boots entry 0. GRUB on
    an ESP (grub-esp) reads both from its $prefix there (`grub_esp_prefix`), a vfat file system
    whose blocks save_env writes in place (grub-core/commands/loadenv.c).
    {"release", "args", "id"} or None without a grub.cfg menu."""
    prefix = "boot/grub"
    if profile["boot"]["loader"] == "grub-esp":
        found = grub_esp_prefix(root, profile)
        if found is None:
            return None
        prefix = found
    cfg = _read(root, f"{prefix}/grub.cfg") or ""
    menu = _grub_menu(cfg)
    if not menu:
        return None
    env = _grubenv(root, f"{prefix}/grubenv")
    m = re.search(r'^\s*else\s*\n\s*set default="([^"]*)"', cfg, re.M)
    default = m.group(1) if m else "0"
    default = default.replace("${saved_entry}", env.get("saved_entry", ""))
    chosen = None
    if env.get("next_entry"):
        chosen = _grub_resolve(menu, env["next_entry"])
        writable = prefix != "boot/grub" or grubenv_writable(profile)
        if consume and writable:
            env["next_entry"] = ""
            _write_grubenv(root, env, f"{prefix}/grubenv")
    if chosen is None:
        chosen = _grub_resolve(menu, default) or _grub_resolve(menu, "0")
    if chosen is None:
        return None
    rel = re.sub(r"^.*vmlinuz-", "", chosen["linux"])
    return {"release": rel, "args": chosen.get("args", ""), "id": chosen["id"], "image": chosen["linux"]}


def _no_boot(root: Path) -> dict[str, str]:
    out = {}
    for line in (_read(root, NO_BOOT) or "").splitlines():
        parts = line.split()
        if parts:
            out[parts[0]] = parts[1] if len(parts) > 1 else "hangs"
    return out


def choose_boot(root: Path, profile: dict, consume: bool = False) -> dict:
    """One power-on: the loader chooses (consuming its one-shots when `consume`), the kernel
    comes up, hangs, or panics and resets (then the loader chooses again).
    {"release", "cmdline", "entry", "hung": bool, "attempts": [[release, entry, outcome], …]}"""
    loader = profile["boot"]["loader"]
    installed = installed_kernels(root)
    no_boot = _no_boot(root)
    attempts: list[list[str]] = []
    while True:
        release, cmdline, ident = _loader_choice(root, profile, installed, consume)
        refused = shim_refusal(root, profile, release)
        if refused:
            attempts.append([release, ident, f"hung ({refused})"])
            return {"release": release, "cmdline": cmdline, "entry": ident, "hung": True, "attempts": attempts,
                    "loader": loader}
        mode = no_boot.get(release)
        panic = _cmdline_params(cmdline).get("panic")
        if mode is None:
            attempts.append([release, ident, "up"])
            return {"release": release, "cmdline": cmdline, "entry": ident, "hung": False, "attempts": attempts}
        if mode == "panics" and panic and panic.lstrip("-").isdigit() and int(panic) != 0 and consume \
                and len(attempts) < MAX_ATTEMPTS:
            attempts.append([release, ident, f"panic, reset after {panic} s (panic={panic})"])
            continue
        outcome = "hung (panic without panic=: waits at the console)" if mode == "panics" else "hung"
        if len(attempts) >= MAX_ATTEMPTS:
            outcome = f"reset loop: panicked {len(attempts)} times"
        attempts.append([release, ident, outcome])
        return {"release": release, "cmdline": cmdline, "entry": ident, "hung": True, "attempts": attempts,
                "loader": loader}


def _loader_choice(root: Path, profile: dict, installed: list[str], consume: bool) -> tuple[str, str, str]:
    boot = profile["boot"]
    if boot["loader"] == "systemd-boot":
        entry = esp_boot_entry(root, consume)
        if consume:
            loader_variables(root, profile, entry)
        if entry is not None:
            rel = _entry_release(entry)
            return rel, f"initrd=\\EFI\\proxmox\\{rel}\\initrd.img-{rel} {entry['options'].strip()}", entry["file"]
    elif boot["loader"] in ("grub", "grub-esp"):
        entry = grub_boot_entry(root, profile, consume)
        if entry is not None:
            return entry["release"], f"BOOT_IMAGE={entry['image']} {entry['args']}".strip(), entry["id"]
    rel = installed[-1] if installed else profile["kernel"]["release"]
    return rel, booted_cmdline(root, profile, rel), "-"


def booted_release(root: Path, profile: dict, previous: str | None = None) -> str:
    """The release a power-on would run now (nothing consumed)."""
    return choose_boot(root, profile)["release"]


def booted_cmdline(root: Path, profile: dict, release: str) -> str:
    """The command line of `release` where no loader entry names it (a loader-less profile)."""
    boot = profile["boot"]
    if boot["loader"] == "grub":
        return f"BOOT_IMAGE=/boot/vmlinuz-{release} {boot['cmdline']}".strip()
    if boot["loader"] == "systemd-boot":
        return f"initrd=\\EFI\\proxmox\\{release}\\initrd.img-{release} {boot['cmdline']}"
    return boot["cmdline"]


def _kernel_gcc(root: Path, profile: dict, release: str) -> str:
    """CONFIG_CC_VERSION_TEXT of the booted kernel's headers when we have them."""
    for rel in (f"usr/src/linux-headers-{release}/include/config/auto.conf",
                f"usr/src/linux-headers-{release}/.config", f"lib/modules/{release}/build/.config",
                f"boot/config-{release}"):
        text = _read(root, rel)
        if text:
            m = re.search(r'^CONFIG_CC_VERSION_TEXT="(.*)"$', text, re.M)
            if m:
                return m.group(1)
    return profile["kernel"]["gcc"]


def _nvidia_module(root: Path, release: str) -> dict | None:
    """version/license/gcc of an nvidia.ko installed for `release`, read from the ELF itself."""
    base = root / "lib/modules" / release
    if not base.is_dir():
        return None
    for p in sorted(base.rglob("nvidia.ko*")):
        data = p.read_bytes()
        if p.suffix in (".xz", ".zst", ".gz"):
            continue  # compressed modules: we do not decompress, fall back to the profile
        ver = re.search(rb"\x00version=([^\x00]+)\x00", data)
        if not ver:
            continue
        lic = re.search(rb"\x00license=([^\x00]+)\x00", data)
        gcc = re.search(rb"GCC: \(([^)\x00]*)\) ([^\s\x00]+)\x00", data)
        return {"version": ver.group(1).decode(),
                "open": bool(lic and b"GPL" in lic.group(1)),
                "gcc": f"gcc version {gcc.group(2).decode()} ({gcc.group(1).decode()})" if gcc else None,
                "path": "/" + str(p.relative_to(root))}
    return None


# -- module signatures: the twin's model of what the kernel loads (kernel/module/signing.c) -----

EFI_DIR = f"{TWIN_DIR}/efi"  # the twin's EFI variables: SecureBoot ("1"/"0"), MokListRT/ and MokNew/ (*.der)
MODULE_SIG_MAGIC = b"~Module signature appended~\n"  # include/linux/module_signature.h MODULE_SIG_STRING
PKEY_ID_PKCS7 = 2


def is_efi(profile: dict) -> bool:
    return profile["boot"]["loader"] == "systemd-boot" or bool(profile["boot"].get("uefi"))


def set_secure_boot(root: Path, on: bool) -> None:
    """Turn Secure Boot on or off in the twin's firmware (takes effect at the next render/boot)."""
    _write(Path(root) / EFI_DIR / "SecureBoot", "1\n" if on else "0\n")


def enroll_mok(root: Path, der: bytes, pending: bool = False) -> None:
    """Put a DER certificate in the twin's MOK list (MokListRT: enrolled, as after MokManager's
    confirmation) or, `pending`, in MokNew (imported with mokutil --import, not yet confirmed)."""
    d = Path(root) / EFI_DIR / ("MokNew" if pending else "MokListRT")
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{hashlib.sha256(der).hexdigest()[:16]}.der").write_bytes(der)


def _secure_boot(root: Path, profile: dict) -> bool:
    return is_efi(profile) and (_read(root, f"{EFI_DIR}/SecureBoot") or "0").strip() == "1"


def _enrolled(root: Path) -> list[bytes]:
    d = root / EFI_DIR / "MokListRT"
    return [p.read_bytes() for p in sorted(d.glob("*.der"))] if d.is_dir() else []


def module_signature_error(path: Path, enrolled: list[bytes]) -> str | None:
    """None when the module carries a signature that verifies with one of the `enrolled` DER certs,
    else the kernel's reason: "unsigned module" or "module with unavailable key" (the errors
    module_sig_check() lets through unless signatures are enforced). Follows kernel/module/signing.c
    mod_verify_sig(): the PKCS#7 blob and struct module_signature (12 bytes, sig_len big-endian
    last) sit before the magic string at the end; the signature covers everything before the blob.
    The verification is openssl's CMS check against each enrolled cert alone (the kernel looks the
    signer up in its keyrings: built-in keys plus the machine-owner keys)."""
    data = path.read_bytes()
    if not data.endswith(MODULE_SIG_MAGIC):
        return "unsigned module"
    end = len(data) - len(MODULE_SIG_MAGIC) - 12
    info = data[end:end + 12]
    sig_len = int.from_bytes(info[8:12], "big")
    if info[2] != PKEY_ID_PKCS7 or sig_len <= 0 or sig_len > end:
        return "module with unsupported crypto"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "sig").write_bytes(data[end - sig_len:end])
        (Path(tmp) / "body").write_bytes(data[:end - sig_len])
        for i, der in enumerate(enrolled):
            pem = subprocess.run(["openssl", "x509", "-inform", "DER"], input=der, capture_output=True)
            if pem.returncode != 0:
                continue
            (Path(tmp) / f"c{i}.pem").write_bytes(pem.stdout)
            done = subprocess.run(["openssl", "cms", "-verify", "-binary", "-inform", "DER", "-in", f"{tmp}/sig",
                                   "-content", f"{tmp}/body", "-certfile", f"{tmp}/c{i}.pem", "-nointern",
                                   "-noverify", "-out", "/dev/null"], capture_output=True)
            if done.returncode == 0:
                return None
    return "module with unavailable key"


def shim_refusal(root: Path, profile: dict, release: str) -> str | None:
    """Why shim refuses the kernel image GRUB loads under Secure Boot, or None. Proxmox boots a
    Secure Boot host through shim + GRUB (pve-docs system-booting.adoc): GRUB asks shim's verifier
    (shim_lock) about each image, and shim accepts an Authenticode signature by its vendor cert
    (Proxmox's, built into shim), a db cert or a MOK; otherwise GRUB says "bad shim signature" and
    stays at its menu (the twin: hung until a reset). The profile's own kernels stand for Proxmox's
    signed packages (vendor cert); any other image must verify (the twin's real sbverify, run in
    its root) against an enrolled MOK (MokListRT). Only GRUB profiles with UEFI are modelled."""
    if profile["boot"]["loader"] != "grub" or not _secure_boot(root, profile):
        return None
    stock = profile["kernel"].get("installed") or [profile["kernel"]["release"]]
    if release in stock:
        return None
    image = f"/boot/vmlinuz-{release}"
    if not (root / image.lstrip("/")).exists():
        return f"error: file `{image}' not found"
    work = root / TWIN_DIR / "boot"
    work.mkdir(parents=True, exist_ok=True)
    for i, der in enumerate(_enrolled(root)):
        pem = subprocess.run(["openssl", "x509", "-inform", "DER"], input=der, capture_output=True)
        if pem.returncode != 0:
            continue
        (work / f"mok-{i}.pem").write_bytes(pem.stdout)
        done = subprocess.run(["chroot", str(root), "sbverify", "--cert", f"/{TWIN_DIR}/boot/mok-{i}.pem", image],
                              capture_output=True)
        (work / f"mok-{i}.pem").unlink()
        if done.returncode == 0:
            return None
    return "Secure Boot: error: bad shim signature"


def module_load_refusal(root: Path, profile: dict, release: str, params: dict[str, str], path: Path) -> str | None:
    """The kernel's message when it refuses to load the module at `path` at boot, or None.

    A signature problem refuses the load when signatures are enforced (CONFIG_MODULE_SIG_FORCE=y in
    the release's config, module.sig_enforce=1 on the command line: "Loading of <reason> is
    rejected", modprobe then says "Key was rejected by service") or, with Secure Boot on, by
    lockdown (Debian's and Proxmox's kernels lock down under Secure Boot: LOCKDOWN_MODULE_SIGNATURE);
    otherwise the module loads and taints the kernel."""
    error = module_signature_error(path, _enrolled(root))
    if error is None:
        return None
    config = _read(root, f"boot/config-{release}") or ""
    if "CONFIG_MODULE_SIG_FORCE=y" in config.splitlines() or _truthy(params.get("module.sig_enforce", "")):
        return f"Loading of {error} is rejected"
    if _secure_boot(root, profile):
        return "Lockdown: modprobe: unsigned module loading is restricted; see man kernel_lockdown.7"
    return None


def _boot_units_nvidia_modprobe(root: Path) -> list[str]:
    """Command lines of nvidia-modprobe that an enabled unit or a udev rule runs at boot."""
    cmds = []
    for wants in sorted(root.glob("etc/systemd/system/*.wants/*")) + sorted(
            root.glob("etc/systemd/system/*.requires/*")):
        unit = wants
        if wants.is_symlink():
            target = os.readlink(wants)
            unit = root / target.lstrip("/") if target.startswith("/") else wants.parent / target
        try:
            text = unit.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.strip().startswith("ExecStart") and "nvidia-modprobe" in line:
                cmds.append(line.split("=", 1)[1])
    for _, text in _glob_text(root, "etc/udev/rules.d/*.rules"):
        for m in re.finditer(r'RUN\+="([^"]*nvidia-modprobe[^"]*)"', text):
            cmds.append(m.group(1))
    return cmds


def _norm_bdf(bdf: str) -> str:
    bdf = bdf.lower()
    return bdf if bdf.count(":") == 2 else f"0000:{bdf}"


def _cmdline_params(cmdline: str) -> dict[str, str]:
    params = {}
    for tok in cmdline.split():
        if tok == "--":
            break
        k, _, v = tok.partition("=")
        params[k] = v
    return params


def _truthy(v: str) -> bool:
    return str(v).strip().lower() in ("1", "y", "yes", "true", "on")


# ---------------------------------------------------------------- the boot computation

def compute(root: Path, profile: dict, previous: str | None = None, choice: dict | None = None) -> dict:
    """Everything a boot decides, as plain data (written to hw/state.json). `choice`: what the
    boot loader chose (`choose_boot`; None: choose now without consuming one-shots)."""
    choice = choice or choose_boot(root, profile)
    release, cmdline = choice["release"], choice["cmdline"]
    params = _cmdline_params(cmdline)

    iommu_cfg = profile.get("iommu") or {"vendor": "none"}
    vendor = iommu_cfg.get("vendor", "none")
    if vendor == "none":
        iommu_on = False
    else:
        flag = params.get(f"{vendor}_iommu", "")
        iommu_on = "off" not in flag.split(",") and (iommu_cfg.get("default_on", True) or "on" in flag.split(","))
    passthrough = params.get("iommu") == "pt" or params.get("iommu.passthrough") == "1"
    if passthrough:
        domain = "identity"
    elif params.get("iommu.strict") == "1":
        domain = "DMA"
    elif params.get("iommu.strict") == "0":
        domain = "DMA-FQ"
    else:
        domain = iommu_cfg.get("default_domain", "DMA")

    options = modprobe_options(root)
    loaded_extra = modules_load(root)
    vfio_at_boot = "vfio_pci" in loaded_extra
    bindings = persisted_bindings(root)
    vfio_ids = {i.lower() for i in options.get("vfio_pci", {}).get("ids", "").split(",") if i}

    drivers: dict[str, str | None] = {}
    for dev in profile["pci"]:
        bdf = dev["bdf"]
        override = bindings.get(bdf)
        default = dev.get("driver")
        if override == "vfio-pci" or (override is None and f"{dev['vendor']}:{dev['device']}" in vfio_ids):
            drv = "vfio-pci" if vfio_at_boot else None
        elif override:
            drv = override
        else:
            drv = default
        drivers[bdf] = drv

    # nvidia driver: the module for the booted kernel if we find one, else the profile's
    nv = dict(profile.get("nvidia") or {})
    module = _nvidia_module(root, release)
    kernel_log: list[str] = []
    refused = None
    if module:
        nv.update(version=module["version"], open=module["open"], module_path=module["path"])
        if module["gcc"]:
            nv["gcc"] = module["gcc"]
        refused = module_load_refusal(root, profile, release, params, root / module["path"].lstrip("/"))
    elif profile.get("pve") and nv.get("version") and nv.get("installed") is not False:
        # a Proxmox host whose driver is installed files (_seed_nvidia_install) booting a kernel without
        # an nvidia.ko (9's kernel after the 8 -> 9 upgrade, before the converge builds one): modprobe
        # finds nothing to load (kmod tools/modprobe.c: "Module %s not found in directory %s")
        refused = f"Module nvidia not found in directory /lib/modules/{release}"
    loaded = list(dict.fromkeys([m.replace("-", "_") for m in profile.get("modules_loaded", [])] + loaded_extra))
    if refused:
        # the kernel refused nvidia.ko: it and the modules that need it stay out, its GPUs get no driver
        kernel_log.append(f"nvidia: {refused}")
        loaded = [m for m in loaded if not m.startswith("nvidia")]
        drivers = {bdf: (None if d == "nvidia" else d) for bdf, d in drivers.items()}
    # fault knob (runtime.set_fault probe_fails): the driver's probe of these devices fails at boot;
    # the device stays without a driver and the kernel logs it (linux drivers/base/dd.c call_driver_probe)
    try:
        faults = json.loads((root / "var/lib/twin/faults.json").read_text() or "{}")
    except (OSError, ValueError):
        faults = {}
    for bdf in faults.get("probe_fails") or []:
        if drivers.get(bdf):
            kernel_log.append(f"{drivers[bdf]} {bdf}: probe of {bdf} failed with error -22")
            drivers[bdf] = None
    if any(d == "nvidia" for d in drivers.values()) and "nvidia" not in loaded:
        loaded.append("nvidia")
    if vfio_at_boot:
        for m in ("vfio", "vfio_iommu_type1", "vfio_pci_core"):
            if m not in loaded:
                loaded.append(m)
    nvidia_loaded = "nvidia" in loaded

    majors = dict(profile.get("char_majors") or {})
    boot_cmds = _boot_units_nvidia_modprobe(root)
    at_boot = set(nv.get("nodes_at_boot") or [])
    if any(re.search(r"(^|\s)(-u|--unified-memory)\b", c) for c in boot_cmds):
        at_boot.add("uvm")  # nvidia-modprobe -u loads nvidia_uvm and makes its nodes
        if nvidia_loaded and "nvidia_uvm" not in loaded:
            loaded.append("nvidia_uvm")

    module_params: dict[str, dict[str, str]] = {}
    for mod, defaults in (profile.get("module_params") or {}).items():
        if mod not in loaded:
            continue
        vals = {}
        for k, default in defaults.items():
            v = options.get(mod, {}).get(k)
            default = str(default)
            if v is None:
                vals[k] = default
            elif default in ("Y", "N"):
                vals[k] = "Y" if _truthy(v) else "N"
            else:
                vals[k] = v
        module_params[mod] = vals
    # SEV-SNP needs a translating IOMMU: the kernel drops SNP with iommu=pt or the IOMMU off
    if "kvm_amd" in module_params and "sev_snp" in module_params["kvm_amd"]:
        if not iommu_on or passthrough:
            module_params["kvm_amd"]["sev_snp"] = "N"

    nv_params = dict((profile.get("nvidia") or {}).get("params") or {})
    for k, v in options.get("nvidia", {}).items():
        if k.startswith("NVreg_"):
            nv_params[k[len("NVreg_"):]] = v

    # GPUs, minors in BDF order among nvidia-bound ones
    by_bdf = {d["bdf"]: d for d in profile["pci"]}
    gpus = []
    minor = 0
    for dev in sorted((d for d in profile["pci"] if d.get("gpu")), key=lambda d: d["bdf"]):
        drv = drivers[dev["bdf"]]
        g = dict(dev["gpu"])
        g.update(bdf=dev["bdf"], driver=drv, device_id=f"0x{dev['device'].upper()}{dev['vendor'].upper()}",
                 subsystem_id="0x{1}{0}".format(*dev.get("subsystem", "0000:0000").upper().split(":")),
                 numa_node=dev.get("numa_node", -1), link=dev.get("link") or {},
                 irq=dev.get("irq", 0), minor=None, index=None)
        if drv == "nvidia" and nvidia_loaded:
            g["minor"] = g["index"] = minor
            minor += 1
        gpus.append(g)
    for g in gpus:
        g["cpu_affinity"], g["numa_affinity"] = _affinity(profile, g["numa_node"])
    nics = [{"bdf": d["bdf"], "name": d["nic"], "driver": drivers[d["bdf"]]}
            for d in sorted(profile["pci"], key=lambda d: d["bdf"]) if d.get("nic")]

    endpoints = [g["bdf"] for g in gpus] + [n["bdf"] for n in nics]
    topology = {f"{a} {b}": _level(by_bdf, a, b) for a in endpoints for b in endpoints if a != b}

    # device nodes that exist after this boot
    nodes: list[dict] = []
    if nvidia_loaded:
        nodes.append({"path": "/dev/nvidiactl", "major": 195, "minor": 255, "mode": 0o666})
        if "nvidia_modeset" in loaded:
            nodes.append({"path": "/dev/nvidia-modeset", "major": 195, "minor": 254, "mode": 0o666})
        for g in gpus:
            if g["minor"] is not None:
                nodes.append({"path": f"/dev/nvidia{g['minor']}", "major": 195, "minor": g["minor"], "mode": 0o666})
    if nvidia_loaded and "uvm" in at_boot and "nvidia-uvm" in majors:
        u = majors["nvidia-uvm"]
        nodes += [{"path": "/dev/nvidia-uvm", "major": u, "minor": 0, "mode": 0o666},
                  {"path": "/dev/nvidia-uvm-tools", "major": u, "minor": 1, "mode": 0o666}]
    if nvidia_loaded and "caps" in at_boot and "nvidia-caps" in majors:
        c = majors["nvidia-caps"]
        nodes += [{"path": "/dev/nvidia-caps/nvidia-cap1", "major": c, "minor": 1, "mode": 0o400},
                  {"path": "/dev/nvidia-caps/nvidia-cap2", "major": c, "minor": 2, "mode": 0o444}]
    vfio_groups = sorted({by_bdf[b].get("iommu_group") for b, d in drivers.items()
                          if d == "vfio-pci" and iommu_on and by_bdf[b].get("iommu_group") is not None})
    if "vfio" in loaded:
        nodes.append({"path": "/dev/vfio/vfio", "major": 10, "minor": 196, "mode": 0o666})
        for i, grp in enumerate(vfio_groups):
            nodes.append({"path": f"/dev/vfio/{grp}", "major": majors.get("vfio", 509), "minor": i, "mode": 0o600})

    return {
        "profile": profile["name"], "node": profile.get("node", profile["name"]),
        "booted_at": time.time(),
        "boot": {"release": release, "cmdline": cmdline, "loader": profile["boot"]["loader"],
                 "entry": choice.get("entry"), "hung": choice.get("hung", False), "attempts": choice.get("attempts", []),
                 "gcc": _kernel_gcc(root, profile, release)},
        "iommu": {"enabled": iommu_on, "type": domain, "vendor": vendor},
        "modules": loaded, "module_params": module_params,
        "nvidia": {"loaded": nvidia_loaded, "version": nv.get("version"), "open": nv.get("open", True),
                   "cuda_version": nv.get("cuda_version"), "gcc": nv.get("gcc"),
                   "builder": nv.get("builder", ""), "build_date": nv.get("build_date", ""),
                   "params": nv_params, "boot_modprobe": boot_cmds},
        "gpus": gpus, "nics": nics, "topology": topology,
        "p2p": profile.get("p2p") or {}, "char_majors": majors,
        "drivers": drivers, "bindings": bindings, "vfio_at_boot": vfio_at_boot,
        "dev_nodes": nodes, "pve": profile.get("pve"),
        "secure_boot": _secure_boot(root, profile), "kernel_log": kernel_log,
        "sig_enforce": "CONFIG_MODULE_SIG_FORCE=y" in (_read(root, f"boot/config-{release}") or "").splitlines()
        or _truthy(params.get("module.sig_enforce", "")),
    }


def _affinity(profile: dict, numa: int) -> tuple[str, str]:
    nodes = {int(k): v for k, v in (profile.get("numa_nodes") or {}).items()}
    if numa is not None and numa >= 0 and numa in nodes:
        return nodes[numa], str(numa)
    return _all_cpus(profile), "0" if len(nodes) <= 1 else "N/A"


def _all_cpus(profile: dict) -> str:
    c = profile["cpu"]
    return f"0-{c['sockets'] * c['cores_per_socket'] * c['threads_per_core'] - 1}"


def _chain(by_bdf: dict, bdf: str) -> list[str]:
    """[root complex, bridge, ..., bdf] from the top down."""
    chain = [bdf]
    while by_bdf[chain[0]].get("parent"):
        chain.insert(0, by_bdf[chain[0]]["parent"])
    chain.insert(0, "pci" + chain[0][:7])
    return chain


def _level(by_bdf: dict, a: str, b: str) -> str:
    """nvidia-smi topo -m level between two endpoints, from the PCI tree and NUMA nodes."""
    ca, cb = _chain(by_bdf, a)[:-1], _chain(by_bdf, b)[:-1]
    if ca[0] != cb[0]:
        na, nb = by_bdf[a].get("numa_node", -1), by_bdf[b].get("numa_node", -1)
        return "NODE" if na == nb else "SYS"
    common = 0
    while common < min(len(ca), len(cb)) and ca[common] == cb[common]:
        common += 1
    if common == 1:
        return "PHB"  # diverge at the host bridge: different root ports of one root complex
    rest = ca[common:] + cb[common:]
    if any(by_bdf[x].get("bridge") == "switch_upstream" for x in rest):
        return "PXB"
    return "PIX"


# ---------------------------------------------------------------- rendering

def render(root: Path) -> None:
    """One boot: rewrite root/var/lib/twin/hw from profile.yml + persisted config."""
    root = Path(root)
    profile = load_profile(root / TWIN_DIR / "profile.yml")
    before = _read(root, f"{TWIN_DIR}/hw/state.json")
    previous = json.loads(before)["boot"]["release"] if before else None
    choice = choose_boot(root, profile, consume=True)  # the loader's one-shots are used up here
    if profile["boot"]["loader"] != "systemd-boot":
        loader_variables(root, profile, None)  # (systemd-boot's: _loader_choice, as it chooses)
    with open(_ensure_dir(root / BOOT_ATTEMPTS), "a") as log:
        log.writelines(f"{r} {e} {o}\n" for r, e, o in choice["attempts"])
    state = compute(root, profile, previous, choice)
    hw = root / TWIN_DIR / "hw"
    if hw.exists():
        shutil.rmtree(hw)
    hw.mkdir(parents=True)
    _render_sys(hw / "sys", profile, state)
    _render_proc(hw / "proc", profile, state)
    (hw / "dev.json").write_text(json.dumps(state["dev_nodes"], indent=1))
    (hw / "state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
    (hw / "esp-devices").write_text("".join(f"{d['name']} {d['uuid']} {d['disk']} {ESP_SIZE}\n"
                                           for d in esp_devices(root, profile)))


def _ensure_dir(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def hung(root: Path) -> bool:
    """Did the last boot hang (no user space: the twin's supervisor starts no sshd)?"""
    text = _read(root, f"{TWIN_DIR}/hw/state.json")
    return bool(text and json.loads(text)["boot"].get("hung"))


def esp_devices(root: Path, profile: dict) -> list[dict]:
    """The ESP partitions of this boot: the profile's (boot.esp_uuids, else boot.esp_uuid), then any
    other ESP directory (ESP_ROOT), each the second partition of its own disk as the Proxmox
    installer lays them out: {"uuid", "name": "sda2", "disk": "sda", "major": 8, "minor": 2}.
    Only directories that exist are partitions (a removed one is a disk gone)."""
    boot = profile.get("boot") or {}
    wanted = list(boot.get("esp_uuids") or ([boot["esp_uuid"]] if boot.get("esp_uuid") else []))
    base = root / ESP_ROOT
    present = sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    uuids = [u for u in wanted if u in present] + [u for u in present if u not in wanted]
    return [{"uuid": u, "name": f"sd{chr(ord('a') + i)}2", "disk": f"sd{chr(ord('a') + i)}",
             "major": 8, "minor": 16 * i + 2} for i, u in enumerate(uuids[:26])]


# proxmox-kernel-helper's unit (debian: dh_installsystemd enables it): on a boot with a next-boot
# pin (ConditionPathExists), `proxmox-boot-tool kernel unpin --next-boot`, then `refresh`
BOOT_CLEANUP_UNIT = "etc/systemd/system/multi-user.target.wants/proxmox-boot-cleanup.service"


# pvegpu's trial unit (templates/kernel-trial-up.service.j2, armed by the kernel stage): enabled and
# its ConditionPathExists there, systemd runs its ExecStart once multi-user.target is reached
TRIAL_UNIT = "etc/systemd/system/multi-user.target.wants/pvegpu-kernel-trial.service"


def boot_units(root: Path) -> list[list[list[str]]]:
    """The units the twin's boot runs in the root once its mounts are up, before sshd (as systemd
    would run these units of multi-user.target; tests/twin/runtime.py Supervisor.boot runs each
    unit's commands in order, stopping at its first that fails, as a Type=oneshot unit's ExecStart
    lines). Follows proxmox-kernel-helper proxmox-boot-cleanup.service (enabled, with
    /etc/kernel/next-boot-pin there: the real proxmox-boot-tool unpins and refreshes) and pvegpu's
    own pvegpu-kernel-trial.service (enabled, with the trial marker there: its ExecStart lines as
    written; the host checks it runs read the twin's hardware like any program)."""
    root = Path(root)
    units: list[list[list[str]]] = []
    # (the unit link is absolute: it names a path inside the root, so only the link itself is looked at)
    if os.path.lexists(root / BOOT_CLEANUP_UNIT) and (root / "etc/kernel/next-boot-pin").exists():
        units.append([["/usr/sbin/proxmox-boot-tool", "kernel", "unpin", "--next-boot"],
                      ["/usr/sbin/proxmox-boot-tool", "refresh"]])
    if os.path.lexists(root / TRIAL_UNIT):
        target = os.readlink(root / TRIAL_UNIT)
        text = _read(root, target.lstrip("/")) if target.startswith("/") else None
        lines = (text or "").splitlines()
        conditions = [line.split("=", 1)[1].strip() for line in lines if line.startswith("ConditionPathExists=")]
        if text is not None and all((root / c.lstrip("/")).exists() for c in conditions):
            units.append([line.split("=", 1)[1].split() for line in lines if line.startswith("ExecStart=")])
    return units


def _resource_lines(dev: dict, profile: dict) -> str:
    iov = profile["kernel"].get("pci_iov", True)
    n = 13 if iov else 7
    if dev.get("bridge") or dev.get("class", "").startswith("0604"):
        n += 4
    rows = [(0, 0, 0)] * n
    for bar in dev.get("bars") or []:
        size = _size(bar["size"])
        start = _int(bar["start"])
        rows[bar["index"]] = (start, start + size - 1, BAR_FLAGS[bar.get("flags", "mem64pref")])
    if dev.get("rom"):
        rom = dev["rom"]
        rows[6] = (_int(rom["start"]), _int(rom["start"]) + _size(rom["size"]) - 1, BAR_FLAGS["rom"])
    return "".join(f"0x{s:016x} 0x{e:016x} 0x{f:016x}\n" for s, e, f in rows)


# ACS Control bits the kernel turns on where the port's ACS Capability has them: Source Validation,
# P2P Request/Completion Redirect, Upstream Forwarding (drivers/pci/pci.c pci_std_enable_acs(),
# run for every device once an IOMMU driver has called pci_request_acs(), i.e. with the IOMMU on).
ACS_KERNEL_ENABLES = 0x01 | 0x04 | 0x08 | 0x10


def _config_bytes(dev: dict, iommu_on: bool) -> bytes:
    """The function's sysfs `config` as root reads it: 4096 bytes for a PCIe function (it has a
    link), 256 for conventional PCI; the header's IDs and class, and for a bridge with ``acs_cap``
    in the profile one extended capability at 0x100: ACS (ID 0x000D, version 1, no next), its
    Capability word at +4 and its Control word at +6 (``acs_ctl`` from the profile, else what the
    kernel enables with the IOMMU on)."""
    config = bytearray(4096 if dev.get("link") else 256)
    struct.pack_into("<HH", config, 0, int(dev["vendor"], 16), int(str(dev["device"]), 16))
    config[8] = int(dev.get("revision", "00"), 16)
    config[9:12] = bytes.fromhex(dev["class"])[::-1]
    if "acs_cap" in dev and len(config) == 4096:
        cap = _int(dev["acs_cap"])
        ctl = _int(dev["acs_ctl"]) if "acs_ctl" in dev else (cap & ACS_KERNEL_ENABLES if iommu_on else 0)
        struct.pack_into("<IHH", config, 0x100, 0x000D | (1 << 16), cap, ctl)
    return bytes(config)


def _int(v) -> int:
    return v if isinstance(v, int) else int(str(v), 0)


def _size(v) -> int:
    if isinstance(v, int):
        return v
    m = re.fullmatch(r"(\d+)([KMGT]?)", str(v))
    assert m, f"not a size: {v!r}"
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)]


def _dev_rel(by_bdf: dict, bdf: str) -> str:
    return "devices/" + "/".join(_chain(by_bdf, bdf))


def _render_sys(sys: Path, profile: dict, state: dict) -> None:
    by_bdf = {d["bdf"]: d for d in profile["pci"]}
    drivers = state["drivers"]
    iommu_on = state["iommu"]["enabled"]
    for dev in profile["pci"]:
        bdf = dev["bdf"]
        rel = _dev_rel(by_bdf, bdf)
        d = sys / rel
        d.mkdir(parents=True, exist_ok=True)
        sv, sd = dev.get("subsystem", "0000:0000").split(":")
        cls = dev["class"]
        drv = drivers[bdf]
        files = {
            "vendor": f"0x{dev['vendor']}", "device": f"0x{dev['device']}",
            "subsystem_vendor": f"0x{sv}", "subsystem_device": f"0x{sd}",
            "class": f"0x{cls}", "revision": f"0x{dev.get('revision', '00')}",
            "numa_node": str(dev.get("numa_node", -1)),
            "local_cpulist": _affinity(profile, dev.get("numa_node", -1))[0],
            "enable": "1" if drv else "0", "irq": str(dev.get("irq", 0)),
            "resource": _resource_lines(dev, profile).rstrip("\n"),
            "driver_override": state["bindings"].get(bdf, "(null)"),
            "modalias": "pci:v0000{}d0000{}sv0000{}sd0000{}bc{}sc{}i{}".format(
                dev["vendor"].upper(), dev["device"].upper(), sv.upper(), sd.upper(),
                cls[0:2].upper(), cls[2:4].upper(), cls[4:6].upper()),
            "uevent": "\n".join(([f"DRIVER={drv}"] if drv else []) + [
                f"PCI_CLASS={int(cls, 16):X}", f"PCI_ID={dev['vendor'].upper()}:{dev['device'].upper()}",
                f"PCI_SUBSYS_ID={sv.upper()}:{sd.upper()}", f"PCI_SLOT_NAME={bdf}",
                f"MODALIAS=pci:v0000{dev['vendor'].upper()}d0000{dev['device'].upper()}sv0000{sv.upper()}"
                f"sd0000{sd.upper()}bc{cls[0:2].upper()}sc{cls[2:4].upper()}i{cls[4:6].upper()}"]),
        }
        link = dev.get("link")
        if link:
            files.update(current_link_speed=link["speed"], current_link_width=str(link["width"]),
                         max_link_speed=link.get("max_speed", link["speed"]),
                         max_link_width=str(link.get("max_width", link["width"])))
        if dev.get("bridge"):
            files["secondary_bus_number"] = str(int(dev.get("secondary_bus", "0"), 16))
        for name, text in files.items():
            (d / name).write_text(text + "\n")
        (d / "config").write_bytes(_config_bytes(dev, iommu_on))
        for bar in dev.get("bars") or []:
            (d / f"resource{bar['index']}").write_text("")
        bus_link = sys / "bus/pci/devices" / bdf
        _symlink(bus_link, "../../../" + rel)
        if drv:
            drvdir = sys / "bus/pci/drivers" / drv
            _symlink(d / "driver", "../" * (rel.count("/") + 1) + f"bus/pci/drivers/{drv}")
            _symlink(drvdir / bdf, "../../../../" + rel)
        grp = dev.get("iommu_group")
        if iommu_on and grp is not None:
            gdir = sys / "kernel/iommu_groups" / str(grp)
            _symlink(d / "iommu_group", "../" * (rel.count("/") + 1) + f"kernel/iommu_groups/{grp}")
            _symlink(gdir / "devices" / bdf, "../../../../" + rel)
            _write(gdir / "type", state["iommu"]["type"] + "\n")
            _write(gdir / "reserved_regions", "0x00000000fee00000 0x00000000feefffff msi\n")
    # root complexes
    for rc in {_chain(by_bdf, d["bdf"])[0] for d in profile["pci"]}:
        _write(sys / "devices" / rc / "uevent", "")
    # drivers of loaded modules exist even without devices
    driver_of_module = {"nvidia": "nvidia", "vfio_pci": "vfio-pci", "snd_hda_intel": "snd_hda_intel",
                        "mlx5_core": "mlx5_core", "nvme": "nvme"}
    for mod in state["modules"]:
        if mod in driver_of_module:
            (sys / "bus/pci/drivers" / driver_of_module[mod]).mkdir(parents=True, exist_ok=True)
    for drvdir in (sys / "bus/pci/drivers").glob("*"):
        for f in ("bind", "unbind", "new_id", "remove_id"):
            _write(drvdir / f, "")
    _write(sys / "bus/pci/drivers_probe", "")
    _write(sys / "bus/pci/rescan", "")
    (sys / "kernel/iommu_groups").mkdir(parents=True, exist_ok=True)
    # modules and their parameters; module.sig_enforce (built in: always there)
    _write(sys / "module/module/parameters/sig_enforce", "Y\n" if state.get("sig_enforce") else "N\n")
    for mod in state["modules"]:
        mdir = sys / "module" / mod
        mdir.mkdir(parents=True, exist_ok=True)
        _write(mdir / "initstate", "live\n")
        for k, v in state["module_params"].get(mod, {}).items():
            _write(mdir / "parameters" / k, f"{v}\n")
    # NUMA + CPUs
    nodes = profile.get("numa_nodes") or {}
    for n, cpus in nodes.items():
        _write(sys / f"devices/system/node/node{n}/cpulist", cpus + "\n")
    _write(sys / "devices/system/node/online", _ranges(sorted(int(n) for n in nodes)) + "\n" if nodes else "0\n")
    _write(sys / "devices/system/cpu/online", _all_cpus(profile) + "\n")
    if profile["boot"]["loader"] == "systemd-boot" or profile["boot"].get("uefi"):
        _write(sys / "firmware/efi/fw_platform_size", "64\n")
        # efivarfs: 4 attribute bytes (NV|BS|RT), then the value byte (1: Secure Boot on)
        var = sys / "firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
        var.parent.mkdir(parents=True, exist_ok=True)
        var.write_bytes(b"\x06\x00\x00\x00" + (b"\x01" if state.get("secure_boot") else b"\x00"))


def _ranges(nums: list[int]) -> str:
    out, start = [], None
    for i, n in enumerate(nums):
        if start is None:
            start = n
        if i + 1 == len(nums) or nums[i + 1] != n + 1:
            out.append(f"{start}-{n}" if n != start else str(n))
            start = None
    return ",".join(out)


def _render_proc(proc: Path, profile: dict, state: dict) -> None:
    k = profile["kernel"]
    rel = state["boot"]["release"]
    version_tail = k["version"] if rel == k["release"] else "#1 SMP PREEMPT_DYNAMIC"
    _write(proc / "version", f"Linux version {rel} ({k.get('builder', 'build@proxmox')}) "
           f"({state['boot']['gcc']}, {k.get('ld', 'GNU ld (GNU Binutils for Debian) 2.40')}) {version_tail}\n")
    _write(proc / "cmdline", state["boot"]["cmdline"] + "\n")
    _write(proc / "uptime", "5.00 4.00\n")  # fresh boot: pyinfra's server.reboot compares uptimes
    _write(proc / "cpuinfo", _cpuinfo(profile))
    _write(proc / "meminfo", profile.get("meminfo") or _meminfo(profile["memory_kib"]))
    _write(proc / "devices", _proc_devices(profile, state))
    _write(proc / "modules", "".join(
        f"{m} {1048576 + 4096 * i} 0 - Live 0x0000000000000000{' (OE)' if m.startswith('nvidia') else ''}\n"
        for i, m in enumerate(state["modules"])))
    nv = state["nvidia"]
    (proc / "driver").mkdir(exist_ok=True)
    if nv["loaded"]:
        if nv["open"]:
            nvrm = (f"NVIDIA UNIX Open Kernel Module for x86_64  {nv['version']}  Release Build  "
                    f"({nv['builder']})  {nv['build_date']}")
        else:
            nvrm = f"NVIDIA UNIX x86_64 Kernel Module  {nv['version']}  {nv['build_date']}"
        _write(proc / "driver/nvidia/version", f"NVRM version: {nvrm}\nGCC version:  {nv['gcc']} \n")
        _write(proc / "driver/nvidia/params", "".join(f"{k}: {v}\n" for k, v in nv["params"].items()))
        (proc / "driver/nvidia/gpus").mkdir(parents=True, exist_ok=True)
        for g in state["gpus"]:
            if g["minor"] is None:
                continue
            _write(proc / f"driver/nvidia/gpus/{g['bdf']}/information", _gpu_information(g, nv))


def _gpu_information(g: dict, nv: dict) -> str:
    """/proc/driver/nvidia/gpus/<bdf>/information of GPU `g` (tests/twin/livesys.py writes it too)."""
    return (f"Model: \t\t {g['name']}\nIRQ:   \t\t {g['irq']}\nGPU UUID: \t {g['uuid']}\n"
            f"Video BIOS: \t {g['vbios'].lower()}\nBus Type: \t PCIe\nDMA Size: \t 52 bits\n"
            f"DMA Mask: \t 0xfffffffffffff\nBus Location: \t {g['bdf']}\n"
            f"Device Minor: \t {g['minor']}\nGPU Firmware: \t {nv['version']}\nGPU Excluded:\t No\n")


def _cpuinfo(profile: dict) -> str:
    c = profile["cpu"]
    per_socket = c["cores_per_socket"] * c["threads_per_core"]
    total = c["sockets"] * per_socket
    blocks = []
    for cpu in range(total):
        # Linux numbers all first threads, then the siblings
        thread = cpu // (c["sockets"] * c["cores_per_socket"])
        core_lin = cpu % (c["sockets"] * c["cores_per_socket"])
        socket, core = divmod(core_lin, c["cores_per_socket"])
        apic = (socket * per_socket + core * c["threads_per_core"] + thread)
        blocks.append(
            f"processor\t: {cpu}\nvendor_id\t: {c['vendor_id']}\ncpu family\t: {c['family']}\n"
            f"model\t\t: {c['model']}\nmodel name\t: {c['model_name']}\nstepping\t: {c['stepping']}\n"
            f"microcode\t: {c.get('microcode', '0x1')}\ncpu MHz\t\t: {c.get('mhz', '2000.000')}\n"
            f"cache size\t: {c.get('cache_kb', 1024)} KB\nphysical id\t: {socket}\nsiblings\t: {per_socket}\n"
            f"core id\t\t: {core}\ncpu cores\t: {c['cores_per_socket']}\napicid\t\t: {apic}\n"
            f"initial apicid\t: {apic}\nfpu\t\t: yes\nfpu_exception\t: yes\ncpuid level\t: {c.get('cpuid_level', 16)}\n"
            f"wp\t\t: yes\nflags\t\t: {c['flags']}\nbugs\t\t: {c.get('bugs', '')}\n"
            f"bogomips\t: {float(c.get('mhz', 2000)) * 2:.2f}\nclflush size\t: 64\ncache_alignment\t: 64\n"
            f"address sizes\t: {c.get('address_sizes', '52 bits physical, 57 bits virtual')}\n"
            f"power management:\n\n")
    return "".join(blocks)


def _meminfo(kib: int) -> str:
    rows = [("MemTotal", kib), ("MemFree", kib * 9 // 10), ("MemAvailable", kib * 19 // 20),
            ("Buffers", 204800), ("Cached", 4194304), ("SwapCached", 0), ("SwapTotal", 0),
            ("SwapFree", 0), ("HugePages_Total", None), ("Hugepagesize", 2048)]
    out = []
    for k, v in rows:
        if v is None:
            out.append(f"{k + ':':<16}{0:>8}\n")
        else:
            out.append(f"{k + ':':<16}{v:>8} kB\n")
    return "".join(out)


def _proc_devices(profile: dict, state: dict) -> str:
    chars = [list(x) for x in (profile.get("char_devices") or BASE_CHAR_DEVICES)]
    names = {n for _, n in chars}
    majors = state["char_majors"]
    if state["nvidia"]["loaded"] and "nvidia" not in names:
        chars += [[195, "nvidia"], [195, "nvidia-modeset"], [195, "nvidiactl"]]
    wanted = {"nvidia-caps": state["nvidia"]["loaded"], "nvidia-nvlink": state["nvidia"]["loaded"],
              "nvidia-uvm": "nvidia_uvm" in state["modules"], "vfio": "vfio" in state["modules"]}
    for name, major in majors.items():
        if wanted.get(name, True) and name not in names:
            chars.append([major, name])
    chars.sort(key=lambda x: x[0])  # the kernel lists by major
    blocks = sorted(profile.get("block_devices") or BASE_BLOCK_DEVICES, key=lambda x: x[0])
    return ("Character devices:\n" + "".join(f"{m:3d} {n}\n" for m, n in chars)
            + "\nBlock devices:\n" + "".join(f"{m:3d} {n}\n" for m, n in blocks))


# ---------------------------------------------------------------- install + busy

def standin_client() -> Path | None:
    """The stand-in client (standins/client.c) built static with this machine's cc, cached by
    the source's hash; None where it cannot be built (the Python stand-ins are installed then)."""
    source = CLIENT_SOURCE.read_bytes()
    out = CLIENT_CACHE / f"standin-client-{hashlib.sha256(source).hexdigest()[:16]}"
    if out.exists():
        return out
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    CLIENT_CACHE.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    built = subprocess.run([compiler, "-O2", "-static", "-o", str(tmp), str(CLIENT_SOURCE)],
                           capture_output=True, text=True)
    if built.returncode != 0:
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, out)  # several test processes may build it at once: last rename wins
    return out


def install_standins(root: Path, data: dict) -> None:
    """The stand-in programs of profile `data` into `root` (STANDIN_PATHS), their Python under
    /usr/local/lib/twin (modules, programs in bin/, the server)."""
    lib = root / STANDIN_LIB_DIR
    (lib / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(STANDINS_DIR / "twinstate.py", lib / "twinstate.py")
    shutil.copyfile(STANDINS_DIR / STANDIN_SERVER, lib / STANDIN_SERVER)
    client = standin_client()
    for name, dests in STANDIN_PATHS.items():
        if name == "proxmox.py" and not data.get("pve"):
            dests = []  # not a Proxmox host
        if name == "boot.py" and not data.get("pve"):
            dests = [d for d in dests if "proxmox-boot-tool" not in d and "zz-proxmox-boot" not in d]
        if dests:
            shutil.copyfile(STANDINS_DIR / name, lib / name)
        for dest in dests:
            program = lib / "bin" / Path(dest).name
            shutil.copyfile(STANDINS_DIR / name, program)
            program.chmod(0o755)
            p = root / dest
            p.parent.mkdir(parents=True, exist_ok=True)
            if p.is_symlink() or p.exists():
                p.unlink()  # /usr/sbin/reboot is a symlink to systemctl: never write through it
            shutil.copyfile(client or program, p)
            p.chmod(0o755)
    for name, dests in SHELL_STANDIN_PATHS.items():
        for dest in dests:
            p = root / dest
            p.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(STANDINS_DIR / name, p)
            p.chmod(0o755)


def install(root: Path, profile: str, node: str | None = None, pve_dir: Path | None = None) -> None:
    """Prepare a fresh twin root for `profile` (a name under profiles/ or a path), then render.

    `node`: the Proxmox node name (default: the profile's); `pve_dir`: seed /etc/pve there
    instead of under the root (a cluster's shared /etc/pve: tests/twin/runtime.py "Clusters");
    a guest id another node of that cluster has already is not seeded (ids are cluster-wide)."""
    root = Path(root)
    data = load_profile(profile)
    if node:
        data["node"] = node
    _write_profile(root, profile, data, node)
    install_standins(root, data)
    _seed_kernels(root, data)
    _seed_nvidia_install(root, data)
    if (data.get("nvidia") or {}).get("version"):  # an operator's download of the host's driver
        installer.build(data["nvidia"]["version"], root / "opt/nvidia")
    _seed_boot(root, data)
    if data.get("pve"):
        _seed_pve(root, data, pve_dir)
        _seed_kernel_packages(root, data)
    elif (root / "var/lib/dpkg/info/proxmox-kernel-helper.list").exists():
        # not a Proxmox host: the root's boot layer (tests/twin/runtime.py) is not there
        subprocess.run(["chroot", str(root), "dpkg", "--purge", "proxmox-kernel-helper"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    render(root)


def _write_profile(root: Path, profile: str, data: dict, node: str | None) -> None:
    twin = root / TWIN_DIR
    twin.mkdir(parents=True, exist_ok=True)
    src = Path(profile) if Path(profile).suffix else PROFILES_DIR / f"{profile}.yml"
    shutil.copyfile(src, twin / "profile.yml")
    if node:  # every boot renders from profile.yml: the node name goes there too
        text = (twin / "profile.yml").read_text()
        text, n = re.subn(r"^node: .*$", f"node: {node}", text, count=1, flags=re.M)
        (twin / "profile.yml").write_text(text if n else text + f"node: {node}\n")
    (twin / "profile.json").write_text(json.dumps(data, indent=1))  # stand-ins have no pyyaml


def upgrade_install(root: Path, profile: str) -> None:
    """The packages of `profile` over a root an older profile's twin left (tests/twin/runtime.py
    upgrade_in_place pruned what the distribution upgrade replaces): its stand-ins, its kernels
    (8's stay beside them), its Proxmox VE packages in the new dpkg database, its repository file
    (the 8 one-line file gives way to 9's deb822 file, as the upgrade guide moves the sources to
    trixie), boot entries for the new kernels. Not seeded: the NVIDIA modules for the new kernel
    (nothing builds them during the upgrade in the twin; pvegpu's converge has to), the guests and
    /etc/pve (they carry over)."""
    root = Path(root)
    data = load_profile(profile)
    node = (json.loads((root / TWIN_DIR / "profile.json").read_text()).get("node")
            if (root / TWIN_DIR / "profile.json").exists() else None)
    if node:
        data["node"] = node
    _write_profile(root, profile, data, node)
    install_standins(root, data)
    _seed_kernels(root, data)
    boot = data["boot"]
    if boot["loader"] == "systemd-boot":
        # the kernel packages' postinst hook (/etc/kernel/postinst.d/zz-proxmox-boot, proxmox-kernel-helper)
        # runs `proxmox-boot-tool refresh`: each installed kernel copied to the ESPs with an entry whose
        # options are /etc/kernel/cmdline (proxmox-boot-tool's refresh / zz-proxmox-boot)
        cmdline = (_read(root, "etc/kernel/cmdline") or boot["cmdline"]).strip()
        uuid = (_read(root, "etc/kernel/proxmox-boot-uuids") or boot.get("esp_uuid", "0E4E-3C5A")).split()[0]
        esp = root / ESP_ROOT / uuid
        for rel in data["kernel"].get("installed") or [data["kernel"]["release"]]:
            if not (esp / "loader/entries" / f"proxmox-{rel}.conf").exists():
                _write(esp / "EFI/proxmox" / rel / f"vmlinuz-{rel}", "")
                _write(esp / "EFI/proxmox" / rel / f"initrd.img-{rel}", "")
                _write(esp / "loader/entries" / f"proxmox-{rel}.conf",
                       f"title    Proxmox Virtual Environment\nversion  {rel}\noptions  {cmdline}\n"
                       f"linux    /EFI/proxmox/{rel}/vmlinuz-{rel}\ninitrd   /EFI/proxmox/{rel}/initrd.img-{rel}\n")
    if data.get("pve"):
        _write(root / "etc/hostname", data.get("node", data["name"]) + "\n")  # the node's name, kept by the upgrade
        _seed_pve_packages(root, data)
        for rel, _text in PVE_REPOSITORY.values():
            (root / rel).unlink(missing_ok=True)
        _seed_pve_repository(root, data)
    render(root)


def _seed_kernels(root: Path, data: dict) -> None:
    for rel in data["kernel"].get("installed") or [data["kernel"]["release"]]:
        (root / "lib/modules" / rel).mkdir(parents=True, exist_ok=True)
        vm = root / "boot" / f"vmlinuz-{rel}"
        if not vm.exists():
            _write(vm, "")
            _write(root / "boot" / f"initrd.img-{rel}", "")
        cfg = root / "boot" / f"config-{rel}"
        if not cfg.exists():  # an installed kernel ships its config; initramfs-tools reads it
            _write(cfg, "CONFIG_BLK_DEV_INITRD=y\nCONFIG_RD_GZIP=y\nCONFIG_RD_ZSTD=y\nCONFIG_MODULES=y\n"
                        "CONFIG_VFIO=m\nCONFIG_VFIO_PCI=m\nCONFIG_VFIO_IOMMU_TYPE1=m\n")


def _seed_nvidia_install(root: Path, data: dict) -> None:
    """The driver the profile's host already runs, as installed files: an nvidia.ko for the
    booted release (an ELF whose .modinfo carries version/license/vermagic, so `modinfo -k`
    and depmod read it like a real module; it holds no code), GSP firmware and user-space
    library names of that version (Proxmox profiles only). A host converged earlier looks like this; a profile with
    `nvidia.installed: false` leaves them out (a host before its first driver install)."""
    nv = data.get("nvidia")
    if not nv or nv.get("installed") is False or not data.get("pve"):  # recordings stay as recorded
        return
    release, version = data["kernel"]["release"], nv["version"]
    moddir = root / "lib/modules" / release / "updates/pvegpu-nvidia"
    if not (moddir / "nvidia.ko").exists():
        moddir.mkdir(parents=True, exist_ok=True)
        lic = "Dual MIT/GPL" if nv.get("open", True) else "NVIDIA"
        fields = [f"version={version}", f"license={lic}", "name=nvidia",
                  f"vermagic={release} SMP preempt mod_unload modversions "]
        body = "".join(f.replace("\\", "\\\\").replace('"', '\\"') + "\\0" for f in fields)
        # compiled by the twin root's own gcc (bookworm: 12.2.0, trixie: 14.2.0), as the host built its
        # module: its .comment names that GCC, which the module-vs-kernel compiler check reads (a
        # test's bare tmp root has no gcc: this machine's then)
        in_root = (root / "usr/bin/gcc").exists() and (root / "tmp").is_dir()
        with tempfile.TemporaryDirectory(dir=root / "tmp" if in_root else None) as tmp:
            src = Path(tmp) / "nvidia_modinfo.c"
            src.write_text(f'__attribute__((section(".modinfo"), used)) static const char m[] = "{body}";\n')
            if in_root:
                inside = "/" + str(src.relative_to(root))
                subprocess.run(["chroot", str(root), "gcc", "-c", inside, "-o", inside[:-2] + ".o"], check=True)
            else:
                subprocess.run(["gcc", "-c", str(src), "-o", str(src.with_suffix(".o"))], check=True)
            shutil.move(str(src.with_suffix(".o")), moddir / "nvidia.ko")
        subprocess.run(["chroot", str(root), "/sbin/depmod", release], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if nv.get("open", True):
        for fw in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
            p = root / "lib/firmware/nvidia" / version / fw
            if not p.exists():
                _write(p, f"twin placeholder: GSP firmware {version}\n")
    lib = root / "usr/lib/x86_64-linux-gnu" / f"libnvidia-ml.so.{version}"
    if not lib.exists():
        _write(lib, f"twin placeholder: NVML {version}\n")


def _seed_boot(root: Path, data: dict) -> None:
    boot = data["boot"]
    if boot["loader"] == "systemd-boot":
        if not (root / "etc/kernel/cmdline").exists():
            _write(root / "etc/kernel/cmdline", boot["cmdline"] + "\n")
        uuid = boot.get("esp_uuid", "0E4E-3C5A")
        _write(root / "etc/kernel/proxmox-boot-uuids", uuid + "\n")
        esp = root / ESP_ROOT / uuid
        if not (esp / "loader/loader.conf").exists():  # as `proxmox-boot-tool init` + refresh left it
            # proxmox-boot-tool init_bootloader: `bootctl install` (systemd-boot's binary as the
            # loader and the removable path), then loader.conf
            efi = root / "usr/lib/systemd/boot/efi/systemd-bootx64.efi"
            for dest in ("EFI/systemd/systemd-bootx64.efi", "EFI/BOOT/BOOTX64.EFI"):
                (esp / dest).parent.mkdir(parents=True, exist_ok=True)
                if efi.exists():
                    shutil.copyfile(efi, esp / dest)
            _write(esp / "loader/loader.conf", "timeout 3\ndefault proxmox-*\n")
            for rel in data["kernel"].get("installed") or [data["kernel"]["release"]]:
                _write(esp / "EFI/proxmox" / rel / f"vmlinuz-{rel}", "")
                _write(esp / "EFI/proxmox" / rel / f"initrd.img-{rel}", "")
                _write(esp / "loader/entries" / f"proxmox-{rel}.conf",
                       f"title    Proxmox Virtual Environment\nversion  {rel}\noptions  {boot['cmdline']}\n"
                       f"linux    /EFI/proxmox/{rel}/vmlinuz-{rel}\ninitrd   /EFI/proxmox/{rel}/initrd.img-{rel}\n")
    elif boot["loader"] == "grub-esp":
        # what the installer leaves in proxmox-boot-tool's grub mode (profiles/kpro6-grubesp.yml):
        # the ESP listed, /etc/kernel/cmdline (zz-proxmox-boot update_esps needs its root=), GRUB's
        # configuration on the root as on a GRUB install, and on the ESP what `init <part> grub`
        # (grub-install: the EFI image, the removable copy, grub/grubenv) and refresh
        # (copy_and_config_kernels: the kernels at the ESP's top; update-grub with the ESP on /boot) wrote
        if not (root / "etc/kernel/cmdline").exists():
            _write(root / "etc/kernel/cmdline", boot["cmdline"] + "\n")
        uuid = boot.get("esp_uuid", "0E4E-3C5A")
        _write(root / ESP_LIST, uuid + "\n")
        _seed_grub(root, boot)
        esp = root / ESP_ROOT / uuid
        if not (esp / "grub/grub.cfg").exists():
            for dest in (("EFI/proxmox/grubx64.efi", "EFI/BOOT/BOOTX64.EFI") if is_efi(data) else ()):
                _write(esp / dest, "twin placeholder: GRUB's EFI image (grub-install)\n")
            _write_grubenv(root, {}, f"{ESP_ROOT}/{uuid}/grub/grubenv")
            for rel in data["kernel"].get("installed") or [data["kernel"]["release"]]:
                _write(esp / f"vmlinuz-{rel}", "")
                _write(esp / f"initrd.img-{rel}", "")
            shutil.copyfile(root / "boot/grub/grub.cfg", esp / "grub/grub.cfg")
    elif boot["loader"] == "grub":
        _seed_grub(root, boot)


def _seed_grub(root: Path, boot: dict) -> None:
    """/etc/default/grub and /boot/grub/grub.cfg as a Proxmox install with GRUB leaves them."""
    default = root / "etc/default/grub"
    if not default.exists():
        _write(default, 'GRUB_DEFAULT=0\nGRUB_TIMEOUT=5\n'
               'GRUB_DISTRIBUTOR="Proxmox VE"\n'
               f'GRUB_CMDLINE_LINUX_DEFAULT="{boot.get("cmdline_default", "quiet")}"\n'
               f'GRUB_CMDLINE_LINUX="{boot.get("cmdline_linux", "")}"\n')
    if not (root / "boot/grub/grub.cfg").exists():  # what the installer's update-grub left
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "TWIN_ROOT": str(root)}
        subprocess.run([str(root / STANDIN_LIB_DIR / "bin/update-grub")], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _seed_pve(root: Path, data: dict, pve_dir: Path | None = None) -> None:
    node = data.get("node", data["name"])
    pve = pve_dir or root / "etc/pve"
    for sub in ("lxc", "qemu-server"):
        (pve / "nodes" / node / sub).mkdir(parents=True, exist_ok=True)
        if pve_dir is None:  # a cluster's node-local links are its twin's mounts (runtime.py)
            _symlink(pve / sub, f"nodes/{node}/{sub}")
    if pve_dir is None:
        _symlink(pve / "local", f"nodes/{node}")
    (pve / "mapping").mkdir(parents=True, exist_ok=True)
    if not (pve / "mapping/pci.cfg").exists():
        _write(pve / "mapping/pci.cfg", "")
    guests = data.get("guests") or {}
    taken = {c.stem for c in pve.glob("nodes/*/*/*.conf")}
    for kind, sub in (("lxc", "lxc"), ("qemu", "qemu-server")):
        for vmid, text in (guests.get(kind) or {}).items():
            p = pve / "nodes" / node / sub / f"{vmid}.conf"
            if not p.exists() and str(vmid) not in taken:
                _write(p, text if text.endswith("\n") else text + "\n")
    _write(root / "etc/hostname", node + "\n")
    _seed_pve_packages(root, data)
    _seed_pve_repository(root, data)


# The Proxmox VE repository file pve-manager installs (its configs/Makefile): on 8 (stable-8)
# /etc/apt/sources.list.d/pve-enterprise.list, one-line format; on 9 (master)
# pve-enterprise.sources, deb822 (configs/pve-sources.sources). Nothing in the twin reaches it.
PVE_REPOSITORY = {
    8: ("etc/apt/sources.list.d/pve-enterprise.list",
        "deb https://enterprise.proxmox.com/debian/pve bookworm pve-enterprise\n"),
    9: ("etc/apt/sources.list.d/pve-enterprise.sources",
        "Types: deb\nURIs: https://enterprise.proxmox.com/debian/pve\nSuites: trixie\n"
        "Components: pve-enterprise\nSigned-By: /usr/share/keyrings/proxmox-archive-keyring.gpg\n"),
}


def _seed_pve_repository(root: Path, data: dict) -> None:
    major = int(str(data["pve"]["version"]).split(".")[0])
    if major in PVE_REPOSITORY:
        rel, text = PVE_REPOSITORY[major]
        if not (root / rel).exists():
            _write(root / rel, text)


def _seed_kernel_packages(root: Path, data: dict) -> None:
    """The profile's installed kernels as the packages a Proxmox VE >= 8.1 install has for them,
    in dpkg's database (no files): proxmox-kernel-<release>-signed and the series' meta package
    proxmox-kernel-<X.Y> (pve-kernel debian/control.in), which proxmox-kernel-helper's
    kernel_keep_versions (functions) reads from `dpkg -l` to choose what stays on the ESPs."""
    rels = data["kernel"].get("installed") or [data["kernel"]["release"]]
    packages = {}
    for rel in rels:
        m = re.match(r"(\d+\.\d+)\.(\d+)-(\d+)", rel)
        version = f"{m.group(1)}.{m.group(2)}-{m.group(3)}" if m else "1"
        packages[f"proxmox-kernel-{rel}-signed"] = (version, f"proxmox-kernel-{rel}")
        if m:
            packages[f"proxmox-kernel-{m.group(1)}"] = (version, "")
    _dpkg_stanzas(root, packages, "amd64")


def _dpkg_stanzas(root: Path, packages: dict[str, tuple[str, str]], arch: str) -> None:
    """{name: (version, provides)} as installed packages without files in the root's dpkg database."""
    status = root / "var/lib/dpkg/status"
    text = status.read_text() if status.exists() else ""
    known = set(re.findall(r"^Package: (\S+)$", text, re.M))
    stanzas = [f"Package: {name}\nStatus: install ok installed\nPriority: optional\nSection: kernel\n"
               f"Maintainer: Proxmox Support Team <support@proxmox.com>\nArchitecture: {arch}\n"
               + (f"Provides: {provides}\n" if provides else "")
               + f"Version: {version}\nDescription: {name} (pvegpu twin: the profile's package, no files)\n"
               for name, (version, provides) in packages.items() if name not in known]
    if stanzas:
        _write(status, text.rstrip("\n") + "\n\n" + "\n".join(stanzas) if text.strip() else "\n".join(stanzas))
    for name in packages:
        for suffix in ("list", "md5sums"):
            info = root / "var/lib/dpkg/info" / f"{name}.{suffix}"
            if not info.exists():
                _write(info, "")


def _seed_pve_packages(root: Path, data: dict) -> None:
    """The profile's Proxmox VE packages as dpkg knows installed ones: a stanza each in the
    root's real /var/lib/dpkg/status (state `install ok installed`), so `dpkg-query` and apt read
    them as on a node (pve-manager at `pve.version`, the others at `pve.packages`). They carry
    no files and no dependencies."""
    pve = data["pve"]
    versions = {"pve-manager": str(pve["version"]), **{k: str(v) for k, v in (pve.get("packages") or {}).items()}}
    status = root / "var/lib/dpkg/status"
    text = status.read_text() if status.exists() else ""
    known = set(re.findall(r"^Package: (\S+)$", text, re.M))
    stanzas = [f"Package: {name}\nStatus: install ok installed\nPriority: optional\nSection: admin\n"
               f"Maintainer: Proxmox Support Team <support@proxmox.com>\nArchitecture: all\n"
               f"Version: {version}\nDescription: {name} (pvegpu twin: the profile's Proxmox VE package, no files)\n"
               for name, version in versions.items() if name not in known]
    if stanzas:
        _write(status, text.rstrip("\n") + "\n\n" + "\n".join(stanzas) if text.strip() else "\n".join(stanzas))
    for name in versions:  # what dpkg keeps of an installed package: its file list and md5sums (none)
        for suffix in ("list", "md5sums"):
            info = root / "var/lib/dpkg/info" / f"{name}.{suffix}"
            if not info.exists():
                _write(info, "")


def _busy_path(root: Path) -> Path:
    return Path(root) / TWIN_DIR / "busy.json"


def mark_busy(root: Path, bdf: str, holder: str = "nvidia-persistenced") -> None:
    """Record that `holder` holds the GPU at `bdf` ({bdf: holder} in busy.json)."""
    path = _busy_path(root)
    busy = json.loads(path.read_text()) if path.exists() else {}
    busy[_norm_bdf(bdf)] = holder
    _write(path, json.dumps(busy, indent=1))


def clear_busy(root: Path, bdf: str | None = None) -> None:
    """Forget one holder (or all)."""
    path = _busy_path(root)
    busy = json.loads(path.read_text()) if path.exists() else {}
    if bdf is None:
        busy = {}
    else:
        busy.pop(_norm_bdf(bdf), None)
    _write(path, json.dumps(busy, indent=1))
