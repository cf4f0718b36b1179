"""What the 8 -> 9 upgrade check reads that no other fact does (read-only; operations/upgrade.py).

The checks follow pve-manager PVE/CLI/pve8to9.pm for what pvegpu causes or can fix:
check_dkms_modules (`dkms status`), check_bootloader (the systemd-boot meta-package, seen by its
/usr/share/doc/systemd-boot/changelog.Debian.gz, on a proxmox-boot-tool host: /etc/kernel/
proxmox-boot-uuids, booted with EFI: /sys/firmware/efi) and the kernel pin of proxmox-boot-tool
(/etc/kernel/proxmox-boot-pin), which would keep 8's kernel booting after the upgrade.
"""

from __future__ import annotations

from facts.base import ShellFact
from facts.sections import parse_sections
from facts.shared import first_line


def _lines(lines: list[str]) -> list[str]:
    return [line.strip() for line in lines if line.strip()]


def _flag(lines: list[str]) -> bool:
    return bool(_lines(lines))


def parse_upgrade_state(output_lines: list[str]) -> dict:
    state = parse_sections(output_lines, {"dkms": _lines, "systemd-boot": _flag, "boot-uuids": _flag, "efi": _flag,
                                          "pin": lambda ls: next(iter(_lines(ls)), None)})
    return {"dkms": state.get("dkms", []), "systemd_boot": state.get("systemd-boot", False),
            "boot_uuids": state.get("boot-uuids", False), "efi": state.get("efi", False), "pin": state.get("pin")}


class UpgradeState(ShellFact):
    """.. code:: python

        {"dkms": ["nvidia/550.163.01: added"],   # `dkms status` lines (all kernels)
         "systemd_boot": True,                    # the systemd-boot meta-package is installed
         "boot_uuids": True, "efi": True,         # proxmox-boot-tool manages the ESPs; booted with EFI
         "pin": "6.14.8-2-pve" | None}            # proxmox-boot-tool's kernel pin
    """

    command = ("echo '@@ dkms'; dkms status 2>/dev/null; "
               "echo '@@ systemd-boot'; [ -f /usr/share/doc/systemd-boot/changelog.Debian.gz ] && echo installed; "
               "echo '@@ boot-uuids'; [ -f /etc/kernel/proxmox-boot-uuids ] && echo yes; "
               "echo '@@ efi'; [ -d /sys/firmware/efi ] && echo yes; "
               f"echo '@@ pin'; {first_line('/etc/kernel/proxmox-boot-pin')}; true")

    def process(self, output):
        return parse_upgrade_state(output)
