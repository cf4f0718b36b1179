"""What a spec value becomes, checked when the spec loads (issue 19, part 4).

Each check here knows the format the value ends up in — a systemd unit name, a kernel config
line, a kernel command-line word, a path on the host, a Proxmox identifier — and refuses a
value that format would reject or misread, with a sentence that says what is allowed. They
are used by `spec.models` (field annotations) and by the stages that turn the value into
that thing (e.g. `operations.nccl.unit_name`), so both agree.

All checks raise ValueError; the spec loader turns that into a message naming file, host
and field.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
from collections.abc import Callable
from typing import Any

from pydantic import BeforeValidator

# ----------------------------------------------------------------- systemd unit names

# follows systemd src/basic/unit-def.c unit_type_table: the unit types a name may end in
UNIT_TYPES = ("service", "socket", "target", "device", "mount", "automount", "swap", "timer",
              "path", "slice", "scope")
UNIT_CHARS_RE = re.compile(r"^[A-Za-z0-9:_.\\@-]+$")
# follows systemd src/basic/unit-name.h UNIT_NAME_MAX (256 with the NUL): at most 255 bytes
UNIT_NAME_MAX = 255
# the drop-in directory is "<unit>.d", one file name (NAME_MAX 255 bytes)
DROPIN_UNIT_MAX = 255 - len(".d")


def systemd_unit(name: str) -> str:
    """The full unit name for a spec entry (``vllm`` → ``vllm.service``, as systemctl reads a
    name without a unit type), or ValueError when systemd would not take it as a unit name."""
    def bad(why: str) -> ValueError:
        return ValueError(f"{name!r} is not a systemd unit name: {why} "
                          "(letters, digits, ':-_.\\@', like 'vllm' or 'vllm.service')")

    if not isinstance(name, str) or not name:
        raise bad("it is empty")
    suffix = name.rsplit(".", 1)[-1] if "." in name else ""
    unit = name if suffix in UNIT_TYPES else f"{name}.service"
    # follows systemd src/basic/unit-name.c unit_name_is_valid(): characters before the last
    # '.' from its set plus '@', a known type after it, not starting with '.' or '@'
    if "/" in name:
        raise bad("it holds '/' (it becomes a directory name under /etc/systemd/system)")
    if not UNIT_CHARS_RE.match(name):
        odd = sorted({c for c in name if not UNIT_CHARS_RE.match(c)})
        raise bad(f"it holds {''.join(odd)!r}")
    stem = unit[: unit.rindex(".")]
    if not stem:
        raise bad("nothing before the unit type")
    if stem.startswith("@"):
        raise bad("it starts with '@' (a template needs a prefix, like 'vllm@.service')")
    if stem.startswith("."):
        # systemd skips hidden files when it lists unit files, so such a unit never loads
        raise bad("it starts with '.' (systemd skips hidden unit files)")
    if len(unit) > DROPIN_UNIT_MAX:
        raise bad(f"{len(unit)} characters; its drop-in directory '<unit>.d' must fit a file name, "
                  f"so at most {DROPIN_UNIT_MAX}")
    return unit


def systemd_unit_entry(name: str) -> str:
    """The spec entry itself when `systemd_unit` takes it (a field validator)."""
    systemd_unit(name)
    return name

# ----------------------------------------------------------------- kernel config lines

# follows linux scripts/kconfig/confdata.c conf_read_simple(): "CONFIG_<SYM>=<value>" or
# "# CONFIG_<SYM> is not set"; a value is y/m/n, a (hex) number or a double-quoted string
KCONFIG_SET_RE = re.compile(r'^CONFIG_[A-Z0-9_]+=(?:[ymn]|-?[0-9]+|0[xX][0-9A-Fa-f]+|"(?:[^"\\]|\\.)*")$')
KCONFIG_UNSET_RE = re.compile(r"^# CONFIG_[A-Z0-9_]+ is not set$")


def kconfig_line(line: str) -> str:
    if KCONFIG_SET_RE.match(line) or KCONFIG_UNSET_RE.match(line):
        return line
    hint = ""
    if re.match(r"^[A-Z0-9_]+=", line) and not line.startswith("CONFIG_"):
        hint = "; the symbol needs its CONFIG_ prefix"
    elif line.startswith("CONFIG_") and "=" in line:
        hint = "; a value is y, m, n, a number, 0x<hex> or a string in double quotes"
    raise ValueError(f"{line!r} is not a kernel config line; write 'CONFIG_NAME=y' (m, n, a number, "
                     f"0x<hex> or \"a string\") or '# CONFIG_NAME is not set'{hint}")


# ----------------------------------------------------------------- kernel command line

# follows linux arch/x86/include/asm/setup.h COMMAND_LINE_SIZE (2048 with the NUL)
CMDLINE_MAX = 2047
# a parameter is one word: no whitespace, and nothing a shell or GRUB's sourced
# /etc/default/grub.d/*.cfg, /etc/kernel/cmdline or a quoted value would read differently
CMDLINE_WORD_RE = re.compile(r"^[A-Za-z0-9_.,:;=+/@%~^-]+$")


def cmdline_word(word: str) -> str:
    if not word:
        raise ValueError("an empty kernel parameter; write one word like 'pci=realloc'")
    if any(c.isspace() for c in word):
        raise ValueError(f"{word!r}: each cmdline parameter is one word without spaces, like 'pci=realloc'")
    if not CMDLINE_WORD_RE.match(word):
        odd = "".join(sorted({c for c in word if not CMDLINE_WORD_RE.match(c)}))
        raise ValueError(f"{word!r}: a kernel parameter here is letters, digits and '_.,:;=+/@%~^-' "
                         f"(not {odd!r}, which the boot loader's files would quote or split)")
    if len(word) > CMDLINE_MAX:
        raise ValueError(f"{word!r} is {len(word)} characters; the whole kernel command line holds {CMDLINE_MAX}")
    return word


ACS_ITEM_RE = re.compile(r"^(downstream|multifunction|id:[0-9a-fA-F]{4}:[0-9a-fA-F]{4})$")
# follows pve-kernel patches/kernel/0004-pci-Enable-overrides-for-missing-ACS-capabilities:
# pcie_acs_override_setup() takes 15 id: entries (NUM_ACS_IDS 16, one slot kept)
ACS_MAX_IDS = 15


def acs_override(value: str) -> str:
    # follows the same patch's pcie_acs_override_setup(): comma-separated 'downstream',
    # 'multifunction' and 'id:<vendor>:<device>' (4 hex digits each); anything else is ignored
    items = value.split(",")
    for item in items:
        if not ACS_ITEM_RE.match(item):
            raise ValueError(f"{item!r} in {value!r}: pcie_acs_override takes 'downstream', 'multifunction' and "
                             "'id:<vendor>:<device>' (4 hex digits each), separated by commas")
    if sum(item.startswith("id:") for item in items) > ACS_MAX_IDS:
        raise ValueError(f"{value!r}: the kernel keeps at most {ACS_MAX_IDS} 'id:' entries; the rest are dropped")
    return value


# ----------------------------------------------------------------- paths on the host


def host_abs_path(value: str) -> str:
    """An absolute path on the host that names where it says: no '..' or '.' parts."""
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not an absolute path; write it from '/', like '/root/config-6.14'")
    parts = value.split("/")
    if ".." in parts or "." in parts:
        raise ValueError(f"{value!r} holds '.' or '..'; write the path without them")
    if posixpath.normpath(value) != value.rstrip("/") or value == "/" or value.endswith("/"):
        raise ValueError(f"{value!r} is not a plain file path (no '//', no trailing '/')")
    if len(value) > 4095:  # PATH_MAX 4096 with the NUL
        raise ValueError(f"{value!r} is longer than a path may be (4095)")
    return value


def source_location(url: str) -> str:
    """A source archive's place: https:// or http:// URL, file:///abs/path or /abs/path."""
    if url.startswith("file://"):
        host_abs_path(url[len("file://"):])
        return url
    if url.startswith("/"):
        host_abs_path(url)
        return url
    m = re.match(r"^(https?)://([^/?#\s]+)(/[^\s]*)?$", url)
    if not m:
        raise ValueError(f"{url!r}: a source is an https:// URL, file:///absolute/path or /absolute/path")
    host_part = m.group(2).rsplit("@", 1)[-1]
    hostname = host_part.rsplit(":", 1)[0] if not host_part.startswith("[") else host_part
    if hostname.startswith("-"):
        raise ValueError(f"{url!r}: the host name starts with '-'")
    return url


# ----------------------------------------------------------------- file digests

SHA256_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
SHA256_OF_NOTHING = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of zero bytes


def sha256_digest(value: str) -> str:
    """A file's sha256 as `sha256sum` prints it, and not a placeholder: all zeros, one digit or
    a short pattern repeated ("deadbeef" x 8), few distinct digits (a real digest shows about 16;
    8 or fewer happens by chance about once in 10^15) or the sha256 of an empty file."""
    if not SHA256_HEX_RE.match(value):
        raise ValueError("must be 64 lowercase hex characters (the archive's sha256)")
    if value == SHA256_OF_NOTHING:
        raise ValueError(f"{value} is the sha256 of an empty file, not of an archive; put the file's sha256 here "
                         "(sha256sum FILE)")
    if any(value == value[:n] * (64 // n) for n in (1, 2, 4, 8, 16, 32)) or len(set(value)) <= 8:
        raise ValueError(f"{value[:16]}… is a placeholder, not a digest; put the file's sha256 here (sha256sum FILE)")
    return value


# ----------------------------------------------------------------- names and identifiers


def _regex_validator(name: str, pattern: re.Pattern[str], what: str, doc: str,
                     max_len: int | None = None) -> Callable[[str], str]:
    """A check named `name` that returns its value when `pattern` matches it (and it is at most
    `max_len` characters), else raises ValueError "<the value, quoted> <what>"."""
    def check(value: str) -> str:
        if not pattern.match(value) or (max_len is not None and len(value) > max_len):
            raise ValueError(f"{value!r} {what}")
        return value

    check.__name__ = check.__qualname__ = name
    check.__doc__ = doc
    return check


HOST_LABEL_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def hostname_or_ip(value: str) -> str:
    """A DNS name (RFC 1123 labels) or an IPv4/IPv6 address."""
    try:
        ipaddress.ip_address(value.strip("[]"))
        return value
    except ValueError:
        pass
    name = value[:-1] if value.endswith(".") else value
    if not name or len(name) > 253 or not all(HOST_LABEL_RE.match(label) for label in name.split(".")):
        raise ValueError(f"{value!r} is not a host name or IP address (labels of letters, digits and '-', "
                         "separated by '.', like 'kpro6.lab.internal')")
    return value


# follows shadow's useradd default (is_valid_user_name): [a-z_][a-z0-9_-]*$?, at most 32
POSIX_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,30}\$?$")

posix_user = _regex_validator(
    "posix_user", POSIX_USER_RE,
    "is not a login name (lowercase letters, digits, '_' and '-', starting with a letter or '_', at most 32)",
    "A login name as useradd takes it by default.")


# follows pve-common src/PVE/JSONSchema.pm pve_verify_node_name()
PVE_NODE_RE = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?$")

pve_node = _regex_validator(
    "pve_node", PVE_NODE_RE,
    "is not a Proxmox node name (letters, digits and '-', not at either end, at most 63; the short host name, "
    "like 'kpro6')",
    "A Proxmox node name (one DNS label, at most 63 characters).", max_len=63)


# follows pve-access-control src/PVE/Auth/Plugin.pm $user_regex / $realm_regex and
# verify_username() (at most 64 characters)
PVE_USERID_RE = re.compile(r"^[^\s:/]+@[A-Za-z][A-Za-z0-9._-]+$")
# follows pve-access-control src/PVE/AccessControl.pm $token_subid_regex (= the realm form)
PVE_TOKEN_RE = re.compile(r"^[A-Za-z][A-Za-z0-9._-]+$")

pve_userid = _regex_validator(
    "pve_userid", PVE_USERID_RE, "is not a Proxmox user ID; write user@realm, like 'root@pam' (at most 64)",
    "A Proxmox user ID, user@realm.", max_len=64)
pve_token_name = _regex_validator(
    "pve_token_name", PVE_TOKEN_RE,
    "is not a Proxmox API token name (a letter, then letters, digits, '.', '_', '-'; "
    "the part after '!' in user@realm!name)",
    "A Proxmox API token name (the part after '!').", max_len=64)

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
env_name = _regex_validator(
    "env_name", ENV_NAME_RE, "is not an environment variable name (letters, digits, '_', not starting with a digit)",
    "An environment variable name.")


def local_path(value: str) -> str:
    """A file on the machine that runs pyinfra (may start with '~')."""
    if not value.strip():
        raise ValueError("an empty path")
    return value


# ----------------------------------------------------------------- numbers


def _no_bool(value: Any) -> Any:
    # YAML's yes/no/true/false would otherwise count as 1/0
    if isinstance(value, bool):
        raise ValueError(f"got {value!r}; write a number")
    return value


NoBool = BeforeValidator(_no_bool)

JOBS_MAX = 4096


def build_jobs(value: Any) -> Any:
    """kernel.jobs: 'auto' or a number of parallel make jobs, 1..4096."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= JOBS_MAX:
        raise ValueError(f"got {value!r}; write 'auto' (min(cores, RAM / 2 GiB)) or a number of make jobs "
                         f"from 1 to {JOBS_MAX}")
    return value

# NVreg_* are module_param()s of type int/uint in the nvidia module (kernel-open/nvidia/nv-reg.h)
NVREG_INT_MIN, NVREG_INT_MAX = -(2**31), 2**32 - 1
MODPROBE_VALUE_RE = re.compile(r'^[^"\\\s]*$')


def nvreg_value(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if not NVREG_INT_MIN <= value <= NVREG_INT_MAX:
            raise ValueError(f"{value} does not fit a 32-bit module parameter ({NVREG_INT_MIN}..{NVREG_INT_MAX})")
        return value
    if not MODPROBE_VALUE_RE.match(value):
        raise ValueError(f"{value!r}: a modprobe option value cannot hold a double quote, a backslash or whitespace")
    if len(value) > 1024:
        raise ValueError(f"{value!r} is longer than a module parameter string (1024)")
    return value


# NCCL reads one NAME=value per line of /etc/nccl.conf and systemd one Environment= operand
NCCL_VALUE_MAX = 4096


def nccl_value(value: Any) -> Any:
    if isinstance(value, str) and len(value) > NCCL_VALUE_MAX:
        raise ValueError(f"a value of {len(value)} characters; NCCL variables here hold at most {NCCL_VALUE_MAX}")
    return value
