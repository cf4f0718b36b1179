"""What a pending reboot looks like to the user (pure).

Stages report reasons with `facts.run_state.need_reboot("cmdline", "booted lacks amd_iommu=on")`
while their operations are generated (from facts, before anything runs); the reboot stage
(last) reads `facts.run_state.reboot_reasons()`: it reboots once when the spec allows it, else
prints this "reboot pending" summary.
"""

from __future__ import annotations


def pending_summary(name: str, reasons: list[tuple[str, str]]) -> list[str]:
    if not reasons:
        return [f"{name}: no reboot pending"]
    return [f"{name}: reboot pending ({len(reasons)} reason(s)):"] + [f"  - {k}: {d}" for k, d in reasons]
