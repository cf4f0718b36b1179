"""What the boot loader itself will read at the next boot (issue 38 item 2.6): its EFI variables,
the ESPs' files (systemd-boot's loader.conf and entries, GRUB's grub.cfg and grubenv on an ESP in
proxmox-boot-tool's grub mode) and /boot/grub's. Read as the loader sees them, not from pvegpu's
or proxmox-boot-tool's pin files; plan.loader decides from this reading which kernel boots next.

The ESPs are mounted read-only in a private mount namespace, on /mnt there (nothing is written on
the host; the host's own mounts stay as they are), as proxmox-kernel-helper's zz-proxmox-boot
update_esp_func mounts them (/dev/disk/by-uuid/<uuid> of each line of /etc/kernel/proxmox-boot-uuids).
"""

from __future__ import annotations

from facts.base import ShellFact
from facts.sections import SECTION, split_sections
from facts.shared import read_file
from facts.shell import word

ESP_LIST = "/etc/kernel/proxmox-boot-uuids"
GRUB_DIR = "/boot/grub"
LOADER_GUID = "4a67b082-0a4c-41cf-b6c7-440b29bb8c4f"  # systemd's Boot Loader Interface vendor GUID
EFIVARS = "/sys/firmware/efi/efivars"
# The variables systemd-boot reads when it picks the default (boot.c config_load_defaults /
# config_default_entry_select) and the one it writes at every boot it starts (LoaderInfo)
LOADER_VARIABLES = ("LoaderEntryOneShot", "LoaderEntryDefault", "LoaderInfo")
# What tells an ESP's loader apart (proxmox-kernel-helper zz-proxmox-boot update_esp_func: GRUB where
# EFI/proxmox/grubx64.efi is, else systemd-boot under UEFI (loader/loader.conf), else GRUB (grub/))
ESP_MARKS = ("EFI/proxmox/grubx64.efi", "loader/loader.conf", "grub")
ESP_MOUNT = "/mnt"  # in the probe's own mount namespace only

# One ESP: its marks, loader.conf, each systemd-boot entry (boot.c config_load_type1_entries: *.conf
# of loader/entries, not "auto-*" nor hidden; the section says whether the entry's last `linux` line
# names a file on the ESP: boot.c config_entry_add_type1 drops an entry whose kernel cannot be
# opened), and GRUB's grub.cfg and grubenv of the ESP's grub/ (its $prefix in grub mode).
_ESP = (
    f'echo "{SECTION}esp $u"; '
    f'if ! mount -o ro "/dev/disk/by-uuid/$u" {ESP_MOUNT} >/dev/null 2>&1; then echo unmounted; continue; fi; '
    + "for p in " + " ".join(ESP_MARKS) + f'; do [ -e "{ESP_MOUNT}/$p" ] && echo "has $p"; done; '
    f'echo "{SECTION}esp $u loader.conf"; {read_file(word(ESP_MOUNT + "/loader/loader.conf"))}; '
    f"for e in {ESP_MOUNT}/loader/entries/*.conf; do "
    '[ -f "$e" ] || continue; case "${e##*/}" in auto-*|.*) continue ;; esac; '
    "l=$(awk '$1 == \"linux\" { sub(/^[ \\t]*linux[ \\t]+/, \"\"); sub(/[ \\t\\r]+$/, \"\"); p = $0 } END { print p }' \"$e\"); "
    f'k=missing; [ -n "$l" ] && [ -f "{ESP_MOUNT}/${{l#/}}" ] && k=present; '
    f'echo "{SECTION}esp $u entry $k ${{e##*/}}"; {read_file(chr(34) + "$e" + chr(34))}; done; '
    f'echo "{SECTION}esp $u grub.cfg"; {read_file(word(ESP_MOUNT + "/grub/grub.cfg"))}; '
    f'echo "{SECTION}esp $u grubenv"; {read_file(word(ESP_MOUNT + "/grub/grubenv"))}; '
    f"umount {ESP_MOUNT} >/dev/null 2>&1"
)
_ESPS = (f'while IFS= read -r u || [ -n "$u" ]; do [ -n "$u" ] || continue; {_ESP}; done < {ESP_LIST}')


def _hex_utf16(hexdigits: str) -> str | None:
    """An efivarfs string variable as `od -An -v -tx1` prints it: 4 bytes of attributes, then
    UTF-16LE up to its NUL (systemd efivars efi_get_variable_string)."""
    try:
        data = bytes.fromhex(hexdigits)[4:]
    except ValueError:
        return None
    return data.decode("utf-16-le", "replace").split("\x00", 1)[0]


def _text(lines: list[str] | None) -> list[str] | None:
    """A file's lines, None for an absent (or empty) file."""
    return list(lines) if lines else None


def parse_loader_state(output_lines: list[str]) -> dict:
    """Pure parser of `LoaderState.command` output (shape: see `LoaderState`)."""
    sections = split_sections(output_lines)
    firmware = next((line.strip() for line in sections.get("firmware", []) if line.strip()), None)
    efivars: dict[str, str | None] = {}
    for line in sections.get("efivars", []):
        name, _, digits = line.strip().partition(" ")
        if name in LOADER_VARIABLES:
            efivars[name] = _hex_utf16(digits.strip())
    listed = [line.strip() for line in sections.get("esp list", []) if line.strip()]
    esps = []
    for uuid in listed:
        head = sections.get(f"esp {uuid}")
        if head is None:
            continue
        mounted = not any(line.strip() == "unmounted" for line in head)
        entries: list[dict] = []
        prefix = f"esp {uuid} entry "
        for name, lines in sections.items():
            if name.startswith(prefix):
                kernel, _, file = name[len(prefix):].partition(" ")
                entries.append({"file": file, "kernel_present": kernel == "present", "lines": list(lines)})
        esps.append({
            "uuid": uuid, "mounted": mounted,
            "has": [line.strip()[len("has "):] for line in head if line.strip().startswith("has ")],
            "loader_conf": _text(sections.get(f"esp {uuid} loader.conf")),
            "entries": sorted(entries, key=lambda e: str(e["file"])),
            "grub_cfg": _text(sections.get(f"esp {uuid} grub.cfg")),
            "grubenv": _text(sections.get(f"esp {uuid} grubenv")),
        })
    return {
        "firmware": firmware,
        "efivars": efivars,
        "esp_list": listed,
        "esps": esps,
        "grub_cfg": _text(sections.get(f"{GRUB_DIR}/grub.cfg")),
        "grubenv": _text(sections.get(f"{GRUB_DIR}/grubenv")),
    }


class LoaderState(ShellFact):
    """
    What the boot loader reads at the next boot, as it reads it (plan.loader.next_boot decides).
    Needs root (the ESPs are mounted read-only in a private mount namespace; nothing is written).

    .. code:: python

        {"firmware": "uefi",                      # uefi | bios (/sys/firmware/efi)
         "efivars": {"LoaderEntryOneShot": "pvegpu-trial-6.14.8-2-pve.conf",
                     "LoaderEntryDefault": "proxmox-6.8.12-4-pve.conf",
                     "LoaderInfo": "systemd-boot 252.39-1~deb12u1"},   # those set
         "esp_list": ["5A1C-9E27"],               # /etc/kernel/proxmox-boot-uuids
         "esps": [{"uuid": "5A1C-9E27", "mounted": True,
                   "has": ["loader/loader.conf"],       # of ESP_MARKS
                   "loader_conf": ["timeout 3", "default proxmox-*"],
                   "entries": [{"file": "proxmox-6.8.12-4-pve.conf", "kernel_present": True,
                                "lines": ["title    Proxmox Virtual Environment", "version  6.8.12-4-pve", …]}],
                   "grub_cfg": None, "grubenv": None}],      # the ESP's grub/ (grub mode)
         "grub_cfg": [...] or None, "grubenv": [...] or None}   # /boot/grub's
    """

    command = (
        "export LC_ALL=C; "
        f"echo '{SECTION}firmware'; if [ -d /sys/firmware/efi ]; then echo uefi; else echo bios; fi; "
        f"echo '{SECTION}efivars'; for v in {' '.join(LOADER_VARIABLES)}; do f={EFIVARS}/$v-{LOADER_GUID}; "
        "[ -r \"$f\" ] && echo \"$v $(od -An -v -tx1 \"$f\" | tr -d ' \\n')\"; done; "
        f"echo '{SECTION}{GRUB_DIR}/grub.cfg'; {read_file(GRUB_DIR + '/grub.cfg')}; "
        f"echo '{SECTION}{GRUB_DIR}/grubenv'; {read_file(GRUB_DIR + '/grubenv')}; "
        f"echo '{SECTION}esp list'; {read_file(ESP_LIST)}; "
        f"if [ -s {ESP_LIST} ]; then unshare --mount --propagation private /bin/sh -c {word(_ESPS)}; fi; "
        "true"
    )

    def process(self, output):
        return parse_loader_state(output)
