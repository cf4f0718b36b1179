"""NVIDIA kernel driver state from /proc/driver/nvidia (no nvidia-smi needed), and what the
driver stage (operations/nvidia.py) decides from (`NvidiaHostState`)."""

from __future__ import annotations

import re

from pyinfra.api import FactBase

from facts.base import ShellFact
from facts.compilers import compiler_version
from facts.sections import SECTION, split_sections
from facts.shared import EACH_FILE, UNAME, first_line, read_file, take
from facts.shell import operands, word

GPU_INFORMATION_MARKER = "== "


def parse_driver_version(output_lines: list[str]) -> dict | None:
    """Pure parser of /proc/driver/nvidia/version (shape: see `NvidiaDriver`)."""
    result = None
    for line in output_lines:
        match = re.match(
            r"^NVRM version:\s+NVIDIA UNIX (Open )?(?:Kernel Module for )?(\S+)\s+(?:Kernel Module\s+)?"
            r"(\d+(?:\.\d+)+)\s",
            line + " ",
        )
        if match:
            result = {
                "version": match.group(3),
                "open": bool(match.group(1)),
                "arch": match.group(2),
                "gcc": None,
            }
            continue
        # "GCC version:" then the last line of `$CC -v` (the driver's NV_COMPILER, kernel-open/nvidia/
        # nvidia.Kbuild: `$(CC) -v 2>&1 | tail -n 1`): read as every GCC banner is (facts.compilers)
        if line.startswith("GCC version:") and result is not None:
            result["gcc"] = compiler_version(line[len("GCC version:"):])
    return result


def parse_gpu_information(output_lines: list[str]) -> dict[str, dict]:
    """Pure parser of /proc/driver/nvidia/gpus/*/information blocks (shape: see `NvidiaGpus`)."""
    gpus: dict[str, dict] = {}
    current: dict | None = None

    def finish(block: dict | None) -> None:
        if block and block.get("bdf"):
            gpus[block.pop("bdf")] = block

    for line in output_lines:
        marker = re.match(r"^== .*/gpus/([0-9a-fA-F:.]+)/information\s*$", line)
        if marker:
            finish(current)
            current = {"bdf": marker.group(1).lower(), "model": None, "minor": None,
                       "uuid": None, "firmware": None, "vbios": None}
            continue
        match = re.match(r"^([A-Za-z][A-Za-z ]*?):\s*(.*?)\s*$", line)
        if not match:
            continue
        key, value = match.groups()
        if current is None:  # a single file without the marker line
            current = {"bdf": None, "model": None, "minor": None, "uuid": None,
                       "firmware": None, "vbios": None}
        if key == "Model":
            current["model"] = value
        elif key == "Bus Location":
            current["bdf"] = value.lower()
        elif key == "Device Minor" and value.isdigit():
            current["minor"] = int(value)
        elif key == "GPU UUID":
            current["uuid"] = value
        elif key == "GPU Firmware":
            current["firmware"] = value if value not in ("", "N/A") else None
        elif key == "Video BIOS":
            current["vbios"] = value
    finish(current)
    return gpus


def parse_colon_params(output_lines: list[str]) -> dict[str, str]:
    """`Name: value` lines (e.g. /proc/driver/nvidia/params) → ``{"Name": "value"}``."""
    params: dict[str, str] = {}
    for line in output_lines:
        match = re.match(r"^([A-Za-z]\w*):\s?(.*?)\s*$", line)
        if match:
            params[match.group(1)] = match.group(2)
    return params


def _strtoul(text: str) -> int:
    """A value as the driver's os_strtoul(value, NULL, 0) reads it: 0x hex, leading 0 octal, else
    decimal, up to the first character that is no digit of that base; 0 without one."""
    match = re.match(r"^(?:0[xX]([0-9a-fA-F]+)|(0[0-7]*)|([1-9][0-9]*))", text)
    if not match:
        return 0
    hexa, octal, decimal = match.groups()
    return int(hexa, 16) if hexa else int(octal, 8) if octal else int(decimal)


def parse_registry_dwords(params: dict | None) -> dict | None:
    """The RM registry keys the loaded driver was given, from /proc/driver/nvidia/params
    (`NvidiaDriverParams`): ``RegistryDwords: "<key=value>;…"`` for every GPU and
    ``RegistryDwordsPerDevice: "pci=DDDD:BB:DD.F;<key=value>;…"`` per GPU, printed verbatim in
    quotes (open-gpu-kernel-modules kernel-open/nvidia/nv-procfs.c). Read as the driver reads
    them (kernel-open/nvidia/os-registry.c: spaces removed, ``;``-separated ``name=value``, a token
    with no or a second ``=`` skipped, values by strtoul base 0, 0 where no digit leads; per device, the keys after
    a ``pci=`` apply to that GPU).

    .. code:: python

        {"global": {"RMForceStaticBar1": 1, "PeerMappingOverride": 1},
         "per_device": {"0000:01:00.0": {"RMForceStaticBar1": 1}}}

    ``None`` when the params file was not read (no driver loaded, or not asked).
    """
    if not params or "RegistryDwords" not in params:
        return None

    def pairs(raw: str | None):
        text = "".join((raw or "").split())
        if len(text) >= 2 and text[0] == text[-1] == '"':
            text = text[1:-1]
        for token in text.split(";"):
            parts = token.split("=")
            if len(parts) == 2 and parts[0] and parts[1]:
                yield parts[0], parts[1]

    result: dict = {"global": {}, "per_device": {}}
    for name, value in pairs(params.get("RegistryDwords")):  # osapi.c rm_parse_option_string
        result["global"][name] = _strtoul(value)
    device: str | None = None
    for name, value in pairs(params.get("RegistryDwordsPerDevice")):
        if name == "pci":  # bus:slot, domain:bus:slot or domain:bus:slot.func (nv-reg.h)
            match = re.fullmatch(r"(?:([0-9a-fA-F]{1,4}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?", value)
            device = (f"{int(match.group(1) or '0', 16):04x}:{int(match.group(2), 16):02x}:"
                      f"{int(match.group(3), 16):02x}.{match.group(4) or '0'}") if match else None
            continue
        if device:
            result["per_device"].setdefault(device, {})[name] = _strtoul(value)
    return result


class NvidiaDriver(ShellFact):
    """
    The loaded NVIDIA kernel module, from /proc/driver/nvidia/version.

    .. code:: python

        {"version": "580.159.04", "open": True, "arch": "x86_64", "gcc": "15.3.0"}

    ``None`` when no driver is loaded.
    """

    command = f"{read_file('/proc/driver/nvidia/version')} || true"

    def process(self, output):
        return parse_driver_version(output)


class NvidiaGpus(ShellFact):
    """
    GPUs the NVIDIA driver has bound, from /proc/driver/nvidia/gpus/<bdf>/information.

    .. code:: python

        {"0000:00:06.0": {"model": "NVIDIA H200", "minor": 0, "uuid": "GPU-e567…",
                          "firmware": "580.159.04", "vbios": "96.00.a5.00.1a"}}

    ``minor`` is the N of /dev/nvidiaN (it shifts when GPUs move to vfio-pci). ``{}`` without
    a driver.
    """

    command = (
        "for f in /proc/driver/nvidia/gpus/*/information; do "
        f'[ -r "$f" ] && {{ echo "== $f"; {read_file(EACH_FILE)}; }}; '
        "done; true"
    )

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_gpu_information(output)


class NvidiaDriverParams(ShellFact):
    """
    The NVIDIA module's effective parameters, /proc/driver/nvidia/params.

    .. code:: python

        {"EnableResizableBar": "0", "DmaRemapPeerMmio": "1", "RegistryDwords": '""', …}
    """

    command = f"{read_file('/proc/driver/nvidia/params')} || true"

    @staticmethod
    def default() -> dict:
        return {}

    def process(self, output):
        return parse_colon_params(output)


# -- the driver stage's host state (operations/nvidia.py) ---------------------------------

SOURCE_CACHE = "/var/cache/pvegpu/sources"
CCACHE_MASQUERADE = "/usr/lib/ccache"
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
PERSISTENCED_UNIT_DIRS = ("/etc/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system")
WANTS_DIR = "/etc/systemd/system/multi-user.target.wants"
# sign-file in a release's headers: Debian links scripts/ into linux-kbuild; Proxmox copies the built
# scripts/ into proxmox-headers (follows pve-kernel debian/rules, the headers package target)
SIGN_FILE = "scripts/sign-file"
# kernel options the driver preflight reads from each release's include/config/auto.conf
KERNEL_CONFIG_KEYS = ("CONFIG_OBJTOOL_WERROR", "CONFIG_MITIGATION_RETHUNK", "CONFIG_RETHUNK",
                      "CONFIG_MODULE_SIG", "CONFIG_MODULE_SIG_FORCE", "CONFIG_MODULE_SIG_HASH")
# module.sig_enforce (kernel/module/signing.c): Y when unsigned or badly signed modules are refused,
# whatever made it so (CONFIG_MODULE_SIG_FORCE, module.sig_enforce=1, or lockdown under Secure Boot)
SIG_ENFORCE = "/sys/module/module/parameters/sig_enforce"
# EFI global variable GUID 8be4df61-…: SecureBoot and SetupMode (UEFI spec; what mokutil --sb-state
# reads); shim's GUID 605dab50-…: MokSBStateRT, the runtime copy shim makes of MokSBState, which
# MokManager sets to 1 when its owner turns shim's validation off
SECURE_BOOT_EFIVAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
SETUP_MODE_EFIVAR = "/sys/firmware/efi/efivars/SetupMode-8be4df61-93ca-11d2-aa0d-00e098032b8c"
MOK_SB_STATE_EFIVAR = "/sys/firmware/efi/efivars/MokSBStateRT-605dab50-e046-4300-abb6-3dd810dd8b23"


def secure_boot_efivars() -> str:
    """Shell that prints `efivar <b>` (SecureBoot), `setupmode <b>` and `moksbstate <b>` (each the
    variable's last byte, after efivarfs' 4 attribute bytes, where it can be read), else why not:
    'efivars without SecureBoot variable' (firmware without Secure Boot), 'efivars not readable',
    'no efi'. `parse_secure_boot` reads them."""
    def last_byte(path: str, tag: str) -> str:
        return (f"[ -r {path} ] && {{ set -- $(od -An -v -t u1 {path}); v=; [ $# -gt 0 ] && eval \"v=\\${{$#}}\"; "
                f'echo "{tag} $v"; }}')
    return (f"if [ -r {SECURE_BOOT_EFIVAR} ]; then {last_byte(SECURE_BOOT_EFIVAR, 'efivar')}; "
            f"{last_byte(SETUP_MODE_EFIVAR, 'setupmode')}; {last_byte(MOK_SB_STATE_EFIVAR, 'moksbstate')}; "
            "elif [ -n \"$(ls -A /sys/firmware/efi/efivars 2>/dev/null)\" ]; then echo 'efivars without SecureBoot variable'; "
            "elif [ -d /sys/firmware/efi ]; then echo 'efivars not readable'; else echo 'no efi'; fi")


def source_name(url: str) -> str:
    """A file name for a source URL or path: its last path segment, reduced to safe characters."""
    last = re.split(r"[/?#]", url.rstrip("/").split("://", 1)[-1].split("?", 1)[0])[-1]
    return re.sub(r"[^A-Za-z0-9._+-]", "_", last) or "source"


def local_path(url: str) -> str | None:
    """The host path of a local source (`/path` or `file:///path`), None for a remote URL."""
    if url.startswith("file://"):
        return url[len("file://"):]
    if url.startswith("/"):
        return url
    return None


# Each gcc/g++ program and the first line of its --version. GCC's driver prints its own name there,
# argv[0] after the last directory separator, then the package and version strings built into it
# (gcc/gcc.cc driver::set_progname, driver::maybe_print_and_exit): a program that is the same file
# as the one asked just before it (`-ef`: gcc -> gcc-12, g++ -> g++-12, Debian's links) is not run
# again; its line is that banner under its own name (only where the banner starts with that name).
COMPILER_DIR = "/usr/bin"
COMPILER_BANNERS = (
    f"p=; q=; for c in {COMPILER_DIR}/gcc {COMPILER_DIR}/gcc-[0-9]* {COMPILER_DIR}/g++ {COMPILER_DIR}/g++-[0-9]*; do "
    '[ -x "$c" ] || continue; '
    'if [ -n "$p" ] && [ "$c" -ef "$p" ] && case "$q" in "${p##*/} "*) true;; *) false;; esac; '
    'then v="${c##*/}${q#"${p##*/}"}"; '
    f'else v=$("$c" --version 2>/dev/null | {first_line()}); p=$c; q=$v; fi; '
    'echo "${c##*/}: $v"; done'
)


class NvidiaHostState(FactBase):
    """Everything the driver stage decides from, in one command.

    + releases: target kernel releases
    + sources: ``{"modules": (url, sha256), "installer": (url, sha256)}`` (configured ones)
    + signing: ``[key, cert]`` host paths (nvidia.signing) or empty

    .. code:: python

        {"cores": 2, "mem_total_kib": 24576000, "running": "6.1.0-57-amd64", "ccache": True,
         "compilers": {"gcc": "gcc (Debian 12.2.0-14+deb12u1) 12.2.0", "gcc-12": "gcc-12 (…) 12.2.0"},
         "releases": {"6.1.0-57-amd64": {
             "headers": True, "cc_version_text": "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0",
             "module": {"version": "535.309.01", "vermagic": "6.1.0-57-amd64 SMP …",
                        "filename": "/lib/modules/6.1.0-57-amd64/updates/pvegpu-nvidia/nvidia.ko"}}},
         "firmware": {"535.261.03": ["gsp_ga10x.bin", "gsp_tu10x.bin"]},
         "userspace": ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.595.71.05"],
         "persistenced": {"binary": True, "unit": "/lib/systemd/system/nvidia-persistenced.service",
                          "enabled": False},
         "sources": {"modules": {"cached": False, "sha256": "…"}},   # sha256 of a local path
         "secure_boot": True, "sig_enforce": False,                   # None: unknown
         "secure_boot_state": "enabled",       # facts.nvidia.SECURE_BOOT_STATES, e.g. "validation disabled in shim"
         "signing_files": {"/root/mok.pem": True, "/root/mok.der": True},
         "signing_key_pem": True, "mok": "enrolled",                  # see parse_mok; None: unknown
         "signing_key_mode": {"uid": 0, "mode": 0o600}}               # None: not read

    ``module`` is None when `modinfo -k <rel> nvidia` finds none; each release's ``config`` holds
    the KERNEL_CONFIG_KEYS its auto.conf sets (CONFIG_MODULE_SIG_HASH among them).
    """

    def command(self, releases: list[str], sources: dict | None = None, signing: list[str] | None = None) -> str:
        parts = [
            f"echo '{SECTION}cores'; nproc",
            # MemTotal is /proc/meminfo's first line (fs/proc/meminfo.c meminfo_proc_show): the lines up
            # to it, no program
            f"echo '{SECTION}meminfo'; while IFS= read -r l; do case \"$l\" in MemTotal:*) printf '%s\\n' \"$l\"; break;; esac; "
            "done < /proc/meminfo",
            f"echo '{SECTION}running'; {take(UNAME['r'])}; k=${UNAME['r']}; echo \"$k\"",
            f"echo '{SECTION}ccache'; command -v ccache >/dev/null && [ -d {CCACHE_MASQUERADE} ] && echo {CCACHE_MASQUERADE}",
            f"echo '{SECTION}compilers'; {COMPILER_BANNERS}",
        ]
        # the running release ($k, named at run time), then each target; each release once,
        # one modinfo per release (its version/vermagic/filename lines)
        targets = " ".join(['"$k"', *[word(r) for r in releases]])
        parts.append(
            f"seen=; for r in {targets}; do "
            '[ -n "$r" ] || continue; case " $seen " in *" $r "*) continue;; esac; seen="$seen $r"; '
            f"b=/lib/modules/$r/build; echo \"{SECTION}release $r\"; "
            "[ -f \"$b/Makefile\" ] && echo 'headers: yes' || echo 'headers: no'; "
            f"grep -h -m 1 '^CONFIG_CC_VERSION_TEXT=' \"$b/include/config/auto.conf\" \"$b/.config\" 2>/dev/null | {first_line()}; "
            # the options preflight weighs: objtool -Werror with return thunks, module signing
            f"grep -h -E '^({'|'.join(KERNEL_CONFIG_KEYS)})=' \"$b/include/config/auto.conf\" 2>/dev/null | "
            "while IFS= read -r l; do printf 'config %s\\n' \"$l\"; done; "
            f"[ -x \"$b/{SIGN_FILE}\" ] && echo 'sign-file: yes'; "
            "modinfo -k \"$r\" nvidia 2>/dev/null | while read -r key value; do "
            'case "$key" in version:|vermagic:|filename:) echo "module $key $value";; esac; done; '
            "done"
        )
        # Secure Boot: mokutil's verdict, else the EFI variable's last byte (follows nvidia-installer
        # misc.c secure_boot_enabled(): the low bit of the variable's last byte). efivarfs mounted
        # without the variable: firmware without Secure Boot (the kernel's drivers/firmware/efi/libstub/
        # secureboot.c efi_get_secureboot() takes EFI_NOT_FOUND as disabled); efivarfs not mounted: unknown
        # (the variable is not read where mokutil printed its verdict line: parse_secure_boot takes that first)
        parts.append(f"echo '{SECTION}secureboot'; s=; command -v mokutil >/dev/null 2>&1 && "
                     "s=$(mokutil --sb-state 2>&1; echo .) && s=${s%.} && printf '%s' \"$s\"; "
                     "if printf '%s' \"$s\" | { while IFS= read -r l; do case \"$l\" in "
                     "'SecureBoot enabled'|'SecureBoot disabled') exit 0;; esac; done; exit 1; }; then :; "
                     f"else {secure_boot_efivars()}; fi")
        parts.append(f"echo '{SECTION}sig_enforce'; {read_file(SIG_ENFORCE)}")
        # signing = [key, cert]: the key must be PEM (the kernel's scripts/sign-file.c read_private_key()
        # reads a key file with PEM_read_bio_PrivateKey only); the cert's MOK enrolment is what
        # `mokutil --test-key` says (mokutil.c test_key(): "<file> is not enrolled", or
        # print_skip_message()'s "is already enrolled" / "is already in db" / "is already in the enrollment
        # request" / "is blocked in …"; its exit status differs between versions, so the text is read)
        for i, path in enumerate(signing or ()):
            qp = word(path)
            # the key's owner and mode too (issue 39 item 4: root's, readable by root only; plan.nvidia
            # signing_key_refusal), of the file the path names, as sign-file opens it
            check = (f"{{ stat -L -c 'owner-mode %u %a' {operands(path)}; "
                     f"head -n 1 {operands(path)} | grep -q -- '-----BEGIN .*PRIVATE KEY-----' && echo pem; }}" if i == 0 else
                     f"if command -v mokutil >/dev/null 2>&1; then mokutil --test-key {qp} 2>&1 | sed 's/^/mok /'; "
                     "else echo 'mok unknown: no mokutil'; fi")
            parts.append(f"echo {word(SECTION + 'signing ' + path)}; [ -r {qp} ] && echo readable && {check}")
        parts.append(f"echo '{SECTION}firmware'; for f in /lib/firmware/nvidia/*/gsp*.bin*; do [ -e \"$f\" ] && echo \"$f\"; done")
        libs = " ".join(f"{d}/libnvidia-ml.so.*" for d in LIB_DIRS)
        parts.append(f"echo '{SECTION}userspace'; for f in {libs}; do [ -e \"$f\" ] && echo \"$f\"; done")
        units = " ".join(f"{d}/nvidia-persistenced.service" for d in PERSISTENCED_UNIT_DIRS)
        parts.append(
            f"echo '{SECTION}persistenced'; command -v nvidia-persistenced >/dev/null 2>&1 && echo binary; "
            f"for u in {units}; do [ -f \"$u\" ] && echo \"unit $u\"; done; "
            f"[ -e {WANTS_DIR}/nvidia-persistenced.service ] && echo enabled"
        )
        for key, (url, sha256) in sorted((sources or {}).items()):
            dest = word(f"{SOURCE_CACHE}/{sha256}-{source_name(url)}")
            local = local_path(url)
            check = (f"elif [ -f {word(local)} ]; then h=$(sha256sum < {word(local)}); echo \"sha256 ${{h%% *}}\"; "
                     if local else "")
            parts.append(f"echo {word(SECTION + 'source ' + key)}; if [ -f {dest} ]; then echo cached; "
                         f"{check}else echo absent; fi")
        return "; ".join(f"{{ {p}; }} 2>/dev/null" for p in parts) + "; true"

    def process(self, output):
        return parse_host_state(output)


# What the kernel decides (drivers/firmware/efi/libstub/secureboot.c efi_get_secureboot, with
# include/linux/efi.h efi_get_secureboot_mode): Secure Boot is off without the SecureBoot variable,
# with it 0 or SetupMode 1, and off as well where shim's MokSBState is 1 ("validation disabled in
# shim": no lockdown, unsigned modules and kernels load; systemd's bootctl says "disabled
# (insecure)"). mokutil --sb-state (mokutil.c sb_state_internal) prints "SecureBoot enabled" for
# SecureBoot 1 and SetupMode 0 and then "SecureBoot validation is disabled in shim" where
# MokSBStateRT exists; "SecureBoot disabled", then "Platform is in Setup Mode" for SetupMode 1.
SHIM_VALIDATION_OFF = "validation disabled in shim"
SECURE_BOOT_STATES = ("enabled", "disabled", "setup mode", SHIM_VALIDATION_OFF, "no efi")


def _byte(lines: list[str], tag: str) -> int | None:
    for line in lines:
        words = line.split()
        if len(words) == 2 and words[0] == tag and words[1].isascii() and words[1].isdigit():
            return int(words[1])
    return None


def secure_boot_state(lines: list[str]) -> str | None:
    """The host's Secure Boot state in words (`SECURE_BOOT_STATES`), every line read: mokutil's,
    else the EFI variables' (`secure_boot_efivars`); None when unknown."""
    text = [line.strip() for line in lines]
    if "SecureBoot enabled" in text:
        return SHIM_VALIDATION_OFF if "SecureBoot validation is disabled in shim" in text else "enabled"
    if "SecureBoot disabled" in text:
        return "setup mode" if "Platform is in Setup Mode" in text else "disabled"
    secure_boot = _byte(text, "efivar")
    if secure_boot is not None:
        if not secure_boot & 1:
            return "disabled"
        if _byte(text, "setupmode") == 1:
            return "setup mode"
        return SHIM_VALIDATION_OFF if _byte(text, "moksbstate") == 1 else "enabled"
    if "no efi" in text:
        return "no efi"
    if "efivars without SecureBoot variable" in text:
        return "disabled"
    return None


def parse_secure_boot(lines: list[str]) -> bool | None:
    """Whether the kernel enforces Secure Boot (lockdown: signed modules and kernels only): True
    for the state "enabled" only (`secure_boot_state`); False for disabled, setup mode, validation
    disabled in shim, no EFI; None when unknown (an EFI host whose variables cannot be read)."""
    state = secure_boot_state(lines)
    return None if state is None else state == "enabled"


MOK_STATES = (("is not enrolled", "not enrolled"), ("is already enrolled", "enrolled"), ("is already in db", "in db"),
              ("is already in the enrollment request", "pending"), ("is blocked", "blocked"),
              ("Not a valid x509 certificate", "not DER"))


def parse_mok(lines: list[str]) -> str | None:
    """The cert's MOK state from `mokutil --test-key` lines ("mok …"): "enrolled", "in db",
    "not enrolled", "pending" (imported, MokManager confirmation not done), "blocked", "not DER"
    (mokutil reads a DER certificate only); None when unknown (no mokutil, no answer)."""
    for line in lines:
        if line.startswith("mok "):
            for words, state in MOK_STATES:
                if words in line:
                    return state
    return None


def parse_owner_mode(lines: list[str], tag: str = "owner-mode") -> dict | None:
    """{"uid": 0, "mode": 0o600} from a `stat -c '<tag> %u %a'` line; None when there is none."""
    for line in lines:
        parts = line.split()
        if len(parts) == 3 and parts[0] == tag and parts[1].isdigit() and re.fullmatch(r"[0-7]{1,4}", parts[2]):
            return {"uid": int(parts[1]), "mode": int(parts[2], 8)}
    return None


def parse_host_state(lines: list[str]) -> dict:
    """Pure parser of `NvidiaHostState.command` output (shape: see the fact)."""
    sections = {name: [line.rstrip() for line in body if line.strip()]
                for name, body in split_sections(lines, SECTION).items()}

    def first(name: str) -> str | None:
        lines = sections.get(name)
        return lines[0] if lines else None

    mem = re.search(r"(\d+)", first("meminfo") or "")
    cores = first("cores")
    compilers = {}
    for line in sections.get("compilers", []):
        name, _, banner = line.partition(": ")
        if banner.strip():
            compilers[name.strip()] = banner.strip()
    releases = {}
    for name, body in sections.items():
        if not name.startswith("release "):
            continue
        info: dict = {"headers": False, "cc_version_text": None, "module": None, "config": {}, "sign_file": False}
        module = {}
        for line in body:
            if line.startswith("headers: "):
                info["headers"] = line.endswith("yes")
            elif line.startswith("CONFIG_CC_VERSION_TEXT="):
                info["cc_version_text"] = line.split("=", 1)[1].strip().strip('"')
            elif line.startswith("config "):
                key, _, value = line[len("config "):].partition("=")
                info["config"][key] = value.strip().strip('"')
            elif line == "sign-file: yes":
                info["sign_file"] = True
            elif line.startswith("module "):
                key, _, value = line[len("module "):].partition(":")
                module[key] = value.strip() or None
        info["module"] = module if module.get("version") else None
        releases[name[len("release "):]] = info
    firmware: dict[str, list[str]] = {}
    for path in sections.get("firmware", []):
        match = re.match(r"^/lib/firmware/nvidia/([^/]+)/(gsp[^/]*)$", path)
        if match:
            firmware.setdefault(match.group(1), []).append(match.group(2))
    pers = sections.get("persistenced", [])
    sources = {}
    for name, body in sections.items():
        if name.startswith("source "):
            value = body[0] if body else "absent"
            sources[name[len("source "):]] = {
                "cached": value == "cached",
                "sha256": value.split(" ", 1)[1] if value.startswith("sha256 ") else None,
            }
    signing = {name[len("signing "):]: "readable" in body for name, body in sections.items() if name.startswith("signing ")}
    signing_bodies = [body for name, body in sections.items() if name.startswith("signing ")]
    key_body = signing_bodies[0] if signing_bodies else []
    enforce = (sections.get("sig_enforce") or [""])[0].strip()
    return {
        "secure_boot": parse_secure_boot(sections.get("secureboot", [])),
        "secure_boot_state": secure_boot_state(sections.get("secureboot", [])),
        "sig_enforce": {"Y": True, "N": False}.get(enforce),
        "signing_files": signing,
        # the key (the first signing path) is PEM: None when it was not read
        "signing_key_pem": ("pem" in key_body) if "readable" in key_body else None,
        "signing_key_mode": parse_owner_mode(key_body),
        "mok": parse_mok([line for body in signing_bodies[1:] for line in body]),
        "cores": int(cores) if cores and cores.isdigit() else 1,
        "mem_total_kib": int(mem.group(1)) if mem else 0,
        "running": first("running"),
        "ccache": bool(first("ccache")),
        "compilers": compilers,
        "releases": releases,
        "firmware": firmware,
        "userspace": sections.get("userspace", []),
        "persistenced": {
            "binary": "binary" in pers,
            "unit": next((line[5:] for line in pers if line.startswith("unit ")), None),
            "enabled": "enabled" in pers,
        },
        "sources": sources,
    }
