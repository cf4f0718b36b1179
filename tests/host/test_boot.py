"""Host checks of the host kernel & IOMMU stage and the kernel stage: the booted cmdline has the
spec's parameters, the IOMMU is on, nothing is waiting for a reboot, vfio loads early, nouveau
stays out, the spec'd kernel runs and is pinned, and its build's -j fit the host's memory."""

from __future__ import annotations

import json
import re
from shlex import quote

import pytest

from facts.cpu import CpuInfo
from facts.kernel import BootLoader, NvidiaGateRecords, ProxmoxKernels, parse_cmdline_text
from facts.kernel_hook import KernelHookState
from facts.loader import LoaderState
from plan.boot import cmdline_difference, describe_difference, desired_params, vfio_modules
from plan.kernel import PER_JOB_KIB, STATE_DIR, build_jobs, gate_refusal
from plan.kernel_hook import failure_lines, module_problems
from plan.loader import esp_mode_problems, next_boot


def _cpu(target) -> dict:
    _, out = target.run(CpuInfo.command)
    return CpuInfo().process(out.splitlines()) or {}


def _booted(target) -> str:
    _, out = target.run("cat /proc/cmdline")
    return out.strip()


def test_booted_cmdline_has_the_spec_parameters(target):
    """The booted command line has the spec's IOMMU parameters."""
    wanted = desired_params(target.spec, _cpu(target))
    booted = parse_cmdline_text(_booted(target))["args"]
    missing = [w for w in wanted if w not in booted]
    assert not missing, f"{target.name}: the running kernel was booted without {' '.join(missing)} (/proc/cmdline: {' '.join(booted)})"
    if not target.spec.iommu.passthrough:
        assert "iommu=pt" not in booted, f"{target.name}: booted with iommu=pt although the spec keeps the IOMMU translating"


def test_iommu_is_on(target):
    """The IOMMU is on."""
    if _cpu(target).get("virtualized"):
        pytest.skip(f"{target.name} is a VM: no IOMMU groups are expected")
    rc, out = target.run("ls /sys/kernel/iommu_groups 2>/dev/null | wc -l")
    groups = int(out.strip() or 0) if rc == 0 else 0
    assert groups > 0, f"{target.name}: the IOMMU is off (no /sys/kernel/iommu_groups), so no GPU can be passed through"


def test_no_reboot_pending_for_the_cmdline(target):
    """The configured command line is the booted one."""
    _, out = target.run(BootLoader.command)
    loader = BootLoader().process(out.splitlines())
    if loader["cmdline"] is None:
        pytest.fail(f"{target.name}: no configured kernel cmdline found (boot loader {loader['loader']})")
    diff = cmdline_difference(loader["cmdline"], _booted(target), loader["loader"])
    assert diff == {"missing": [], "extra": []}, (
        f"{target.name}: reboot pending: {describe_difference(diff)} (configured in {loader['config_file']})")


def test_nouveau_not_loaded(target):
    """nouveau is not loaded."""
    _, out = target.run("ls /sys/module")
    assert "nouveau" not in set(out.split()), f"{target.name}: nouveau is loaded; it must stay blacklisted on a GPU host"


def test_vfio_loaded_for_vm_gpus(target):
    """vfio is loaded where the spec has VM GPUs."""
    vm_gpus = sorted(bdf for bdf, gpu in target.spec.gpus.items() if gpu.vmid is not None)
    if not vm_gpus:
        pytest.skip(f"{target.name}: the spec gives no GPU to a VM, so nothing needs vfio-pci")
    _, out = target.run("ls /sys/module")
    loaded = set(out.split())
    _, pve = target.run("pveversion 2>/dev/null")
    major = int(pve.split("pve-manager/")[1].split(".")[0]) if "pve-manager/" in pve else None
    missing = [m for m in vfio_modules(major) if m not in loaded]
    assert not missing, (f"{target.name}: {', '.join(missing)} not loaded; vfio-pci cannot claim the passthrough "
                         f"GPUs {', '.join(vm_gpus)} at boot")


def test_spec_kernel_runs_and_is_pinned(target):
    """The spec's kernel runs and is the default."""
    kernel = target.spec.kernel
    if kernel is None:
        pytest.skip(f"{target.name}: the spec pins no kernel")
    _, out = target.run(ProxmoxKernels.command)
    kernels = ProxmoxKernels().process(out.splitlines())
    assert kernels["running"] == kernel.version, (
        f"{target.name}: runs kernel {kernels['running']}, but the spec says {kernel.version}")
    if kernel.trial_boot:
        assert kernels["pinned"] == kernel.version, (
            f"{target.name}: kernel {kernel.version} runs but is not pinned (pinned: {kernels['pinned']}); "
            "the next boot may pick another kernel")


def test_the_spec_kernel_was_not_refused_by_the_driver_gate(target):
    """The driver × kernel gate did not refuse the spec's kernel.

    The kernel stage's driver x kernel gate (operations/kernel.py nvidia_gate) could not build
    `nvidia.version` from its source for the spec's kernel: its record quotes the first compile error."""
    kernel, nv = target.spec.kernel, target.spec.nvidia
    if kernel is None or nv is None or nv.modules_source is None:
        pytest.skip(f"{target.name}: no kernel stage or no nvidia source to gate it with")
    refusal = gate_refusal(kernel, kernel.base_config or "running", nv.version, nv.modules_source.sha256,
                           target.fact(NvidiaGateRecords))
    assert refusal is None, f"{target.name}: {refusal}"


def test_kernel_build_jobs_fit_the_hosts_memory(target):
    """The kernel build's jobs fit the host's memory (incident 14).

    Incident 14: a kernel build with -j = cores (128) and ~2 GiB per compile job took the
    host down (OOM). The build of the kernel the spec pins records its -j (its manifest, kept
    once installed): with `jobs: auto` it must not exceed min(cores, RAM / 2 GiB) here."""
    kernel = target.spec.kernel
    if kernel is None:
        pytest.skip(f"{target.name}: the spec pins no kernel")
    recorded = target.read(f"{STATE_DIR}/{kernel.version}.json")
    if recorded is None:
        pytest.skip(f"{target.name}: kernel {kernel.version} has no pvegpu build record (not built here)")
    jobs = json.loads(recorded)["jobs"]
    _, out = target.run("nproc; grep '^MemTotal:' /proc/meminfo")
    cores = int(out.split()[0])
    mem = re.search(r"MemTotal:\s*(\d+)", out)
    assert mem, out
    mem_kib = int(mem.group(1))
    if kernel.jobs != "auto":
        assert jobs == int(kernel.jobs), (
            f"{target.name}: kernel {kernel.version} was built with -j{jobs}, but the spec sets jobs: {kernel.jobs}")
        return
    limit = build_jobs(cores, mem_kib)
    assert jobs <= limit, (
        f"{target.name}: kernel {kernel.version} was built with -j{jobs}; {cores} cores and "
        f"{mem_kib // (1024 * 1024)} GiB of RAM allow -j{limit} at ~{PER_JOB_KIB // (1024 * 1024)} GiB per compile "
        "job (a bigger -j risks the OOM of incident 14)")


def test_no_installed_kernel_was_left_without_its_nvidia_driver(target):
    """The kernel hook left no kernel without NVIDIA modules.

    The kernel hook (operations/kernel_hook.py) could not build nvidia for a kernel a package
    installed: the reason it kept on the host, and what the boot default became."""
    if target.spec.nvidia is None:
        pytest.skip(f"{target.name}: no nvidia in the spec")
    lines = failure_lines(target.fact(KernelHookState))
    assert not lines, f"{target.name}: " + "; ".join(lines)


def _nvidia_module(target, release: str) -> tuple[dict, str | None, list[str]]:
    """nvidia's version, vermagic, compiler (.comment) and firmware for `release`, the kernel's
    CONFIG_CC_VERSION_TEXT (its headers' auto.conf, else /boot/config-<rel>), firmware lines."""
    r = quote(release)
    _, out = target.run(
        f"modinfo -k {r} -F version nvidia 2>/dev/null; echo '@@'; modinfo -k {r} -F vermagic nvidia 2>/dev/null; "
        f"echo '@@'; f=$(modinfo -k {r} -F filename nvidia 2>/dev/null); [ -n \"$f\" ] && readelf -p .comment \"$f\" "
        f"2>/dev/null | grep -m 1 -o 'GCC: .*'; echo '@@'; modinfo -k {r} -F firmware nvidia 2>/dev/null; echo '@@'; "
        f"grep -h -m 1 '^CONFIG_CC_VERSION_TEXT=' /lib/modules/{r}/build/include/config/auto.conf /boot/config-{r} "
        "2>/dev/null | head -n 1")
    parts = [[line.strip() for line in part.strip().splitlines() if line.strip()] for part in out.split("@@")] + [[]] * 5
    first = [p[0] if p else None for p in parts[:5]]
    cc = (first[4] or "").split("=", 1)[-1].strip('"') or None
    return {"version": first[0], "vermagic": first[1], "gcc": first[2]}, cc, parts[3]


def test_kernels_the_loader_boots_next_have_the_nvidia_driver(target):
    """What the boot loader boots next has `nvidia.version`'s modules, built by its compiler, with their firmware.

    Read from the loader, not from pin files (issue 38 item 2.6; facts.loader.LoaderState,
    plan.loader.next_boot): systemd-boot on each ESP: the EFI variable LoaderEntryOneShot, then
    LoaderEntryDefault, then loader.conf's `default` glob over the entries whose kernel is on the
    ESP, in systemd-boot's order; GRUB: next_entry, then the default grub.cfg sets (saved_entry from
    the grubenv that GRUB reads: the ESP's in proxmox-boot-tool's grub mode), else the first entry.
    That kernel has nvidia `nvidia.version` under /lib/modules/<release>/, built for it by the
    compiler that built it, with its firmware (issue 25). ESPs set up for both loaders, an ESP
    holding both, or systemd-boot started on GRUB's ESPs (a reinit after a loader upgrade) fail
    first, naming the ESPs and the fix (plan.loader esp_mode_problems): no one answer holds there."""
    nv = target.spec.nvidia
    if nv is None:
        pytest.skip(f"{target.name}: no nvidia in the spec")
    state = target.fact(LoaderState)
    # ESPs of both loaders, one ESP holding both, a mode that changed: no one answer (plan.loader esp_mode_problems)
    mixed = esp_mode_problems(state)
    assert not mixed, f"{target.name}: what boots next depends on the firmware's boot order: " + " ".join(mixed)
    choices = next_boot(state)
    if not choices:
        pytest.skip(f"{target.name}: no boot loader to read (no proxmox-boot-tool ESP, no /boot/grub/grub.cfg)")
    unknown = [c for c in choices if not c["release"]]
    assert not unknown, f"{target.name}: what boots next is unknown: " + "; ".join(
        f"{c['where']}: {c['why']}" for c in unknown)
    releases = list(dict.fromkeys(c["release"] for c in choices))
    problems = []
    for release in releases:
        module, cc, firmware = _nvidia_module(target, release)
        present = None
        if nv.firmware and firmware:
            present = {name: target.run(f"test -e /lib/firmware/{quote(name)}")[0] == 0 for name in firmware}
        problems += module_problems(release, nv.version, module, cc, present)
    where = "; ".join(f"{c['where']} ({c['loader']}): {c['release']} by {c['why']}" for c in choices)
    assert not problems, (f"{target.name}: the next boot ({where}) would come up without its GPU driver: "
                          + "; ".join(problems))
