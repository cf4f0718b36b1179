"""What the kernel hook (operations/kernel_hook.py) left on a host and how its kernels move:
the hook's failure records, the pin it set, the kernel meta-packages and their apt holds."""

from __future__ import annotations

import re

from facts.base import ShellFact
from facts.sections import parse_sections, section_echo
from facts.shared import dpkg_holds, dpkg_installed, dpkg_show, first_line, read_file, uname

HOOK_STATE = "/var/lib/pvegpu/kernel-hook"  # <release>.failed / .ok / .log, `pinned`
HOLD_RECORD = "/var/lib/pvegpu/kernel-hold"  # the packages pvegpu put on hold, one a line
PIN_FILE = "/etc/kernel/proxmox-boot-pin"  # proxmox-kernel-helper's pin (proxmox-boot-tool kernel pin)
NEXT_PIN_FILE = "/etc/kernel/next-boot-pin"
# pvegpu's kernel hook (operations/kernel_hook.py). run-parts (debianutils run-parts.c: never calls
# setlocale, so its strcoll sort is the C locale's byte order) runs 00… before initramfs-tools, whose
# update-initramfs copies the new kernel onto the ESPs (proxmox-kernel-helper proxmox-boot-sync), as dkms does
HOOK = "/etc/kernel/postinst.d/00pvegpu-nvidia"
OLD_HOOK = "/etc/kernel/postinst.d/pvegpu-nvidia"  # its name before (after initramfs-tools): removed
# proxmox-kernel-meta debian/control: proxmox-default-kernel / -headers depend on proxmox-kernel-X.Y /
# proxmox-headers-X.Y; pve-kernel debian/control.in: those depend on proxmox-kernel-<rel>(-signed) /
# proxmox-headers-<rel>, and a new ABI moves them to the new release
META_RE = re.compile(r"^proxmox-(kernel|headers)-(\d+\.\d+)$")
DEFAULT_METAS = ("proxmox-default-kernel", "proxmox-default-headers")
# apt reads without writing its cache files (a --dry changes nothing): apt.conf(5) Dir::Cache, an empty
# pkgcache / srcpkgcache turns that cache file off (the cache is then built in memory)
NO_CACHE = "-o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache="


def parse_failed(lines: list[str]) -> dict[str, dict]:
    """``<release>.failed`` records: a ``== <file>`` line, then its lines (time, reason, what the
    boot default became). {release: {"time", "reason", "kept"}}"""
    out: dict[str, dict] = {}
    current: list[str] | None = None
    for line in lines:
        if line.startswith("== ") and line.endswith(".failed"):
            current = []
            out[line[3:-len(".failed")]] = {"lines": current}
        elif current is not None:
            current.append(line)
    return {rel: {"time": (v["lines"] + [""])[0], "reason": (v["lines"] + ["", ""])[1],
                  "kept": (v["lines"] + ["", "", ""])[2]} for rel, v in out.items()}


def parse_packages(lines: list[str]) -> dict[str, dict]:
    """``dpkg-query -W -f '${db:Status-Abbrev} ${Package} ${Version}'`` lines: the installed
    ones ({package: {"version"}}; status "ii"/"hi", not "un"/"rc")."""
    out: dict[str, dict] = {}
    for line in lines:
        words = line.split()
        if len(words) >= 3 and len(words[0]) >= 2 and words[0][1] == "i":
            out[words[1]] = {"version": words[2], "held": words[0][0] == "h"}
    return out


# dpkg-query's db:Status-Abbrev, second letter (dpkg lib/dpkg/pkg-show.c pkg_status_abbrev): the
# package's state; these are the ones a dpkg run stopped in (a power cut, a killed apt) leaves and
# `dpkg --configure -a` finishes: half-installed, unpacked, half-configured, triggers-awaited/-pending
UNFINISHED = {"H": "half-installed", "U": "unpacked", "F": "half-configured", "W": "triggers-awaited",
              "t": "triggers-pending"}


def parse_unfinished(lines: list[str]) -> dict[str, str]:
    """The same lines: {package: its state} of the packages dpkg left between two states. The
    third letter R (reinst-required, dpkg's error flag: a cut while it unpacked) makes any state
    "half-installed": dpkg refuses to configure such a package ("very bad inconsistent state")."""
    out: dict[str, str] = {}
    for line in lines:
        words = line.split()
        if len(words) >= 3 and len(words[0]) >= 2 and words[0][1] in UNFINISHED:
            out[words[1]] = "half-installed" if words[0][2:3] == "R" else UNFINISHED[words[0][1]]
    return out


def parse_owners(lines: list[str]) -> dict[str, str]:
    """``dpkg-query -S /boot/vmlinuz-*`` lines (``<package>[, <package>]: <path>``; dpkg's
    diversion lines skipped): {release: the package that installed its image}."""
    out: dict[str, str] = {}
    for line in lines:
        if line.startswith("diversion ") or ": /boot/vmlinuz-" not in line:
            continue
        packages, path = line.split(": ", 1)
        out[path.strip()[len("/boot/vmlinuz-"):]] = packages.split(",")[0].strip()
    return out


def parse_reinstall(lines: list[str]) -> dict[str, str]:
    """The same lines: {package: version} of the half-installed ones (state H, or dpkg's
    reinst-required flag R: a cut while dpkg unpacked them): dpkg refuses to configure them, only
    unpacking them again mends them (`apt-get install --reinstall`)."""
    return {w[1]: w[2] for w in (line.split() for line in lines)
            if len(w) >= 3 and len(w[0]) >= 2 and w[0][1] in UNFINISHED and (w[0][1] == "H" or w[0][2:3] == "R")}


def _first(lines: list[str]) -> str | None:
    return next((line.strip() for line in lines if line.strip()), None)


def parse_kernel_hook(lines: list[str]) -> dict:
    lines = list(lines)
    return {**_parse_kernel_hook(lines), "unfinished": parse_sections(lines, {"packages": parse_unfinished})["packages"],
            "reinstall": parse_sections(lines, {"packages": parse_reinstall})["packages"]}


def _parse_kernel_hook(lines: list[str]) -> dict:
    return parse_sections(lines, {
        "failed": parse_failed,
        "pinned": _first,
        "pin": _first,
        "next_pin": _first,
        "holds": lambda ls: sorted(line.strip() for line in ls if line.strip()),
        "hold_record": lambda ls: sorted(line.strip() for line in ls if line.strip()),
        "packages": parse_packages,
        "headers_candidate": lambda ls: (c if (c := _first(ls)) and c != "(none)" else None),
        "hook": lambda ls: bool(ls) and ls[0].strip() == "yes",
        "running": _first,
        "installed": lambda ls: sorted(line.strip() for line in ls if line.strip()),
        "owners": parse_owners,
    })


class KernelHookState(ShellFact):
    """.. code:: python

        {"failed": {"6.14.11-1-pve": {"time": "2026-…", "reason": "nvidia … could not be built …",
                                      "kept": "6.14.8-2-pve stays the boot default (pinned by pvegpu; …)"}},
         "pinned": "6.14.8-2-pve" | None, "pin": …, "next_pin": …,
         "holds": ["proxmox-kernel-6.14"], "hold_record": […],
         "packages": {"proxmox-default-kernel": {"version": "1.1.0", "held": False}, …},
         "headers_candidate": "1.1.0" | None, "hook": True, "running": "6.14.8-2-pve",
         "installed": ["6.14.11-1-pve", "6.14.8-2-pve"],   # /boot/vmlinuz-*
         "owners": {"6.14.11-1-pve": "proxmox-kernel-6.14.11-1-pve-signed"},   # dpkg's owner of each image
         "unfinished": {"proxmox-kernel-6.12.118+deb12-amd64-signed": "half-configured"},  # dpkg stopped midway
         "reinstall": {"proxmox-headers-6.12.118+deb12-amd64": "1"}}  # reinst-required: package -> version
    """

    command = "; ".join([
        section_echo("failed"),
        f'for f in {HOOK_STATE}/*.failed; do [ -f "$f" ] && echo "== ${{f##*/}}" && head -n 3 "$f"; done',
        section_echo("pinned"), read_file(f"{HOOK_STATE}/pinned"),
        section_echo("pin"), first_line(PIN_FILE),
        section_echo("next_pin"), first_line(NEXT_PIN_FILE),
        # what apt-mark showhold prints (apt-private: packages whose dpkg selection is hold), read
        # from dpkg directly: the Status-Abbrev's first letter is the selection, h = hold
        section_echo("holds"), dpkg_holds(),
        section_echo("hold_record"), read_file(HOLD_RECORD),
        section_echo("packages"),
        dpkg_show(["proxmox-default-kernel", "proxmox-default-headers", "proxmox-kernel-[0-9]*", "proxmox-headers-[0-9]*"]),
        # apt's candidate only where plan.kernel_hook.headers_step asks for it (default-kernel
        # installed, default-headers not): apt-cache without its cache files costs ~0.5-1 s
        section_echo("headers_candidate"),
        f"if {dpkg_installed('proxmox-default-kernel')} && ! {dpkg_installed('proxmox-default-headers')}; then "
        f"apt-cache {NO_CACHE} policy proxmox-default-headers 2>/dev/null | sed -n 's/^ *Candidate: //p'; fi",
        section_echo("hook"), f"{{ [ -e {HOOK} ] || [ -e {OLD_HOOK} ]; }} && echo yes",
        section_echo("running"), uname("r"),
        section_echo("installed"), 'for f in /boot/vmlinuz-*; do [ -e "$f" ] && echo "${f#/boot/vmlinuz-}"; done',
        # the package each image came in (Proxmox VE >= 8.1 installs proxmox-kernel-<rel>-signed, which
        # Provides proxmox-kernel-<rel>: dpkg-reconfigure needs the installed name)
        section_echo("owners"), "dpkg-query -S /boot/vmlinuz-* 2>/dev/null",
        "true",
    ])

    @staticmethod
    def default() -> dict:
        return parse_kernel_hook([])

    def process(self, output):
        return parse_kernel_hook(list(output))
