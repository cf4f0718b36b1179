"""One build per input set in a run (issue 41), from spec + facts (no I/O): the NVIDIA modules and the
custom kernel's .debs, by one code path (`share_plan`, `share_lines`), each kind with its own inputs.

A module build is a function of its inputs: the NVIDIA source archive (its sha256), the kernel
release and the headers package it is built against (name and version), the compiler that builds it
as the toolchain check reads it (templates/nvidia-toolchain-check.sh.j2: the `--version` banner less
the program name, for $(CC) and the open tree's $(CXX)), the kernel's own compiler
(CONFIG_CC_VERSION_TEXT), the make variables and the strip the build uses, the machine and
`nvidia.version`. `build_inputs` collects them per host and release; `build_key` is their sha256.
`share_plan` groups the run's (host, release) builds by key: one host of each group builds (the one
with the most cores, then memory, then the first name), the others receive its unsigned modules,
verify them against the key and install them (each signs with its own key). A host whose inputs
nobody else has builds alone, and the plan says which input differs.

The kernel stage's build (`kernel_build_inputs`): the release it produces (kernel.version, which
carries the LOCALVERSION of a tarball build and, for pve-kernel, its Makefile's KVNAME with
KREL_EXTRA + facts.kernel.LOCAL_KREL_SUFFIX), the source (tarball sha256, or the pinned commit),
the base config (a make target, or the sha256 of the config file it copies: the running kernel's or
a path), the config fragments, the compiler Kbuild runs (`gcc`, its `--version` banner less the
program name, as the build's manifest records it), the machine and the packaging
(templates/kernel-build.sh.j2). One host of each group builds the .debs; the others copy them,
verify them (sha256 of each against the builder's manifest, the package names and versions the key
implies) and install them through the stage's own install and trial (operations/kernel.py).
"""

from __future__ import annotations

import hashlib
import json
import re

# What a difference in each input is called where the plan says why a host builds alone
INPUT_WORDS = {
    "version": "nvidia.version", "source_sha256": "NVIDIA source archive (sha256)",
    "headers_package": "kernel headers package", "kernel_compiler": "kernel's compiler (CONFIG_CC_VERSION_TEXT)",
    "cc": "compiler", "cxx": "C++ compiler", "flags": "build flags", "machine": "machine",
}
STRIP = "strip --strip-debug"  # templates/nvidia-build.sh.j2, before signing
KERNEL_INPUT_WORDS = {
    "release": "kernel release", "kind": "source kind", "source": "source (sha256 or commit)",
    "base_config": "base config", "base_config_sha256": "base config file (sha256)",
    "fragments": "config fragments", "krel_suffix": "KREL_EXTRA suffix", "cc": "compiler",
    "packaging": "packaging", "machine": "machine",
}
# per kind: what a difference in each input is called, and the spec field that picks the builder
KINDS: dict[str, dict[str, dict[str, str]]] = {
    "nvidia": {"words": INPUT_WORDS, "preferred": {"field": "nvidia.share_builder"}},
    "kernel": {"words": KERNEL_INPUT_WORDS, "preferred": {"field": "kernel.share_builder"}},
}
# the packaging each kind of kernel build runs (templates/kernel-build.sh.j2), with the .debs' version
# where the key implies it (bindeb-pkg's KDEB_PKGVERSION; pve-kernel's comes from its changelog at the ref)
KERNEL_PKGVERSION = "1"
KERNEL_PACKAGING = {"tarball": f"make bindeb-pkg KDEB_PKGVERSION={KERNEL_PKGVERSION} KDEB_COMPRESS=gzip",
                    "proxmox-git": "dpkg-buildpackage -b -uc -us"}


def _banner_tail(banner: str | None) -> str | None:
    """A `--version` first line less the program name, as the toolchain check compares it."""
    text = (banner or "").strip()
    return text.split(" ", 1)[1] if " " in text else None


def build_inputs(version: str, source_sha256: str | None, release: str, nv_state: dict, share_state: dict,
                 entry: dict) -> tuple[dict | None, str | None]:
    """(inputs, None) of one release's build on one host, or (None, why it cannot be shared).

    `nv_state`: the `NvidiaHostState` fact; `share_state`: the `BuildShareState` fact; `entry`: the
    release's `plan.nvidia.driver_steps` entry (its `cc`, `cxx`).

    >>> inputs, _ = build_inputs("595.45.04", "ab" * 32, "6.1.0-57-amd64",
    ...     {"compilers": {"gcc-12": "gcc-12 (Debian 12.2.0-14) 12.2.0"},
    ...      "releases": {"6.1.0-57-amd64": {"cc_version_text": "gcc-12 (Debian 12.2.0-14) 12.2.0"}}},
    ...     {"machine": "x86_64", "headers": {"6.1.0-57-amd64": "linux-headers-6.1.0-57-amd64 6.1.158-1"}},
    ...     {"cc": "gcc-12", "cxx": None})
    >>> inputs["cc"], inputs["flags"]
    (['gcc-12', '(Debian 12.2.0-14) 12.2.0'], 'CC=gcc-12 KERNEL_UNAME=6.1.0-57-amd64; strip --strip-debug')
    """
    compilers = nv_state.get("compilers") or {}
    cc, cxx = entry.get("cc"), entry.get("cxx")
    headers = (share_state.get("headers") or {}).get(release)
    if not source_sha256:
        return None, "no nvidia.modules_source to name the source by"
    if not headers:
        return None, (f"no installed headers package (linux-headers-{release} or proxmox-headers-{release}) "
                      f"says which headers /lib/modules/{release}/build holds")
    if not share_state.get("machine"):
        return None, "the machine (uname -m) is unknown"
    if not cc or not _banner_tail(compilers.get(cc)) or (cxx and not _banner_tail(compilers.get(cxx))):
        return None, "the compiler's banner is unknown"
    flags = f"CC={cc}{f' CXX={cxx}' if cxx else ''} KERNEL_UNAME={release}; {STRIP}"
    inputs = {
        "version": version, "source_sha256": source_sha256, "release": release, "headers_package": headers,
        "kernel_compiler": ((nv_state.get("releases") or {}).get(release) or {}).get("cc_version_text"),
        "cc": [cc, _banner_tail(compilers.get(cc))],
        "cxx": [cxx, _banner_tail(compilers.get(cxx))] if cxx else None,
        "flags": flags, "machine": share_state.get("machine"),
    }
    return inputs, None


def kernel_build_inputs(version: str, kind: str, source: str | None, base_config: str, fragments: list[str],
                        share_state: dict, krel_suffix: str | None = None) -> tuple[dict | None, str | None]:
    """(inputs, None) of the kernel stage's build of `version` on one host, or (None, why it cannot
    be shared). `source`: the tarball's sha256 or the pinned commit; `base_config`: the spec's
    (`running`, a make target or a path: then the file's sha256 is an input, `share_state`
    "base_config_sha256"); `share_state`: the `BuildShareState` fact read with `kernel_base`.

    >>> inputs, _ = kernel_build_inputs("6.1.192-pvegpu", "tarball", "ab" * 32, "tinyconfig", ["CONFIG_64BIT=y"],
    ...     {"machine": "x86_64", "gcc": "gcc (Debian 12.2.0-14) 12.2.0"})
    >>> inputs["cc"], inputs["base_config_sha256"]
    (['gcc', '(Debian 12.2.0-14) 12.2.0'], None)
    """
    if not source:
        return None, "its source has no sha256 or commit to name it by"
    file_based = base_config not in ("tinyconfig", "defconfig", "allnoconfig")
    config_sha = share_state.get("base_config_sha256") if file_based else None
    if file_based and not config_sha:
        where = "the running kernel's /boot/config-<release>" if base_config == "running" else base_config
        return None, f"its base config ({where}) could not be read"
    if not share_state.get("machine"):
        return None, "the machine (uname -m) is unknown"
    cc = _banner_tail(share_state.get("gcc"))
    if not cc:
        return None, "the compiler's banner (gcc --version) is unknown"
    inputs = {
        "release": version, "kind": kind, "source": source, "base_config": base_config,
        "base_config_sha256": config_sha, "fragments": list(fragments), "krel_suffix": krel_suffix,
        "cc": ["gcc", cc], "packaging": KERNEL_PACKAGING.get(kind), "machine": share_state.get("machine"),
    }
    return inputs, None


def inputs_text(inputs: dict) -> str:
    """The inputs as the key hashes them and a kept build's manifest records them (its `inputs`
    line): JSON, keys sorted, no spaces, ASCII only (each other character a \\u escape)."""
    return json.dumps(inputs, sort_keys=True, separators=(",", ":"))


def build_key(inputs: dict) -> str:
    """The sha256 (hex) naming a build by its inputs: equal inputs, equal key."""
    return hashlib.sha256(inputs_text(inputs).encode()).hexdigest()


# what the kernel hook reads on the host for the key (templates/nvidia-share-key.sh.j2), each where
# this module's facts read it: the release (its $1), the headers package (BuildShareState), the
# kernel's CONFIG_CC_VERSION_TEXT (NvidiaHostState), the compilers it picked and their banners' tails
# (NvidiaHostState's COMPILER_BANNERS), the machine (uname -m)
HOOK_KEY_VARS = ("release", "headers", "kernel_compiler", "cc", "cc_tail", "cxx", "cxx_tail", "machine")
_MARK = "\x7f"  # json.dumps writes it as \u007f: no spec value holds it


def hook_key_parts(version: str, source_sha256: str, cxx: bool) -> list[tuple[str, str]]:
    """The kernel hook's build inputs as `build_inputs` shapes them, in pieces: ("text", JSON text as
    `inputs_text` writes it) and ("var", one of HOOK_KEY_VARS, which the hook reads on the host and
    writes JSON-escaped in its place). The static parts (nvidia.version, the source's sha256, the
    flags' form, the field names and order) come from `build_inputs` itself, so the hook's key is
    this module's key of the same inputs. `cxx`: the open tree's (the hook picks a C++ compiler)."""
    mark = {v: f"{_MARK}{v}{_MARK}" for v in HOOK_KEY_VARS}
    compilers = {mark["cc"]: f"{mark['cc']} {mark['cc_tail']}"}
    if cxx:
        compilers[mark["cxx"]] = f"{mark['cxx']} {mark['cxx_tail']}"
    inputs, why = build_inputs(
        version, source_sha256, mark["release"],
        {"compilers": compilers, "releases": {mark["release"]: {"cc_version_text": mark["kernel_compiler"]}}},
        {"machine": mark["machine"], "headers": {mark["release"]: mark["headers"]}},
        {"cc": mark["cc"], "cxx": mark["cxx"] if cxx else None})
    assert inputs is not None, why
    escaped = re.escape(json.dumps(_MARK)[1:-1])
    parts: list[tuple[str, str]] = []
    for n, piece in enumerate(re.split(f"{escaped}([a-z_]+){escaped}", inputs_text(inputs))):
        if piece:
            parts.append(("var" if n % 2 else "text", piece))
    return parts


def _describe(field: str, value) -> str:
    if field in ("cc", "cxx") and value:
        return f"{value[0]} {value[1]!r}"
    return repr(value)


def _differences(mine: dict, theirs: dict, words: dict) -> list[str]:
    return [f for f in words if mine.get(f) != theirs.get(f)]


def _builder(members: list[str], hosts: dict) -> str:
    """The spec's choice (nvidia.share_builder, kernel.share_builder), then most cores, then most memory, then the first name."""
    return min(members, key=lambda h: (not hosts[h].get("preferred"), -(hosts[h].get("cores") or 0),
                                       -(hosts[h].get("mem_total_kib") or 0), h))


def _same_cluster(a: dict, b: dict) -> dict | None:
    """`b`'s node entry in `a`'s view of its cluster when both hosts are nodes of one Proxmox
    cluster (their .members name the same cluster, and `a`'s nodelist has `b`'s node with an
    address): {"node", "ip"}; else None."""
    ma, mb = a.get("members") or {}, b.get("members") or {}
    name = (ma.get("cluster") or {}).get("name")
    if not name or name != (mb.get("cluster") or {}).get("name"):
        return None
    node = mb.get("nodename")
    entry = (ma.get("nodelist") or {}).get(node) if node else None
    if not entry or not entry.get("ip"):
        return None
    return {"node": node, "ip": entry["ip"]}


def what(kind: str, version: str | None, release: str) -> str:
    """How the plan's lines name one build: `nvidia <version> for <release>`, `kernel <release>`."""
    return f"kernel {release}" if kind == "kernel" else f"nvidia {version} for {release}"


def share_plan(hosts: dict[str, dict], kind: str = "nvidia") -> dict[tuple[str, str], dict]:
    """Who builds and who receives each (host, release) of the run, for one `kind` of build
    ("nvidia": the modules of each release; "kernel": the kernel stage's .debs of its release).

    `hosts`: {host name: {"cores", "mem_total_kib", "preferred" (KINDS' spec field), "members"
    (.members, or None), "published":
    {key: [release]}, "builds": {release: {"version", "key": str | None, "inputs": dict | None,
    "why": str | None}}}},
    `builds` holding only the releases the host builds this run (`why`: why its build cannot be
    shared). Returns {(host, release): step} (each with the build's "version" and "what" it is
    called), step one of

    - ``{"role": "build", "key", "for": [receivers], "why": str}``: builds here (and publishes the
      unsigned modules when `key` is set);
    - ``{"role": "receive", "key", "from": host, "via": {"node", "ip"} | None, "why": str}``: copies
      the build of `from` (node to node over the cluster's root SSH trust where `via`, else
      through the controller), verifies and installs it.

    A key some host of the run already published (a build of an earlier run or of its kernel hook,
    kept under facts.build_share.SHARE_ROOT and checked by that fact) is received from that host
    and built nowhere; a keeper that builds nothing itself gets ``{"role": "keep", "key", "for":
    [receivers], "why"}`` (its line says who made the build: `kept` {key: {"built_by"}}).
    """
    steps: dict[tuple[str, str], dict] = {}
    groups: dict[str, list[str]] = {}
    for name in sorted(hosts):
        for release, build in sorted((hosts[name].get("builds") or {}).items()):
            if build.get("key"):
                groups.setdefault(build["key"], []).append(name)
            else:
                steps[(name, release)] = {"role": "build", "key": None, "for": [],
                                          "why": f"builds alone: {build.get('why') or 'its inputs are unknown'}"}
    for key, members in groups.items():
        release = next(r for r, b in hosts[members[0]]["builds"].items() if b.get("key") == key)
        publishers = [h for h in sorted(hosts) if release in (hosts[h].get("published") or {}).get(key, [])]
        if publishers:
            source = _builder(publishers, hosts)
            if source not in members:
                # the keeper builds nothing this run (it has the modules already): say who made its
                # build (the converge, or its kernel hook when apt installed the kernel) and who takes it
                by = ((hosts[source].get("kept") or {}).get(key) or {}).get("built_by")
                made = "built by its kernel hook" if by == "kernel-hook" else "kept from an earlier converge's build"
                steps[(source, release)] = {
                    "role": "keep", "key": key, "for": list(members),
                    "version": hosts[members[0]]["builds"][release].get("version"),
                    "why": f"already has it ({made}; key {key[:12]}): nobody builds; {', '.join(members)} "
                           f"receive{'s' if len(members) == 1 else ''} it"}
            for member in members:
                steps[(member, release)] = {
                    "role": "receive", "key": key, "from": source,
                    "via": None if member == source else _same_cluster(hosts[member], hosts[source]),
                    "why": f"receives the build {source} already keeps for these inputs (key {key[:12]})"}
            continue
        builder = _builder(members, hosts)
        others = [m for m in members if m != builder]
        if others:
            steps[(builder, release)] = {"role": "build", "key": key, "for": others,
                                         "why": f"builds for {', '.join(others)} too ("
                                                + (KINDS[kind]["preferred"]["field"] if hosts[builder].get("preferred") else
                                                   "most cores, then memory, of the hosts with these inputs")
                                                + f"; key {key[:12]})"}
        else:
            steps[(builder, release)] = {"role": "build", "key": key, "for": [],
                                         "why": "builds alone: " + _alone_why(builder, release, key, hosts, kind)}
        for member in others:
            steps[(member, release)] = {"role": "receive", "key": key, "from": builder,
                                        "via": _same_cluster(hosts[member], hosts[builder]),
                                        "why": f"receives the build of {builder} (same inputs, key {key[:12]})"}
    for (name, release), step in steps.items():
        if step["role"] != "keep":
            step["version"] = hosts[name]["builds"][release].get("version")
        step["what"] = what(kind, step["version"], release)
    return steps


def _alone_why(name: str, release: str, key: str, hosts: dict, kind: str = "nvidia") -> str:
    """Why no other host of the run shares `name`'s build for `release`: the inputs that differ from
    those of the other hosts building that release, or that none does."""
    mine = hosts[name]["builds"][release]["inputs"] or {}
    others: dict[str, tuple[dict, list[str]]] = {}
    for other in sorted(hosts):
        build = (hosts[other].get("builds") or {}).get(release)
        if other == name or not build or not build.get("inputs") or build.get("key") == key:
            continue
        inputs = build["inputs"]
        others.setdefault(build["key"], (inputs, []))[1].append(other)
    if not others:
        return f"no other host of this run builds {what(kind, hosts[name]['builds'][release].get('version'), release)}"
    words = KINDS[kind]["words"]
    parts = []
    for inputs, names in others.values():
        diff = _differences(mine, inputs, words)
        parts.append("; ".join(f"its {words[f]} {_describe(f, mine.get(f))} is not "
                               f"{', '.join(names)}'s {_describe(f, inputs.get(f))}" for f in diff))
    return " / ".join(parts)


def distrust_lines(hosts: dict[str, dict], kind: str = "nvidia") -> list[str]:
    """One line per kept build of the run's hosts that is not trusted (facts.build_share parse_kept:
    a changed module or manifest): it is shared with nobody, and the plan goes on without it."""
    lines = []
    for name in sorted(hosts):
        for key, kept in sorted((hosts[name].get("kept") or {}).items()):
            if kept.get("trusted", True) or kept.get("kind", kind) != kind:
                continue
            by = "its kernel hook's" if kept.get("built_by") == "kernel-hook" else "a converge's"
            lines.append(f"{name}: {what(kind, kept.get('version'), kept.get('release') or '?')}: "
                         f"its kept build ({by}, key {key[:12]}) is not trusted: {kept.get('why')}; "
                         f"nobody receives it")
    return lines


def share_lines(steps: dict[tuple[str, str], dict]) -> list[str]:
    """What `--dry` (and a converge) prints about the run's builds, one line per (host, release)."""
    lines = []
    for (name, _release), step in sorted(steps.items()):
        if step["role"] == "receive":
            how = ("from its own copy" if step["from"] == name else
                   f"node to node over the cluster's root SSH trust ({step['via']['node']}, {step['via']['ip']})"
                   if step.get("via") else "through the controller (not one Proxmox cluster)")
            lines.append(f"{name}: {step['what']}: {step['why']}, {how}")
        else:
            lines.append(f"{name}: {step['what']}: {step['why']}")
    return lines
