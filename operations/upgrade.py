"""The host's release and the 8 -> 9 upgrade check (plan/releases.py, plan/upgrade.py).

preflight: the host's Debian release (/etc/os-release) and Proxmox VE major (pve-manager's
version) are read every run that names a kernel or `proxmox_ve`; what belongs to the other
release is refused before any change, --dry included (a pve-kernel branch of 9 on a bookworm host
would be cloned and built with GCC 12; `proxmox_ve: 8` on a trixie host).

report: when the spec says `proxmox_ve: 9`, the run (and --dry) lists what pve8to9 would warn
about that pvegpu causes or can fix, each with its fix: before the upgrade (the host runs 8) and
after it (the host runs 9, while anything is still due: systemd-boot to remove, 8's kernel to
unpin before the reboot, kernel packages on hold, a reboot into 9's kernel). Read-only: it yields
no operation, and it does not run the upgrade. The converge after the distribution upgrade
rebuilds what the new kernel needs (the NVIDIA stage's toolchain guard takes 9's GCC 14 from the
kernel's CONFIG_CC_VERSION_TEXT) and the host checks prove it.
"""

from __future__ import annotations

from facts.boot import BootStageFacts
from facts.guest_state import guest_state
from facts.once import fact_once
from facts.proxmox import LxcConfigs, PvePackages, PveVersion
from facts.upgrade import OsRelease, UpgradeState
from plan.releases import host_release_refusals
from plan.upgrade import HostView, upgrade_findings
from spec.models import HostSpec


def _asks(spec: HostSpec) -> bool:
    return spec.proxmox_ve is not None or spec.kernel is not None


def prefetch(spec: HostSpec) -> list:
    """The facts the release rule and the check read (in deploy.py's first batched command)."""
    release: list = [(OsRelease, {}), (PveVersion, {})] if _asks(spec) else []
    check: list = ([(UpgradeState, {}), (LxcConfigs, {}), (PvePackages, {}), (BootStageFacts, {})]
             if spec.proxmox_ve == 9 else [])
    return release + check


def preflight(spec: HostSpec) -> list[str]:
    """Refusals of what belongs to the other release than the host's (plan.releases)."""
    if not _asks(spec):
        return []
    kernel = spec.kernel
    return host_release_refusals(spec.proxmox_ve, kernel.version if kernel else None,
                                 kernel is not None and kernel.source.kind == "proxmox-git",
                                 fact_once(OsRelease), fact_once(PveVersion))


def _running_gpu_guests(spec: HostSpec) -> list[str]:
    state = guest_state()
    cts = [f"CT {c}" for c, ct in sorted(spec.containers.items()) if ct.gpus and state["lxc"].get(c) == "running"]
    vms = [f"VM {v}" for v, vm in sorted(spec.vms.items()) if vm.gpus and state["qemu"].get(v) == "running"]
    return cts + vms


def report(spec: HostSpec) -> list[str]:
    """Lines for the run's output: empty unless the spec says 9 and the check finds something
    (before the upgrade: always, with the rebuild note)."""
    if spec.proxmox_ve != 9:
        return []
    pve = fact_once(PveVersion)
    if not pve or pve["major"] not in (8, 9):
        return []
    upgraded = pve["major"] == 9
    # the raw lxc.* lines of each CT's main section (LxcConfigs keeps them in file order)
    raw = {ctid: "".join(f"{k}: {v}\n" for k, v in conf.get("lxc", []))
           for ctid, conf in (fact_once(LxcConfigs) or {}).items()}
    boot = (fact_once(BootStageFacts) or {}).get("boot_loader") or {}  # the boot stage's reading
    esps = boot.get("esps") or []
    view = HostView(upgraded=upgraded, proxmox_ve=(fact_once(PvePackages) or {}).get("proxmox-ve"),
                    running_kernel=pve.get("running_kernel"), cmdline_params=boot.get("params") or [],
                    cmdline_file=boot.get("config_file"),
                    pbt_systemd_boot=any(e.get("mode") == "uefi" for e in esps) if esps else None,
                    running_gpu_guests=[] if upgraded else _running_gpu_guests(spec),
                    kernel_updates=spec.kernel_updates)
    findings = upgrade_findings(fact_once(UpgradeState), raw, spec.nvidia.version if spec.nvidia else None, view)
    if upgraded and not findings:
        return []
    if upgraded:
        head = (f"upgrade check: the host runs Proxmox VE {pve['version']} now (proxmox_ve: 9); still due after the "
                "upgrade (pve8to9 --full checks more):")
    else:
        head = (f"upgrade check: the spec says Proxmox VE 9 (proxmox_ve: 9) and this host runs {pve['version']}; "
                "before the upgrade (pve8to9 --full checks more; run the upgrade in tmux or on the console, "
                "after a backup):")
    return [head] + [f"  - {f}" for f in findings]
