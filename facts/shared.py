"""Readings several facts take of the same thing (`uname -r`, dpkg's package list): taken once
per remote command.

A fact's command takes such a reading with `take(NAME)`: shell that sets the variable NAME to
the reading's output unless this command already has it, then uses "$NAME". Run alone, a fact
takes its own reading, as before. A batched probe (`facts.hardware`) whose sections take one
reading more than once takes it once before its sections (`prelude`) and every section finds it:
one `uname` and one `dpkg-query` per probe instead of one per fact. The reading is taken in the
same command, a moment before the sections run: nothing is kept from one command to the next.

A reading over a set (`take_set`: the CTs' init pids and roots, the managed files' modes and
digests) is taken once over the union of the sets its sections name. A small file a fact prints
whole is read by the shell itself (`read_file`, `first_line`): no program at all.
"""

from __future__ import annotations

import re

# dpkg-query's `${db:Status-Abbrev} ${Package} ${Version}` for every package dpkg's status
# database knows (the '*' pattern: a package that is not installed but known, e.g. held or with
# its config files left, is printed too, as for a name given on the command line: dpkg
# src/query/main.c showpackages/pkg_array_match_patterns), sorted by name as dpkg-query sorts
# (pkg_sorter_by_nonambig_name_arch).
DPKG_ALL = "_pvegpu_dpkg"
UNAME = {"r": "_pvegpu_uname_r", "n": "_pvegpu_uname_n", "m": "_pvegpu_uname_m"}
# one `uname -n -r -m` for the three: coreutils uname prints the asked fields in its own order
# (src/uname.c main: print_element for nodename, kernel release, machine, in that order, one
# space apart); a node name and a machine name hold no space, so the release is what lies
# between the first and the last space
UNAME_ALL = "_pvegpu_uname"
_UNAME_PART = {"n": f"${{{UNAME_ALL}%% *}}", "m": f"${{{UNAME_ALL}##* }}"}
ROOT_ID = "_pvegpu_root"  # the host root's device:inode (a CT's root compared with it)

READINGS: dict[str, str] = {
    DPKG_ALL: "dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n' '*' 2>/dev/null",
    UNAME_ALL: "uname -n -r -m 2>/dev/null",
    ROOT_ID: "stat -c %d:%i / 2>/dev/null",
}


def take(name: str) -> str:
    """Shell that sets $name to its reading (`READINGS`, or a part of `uname -n -r -m` for a name
    of `UNAME`) unless this command took it already."""
    for flag, part in UNAME.items():
        if name == part:
            value = (_UNAME_PART[flag] if flag in _UNAME_PART
                     else f"${{{UNAME_ALL}#* }}; {name}=${{{name}% *}}")
            return f"{take(UNAME_ALL)}; {name}={value}"
    return f'[ -n "${{{name}+x}}" ] || {{ {name}=$({READINGS[name]}); }} 2>/dev/null'


def uname(flag: str) -> str:
    """Shell that prints what `uname -<flag>` prints (r, n or m), through the shared reading."""
    return f'{{ {take(UNAME[flag])}; printf \'%s\\n\' "${UNAME[flag]}"; }}'


def _glob_regex(pattern: str) -> str:
    """An fnmatch(3) pattern of package names (dpkg's pkg_spec_match_name) as an anchored awk ERE:
    `*` any run, `?` one character, `[...]` a class; every other character literal."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            out.append(pattern[i:end + 1])
            i = end
        elif c.isalnum():
            out.append(c)
        else:
            out.append(f"[{c}]" if c not in "\\^" else f"\\{c}")
        i += 1
    return "^" + "".join(out) + "$"


def _match(pattern: str) -> str:
    """An awk condition: field 2 (the package) is `pattern` (a name, or an fnmatch pattern)."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9+.\-\[\]*?]*", pattern):
        raise ValueError(f"not a package name or pattern: {pattern!r}")
    if any(ch in pattern for ch in "*?["):
        return f"$2 ~ /{_glob_regex(pattern)}/"
    return f'$2 == "{pattern}"'


def dpkg_show(patterns: list[str]) -> str:
    """Shell that prints what ``dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n'
    PATTERNS 2>/dev/null`` prints (each package of the database that matches a pattern, once, in
    dpkg's order) and, like it, fails when a pattern matches none (pkg_array_match_patterns)."""
    conds = [_match(p) for p in patterns]
    seen = " ".join(f"if ({c}) m{i} = 1;" for i, c in enumerate(conds))
    missing = " || ".join(f"!m{i}" for i in range(len(conds)))
    return (f"{{ {take(DPKG_ALL)}; printf '%s\\n' \"${DPKG_ALL}\" | "
            f"awk '{{ {seen} }} {' || '.join(conds)} {{ print }} END {{ exit ({missing}) }}'; }}")


def dpkg_holds() -> str:
    """Shell that prints what apt-mark showhold prints from dpkg: the installed packages (state
    not `n`: a plain ``dpkg-query -W`` lists no not-installed package, showpackages) whose
    selection is hold (the abbreviation's first letter `h`), one name a line."""
    return (f"{{ {take(DPKG_ALL)}; printf '%s\\n' \"${DPKG_ALL}\" | "
            "awk '$1 ~ /^h/ && substr($1, 2, 1) != \"n\" {print $2}'; }")


def dpkg_installed(package: str) -> str:
    """Shell that succeeds when dpkg's first entry for `package` is in state installed (the
    abbreviation's second letter `i`; what ``dpkg-query -W -f '${db:Status-Abbrev}' P | grep -q '^.i'``
    tests)."""
    return (f"{{ {take(DPKG_ALL)}; printf '%s\\n' \"${DPKG_ALL}\" | "
            f"awk '{_match(package)} {{ f = (substr($0, 2, 1) == \"i\"); exit }} END {{ exit !f }}'; }}")


# A small file read by the shell itself, no program started (a `cat` costs a fork and an exec,
# ~1 ms on a node; dash's `read` builtin takes one byte per read(2), src/miscbltin.c readcmd, so
# this is cheaper for the files of a few KB the facts read: /proc's driver and device tables,
# configs pvegpu or Proxmox write). `IFS= read -r` keeps every line as it is (blanks,
# backslashes, empty lines); a last line without a line break gets one, where cat would run it
# into the next line of output. A file that cannot be opened prints nothing and fails, as cat.
# The /proc files read so are seq_files (the kernel's fs/seq_file.c; the NVIDIA driver's through
# single_open, kernel-open/common/inc/nv-procfs-utils.h): the text is made at the first read and
# the one-byte reads copy it out, the same bytes as cat's large reads.
_LINE = "_pvegpu_l"
EACH_FILE = '"$f"'  # the file of a `for f in ...` loop, as `read_file`'s argument


def read_file(path: str) -> str:
    """Shell that prints the text file `path` (one shell word: quoted, or "$f") as `cat` does,
    with no program."""
    return (f"while IFS= read -r {_LINE} || [ -n \"${_LINE}\" ]; do printf '%s\\n' \"${_LINE}\"; "
            f"done 2>/dev/null < {path}")


def first_line(path: str | None = None) -> str:
    """Shell that prints the first line of the file `path` (of its input without one) as
    `head -n 1` does, with no program."""
    redirect = f" 2>/dev/null < {path}" if path else ""
    return f"{{ {{ IFS= read -r {_LINE} || [ -n \"${_LINE}\" ]; }}{redirect} && printf '%s\\n' \"${_LINE}\"; }}"


# Readings over a set of words (CT ids, file paths): a fact's command takes the reading over its
# own set (`take_set`); a probe whose sections take one more than once takes it once, over the
# union of their sets (`prelude`), and each section picks its own entries out of it. The set is
# written into the command (``NAME=$(set -- WORDS; BODY)``), so the prelude finds it there: no
# state outside the command strings.
CT_PIDS = "_pvegpu_ct_pids"
FILE_SUMS = "_pvegpu_file_sums"
SET_READINGS: dict[str, str] = {
    # `<id>:<pid>:<root>` per CT (`<id>::` where it runs none), <root> the device:inode of its root
    # seen through its init (/proc/<pid>/root/; empty where stat fails): the init pid as pve-container PVE/LXC.pm
    # find_lxc_pid gets it, `lxc-info -n <id> -p` (a C program); with -H and that one filter, lxc
    # src/lxc/tools/lxc_info.c print_info_msg_int prints the bare number and a line break (nothing
    # for a CT that does not run), so output that is not a number is no pid.
    CT_PIDS: ('for id do p=$(lxc-info -n "$id" -p -H 2>/dev/null); case "$p" in *[!0-9]*) p=;; esac; '
              'r=; [ -n "$p" ] && r=$(stat -L -c %d:%i "/proc/$p/root/" 2>/dev/null); '
              "printf '%s:%s:%s\\n' \"$id\" \"$p\" \"$r\"; done"),
    # `stat -c '%a %n'` lines of every regular file (not a symlink) of the set, a `==> pvegpu-sums`
    # line, then `sha256sum` of the same files: what facts.files.ManagedFiles prints after its
    # `==> pvegpu-modes` line (nothing when none of the set is a regular file).
    FILE_SUMS: ('for f do shift; [ ! -L "$f" ] && [ -f "$f" ] && set -- "$@" "$f"; done; '
                "if [ $# -gt 0 ]; then stat -c '%a %n' -- \"$@\"; echo '==> pvegpu-sums'; sha256sum -- \"$@\"; fi"),
}


def take_set(name: str, words) -> str:
    """`take` for a reading of `SET_READINGS` over `words` (each already one shell word, e.g.
    through facts.shell.word): shell that sets $name unless this command took it already, then
    over a set that holds every word of `words` (the probe's union)."""
    return f'[ -n "${{{name}+x}}" ] || {{ {name}=$(set -- {" ".join(words)}; {SET_READINGS[name]}); }} 2>/dev/null'


def ct_init_pids(ctids) -> str:
    """Shell that sets $_pvegpu_ct_pids (`CT_PIDS`) to one ``<id>:<pid>:<root>`` word per CT of `ctids`
    unless this command has it (for at least these CTs) already. Facts that look into the same
    CTs share it."""
    return take_set(CT_PIDS, [str(int(c)) for c in ctids])


def _set_words(script: str, name: str) -> list[list[str]]:
    """The word sets of every `take_set(name, ...)` in `script`, in order."""
    from facts.shell import leading_words

    start = f'[ -n "${{{name}+x}}" ] || {{ {name}=$(set -- '
    sets: list[list[str]] = []
    at = script.find(start)
    while at >= 0:
        sets.append(leading_words(script[at + len(start):]))
        at = script.find(start, at + len(start))
    return sets


PRELUDE_MIN_USES = 2  # a reading one section takes stays in that section


def prelude(script: str) -> str:
    """The readings `script`'s sections take more than once, taken once up front ('' if none);
    a reading over a set is taken over the union of the sections' sets."""
    from facts.shell import word

    out = "".join(f"{{ {name}=$({cmd}); }} 2>/dev/null; " for name, cmd in READINGS.items()
                  if script.count(f'[ -n "${{{name}+x}}" ]') >= PRELUDE_MIN_USES)
    for name, body in SET_READINGS.items():
        sets = _set_words(script, name)
        if len(sets) >= PRELUDE_MIN_USES:
            union = list(dict.fromkeys(w for words in sets for w in words))
            out += f"{{ {name}=$(set -- {' '.join(word(w) for w in union)}; {body}); }} 2>/dev/null; "
    return out
