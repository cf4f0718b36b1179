"""A short, human plan summary per host, printed by deploy.py before any operation."""

from __future__ import annotations

from spec.models import HostSpec


def spec_summary(name: str, spec: HostSpec) -> list[str]:
    """What the spec asks of a host, in a few lines (no secrets: the API token is never read here)."""
    lines = [f"pvegpu plan for {name} (node {spec.node or name}):"]
    iommu = spec.iommu
    cmd = [f"iommu vendor {iommu.vendor}"] + (["iommu=pt"] if iommu.passthrough else []) + list(iommu.params)
    if iommu.acs_override:
        cmd.append(f"pcie_acs_override={iommu.acs_override}")
    lines.append(f"  boot loader {spec.boot_loader}; cmdline: {' '.join(cmd)}")
    if spec.kernel:
        lines.append(f"  kernel {spec.kernel.version} from {spec.kernel.source.kind} {spec.kernel.source.ref or ''}".rstrip())
    if spec.nvidia:
        nv = spec.nvidia
        lines.append(
            f"  nvidia {nv.version} ({'open' if nv.open else 'proprietary'} modules), uvm_disable_hmm={nv.uvm_disable_hmm}"
        )
    roles: dict[str, list[str]] = {}
    for bdf, gpu in sorted(spec.gpus.items()):
        roles.setdefault(gpu.role, []).append(bdf)
    for role, bdfs in sorted(roles.items()):
        lines.append(f"  {len(bdfs)} GPU(s) {role}: {', '.join(bdfs)}")
    for ctid, ct in sorted(spec.containers.items()):
        lines.append(f"  CT {ctid}: {len(ct.gpus)} GPU(s)" + (", NCCL overrides " + ", ".join(ct.nccl) if ct.nccl else ""))
    for vmid, vm in sorted(spec.vms.items()):
        lines.append(f"  VM {vmid}: {len(vm.gpus)} GPU(s), machine {vm.machine}")
    if spec.nccl.profile != "none" or spec.nccl.overrides or spec.nccl.services:
        services = ", ".join(spec.nccl.services)
        lines.append(f"  NCCL profile {spec.nccl.profile}: /etc/nccl.conf on the host and in GPU CTs"
                     + (f", drop-ins for {services}" if services else "")
                     + "; processes read it at NCCL's init, so running services keep old values until restarted")
    lines.append(f"  reboot {'allowed' if spec.reboot.allowed else 'not allowed (pending reasons are reported)'}")
    return lines
