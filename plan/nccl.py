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

# NCCL_P2P_LEVEL values in increasing distance (NCCL env docs, NCCL_P2P_LEVEL).
NCCL_P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
# nvidia-smi topo level -> NCCL path type. NCCL's PHB means "same NUMA node, through the CPU",
# which covers nvidia-smi's PHB and NODE.
SMI_TO_NCCL_LEVEL = {"PIX": "PIX", "PXB": "PXB", "PHB": "PHB", "NODE": "PHB", "SYS": "SYS"}

NCCL_VARIABLE = re.compile(r"^NCCL_[A-Z0-9_]+$")
TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "nccl.conf.j2"


def nccl_level(smi_level: str | None) -> str | None:
    """nvidia-smi's topology level (``NV18``, ``PIX``, ``NODE``, …) as an NCCL_P2P_LEVEL value."""
    if not smi_level:
        return None
    if smi_level.startswith("NV"):
        return "NVL"
    return SMI_TO_NCCL_LEVEL.get(smi_level)


def _usable(pair: dict) -> bool:
    return pair["possible"] and pair["safe"]


def safe_p2p_cutoff(pairs: list[dict]) -> str | None:
    """The farthest NCCL_P2P_LEVEL at which every GPU pair that close or closer has safe P2P.

    ``None`` when even the closest pairs cannot use P2P (or a pair's level is unknown).
    """
    by_level: dict[str, list[dict]] = {}
    for pair in pairs:
        level = nccl_level(pair["level"])
        if level is None:
            return None
        by_level.setdefault(level, []).append(pair)
    cutoff = None
    for level in NCCL_P2P_LEVELS:
        if level not in by_level:
            continue
        if not all(_usable(p) for p in by_level[level]):
            break
        cutoff = level
    return cutoff


def farthest_level(pairs: list[dict]) -> str | None:
    """The farthest NCCL path type between any two of the GPUs (the real topology's limit)."""
    levels = [nccl_level(p["level"]) for p in pairs]
    known = [lvl for lvl in levels if lvl]
    return max(known, key=NCCL_P2P_LEVELS.index) if known else None


@dataclass(frozen=True)
class NcclRule:
    """One row of the rule table: when ``applies(scope)`` returns a reason, set ``variable``."""

    variable: str
    value: Callable[[dict], str] | str
    applies: Callable[[dict], str | None]
    source: str


def _first_reason(pairs: list[dict], kind: str) -> str | None:
    for pair in pairs:
        for reason_kind, reason in zip(pair["reason_kinds"], pair["reasons"], strict=True):
            if reason_kind == kind:
                return reason
    return None


def _p2p_unsafe(scope: dict) -> str | None:
    """SEV-SNP with a translating IOMMU (or another unsafe reason) on a pair NCCL would use."""
    pairs = scope["pairs"]
    if not pairs or safe_p2p_cutoff(pairs) is not None:
        return None
    unsafe = [p for p in pairs if not p["safe"] and any(k.startswith("sev_snp") for k in p["reason_kinds"])]
    if not unsafe:
        return None
    reason = _first_reason(unsafe, "sev_snp") or _first_reason(unsafe, "sev_snp_identity")
    return f"P2P DMA is unsafe on this host: {reason} (INCIDENTS #7)"


def _p2p_impossible(scope: dict) -> str | None:
    """No pair of GPUs has a safe P2P path NCCL could be limited to."""
    pairs = scope["pairs"]
    if not pairs or safe_p2p_cutoff(pairs) is not None:
        return None
    blocked = [p for p in pairs if not _usable(p)]
    if not blocked:  # every pair usable, only a level unknown: nothing to disable
        return None
    closest = min(blocked, key=lambda p: NCCL_P2P_LEVELS.index(nccl_level(p["level"]) or "SYS"))
    usable = sum(1 for p in pairs if _usable(p))
    return (
        f"no safe P2P path for the closest GPU pairs ({usable} of {len(pairs)} pairs usable), "
        f"e.g. {closest['reasons'][0]}"
    )


def _p2p_cutoff_needed(scope: dict) -> str | None:
    """Some pairs can use P2P, farther ones cannot: stop NCCL's P2P at the last safe level."""
    pairs = scope["pairs"]
    cutoff = safe_p2p_cutoff(pairs) if pairs else None
    if cutoff is None or cutoff == farthest_level(pairs):
        return None
    beyond = [p for p in pairs if NCCL_P2P_LEVELS.index(nccl_level(p["level"])) > NCCL_P2P_LEVELS.index(cutoff)]
    bad = next(p for p in beyond if not _usable(p))
    return f"GPU pairs farther than {cutoff} have no safe P2P path, e.g. {bad['reasons'][0]}"


def _p2p_cutoff_level(scope: dict) -> str:
    """NCCL_P2P_LEVEL's value; its rule applies (`_p2p_cutoff_needed`) only when there is a cutoff."""
    cutoff = safe_p2p_cutoff(scope["pairs"])
    if cutoff is None:
        raise ValueError("pvegpu: NCCL_P2P_LEVEL asked for GPU pairs without a safe P2P cutoff")
    return cutoff


def _no_rdma(scope: dict) -> str | None:
    if scope["rdma_devices"] or scope["topology_nics"]:
        return None
    return "no RDMA devices (/sys/class/infiniband is empty and nvidia-smi topo shows no NIC)"


# The one table of NCCL rules for this collection. First matching row per variable wins, so the
# SEV-SNP row (the stronger reason) comes before the "impossible" row.
NCCL_RULES: list[NcclRule] = [
    NcclRule("NCCL_P2P_DISABLE", "1", _p2p_unsafe, f"{NCCL_ENV_DOCS}#nccl-p2p-disable; {CUDA_IOMMU_DOCS}"),
    NcclRule("NCCL_P2P_DISABLE", "1", _p2p_impossible, f"{NCCL_ENV_DOCS}#nccl-p2p-disable; {NCCL_ACS_DOCS}"),
    NcclRule(
        "NCCL_P2P_LEVEL",
        _p2p_cutoff_level,
        _p2p_cutoff_needed,
        f"{NCCL_ENV_DOCS}#nccl-p2p-level",
    ),
    NcclRule("NCCL_IB_DISABLE", "1", _no_rdma, f"{NCCL_ENV_DOCS}#nccl-ib-disable"),
]


def check_overrides(overrides: dict | None, where: str) -> dict[str, str]:
    """Overrides as ``{NCCL_NAME: "value"}``; refuses what would not be a valid nccl.conf line."""
    checked: dict[str, str] = {}
    for name, value in (overrides or {}).items():
        if not NCCL_VARIABLE.match(str(name)):
            raise ValueError(f"{where}: {name!r} is not an NCCL variable (NCCL_ and capitals, digits, _)")
        text = str(value)
        if "\n" in text or "\r" in text:
            raise ValueError(f"{where}: the value of {name} spans several lines; nccl.conf takes one line")
        checked[name] = text
    return checked


def _override_warning(name: str, value: str, ruled: dict | None, scope: dict) -> str | None:
    pairs = scope["pairs"]
    if name == "NCCL_P2P_DISABLE" and value.strip() in ("0", "") and ruled and ruled["value"] == "1":
        return f"P2P stays on against the facts: {ruled['reason']}"
    if name == "NCCL_P2P_LEVEL" and pairs:
        level = value.strip().upper()
        if level not in NCCL_P2P_LEVELS:
            return f"{value!r} is not an NCCL_P2P_LEVEL name ({', '.join(NCCL_P2P_LEVELS)})"
        limit = safe_p2p_cutoff(pairs) or "LOC"
        if NCCL_P2P_LEVELS.index(level) > NCCL_P2P_LEVELS.index(limit):
            return f"{level} reaches beyond the farthest safe P2P level of this topology ({limit})"
    if name == "NCCL_SHM_DISABLE" and value.strip() == "1" and ruled is None and scope.get("p2p_disabled"):
        return "with P2P disabled, SHM is the only intra-node path; NCCL falls back to the network"
    return None


def nccl_environment(
    verdict: dict,
    *,
    rdma_devices: list[str] | None = None,
    topology_nics: dict | None = None,
    nccl: dict | None = None,
    container: str | None = None,
) -> dict[str, dict]:
    """NCCL variables for one scope (the host, or one container given its GPUs' verdict).

    + verdict: `plan.p2p.p2p_verdict` (or `restrict_verdict` for a container's GPUs)
    + rdma_devices: names under /sys/class/infiniband (``[]`` when none)
    + topology_nics: GpuTopology ``nics``
    + nccl: the spec's NCCL section, ``{"profile": "auto" | "none", "overrides": {NAME: value},
      "containers": {"101": {NAME: value}}}``
    + container: the container id whose overrides apply last

    .. code:: python

        {"NCCL_P2P_DISABLE": {"value": "1", "reason": "P2P DMA is unsafe on this host: …",
                              "source": "rule", "reference": "https://docs.nvidia.com/…"},
         "NCCL_DEBUG": {"value": "WARN", "reason": "set by the spec's NCCL overrides",
                        "source": "override", "replaces": None, "warning": None}}
    """
    nccl = nccl or {}
    profile = nccl.get("profile", "auto")
    if profile not in ("auto", "none"):
        raise ValueError(f"NCCL profile {profile!r} is unknown: use 'auto' or 'none'")
    scope = {
        "pairs": verdict["pairs"],
        "rdma_devices": list(rdma_devices or []),
        "topology_nics": dict(topology_nics or {}),
    }
    env: dict[str, dict] = {}
    if profile == "auto":
        for rule in NCCL_RULES:
            if rule.variable in env:
                continue
            reason = rule.applies(scope)
            if reason:
                value = rule.value(scope) if callable(rule.value) else rule.value
                env[rule.variable] = {"value": value, "reason": reason, "source": "rule", "reference": rule.source}
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
                "warning": _override_warning(name, value, replaced, scope),
            }
    return env


def nccl_plan(
    verdict: dict,
    *,
    containers: dict[str, list[str]] | None = None,
    rdma_devices: list[str] | None = None,
    topology_nics: dict | None = None,
    nccl: dict | None = None,
    host_gpus: list[str] | None = None,
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
    host = nccl_environment(host_verdict, rdma_devices=rdma_devices, topology_nics=topology_nics, nccl=nccl)
    per_container = {
        str(ctid): nccl_environment(
            restrict_verdict(verdict, gpus),
            rdma_devices=rdma_devices,
            topology_nics=topology_nics,
            nccl=nccl,
            container=str(ctid),
        )
        for ctid, gpus in sorted((containers or {}).items())
    }
    return {"host": host, "containers": per_container}


def nccl_plan_for_spec(
    verdict: dict, spec, *, rdma_devices: list[str] | None = None, topology_nics: dict | None = None
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
                     topology_nics=topology_nics, nccl=nccl, host_gpus=host_gpus)


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
        lines.append({"name": name, "value": entry["value"], "comment": comment})
    return lines


@functools.lru_cache(maxsize=4)
def _compiled(text: str):
    """The template compiled once per process (not per host and scope); a changed file is new text."""
    from jinja2 import Environment, StrictUndefined

    return Environment(undefined=StrictUndefined, keep_trailing_newline=True).from_string(text)


def render_nccl_conf(env: dict[str, dict], scope: str = "host") -> str:
    """/etc/nccl.conf for one scope, rendered as pyinfra's files.template renders templates/nccl.conf.j2."""
    return _compiled(TEMPLATE.read_text()).render(nccl_lines=nccl_conf_lines(env), nccl_scope=scope)


def describe_nccl_environment(env: dict[str, dict]) -> list[str]:
    """Lines for `--dry` and the topology report: ``NAME=value  (rule|override) reason``."""
    out = []
    for line, name in zip(nccl_conf_lines(env), sorted(env), strict=True):
        warning = env[name].get("warning")
        out.append(f"{name}={line['value']}  — {line['comment']}" + (f"  WARNING: {warning}" if warning else ""))
    return out
