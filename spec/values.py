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
# One rule for both places a word lands, each read by its consumer's own parser:
# - grub-mkconfig's util/grub.d/10_linux.in linux_entry writes `linux … ro ${args}` unquoted into
#   grub.cfg, where grub-core/script/yylex.l ends a word at blanks and at {}|&$;<> and quotes or
#   backslashes, starts a comment with '#' at a word's start, and expands '$';
# - linux lib/cmdline.c next_arg() splits at whitespace and treats '"' as quoting, and
#   kernel/params.c parse_args() stops at a lone '--' (the rest goes to init), while
#   init/main.c hands words without '=' that no parameter claims to init as arguments ('-s').
# So: letters, digits and '_.,:=+/@%~^-', starting with a letter, digit or '_'.
CMDLINE_WORD_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.,:=+/@%~^-]*$")
CMDLINE_CHARS_RE = re.compile(r"^[A-Za-z0-9_.,:=+/@%~^-]$")


def cmdline_word(word: str) -> str:
    if not word:
        raise ValueError("an empty kernel parameter; write one word like 'pci=realloc'")
    if any(c.isspace() for c in word):
        raise ValueError(f"{word!r}: each cmdline parameter is one word without spaces, like 'pci=realloc'")
    odd = "".join(sorted({c for c in word if not CMDLINE_CHARS_RE.match(c)}))
    if odd:
        raise ValueError(f"{word!r}: a kernel parameter here is letters, digits and '_.,:=+/@%~^-' (not {odd!r}: "
                         "grub.cfg's script lexer or the kernel's parser would read it as quoting, a command "
                         "separator, a redirection or a variable)")
    if not CMDLINE_WORD_RE.match(word):
        raise ValueError(f"{word!r}: a kernel parameter starts with a letter, digit or '_' (a lone '--' ends the "
                         "kernel's parameters and hands the rest to init; a word starting with '-' is an "
                         "argument of init)")
    if len(word) > CMDLINE_MAX:
        raise ValueError(f"a parameter of {len(word)} characters; the whole kernel command line holds {CMDLINE_MAX}")
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
    # POSIX lets a path start with exactly two slashes and keeps them (posixpath.normpath('//x') is '//x'):
    # the leading pair is refused by its own test
    if (posixpath.normpath(value) != value.rstrip("/") or value.startswith("//") or value == "/"
            or value.endswith("/")):
        raise ValueError(f"{value!r} is not a plain file path (no '//', no trailing '/')")
    if len(value) > 4095:  # PATH_MAX 4096 with the NUL
        raise ValueError(f"{value!r} is longer than a path may be (4095)")
    return value


# follows linux include/uapi/linux/limits.h NAME_MAX: one file name is at most 255 bytes
NAME_MAX = 255
# a source archive is kept as <sha256>-<its last URL segment>(.part) in the source cache
# (facts/nvidia.py source_name, operations/nvidia.py cached_source): 255 - 65 - 5 bytes left
SOURCE_NAME_MAX = NAME_MAX - 65 - len(".part")
URL_MAX = 2048
# RFC 3986 path characters (unreserved, sub-delims, ':' '@', '/' and %XX escapes)
URL_PATH_RE = re.compile(r"^(?:[A-Za-z0-9._~!$&'()*+,;=:@/-]|%[0-9A-Fa-f]{2})*$")
URL_USER_RE = re.compile(r"^[A-Za-z0-9._-]+$")


def _file_names_fit(value: str, what: str) -> None:
    for part in value.split("/"):
        if len(part.encode("utf-8", "surrogatepass")) > NAME_MAX:
            raise ValueError(f"{what}: the part {part[:40]!r}… is longer than a file name may be ({NAME_MAX} bytes)")


def url(value: str, schemes: tuple[str, ...], what: str = "a source") -> str:
    """A URL whose parts each say what it looks like: the scheme from `schemes`, a host that
    `hostname_or_ip` takes (no zone id), an optional port, a path of RFC 3986 characters;
    parsed by urllib and rebuilt, it must come out as written (so git, curl and Python read
    the same host). No password in it (it would be printed); no fragment."""
    from urllib.parse import urlsplit, urlunsplit

    allowed = ", ".join(f"{s}://" for s in schemes)
    if len(value) > URL_MAX:
        raise ValueError(f"a URL of {len(value)} characters; {what} URL here is at most {URL_MAX}")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a URL ({exc})") from None
    if parts.scheme not in schemes or not value.startswith(parts.scheme + "://"):
        raise ValueError(f"{value!r}: {what} is a URL starting with {allowed}")
    if "#" in value:
        raise ValueError(f"{value!r} holds a '#' fragment; a source URL has none")
    if urlunsplit(parts) != value:
        raise ValueError(f"{value!r} does not read back as written once parsed; write a plain URL")
    if parts.password is not None:
        raise ValueError(f"{value!r} holds a password; keep credentials out of the spec")
    if parts.username is not None and not URL_USER_RE.match(parts.username):
        raise ValueError(f"{value!r}: the user name before '@' is letters, digits, '.', '_' and '-'")
    host = parts.hostname or ""
    netloc_host = parts.netloc.rsplit("@", 1)[-1]
    if port is not None:
        netloc_host = netloc_host[: netloc_host.rindex(":")]
    if netloc_host.startswith("["):
        if "%" in netloc_host or not netloc_host.endswith("]"):
            raise ValueError(f"{value!r}: an IPv6 host in a URL is [address] without a zone id")
        try:
            ipaddress.IPv6Address(netloc_host[1:-1])
        except ValueError:
            raise ValueError(f"{value!r}: {netloc_host!r} is not an IPv6 address") from None
    else:
        try:
            hostname_or_ip(netloc_host)
        except ValueError as exc:
            raise ValueError(f"{value!r}: the host {netloc_host!r} is not a host name or address") from exc
        if ":" in netloc_host:
            raise ValueError(f"{value!r}: an IPv6 host in a URL is written in brackets, [address]")
    if not host:
        raise ValueError(f"{value!r} has no host")
    if not URL_PATH_RE.match(parts.path) or not URL_PATH_RE.match(parts.query.replace("?", "")):
        odd = "".join(sorted({c for c in parts.path + parts.query if not URL_PATH_RE.match(c) and c != "%"}))
        raise ValueError(f"{value!r}: a URL path holds letters, digits and RFC 3986 punctuation "
                         f"(write {odd or 'a stray %'!r} %-escaped)")
    return value


def source_location(value: str) -> str:
    """A source archive's place: https:// or http:// URL, file:///abs/path or /abs/path; its
    last segment becomes part of a file name in the host's source cache, so it is bounded."""
    if value.startswith("file://"):
        host_abs_path(value[len("file://"):])
    elif value.startswith("/"):
        host_abs_path(value)
    elif value.split(":", 1)[0] in ("https", "http"):
        url(value, ("https", "http"))
    else:
        raise ValueError(f"{value!r}: a source is an https:// URL, file:///absolute/path or /absolute/path")
    last = value.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
    if len(last) > SOURCE_NAME_MAX:
        raise ValueError(f"{value!r}: its last part is {len(last)} characters; the host keeps the archive as "
                         f"<sha256>-<that part>, a file name of at most {NAME_MAX} bytes, so at most {SOURCE_NAME_MAX}")
    return value


# git clone takes these transports (git's transport.c / remote helpers); 'ext::' and other
# helpers that run commands are not among them, nor scp-like 'host:path'
GIT_SCHEMES = ("https", "http", "git", "ssh")


def git_url(value: str) -> str:
    """kernel.source.url for proxmox-git: an https://, http://, git:// or ssh:// URL, or a local
    repository as /abs/path or file:///abs/path."""
    if value.startswith("file://"):
        host_abs_path(value[len("file://"):])
        return value
    if value.startswith("/"):
        return host_abs_path(value)
    if value.split(":", 1)[0] not in GIT_SCHEMES or "://" not in value:
        raise ValueError(f"{value!r}: a git source is an https://, git:// or ssh:// URL, or a local repository "
                         "as /absolute/path or file:///absolute/path")
    return url(value, GIT_SCHEMES, "a git source")


# A pinned source is a full object id (git's hash: SHA-1, 40 hex digits; SHA-256 repositories, 64):
# a tag or branch names whatever the server (or anyone between it and the host: git:// and http://
# carry no authentication) says it names at fetch time, and a tag can be moved (issue 39 item 3).
# The build script checks that `git rev-parse HEAD` after the checkout is this id
# (templates/kernel-build.sh.j2).
COMMIT_ID_RE = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")


def git_ref(value: str) -> str:
    """kernel.source.ref: the full id of the commit to build (40 or 64 lowercase hex digits);
    tags, branches and abbreviated ids are refused."""
    if COMMIT_ID_RE.match(value):
        return value
    if COMMIT_ID_RE.match(value.lower()):
        why = "write it in lowercase, as git rev-parse prints it"
    elif re.fullmatch(r"[0-9a-fA-F]{4,63}", value):
        why = f"an abbreviated commit id ({len(value)} digits) can name another commit later; write all 40"
    else:
        why = ("a tag or branch names whatever the server, or anyone on the way, says when the host fetches it, "
               "and a tag can be moved; pin the commit it names now, e.g. "
               "git ls-remote URL 'refs/tags/TAG^{}' or git rev-parse 'TAG^{commit}' in a clone you trust")
    raise ValueError(f"{value[:80]!r} is not a full commit id: {why} (kernel.source.ref is the 40-hex id of the "
                     "commit to build)")


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


# follows linux include/uapi/linux/if.h IFNAMSIZ (16 with the NUL) and net/core/dev.c
# dev_valid_name(): an interface name is 1-15 bytes, not '.' or '..', without '/', ':' or
# whitespace; here also without the characters a URL or ssh_config would read ('%]@#?' …)
IFNAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")


def zone_id(zone: str) -> str:
    """An IPv6 zone id: the name of a network interface (or its index)."""
    if not IFNAME_RE.match(zone) or zone in (".", ".."):
        raise ValueError(f"zone id {zone!r} is not a network interface name (1-15 letters, digits, '_', '.', '-', "
                         "like 'vmbr0')")
    return zone


def hostname_or_ip(value: str) -> str:
    """A DNS name (RFC 1123 labels) or an IPv4/IPv6 address (an IPv6 link-local one may name
    its interface: fe80::1%vmbr0). Written bare, without brackets or a port."""
    if value.startswith("[") or value.endswith("]"):
        raise ValueError(f"{value!r}: write an IPv6 address without brackets, like 'fe80::1%vmbr0'")
    address, pct, zone = value.partition("%")
    if pct:
        zone_id(zone)
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            raise ValueError(f"{value!r}: only an IPv6 address takes a zone id ('%<interface>')") from None
        return value
    try:
        ipaddress.ip_address(value)
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


# follows pve-common src/PVE/JSONSchema.pm $CONFIGID_RE (format pve-configid), the format of a
# PCI mapping id (pve-guest-common src/PVE/Mapping/PCI.pm) and of hostpciN's mapping= (qemu-server);
# `pvegpu-` names the per-node mappings pvegpu creates and deletes when stale (plan/guests.py)
PVE_CONFIGID_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]+$")


def gpu_pool(value: str) -> str:
    """A GPU pool: the id of its cluster-wide PCI resource mapping."""
    if not PVE_CONFIGID_RE.match(value):
        raise ValueError(f"{value!r} is not a Proxmox mapping id (a letter, then letters, digits, '_' or '-'; "
                         "at least 2 characters, like 'rtx6000')")
    if value.lower().startswith("pvegpu-"):
        raise ValueError(f"{value!r}: mapping ids starting with 'pvegpu-' are pvegpu's per-node mappings "
                         "(deleted when unused); name the pool otherwise, like 'rtx6000'")
    return value


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


# NCCL reads one NAME=value per line of /etc/nccl.conf and systemd one Environment= operand;
# follows nccl src/misc/param.cc setEnvFile(): a value is copied into a 1024-byte buffer, so
# NCCL keeps its first 1023 bytes and silently drops the rest
NCCL_VALUE_MAX = 1023


def nccl_value(value: Any) -> Any:
    size = len(str(value).encode("utf-8", "surrogatepass"))
    if size > NCCL_VALUE_MAX:
        raise ValueError(f"a value of {size} bytes; NCCL keeps at most {NCCL_VALUE_MAX} bytes of a value "
                         "(src/misc/param.cc) and would cut the rest")
    return value
