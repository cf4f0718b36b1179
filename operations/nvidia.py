"""Stage 3 — NVIDIA driver: kernel modules (open, or the proprietary tree when nvidia.open is
false and no GPU is Blackwell) built for each target kernel, GSP firmware and
user space of exactly the same version (DESIGN.md §2.3; incidents 1, 2, 6, 14).

Order on the host (each step runs only when the facts say it is needed, so a converged host
costs two fact commands and no change):

    fetch + sha256-check sources  ->  build modules per release (scratch dir)  ->  GSP firmware
    ->  install modules per release  ->  depmod once for all (handler, flushed here)
    ->  user space (.run --no-kernel-modules)
    ->  nvidia-persistenced  ->  verify module/firmware/user-space versions are equal

A failed step stops the host there: a wrong checksum stops before any build, a failed build
before any install. Refusals (toolchain, firmware, local checksum, version mismatch) come from
`preflight` and stop the whole run before a single change.

Host paths:
    /var/cache/pvegpu/sources/<sha256>-<name>   verified source archives
    /var/cache/pvegpu/ccache                    ccache of module builds (rebuilds are warm)
    /var/cache/pvegpu/nvidia-conftest/<key>.tgz NVIDIA conftest results per (tree, headers, compiler)
    /var/cache/pvegpu/nvidia-build/<ver>/<rel>/  scratch build trees (removed after install), 0700
    /var/cache/pvegpu/nvidia-build/builds.log    the builds' own notes (one line per build)
    /var/cache/pvegpu/nvidia-share/<key>/        unsigned modules + manifest kept for the run's other
                                                hosts of the same build inputs (operations/build_share.py)
    /var/cache/pvegpu/nvidia-received/<tmp>/     a copy of another host's build while it is verified
    /lib/modules/<rel>/updates/pvegpu-nvidia/    installed modules (depmod prefers updates/)
"""

from __future__ import annotations

import re

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, deploy, operation

from facts.build_share import SHARE_ROOT, BuildShareState
from facts.files import ManagedFiles
from facts.hardware import HardwareProbe
from facts.nvidia import (
    CCACHE_MASQUERADE,
    LIB_DIRS,
    SIGN_FILE,
    SOURCE_CACHE,
    WANTS_DIR,
    NvidiaHostState,
    local_path,
    source_name,
)
from facts.once import fact_once, read_fact
from facts.run_state import need_reboot
from facts.shell import operands, word
from operations import build_share, handlers, progress
from operations.files import file_current, link_unit, managed_file
from plan import nvidia as nvplan
from plan.render import PUBLIC, render_template, root_dirs
from spec.models import SourceSpec

CCACHE_DIR = "/var/cache/pvegpu/ccache"
# root's alone (templates/root-dir.sh.j2 checks the path before each build): never /var/tmp, whose
# 1777 parent let any local user create the tree first (issue 39); a cache: nothing there is needed
# once the modules are installed, and a later build makes what it lacks again
BUILD_ROOT = "/var/cache/pvegpu/nvidia-build"
# NVIDIA's conftest.sh compiles every test with -DKBUILD_BASENAME="#conftest<pid>" (and
# KBUILD_MODNAME): a new pid per build made every conftest a ccache miss on a rebuild. Only
# the conftest values are left out of the hash (a conftest only asks "does it compile");
# real objects keep their module name in the hash.
CCACHE_IGNORE_OPTIONS = '-DKBUILD_BASENAME="#conftest* -DKBUILD_MODNAME="#conftest*'
# NVIDIA's conftest results (<tree>/conftest/, ~300 test compiles, most meant to fail, so
# ccache cannot keep them) are kept per key; see conftest_key_command.
CONFTEST_CACHE = "/var/cache/pvegpu/nvidia-conftest"
CONFTEST_CACHE_KEEP = 16
MODULE_SUBDIR = "updates/pvegpu-nvidia"
PERSISTENCED_UNIT = "/etc/systemd/system/nvidia-persistenced.service"


# -- sources -------------------------------------------------------------------------------

def cached_source(source) -> str:
    """Where a verified copy of `source` (url, sha256) lives on the host."""
    return f"{SOURCE_CACHE}/{source.sha256}-{source_name(source.url)}"


def fetch_source_command(url: str, sha256: str, dest: str) -> str:
    """Copy or download `url` to `dest`, moving it into place only when its sha256 matches
    (templates/nvidia-fetch-source.sh.j2).

    A mismatch removes the partial file and exits 1 with a message naming both checksums.
    """
    return render_template("nvidia-fetch-source.sh.j2", url=url, local=local_path(url), sha256=sha256, dest=dest)


# -- build and install ---------------------------------------------------------------------

def build_dir(version: str, release: str) -> str:
    return f"{BUILD_ROOT}/{version}/{release}"


def conftest_key_command(archive: str, release: str, cc: str, make_args: str = "",
                         modules_dir: str = "/lib/modules") -> str:
    """Shell that prints the sha256 naming the conftest results of one build
    (templates/nvidia-conftest-key.sh.j2).

    The results depend on the NVIDIA tree (its conftest.sh and Kbuild: the archive), the kernel
    headers (the release's build and source trees, kbuild scripts included through their
    symlinks: every file's path, size and mtime, plus include/config/auto.conf itself), the
    compiler (its full `-v` banner and the driver and cc1 binaries' size and mtime), the
    machine and `make_args` (the variables `make` gets). Any change there gives a new key, so a
    rebuild never reads stale results.
    """
    return f"R={word(release)}\n" + render_template("nvidia-conftest-key.sh.j2", archive=archive, cc=cc,
                                                                make_args=make_args, modules_dir=modules_dir)


def src_dir(version: str, cc: str, cxx: str | None) -> str:
    """The unpacked open tree whose src/ objects every release of one build run shares."""
    return f"{BUILD_ROOT}/{version}/tree-{re.sub(r'[^A-Za-z0-9._+-]', '_', cc)}-{re.sub(r'[^A-Za-z0-9._+-]', '_', cxx or 'none')}"


def build_command(archive: str, version: str, release: str | None, cc: str, jobs: int, ccache: bool,
                  conftest_cache: bool = True, cxx: str | None = None,
                  signing: tuple[str, str] | None = None, sig_hash: str = "sha256", share_key: str | None = None,
                  share_inputs: str | None = None) -> str:
    """Build the NVIDIA modules for `release` in a fresh scratch dir; the .ko files land in <scratch>/out
    (templates/nvidia-build.sh.j2, every value quoted there).

    Layouts: the open-gpu-kernel-modules archive (`src/nvidia` + `src/nvidia-modeset` compiled
    with $(CC) and $(CXX) into nv-kernel.o / nv-modeset-kernel.o, then `kernel-open/` with
    kbuild), an extracted .run (`kernel-open/` with NVIDIA's prebuilt objects), and Debian's
    nvidia-*kernel-source tarball (`modules/nvidia-kernel/`): the shallowest dir with a Kbuild.

    The open tree's src/ part does not depend on the kernel: it is built once per run in
    `src_dir(version, cc, cxx)` (kept while its stamp names this archive and these compilers'
    banners) and every release copies only kernel-open/ from there, its two .o_binary links
    pointing at the shared objects; so a second release compiles kernel-open/ alone (follows
    the tree's top-level Makefile: `modules` needs the two .o_binary links, then
    `make -C kernel-open modules`). `cleanup_command` removes it after the installs.

    The kernel is named by KERNEL_UNAME (as Debian's dkms.conf does), so NVIDIA's Makefile
    finds a split header package itself: sources in /lib/modules/<rel>/source (Debian's
    -common), output in .../build (-amd64); with SYSSRC=.../build alone every conftest compiled
    against the output tree's empty include/ and failed. The build log is <scratch>/build.log
    (its tail is printed on failure). The .ko files are stripped of debug info as the kernel's
    INSTALL_MOD_STRIP=1 does (`strip --strip-debug`; 595.45.04 for 6.1: 25.5 MB of modules left) and then,
    with `signing` = (key, cert) paths on the host, signed with the release's own
    scripts/sign-file with `sig_hash` (the release's CONFIG_MODULE_SIG_HASH), in that order: stripping after signing would drop the signature.
    Nothing outside the scratch dirs, the ccache and the conftest cache is touched.

    release None: the script builds for the release in its shell variable R, which the caller
    sets (the kernel hook, templates/kernel-postinst-nvidia.sh.j2, from its first argument).

    conftest_cache: before `make`, restore kernel-open/conftest/ from a previous successful
    build with the same `conftest_key_command` key (mtimes kept, so NVIDIA's Kbuild finds every
    result newer than conftest.sh and reruns only its always-run checks); after a successful
    build, store this build's conftest/ under its key.

    share_key: the build's key (plan.build_share.build_key) in a run that shares builds: after the
    strip and before signing, the unsigned modules and their manifest are kept under
    facts.build_share.SHARE_ROOT/<key>/ for the run's other hosts of the same inputs (issue 41), the
    manifest recording `share_inputs` (plan.build_share.inputs_text: what the key hashes).
    """
    return render_template("nvidia-build.sh.j2", **build_context(archive, version, release, cc, jobs, ccache,
                                                                conftest_cache, cxx, signing, sig_hash,
                                                                share_key=share_key, share_inputs=share_inputs))


def build_context(archive: str, version: str, release: str | None, cc: str | None, jobs: int, ccache: bool,
                  conftest_cache: bool = True, cxx: str | None = None,
                  signing: tuple[str, str] | None = None, sig_hash: str = "sha256", kernel_dirs: bool = False,
                  share_key: str | None = None, share_inputs: str | None = None, share_by: str = "converge") -> dict:
    """templates/nvidia-build.sh.j2's values (`build_command`; the kernel hook and the kernel stage's
    gate include the same template with these values and release None; the gate with kernel_dirs:
    the kernel trees in $KSRC/$KOUT). cc None: the compilers are the caller's $CC and $CXX (the kernel
    hook's, picked for each kernel: templates/nvidia-toolchain-pick.sh.j2), the shared tree named from them.
    share_by: who keeps the build for sharing ("converge": with `share_key`; "kernel-hook": under the
    key the hook computes, templates/nvidia-share-key.sh.j2)."""
    # ccache by masquerade (/usr/lib/ccache/<cc> first on PATH): NVIDIA's conftest.sh runs
    # "$CC" quoted, so CC="ccache gcc-12" makes every conftest fail.
    return dict(
        archive=archive, version=version, release=release, cc=cc, cxx=cxx, jobs=int(jobs),
        ccache=ccache, conftest_cache=conftest_cache, signing=tuple(signing) if signing else None, sig_hash=sig_hash,
        build_root=BUILD_ROOT, build_parent=f"{BUILD_ROOT}/{version}", src_dir=src_dir(version, cc, cxx) if cc else None,
        ccache_dir=CCACHE_DIR, ccache_masquerade=CCACHE_MASQUERADE, ccache_ignore_options=CCACHE_IGNORE_OPTIONS,
        conftest_cache_dir=CONFTEST_CACHE, conftest_cache_keep=CONFTEST_CACHE_KEEP, sign_file=SIGN_FILE,
        modules_dir="/lib/modules", kernel_dirs=kernel_dirs, share_key=share_key,
        share_inputs=share_inputs if share_key else None, share_by=share_by, share_root=SHARE_ROOT)


def cleanup_command(version: str) -> str:
    """Remove every scratch dir of `version`'s builds (the shared src/ tree included)."""
    return f"rm -rf {operands(f'{BUILD_ROOT}/{version}')}"


def module_dir(release: str) -> str:
    return f"/lib/modules/{release}/{MODULE_SUBDIR}"


def install_command(version: str, release: str | None) -> str:
    """Swap the built modules into /lib/modules/<rel>/updates/pvegpu-nvidia
    (templates/nvidia-install.sh.j2); depmod is the DEPMOD handler's (`declare_depmod`).
    release None: the release in the shell variable R (the kernel hook's)."""
    return render_template("nvidia-install.sh.j2", release=release, build_parent=f"{BUILD_ROOT}/{version}",
                           modules_dir="/lib/modules", module_subdir=MODULE_SUBDIR)


# --no-nouveau-check: GPUs this run gives to VMs or containers may still be on nouveau until the
# reboot that the boot stage's blacklist takes effect with; without it nvidia-installer aborts under
# --silent when nouveau is bound, after writing its own modprobe.d blacklist (nvidia-installer misc.c
# check_for_nouveau(), run by install-from-cwd.c with --no-kernel-modules too); gpu-driver-container
# passes it as well
USERSPACE_FLAGS = ("--silent", "--no-kernel-modules", "--no-nouveau-check")
INSTALLER_VERSION_RE = r"s/^nvidia-installer: *version *\([^ ]*\).*/\1/p"


def installer_version_command(installer: str, version: str) -> str:
    """Exit 1 naming both versions unless the .run says it is `version`.

    `sh <run> --version`: the .run's makeself header hands the option to the extracted
    nvidia-installer, which prints its NV_ID_STRING, "nvidia-installer:  version <v>"
    (nvidia-installer.c print_version()).
    """
    q = word
    # dash (the host's sh; src/options.c procargs) takes '--' as the end of its own options
    return (f"v=$(sh {operands(installer)} --version 2>/dev/null | sed -n {q(INSTALLER_VERSION_RE)} | head -n 1); "
            f"[ \"$v\" = {q(version)} ] || {{ echo {q('pvegpu: the NVIDIA installer ' + installer + ' is version ')}"
            f"\"'${{v:-unknown}}'\"{q(', but nvidia.version is ' + version + '; nothing was installed')} >&2; exit 1; }}")


def userspace_command(installer: str) -> str:
    return " ".join(["sh", operands(installer), *USERSPACE_FLAGS])


def verify_command(version: str, releases: list[str], firmware: bool, firmware_files: list[str] | None = None) -> str:
    """Exit 1 naming every component whose version is not `version` (incidents 2, 6;
    templates/nvidia-verify.sh.j2).

    firmware_files: the GSP files the host's GPUs load (each must be in
    /lib/firmware/nvidia/<version>/); without them, any gsp*.bin there.
    """
    return render_template("nvidia-verify.sh.j2", version=version, releases=list(releases), firmware=firmware,
                           firmware_files=list(firmware_files or []), lib_dirs=list(LIB_DIRS))


# -- operations ----------------------------------------------------------------------------

# One contract (issue 18 part 7): the plan (`plan.nvidia.driver_steps`) decides which steps run;
# `apply` calls an operation only for a step that runs and says why the others do not. Each
# operation always does its step.

@operation()
def fetch_source(url: str, sha256: str, dest: str):
    """Fetch a source archive to `dest` and check its sha256 before anything uses it.

    + url: https://…, file:///path or /path on the host
    + sha256: the archive's expected sha256 (64 hex)
    """
    yield StringCommand(fetch_source_command(url, sha256, dest))


@operation()
def build_modules(archive: str, version: str, release: str, cc: str, jobs: int, ccache: bool,
                  cxx: str | None = None, signing: tuple[str, str] | None = None, sig_hash: str = "sha256",
                  share_key: str | None = None, share_inputs: str | None = None):
    """Build the NVIDIA kernel modules for one kernel release in a scratch dir (not installed yet).

    + cxx: the C++ compiler for the open tree's src/ (None: the tree has no C++)
    + signing: (key, cert) paths on the host to sign the modules with, or None
    + sig_hash: the hash sign-file uses (the release's CONFIG_MODULE_SIG_HASH)
    + share_key: the build's key when the run shares builds (its unsigned modules are kept for others)
    + share_inputs: the inputs the key hashes (plan.build_share.inputs_text), recorded in the kept manifest
    """
    yield progress.reported(build_command(archive, version, release, cc, jobs, ccache, cxx=cxx, signing=signing,
                                          sig_hash=sig_hash, share_key=share_key, share_inputs=share_inputs), f"nvidia {version} build for {release}",
                            key=f"nvidia-{version}-{release}-{archive.rsplit('/', 1)[-1]}", log=f"{build_dir(version, release)}/build.log")
    if share_key:
        yield FunctionCommand(build_share.mark_built, (share_key,), {})


@operation()
def clean_builds(version: str):
    """Remove the scratch dirs of `version`'s builds once every release is installed."""
    yield StringCommand(cleanup_command(version))


@operation()
def install_modules(version: str, release: str):
    """Install the modules built for `release` (depmod follows once for all releases)."""
    yield StringCommand(install_command(version, release))


@operation()
def install_userspace(installer: str, version: str):
    """NVIDIA user space and GSP firmware of exactly the module version, without kernel modules
    (incidents 2, 6): the installer is the one source of the firmware (nvidia-installer installs
    its FIRMWARE entries into /lib/firmware/nvidia/<version>/ with --no-kernel-modules too)."""
    # the verified installer's directory is root's alone (templates/root-dir.sh.j2), checked before it runs
    yield StringCommand(root_dirs((installer.rsplit("/", 1)[0], PUBLIC)) + userspace_command(installer))


@operation()
def check_installer(installer: str, version: str):
    """Refuse, before anything is built or installed, a .run whose version is not `version`."""
    yield StringCommand(installer_version_command(installer, version))


@operation()
def verify_versions(version: str, releases: list[str], firmware: bool, firmware_files: list[str] | None = None):
    """Refuse to finish when modules, firmware (each file the GPUs load) and user space are not all `version`."""
    yield StringCommand(verify_command(version, releases, firmware, firmware_files))


# -- stage protocol ------------------------------------------------------------------------

def _releases(spec, state_running: str | None) -> tuple[list[str], set[str]]:
    """Target releases and those whose missing headers are a refusal (the running kernel's)."""
    explicit = spec.nvidia.releases
    kernel_stage = [spec.kernel.version] if spec.kernel is not None else []
    releases = nvplan.target_releases(state_running, kernel_stage, explicit)
    required = set(releases) if explicit else ({state_running} if state_running else set())
    return releases, required


def _sources(nv) -> dict:
    return {key: (src.url, src.sha256) for key, src in
            (("modules", nv.modules_source), ("installer", nv.installer)) if src is not None}


def state_kwargs(spec) -> dict:
    """`NvidiaHostState`'s arguments: the running release is probed by name at run time, plus
    the kernel stage's, the configured sources and the signing key/cert."""
    signing = spec.nvidia.signing
    return {"releases": _releases(spec, None)[0], "sources": _sources(spec.nvidia),
            "signing": [signing.key, signing.cert] if signing else []}


def _gpu_ids() -> dict[str, str]:
    """{bdf: device id} of the host's NVIDIA GPUs (the hardware probe, read once per run)."""
    hardware = fact_once(HardwareProbe)
    return nvplan.nvidia_gpu_ids(hardware.get("pci_devices") or {})


def _state_and_steps(spec) -> tuple[dict, list[str], dict]:
    nv = spec.nvidia
    state = fact_once(NvidiaHostState, **state_kwargs(spec))
    releases, required = _releases(spec, state["running"])
    steps = nvplan.driver_steps(nv.version, releases, state, modules_source=nv.modules_source,
                                installer=nv.installer, want_firmware=nv.firmware, required=required,
                                open_tree=nv.open, signing=nv.signing, gpu_ids=_gpu_ids())
    return state, releases, steps


def build_targets(spec) -> tuple[dict, list[str]]:
    """The `NvidiaHostState` reading and the releases this run builds the modules for, as this
    stage decides them (its own fact memo and `_releases`): the reboot stage weighs the next boot with them."""
    state = fact_once(NvidiaHostState, **state_kwargs(spec))
    return state, _releases(spec, state["running"])[0]


def prefetch(spec) -> list:
    """The facts this stage reads (deploy.py reads every stage's in one command)."""
    if spec.nvidia is None:
        return []
    share = [(BuildShareState, {"releases": state_kwargs(spec)["releases"]})] if build_share.sharing() else []
    return [(NvidiaHostState, state_kwargs(spec)), (HardwareProbe, {}), *progress.prefetch(),
            *handlers.prefetch(spec), *share]  # the depmod stamp (the stage flushes that handler itself)


def preflight(spec) -> list[str]:
    if spec.nvidia is None:
        return []
    refusals = []
    if not spec.nvidia.open:
        # only then is the hardware probe needed here (module_options reads it anyway; facts are cached)
        hardware = fact_once(HardwareProbe)
        models = {bdf: gpu.get("model") or "" for bdf, gpu in (hardware.get("nvidia_gpus") or {}).items()}
        problem = nvplan.open_modules_problem(False, nvplan.nvidia_gpu_ids(hardware.get("pci_devices") or {}), models)
        if problem:
            refusals.append(problem)
    _, _, steps = _state_and_steps(spec)
    return refusals + steps["refusals"]


@deploy("NVIDIA driver")
def apply(spec) -> None:
    if spec.nvidia is None:
        return
    nv = spec.nvidia
    state, releases, steps = _state_and_steps(spec)
    for note in steps["notes"]:
        logger.info(f"{host.name}: nvidia: {note}")
    modules_archive = cached_source(nv.modules_source) if nv.modules_source else None
    installer = cached_source(nv.installer) if nv.installer else None
    if nv.modules_source and modules_archive:
        _fetch_or_skip("modules", "modules source", nv.modules_source, modules_archive, steps, state["sources"])
    if nv.installer and installer:
        _fetch_or_skip("installer", "installer", nv.installer, installer, steps, state["sources"])
    if steps["install_userspace"]:
        check_installer(name=f"Check the NVIDIA installer is {nv.version}", installer=installer or "",
                        version=nv.version)
    building = [r for r in releases if steps["releases"][r]["build"]]
    # a run of several hosts: one build per input set (operations/build_share.py decides at execution)
    share = build_share.sharing()
    if share:
        build_share.register(spec, state, fact_once(BuildShareState, releases=state_kwargs(spec)["releases"]),
                             steps, releases)
    signing = (nv.signing.key, nv.signing.cert) if nv.signing else None
    for release in releases:
        entry = steps["releases"][release]
        if not entry["build"]:
            _skip(entry["reason"] or f"nvidia {nv.version} is current for {release}")
            continue
        build_modules(name=f"Build nvidia {nv.version} for {release}", archive=modules_archive or "",
                      version=nv.version, release=release, cc=entry["cc"] or "gcc", jobs=steps["jobs"],
                      ccache=steps["ccache"], cxx=entry["cxx"], signing=signing,
                      sig_hash=entry.get("sig_hash") or "sha256",
                      share_key=build_share.key_of(host.name, release) if share else None,
                      share_inputs=build_share.inputs_of(host.name, release) if share else None,
                      **({"_if": build_share.build_if(host.name, release)} if share else {}))
    if share:
        _receive_or_build(nv, building, steps, modules_archive or "", signing)
    for release in building:
        install_modules(name=f"Install nvidia {nv.version} modules for {release}", version=nv.version,
                        release=release)
    if building:
        clean_builds(name=f"Remove nvidia {nv.version} build dirs", version=nv.version)
    declare_depmod(nv.version, releases, steps, state)
    handlers.flush(handlers.DEPMOD)  # the version check below reads the index (modinfo -k <rel> nvidia)
    if steps["install_userspace"]:
        install_userspace(name=f"NVIDIA user space and GSP firmware {nv.version}", installer=installer or "",
                          version=nv.version)
    else:
        _skip(f"user space {nv.version} is installed (or no installer configured)")
    if nv.persistenced:
        _persistenced(state, will_install=steps["install_userspace"])
    loaded = (fact_once(HardwareProbe).get("nvidia_driver") or {}).get("version")
    reason = nvplan.reboot_reason(nv.version, loaded, state["running"], steps, state)
    if reason:
        need_reboot("nvidia", reason)
    if steps["verify"]:
        verify_versions(name=f"Check nvidia {nv.version}: modules, firmware, user space",
                        version=nv.version, releases=[r for r in releases if steps["releases"][r]["build"]
                                                      or (state["releases"].get(r) or {}).get("module")],
                        firmware=nv.firmware, firmware_files=steps["firmware_files"])
    else:
        _skip(f"nvidia {nv.version}: modules, firmware and user space unchanged and equal")


def _receive_or_build(nv, building: list[str], steps: dict, archive: str, signing) -> None:
    """In a run that shares builds: each release another host builds for this one is received
    (copied, verified, signed here); a copy that is refused or fails is built here after all."""
    for release in building:
        entry = steps["releases"][release]
        build_share.receive_modules(name=f"Receive nvidia {nv.version} for {release} from the run's build",
                                    version=nv.version, release=release, signing=signing,
                                    sig_hash=entry.get("sig_hash") or "sha256",
                                    _if=build_share.receive_if(host.name, release))
    for release in building:
        entry = steps["releases"][release]
        build_modules(name=f"Build nvidia {nv.version} for {release} here (the copy was not taken)", archive=archive,
                      version=nv.version, release=release, cc=entry["cc"] or "gcc", jobs=steps["jobs"],
                      ccache=steps["ccache"], cxx=entry["cxx"], signing=signing,
                      sig_hash=entry.get("sig_hash") or "sha256", share_key=build_share.key_of(host.name, release),
                      share_inputs=build_share.inputs_of(host.name, release),
                      _if=build_share.fallback_if(host.name, release))


def declare_depmod(version: str, releases: list[str], steps: dict, state: dict, target=None) -> None:
    """Each target release that has (or gets, this run) our modules depends on the DEPMOD handler;
    a release built this run is a reason to run it. The stamp holds the version per module dir,
    so a run that installed modules but stopped before depmod runs it next time."""
    for release in releases:
        build = steps["releases"][release]["build"]
        module = (state["releases"].get(release) or {}).get("module") or {}
        if build or module.get("version") == version:
            handlers.depends_on(handlers.DEPMOD, module_dir(release), f"nvidia {version}", "755", changed=build,
                                why=f"nvidia {version} modules installed for {release}", target=target)


def _skip(why: str) -> None:
    """A step the plan does not run, and why (the operation is not called: nothing to do)."""
    logger.info(f"{host.name}: nvidia: {why}")


def _fetch_or_skip(kind: str, label: str, source: SourceSpec, dest: str, steps: dict, sources: dict) -> None:
    """Fetch and verify `source` (`kind` "modules" or "installer") into `dest` when the plan's
    `fetch_<kind>` step runs and the host has no verified copy yet; else say it is there. Called
    once per kind from its own line: pyinfra tells operations apart by the call stack's line numbers."""
    if steps[f"fetch_{kind}"] and not sources.get(kind, {}).get("cached", False):
        fetch_source(name=f"Fetch and verify NVIDIA {label} {source_name(source.url)}",
                     url=source.url, sha256=source.sha256, dest=dest)
    else:
        _skip(f"{dest} is already fetched and verified")


def _persistenced(state: dict, will_install: bool) -> None:
    pers = state["persistenced"]
    unit = pers["unit"]
    if unit is None and not (pers["binary"] or will_install):
        logger.info(f"{host.name}: nvidia: nvidia-persistenced is not installed (it comes with the user space)")
        return
    if unit is None or unit == PERSISTENCED_UNIT:
        files = read_fact(ManagedFiles, paths=[PERSISTENCED_UNIT])
        content = render_template("nvidia-persistenced.service.j2")
        current = files.get(PERSISTENCED_UNIT)
        handlers.depends_on(handlers.DAEMON_RELOAD, PERSISTENCED_UNIT, content, "644",
                            changed=not file_current(current, content, "644"),
                            why="nvidia-persistenced unit changed")
        managed_file(name="nvidia-persistenced unit", path=PERSISTENCED_UNIT, content=content, mode="644",
                     state=current)
        unit = PERSISTENCED_UNIT
    if pers["enabled"]:
        _skip("nvidia-persistenced.service is enabled")
    else:
        link_unit(name="Enable nvidia-persistenced", link=f"{WANTS_DIR}/nvidia-persistenced.service", target=unit,
                  current=None)
