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
from pyinfra.api import FactBase, StringCommand, deploy, operation

from facts.files import ManagedFiles
from facts.hardware import HardwareProbe
from facts.kernel import split_sections
from facts.once import fact_once
from operations import progress
from operations.files import managed_file
from plan import nvidia as nvplan
from plan.render import render_template

SOURCE_CACHE = "/var/cache/pvegpu/sources"
CCACHE_DIR = "/var/cache/pvegpu/ccache"
BUILD_ROOT = "/var/tmp/pvegpu/nvidia-build"
CCACHE_MASQUERADE = "/usr/lib/ccache"
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
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
PERSISTENCED_UNIT = "/etc/systemd/system/nvidia-persistenced.service"
PERSISTENCED_UNIT_DIRS = ("/etc/systemd/system", "/lib/systemd/system", "/usr/lib/systemd/system")
WANTS_DIR = "/etc/systemd/system/multi-user.target.wants"
SECTION = "@@ "
# sign-file in a release's headers: Debian links scripts/ into linux-kbuild; Proxmox copies the built
# scripts/ into proxmox-headers (follows pve-kernel debian/rules, the headers package target)
SIGN_FILE = "scripts/sign-file"
# kernel options the driver preflight reads from each release's include/config/auto.conf
KERNEL_CONFIG_KEYS = ("CONFIG_OBJTOOL_WERROR", "CONFIG_MITIGATION_RETHUNK", "CONFIG_RETHUNK",
                      "CONFIG_MODULE_SIG", "CONFIG_MODULE_SIG_FORCE")
# EFI global variable GUID 8be4df61-…: SecureBoot (UEFI spec; what mokutil --sb-state reads)
SECURE_BOOT_EFIVAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
# host data a kernel stage sets to the releases it installs (list of str)
KERNEL_RELEASES_KEY = "pvegpu_kernel_releases"
# host data that replaces the target releases (list of str) when the spec's nvidia.releases
# is not set, e.g. for a twin whose booted kernel has no headers
EXPLICIT_RELEASES_KEY = "pvegpu_nvidia_releases"


# -- sources -------------------------------------------------------------------------------

def source_name(url: str) -> str:
    """A file name for a source URL or path: its last path segment, reduced to safe characters."""
    last = re.split(r"[/?#]", url.rstrip("/").split("://", 1)[-1].split("?", 1)[0])[-1]
    return re.sub(r"[^A-Za-z0-9._+-]", "_", last) or "source"


def cached_source(source) -> str:
    """Where a verified copy of `source` (url, sha256) lives on the host."""
    return f"{SOURCE_CACHE}/{source.sha256}-{source_name(source.url)}"


def local_path(url: str) -> str | None:
    """The host path of a local source (`/path` or `file:///path`), None for a remote URL."""
    if url.startswith("file://"):
        return url[len("file://"):]
    if url.startswith("/"):
        return url
    return None


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
    return render_template("nvidia-conftest-key.sh.j2", archive=archive, release=release, cc=cc,
                           make_args=make_args, modules_dir=modules_dir)


def src_dir(version: str, cc: str, cxx: str | None) -> str:
    """The unpacked open tree whose src/ objects every release of one build run shares."""
    return f"{BUILD_ROOT}/{version}/tree-{re.sub(r'[^A-Za-z0-9._+-]', '_', cc)}-{re.sub(r'[^A-Za-z0-9._+-]', '_', cxx or 'none')}"


def build_command(archive: str, version: str, release: str, cc: str, jobs: int, ccache: bool,
                  conftest_cache: bool = True, cxx: str | None = None,
                  signing: tuple[str, str] | None = None) -> str:
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
    scripts/sign-file (sha256), in that order: stripping after signing would drop the signature.
    Nothing outside the scratch dirs, the ccache and the conftest cache is touched.

    conftest_cache: before `make`, restore kernel-open/conftest/ from a previous successful
    build with the same `conftest_key_command` key (mtimes kept, so NVIDIA's Kbuild finds every
    result newer than conftest.sh and reruns only its always-run checks); after a successful
    build, store this build's conftest/ under its key.
    """
    # ccache by masquerade (/usr/lib/ccache/<cc> first on PATH): NVIDIA's conftest.sh runs
    # "$CC" quoted, so CC="ccache gcc-12" makes every conftest fail.
    return render_template(
        "nvidia-build.sh.j2", archive=archive, version=version, release=release, cc=cc, cxx=cxx, jobs=int(jobs),
        ccache=ccache, conftest_cache=conftest_cache, signing=tuple(signing) if signing else None,
        build_root=BUILD_ROOT, build_dir=build_dir(version, release), src_dir=src_dir(version, cc, cxx),
        ccache_dir=CCACHE_DIR, ccache_masquerade=CCACHE_MASQUERADE, ccache_ignore_options=CCACHE_IGNORE_OPTIONS,
        conftest_cache_dir=CONFTEST_CACHE, conftest_cache_keep=CONFTEST_CACHE_KEEP, sign_file=SIGN_FILE,
        modules_dir="/lib/modules")


def cleanup_command(version: str) -> str:
    """Remove every scratch dir of `version`'s builds (the shared src/ tree included)."""
    return f"rm -rf {shlex.quote(f'{BUILD_ROOT}/{version}')}"


def install_command(version: str, release: str) -> str:
    """Swap the built modules into /lib/modules/<rel>/updates/pvegpu-nvidia and run depmod
    (templates/nvidia-install.sh.j2)."""
    return render_template("nvidia-install.sh.j2", build_dir=build_dir(version, release), release=release,
                           module_dir=f"/lib/modules/{release}/{MODULE_SUBDIR}")


def verify_command(version: str, releases: list[str], firmware: bool, firmware_files: list[str] | None = None) -> str:
    """Exit 1 naming every component whose version is not `version` (incidents 2, 6;
    templates/nvidia-verify.sh.j2).

    firmware_files: the GSP files the host's GPUs load (each must be in
    /lib/firmware/nvidia/<version>/); without them, any gsp*.bin there.
    """
    return render_template("nvidia-verify.sh.j2", version=version, releases=list(releases), firmware=firmware,
                           firmware_files=list(firmware_files or []), lib_dirs=list(LIB_DIRS))


# -- the stage-local fact ------------------------------------------------------------------

class NvidiaHostState(FactBase):
    """Everything the driver stage decides from, in one command.

    + releases: target kernel releases
    + sources: ``{"modules": (url, sha256), "installer": (url, sha256)}`` (configured ones)

    .. code:: python

        {"cores": 2, "mem_total_kib": 24576000, "running": "6.1.0-57-amd64", "ccache": True,
         "compilers": {"gcc": "gcc (Debian 12.2.0-14+deb12u1) 12.2.0", "gcc-12": "gcc-12 (…) 12.2.0"},
         "releases": {"6.1.0-57-amd64": {
             "headers": True, "cc_version_text": "gcc-12 (Debian 12.2.0-14+deb12u1) 12.2.0",
             "module": {"version": "535.309.01", "vermagic": "6.1.0-57-amd64 SMP …",
                        "filename": "/lib/modules/6.1.0-57-amd64/updates/pvegpu-nvidia/nvidia.ko"}}},
         "firmware": {"535.261.03": ["gsp_ga10x.bin", "gsp_tu10x.bin"]},
         "userspace": ["/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.595.71.05"],
         "persistenced": {"binary": True, "unit": "/lib/systemd/system/nvidia-persistenced.service",
                          "enabled": False},
         "sources": {"modules": {"cached": False, "sha256": "…"}}}   # sha256 of a local path

    ``module`` is None when `modinfo -k <rel> nvidia` finds none.
    """

    def command(self, releases: list[str], sources: dict | None = None, signing: list[str] | None = None) -> str:
        parts = [
            f"echo '{SECTION}cores'; nproc",
            f"echo '{SECTION}meminfo'; grep '^MemTotal:' /proc/meminfo",
            f"echo '{SECTION}running'; k=$(uname -r); echo \"$k\"",
            f"echo '{SECTION}ccache'; command -v ccache >/dev/null && [ -d {CCACHE_MASQUERADE} ] && echo {CCACHE_MASQUERADE}",
            f"echo '{SECTION}compilers'; for c in /usr/bin/gcc /usr/bin/gcc-[0-9]* /usr/bin/g++ /usr/bin/g++-[0-9]*; do "
            "[ -x \"$c\" ] && echo \"${c##*/}: $(\"$c\" --version 2>/dev/null | head -n 1)\"; done",
        ]
        # the running release ($k, named at run time), then each target; each release once,
        # one modinfo per release (its version/vermagic/filename lines)
        targets = " ".join(['"$k"', *[shlex.quote(r) for r in releases]])
        parts.append(
            f"seen=; for r in {targets}; do "
            '[ -n "$r" ] || continue; case " $seen " in *" $r "*) continue;; esac; seen="$seen $r"; '
            f"b=/lib/modules/$r/build; echo \"{SECTION}release $r\"; "
            "[ -f \"$b/Makefile\" ] && echo 'headers: yes' || echo 'headers: no'; "
            "grep -h -m 1 '^CONFIG_CC_VERSION_TEXT=' \"$b/include/config/auto.conf\" \"$b/.config\" 2>/dev/null | head -n 1; "
            # the options preflight weighs: objtool -Werror with return thunks, module signing
            f"grep -h -E '^({'|'.join(KERNEL_CONFIG_KEYS)})=' \"$b/include/config/auto.conf\" 2>/dev/null | sed 's/^/config /'; "
            f"[ -x \"$b/{SIGN_FILE}\" ] && echo 'sign-file: yes'; "
            "modinfo -k \"$r\" nvidia 2>/dev/null | while read -r key value; do "
            'case "$key" in version:|vermagic:|filename:) echo "module $key $value";; esac; done; '
            "done"
        )
        # Secure Boot: mokutil's verdict, else the EFI variable's last byte (follows nvidia-installer
        # misc.c secure_boot_enabled(): the low bit of the variable's last byte)
        parts.append(f"echo '{SECTION}secureboot'; command -v mokutil >/dev/null 2>&1 && mokutil --sb-state 2>&1; "
                     f"if [ -r {SECURE_BOOT_EFIVAR} ]; then echo \"efivar $(od -An -v -t u1 {SECURE_BOOT_EFIVAR} | tr -s ' ' '\\n' | tail -n 1)\"; "
                     "elif [ -d /sys/firmware/efi ]; then echo 'efi without SecureBoot variable'; else echo 'no efi'; fi")
        for path in signing or ():
            parts.append(f"echo {shlex.quote(SECTION + 'signing ' + path)}; [ -r {shlex.quote(path)} ] && echo readable")
        parts.append(f"echo '{SECTION}firmware'; for f in /lib/firmware/nvidia/*/gsp*.bin*; do [ -e \"$f\" ] && echo \"$f\"; done")
        libs = " ".join(f"{d}/libnvidia-ml.so.*" for d in LIB_DIRS)
        parts.append(f"echo '{SECTION}userspace'; for f in {libs}; do [ -e \"$f\" ] && echo \"$f\"; done")
        units = " ".join(f"{d}/nvidia-persistenced.service" for d in PERSISTENCED_UNIT_DIRS)
        parts.append(
            f"echo '{SECTION}persistenced'; command -v nvidia-persistenced >/dev/null 2>&1 && echo binary; "
            f"for u in {units}; do [ -f \"$u\" ] && echo \"unit $u\"; done; "
            f"[ -e {WANTS_DIR}/nvidia-persistenced.service ] && echo enabled"
        )
        for key, (url, sha256) in sorted((sources or {}).items()):
            dest = shlex.quote(f"{SOURCE_CACHE}/{sha256}-{source_name(url)}")
            local = local_path(url)
            check = (f"elif [ -f {shlex.quote(local)} ]; then echo \"sha256 $(sha256sum < {shlex.quote(local)} | cut -d' ' -f1)\"; "
                     if local else "")
            parts.append(f"echo {shlex.quote(SECTION + 'source ' + key)}; if [ -f {dest} ]; then echo cached; "
                         f"{check}else echo absent; fi")
        return "; ".join(f"{{ {p}; }} 2>/dev/null" for p in parts) + "; true"

    def process(self, output):
        return parse_host_state(output)


def parse_secure_boot(lines: list[str]) -> bool | None:
    """True/False from `mokutil --sb-state` ("SecureBoot enabled"/"SecureBoot disabled") or the
    EFI variable's value byte ("efivar 1"); False on a host without EFI; None when unknown."""
    for line in lines:
        if line.strip() in ("SecureBoot enabled", "SecureBoot disabled"):
            return line.strip() == "SecureBoot enabled"
    for line in lines:
        text = line.strip()
        if text.startswith("efivar "):
            value = text.split()[-1]
            return bool(int(value) & 1) if value.isdigit() else None
        if text in ("no efi", "efi without SecureBoot variable"):
            return False
    return None


def parse_host_state(lines: list[str]) -> dict:
    """Pure parser of `NvidiaHostState.command` output (shape: see the fact)."""
    sections = {name: [line.rstrip() for line in body if line.strip()]
                for name, body in split_sections(lines, SECTION).items()}

    def first(name: str) -> str | None:
        lines = sections.get(name)
        return lines[0] if lines else None

    mem = re.search(r"(\d+)", first("meminfo") or "")
    cores = first("cores")
    compilers = {}
    for line in sections.get("compilers", []):
        name, _, banner = line.partition(": ")
        if banner.strip():
            compilers[name.strip()] = banner.strip()
    releases = {}
    for name, body in sections.items():
        if not name.startswith("release "):
            continue
        info: dict = {"headers": False, "cc_version_text": None, "module": None, "config": {}, "sign_file": False}
        module = {}
        for line in body:
            if line.startswith("headers: "):
                info["headers"] = line.endswith("yes")
            elif line.startswith("CONFIG_CC_VERSION_TEXT="):
                info["cc_version_text"] = line.split("=", 1)[1].strip().strip('"')
            elif line.startswith("config "):
                key, _, value = line[len("config "):].partition("=")
                info["config"][key] = value.strip().strip('"')
            elif line == "sign-file: yes":
                info["sign_file"] = True
            elif line.startswith("module "):
                key, _, value = line[len("module "):].partition(":")
                module[key] = value.strip() or None
        info["module"] = module if module.get("version") else None
        releases[name[len("release "):]] = info
    firmware: dict[str, list[str]] = {}
    for path in sections.get("firmware", []):
        match = re.match(r"^/lib/firmware/nvidia/([^/]+)/(gsp[^/]*)$", path)
        if match:
            firmware.setdefault(match.group(1), []).append(match.group(2))
    pers = sections.get("persistenced", [])
    sources = {}
    for name, body in sections.items():
        if name.startswith("source "):
            value = body[0] if body else "absent"
            sources[name[len("source "):]] = {
                "cached": value == "cached",
                "sha256": value.split(" ", 1)[1] if value.startswith("sha256 ") else None,
            }
    signing = {name[len("signing "):]: "readable" in body for name, body in sections.items() if name.startswith("signing ")}
    return {
        "secure_boot": parse_secure_boot(sections.get("secureboot", [])),
        "signing_files": signing,
        "cores": int(cores) if cores and cores.isdigit() else 1,
        "mem_total_kib": int(mem.group(1)) if mem else 0,
        "running": first("running"),
        "ccache": bool(first("ccache")),
        "compilers": compilers,
        "releases": releases,
        "firmware": firmware,
        "userspace": sections.get("userspace", []),
        "persistenced": {
            "binary": "binary" in pers,
            "unit": next((line[5:] for line in pers if line.startswith("unit ")), None),
            "enabled": "enabled" in pers,
        },
        "sources": sources,
    }


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
                  cxx: str | None = None, signing: tuple[str, str] | None = None):
    """Build the NVIDIA kernel modules for one kernel release in a scratch dir (not installed yet).

    + cxx: the C++ compiler for the open tree's src/ (None: the tree has no C++)
    + signing: (key, cert) paths on the host to sign the modules with, or None
    """
    yield progress.reported(build_command(archive, version, release, cc, jobs, ccache, cxx=cxx, signing=signing), f"nvidia {version} build for {release}",
                            key=f"nvidia-{version}-{release}-{archive.rsplit('/', 1)[-1]}", log=f"{build_dir(version, release)}/build.log")


@operation()
def clean_builds(version: str):
    """Remove the scratch dirs of `version`'s builds once every release is installed."""
    yield StringCommand(cleanup_command(version))


@operation()
def install_modules(version: str, release: str):
    """Install the modules built for `release` and run depmod for that release."""
    yield StringCommand(install_command(version, release))


@operation()
def install_userspace(installer: str, version: str):
    """NVIDIA user space and GSP firmware of exactly the module version, without kernel modules
    (incidents 2, 6): the installer is the one source of the firmware (nvidia-installer installs
    its FIRMWARE entries into /lib/firmware/nvidia/<version>/ with --no-kernel-modules too)."""
    yield StringCommand(f"sh {shlex.quote(installer)} --silent --no-kernel-modules")


@operation()
def enable_unit(unit: str, unit_path: str):
    """Enable a unit for multi-user.target by its wants link (works with systemd not running)."""
    link = f"{WANTS_DIR}/{unit}"
    yield StringCommand(f"mkdir -p {shlex.quote(WANTS_DIR)} && ln -sfn {shlex.quote(unit_path)} {shlex.quote(link)}")


@operation()
def verify_versions(version: str, releases: list[str], firmware: bool, firmware_files: list[str] | None = None):
    """Refuse to finish when modules, firmware (each file the GPUs load) and user space are not all `version`."""
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
        if steps["fetch_modules"] and not sources.get("modules", {}).get("cached", False):
            fetch_source(name=f"Fetch and verify NVIDIA modules source {source_name(nv.modules_source.url)}",
                         url=nv.modules_source.url, sha256=nv.modules_source.sha256, dest=modules_archive)
        else:
            _skip(f"{modules_archive} is already fetched and verified")
    if nv.installer and installer:
        if steps["fetch_installer"] and not sources.get("installer", {}).get("cached", False):
            fetch_source(name=f"Fetch and verify NVIDIA installer {source_name(nv.installer.url)}",
                         url=nv.installer.url, sha256=nv.installer.sha256, dest=installer)
        else:
            _skip(f"{installer} is already fetched and verified")
    building = [r for r in releases if steps["releases"][r]["build"]]
    for release in releases:
        entry = steps["releases"][release]
        if not entry["build"]:
            _skip(entry["reason"] or f"nvidia {nv.version} is current for {release}")
            continue
        build_modules(name=f"Build nvidia {nv.version} for {release}", archive=modules_archive or "",
                      version=nv.version, release=release, cc=entry["cc"] or "gcc", jobs=steps["jobs"],
                      ccache=steps["ccache"], cxx=entry["cxx"],
                      signing=(nv.signing.key, nv.signing.cert) if nv.signing else None)
    for release in building:
        install_modules(name=f"Install nvidia {nv.version} modules for {release}", version=nv.version,
                        release=release)
    if building:
        clean_builds(name=f"Remove nvidia {nv.version} build dirs", version=nv.version)
    if steps["install_userspace"]:
        install_userspace(name=f"NVIDIA user space and GSP firmware {nv.version}", installer=installer or "",
                          version=nv.version)
    else:
        _skip(f"user space {nv.version} is installed (or no installer configured)")
    if nv.persistenced:
        _persistenced(state, will_install=steps["install_userspace"])
    if steps["verify"]:
        verify_versions(name=f"Check nvidia {nv.version}: modules, firmware, user space",
                        version=nv.version, releases=[r for r in releases if steps["releases"][r]["build"]
                                                      or (state["releases"].get(r) or {}).get("module")],
                        firmware=nv.firmware, firmware_files=steps["firmware_files"])
    else:
        _skip(f"nvidia {nv.version}: modules, firmware and user space unchanged and equal")


def _skip(why: str) -> None:
    """A step the plan does not run, and why (the operation is not called: nothing to do)."""
    logger.info(f"{host.name}: nvidia: {why}")


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
    if pers["enabled"]:
        _skip("nvidia-persistenced.service is enabled")
    else:
        enable_unit(name="Enable nvidia-persistenced", unit="nvidia-persistenced.service", unit_path=unit)
