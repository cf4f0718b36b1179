"""What the NVIDIA and kernel stages share a build by (issue 41): the inputs of a build that the
stages' own facts do not read (the machine, each release's headers package; for the kernel, `gcc`'s
banner and the sha256 of the base config file), the builds this host keeps for others (`SHARE_ROOT`,
`KERNEL_SHARE_ROOT`), and its view of its Proxmox cluster (pmxcfs's /etc/pve/.members: the nodes
and their addresses the copy goes to). plan/build_share.py decides from it."""

from __future__ import annotations

import hashlib
import json
import re

from pyinfra.api import FactBase

from facts.sections import SECTION, split_sections
from facts.shared import DPKG_ALL, UNAME, first_line, read_file, take
from facts.shell import word

# unsigned, stripped modules of one build with their manifest, one directory per build key
# (operations/nvidia.py publishes them there after a build; a receiver copies one whole)
SHARE_ROOT = "/var/cache/pvegpu/nvidia-share"
# the kernel stage's .debs of one build with their manifest, one directory per build key
# (operations/kernel.py publishes them there after a build)
KERNEL_SHARE_ROOT = "/var/cache/pvegpu/kernel-share"
MANIFEST = "manifest"
MODULE_SUM = r"^[0-9a-f]{64}  [A-Za-z0-9_-]+\.ko$"  # a module's line in a kept NVIDIA build's manifest
MEMBERS = "/etc/pve/.members"  # pmxcfs status.c: this node's view of its cluster
# the headers packages that ship /lib/modules/<release>/build: Debian's linux-headers-<rel>, Proxmox's
# proxmox-headers-<rel> (pve-headers-<rel> before Proxmox VE 8)
HEADERS_PACKAGES = ("linux-headers-{}", "proxmox-headers-{}", "pve-headers-{}")


class BuildShareState(FactBase):
    """The inputs of a module build beyond the driver stage's fact, the builds this host keeps for
    others and its cluster view, in one command.

    + releases: the kernel releases whose headers package is asked
    + kernel_base: the kernel stage's base config (`running`, a make target or a path): then `gcc`'s
      banner and the base config file's sha256 are read too

    .. code:: python

        {"machine": "x86_64",
         "headers": {"6.1.0-57-amd64": "linux-headers-6.1.0-57-amd64 6.1.158-1"},   # None: no package
         "published": {"<key>": ["6.1.0-57-amd64"]},     # the trusted kept builds: SHARE_ROOT/<key>/manifest's release
         "kept": {"<key>": {"kind": "nvidia", "version": "595.45.04", "release": "6.1.0-57-amd64", "built_by": "kernel-hook",
                            "trusted": True, "why": None}},  # every kept build, and why one is not trusted
         "members": {"nodename": "kpro6", "cluster": {"name": "c1", …}, "nodelist": {…}},  # None: no cluster
         # with kernel_base only:
         "gcc": "gcc (Debian 12.2.0-14) 12.2.0",   # None: no gcc
         "base_config_sha256": "<sha256>"}          # None: a make target, or the file is unreadable

    """

    def command(self, releases: list[str], kernel_base: str | None = None) -> str:
        # the running release (named at run time) and the targets; each headers package name of each
        names = '"$k"' + (word(" " + " ".join(releases)) if releases else "")
        wanted = "; ".join(f'w["{p.format("")}" a[i]]' for p in HEADERS_PACKAGES)
        awk = (f"BEGIN {{ n = split(rels, a, \" \"); for (i = 1; i <= n; i++) {{ {wanted} }} }} "
               "substr($1, 2, 1) == \"i\" && ($2 in w) { print $2, $3 }")
        parts = [
            f"echo '{SECTION}machine'; {take(UNAME['m'])}; echo \"${UNAME['m']}\"",
            # installed (second letter of the abbreviation `i`) packages of those names, with versions
            (f"echo '{SECTION}headers'; {take(UNAME['r'])}; k=${UNAME['r']}; {take(DPKG_ALL)}; "
             f"printf '%s\\n' \"${DPKG_ALL}\" | awk -v rels={names} {word(awk)}"),
            # each kept build: its manifest's fields, then (NVIDIA's) sha256sum -c of the modules it lists,
            # each line as `<kind> <dir> <field> <value>`; the parser trusts only a build whose key is its
            # recorded inputs' sha256 and whose modules match (`kept_verdict`)
            (f"echo '{SECTION}published'; for m in {word(SHARE_ROOT)}/*/{MANIFEST}"
             + (f" {word(KERNEL_SHARE_ROOT)}/*/{MANIFEST}" if kernel_base else "") + "; do [ -f \"$m\" ] || continue; "
             f"d=${{m%/*}}; case \"$d\" in {word(SHARE_ROOT)}/*) t=nvidia;; *) t=kernel;; esac; "
             "while IFS= read -r l; do case \"$l\" in 'key '*|'version '*|'release '*|'built-by '*|'inputs '*) "
             "echo \"$t ${d##*/} $l\";; esac; done < \"$m\"; "
             "[ \"$t\" = nvidia ] || continue; "
             f"grep -E '{MODULE_SUM}' \"$m\" | (cd \"$d\" && LC_ALL=C sha256sum -c --strict 2>&1) | "
             "while IFS= read -r l; do echo \"$t ${d##*/} check $l\"; done; done"),
            f"echo '{SECTION}members'; {read_file(MEMBERS)}",
        ]
        if kernel_base:
            # the compiler Kbuild runs (templates/kernel-build.sh.j2 records the same first line)
            parts.append(f"echo '{SECTION}gcc'; gcc --version | {first_line()}")
            if kernel_base not in ("tinyconfig", "defconfig", "allnoconfig"):
                path = f'"/boot/config-${UNAME["r"]}"' if kernel_base == "running" else word(kernel_base)
                parts.append(f"echo '{SECTION}base_config'; {take(UNAME['r'])}; sha256sum < {path}")
        return "; ".join(f"{{ {p}; }} 2>/dev/null" for p in parts) + "; true"

    def process(self, output):
        return parse_share_state(output)


def parse_share_state(lines: list[str]) -> dict:
    """Pure parser of `BuildShareState.command` output (shape: see the fact)."""
    sections = split_sections(lines, SECTION)
    machine = next((line.strip() for line in sections.get("machine", []) if line.strip()), None)
    headers: dict[str, str] = {}
    for line in sections.get("headers", []):
        words = line.split()
        if len(words) == 2:
            for pattern in HEADERS_PACKAGES:
                prefix = pattern.format("")
                if words[0].startswith(prefix):
                    headers[words[0][len(prefix):]] = f"{words[0]} {words[1]}"
    kept = parse_kept(sections.get("published", []))
    published: dict[str, list[str]] = {}
    for key, entry in kept.items():
        if entry["trusted"]:
            published.setdefault(key, []).append(entry["release"])
    members = None
    text = "\n".join(sections.get("members", [])).strip()
    if text:
        try:
            members = json.loads(text)
        except ValueError:
            members = None
    state = {"machine": machine, "headers": headers, "published": published, "kept": kept,
             "members": members if isinstance(members, dict) else None}
    if "gcc" in sections:  # read with kernel_base
        state["gcc"] = next((line.strip() for line in sections["gcc"] if line.strip()), None)
        state["base_config_sha256"] = next(
            (line.split()[0] for line in sections.get("base_config", []) if re.match(r"^[0-9a-f]{64}\b", line)), None)
    return state


def parse_kept(lines: list[str]) -> dict[str, dict]:
    """The kept builds of the `published` section: {key: {"kind", "version", "release", "built_by", "trusted",
    "why"}}.

    A kept NVIDIA build is trusted when its directory, its manifest's key and the sha256 of the inputs
    its manifest records (plan.build_share.inputs_text: what the key hashes, the converge's or the
    kernel hook's) are one key, the inputs name the manifest's release, and every module it lists
    has the sha256 it records (sha256sum -c, run by the command). A kernel build (its .debs are
    checked by the receiver) is taken by its release as before."""
    raw: dict[str, dict] = {}
    for line in lines:
        words = line.rstrip("\n").split(" ", 3)
        if len(words) < 4 or words[0] not in ("nvidia", "kernel") or not re.fullmatch(r"[0-9a-f]{64}", words[1]):
            continue
        kind, key, field, value = words
        entry = raw.setdefault(key, {"kind": kind, "fields": {}, "checks": []})
        if field == "check":
            entry["checks"].append(value)
        else:
            entry["fields"].setdefault(field, value)
    kept: dict[str, dict] = {}
    for key, entry in raw.items():
        fields = entry["fields"]
        release = fields.get("release")
        if not release:
            continue
        why = kept_verdict(key, entry["kind"], fields, entry["checks"])
        kept[key] = {"kind": entry["kind"], "version": fields.get("version"), "release": release,
                     "built_by": fields.get("built-by") or "converge",
                     "trusted": why is None, "why": why}
    return kept


def kept_verdict(key: str, kind: str, fields: dict[str, str], checks: list[str]) -> str | None:
    """Why a kept build is not trusted (None: it is); see `parse_kept`."""
    if kind != "nvidia":
        return None
    if fields.get("key") != key:
        return f"its manifest names the key {fields.get('key')!r}, not its directory's"
    text = fields.get("inputs")
    if not text:
        return "its manifest records no inputs to check its key against (kept by an older pvegpu)"
    if hashlib.sha256(text.encode()).hexdigest() != key:
        return "its key is not the sha256 of the inputs its manifest records (the manifest was changed)"
    try:
        inputs = json.loads(text)
    except ValueError:
        return "the inputs its manifest records are not JSON"
    if not isinstance(inputs, dict) or inputs.get("release") != fields.get("release"):
        return f"its recorded inputs are not of release {fields.get('release')}"
    failed = [line.split(": ", 1)[0] for line in checks if re.match(r"^[A-Za-z0-9_-]+\.ko: FAILED", line)]
    if failed:
        return f"the sha256 of {', '.join(failed)} differs from its manifest (a module was changed)"
    ok = [line for line in checks if line.endswith(": OK")]
    if not ok or len(ok) != len(checks):
        bad = next((line for line in checks if not line.endswith(": OK")), "no module listed")
        return f"its modules do not check against its manifest ({bad})"
    if "nvidia.ko: OK" not in ok:
        return "its manifest lists no nvidia.ko"
    return None
