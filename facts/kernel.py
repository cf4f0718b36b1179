"""Kernel, boot loader, IOMMU and SEV-SNP state of a host, and the kernel stage's build state
(`KernelStageFacts`, read by operations/kernel.py) with the host paths it reads and pve-kernel's
Makefile reader (`release_from_makefile`; plan.kernel uses both under the same names)."""

from __future__ import annotations

import json
import re

from pyinfra.api import FactBase

from facts.base import ShellFact
from facts.compilers import compiler_version
from facts.kernel_hook import NO_CACHE  # apt-cache reads without writing its cache files
from facts.nvidia import parse_mok, parse_owner_mode, parse_secure_boot, secure_boot_efivars, secure_boot_state
from facts.sections import PROBE_SECTION, parse_sections, split_sections
from facts.shared import EACH_FILE, first_line, read_file, uname
from facts.shell import operands, word  # the one quoting helper (plan.render gives it to the templates)

# The kernel stage's host paths (`KernelStageFacts` reads them; plan.kernel and operations.kernel
# write them, under the same names through plan.kernel).
BUILD_ROOT = "/var/lib/pvegpu/kernel-build"
STATE_DIR = "/var/lib/pvegpu/kernel"  # manifests of installed builds, trial-boot marker
TRIAL_MARKER = f"{STATE_DIR}/trial-boot"  # release of the trial set up (kept until it is decided)
# release the kernel stage installs or arms for a trial (written before its dpkg -i, gone when the trial
# is decided): the kernel hook never makes that release the default (issue 38 2.2)
TRIAL_PENDING = f"{STATE_DIR}/trial-pending"
TRIAL_ARMED = "/run/pvegpu/kernel-trial"  # the same, on a tmpfs: present = the trial boot is still ahead
TRIAL_FAILED = f"{STATE_DIR}/trial-failed"  # {"release", "build_id", "came_up_on", "checks", "journal"} of a failed trial
TRIAL_CHECKS = f"{STATE_DIR}/trial-checks"  # what held on the known-good kernel: `nvidia <ver>`, `gpu <bdf> <driver>`
TRIAL_LOG = f"{STATE_DIR}/trial-failed.log"  # the failed trial boot's last journal lines, where the journal kept them
# at the trial kernel's boot, pvegpu-kernel-trial.service writes "<release> ok" or "<release> failed <checks>"
# (templates/kernel-trial-up.sh.j2): the trial came up even where a reset cut the run before its check
TRIAL_UP = f"{STATE_DIR}/trial-up"
TRIAL_RETRIED = f"{STATE_DIR}/trial-retried"  # release set up again after such a reset (once)
TRIAL_UP_SCRIPT = f"{STATE_DIR}/trial-up.sh"
TRIAL_UNIT_NAME = "pvegpu-kernel-trial.service"
TRIAL_UNIT = f"/etc/systemd/system/{TRIAL_UNIT_NAME}"
TRIAL_WANTS = f"/etc/systemd/system/multi-user.target.wants/{TRIAL_UNIT_NAME}"


def kernel_version_key(release: str) -> list:
    """Sort key so 6.8.12-10-pve sorts after 6.8.12-9-pve."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", release) if part]


def _ends_kernel_args(word: str) -> bool:
    """A lone `--` (quoted or not, no `=`): the kernel stops reading parameters there and hands the
    rest to init (kernel/params.c parse_args: `!val && strcmp(param, "--") == 0` returns the rest,
    which init/main.c start_kernel parses as init's arguments with set_init_arg; lib/cmdline.c
    next_arg drops the quotes of a word that starts with one)."""
    if word.startswith('"'):
        word = word[1:-1] if word.endswith('"') and len(word) > 1 else word[1:]
    return word == "--"


def parse_cmdline_text(text: str) -> dict:
    """`a=1 ro x="y z" -- --addr 0.0.0.0:2024` → raw, args (the kernel's, in order, repeats kept),
    params (last value wins) and init_args (the words after a lone `--`, which go to init, not the
    kernel: `_ends_kernel_args`)."""
    text = text.strip()
    # Kernel quoting is double quotes only; backslashes (initrd=\EFI\…) are literal.
    words = re.findall(r'(?:[^\s"]+|"[^"]*")+', text)
    end = next((i for i, w in enumerate(words) if _ends_kernel_args(w)), None)
    args, init_args = (words, []) if end is None else (words[:end], words[end + 1:])
    params: dict[str, str | None] = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        params[key.replace('"', "")] = value.replace('"', "") if sep else None
    return {"raw": text, "args": args, "params": params, "init_args": init_args}


def parse_proc_cmdline(output_lines: list[str]) -> dict | None:
    """Pure parser of /proc/cmdline (shape: see `KernelCmdline`)."""
    for line in output_lines:
        if line.strip():
            return parse_cmdline_text(line)
    return None


def _shell_value(raw: str, variables: dict[str, str]) -> str:
    """Value of a simple sh assignment's right side, as /etc/default/grub uses them."""
    raw = raw.strip()

    def expand(text: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), ""), text)

    if raw.startswith("'") and raw.endswith("'") and len(raw) >= 2:
        return raw[1:-1]
    if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
        return expand(raw[1:-1])
    if raw.startswith("`"):
        return raw  # command substitution: kept as written
    return expand(raw.split("#", 1)[0].strip())


def parse_grub_defaults(lines: list[str], variables: dict[str, str] | None = None) -> dict[str, str]:
    """`GRUB_*=` assignments of /etc/default/grub (and grub.d snippets applied after it)."""
    variables = dict(variables or {})
    for line in lines:
        match = re.match(r"^\s*(?:export\s+)?(GRUB_\w+)=(.*)$", line)
        if match:
            variables[match.group(1)] = _shell_value(match.group(2), variables)
    return variables


def _esp_status(uuid: str, detail: str, firmware: str | None) -> dict:
    """One ESP of `proxmox-boot-tool status`. Its detail (proxmox-boot-tool `_status_detail`) is
    `uefi (versions: A, B)` where the ESP has loader/loader.conf, `grub (versions: C)` where it has
    grub/, both joined by ", " where it has both, or nothing: `modes` holds each part's versions.
    `mode` is the loader `proxmox-boot-tool refresh` sets up there (proxmox-boot/zz-proxmox-boot:
    GRUB where EFI/proxmox/grubx64.efi is, else systemd-boot when the firmware is UEFI and GRUB when
    it is BIOS): the only part, or for both the firmware's (status does not show grubx64.efi);
    `versions` are that mode's."""
    modes: dict[str, list[str]] = {}
    for match in re.finditer(r"(\w[\w-]*)(?: \(versions: ([^()]*)\))?(?:, |$)", detail.strip()):
        if match.group(1):
            modes[match.group(1)] = [v.strip() for v in (match.group(2) or "").split(",") if v.strip()]
    if len(modes) > 1 and {"uefi", "grub"} <= set(modes):
        mode: str | None = "uefi" if firmware == "uefi" else "grub"
    else:
        mode = next(iter(modes), None)
    return {"uuid": uuid, "mode": mode, "versions": modes.get(mode or "", []), "modes": modes}


def parse_boot_loader(output_lines: list[str]) -> dict:
    """Pure parser of `BootLoader.command` output (shape: see `BootLoader`)."""
    sections = split_sections(output_lines)
    firmware_lines = [line.strip() for line in sections.get("firmware", []) if line.strip()]
    firmware = firmware_lines[0] if firmware_lines else None
    esps = []
    for line in sections.get("proxmox-boot-tool status", []):
        match = re.match(r"^(\S+) is configured with: ?(.*)$", line.strip())
        esp = _esp_status(match.group(1), match.group(2), firmware) if match else None
        if esp and esp["mode"]:  # an ESP with neither loader set up is no place to configure
            esps.append(esp)

    kernel_cmdline = next(
        (line.strip() for line in sections.get("/etc/kernel/cmdline", [])
         if line.strip() and not line.lstrip().startswith("#")),
        None,
    )
    grub_lines = sections.get("/etc/default/grub", [])
    grub = None
    if grub_lines or any(name.startswith("/etc/default/grub.d/") for name in sections):
        grub = parse_grub_defaults(grub_lines)
        for name in sorted(n for n in sections if n.startswith("/etc/default/grub.d/")):
            grub = parse_grub_defaults(sections[name], grub)

    if esps:
        loader = "systemd-boot" if esps[0]["mode"] == "uefi" else "grub"
    elif grub is not None:
        loader = "grub"
    elif kernel_cmdline is not None:
        loader = "systemd-boot"
    else:
        loader = "unknown"

    if loader == "systemd-boot":
        config_file, cmdline = "/etc/kernel/cmdline", kernel_cmdline
    elif loader == "grub" and grub is not None:
        config_file = "/etc/default/grub"
        cmdline = " ".join(
            part for part in (grub.get("GRUB_CMDLINE_LINUX", ""), grub.get("GRUB_CMDLINE_LINUX_DEFAULT", ""))
            if part.strip()
        ).strip()
    else:
        config_file, cmdline = None, None

    if esps:
        refresh = "proxmox-boot-tool refresh"
    elif loader == "grub":
        refresh = "update-grub"
    else:
        refresh = None
    return {
        "loader": loader,
        "proxmox_boot_tool": bool(esps),
        "firmware": firmware,
        "esps": esps,
        "config_file": config_file,
        "cmdline": cmdline,
        "params": parse_cmdline_text(cmdline)["params"] if cmdline is not None else None,
        "refresh_command": refresh,
        "grub": grub,
        "kernel_cmdline": kernel_cmdline,
    }


def parse_kernel_toolchain(output_lines: list[str]) -> dict:
    """Pure parser of `KernelToolchain.command` output (shape: see `KernelToolchain`)."""
    running = None
    headers = None
    sections = split_sections(output_lines)
    version_lines = sections.get("/proc/version", output_lines if not sections else [])
    for line in version_lines:
        match = re.match(r"^Linux version (\S+) \(([^)]*)\) \((.*)\) #", line)
        if match:
            compiler = re.split(r",\s+(?:GNU ld|LLD|ld)\b", match.group(3))[0].strip()
            running = {"release": match.group(1), "compiler": compiler, "gcc": compiler_version(compiler)}
            break
    for name, lines in sections.items():
        if not name.startswith("headers "):
            continue
        headers = {"path": name[len("headers "):], "compiler": None, "gcc": None}
        for line in lines:
            # auto.conf leaves the value unquoted, .config quotes it.
            match = re.match(r'^CONFIG_CC_VERSION_TEXT="?(.*?)"?\s*$', line)
            if match:
                headers["compiler"] = match.group(1)
                headers["gcc"] = compiler_version(match.group(1))
                break
    return {"running": running, "headers": headers}


def parse_proxmox_kernels(output_lines: list[str]) -> dict:
    """Pure parser of `ProxmoxKernels.command` output (shape: see `ProxmoxKernels`)."""
    sections = split_sections(output_lines)
    lists: dict[str, list[str]] = {"manual": [], "automatic": [], "pinned": [], "next_boot": []}
    current = None
    headings = {
        "Manually selected kernels:": "manual",
        "Automatically selected kernels:": "automatic",
        "Pinned kernel:": "pinned",
        "Kernel pinned on next-boot:": "next_boot",
    }
    for line in sections.get("kernel list", []):
        text = line.strip()
        if text in headings:
            current = headings[text]
        elif current and text and text != "None.":
            lists[current].append(text)

    def first(name: str) -> str | None:
        values = [line.strip() for line in sections.get(name, []) if line.strip()]
        return values[0] if values else None

    installed = sorted(
        {line.strip() for line in sections.get("/boot", []) if line.strip()}, key=kernel_version_key
    )
    return {
        "running": first("running"),
        "installed": installed,
        "manual": lists["manual"],
        "automatic": lists["automatic"],
        "pinned": first("pin") or (lists["pinned"][0] if lists["pinned"] else None),
        "next_boot": first("next-boot-pin") or (lists["next_boot"][0] if lists["next_boot"] else None),
    }


IOMMU_TYPE_MODES = {"DMA": "translated", "DMA-FQ": "translated", "identity": "passthrough", "blocked": "blocked"}


def parse_iommu(output_lines: list[str]) -> dict:
    """Pure parser of IOMMU group listings (shape: see `IommuState`).

    Reads the sysfs form `IommuState.command` prints (`/sys/kernel/iommu_groups/N/type: DMA`,
    `/sys/kernel/iommu_groups/N/devices/<bdf>`) and the usual user-script listings
    (`IOMMU Group N:` + indented lspci lines, or `IOMMU group N <bdf> …` per line).
    """
    types: dict[int, str | None] = {}
    devices: dict[int, list[str]] = {}
    units: list[str] = []
    current: int | None = None

    def group(number: int) -> None:
        types.setdefault(number, None)
        devices.setdefault(number, [])

    def add_device(number: int, address: str) -> None:
        group(number)
        bdf = ("0000:" + address if address.count(":") == 1 else address).lower()
        if bdf not in devices[number]:
            devices[number].append(bdf)

    bdf = r"(?:[0-9a-fA-F]{4}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
    for line in output_lines:
        match = re.match(r"^/sys/kernel/iommu_groups/(\d+)/type:\s*(\S*)\s*$", line)
        if match:
            group(int(match.group(1)))
            types[int(match.group(1))] = match.group(2) or None
            continue
        match = re.match(rf"^/sys/kernel/iommu_groups/(\d+)/devices/({bdf})\s*$", line)
        if match:
            add_device(int(match.group(1)), match.group(2))
            continue
        match = re.match(r"^IOMMU unit (\S+)\s*$", line)
        if match:
            units.append(match.group(1))
            continue
        match = re.match(r"^\s*IOMMU [Gg]roup:?\s*(\d+):?\s*(.*)$", line)
        if match:
            current = int(match.group(1))
            group(current)
            rest = re.match(rf"^({bdf})\b", match.group(2))
            if rest:
                add_device(current, rest.group(1))
            continue
        match = re.match(rf"^\s+({bdf})\s", line)
        if match and current is not None:
            add_device(current, match.group(1))
            continue
        if line.strip() and not line[0].isspace():
            current = None
    numbers = sorted(types)
    group_modes = {n: IOMMU_TYPE_MODES.get(types[n] or "") for n in numbers}
    modes = {mode for mode in group_modes.values() if mode}
    return {
        "enabled": bool(numbers) or bool(units),
        "units": units,
        "mode": (modes.pop() if len(modes) == 1 else "mixed") if modes else None,
        "groups": {n: types[n] for n in numbers},
        "group_modes": group_modes,
        "devices": {n: devices[n] for n in numbers},
    }


def parse_sev_snp(output_lines: list[str]) -> dict:
    """Pure parser of kvm_amd SEV parameters and cpuinfo flag counts (shape: see `SevSnp`)."""
    params: dict[str, str] = {}
    flags: set[str] = set()
    for line in output_lines:
        match = re.match(r"^/sys/module/kvm_amd/parameters/(sev\w*):(.*)$", line.strip())
        if match:
            params[match.group(1)] = match.group(2).strip()
            continue
        match = re.match(r"^\d+\s+(sev|sev_es|sev_snp)$", line.strip())
        if match:
            flags.add(match.group(1))

    def enabled(name: str) -> bool | None:
        value = params.get(name)
        return None if value is None else value in ("Y", "1")

    snp = enabled("sev_snp")
    if snp is None and "sev_snp" not in flags:
        snp = False  # the CPU cannot do SNP; with the flag but no kvm_amd it stays unknown
    return {
        "cpu_flags": sorted(flags),
        "kvm_sev": enabled("sev"),
        "kvm_sev_snp": enabled("sev_snp"),
        "snp": snp,
        "enabled": bool(enabled("sev_snp")),
    }


def parse_module_parameters(output_lines: list[str]) -> dict[str, str]:
    """`grep -H . /sys/module/<m>/parameters/*` lines → ``{"param": "value"}``."""
    params: dict[str, str] = {}
    for line in output_lines:
        match = re.match(r"^/sys/module/[^/]+/parameters/([^:/]+):(.*)$", line)
        if match:
            params[match.group(1)] = match.group(2)
    return params


class KernelCmdline(ShellFact):
    """
    The booted kernel command line, /proc/cmdline.

    .. code:: python

        {"raw": "BOOT_IMAGE=/boot/vmlinuz-6.8.12-4-pve ro quiet amd_iommu=on",
         "args": ["BOOT_IMAGE=/boot/vmlinuz-6.8.12-4-pve", "ro", "quiet", "amd_iommu=on"],
         "params": {"BOOT_IMAGE": "/boot/vmlinuz-6.8.12-4-pve", "ro": None, "quiet": None,
                    "amd_iommu": "on"},
         "init_args": []}     # the words after a lone `--`: init's, not the kernel's

    ``args`` and ``params`` hold the kernel's parameters only.
    """

    command = read_file("/proc/cmdline")

    def process(self, output):
        return parse_proc_cmdline(output)


class BootLoader(ShellFact):
    """
    Which boot loader a host uses and the kernel command line it is *configured* to boot with
    (compare with `KernelCmdline` for "reboot pending").

    .. code:: python

        {"loader": "systemd-boot",           # systemd-boot | grub | unknown
         "proxmox_boot_tool": True,          # ESPs managed by proxmox-boot-tool
         "firmware": "uefi",                 # uefi | bios
         "esps": [{"uuid": "5E1A-0D2B", "mode": "uefi", "versions": ["6.8.12-4-pve"],
                   "modes": {"uefi": ["6.8.12-4-pve"]}}],   # each loader set up there (`_esp_status`)
         "config_file": "/etc/kernel/cmdline",   # where the cmdline is configured
         "cmdline": "root=ZFS=rpool/ROOT/pve-1 boot=zfs amd_iommu=on",
         "params": {"root": "ZFS=rpool/ROOT/pve-1", "boot": "zfs", "amd_iommu": "on"},
         "refresh_command": "proxmox-boot-tool refresh",   # or update-grub
         "grub": {"GRUB_CMDLINE_LINUX_DEFAULT": "quiet", …} or None,
         "kernel_cmdline": "root=ZFS=… boot=zfs" or None}

    For GRUB the configured line is GRUB_CMDLINE_LINUX + GRUB_CMDLINE_LINUX_DEFAULT after
    /etc/default/grub.d/*.cfg.
    """

    command = (
        "echo '@@ proxmox-boot-tool status'; "
        "if command -v proxmox-boot-tool >/dev/null 2>&1; then proxmox-boot-tool status 2>&1; fi; "
        "echo '@@ firmware'; if [ -d /sys/firmware/efi ]; then echo uefi; else echo bios; fi; "
        f"echo '@@ /etc/kernel/cmdline'; {read_file('/etc/kernel/cmdline')}; "
        f"echo '@@ /etc/default/grub'; {read_file('/etc/default/grub')}; "
        f'for f in /etc/default/grub.d/*.cfg; do [ -r "$f" ] && {{ echo "@@ $f"; {read_file(EACH_FILE)}; }}; done; '
        "true"
    )

    def process(self, output):
        return parse_boot_loader(output)


class KernelToolchain(FactBase):
    """
    The GCC that built the running kernel (/proc/version) and, given a headers tree, the GCC
    that tree was configured with (CONFIG_CC_VERSION_TEXT). Modules must be built with the
    same compiler as their kernel (incident 1).

    + headers: path of a headers tree, or a kernel release (→ /lib/modules/<release>/build)

    .. code:: python

        {"running": {"release": "6.8.12-4-pve",
                     "compiler": "gcc (Debian 12.2.0-14) 12.2.0", "gcc": "12.2.0"},
         "headers": {"path": "/usr/src/linux-headers-6.14.8-2-pve",
                     "compiler": "gcc-12 (Debian 12.2.0-14) 12.2.0", "gcc": "12.2.0"}}

    ``headers`` is ``None`` without the argument; its ``gcc`` is ``None`` when the tree has
    no config.
    """

    def command(self, headers: str | None = None) -> str:
        command = f"echo '@@ /proc/version'; {read_file('/proc/version')}"
        if headers:
            path = headers if headers.startswith("/") else f"/lib/modules/{headers}/build"
            quoted = word(path)
            command += (
                f"; echo {word('@@ headers ' + path)}; "
                f"grep -h '^CONFIG_CC_VERSION_TEXT=' {quoted}/include/config/auto.conf "
                f"{quoted}/.config 2>/dev/null | {first_line()}; true"
            )
        return command

    def process(self, output):
        return parse_kernel_toolchain(output)


class ProxmoxKernels(ShellFact):
    """
    Kernels installed and selected for boot (`proxmox-boot-tool kernel list`, /boot, pins).

    .. code:: python

        {"running": "6.8.12-4-pve",
         "installed": ["6.8.4-2-pve", "6.8.12-4-pve"],     # /boot/vmlinuz-*, oldest first
         "manual": [], "automatic": ["6.8.12-4-pve", "6.8.4-2-pve"],
         "pinned": "6.8.12-4-pve" or None, "next_boot": "6.14.8-2-pve" or None}
    """

    command = (
        "echo '@@ kernel list'; "
        "if command -v proxmox-boot-tool >/dev/null 2>&1; then proxmox-boot-tool kernel list 2>/dev/null; fi; "
        "echo '@@ /boot'; for f in /boot/vmlinuz-*; do [ -e \"$f\" ] && echo \"${f#/boot/vmlinuz-}\"; done; "
        f"echo '@@ running'; {uname('r')}; "
        f"echo '@@ pin'; {read_file('/etc/kernel/proxmox-boot-pin')}; "
        f"echo '@@ next-boot-pin'; {read_file('/etc/kernel/next-boot-pin')}; "
        "true"
    )

    def process(self, output):
        return parse_proxmox_kernels(output)


class IommuState(ShellFact):
    """
    IOMMU on/off and, per group, its domain type and members
    (DMA/DMA-FQ = translated, identity = passthrough; incidents 7 and 9).

    .. code:: python

        {"enabled": True,
         "units": ["ivhd0"],                       # /sys/class/iommu
         "mode": "translated",                     # translated | passthrough | blocked | mixed | None
         "groups": {12: "DMA-FQ"},                 # domain type as sysfs says (None if unknown)
         "group_modes": {12: "translated"},
         "devices": {12: ["0000:41:00.0", "0000:41:00.1"]}}

    A VM usually has no groups: ``enabled`` False.
    """

    command = (
        "for g in /sys/kernel/iommu_groups/*; do "
        '[ -d "$g" ] || continue; t=; { read -r t; } 2>/dev/null < "$g/type"; echo "$g/type: $t"; '
        'for d in "$g"/devices/*; do [ -e "$d" ] && echo "$d"; done; '
        "done; "
        'for u in /sys/class/iommu/*; do [ -e "$u" ] && echo "IOMMU unit ${u##*/}"; done; '
        "true"
    )

    @staticmethod
    def default() -> dict:
        return {"enabled": False, "units": [], "mode": None, "groups": {}, "group_modes": {}, "devices": {}}

    def process(self, output):
        return parse_iommu(output)


class SevSnp(ShellFact):
    """
    AMD SEV-SNP state: kvm_amd's parameters and the CPU's flags (incident 7: P2P DMA through
    a translating IOMMU was corrupted with SEV-SNP on).

    .. code:: python

        {"cpu_flags": ["sev", "sev_es", "sev_snp"],   # of those three, present in /proc/cpuinfo
         "kvm_sev": True, "kvm_sev_snp": True,         # None when kvm_amd is not loaded
         "snp": True,      # kvm_amd's sev_snp; False when the CPU lacks the flag; else None
         "enabled": True}  # kvm_amd sev_snp=Y
    """

    command = (
        "grep -H . /sys/module/kvm_amd/parameters/sev* 2>/dev/null; "
        # what `grep -o -w -E 'sev|sev_es|sev_snp' /proc/cpuinfo | sort | uniq -c` prints (a count,
        # then the flag; every whole word, word characters as grep's -w: letters, digits, _) in one
        # awk that splits only the lines holding `sev`; the flags in any order (parse_sev_snp keeps a set)
        "awk '/sev/ { n = split($0, w, /[^A-Za-z0-9_]+/); for (i = 1; i <= n; i++) "
        "if (w[i] == \"sev\" || w[i] == \"sev_es\" || w[i] == \"sev_snp\") c[w[i]]++ } "
        "END { for (f in c) printf \"%7d %s\\n\", c[f], f }' /proc/cpuinfo 2>/dev/null; true"
    )

    @staticmethod
    def default() -> dict:
        return {"cpu_flags": [], "kvm_sev": None, "kvm_sev_snp": None, "snp": False, "enabled": False}

    def process(self, output):
        return parse_sev_snp(output)


class ModuleParameters(FactBase):
    """
    A loaded module's parameters from /sys/module/<module>/parameters (e.g. nvidia_uvm's
    uvm_disable_hmm, incident 3).

    + module: module name, e.g. ``nvidia_uvm``

    .. code:: python

        {"uvm_disable_hmm": "Y", "uvm_perf_fault_coalesce": "1", …}   # {} when not loaded
    """

    def command(self, module: str) -> str:
        directory = word(f"/sys/module/{module}/parameters")
        return f"grep -H . {directory}/* 2>/dev/null; true"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_module_parameters(output)


# -- the kernel stage's build state (operations/kernel.py) --------------------------------

def parse_build_state(lines: list[str]) -> dict:
    """Pure parser of the build-state section (shape: see `KernelStageFacts`)."""
    state: dict = {"running": False, "rc": None, "debs": [], "manifest": None, "installed_manifest": None,
                   "trial": None, "cores": None, "mem_total_kib": None, "systemd": False, "pbt": False, "esps": False, "headers_installed": False,
                   "log_objects": 0, "log_last": None, "armed": None, "failed": None, "uefi": False,
                   "trial_up": None, "trial_retried": None,
                   "grubenv_abstraction": None, "grubenv_fs": None, "grub_advanced_id": None, "grub_default": None,
                   "grub_saved": None, "grub_next": None, "kernel_packages": [], "secure_boot": None,
                   "secure_boot_state": None, "mok": None, "sbsign": False, "signing_key_mode": None}
    sb_lines = []
    mok_lines = []
    for line in lines:
        key, _, value = line.partition(" ")
        value = value.strip()
        if key == "running":
            state["running"] = True
        elif key == "rc" and value.lstrip("-").isdigit():
            state["rc"] = int(value)
        elif key == "deb" and value:
            state["debs"].append(value)
        elif key in ("manifest", "installed-manifest") and value:
            try:
                state[key.replace("-", "_")] = json.loads(value)
            except ValueError:
                pass  # a half-written manifest counts as none
        elif key in ("trial", "armed", "grub_advanced_id", "grub_saved", "grub_next", "trial_up", "trial_retried"):
            state[key] = value or None
        elif key == "grub_default":
            state[key] = value
        elif key == "failed" and value:
            try:
                state["failed"] = json.loads(value)
            except ValueError:
                state["failed"] = {"release": None}  # unreadable: reported, never matched
        elif key in ("grubenv_abstraction", "grubenv_fs"):
            state[key] = value[len("ok"):].strip() if value.startswith("ok") else None
        elif key == "uefi":
            state["uefi"] = True
        elif key == "kpkg" and value:
            state["kernel_packages"].append(value)
        elif key == "sb":
            sb_lines.append(value)
        elif key == "mok":
            mok_lines.append(line)
        elif key == "sbsign":
            state["sbsign"] = True
        elif key == "keymode":
            state["signing_key_mode"] = parse_owner_mode([line], "keymode")
        elif key in ("cores", "mem_total_kib", "log_objects") and value.isdigit():
            state[key] = int(value)
        elif key == "systemd":
            state["systemd"] = True
        elif key == "pbt":
            state["pbt"] = True
        elif key == "esps":
            state["esps"] = True
        elif key == "headers-installed":
            state["headers_installed"] = True
        elif key == "log_last":
            state["log_last"] = value or None
    state["secure_boot"] = parse_secure_boot(sb_lines)
    state["secure_boot_state"] = secure_boot_state(sb_lines)
    state["mok"] = parse_mok(mok_lines)
    return state


def build_state_command(build_dir: str, release: str, signing_cert: str | None = None,
                        signing_key: str | None = None) -> str:
    d = word(build_dir)
    installed = word(f"{STATE_DIR}/{release}.json")
    trial = word(TRIAL_MARKER)
    return (
        f"d={d}; "
        'if [ -f "$d/build.pid" ] && p=$(cat "$d/build.pid") && [ -n "$p" ] && kill -0 "$p" 2>/dev/null '
        '&& grep -q build.sh "/proc/$p/cmdline" 2>/dev/null; then echo running; fi; '
        '[ -f "$d/build.rc" ] && echo "rc $(cat "$d/build.rc")"; '
        'for f in "$d"/*.deb; do [ -e "$f" ] && echo "deb ${f##*/}"; done; '
        '[ -f "$d/manifest.json" ] && echo "manifest $(tr -d \'\\n\' < "$d/manifest.json")"; '
        f'[ -f {installed} ] && echo "installed-manifest $(tr -d \'\\n\' < {installed})"; '
        f'[ -f {trial} ] && echo "trial $(cat {trial})"; '
        f'[ -f {word(TRIAL_ARMED)} ] && echo "armed $(cat {word(TRIAL_ARMED)})"; '
        f'[ -f {word(TRIAL_FAILED)} ] && echo "failed $(tr -d \'\\n\' < {word(TRIAL_FAILED)})"; '
        f'[ -f {word(TRIAL_UP)} ] && echo "trial_up $(head -c 400 {word(TRIAL_UP)} | tr -d \'\\n\')"; '
        f'[ -f {word(TRIAL_RETRIED)} ] && echo "trial_retried $(cat {word(TRIAL_RETRIED)})"; '
        "[ -d /sys/firmware/efi ] && echo uefi; "
        # Secure Boot as the NVIDIA stage reads it (facts.nvidia: mokutil, else the EFI variable)
        f"{{ command -v mokutil >/dev/null 2>&1 && mokutil --sb-state 2>&1; {secure_boot_efivars()}; }} | sed 's/^/sb /'; "
        # kernel.signing: is its cert enrolled (mokutil --test-key, as facts.nvidia asks), is sbsign there
        + (f"mokutil --test-key {word(signing_cert)} 2>&1 | sed 's/^/mok /'; command -v sbsign >/dev/null && echo sbsign; "
           if signing_cert else "")
        # kernel.signing.key: its owner and mode (issue 39 item 4; plan.nvidia signing_key_refusal)
        + (f"stat -L -c 'keymode %u %a' {operands(signing_key)} 2>/dev/null; " if signing_key else "") +
        # GRUB: what grub-mkconfig sources for GRUB_DEFAULT, the submenu id proxmox-kernel-helper's
        # set_grub_default() reads from grub.cfg, grubenv's entries and what holds grubenv
        "if [ -f /etc/default/grub ]; then "
        "echo \"grub_default $( . /etc/default/grub; for f in /etc/default/grub.d/*.cfg; do [ -r \"$f\" ] && . \"$f\"; done; "
        "echo \"$GRUB_DEFAULT\")\"; "
        "echo \"grub_advanced_id $(sed -rn \"s/.*gnulinux-advanced-(.+)['] \\{$/\\1/p\" /boot/grub/grub.cfg 2>/dev/null | head -n 1)\"; "
        "if [ -f /boot/grub/grubenv ]; then grub-editenv /boot/grub/grubenv list 2>/dev/null "
        "| sed -n -e 's/^saved_entry=/grub_saved /p' -e 's/^next_entry=/grub_next /p'; fi; "
        "a=$(grub-probe --target=abstraction /boot/grub 2>/dev/null) && echo \"grubenv_abstraction ok $a\"; "
        # and the file system (Debian's util/grub.d/00_header.in check_writable: GRUB writes no
        # environment on btrfs, zfs and the archive/read-only ones)
        "a=$(grub-probe --target=fs /boot/grub 2>/dev/null) && echo \"grubenv_fs ok $a\"; "
        "fi; "
        'echo "cores $(nproc)"; awk \'/^MemTotal:/{print "mem_total_kib " $2}\' /proc/meminfo; '
        "[ -d /run/systemd/system ] && echo systemd; "
        "command -v proxmox-boot-tool >/dev/null 2>&1 && echo pbt; "
        "[ -f /etc/kernel/proxmox-boot-uuids ] && echo esps; "
        # installed kernel image packages (kernel.remove_old purges what is really there)
        "dpkg-query -W -f='${db:Status-Abbrev} ${Package}\\n' 'proxmox-kernel-*' 'pve-kernel-*' 'linux-image-*' "
        "2>/dev/null | awk '$1 == \"ii\" {print \"kpkg \" $2}'; "
        f"dpkg-query -W -f='${{Status}}\\n' {word('proxmox-headers-' + release)} 2>/dev/null "
        "| grep -q ' ok installed' && echo headers-installed; "
        "true"
    )


_MAKE_ASSIGN = re.compile(r"^(?:export\s+|override\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*(?::=|::=|\?=|=)\s*(.*?)\s*$")
_MAKE_REF = re.compile(r"\$[({]([A-Za-z_][A-Za-z0-9_]*)[)}]")


def makefile_variables(text: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Top-level `NAME=value` assignments of a Makefile, each expanded from the others
    (`$(NAME)`/`${NAME}`; `$(shell …)` and other functions expand to nothing). A variable
    read, not a build: what `make --eval '…: ; @echo $(NAME)'` prints for plain variables.
    `overrides`: variables given on make's command line (they win over the Makefile's)."""
    raw: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("\t") or line.lstrip().startswith("#"):
            continue
        match = _MAKE_ASSIGN.match(line)
        if match:
            raw[match.group(1)] = match.group(2).split(" #", 1)[0].strip()
    raw.update(overrides or {})

    def expand(value: str, depth: int = 0) -> str:
        if depth > 20:
            return value
        value = re.sub(r"\$\((?:shell|wildcard|addsuffix|foreach|subst|filter)\b[^)]*\)", "", value)
        return _MAKE_REF.sub(lambda m: expand(raw.get(m.group(1), ""), depth + 1), value)

    return {name: expand(value) for name, value in raw.items()}


def release_from_makefile(text: str) -> str | None:
    """The kernel release pve-kernel's Makefile builds: KVNAME = KERNEL_MAJ.KERNEL_MIN.
    KERNEL_PATCHLEVEL + -KREL + KREL_EXTRA + -pve (follows pve-kernel Makefile: on bookworm
    branches KREL_EXTRA=-bpo12, so bookworm-6.14 at ad58d14 builds 6.14.11-9-bpo12-pve).
    None when the text defines no KVNAME."""
    value = makefile_variables(text).get("KVNAME")
    return value or None


# Appended to pve-kernel's KREL_EXTRA on make's command line (templates/kernel-build.sh.j2): our
# build's KVNAME, so the names of its packages and files, are its own. Proxmox's
# proxmox-kernel-<KVNAME>-signed Conflicts/Replaces proxmox-kernel-<KVNAME> (pve-kernel
# debian/signing-template/control.in) and both install /boot/vmlinuz-<KVNAME>: with Proxmox's
# KVNAME apt would replace our build, or our dpkg -i fail, whichever came second.
LOCAL_KREL_SUFFIX = "-pvegpu"


def built_release_from_makefile(text: str) -> str | None:
    """The release our build of that Makefile produces: KVNAME with KREL_EXTRA + LOCAL_KREL_SUFFIX
    (bookworm-6.14 at ad58d14: 6.14.11-9-bpo12-pvegpu-pve)."""
    krel_extra = makefile_variables(text).get("KREL_EXTRA", "")
    value = makefile_variables(text, {"KREL_EXTRA": krel_extra + LOCAL_KREL_SUFFIX}).get("KVNAME")
    return value or None


def source_makefile_command(url: str, ref: str) -> str:
    """Print pve-kernel's Makefile at `ref` from a clone of `url` an earlier build left under
    BUILD_ROOT (read-only: `git show`), after a `from <clone>` line; nothing when none has it."""
    return (
        f"for d in {word(BUILD_ROOT)}/*/src; do "
        '[ -d "$d/.git" ] || continue; '
        f'[ "$(git -C "$d" config --get remote.origin.url)" = {word(url)} ] || continue; '
        f'if git -C "$d" cat-file -e {operands(ref + ":Makefile", "--end-of-options")} 2>/dev/null; then '
        f'echo "from $d"; git -C "$d" show {operands(ref + ":Makefile", "--end-of-options")}; break; fi; '
        "done; true"
    )


def parse_source_makefile(lines: list[str]) -> dict | None:
    """{"release": "6.14.11-9-bpo12-pvegpu-pve" (what our build of it produces: built_release_from_makefile),
    "from": "/var/lib/pvegpu/kernel-build/…/src"} or None."""
    if not lines or not lines[0].startswith("from "):
        return None
    return {"release": built_release_from_makefile("\n".join(lines[1:])), "from": lines[0][len("from "):].strip()}


def build_needs_command(tools: list[str], release: str, path: str = BUILD_ROOT) -> str:
    """What a build needs from the host before it starts: which of `tools` (Debian packages) are
    installed, apt's candidate for each missing one, and the space available (df -P, KiB) on the
    file system that holds `path` (its nearest existing parent). apt-cache policy reads all of
    apt's lists (~1 s): it is asked only for a missing package and only while no build of
    `release` is installed (else `unasked <package>`: a converged host pays nothing for it), and
    without writing apt's cache files (`NO_CACHE`: a `--dry` changes nothing on the host)."""
    names = " ".join(word(t) for t in tools)
    installed = word(f"{STATE_DIR}/{release}.json")
    return (
        f"inst=$(dpkg-query -W -f='${{db:Status-Abbrev}} ${{Package}}\\n' {names} 2>/dev/null | awk '$1 == \"ii\" {{print $2}}'); "
        f"for t in {names}; do if printf '%s\\n' \"$inst\" | grep -qxF -e \"$t\"; then echo \"installed $t\"; "
        f"elif [ -f {installed} ]; then echo \"unasked $t\"; "
        f"else echo \"candidate $t $(apt-cache {NO_CACHE} policy -- \"$t\" 2>/dev/null | sed -n 's/^ *Candidate: //p')\"; fi; done; "
        f"p={word(path)}; while [ ! -d \"$p\" ]; do p=${{p%/*}}; [ -n \"$p\" ] || p=/; done; "
        "echo \"free $(df -Pk \"$p\" | awk 'NR == 2 {print $4}') $p\"; true"
    )


def parse_build_needs(lines: list[str]) -> dict:
    """Pure parser of `build_needs_command` output:
    {"installed": ["git", …], "candidates": {"equivs": "2.3.1" or None}, "unasked": ["devscripts"],
    "free_kib": 52428800 or None, "free_path": "/var/lib"}."""
    needs: dict = {"installed": [], "candidates": {}, "unasked": [], "free_kib": None, "free_path": None}
    for line in lines:
        key, _, rest = line.strip().partition(" ")
        name, _, value = rest.partition(" ")
        if key in ("installed", "unasked") and name:
            needs[key].append(name)
        elif key == "candidate" and name:
            needs["candidates"][name] = value.strip() if value.strip() not in ("", "(none)") else None
        elif key == "free" and name.isdigit():
            needs["free_kib"], needs["free_path"] = int(name), value.strip() or None
    return needs


class KernelStageFacts(FactBase):
    """Everything the kernel stage reads, in one remote command.

    + build_dir: the build dir of the spec'd build (plan.kernel.build_dir)
    + release: the spec'd kernel release
    + url, ref: a proxmox-git source: its Makefile at ref is read from an earlier clone, if any
    + tools: the Debian packages a build needs (space-separated; plan.kernel.build_tools): with
      it, the "needs" section (`build_needs_command`: installed, apt candidates, free space)

    .. code:: python

        {"kernels": <ProxmoxKernels>,
         "build": {"running": False, "rc": 0, "debs": ["linux-image-6.1.192-x_1_amd64.deb", …],
                   "manifest": {...} or None, "installed_manifest": {...} or None,
                   "trial": "6.1.192-x" or None, "cores": 2, "mem_total_kib": 24000000,
                   "systemd": False, "pbt": True,
                   "esps": True,    # /etc/kernel/proxmox-boot-uuids exists: pins need a refresh
                   "headers_installed": False},   # proxmox-headers-<release> (pve-kernel Build-Conflicts)
         "source": {"release": "6.14.11-9-bpo12-pve", "from": "<clone>"} or None,   # proxmox-git
         "needs": {"installed": ["git", …], "candidates": {"equivs": "2.3.1"}, "free_kib": 52428800,
                   "free_path": "/var/lib"}}   # with tools (parse_build_needs)
    """

    def command(self, build_dir: str, release: str, url: str | None = None, ref: str | None = None,
                signing_cert: str | None = None, tools: str | None = None, signing_key: str | None = None) -> str:
        source = (f"echo '{PROBE_SECTION}source'; ( {source_makefile_command(url, ref)} ) 2>/dev/null; "
                  if url and ref else "")
        needs = (f"echo '{PROBE_SECTION}needs'; ( {build_needs_command(tools.split(), release)} ) 2>/dev/null; "
                 if tools else "")
        return (
            f"echo '{PROBE_SECTION}kernels'; ( {ProxmoxKernels.command} ) 2>/dev/null; "
            f"echo '{PROBE_SECTION}build'; ( {build_state_command(build_dir, release, signing_cert, signing_key)} ) 2>/dev/null; "
            f"{source}{needs}true"
        )

    def process(self, output):
        return parse_sections(output, {"kernels": ProxmoxKernels().process, "build": parse_build_state,
                                       "source": parse_source_makefile, "needs": parse_build_needs}, PROBE_SECTION)


# The driver x kernel gate (operations/kernel.py nvidia_gate, templates/kernel-nvidia-gate.sh.j2):
# before the kernel stage installs or trial-boots its kernel, nvidia.version is built against that
# kernel's headers; a kernel it cannot build for is refused and recorded here as <release>.refused:
# the time, the reason (the first compile error quoted), "nvidia <version> <archive sha256>",
# "kernel build <build id>". <release>.log keeps the build's log.
GATE_DIR = f"{STATE_DIR}/nvidia-gate"


def parse_gate_records(lines: list[str]) -> dict[str, dict]:
    """``== <release>.refused`` then the record's four lines, per refused kernel:
    {release: {"time", "reason", "version", "archive_sha256", "build_id"}}"""
    records: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        if line.startswith("== ") and line.endswith(".refused"):
            current = records.setdefault(line[3:-len(".refused")], [])
        elif current is not None:
            current.append(line.rstrip("\n"))
    out = {}
    for release, rec in records.items():
        rec = rec + [""] * 4
        driver = rec[2].split()
        build = rec[3].split()
        out[release] = {"time": rec[0], "reason": rec[1],
                        "version": driver[1] if len(driver) == 3 and driver[0] == "nvidia" else None,
                        "archive_sha256": driver[2] if len(driver) == 3 and driver[0] == "nvidia" else None,
                        "build_id": build[2] if len(build) == 3 and build[:2] == ["kernel", "build"] else None}
    return out


class NvidiaGateRecords(ShellFact):
    """The kernels the driver x kernel gate refused (GATE_DIR).

    .. code:: python

        {"6.12.118+deb12-amd64": {"time": "2026-12-04T10:40:02Z",
            "reason": "nvidia 580.95.05 could not be built for kernel 6.12.118+deb12-amd64: the build failed "
                      "(exit 1): kernel-open/nvidia.c:4:2: error: #error …",
            "version": "580.95.05", "archive_sha256": "…", "build_id": "…"}}
    """

    command = f'for f in {GATE_DIR}/*.refused; do [ -f "$f" ] && echo "== ${{f##*/}}" && head -n 4 "$f"; done; true'

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_gate_records(list(output))
