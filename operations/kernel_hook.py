"""Stage after the NVIDIA driver — kernels that apt installs between runs (issue 25).

follow (spec `kernel_updates`, the default): `/etc/kernel/postinst.d/00pvegpu-nvidia`
(templates/kernel-postinst-nvidia.sh.j2) builds and installs nvidia `nvidia.version` for each
kernel a package installs, offline, from the sha256-checked archive the NVIDIA stage keeps, with
that stage's own build and install scripts (templates/nvidia-build.sh.j2, nvidia-install.sh.j2
with the release from the hook's argument), its toolchain rule and its signing key. It runs
first in run-parts' order, before initramfs-tools (whose update-initramfs runs
proxmox-kernel-helper's post-update proxmox-boot-sync: the new kernel's first copy onto the ESPs),
proxmox-auto-removal, zz-proxmox-boot and zz-update-grub, so the new kernel reaches the loader only
once its modules are installed or the last kernel with working modules is pinned (a power cut
while this hook builds boots the old kernel: docs/DESIGN.md, bench/power_cut.py). Its name before,
`pvegpu-nvidia`, ran after initramfs-tools: the stage removes it. The reason is kept in
/var/lib/pvegpu/kernel-hook/<release>.failed, shown at login (/etc/motd.d/pvegpu-kernel), by
this stage (--dry too) and by the host checks. The hook always exits 0: pve-kernel's postinst
runs the hooks with `run-parts --exit-on-error` and dies on a failure (debian/proxmox-kernel.
postinst.in), which would leave the kernel package half-configured. The headers follow the
kernels through proxmox-default-headers; headers that come in a later apt run than their kernel
(their postinst runs no kernel hook) get the build through apt's DPkg::Post-Invoke
(templates/kernel-headers-apt.conf.j2), which runs the same hook for the kernels it left for want
of headers.

hold: the installed kernel meta-packages of the series are held (`apt-mark hold`), so
`apt full-upgrade` installs no new release; `follow` releases exactly the holds pvegpu set.

A kernel package dpkg left midway (a power cut or a killed apt run) is finished first:
`dpkg --configure -a`, which runs its hooks to the end; one left half-installed (cut while dpkg
unpacked it) is unpacked again first (`apt-get install --reinstall` of the version dpkg had).
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation

from facts.files import ManagedFiles
from facts.kernel_hook import HOLD_RECORD, HOOK, HOOK_STATE, OLD_HOOK, PIN_FILE, KernelHookState
from facts.loader import ESP_LIST
from facts.nvidia import COMPILER_DIR
from facts.once import fact_once
from facts.shell import operands, word
from operations import nvidia
from operations.files import file_current, managed_file
from plan import build_share as shplan
from plan import kernel as kplan
from plan import kernel_hook as khplan
from plan import nvidia as nvplan
from plan.render import render_template
from plan.terminal import visible

# apt's DPkg::Post-Invoke runs the hook's --headers pass after each dpkg run: headers installed after
# their kernel (pve-kernel debian/proxmox-headers.postinst.in runs no kernel hook) get it built then
HEADERS_CONF = "/etc/apt/apt.conf.d/80pvegpu-kernel-headers"
MOTD_DIR = "/etc/motd.d"
# Linux-PAM modules/pam_motd/pam_motd.c: DEFAULT_MOTD_D (/etc/motd.d:…) is read when neither
# motd= nor motd_dir= is given, as on Debian's second pam_motd line (/etc/pam.d/sshd, login)
MOTD = f"{MOTD_DIR}/pvegpu-kernel"
# proxmox-kernel-helper's hook that writes apt's NeverAutoRemove list (/etc/apt/apt.conf.d/76pveconf)
# from kernel_keep_versions (the pin among them); run-parts runs it after ours, apt's Post-Invoke not at all
AUTO_REMOVAL = "/etc/kernel/postinst.d/proxmox-auto-removal"
GRUB_CFG = "/boot/grub/grub.cfg"  # grub-mkconfig's output: whether GRUB boots saved_entry, and the entries' ids


def hook_context(spec, jobs: int, ccache: bool, sig_hash: str = "sha256") -> dict:
    """The hook's values; no compiler: the hook picks each kernel's own when it runs
    (templates/nvidia-toolchain-pick.sh.j2, plan/nvidia.py toolchain_for's candidates)."""
    nv = spec.nvidia
    build = nvidia.build_context(nvidia.cached_source(nv.modules_source), nv.version, None, None, jobs, ccache,
                                 signing=(nv.signing.key, nv.signing.cert) if nv.signing else None,
                                 sig_hash=sig_hash, share_by="kernel-hook")
    return {**build, "sha256": nv.modules_source.sha256,
            "key_parts": shplan.hook_key_parts(nv.version, nv.modules_source.sha256, nv.open),
            "compiler_dir": COMPILER_DIR, "state_dir": HOOK_STATE, "pin_file": PIN_FILE,
            "motd_dir": MOTD_DIR, "motd_file": MOTD, "module_subdir": nvidia.MODULE_SUBDIR,
            "boot_dir": "/boot", "grub_cfg": GRUB_CFG, "loader_entry_prefix": kplan.LOADER_ENTRY_PREFIX,
            "grubenv": kplan.GRUBENV, "trial_pending": kplan.TRIAL_PENDING, "auto_removal": AUTO_REMOVAL,
            "esp_list": ESP_LIST, "need_cxx": nv.open, "cc_candidates": nvplan.CC_CANDIDATES,
            "cxx_candidates": nvplan.CXX_CANDIDATES}


def hook_script(spec, jobs: int, ccache: bool, sig_hash: str = "sha256") -> str:
    """The hook's text (templates/kernel-postinst-nvidia.sh.j2)."""
    return render_template("kernel-postinst-nvidia.sh.j2", **hook_context(spec, jobs, ccache, sig_hash))


def prefetch(spec) -> list:
    return [(KernelHookState, {}), (ManagedFiles, {"paths": [HOOK, OLD_HOOK, HEADERS_CONF, HOLD_RECORD]})]


def preflight(spec) -> list[str]:
    state = fact_once(KernelHookState)
    refusals = [khplan.updates_plan(spec.kernel_updates, spec.kernel.version if spec.kernel else None,
                                    state)["refusal"]]
    if spec.kernel is not None and spec.nvidia is not None:
        refusals.append(khplan.driver_kernel_refusal(spec.nvidia.version, spec.kernel.version, state))
    return [r for r in refusals if r]


@operation()
def apt_mark(action: str, packages: list[str]):
    """`apt-mark hold|unhold` of kernel meta-packages."""
    yield StringCommand(f"apt-mark {word(action)} " + " ".join(word(p) for p in packages))


@operation()
def install_default_headers():
    """proxmox-default-headers: the headers of every new kernel come with it."""
    yield StringCommand("DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends proxmox-default-headers")


@operation()
def forget_failures(releases: list[str], last: bool):
    """Remove the failure records of kernels no longer installed (and the login notice with the last)."""
    paths = [f"{HOOK_STATE}/{r}.failed" for r in releases] + ([MOTD] if last else [])
    yield StringCommand(f"rm -f {operands(paths)}")


@operation()
def finish_packages(reinstall: list[str] | None = None):
    """Finish what dpkg left midway: configure every unpacked or half-configured package and run
    the pending triggers (dpkg --configure -a; a kernel's postinst then runs its
    /etc/kernel/postinst.d hooks, this hook among them, and proxmox-boot-tool's refresh).
    `reinstall` (`pkg=version`, half-installed): unpacked again first, the version dpkg was
    unpacking (apt's archive cache or the repository); the first configure pass only clears
    dpkg's journal, without which apt refuses to run ("dpkg was interrupted"), and fails on them."""
    # dpkg src/main/configure.c deferred_configure: PKG_EFLAG_REINSTREQ refuses the configure;
    # apt-pkg/deb/debsystem.cc CheckUpdates: a non-empty /var/lib/dpkg/updates stops apt
    if reinstall:
        yield StringCommand("DEBIAN_FRONTEND=noninteractive dpkg --configure -a >/dev/null 2>&1 || :")
        yield StringCommand("DEBIAN_FRONTEND=noninteractive apt-get install -y --reinstall --no-install-recommends "
                            + " ".join(word(p) for p in reinstall))
    yield StringCommand("DEBIAN_FRONTEND=noninteractive dpkg --configure -a")


@operation()
def remove_hook(paths: list[str]):
    yield StringCommand(f"rm -f {operands(paths)}")


@deploy("Kernel updates")
def apply(spec) -> None:
    state = fact_once(KernelHookState)
    # first: apt refuses to run while dpkg is interrupted ("dpkg was interrupted, you must manually
    # run 'dpkg --configure -a'"), and a kernel package a power cut (or a killed apt) left unpacked
    # or half-configured never ran its hooks to the end (tests/e2e/test_power_cut_e2e.py)
    unfinished = khplan.unfinished_packages(state)
    broken = khplan.half_installed(state)
    if broken:
        finish_packages(name=f"Unpack again the kernel packages dpkg left half-installed: {', '.join(broken)}, "
                             f"then finish the rest (apt-get install --reinstall; dpkg --configure -a)",
                        reinstall=broken)
    elif unfinished:
        finish_packages(name=f"Finish the kernel packages dpkg left midway: {unfinished} (dpkg --configure -a)")
    _hook_and_holds(spec, state)


def _hook_and_holds(spec, state: dict) -> None:
    for line in khplan.failure_lines(state):
        logger.warning(f"{host.name}: kernel hook: {visible(line)}")  # a build log's first error in it
    stale = khplan.stale_failures(state)
    if stale:
        forget_failures(name=f"Forget the kernel hook's records of removed kernels: {', '.join(stale)}", releases=stale,
                        last=not khplan.live_failures(state))
    updates = khplan.updates_plan(spec.kernel_updates, spec.kernel.version if spec.kernel else None, state)
    logger.info(f"{host.name}: {updates['summary']}")
    if updates["unhold"]:
        apt_mark(name=f"Release the kernel holds pvegpu set: {', '.join(updates['unhold'])}", action="unhold",
                 packages=updates["unhold"])
    if updates["hold"]:
        apt_mark(name=f"Hold the kernel series {updates['series']}: {', '.join(updates['hold'])}", action="hold",
                 packages=updates["hold"])
    record = "".join(f"{p}\n" for p in updates["record"])
    files = fact_once(ManagedFiles, paths=[HOOK, OLD_HOOK, HEADERS_CONF, HOLD_RECORD])
    if record or files.get(HOLD_RECORD):
        managed_file(name="Record the kernel holds pvegpu set", path=HOLD_RECORD, content=record, mode="644",
                     state=files.get(HOLD_RECORD), keep_previous=False)
    nv = spec.nvidia
    if nv is None or nv.modules_source is None:
        if state.get("hook") or files.get(HEADERS_CONF):
            remove_hook(name="Remove the kernel hook (no nvidia.modules_source to build from)",
                        paths=[HOOK, OLD_HOOK, HEADERS_CONF])
        return
    # follow only: held kernels need no new headers (and proxmox-default-headers may name a newer series)
    headers, note = khplan.headers_step(state) if spec.kernel_updates == "follow" else (False, None)
    if note:
        logger.warning(f"{host.name}: kernel hook: {note}")
    if headers:
        install_default_headers(name="Install proxmox-default-headers (headers follow the kernels)")
    nv_state, releases, steps = nvidia._state_and_steps(spec)
    # the hook builds from the verified archive on the host: fetched even when the NVIDIA stage builds nothing
    archive = nvidia.cached_source(nv.modules_source)
    if not (nv_state["sources"].get("modules") or {}).get("cached") and not steps["fetch_modules"]:
        nvidia.fetch_source(name=f"Fetch and verify NVIDIA modules source {archive} for the kernel hook",
                            url=nv.modules_source.url, sha256=nv.modules_source.sha256, dest=archive)
    # sign-file's hash: the target kernels' CONFIG_MODULE_SIG_HASH (a series keeps its config), else sha256
    sig_hash = next((h for r in releases if (h := ((nv_state["releases"].get(r) or {}).get("config") or {})
                                             .get("CONFIG_MODULE_SIG_HASH"))), "sha256")
    content = hook_script(spec, steps["jobs"], steps["ccache"], sig_hash)
    conf = render_template("kernel-headers-apt.conf.j2", path=HEADERS_CONF, hook=HOOK)
    if not file_current(files.get(HEADERS_CONF), conf, "644"):
        managed_file(name="Kernel hook: build for headers apt installs after their kernel (DPkg::Post-Invoke)",
                     path=HEADERS_CONF, content=conf, mode="644", state=files.get(HEADERS_CONF), keep_previous=False)
    current = files.get(HOOK)
    if file_current(current, content, "755"):
        logger.info(f"{host.name}: kernel hook: {HOOK} builds nvidia {nv.version} for new kernels (each with its own GCC)")
    else:
        managed_file(name=f"Kernel hook: build nvidia {nv.version} for each kernel apt installs", path=HOOK,
                     content=content, mode="755", state=current, keep_previous=False)
    if files.get(OLD_HOOK):  # after the new one is in place: no run-parts between finds neither
        remove_hook(name=f"Kernel hook: remove its old name {OLD_HOOK} (ran after initramfs-tools' ESP refresh)",
                    paths=[OLD_HOOK])
