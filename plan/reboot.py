"""Why a host needs a reboot: stages report reasons here; one place decides.

Stages call `need_reboot(host, "cmdline", "booted lacks amd_iommu=on")` while their operations
are generated (from facts, before anything runs). The reboot stage (last) reads
`reboot_reasons(host)`: it reboots once when the spec allows it, else prints a
"reboot pending" summary.
"""

from __future__ import annotations

from typing import Any

_KEY = "_pvegpu_reboot_reasons"


def need_reboot(host: Any, kind: str, detail: str) -> None:
    # host.data hands out copies: read, extend, assign back
    reasons = list(host.data.get(_KEY) or [])
    if (kind, detail) not in reasons:
        reasons.append((kind, detail))
    setattr(host.data, _KEY, reasons)


def reboot_reasons(host: Any) -> list[tuple[str, str]]:
    return list(host.data.get(_KEY) or [])


def pending_summary(name: str, reasons: list[tuple[str, str]]) -> list[str]:
    if not reasons:
        return [f"{name}: no reboot pending"]
    return [f"{name}: reboot pending ({len(reasons)} reason(s)):"] + [f"  - {k}: {d}" for k, d in reasons]
