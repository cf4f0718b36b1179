"""Readings several facts take of the same thing (`uname -r`, dpkg's package list): taken once
per remote command.

A fact's command takes such a reading with `take(NAME)`: shell that sets the variable NAME to
the reading's output unless this command already has it, then uses "$NAME". Run alone, a fact
takes its own reading, as before. A batched probe (`facts.hardware`) whose sections take one
reading more than once takes it once before its sections (`prelude`) and every section finds it:
one `uname` and one `dpkg-query` per probe instead of one per fact. The reading is taken in the
same command, a moment before the sections run: nothing is kept from one command to the next.
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

READINGS: dict[str, str] = {
    DPKG_ALL: "dpkg-query -W -f='${db:Status-Abbrev} ${Package} ${Version}\\n' '*' 2>/dev/null",
    **{name: f"uname -{flag} 2>/dev/null" for flag, name in UNAME.items()},
}


def take(name: str) -> str:
    """Shell that sets $name to its reading (`READINGS`) unless this command took it already."""
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


def ct_init_pids(ctids) -> str:
    """The reading of each CT's init pid (`lxc-info -n <id> -p -H`, facts.guest_state.ct_root_loop),
    one ``<id>:<pid>`` word per CT (`<id>:` where it runs none); returns the variable's name.
    Facts that look into the same CTs share it."""
    ids = [int(c) for c in ctids]
    name = "_pvegpu_ct_pids_" + "_".join(str(i) for i in ids)
    READINGS[name] = ("for id in " + " ".join(str(i) for i in ids) + "; do "
                      'printf \'%s:%s\\n\' "$id" "$(lxc-info -n "$id" -p -H 2>/dev/null | tr -dc 0-9)"; done')
    return name


PRELUDE_MIN_USES = 2  # a reading one section takes stays in that section


def prelude(script: str) -> str:
    """The readings `script`'s sections take more than once, taken once up front ('' if none)."""
    return "".join(f"{{ {name}=$({cmd}); }} 2>/dev/null; " for name, cmd in READINGS.items()
                   if script.count(f'[ -n "${{{name}+x}}" ]') >= PRELUDE_MIN_USES)
