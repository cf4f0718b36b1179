"""Stage 3 — NVIDIA driver: kernel modules (open, or the proprietary tree when nvidia.open is
false and no GPU is Blackwell) built for each target kernel, GSP firmware and
user space of exactly the same version (DESIGN.md §2.3; incidents 1, 2, 6, 14).

Order on the host (each step runs only when the facts say it is needed, so a converged host
costs two fact commands and no change):

    fetch + sha256-check sources  ->  build modules per release (scratch dir)  ->  GSP firmware
    ->  install modules + depmod per release  ->  user space (.run --no-kernel-modules)
    ->  nvidia-persistenced  ->  verify module/firmware/user-space versions are equal

A failed step stops the host there: a wrong checksum stops before any build, a failed build
before any install. Refusals (toolchain, firmware, local checksum, version mismatch) come from
`preflight` and stop the whole run before a single change.

Host paths:
    /var/cache/pvegpu/sources/<sha256>-<name>   verified source archives
    /var/cache/pvegpu/ccache                    ccache of module builds (rebuilds are warm)
    /var/cache/pvegpu/nvidia-conftest/<key>.tgz NVIDIA conftest results per (tree, headers, compiler)
    /var/tmp/pvegpu/nvidia-build/<ver>/<rel>/    scratch build trees (removed after install)
    /lib/modules/<rel>/updates/pvegpu-nvidia/    installed modules (depmod prefers updates/)
"""

from __future__ import annotations

import re
import shlex

from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation

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
from facts.once import fact_once
from operations import progress
from operations.files import managed_file
from plan import nvidia as nvplan
from plan.render import render_template

CCACHE_DIR = "/var/cache/pvegpu/ccache"
BUILD_ROOT = "/var/tmp/pvegpu/nvidia-build"
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
# host data a kernel stage sets to the releases it installs (list of str)
KERNEL_RELEASES_KEY = "pvegpu_kernel_releases"
# host data that replaces the target releases (list of str) when the spec's nvidia.releases
# is not set, e.g. for a twin whose booted kernel has no headers
EXPLICIT_RELEASES_KEY = "pvegpu_nvidia_releases"


# -- sources -------------------------------------------------------------------------------

def cached_source(source) -> str:
    """Where a verified copy of `source` (url, sha256) lives on the host."""
    return f"{SOURCE_CACHE}/{source.sha256}-{source_name(source.url)}"


def fetch_source_command(url: str, sha256: str, dest: str) -> str:
    """Copy or download `url` to `dest`, moving it into place only when its sha256 matches.

    A mismatch removes the partial file and exits 1 with a message naming both checksums.
    """
    q_dest, q_part = shlex.quote(dest), shlex.quote(dest + ".part")
    path = local_path(url)
    if path is not None:
        get = f"cp -f {shlex.quote(path)} {q_part}"
    else:
        q_url = shlex.quote(url)
        get = (f"if command -v curl >/dev/null 2>&1; then curl -fsSL --retry 3 -o {q_part} {q_url}; "
               f"else wget -q -O {q_part} {q_url}; fi")
    message = shlex.quote(f"pvegpu: checksum mismatch for {url}: the spec says {sha256}, the file has ")
    tail = shlex.quote("; nothing was built or installed")
    return (
        f"set -e; [ -f {q_dest} ] && exit 0; mkdir -p {shlex.quote(dest.rsplit('/', 1)[0])}; "
        f"rm -f {q_part}; {get}; got=$(sha256sum {q_part} | cut -d' ' -f1); "
        f"if [ \"$got\" != {shlex.quote(sha256)} ]; then rm -f {q_part}; "
        f"echo {message}\"$got\"{tail} >&2; exit 1; fi; mv -f {q_part} {q_dest}"
    )


# -- build and install ---------------------------------------------------------------------

def build_dir(version: str, release: str) -> str:
    return f"{BUILD_ROOT}/{version}/{release}"


def conftest_key_command(archive: str, release: str, cc: str, make_args: str = "",
                         modules_dir: str = "/lib/modules") -> str:
    """Shell that prints the sha256 naming the conftest results of one build.

    The results depend on the NVIDIA tree (its conftest.sh and Kbuild: the archive), the kernel
    headers (the release's build and source trees, kbuild scripts included through their
    symlinks: every file's path, size and mtime, plus include/config/auto.conf itself), the
    compiler (its full `-v` banner and the driver and cc1 binaries' size and mtime), the
    machine and `make_args` (the variables `make` gets). Any change there gives a new key, so a
    rebuild never reads stale results.
    """
    r, c, m = shlex.quote(release), shlex.quote(cc), shlex.quote(modules_dir)
    return (
        f"( set +e; sha256sum < {shlex.quote(archive)}; echo {r} {shlex.quote(make_args)}; uname -m; {c} -v 2>&1; "
        f"stat -L -c '%n %s %Y' \"$(command -v {c})\" \"$({c} -print-prog-name=cc1)\"; "
        f"cat {m}/{r}/build/include/config/auto.conf; "
        f"for d in {m}/{r}/build {m}/{r}/source; do [ -d \"$d\" ] || continue; "
        "echo \"tree $d\"; ( cd -P \"$d\" && find -L . -type f -printf '%P %s %T@\\n' | LC_ALL=C sort ); done; "
        ") 2>&1 | sha256sum | cut -c1-64"
    )


def src_dir(version: str, cc: str, cxx: str | None) -> str:
    """The unpacked open tree whose src/ objects every release of one build run shares."""
    return f"{BUILD_ROOT}/{version}/tree-{re.sub(r'[^A-Za-z0-9._+-]', '_', cc)}-{re.sub(r'[^A-Za-z0-9._+-]', '_', cxx or 'none')}"


def build_command(archive: str, version: str, release: str, cc: str, jobs: int, ccache: bool,
                  conftest_cache: bool = True, cxx: str | None = None,
                  signing: tuple[str, str] | None = None) -> str:
    """Build the NVIDIA modules for `release` in a fresh scratch dir; the .ko files land in <scratch>/out.

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
    scripts/sign-file (sha256), in that order: stripping after signing would drop the signature.
    Nothing outside the scratch dirs, the ccache and the conftest cache is touched.

    conftest_cache: before `make`, restore kernel-open/conftest/ from a previous successful
    build with the same `conftest_key_command` key (mtimes kept, so NVIDIA's Kbuild finds every
    result newer than conftest.sh and reruns only its always-run checks); after a successful
    build, store this build's conftest/ under its key.
    """
    b = shlex.quote(build_dir(version, release))
    # ccache by masquerade (/usr/lib/ccache/<cc> first on PATH): NVIDIA's conftest.sh runs
    # "$CC" quoted, so CC="ccache gcc-12" makes every conftest fail.
    compiler = cc
    make_args = f"modules KERNEL_UNAME={shlex.quote(release)} CC={shlex.quote(compiler)}"
    src_args = f"CC={shlex.quote(compiler)}" + (f" CXX={shlex.quote(cxx)}" if cxx else "")
    if cxx:
        make_args += f" CXX={shlex.quote(cxx)}"
    env = (f"PATH={CCACHE_MASQUERADE}:$PATH CCACHE_DIR={shlex.quote(CCACHE_DIR)} "
           f"CCACHE_IGNOREOPTIONS={shlex.quote(CCACHE_IGNORE_OPTIONS)} " if ccache else "")
    fail = shlex.quote(f"pvegpu: building nvidia {version} for {release} failed; installed modules are untouched")
    t = shlex.quote(src_dir(version, compiler, cxx))
    stamp_key = (f"{{ sha256sum < {shlex.quote(archive)}; echo {shlex.quote(src_args)}; {shlex.quote(compiler)} -v 2>&1; "
                 + (f"{shlex.quote(cxx)} -v 2>&1; " if cxx else "") + "} | sha256sum | cut -c1-64")
    sign = ""
    if signing:
        key, cert = (shlex.quote(x) for x in signing)
        sign = (f"sf=/lib/modules/{shlex.quote(release)}/build/{SIGN_FILE}; [ -x \"$sf\" ] || "
                f"{{ echo {shlex.quote(f'pvegpu: kernel {release} headers have no {SIGN_FILE} to sign modules with')} >&2; exit 1; }}; "
                f"for m in \"$B\"/out/*.ko; do \"$sf\" sha256 {key} {cert} \"$m\"; done; ")
    log = shlex.quote(f"{BUILD_ROOT}.log")  # what each build did, kept on the host (a line per step)
    return (
        f"set -e; B={b}; T={t}; L={log}; rm -rf \"$B\"; mkdir -p \"$B/out\"; "
        f"{'mkdir -p ' + shlex.quote(CCACHE_DIR) + '; ' if ccache else ''}"
        f"want=$( {stamp_key} ); "
        # a shared open tree of this archive and these compilers: reuse its src/ objects
        "if [ \"$(cat \"$T/.pvegpu-src-built\" 2>/dev/null)\" = \"$want\" ]; then top=$T/tree; src_note=', src/ objects reused'; "
        "else src_note=; rm -rf \"$B/src\"; mkdir -p \"$B/src\"; tar -xf " + shlex.quote(archive) + " -C \"$B/src\"; "
        "top=\"$B/src\"; set -- \"$B\"/src/*; [ $# -eq 1 ] && [ -d \"$1\" ] && top=$1; "
        "if [ -d \"$top/kernel-open\" ] && [ -d \"$top/src/nvidia\" ]; then "
        "rm -rf \"$T\"; mkdir -p \"$T\"; mv \"$top\" \"$T/tree\"; rm -rf \"$B/src\"; top=$T/tree; "
        f"echo \"pvegpu: building nvidia {version} src/ (nv-kernel.o, nv-modeset-kernel.o) with {compiler}{' and ' + cxx if cxx else ''}\" | tee -a \"$L\"; "
        f"if ! {env}make -C \"$top\" -j{int(jobs)} {src_args} kernel-open/nvidia/nv-kernel.o_binary "
        "kernel-open/nvidia-modeset/nv-modeset-kernel.o_binary >\"$B/build.log\" 2>&1; then "
        f"tail -n 40 \"$B/build.log\" >&2; echo {fail} >&2; exit 1; fi; "
        "echo \"$want\" > \"$T/.pvegpu-src-built\"; fi; fi; "
        # the open tree: this release's own copy of kernel-open/ beside the shared src/ objects
        "if [ \"$top\" = \"$T/tree\" ]; then ko=$B/kernel-open; mk=$ko; cp -a \"$top/kernel-open\" \"$ko\"; "
        "for l in nvidia/nv-kernel.o_binary nvidia-modeset/nv-modeset-kernel.o_binary; do "
        "ln -sfn \"$(readlink -f \"$top/kernel-open/$l\")\" \"$ko/$l\"; done; "
        "elif [ -f \"$top/kernel-open/Kbuild\" ]; then mk=$top/kernel-open; ko=$mk; "
        "else kb=$(find \"$top\" -maxdepth 3 -name Kbuild | awk '{print length, $0}' | sort -n | head -n 1 | cut -d' ' -f2-); "
        "[ -n \"$kb\" ] || { echo 'pvegpu: no NVIDIA kernel module tree (Kbuild) in the source archive' >&2; exit 1; }; "
        "mk=${kb%/Kbuild}; ko=$mk; fi; "
        + (f"key=$( {conftest_key_command(archive, release, compiler, make_args)} ); "
           f"ct={shlex.quote(CONFTEST_CACHE)}/$key.tgz; ct_note=; "
           # gzip checks length and CRC: a damaged archive is dropped with whatever it unpacked, and the tests run again
           "if [ -f \"$ct\" ]; then if tar -C \"$ko\" -xf \"$ct\"; then ct_note=', conftest results restored'; "
           "else rm -rf \"$ko/conftest\" \"$ct\"; fi; fi; "
           if conftest_cache else "")
        + f"echo \"pvegpu: building nvidia {version} for {release} in $mk with {compiler}{' (ccache)' if ccache else ''}, -j{int(jobs)}"
        + "$src_note" + ("$ct_note" if conftest_cache else "") + "\" | tee -a \"$L\"; "
        f"if ! {env}make -C \"$mk\" -j{int(jobs)} {make_args} "
        f">>\"$B/build.log\" 2>&1; then tail -n 40 \"$B/build.log\" >&2; echo {fail} >&2; exit 1; fi; "
        "cp \"$ko\"/*.ko \"$B/out/\"; "
        f"vm=$(modinfo -F vermagic \"$B/out/nvidia.ko\"); case \"$vm\" in {shlex.quote(release)}\\ *) ;; *) "
        f"echo \"pvegpu: built nvidia.ko has vermagic '$vm', not {release}\" >&2; exit 1;; esac; "
        # INSTALL_MOD_STRIP=1 (kernel scripts/Makefile.modinst): strip --strip-debug, before signing
        "strip --strip-debug \"$B\"/out/*.ko; "
        + sign
        + ("if [ ! -f \"$ct\" ] && [ -d \"$ko/conftest\" ]; then "
           f"mkdir -p {shlex.quote(CONFTEST_CACHE)}; tar -C \"$ko\" -czf \"$ct.part\" conftest && mv -f \"$ct.part\" \"$ct\"; "
           f"ls -1t {shlex.quote(CONFTEST_CACHE)}/*.tgz | tail -n +{CONFTEST_CACHE_KEEP + 1} | xargs -r rm -f; fi; "
           if conftest_cache else "")
        + "rm -rf \"$B/kernel-open\" \"$B/src\""
    )


def cleanup_command(version: str) -> str:
    """Remove every scratch dir of `version`'s builds (the shared src/ tree included)."""
    return f"rm -rf {shlex.quote(f'{BUILD_ROOT}/{version}')}"


def install_command(version: str, release: str) -> str:
    """Swap the built modules into /lib/modules/<rel>/updates/pvegpu-nvidia and run depmod."""
    b = shlex.quote(build_dir(version, release))
    d = shlex.quote(f"/lib/modules/{release}/{MODULE_SUBDIR}")
    return (
        f"set -e; B={b}; D={d}; [ -f \"$B/out/nvidia.ko\" ] || "
        f"{{ echo 'pvegpu: no built nvidia.ko in '\"$B/out\" >&2; exit 1; }}; "
        "rm -rf \"$D.new\" \"$D.old\"; mkdir -p \"$D.new\"; install -m 644 \"$B\"/out/*.ko \"$D.new/\"; "
        "if [ -d \"$D\" ]; then mv \"$D\" \"$D.old\"; fi; mv \"$D.new\" \"$D\"; rm -rf \"$D.old\"; "
        f"depmod {shlex.quote(release)}; rm -rf \"$B\""
    )


def verify_command(version: str, releases: list[str], firmware: bool, firmware_files: list[str] | None = None) -> str:
    """Exit 1 naming every component whose version is not `version` (incidents 2, 6).

    firmware_files: the GSP files the host's GPUs load (each must be in
    /lib/firmware/nvidia/<version>/); without them, any gsp*.bin there.
    """
    v = shlex.quote(version)
    parts = ["bad=0"]
    for release in releases:
        r = shlex.quote(release)
        parts.append(
            f"m=$(modinfo -k {r} -F version nvidia 2>/dev/null || true); "
            f"[ \"$m\" = {v} ] || {{ echo \"pvegpu: kernel {release}: nvidia module is '${{m:-missing}}', want {version}\" >&2; bad=1; }}"
        )
    if firmware:
        fw = shlex.quote(f"/lib/firmware/nvidia/{version}")
        if firmware_files:
            for name in firmware_files:
                f = shlex.quote(f"/lib/firmware/nvidia/{version}/{name}")
                parts.append(f"[ -e {f} ] || {{ echo \"pvegpu: GSP firmware {version}/{name} missing in {fw}\" >&2; bad=1; }}")
        else:
            parts.append(f"set -- {fw}/gsp*.bin; [ -e \"$1\" ] || {{ echo \"pvegpu: GSP firmware {version} missing in {fw}\" >&2; bad=1; }}")
    libs = " ".join(f"{d}/libnvidia-ml.so.*.*" for d in LIB_DIRS)
    parts.append(
        f"for f in {libs}; do [ -e \"$f\" ] || continue; case \"$f\" in *.so.{v}) ;; *) "
        "echo \"pvegpu: user space $f is not " + version + "\" >&2; bad=1;; esac; done"
    )
    parts.append("[ $bad = 0 ] || { echo 'pvegpu: NVIDIA versions differ; the stage did not finish' >&2; exit 1; }")
    return "; ".join(parts)


# -- operations ----------------------------------------------------------------------------

@operation()
def fetch_source(url: str, sha256: str, dest: str, cached: bool = False):
    """Fetch a source archive to `dest` and check its sha256 before anything uses it.

    + url: https://…, file:///path or /path on the host
    + sha256: the archive's expected sha256 (64 hex)
    + cached: the fact saw `dest` already (it is only ever renamed there after a check)
    """
    if cached:
        host.noop(f"{dest} is already fetched and verified")
        return
    yield StringCommand(fetch_source_command(url, sha256, dest))


@operation()
def build_modules(archive: str, version: str, release: str, cc: str, jobs: int, ccache: bool,
                  build: bool = True, reason: str = "", cxx: str | None = None,
                  signing: tuple[str, str] | None = None):
    """Build the NVIDIA kernel modules for one kernel release in a scratch dir (not installed yet).

    + cxx: the C++ compiler for the open tree's src/ (None: the tree has no C++)
    + signing: (key, cert) paths on the host to sign the modules with, or None
    """
    if not build:
        host.noop(reason or f"nvidia {version} is current for {release}")
        return
    yield progress.reported(build_command(archive, version, release, cc, jobs, ccache, cxx=cxx, signing=signing), f"nvidia {version} build for {release}",
                            key=f"nvidia-{version}-{release}-{archive.rsplit('/', 1)[-1]}", log=f"{build_dir(version, release)}/build.log")


@operation()
def clean_builds(version: str, run: bool = True):
    """Remove the scratch dirs of `version`'s builds once every release is installed."""
    if not run:
        host.noop(f"no nvidia {version} build to clean up")
        return
    yield StringCommand(cleanup_command(version))


@operation()
def install_modules(version: str, release: str, install: bool = True):
    """Install the modules built for `release` and run depmod for that release."""
    if not install:
        host.noop(f"nvidia {version} modules for {release} are installed")
        return
    yield StringCommand(install_command(version, release))


@operation()
def install_userspace(installer: str, version: str, install: bool = True):
    """NVIDIA user space and GSP firmware of exactly the module version, without kernel modules
    (incidents 2, 6): the installer is the one source of the firmware (nvidia-installer installs
    its FIRMWARE entries into /lib/firmware/nvidia/<version>/ with --no-kernel-modules too)."""
    if not install:
        host.noop(f"user space {version} is installed (or no installer configured)")
        return
    yield StringCommand(f"sh {shlex.quote(installer)} --silent --no-kernel-modules")


@operation()
def enable_unit(unit: str, enabled: bool, unit_path: str):
    """Enable a unit for multi-user.target by its wants link (works with systemd not running)."""
    if enabled:
        host.noop(f"{unit} is enabled")
        return
    link = f"{WANTS_DIR}/{unit}"
    yield StringCommand(f"mkdir -p {shlex.quote(WANTS_DIR)} && ln -sfn {shlex.quote(unit_path)} {shlex.quote(link)}")


@operation()
def verify_versions(version: str, releases: list[str], firmware: bool, run: bool = True,
                    firmware_files: list[str] | None = None):
    """Refuse to finish when modules, firmware (each file the GPUs load) and user space are not all `version`."""
    if not run:
        host.noop(f"nvidia {version}: modules, firmware and user space unchanged and equal")
        return
    yield StringCommand(verify_command(version, releases, firmware, firmware_files))


# -- stage protocol ------------------------------------------------------------------------

def _releases(spec, state_running: str | None) -> tuple[list[str], set[str]]:
    """Target releases and those whose missing headers are a refusal (the running kernel's)."""
    explicit = spec.nvidia.releases or host.data.get(EXPLICIT_RELEASES_KEY)
    kernel_stage = list(host.data.get(KERNEL_RELEASES_KEY) or [])
    if spec.kernel is not None and spec.kernel.version not in kernel_stage:
        kernel_stage.append(spec.kernel.version)
    releases = nvplan.target_releases(state_running, kernel_stage, explicit)
    required = set(releases) if explicit else ({state_running} if state_running else set())
    return releases, required


def _sources(nv) -> dict:
    return {key: (src.url, src.sha256) for key, src in
            (("modules", nv.modules_source), ("installer", nv.installer)) if src is not None}


def _state_kwargs(spec) -> dict:
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
    state = fact_once(NvidiaHostState, **_state_kwargs(spec))
    releases, required = _releases(spec, state["running"])
    steps = nvplan.driver_steps(nv.version, releases, state, modules_source=nv.modules_source,
                                installer=nv.installer, want_firmware=nv.firmware, required=required,
                                open_tree=nv.open, signing=nv.signing, gpu_ids=_gpu_ids())
    return state, releases, steps


def prefetch(spec) -> list:
    """The facts this stage reads (deploy.py reads every stage's in one command)."""
    if spec.nvidia is None:
        return []
    return [(NvidiaHostState, _state_kwargs(spec)), (HardwareProbe, {}), *progress.prefetch()]


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
    sources = state["sources"]
    if nv.modules_source and modules_archive:
        fetch_source(name=f"Fetch and verify NVIDIA modules source {source_name(nv.modules_source.url)}",
                     url=nv.modules_source.url, sha256=nv.modules_source.sha256, dest=modules_archive,
                     cached=not steps["fetch_modules"] or sources.get("modules", {}).get("cached", False))
    if nv.installer and installer:
        fetch_source(name=f"Fetch and verify NVIDIA installer {source_name(nv.installer.url)}",
                     url=nv.installer.url, sha256=nv.installer.sha256, dest=installer,
                     cached=not steps["fetch_installer"] or sources.get("installer", {}).get("cached", False))
    for release in releases:
        entry = steps["releases"][release]
        build_modules(name=f"Build nvidia {nv.version} for {release}", archive=modules_archive or "",
                      version=nv.version, release=release, cc=entry["cc"] or "gcc", jobs=steps["jobs"],
                      ccache=steps["ccache"], build=entry["build"], reason=entry["reason"], cxx=entry["cxx"],
                      signing=(nv.signing.key, nv.signing.cert) if nv.signing else None)
    for release in releases:
        install_modules(name=f"Install nvidia {nv.version} modules for {release}", version=nv.version,
                        release=release, install=steps["releases"][release]["build"])
    clean_builds(name=f"Remove nvidia {nv.version} build dirs", version=nv.version,
                 run=any(steps["releases"][r]["build"] for r in releases))
    install_userspace(name=f"NVIDIA user space and GSP firmware {nv.version}", installer=installer or "", version=nv.version,
                      install=steps["install_userspace"])
    if nv.persistenced:
        _persistenced(state, will_install=steps["install_userspace"])
    verify_versions(name=f"Check nvidia {nv.version}: modules, firmware, user space",
                    version=nv.version, releases=[r for r in releases if steps["releases"][r]["build"]
                                                  or (state["releases"].get(r) or {}).get("module")],
                    firmware=nv.firmware, firmware_files=steps["firmware_files"], run=steps["verify"])


def _persistenced(state: dict, will_install: bool) -> None:
    pers = state["persistenced"]
    unit = pers["unit"]
    if unit is None and not (pers["binary"] or will_install):
        logger.info(f"{host.name}: nvidia: nvidia-persistenced is not installed (it comes with the user space)")
        return
    if unit is None or unit == PERSISTENCED_UNIT:
        files = host.get_fact(ManagedFiles, paths=[PERSISTENCED_UNIT])
        managed_file(name="nvidia-persistenced unit", path=PERSISTENCED_UNIT,
                     content=render_template("nvidia-persistenced.service.j2"), mode="644",
                     state=files.get(PERSISTENCED_UNIT))
        unit = PERSISTENCED_UNIT
    enable_unit(name="Enable nvidia-persistenced", unit="nvidia-persistenced.service",
                enabled=pers["enabled"], unit_path=unit)
