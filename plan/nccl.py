"""NCCL environment from the P2P verdict, RDMA devices and the spec: every variable with a reason.

Precedence, lowest first: the rule table below (profile ``auto``), the spec's host overrides, a
container's own overrides. Overrides always win and are marked ``"source": "override"``; where an
override contradicts what the facts say (P2P on where it is unsafe, a P2P level beyond the real
topology), the entry carries a ``warning``.

Deliberately not in the table: ``NCCL_PROTO``, ``NCCL_ALGO``, ``NCCL_MIN_NCHANNELS`` and other
tuning knobs. NCCL's documentation files them under "Debugging" ("should not be used in production
nor retained in scripts"); a user who measured a gain on their box sets them as overrides, where
they are visible and attributed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from plan.p2p import restrict_verdict

NCCL_ENV_DOCS = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"
NCCL_ACS_DOCS = (
    "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting.html"
    "#pci-access-control-services-acs"
)
CUDA_IOMMU_DOCS = (
    "https://docs.nvidia.com/cuda/cuda-programming-guide/03-advanced/multi-gpu-systems.html"
    "#host-iommu-hardware-pci-access-control-services-and-vms"
)

# NCCL's path types in increasing distance, as NCCL_P2P_LEVEL names them: src/graph/topo.cc
# topoPathTypeStr up to SYS (2.30.7: LOC NVL NVB C2C PIX PXB P2C PXN PHB SYS; C2C came in 2.26,
# P2C in 2.27). src/graph/paths.cc ncclGetLevel() compares the value with strcmp (case and
# spaces count), else reads a leading digit as the old numbering 0-5 (LOC PIX PXB PHB SYS SYS);
# anything else is ignored without a word.
NCCL_P2P_LEVELS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "P2C", "PXN", "PHB", "SYS")
NCCL_OLD_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "SYS")
# nvidia-smi topo level -> NCCL path type. NCCL's PHB means "same NUMA node, through the CPU",
# which covers nvidia-smi's PHB and NODE; SOC is older drivers' SYS.
SMI_TO_NCCL_LEVEL = {"PIX": "PIX", "PXB": "PXB", "PHB": "PHB", "NODE": "PHB", "SYS": "SYS", "SOC": "SYS"}
# NCCL's own default P2P level (paths.cc ncclTopoCheckP2p): SYS up to 2.22, PXB from 2.23, and
# SYS again on x86 AMD hosts with at most 2 GPUs.
NCCL_DEFAULT_LEVEL_SINCE_2_23 = "PXB"

# Reasons NCCL cannot see for itself: it drops every pair whose NVML P2P read/write status is not
# OK (paths.cc ncclTopoCheckP2p) and every pair beyond its level, but the driver answers OK
# through a translating IOMMU under SEV-SNP (INCIDENTS #7) and past ACS redirect.
# A GeForce pair on a P2P-patched driver without its static BAR1 mapping answers OK too, and so
# does a VM's pair across virtual root ports in one GPUDirect clique (issue 43): NCCL trusts the
# driver's answer (src/graph/paths.cc p2pCanConnect -> ncclTopoCheckP2p, NVML P2P status).
HIDDEN_REASON_KINDS = ("sev_snp", "sev_snp_identity", "iommu", "acs", "static_bar1", "vm_clique")
# Reasons that keep NCCL off a pair by themselves (the driver refuses, or a GPU is not the host's).
# Not "root_complex": with a translating IOMMU the verdict says so even where the driver answers OK.
NCCL_SEES_KINDS = ("driver", "role", "virtual_root_port")

# What still moves data GPU to GPU with NCCL's P2P transport closed, and each one's own switch.
OTHER_P2P_PATHS = (
    "vLLM's and SGLang's custom allreduce (CUDA IPC, enabled after their own P2P test; they read no "
    "NCCL variable): start them with --disable-custom-all-reduce"
)

NCCL_VARIABLE = re.compile(r"^NCCL_[A-Z0-9_]+$")
TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "nccl.conf.j2"


def nccl_level(smi_level: str | None) -> str | None:
    """nvidia-smi's topology level (``NV18``, ``PIX``, ``NODE``, ``SOC``, …) as an NCCL path type."""
    if not smi_level:
        return None
    if smi_level.startswith("NV"):
        return "NVL"
    return SMI_TO_NCCL_LEVEL.get(smi_level)


def nccl_level_value(value: str) -> str | None:
    """The level NCCL makes of an NCCL_P2P_LEVEL value (paths.cc ncclGetLevel), None when it
    ignores it (a name in other case, spaces, an unknown word)."""
    if value in NCCL_P2P_LEVELS:
        return value
    match = re.match(r"^(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", value)
    if value[:1].isdigit() and match:
        return NCCL_OLD_LEVELS[min(int(match.group(1), 0), len(NCCL_OLD_LEVELS) - 1)]
    return None


def nccl_default_level(version: str | None, cpu_vendor: str | None, gpus: int) -> str | None:
    """NCCL's own P2P level for this version, CPU and GPU count; None when the version is unknown."""
    if not version:
        return None
    parts = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if parts < (2, 23):
        return "SYS"
    if (cpu_vendor or "").lower() in ("authenticamd", "amd") and gpus <= 2:
        return "SYS"
    return NCCL_DEFAULT_LEVEL_SINCE_2_23


def _usable(pair: dict) -> bool:
    return bool(pair["possible"] and pair["safe"])


def _nccl_refuses(pair: dict) -> bool:
    """NCCL keeps off this pair by itself: the driver refuses it (or a GPU is not the host's)."""
    refused = [code for code in (pair.get("driver_read"), pair.get("driver_write")) if code and code != "OK"]
    return bool(refused) or any(kind in NCCL_SEES_KINDS for kind in pair["reason_kinds"])


def at_risk(pair: dict) -> bool:
    """NCCL (or its symmetric memory) may do P2P DMA on this pair, which is impossible or unsafe
    for a reason NCCL cannot see."""
    hidden = any(kind in HIDDEN_REASON_KINDS for kind in pair["reason_kinds"])
    return hidden and not _nccl_refuses(pair)


def safe_p2p_cutoff(pairs: list[dict]) -> str | None:
    """The farthest NCCL level at which no GPU pair that close or closer is at risk (`at_risk`).

    ``None`` when even the closest pairs are at risk, or an at-risk pair's level is unknown.
    """
    risky = [p for p in pairs if at_risk(p)]
    levels = [nccl_level(p["level"]) for p in risky]
    if any(level is None for level in levels):
        return None
    if not risky:
        return "SYS"
    nearest = min(NCCL_P2P_LEVELS.index(level) for level in levels if level)
    known = [NCCL_P2P_LEVELS.index(lvl) for p in pairs if (lvl := nccl_level(p["level"]))]
    below = [i for i in known if i < nearest]
    return NCCL_P2P_LEVELS[max(below)] if below else None


@dataclass(frozen=True)
class NcclRule:
    """One row of the rule table: when ``applies(scope)`` returns a reason, set ``variable``."""

    variable: str
    value: Callable[[dict], str] | str
    applies: Callable[[dict], str | None]
    source: str


def _first_reason(pairs: list[dict], kinds: tuple[str, ...]) -> str | None:
    for kind in kinds:
        for pair in pairs:
            for reason_kind, reason in zip(pair["reason_kinds"], pair["reasons"], strict=True):
                if reason_kind == kind:
                    return reason
    return None


def _risky(scope: dict) -> list[dict]:
    return [p for p in scope["pairs"] if at_risk(p)]


def _unknown_note(pairs: list[dict]) -> str:
    """Said where a decision rests on a pair whose driver answer is missing."""
    if any(p.get("driver_read") is None for p in pairs):
        return (" [derived from an unknown driver answer (no nvidia-smi topo -p2p yet): the host check "
                "after the driver is installed settles it]")
    return ""


def _p2p_must_stop(scope: dict) -> str | None:
    """Even the closest GPU pairs NCCL would use are at risk: close NCCL's P2P transport."""
    risky = _risky(scope)
    if not risky or safe_p2p_cutoff(scope["pairs"]) is not None:
        return None
    reason = _first_reason(risky, HIDDEN_REASON_KINDS)
    prefix = "P2P DMA is unsafe on this host" if any(
        k.startswith("sev_snp") for p in risky for k in p["reason_kinds"]) else "P2P DMA must not happen"
    incident = " (INCIDENTS #7)" if "SEV-SNP" in (reason or "") else ""
    return f"{prefix}: {reason}{incident}; the driver would still let NCCL use it" + _unknown_note(risky)


def _level_needed(scope: dict) -> str | None:
    """Close pairs are fine, farther ones at risk: stop NCCL's P2P before them, where NCCL's own
    default level would not already (writing a level replaces NCCL's default, paths.cc)."""
    risky = _risky(scope)
    cutoff = safe_p2p_cutoff(scope["pairs"]) if risky else None
    if cutoff is None:
        return None
    default = scope.get("default_level")
    if default is not None and NCCL_P2P_LEVELS.index(default) <= NCCL_P2P_LEVELS.index(cutoff):
        return None
    bad = risky[0]
    reason = next(r for k, r in zip(bad["reason_kinds"], bad["reasons"], strict=True) if k in HIDDEN_REASON_KINDS)
    why = ("NCCL's own default level reaches them" if default
           else "the NCCL version is unknown and its default reaches them up to 2.22 (SYS)")
    return f"GPU pairs farther than {_p2p_cutoff_level(scope)} are at risk, e.g. {reason}; {why}" + _unknown_note(risky)


def _p2p_cutoff_level(scope: dict) -> str:
    """NCCL_P2P_LEVEL's value: the last safe level; with the NCCL version unknown no farther than
    PXB, NCCL's default since 2.23, so a newer NCCL is never sent further than it would go."""
    cutoff = safe_p2p_cutoff(scope["pairs"])
    if cutoff is None:
        raise ValueError("pvegpu: NCCL_P2P_LEVEL asked for GPU pairs without a safe P2P cutoff")
    if scope.get("default_level") is None:
        cap = NCCL_DEFAULT_LEVEL_SINCE_2_23
        return min(cutoff, cap, key=NCCL_P2P_LEVELS.index)
    return cutoff


def _symmetric_memory(scope: dict) -> str | None:
    """NCCL >= 2.27's symmetric memory uses every pair CUDA can reach, whatever NCCL_P2P_LEVEL or
    NCCL_P2P_DISABLE say (transport.cc ncclTransportCheckP2pType isAllCudaP2p; init.cc WIN_ENABLE)."""
    risky = _risky(scope)
    if not risky:
        return None
    return ("NCCL's symmetric memory (2.27+) does P2P DMA on every pair the driver allows, whatever "
            "NCCL_P2P_LEVEL/NCCL_P2P_DISABLE say; at risk: " + (_first_reason(risky, HIDDEN_REASON_KINDS) or "")
            + _unknown_note(risky))


# The one table of NCCL rules for this collection. First matching row per variable wins.
# NCCL_IB_DISABLE is not here: without RDMA devices NCCL falls back to sockets by itself.
NCCL_RULES: list[NcclRule] = [
    NcclRule("NCCL_P2P_DISABLE", "1", _p2p_must_stop, f"{NCCL_ENV_DOCS}#nccl-p2p-disable; {CUDA_IOMMU_DOCS}"),
    NcclRule("NCCL_P2P_LEVEL", _p2p_cutoff_level, _level_needed, f"{NCCL_ENV_DOCS}#nccl-p2p-level; {NCCL_ACS_DOCS}"),
    NcclRule("NCCL_WIN_ENABLE", "0", _symmetric_memory, f"{NCCL_ENV_DOCS}#nccl-win-enable"),
]


def override_problem(name: str, value: str) -> str | None:
    """Why NCCL would not read ``name=value`` as written, or None (also the spec's check).

    NCCL reads nccl.conf lines verbatim (src/misc/param.cc setEnvFile: the name up to the first
    ``=``, the rest as the value, quotes and spaces included, cut at 1023 characters) and
    compares level names case-sensitively (paths.cc ncclGetLevel)."""
    if not NCCL_VARIABLE.match(str(name)):
        return f"{name!r} is not an NCCL variable (NCCL_ and capitals, digits, _)"
    if "\n" in value or "\r" in value:
        return f"the value of {name} spans several lines; nccl.conf takes one line"
    if value != value.strip() or (len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'"):
        return (f"the value of {name} is {value!r}: NCCL takes nccl.conf values verbatim, so surrounding "
                "spaces or quotes become part of it; write it bare")
    if name in ("NCCL_P2P_LEVEL", "NCCL_SHM_LEVEL", "NCCL_NET_GDR_LEVEL") and nccl_level_value(value) is None:
        hint = f" (NCCL compares names case-sensitively: {value.upper()})" if value.upper() in NCCL_P2P_LEVELS else ""
        return (f"{name}={value!r} is no level NCCL knows, so it would ignore it{hint}; "
                f"use one of {', '.join(NCCL_P2P_LEVELS)} or 0-5")
    return None


def check_overrides(overrides: dict | None, where: str) -> dict[str, str]:
    """Overrides as ``{NCCL_NAME: "value"}``; refuses what NCCL would not read as written
    (`override_problem`)."""
    checked: dict[str, str] = {}
    for name, value in (overrides or {}).items():
        text = str(value)
        problem = override_problem(str(name), text)
        if problem:
            raise ValueError(f"{where}: {problem}")
        checked[name] = text
    return checked


def _override_warning(name: str, value: str, ruled: dict | None, scope: dict, env: dict) -> str | None:
    pairs = scope["pairs"]
    if name == "NCCL_P2P_DISABLE" and value in ("0", "") and ruled and ruled["value"] == "1":
        return f"P2P stays on against the facts: {ruled['reason']}"
    if name == "NCCL_WIN_ENABLE" and value != "0" and ruled and ruled["value"] == "0":
        return f"symmetric memory stays on against the facts: {ruled['reason']}"
    if name == "NCCL_P2P_LEVEL":
        disable = (env.get("NCCL_P2P_DISABLE") or {}).get("value")
        if disable is not None and _strtol(disable) == 1:
            return "has no effect: NCCL_P2P_DISABLE=1 sets the level to LOC before NCCL_P2P_LEVEL is read (paths.cc ncclGetLevel)"
        level = nccl_level_value(value)
        limit = safe_p2p_cutoff(pairs) if pairs else None
        if level and pairs and _risky(scope):
            limit = limit or "LOC"
            if NCCL_P2P_LEVELS.index(level) > NCCL_P2P_LEVELS.index(limit):
                return f"{level} reaches beyond the farthest safe P2P level of this topology ({limit})"
    if name == "NCCL_PROTO" and not scope.get("nvlink") and _ll128_on(value):
        return "LL128 on a PCIe-only host: NCCL keeps it off there by default because it can corrupt data without NVLink"
    if name == "NCCL_IGNORE_DISABLED_P2P" and _strtol(value) == 2:
        return "2 turns off NCCL's check of the driver's P2P status (paths.cc): pairs the driver refuses are tried anyway"
    if name == "NCCL_SHM_DISABLE" and value == "1" and ruled is None and scope.get("p2p_disabled"):
        return "with P2P disabled, SHM is the only intra-node path; NCCL falls back to the network"
    return None


def _strtol(text: str) -> int | None:
    match = re.match(r"^\s*([+-]?(?:0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*))", text)
    return int(match.group(1), 0) if match else None


def _ll128_on(value: str) -> bool:
    """NCCL_PROTO forces LL128 on for some function: src/graph/tuning.cc parseList() reads
    ``[func:]list;func:list`` (names case-insensitive); a list sets its protocols to 1 and the
    others to 0, a ``^list`` the reverse. 1 is "on" even where NCCL's own default (2) keeps LL128
    to NVLink (ncclTopoTuneModel)."""
    for token in value.split(";"):
        elems = token.split(":", 1)[-1]
        negated = elems.startswith("^")
        items = [item.strip().lower() for item in elems.lstrip("^").split(",")]
        if ("ll128" in items) != negated:
            return True
    return False


def nccl_environment(
    verdict: dict,
    *,
    rdma_devices: list[str] | None = None,
    topology_nics: dict | None = None,
    nccl: dict | None = None,
    container: str | None = None,
    nccl_version: str | None = None,
    cpu_vendor: str | None = None,
) -> dict[str, dict]:
    """NCCL variables for one scope (the host, or one container given its GPUs' verdict).

    + verdict: `plan.p2p.p2p_verdict` (or `restrict_verdict` for a container's GPUs)
    + rdma_devices, topology_nics: kept for the callers; no rule reads them any more (NCCL
      falls back to sockets without RDMA devices by itself)
    + nccl: the spec's NCCL section, ``{"profile": "auto" | "none", "overrides": {NAME: value},
      "containers": {"101": {NAME: value}}}``
    + container: the container id whose overrides apply last
    + nccl_version, cpu_vendor: for NCCL's own default level (`nccl_default_level`); unknown
      version: levels are capped at PXB, NCCL's default since 2.23

    .. code:: python

        {"NCCL_P2P_DISABLE": {"value": "1", "reason": "P2P DMA is unsafe on this host: …",
                              "source": "rule", "reference": "https://docs.nvidia.com/…",
                              "unknown": False, "remains": "vLLM's and SGLang's custom allreduce …"},
         "NCCL_DEBUG": {"value": "WARN", "reason": "set by the spec's NCCL overrides",
                        "source": "override", "replaces": None, "warning": None}}
    """
    del rdma_devices, topology_nics
    nccl = nccl or {}
    profile = nccl.get("profile", "auto")
    if profile not in ("auto", "none"):
        raise ValueError(f"NCCL profile {profile!r} is unknown: use 'auto' or 'none'")
    pairs = verdict["pairs"]
    gpus = len({p["a"] for p in pairs} | {p["b"] for p in pairs})
    scope = {
        "pairs": pairs,
        "default_level": nccl_default_level(nccl_version, cpu_vendor, gpus),
        "nvlink": any((p["level"] or "").startswith("NV") for p in pairs),
    }
    env: dict[str, dict] = {}
    if profile == "auto":
        for rule in NCCL_RULES:
            if rule.variable in env:
                continue
            reason = rule.applies(scope)
            if reason:
                value = rule.value(scope) if callable(rule.value) else rule.value
                env[rule.variable] = {"value": value, "reason": reason, "source": "rule", "reference": rule.source,
                                      "unknown": "unknown driver answer" in reason,
                                      "remains": OTHER_P2P_PATHS if rule.variable in ("NCCL_P2P_DISABLE", "NCCL_WIN_ENABLE")
                                      else None}
    scope["p2p_disabled"] = env.get("NCCL_P2P_DISABLE", {}).get("value") == "1"

    layers = [("the spec's NCCL overrides", check_overrides(nccl.get("overrides"), "nccl.overrides"))]
    if container is not None:
        per_container = (nccl.get("containers") or {}).get(str(container))
        layers.append((
            f"the spec's NCCL overrides for container {container}",
            check_overrides(per_container, f"nccl.containers.{container}"),
        ))
    for where, overrides in layers:
        for name, value in overrides.items():
            ruled = env.get(name)
            replaced = ruled if ruled and ruled["source"] == "rule" else (ruled or {}).get("replaces")
            env[name] = {
                "value": value,
                "reason": f"set by {where}",
                "source": "override",
                "replaces": replaced,
                "warning": None,
            }
    for name, entry in env.items():
        if entry["source"] == "override":
            entry["warning"] = _override_warning(name, entry["value"], entry["replaces"], scope, env)
    return env


def nccl_plan(
    verdict: dict,
    *,
    containers: dict[str, list[str]] | None = None,
    rdma_devices: list[str] | None = None,
    topology_nics: dict | None = None,
    nccl: dict | None = None,
    host_gpus: list[str] | None = None,
    nccl_version: str | None = None,
    cpu_vendor: str | None = None,
    container_versions: dict[str, str | None] | None = None,
) -> dict:
    """NCCL variables for the host and for each GPU container.

    + containers: ``{"101": ["0000:01:00.0", "0000:41:00.0"]}`` — each container's GPUs by BDF;
      a container sees the bare-metal topology, restricted to its own GPUs
    + host_gpus: the GPUs host processes can use (roles on the nvidia driver); None = all.
      GPUs passed to VMs are not the host's, so pairs with them decide nothing for its NCCL
      (and the host's file stays the same before and after the reboot that moves them)

    Returns ``{"host": {NAME: entry}, "containers": {"101": {NAME: entry}}}``.
    """
    host_verdict = verdict if host_gpus is None else restrict_verdict(verdict, host_gpus)
    host = nccl_environment(host_verdict, rdma_devices=rdma_devices, topology_nics=topology_nics, nccl=nccl,
                            nccl_version=nccl_version, cpu_vendor=cpu_vendor)
    per_container = {
        str(ctid): nccl_environment(
            restrict_verdict(verdict, gpus),
            rdma_devices=rdma_devices,
            topology_nics=topology_nics,
            nccl=nccl,
            container=str(ctid),
            nccl_version=(container_versions or {}).get(str(ctid)),
            cpu_vendor=cpu_vendor,
        )
        for ctid, gpus in sorted((containers or {}).items())
    }
    return {"host": host, "containers": per_container}


def nccl_plan_for_spec(
    verdict: dict, spec, *, rdma_devices: list[str] | None = None, topology_nics: dict | None = None,
    nccl_version: str | None = None, cpu_vendor: str | None = None,
    container_versions: dict[str, str | None] | None = None,
) -> dict:
    """`nccl_plan` for a validated HostSpec: its ``nccl`` section and each container's GPUs and
    ``nccl`` overrides (containers without GPUs get no NCCL file)."""
    containers = {str(ctid): list(ct.gpus) for ctid, ct in spec.containers.items() if ct.gpus}
    nccl = {
        "profile": spec.nccl.profile,
        "overrides": dict(spec.nccl.overrides),
        "containers": {str(ctid): dict(ct.nccl) for ctid, ct in spec.containers.items()},
    }
    host_gpus = [bdf for bdf, gpu in spec.gpus.items() if gpu.driver == "nvidia"] if spec.gpus else None
    return nccl_plan(verdict, containers=containers, rdma_devices=rdma_devices,
                     topology_nics=topology_nics, nccl=nccl, host_gpus=host_gpus,
                     nccl_version=nccl_version, cpu_vendor=cpu_vendor, container_versions=container_versions)


def conf_comment(text: str) -> str:
    """One comment line's text: one line, and no ``=``. NCCL before 2.26 does not skip ``#``
    lines (src/misc/param.cc setEnvFile): any line with an ``=`` sets a variable named by what
    stands before it, so a comment must not hold one."""
    return " ".join(str(text).split()).replace("=", " is ")


def nccl_conf_lines(env: dict[str, dict]) -> list[dict]:
    """The entries in file order (by name), each with a one-line comment: what nccl.conf.j2 renders."""
    lines = []
    for name in sorted(env):
        entry = env[name]
        comment = " ".join(str(entry["reason"]).split())
        if entry["source"] == "override":
            comment = f"[override] {comment}"
            if entry.get("replaces"):
                comment += f"; the rule would set {entry['replaces']['value']}: " + " ".join(
                    str(entry["replaces"]["reason"]).split()
                )
        if entry.get("unknown"):
            comment = f"[from unknown] {comment}"
        if entry.get("remains"):
            comment += f"; still doing GPU-to-GPU DMA: {entry['remains']}"
        lines.append({"name": name, "value": entry["value"], "comment": comment,
                      "conf_comment": conf_comment(comment)})
    return lines


@functools.lru_cache(maxsize=4)
def _compiled(text: str):
    """The template compiled once per process (not per host and scope); a changed file is new text."""
    from jinja2 import Environment, StrictUndefined

    return Environment(undefined=StrictUndefined, keep_trailing_newline=True).from_string(text)


def render_nccl_conf(env: dict[str, dict], scope: str = "host") -> str:
    """/etc/nccl.conf for one scope, rendered as pyinfra's files.template renders templates/nccl.conf.j2."""
    text = _compiled(TEMPLATE.read_text()).render(nccl_lines=nccl_conf_lines(env), nccl_scope=scope)
    # NCCL < 2.26 reads a '#' line with an '=' as a variable (param.cc setEnvFile): never write one
    bad = [line for line in text.splitlines() if line.startswith("#") and "=" in line]
    if bad:
        raise ValueError(f"pvegpu: an nccl.conf comment would be read as a variable by NCCL < 2.26: {bad[0]!r}")
    return text


# Where the values take effect, said wherever they are listed (--dry, the report, the summary).
PRECEDENCE = (
    "precedence: what a process sets itself, then systemd EnvironmentFile=, then the pvegpu drop-in "
    "(beats the unit's Environment= and override.conf), then NCCL_CONF_FILE or ~/.nccl.conf, then "
    "/etc/nccl.conf (NCCL never overwrites a variable already set); read once at NCCL's init, so "
    "running services keep the old values until restarted"
)


def describe_nccl_environment(env: dict[str, dict]) -> list[str]:
    """Lines for `--dry` and the topology report: ``NAME=value  — (rule|override) reason``."""
    out = []
    for line, name in zip(nccl_conf_lines(env), sorted(env), strict=True):
        warning = env[name].get("warning")
        out.append(f"{name}={line['value']}  — {line['comment']}" + (f"  WARNING: {warning}" if warning else ""))
    return out


def opt_in_note(verdict: dict, env: dict[str, dict]) -> str | None:
    """Where P2P is possible and safe across the CPU (nvidia-smi PHB/NODE/SYS) and NCCL's own
    default (PXB since 2.23, paths.cc) still keeps it off there: the opt-in to measure."""
    if "NCCL_P2P_LEVEL" in env or "NCCL_P2P_DISABLE" in env:
        return None
    far = [p for p in verdict["pairs"] if _usable(p) and nccl_level(p["level"]) in ("PHB", "SYS")]
    if not far:
        return None
    return (f"{len(far)} of {len(verdict['pairs'])} GPU pairs have safe P2P through the CPU "
            f"({', '.join(sorted({p['level'] for p in far}))}), where NCCL 2.23+ keeps P2P off by default "
            "(beyond PXB; on AMD hosts with at most 2 GPUs it allows SYS): NCCL_P2P_LEVEL=SYS in nccl.overrides "
            "is an opt-in to measure")


# What one SHM connection maps in /dev/shm (src/transport/shm.cc shmSendSetup/shmRecvSetup: one
# buffer per protocol; src/init.cc defaults: LL 8 lines x 512 threads x 8 steps x 16 bytes, LL128
# 120 x 640 x 8 x 8 bytes, Simple 4 MiB) - about 9.2 MiB, charged to the container's memory.
NCCL_SHM_CONNECTION_BYTES = 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8 + (1 << 22)
# A floor, not an estimate: one ring over the GPUs (one connection per edge) on 2 channels.
NCCL_SHM_FLOOR_CHANNELS = 2


def shm_floor_bytes(gpus: int) -> int:
    """The least /dev/shm NCCL's SHM transport takes for one job over `gpus` GPUs without P2P."""
    return gpus * NCCL_SHM_FLOOR_CHANNELS * NCCL_SHM_CONNECTION_BYTES if gpus >= 2 else 0


def shm_problem(where: str, df_lines: list[str], gpus: int) -> str | None:
    """A sentence when `df -Pk /dev/shm` output (inside a container) shows no /dev/shm mount or
    one smaller than `shm_floor_bytes`; None when it holds what NCCL needs."""
    need = shm_floor_bytes(gpus)
    if not need:
        return None
    rows = [line.split() for line in df_lines[1:] if line.strip()]
    row = next((r for r in rows if len(r) >= 6 and r[5] == "/dev/shm"), None)
    mib = need / (1 << 20)
    if row is None:
        return (f"{where} has no /dev/shm mount: NCCL's SHM transport (its path between GPUs without P2P) "
                f"needs at least {mib:.0f} MiB there for {gpus} GPUs and fails its init without it")
    size = int(row[1]) * 1024 if row[1].isdigit() else 0
    if size < need:
        return (f"{where}'s /dev/shm holds {size / (1 << 20):.0f} MiB; NCCL's SHM transport needs at least "
                f"{mib:.0f} MiB for {gpus} GPUs ({NCCL_SHM_CONNECTION_BYTES / (1 << 20):.1f} MiB per connection, "
                f"one ring on {NCCL_SHM_FLOOR_CHANNELS} channels)")
    return None


def custom_allreduce_warnings(env: dict[str, dict], exec_start: dict[str, list[str]]) -> list[str]:
    """Services of the spec that run vLLM or SGLang with their custom allreduce on while the
    rules stop P2P DMA: that path reads no NCCL variable (`OTHER_P2P_PATHS`); their own switch is
    --disable-custom-all-reduce (vLLM engine argument, SGLang server argument)."""
    stop = any(entry["source"] == "rule" and entry.get("remains") for entry in env.values())
    if not stop:
        return []
    out = []
    for unit, lines in sorted(exec_start.items()):
        text = " ".join(lines)
        program = "vLLM" if "vllm" in text.lower() else "SGLang" if "sglang" in text.lower() else None
        if program and "--disable-custom-all-reduce" not in text:
            out.append(f"{unit} runs {program} with its custom allreduce on: its GPU-to-GPU DMA ignores the NCCL "
                       "variables; add --disable-custom-all-reduce to its ExecStart")
    return out


# QEMU's vfio-pci property for NVIDIA's GPUDirect clique (hw/vfio/pci-quirks.c qdev_prop_nv_gpudirect_clique,
# 0-15); qemu-server has no hostpci option for it (src/PVE/QemuServer/PCI.pm print_hostpci_devices), so
# a VM config sets it in `args:`, as `-set device.hostpciN.x-nv-gpudirect-clique=M` (the id qemu-server
# gives hostpciN) or inside a `-device vfio-pci,...` of its own.
_CLIQUE_SET = re.compile(r"-set\s+device\.([^\s=]+?)\.x-nv-gpudirect-clique=(\d+)")
_CLIQUE_DEVICE = re.compile(r"-device\s+(\S*x-nv-gpudirect-clique=(\d+)\S*)")


def vm_clique_warnings(qemu_configs: dict | None) -> list[str]:
    """VMs on this node whose `args` put two or more devices in one GPUDirect clique: inside such a
    guest the NVIDIA driver answers P2P OK across QEMU's virtual root ports (open-gpu-kernel-modules
    p2p_caps.c: the hypervisor's clique short-cuts the chipset check), NCCL follows that answer
    (paths.cc ncclTopoCheckP2p) and hung at its first collective until NCCL_P2P_DISABLE=1 (issue 43).
    pvegpu writes no file inside a VM, so the operator is told what to set there.

    + qemu_configs: QemuConfigs (``{vmid: {"options": {"args": "…"}, …}}``)
    """
    out = []
    for vmid, conf in sorted((qemu_configs or {}).items(), key=lambda item: int(item[0])):
        args = str((conf.get("options") or {}).get("args") or "")
        members: dict[int, list[str]] = {}
        for device, clique in _CLIQUE_SET.findall(args):
            members.setdefault(int(clique), []).append(device)
        for text, clique in _CLIQUE_DEVICE.findall(args):
            ident = re.search(r"(?:^|,)id=([^,]+)", text)
            members.setdefault(int(clique), []).append(ident.group(1) if ident else "a -device of args")
        for clique, devices in sorted(members.items()):
            if len(devices) < 2:
                continue
            out.append(
                f"VM {vmid}: its args put {', '.join(devices)} in GPUDirect clique {clique} (x-nv-gpudirect-clique): "
                "inside the VM the NVIDIA driver answers P2P OK across QEMU's virtual root ports, where NCCL used "
                "P2P and hung at its first collective; pvegpu writes no NCCL file inside a VM: set "
                "NCCL_P2P_DISABLE=1 in the guest (its /etc/nccl.conf or the services' environment), or drop the "
                "clique from args")
    return out


def unseen_gpus(drivers: dict[str, str | None], nvidia_gpus: dict | None) -> list[str]:
    """The GPUs the spec puts on the nvidia driver (`drivers`: BDF -> the driver its role binds)
    that nvidia-smi did not list this run (no driver yet: a kernel whose nvidia.ko this run builds,
    a reboot pending). A plan made without them misses their pairs and what those call for."""
    listed = set(nvidia_gpus or {})
    return sorted(bdf for bdf, driver in drivers.items() if driver == "nvidia" and bdf not in listed)
