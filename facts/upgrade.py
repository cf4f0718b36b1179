"""What the 8 -> 9 upgrade check and the performed upgrade read that no other fact does (read-only;
operations/upgrade.py).

The checks follow pve-manager PVE/CLI/pve8to9.pm for what pvegpu causes or can fix:
check_dkms_modules (`dkms status`), check_bootloader (the systemd-boot meta-package, seen by its
/usr/share/doc/systemd-boot/changelog.Debian.gz, on a proxmox-boot-tool host: /etc/kernel/
proxmox-boot-uuids, booted with EFI: /sys/firmware/efi) and the kernel pin of proxmox-boot-tool
(/etc/kernel/proxmox-boot-pin), which would keep 8's kernel booting after the upgrade; GRUB's
saved default (grubenv saved_entry, what pvegpu's kernel stage sets with grub-set-default on a GRUB
host); check_bootloader's GRUB-EFI branch (the grub-efi-amd64 meta-package by its changelog, the
removable loader /boot/efi/EFI/BOOT/BOOTX64.efi and debconf's grub2/force_efi_extra_removable);
the kernel packages on hold (apt-mark hold: a dist-upgrade keeps them back).

`OsRelease` reads the host's Debian release (/etc/os-release), which the release rule needs
(plan/releases.py).
"""

from __future__ import annotations

from facts.base import ShellFact
from facts.sections import parse_sections
from facts.shared import first_line


def _lines(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if line.strip()]


def _flag(lines: list[str]) -> bool:
    return bool(_lines(lines))


def _first(lines: list[str]) -> str | None:
    return next(iter(_lines(lines)), None)


def parse_upgrade_state(output_lines: list[str]) -> dict:
    state = parse_sections(output_lines, {"dkms": _lines, "systemd-boot": _flag, "boot-uuids": _flag, "efi": _flag,
                                          "pin": _first, "grub-saved": _first, "grub-efi": _flag,
                                          "removable": _flag, "removable-debconf": _flag, "holds": _lines})
    return {"dkms": state.get("dkms", []), "systemd_boot": state.get("systemd-boot", False),
            "boot_uuids": state.get("boot-uuids", False), "efi": state.get("efi", False), "pin": state.get("pin"),
            "grub_saved": state.get("grub-saved"), "grub_efi": state.get("grub-efi", False),
            "removable": state.get("removable", False), "removable_updated": state.get("removable-debconf", False),
            "holds": state.get("holds", [])}


class UpgradeState(ShellFact):
    """.. code:: python

        {"dkms": ["nvidia/550.163.01: added"],   # `dkms status` lines (all kernels)
         "systemd_boot": True,                    # the systemd-boot meta-package is installed
         "boot_uuids": True, "efi": True,         # proxmox-boot-tool manages the ESPs; booted with EFI
         "pin": "6.14.8-2-pve" | None,            # proxmox-boot-tool's kernel pin
         "grub_saved": "gnulinux-advanced-…>gnulinux-6.8.12-11-pve-advanced-…" | None,  # grubenv saved_entry
         "grub_efi": True,                        # the grub-efi-amd64 meta-package is installed
         "removable": True,                       # /boot/efi/EFI/BOOT/BOOTX64.efi exists
         "removable_updated": False,              # debconf: grub2/force_efi_extra_removable true
         "holds": ["proxmox-default-kernel"]}     # packages on hold (dpkg's want state)
    """

    command = ("echo '@@ dkms'; dkms status 2>/dev/null; "
               "echo '@@ systemd-boot'; [ -f /usr/share/doc/systemd-boot/changelog.Debian.gz ] && echo installed; "
               "echo '@@ boot-uuids'; [ -f /etc/kernel/proxmox-boot-uuids ] && echo yes; "
               "echo '@@ efi'; [ -d /sys/firmware/efi ] && echo yes; "
               f"echo '@@ pin'; {first_line('/etc/kernel/proxmox-boot-pin')}; "
               # as facts.kernel.build_state_command reads it (grub-editenv, util/grub-editenv.c list)
               "echo '@@ grub-saved'; [ -f /boot/grub/grubenv ] && grub-editenv /boot/grub/grubenv list 2>/dev/null "
               "| sed -n 's/^saved_entry=//p'; "
               # pve8to9 check_bootloader, EFI without proxmox-boot-tool: the meta-package by its
               # changelog, the removable loader and whether GRUB's packages update it
               "echo '@@ grub-efi'; [ -f /usr/share/doc/grub-efi-amd64/changelog.Debian.gz ] && echo installed; "
               "echo '@@ removable'; [ -f /boot/efi/EFI/BOOT/BOOTX64.efi ] && echo yes; "
               "echo '@@ removable-debconf'; [ -f /boot/efi/EFI/BOOT/BOOTX64.efi ] && "
               "debconf-show --db configdb grub-efi-amd64 grub-pc 2>/dev/null "
               "| grep -E 'grub2/force_efi_extra_removable: +true$'; "
               # dpkg's want state `hold` (apt-mark hold sets it): apt's upgrades keep them back
               "echo '@@ holds'; dpkg-query -W -f='${Status} ${Package}\\n' 2>/dev/null "
               "| awk '$1 == \"hold\" {print $NF}'; true")

    def process(self, output):
        return parse_upgrade_state(output)


def parse_os_release(output_lines: list[str]) -> dict:
    """`VERSION_CODENAME=bookworm` / `VERSION_ID="12"` lines of os-release(5) (values may be
    quoted) -> {"codename": "bookworm", "version_id": "12"}; missing keys are None."""
    values: dict[str, str] = {}
    for line in output_lines:
        key, sep, value = line.strip().partition("=")
        if sep and key in ("VERSION_CODENAME", "VERSION_ID"):
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            values[key] = value
    return {"codename": values.get("VERSION_CODENAME") or None, "version_id": values.get("VERSION_ID") or None}


class OsRelease(ShellFact):
    """The host's Debian release, from /etc/os-release (os-release(5); on Debian a link to
    /usr/lib/os-release, written by base-files).

    .. code:: python

        {"codename": "bookworm", "version_id": "12"}   # Proxmox VE 8; trixie / 13: 9
    """

    command = "LC_ALL=C grep -E '^(VERSION_CODENAME|VERSION_ID)=' /etc/os-release 2>/dev/null; true"

    @staticmethod
    def default() -> dict:
        return {"codename": None, "version_id": None}

    def process(self, output):
        return parse_os_release(list(output))


# the 8 -> 9 upgrade pvegpu performs (plan/upgrade_perform.py; its state dir is root's, 0700)
UPGRADE_DIR = "/var/lib/pvegpu/upgrade"


def parse_upgrade_job(output_lines: list[str]) -> dict:
    """{"state": [key=value lines], "lock": "held"|"free"|None, "log": [the log's last lines],
    "guests": [the lines of the record of the guests the start stopped],
    "moved": [the lines of the record of the guests the start moved or stopped for `reboot.guests: migrate`]}"""
    parts = parse_sections(output_lines, {"state": _lines, "lock": _first, "log": lambda lines: list(lines),
                                          "guests": _lines, "moved": _lines})
    return {"state": parts.get("state", []), "lock": parts.get("lock"), "log": parts.get("log", []),
            "guests": parts.get("guests", []), "moved": parts.get("moved", [])}


class UpgradeJob(ShellFact):
    """The upgrade job pvegpu started, as its files say (templates/pve-upgrade.sh.j2): its state
    file, whether a process holds its lock (flock(1) -n: held while the job runs), the log's
    last 20 lines, the record of the GPU guests the start stopped (guests-stopped), and of those it
    moved to other nodes or stopped with `reboot.guests: migrate` (guests-moved).

    .. code:: python

        {"state": ["status=running", "step=full-upgrade", "since=2026-12-06T19:40:00Z"],
         "lock": "held",                 # held | free | None (no lock file: never started)
         "log": ["Unpacking ...", ...],
         "guests": ["lxc 200", "qemu 300"],
         "moved": ["back qemu 301 pve2", "start lxc 200 pve1"]}
    """

    command = (f"echo '@@ state'; cat {UPGRADE_DIR}/state 2>/dev/null; "
               f"echo '@@ lock'; [ -f {UPGRADE_DIR}/lock ] && "
               f"{{ flock -n {UPGRADE_DIR}/lock true && echo free || echo held; }}; "
               f"echo '@@ guests'; cat {UPGRADE_DIR}/guests-stopped 2>/dev/null; "
               f"echo '@@ moved'; cat {UPGRADE_DIR}/guests-moved 2>/dev/null; "
               f"echo '@@ log'; tail -n 20 {UPGRADE_DIR}/upgrade.log 2>/dev/null; true")

    @staticmethod
    def default() -> dict:
        return {"state": [], "lock": None, "log": [], "guests": [], "moved": []}

    def process(self, output):
        return parse_upgrade_job(list(output))


def parse_upgrade_preflight(output_lines: list[str]) -> dict:
    """pve8to9's output (None: not installed), the bytes free on /, apt's sources file by file."""
    pve8to9: list[str] | None = None
    free: int | None = None
    sources: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in output_lines:
        line = line.rstrip("\n")
        if line == "@@ pve8to9":
            current = pve8to9 = []
        elif line == "@@ no-pve8to9":
            current, pve8to9 = None, None
        elif line == "@@ free":
            current = None
            free = -1
        elif line.startswith("@@ source "):
            current = sources.setdefault(line[len("@@ source "):], [])
        elif free == -1 and current is None:
            free = int(line) if line.strip().isdigit() else None
        elif current is not None:
            current.append(line)
    return {"pve8to9": pve8to9, "free_bytes": free if free != -1 else None, "sources": sources}


class UpgradePreflight(ShellFact):
    """What the preflight of a performed upgrade reads: `pve8to9 --full` (pve-manager
    PVE/CLI/pve8to9.pm; colours off: Term::ANSIColor honours NO_COLOR), the bytes available on /
    (df), and apt's sources (sources.list, sources.list.d/*.list one-line, *.sources deb822).

    .. code:: python

        {"pve8to9": ["= CHECKING VERSION INFORMATION FOR PVE PACKAGES =", ..., "FAILURES: 0"] | None,
         "free_bytes": 52613349376,
         "sources": {"/etc/apt/sources.list": ["deb http://deb.debian.org/debian bookworm main"], ...}}
    """

    command = ("if command -v pve8to9 >/dev/null 2>&1; then echo '@@ pve8to9'; "
               "NO_COLOR=1 ANSI_COLORS_DISABLED=1 pve8to9 --full 2>&1 | sed 's/^@@/ @@/'; "
               "else echo '@@ no-pve8to9'; fi; "
               "echo '@@ free'; df -P -B1 / 2>/dev/null | awk 'NR == 2 {print $4}'; "
               "for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do "
               "[ -f \"$f\" ] || continue; echo \"@@ source $f\"; sed 's/^@@/ @@/' \"$f\"; echo; done; true")

    def process(self, output):
        return parse_upgrade_preflight(list(output))
