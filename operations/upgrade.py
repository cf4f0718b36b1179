"""The 8 -> 9 upgrade check (plan/upgrade.py): when the spec says `proxmox_ve: 9` and the host
still runs Proxmox VE 8, the run (and --dry) lists what pve8to9 would warn about that pvegpu
causes or can fix, each with its fix. Read-only: it yields no operation. The converge after the
distribution upgrade then rebuilds what the new kernel needs (the NVIDIA stage's toolchain guard
takes 9's GCC 14 from the kernel's CONFIG_CC_VERSION_TEXT) and the host checks prove it.
"""

from __future__ import annotations

from facts.once import fact_once
from facts.proxmox import LxcConfigs, PveVersion
from facts.upgrade import UpgradeState
from plan.upgrade import upgrade_findings
from spec.models import HostSpec


def prefetch(spec: HostSpec) -> list:
    """The facts the check reads (in deploy.py's first batched command); none without proxmox_ve: 9."""
    return [(UpgradeState, {}), (PveVersion, {}), (LxcConfigs, {})] if spec.proxmox_ve == 9 else []


def report(spec: HostSpec) -> list[str]:
    """Lines for the run's output: empty unless the spec says 9 and the host runs 8."""
    if spec.proxmox_ve != 9:
        return []
    pve = fact_once(PveVersion)
    if not pve or pve["major"] != 8:
        return []
    # the raw lxc.* lines of each CT's main section (LxcConfigs keeps them in file order)
    raw = {ctid: "".join(f"{k}: {v}\n" for k, v in conf.get("lxc", []))
           for ctid, conf in (fact_once(LxcConfigs) or {}).items()}
    findings = upgrade_findings(fact_once(UpgradeState), raw, spec.nvidia.version if spec.nvidia else None)
    head = (f"upgrade check: the spec says Proxmox VE 9 (proxmox_ve: 9) and this host runs {pve['version']}; "
            "before the upgrade (pve8to9 --full checks more):")
    return [head] + [f"  - {f}" for f in findings]
