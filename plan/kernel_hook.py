"""How kernels move on a host between runs (issue 25), decided from the spec and the
`facts.kernel_hook.KernelHookState` fact; pure.

follow: apt installs new Proxmox kernels; the kernel hook builds nvidia for each as it is
installed, and keeps the last kernel with working modules the boot default when it cannot.
hold: Proxmox's kernel meta-packages are held at the series, so apt installs no new release.
"""

from __future__ import annotations

import re

from facts.compilers import compiler_version
from facts.kernel_hook import DEFAULT_METAS, HOOK

SERIES_RE = re.compile(r"^(\d+\.\d+)\.")


def series_of(release: str | None) -> str | None:
    """`6.14.8-2-pve` -> `6.14`."""
    m = SERIES_RE.match(release or "")
    return m.group(1) if m else None


def hold_packages(series: str, installed: dict[str, dict]) -> list[str]:
    """The installed meta-packages that pull a new kernel release: proxmox-default-kernel /
    -headers (they move to a new series) and proxmox-kernel-X.Y / proxmox-headers-X.Y (each new
    ABI of the series; proxmox-kernel-meta and pve-kernel debian/control)."""
    wanted = [*DEFAULT_METAS, f"proxmox-kernel-{series}", f"proxmox-headers-{series}"]
    return [p for p in wanted if p in installed]


def unfinished_packages(state: dict) -> str | None:
    """The kernel packages a dpkg run left midway (facts.kernel_hook UNFINISHED: a power cut or a
    killed apt during an install or upgrade) that `dpkg --configure -a` finishes (what apt asks
    for then: "dpkg was interrupted"), as the converge names them; None: none. A half-installed
    one is not among them: dpkg refuses to configure it (it must be unpacked again:
    `half_installed`)."""
    unfinished = state.get("unfinished") or {}
    return ", ".join(f"{p} ({s})" for p, s in sorted(unfinished.items()) if s != "half-installed") or None


def half_installed(state: dict) -> list[str]:
    """The kernel packages dpkg left half-installed (a cut while it unpacked them), as
    `pkg=version` for `apt-get install --reinstall`: only unpacking them again mends them (dpkg
    refuses to configure them: "very bad inconsistent state"; neither `dpkg --configure -a` nor
    `apt --fix-broken install` nor the interrupted apt run again unpacks them); their files are
    dpkg's temporary names until then, so no loader boots them."""
    return [f"{p}={v}" for p, v in sorted((state.get("reinstall") or {}).items())]


def updates_plan(mode: str, spec_release: str | None, state: dict) -> dict:
    """What the kernel-updates setting does on this host.

    {"mode": "hold", "series": "6.8", "hold": [...], "unhold": [...], "record": [...],
     "summary": "kernel updates: hold at 6.8 (...)", "refusal": None}
    `record`: the packages pvegpu holds after this run (kept on the host, so `follow` releases
    exactly those and no hold an operator set by hand)."""
    packages = state.get("packages") or {}
    holds = set(state.get("holds") or [])
    record = list(state.get("hold_record") or [])
    if mode == "follow":
        unhold = [p for p in record if p in holds]
        summary = ("kernel updates: follow (apt installs new kernels; the kernel hook builds nvidia for each, "
                   "else the boot default stays on the last kernel with working modules)")
        return {"mode": mode, "series": None, "hold": [], "unhold": unhold, "record": [], "summary": summary,
                "refusal": None}
    series = series_of(spec_release) or series_of(state.get("running"))
    if series is None:
        return {"mode": mode, "series": None, "hold": [], "unhold": [], "record": record, "summary": "",
                "refusal": "kernel_updates is hold but neither the spec's kernel nor the running one names a series"}
    wanted = hold_packages(series, packages)
    if f"proxmox-kernel-{series}" not in packages:
        return {"mode": mode, "series": series, "hold": [], "unhold": [], "record": record, "summary": "",
                "refusal": f"kernel_updates is hold at {series}, but proxmox-kernel-{series} is not installed "
                           f"(installed: {', '.join(sorted(packages)) or 'no Proxmox kernel meta-package'})"}
    hold = [p for p in wanted if p not in holds]
    unhold = [p for p in record if p in holds and p not in wanted]
    summary = (f"kernel updates: hold at {series} ({', '.join(wanted)} held: apt installs no new kernel "
               f"release until the spec changes)")
    return {"mode": mode, "series": series, "hold": hold, "unhold": unhold, "record": sorted(wanted),
            "summary": summary, "refusal": None}


def live_failures(state: dict) -> dict[str, dict]:
    """The hook's failure records of kernels still installed (/boot/vmlinuz-<rel>)."""
    installed = set(state.get("installed") or [])
    return {rel: rec for rel, rec in (state.get("failed") or {}).items() if rel in installed}


def stale_failures(state: dict) -> list[str]:
    """Failure records of kernels removed since (nothing boots them any more)."""
    return sorted(set(state.get("failed") or {}) - set(live_failures(state)))


def rerun_command(release: str, state: dict) -> str:
    """The command that runs the kernel hook again for `release`: dpkg-reconfigure of the package
    dpkg says installed its image (proxmox-kernel-<rel>-signed on Proxmox VE >= 8.1: dpkg-reconfigure
    of the name it only Provides says "is not installed"), else the hook itself with the arguments
    the kernel postinst gives it (pve-kernel debian/proxmox-kernel.postinst.in)."""
    owner = (state.get("owners") or {}).get(release)
    if owner:
        return f"dpkg-reconfigure {owner}"
    return f"{HOOK} {release} /boot/vmlinuz-{release}"


def failure_lines(state: dict) -> list[str]:
    """The kernel hook's failures on this host, in words (the --dry and the run say them)."""
    return [f"kernel {rel}: {rec['reason'] or 'the kernel hook failed'} ({rec['time']}); {rec['kept']}; "
            f"once the cause is fixed, `{rerun_command(rel, state)}` runs the hook again"
            for rel, rec in sorted(live_failures(state).items())]


def headers_step(state: dict) -> tuple[bool, str | None]:
    """(install proxmox-default-headers?, note): on a host with proxmox-default-kernel, the
    headers follow the kernels through proxmox-default-headers (proxmox-kernel-meta: it depends on
    proxmox-headers-X.Y, which depends on the newest release's headers)."""
    packages = state.get("packages") or {}
    if "proxmox-default-kernel" not in packages or "proxmox-default-headers" in packages:
        return False, None
    if state.get("headers_candidate"):
        return True, None
    return False, ("proxmox-default-headers is not installed and apt has no candidate for it: a new kernel "
                   "will come without headers and the kernel hook will refuse it")


def module_problems(release: str, version: str, module: dict, cc_version_text: str | None,
                    firmware_present: dict[str, bool] | None) -> list[str]:
    """What is wrong with nvidia for `release`: `module` is {"version", "vermagic", "gcc"
    (the .ko's .comment GCC line), "firmware": [files it loads]}; `cc_version_text` the kernel's
    CONFIG_CC_VERSION_TEXT; `firmware_present` {firmware file: exists} (None: not checked)."""
    if module.get("version") != version:
        return [f"kernel {release} has nvidia {module.get('version') or 'missing'}, not {version}"]
    problems = []
    vermagic = (module.get("vermagic") or "").split(" ", 1)[0]
    if vermagic != release:
        problems.append(f"kernel {release}: its nvidia module was built for {vermagic or 'an unknown kernel'}")
    gcc = module.get("gcc") or ""
    want = cc_version_text or ""
    if want and gcc:
        same = gcc.split(" ", 1)[-1] == want.split(" ", 1)[-1]
        if not same and compiler_version(gcc) != compiler_version(want):
            problems.append(f"kernel {release} was built with {want!r} but its nvidia module with {gcc!r}")
    elif want:
        problems.append(f"kernel {release}: its nvidia module does not say which compiler built it")
    for name, present in sorted((firmware_present or {}).items()):
        if not present:
            problems.append(f"kernel {release}: nvidia {version} loads /lib/firmware/{name}, which is missing")
    return problems


def driver_kernel_refusal(version: str, release: str | None, state: dict) -> str | None:
    """The driver x kernel gate for the spec's kernel (`kernel.version`): the kernel hook already
    tried nvidia `version` against that release when its package was installed and could not build
    it (the record quotes the first compile error); the run is refused before the kernel stage
    pins it. A record of another driver version does not count (the spec moved on)."""
    rec = live_failures(state).get(release or "")
    if rec is None or not rec["reason"].startswith(f"nvidia {version} "):
        return None
    return (f"kernel {release} (kernel.version) cannot run nvidia {version}: {rec['reason']}; pick a driver version "
            f"that builds for it (nvidia.version) or another kernel.version")
