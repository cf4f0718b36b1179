"""Stage 2, kernel: build the spec's kernel on the host with its own gcc, install the .debs
next to the running kernel, and trial-boot the new one (pinned for good only once it came up).

A build takes an hour or more on a real host, so it runs detached: a transient systemd unit
(`systemd-run --unit pvegpu-kernel-build`, with MemoryMax= so an OOM kills the build and not the
host) where systemd runs, else `setsid nohup` (the twin has no running systemd). For
proxmox-git the release is pve-kernel's Makefile KVNAME at the pinned ref (preflight refuses a
spec version that disagrees); pins are followed by `proxmox-boot-tool refresh` where ESPs are
listed (the pin alone only writes the pin file there). The deploy waits, printing progress from the build log; a re-run
while the build runs attaches to it instead of starting a second one. The build dir holds
build.sh, build.log, build.pid, build.rc (exit status), the .debs and manifest.json
(compiler, source ref/sha, config hash); the manifest of an installed build is kept in
/var/lib/pvegpu/kernel/<release>.json so a re-run skips what is already there.

In a run of several hosts with a kernel spec, one host of each set of equal build inputs builds
(issue 41: plan/build_share.py decides, operations/build_share.py runs the sharing): it keeps the
.debs under facts.build_share.KERNEL_SHARE_ROOT/<key>/ (templates/kernel-publish.sh.j2); the others
copy them (node to node in a cluster, else through the controller), verify them
(templates/kernel-receive.sh.j2) into their own build dir and install and trial-boot them as their
own build; a refused copy is built here.

Facts: one batched remote command (`facts.kernel.KernelStageFacts`).
"""

from __future__ import annotations

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, deploy, operation

from facts.build_share import KERNEL_SHARE_ROOT, BuildShareState
from facts.kernel import KernelStageFacts, NvidiaGateRecords
from facts.loader import LoaderState
from facts.nvidia import SHIM_VALIDATION_OFF, NvidiaHostState
from facts.once import fact_once
from facts.run_state import need_reboot, record_trial_boot
from facts.shell import operands, word
from operations import build_share, nvidia, progress
from operations.files import write_file_command
from plan import build_share as shplan
from plan import kernel as plan
from plan import loader as loader_plan
from plan import nvidia as nvplan
from plan.render import PRIVATE, render_template, root_dirs
from spec.models import HostSpec, KernelSpec

POLL_S = 10.0
BUILD_TIMEOUT_S = 6 * 3600


def base_config_of(kernel: KernelSpec) -> str:
    """`running` (the booted kernel's /boot/config-*), `tinyconfig`/`defconfig`/`allnoconfig`,
    or a path on the host (spec field `kernel.base_config`)."""
    return kernel.base_config or "running"


def start_build_command(build_dir: str, systemd: bool, memory_max_kib: int | None = None) -> str:
    """Start build.sh detached; a no-op when it already runs (a re-run attaches instead).
    Under systemd the unit gets MemoryMax= (an OOM kills the build's cgroup, not the host).
    (templates/kernel-build-start.sh.j2)"""
    return render_template("kernel-build-start.sh.j2", build_dir=build_dir, systemd=systemd, unit=plan.BUILD_UNIT,
                           memory_max_kib=int(memory_max_kib) if memory_max_kib else None)


def build_script(k: KernelSpec, base: str, jobs: int, build_dir: str) -> str:
    """build.sh of one build (templates/kernel-build.sh.j2): the spec's values, each quoted there."""
    return render_template(
        "kernel-build.sh.j2", build_dir=build_dir, version=k.version, kind=k.source.kind, jobs=int(jobs),
        ccache=k.ccache, base_config=base, fragments=list(k.config_fragments),
        url=k.source.url, sha256=k.source.sha256 or "", ref=k.source.ref or "", localversion=plan.localversion(k),
        pkgversion="1", local_suffix=plan.LOCAL_KREL_SUFFIX, ccache_dir=plan.CCACHE_DIR,
        ccache_max_size=plan.CCACHE_MAX_SIZE)


def wait_for_build(state, host, build_dir: str, total: int | None, poll_s: float = POLL_S,
                   timeout_s: float = BUILD_TIMEOUT_S, key: str | None = None):
    """Follow a detached build until build.rc appears, reporting progress (operations.progress);
    False (op fails) on error."""
    return progress.follow_detached(state, host, "kernel build", build_dir, f"{build_dir}/build.log", key=key,
                                    total=total, poll_s=poll_s, timeout_s=timeout_s)


def publish_command(build_dir: str, kind: str, release: str, key: str) -> str:
    """templates/kernel-publish.sh.j2: keep a finished build's .debs and manifest.json for the run's
    other hosts of the same inputs, under KERNEL_SHARE_ROOT/<key>/ with their sha256."""
    return render_template("kernel-publish.sh.j2", build_dir=build_dir, release=release, key=key,
                           share_root=KERNEL_SHARE_ROOT, packages=_packages(kind, release))


def _packages(kind: str, release: str) -> list[str]:
    """The package names of the .debs the stage installs (plan.kernel.package_globs, less `_*.deb`)."""
    return [g.removesuffix("_*.deb") for g in plan.package_globs(kind, release)]


def receive_command(kind: str, release: str, build_dir: str, key: str, source: str, via: dict | None = None,
                    local: str | None = None, incoming: bool = False) -> str:
    """templates/kernel-receive.sh.j2: copy (`via`: {"node", "ip"} node to node; `local`: this
    host's own kept build; `incoming`: the controller filled the scratch dir), verify, and put the
    .debs with the build's manifest.json in `build_dir`, as this host's own build leaves them."""
    return render_template(
        "kernel-receive.sh.j2", release=release, build_root=plan.BUILD_ROOT, build_dir=build_dir,
        packages=_packages(kind, release), pkg_version=shplan.KERNEL_PKGVERSION if kind == "tarball" else None,
        **build_share.copy_context("kernel", shplan.what("kernel", None, release), key, source, via, local, incoming))


def receive(state, host, kind: str, release: str, build_dir: str) -> bool:
    """FunctionCommand body of `receive_kernel`: the copy and its verification (build_share.take_build)."""
    this = build_share.step(host.name, release, state, "kernel") or {}

    def render(**transport) -> str:
        return receive_command(kind, release, build_dir, this.get("key") or "", this.get("from") or "", **transport)
    return build_share.take_build(state, host, "kernel", release, render)


@operation()
def receive_kernel(kind: str, release: str, build_dir: str):
    """Take the .debs another host of the run built with this host's inputs: copy, verify, put them
    in this host's build dir for the install; refused: this host builds itself.

    + kind: kernel.source.kind (which packages, which version the key implies)
    + build_dir: plan.kernel.build_dir of this build
    """
    yield FunctionCommand(receive, (kind, release, build_dir), {})


@operation()
def build_kernel(build_dir: str, script: str, manifest_in: str, systemd: bool, total: int | None, start: bool = True,
                 memory_max_kib: int | None = None, record: str | None = None, share: tuple[str, str, str] | None = None):
    """Write build.sh + manifest template, start the build detached (unless it runs), wait for it.

    + build_dir: scratch dir of this build (plan.kernel.build_dir)
    + script: rendered templates/kernel-build.sh.j2
    + manifest_in: rendered templates/kernel-build-manifest.json.j2 (placeholders filled by build.sh)
    + systemd: run as a transient systemd unit (else setsid nohup)
    + total: objects of an earlier build of the same config, for progress (None: unknown)
    + start: False to attach to a build that already runs
    + memory_max_kib: MemoryMax= of the systemd unit (plan.kernel.build_memory_max_kib)
    + record: key under which the build's time is kept (operations.progress)
    + share: (kind, release, key) in a run that shares builds: the finished build is kept for the
      run's other hosts of the same inputs (`publish_command`)
    """
    if start:
        # root's alone, 0700: the build's tree holds its module-signing key while it runs (issue 39)
        yield StringCommand(root_dirs((plan.BUILD_ROOT, PRIVATE), (build_dir, PRIVATE))
                            + write_file_command(f"{build_dir}/build.sh", script, "755", keep_previous=False))
        yield StringCommand(write_file_command(f"{build_dir}/manifest.json.in", manifest_in, "644", keep_previous=False))
        yield StringCommand(start_build_command(build_dir, systemd, memory_max_kib))
    yield FunctionCommand(wait_for_build, (build_dir, total), {"key": record} if record else {})
    if share:
        kind, release, key = share
        yield StringCommand(publish_command(build_dir, kind, release, key))
        yield FunctionCommand(build_share.mark_built, (key, "kernel"), {})


def register_share(k: KernelSpec, base: str, build: dict, action: str) -> str | None:
    """Record this host in the run's kernel sharing (operations/build_share.py): its build inputs
    when it would build (plan.build_share.kernel_build_inputs), its cores, memory, cluster view and
    kept builds; the build key, or None (it builds nothing this run, or alone)."""
    share_state = fact_once(BuildShareState, releases=[], kernel_base=base)
    builds: dict[str, dict] = {}
    if action == "build":
        source = k.source.sha256 if k.source.kind == "tarball" else k.source.ref
        inputs, why = shplan.kernel_build_inputs(
            k.version, k.source.kind, source, base, list(k.config_fragments), share_state,
            krel_suffix=plan.LOCAL_KREL_SUFFIX if k.source.kind == "proxmox-git" else None)
        builds[k.version] = {"version": k.version, "inputs": inputs, "why": why,
                             "key": shplan.build_key(inputs) if inputs else None}
    build_share.register_host("kernel", build.get("cores"), build.get("mem_total_kib"), k.share_builder, share_state,
                              builds)
    return (builds.get(k.version) or {}).get("key")


def gate_toolchain(spec: HostSpec, state: dict, manifest: dict | None) -> tuple[str, str | None]:
    """The compilers the NVIDIA stage's toolchain rule (plan/nvidia.py toolchain_for) picks for the
    spec's kernel, so the gate builds with the stage's compiler and its src/ build is the stage's:
    from the kernel's installed headers' CONFIG_CC_VERSION_TEXT, else the finished build's recorded
    compiler, else the host's `gcc` (kernel-build.sh.j2 records `gcc --version`'s first line: the gcc
    Kbuild runs, which Kbuild writes as CONFIG_CC_VERSION_TEXT). The gate checks the unpacked headers'
    own text against them. `state`: the NvidiaHostState fact. None fits: the program the kernel names,
    which the gate's check then says is missing or another GCC."""
    k, nv = spec.kernel, spec.nvidia
    assert k is not None and nv is not None
    compilers = state.get("compilers") or {}
    info = (state.get("releases") or {}).get(k.version) or {}
    text = info.get("cc_version_text") or (manifest or {}).get("compiler") or compilers.get("gcc")
    chosen = nvplan.toolchain_for(k.version, text, compilers, need_cxx=nv.open)
    if chosen["cc"]:
        return chosen["cc"], chosen["cxx"]
    program = (text or "gcc").split(" ", 1)[0]
    return program, (program.replace("gcc", "g++") if nv.open else None)


def gate_script(spec: HostSpec, build_dir: str, jobs: int, cc: str, cxx: str | None) -> str:
    """The driver x kernel gate of the spec's kernel (templates/kernel-nvidia-gate.sh.j2): the NVIDIA
    stage's build script against that kernel's headers, with the compilers the stage picks for that
    kernel (`gate_toolchain`: `cc`, and `cxx` for the open tree's C++), so the src/ build is shared."""
    k, nv = spec.kernel, spec.nvidia
    assert k is not None and nv is not None and nv.modules_source is not None
    build = nvidia.build_context(nvidia.cached_source(nv.modules_source), nv.version, None, cc, jobs, k.ccache,
                                 conftest_cache=False, cxx=cxx, kernel_dirs=True)
    return render_template(
        "kernel-nvidia-gate.sh.j2", **build, kernel_release=k.version, sha256=nv.modules_source.sha256,
        build_id=plan.build_id(k, base_config_of(k)), state_dir=plan.GATE_DIR, debs_dir=build_dir,
        headers_prefix=plan.headers_package(k.source.kind, k.version), headers_root=f"{build_dir}/nvidia-gate-headers")


@operation()
def nvidia_gate(fetch: str, script: str):
    """Build nvidia.version against the new kernel's headers before it is installed or trial-booted;
    fails (nothing installed or pinned) with the first compile error quoted, recorded for later runs.

    + fetch: the NVIDIA stage's fetch of the verified source (a no-op when it is there)
    + script: rendered templates/kernel-nvidia-gate.sh.j2 (gate_script)
    """
    yield StringCommand(fetch)
    yield StringCommand(f"/bin/sh -c {word(script)}")


@operation()
def install_build_tools(packages: list[str]):
    """apt-get install the Debian packages the build needs and lacks (plan.kernel.build_tools),
    before the build starts; when apt cannot, the op fails naming them and nothing is built."""
    if not packages:
        host.noop("the kernel build's packages are installed")
        return
    yield StringCommand(plan.install_tools_command(packages))


@operation()
def install_kernel(build_dir: str, release: str, kind: str, keep_default: str | None = None, esps: bool = False,
                   trial: bool = False):
    """dpkg -i the build's image + headers .debs (the running kernel stays installed) and keep
    its manifest in /var/lib/pvegpu/kernel/<release>.json.

    + keep_default: a command making the known-good kernel the loader default first
      (plan.kernel.keep_default_command), so the package's postinst does not make the new one it
    + esps: proxmox-boot-tool keeps ESPs here: a tarball build goes on its manual kernel list
      (plan.kernel.keep_on_esps_command), or the next refresh drops it from the ESPs
    + trial: a trial boot of it follows: marked first (plan.kernel.trial_pending_command), so the
      kernel hook its postinst runs leaves the default alone
    """
    d = word(build_dir)
    if trial:
        yield StringCommand(plan.trial_pending_command(release))
    if keep_default:
        yield StringCommand(keep_default)
    globs = " ".join(f"{d}/{g}" for g in plan.package_globs(kind, release))
    manifest = word(f"{plan.STATE_DIR}/{release}.json")
    # dpkg (lib/dpkg/options.c dpkg_options_parse) ends its options at '--'; the globs stay unquoted
    yield StringCommand(f"DEBIAN_FRONTEND=noninteractive dpkg -i -- {globs}")
    keep_on_esps = plan.keep_on_esps_command(release, kind, esps)
    if keep_on_esps:
        yield StringCommand(keep_on_esps)
    yield StringCommand(root_dirs((plan.STATE_DIR, PRIVATE)) + f"cp -- {d}/manifest.json {manifest}")


@operation()
def trial_boot(release: str, loader: str, panic_s: int, advanced_id: str | None = None,
               known_good: str | None = None, sign: str | None = None, expect: dict | None = None,
               retry: bool = False):
    """Choose `release` for the next boot only (the loader's one-shot; the default stays on the
    known-good kernel) and mark the trial (written last: a failed one-shot leaves no marker).

    + loader: plan.kernel.SYSTEMD_BOOT, GRUB or GRUB_ESP (plan.kernel.trial_loader)
    + panic_s: panic=<s> on the trial entry's command line (either loader)
    + advanced_id: GRUB's "Advanced options" submenu id (plan.kernel.grub_entry_id)
    + known_good: the kernel that stays the default (the running one): made the default again
      right before the one-shot (plan.kernel.reassert_default_command) and verified on every ESP /
      grubenv as the one-shot is set; nothing is armed if it is not (issue 38 2.2)
    + sign: a command signing the kernel image for Secure Boot first (plan.kernel.sign_command)
    + expect: the host checks the trial kernel must pass too (plan.kernel.host_expectations)
    + retry: set up again after a reset cut the last trial's run after its kernel came up
      (plan.kernel.kernel_decision); recorded (TRIAL_RETRIED) so that happens once
    """
    yield StringCommand(plan.trial_pending_command(release))
    if known_good:
        yield StringCommand(plan.reassert_default_command(known_good, loader, advanced_id))
    yield StringCommand(plan.zfs_guard_command(release))
    if sign:
        yield StringCommand(sign)
    yield StringCommand(plan.oneshot_command(release, loader, panic_s, advanced_id, keep=known_good))
    # the boot unit that records the trial kernel's boot (a reset before this run's check is then
    # not a failed trial), enabled as `systemctl enable` does; the marker it reads comes last
    for path, (content, mode) in plan.trial_up_files().items():
        yield StringCommand(write_file_command(path, content, mode, keep_previous=False))
    yield StringCommand(f"ln -sfn {operands([plan.TRIAL_UNIT, plan.TRIAL_WANTS])}")
    if retry:
        yield StringCommand(f"printf '%s\\n' {word(release)} > {word(plan.TRIAL_RETRIED)}")
    yield StringCommand(plan.arm_trial_command(release, expect))


@operation()
def finish_trial(release: str, loader: str, build_id: str, advanced_id: str | None = None, fail: bool = False):
    """After the trial's boot: the default for good if it runs, else the failure recorded."""
    yield StringCommand(plan.finish_trial_command(release, loader, build_id, advanced_id, fail=fail))


@operation()
def pin_kernel(release: str, loader: str, advanced_id: str | None = None):
    """Make `release` (it is running) the loader default for good."""
    yield StringCommand(plan.zfs_guard_command(release))
    yield StringCommand(plan.set_default_command(release, loader, advanced_id)
                        + f" && rm -f {word(plan.TRIAL_PENDING)} {plan.DISARM}")


@operation()
def remove_old_kernels(packages: list[str]):
    """Purge the given kernel image packages (opt-in: spec.kernel.remove_old), exactly those
    (plan.kernel.purge_command)."""
    if not packages:
        host.noop("no old kernels to remove")
        return
    yield StringCommand(plan.purge_command(packages))


def stage_facts(k: KernelSpec) -> dict:
    """KernelStageFacts, and on ESP hosts what their loader reads (facts.loader.LoaderState: the
    ESPs' mode, for the one loader decision)."""
    base = base_config_of(k)
    facts = fact_once(KernelStageFacts, **fact_args(k, base))
    if (facts.get("build") or {}).get("esps"):
        facts = {**facts, "loader_state": fact_once(LoaderState)}
    return facts


def fact_args(k: KernelSpec, base: str) -> dict:
    args: dict[str, str | None] = {"build_dir": plan.build_dir(k, base), "release": k.version,
                                   "tools": " ".join(plan.build_tools(k))}
    if k.signing:
        args.update(signing_cert=k.signing.cert, signing_key=k.signing.key)
    if k.source.kind == "proxmox-git":
        args.update(url=k.source.url, ref=k.source.ref)
    return args


def host_loader(facts: dict) -> str:
    """The one loader decision (plan.kernel.host_loader) from what the loader reads
    (`stage_facts` "loader_state": each ESP's mode), else from the stage's build facts."""
    return plan.host_loader(facts["build"], facts.get("loader_state"))


def decide(k: KernelSpec, facts: dict, base: str) -> dict:
    """plan.kernel_decision on the stage's facts; the decision also carries the loader default."""
    build = facts["build"]
    loader, _ = plan.default_loader(build, host_loader(facts))
    default = plan.default_release(facts["kernels"], build, loader, facts.get("loader_state"))
    decision = plan.kernel_decision(
        k, {"kernels": facts["kernels"], "installed_manifest": build["installed_manifest"], "build": build,
            "trial": build["trial"], "armed": build["armed"], "failed": build["failed"], "default": default,
            "trial_up": build.get("trial_up"), "trial_retried": build.get("trial_retried")}, base)
    return {**decision, "default": default}


def preflight(spec: HostSpec) -> list[str]:
    k = spec.kernel
    if k is None:
        return []
    if k.source.kind == "proxmox-git" and k.config_fragments:
        return ["kernel.config_fragments apply to tarball builds; a proxmox-git build uses the Proxmox "
                "kernel's own config (patch the repository or build from a tarball instead)"]
    facts = stage_facts(k)
    refusals = []
    # ESPs of both loaders: refresh's result depends on their order (issue 38; plan.loader.refresh_modes);
    # one ESP holding both, or systemd-boot started on GRUB's ESPs: a trial armed in one loader while
    # the firmware may start the other (plan.loader.both_loaders_on_one_esp)
    mixed = loader_plan.esp_mode_problems(facts.get("loader_state"))
    if mixed:
        return [f"kernel: {mixed[0]}"]
    source = facts.get("source")
    if source:
        refusal = plan.release_refusal(k, source["release"], f"{host.name}:{source['from']}")
        if refusal:
            refusals.append(refusal)
    decision = decide(k, facts, base_config_of(k))
    if decision["action"] == "wrong-debs":
        refusals.append(decision["why"])
    # a package of the release that our finished build holds under the same name is ours: its
    # install was cut (a power cut) after dpkg -i and before the record below (install_kernel)
    built = {d.split("_", 1)[0] for d in facts["build"].get("debs", [])} if facts["build"].get("rc") == 0 else set()
    theirs = [p for p in facts["build"].get("kernel_packages", [])
              if plan.package_release(p) == k.version and p not in built]
    if theirs and not facts["build"]["installed_manifest"] and decision["action"] in ("build", "attach", "install"):
        # a package of the same release not built here (Proxmox's -signed one, Debian's image):
        # same /boot and /lib/modules files; dpkg -i fails on its Conflicts or apt replaces ours later
        refusals.append(f"kernel {k.version} is already installed from {', '.join(theirs)}, not built by pvegpu: our "
                        "packages of the same release would collide with it (same files; Proxmox's -signed package "
                        "Conflicts/Replaces proxmox-kernel-<release>). Boot that kernel as it is (drop spec.kernel), "
                        "or build a release of your own (proxmox-git builds get KREL_EXTRA + "
                        f"{plan.LOCAL_KREL_SUFFIX}; a tarball build a LOCALVERSION in kernel.version)")
    if decision["action"] == "build":
        needs = facts.get("needs") or {}
        refusals += [r for r in (plan.tools_refusal(k, needs), plan.space_refusal(k, base_config_of(k), needs)) if r]
    sb_refusal = plan.secure_boot_refusal(k, facts["build"])
    if sb_refusal and decision["action"] in ("build", "attach", "install", "trial"):
        # shim verifies the kernel image GRUB loads (Proxmox's Secure Boot chain: shim -> GRUB ->
        # a kernel signed by the Proxmox CA or a MOK): the build is signed with kernel.signing
        refusals.append(sb_refusal)
    mode = host_loader(facts)
    _, no_trial = plan.trial_loader(facts["build"], mode)
    if k.trial_boot and no_trial and decision["action"] in ("build", "attach", "install", "trial"):
        refusals.append(f"kernel.trial_boot is on, but a trial that is one boot cannot be set up on this host: {no_trial}. "
                        "Fix that, or set kernel.trial_boot: false to install the kernel without a trial (then it is "
                        "booted only when chosen at the console)")
    keeper, no_keep = plan.default_loader(facts["build"], mode)
    if not k.trial_boot and no_keep and decision["action"] in ("build", "attach", "install"):
        refusals.append(f"kernel.trial_boot is off, so the new kernel is installed but not made the default; on this "
                        f"host the running kernel cannot be kept the loader's default by name: {no_keep}. Without "
                        "that the new kernel would be the default at once")
    gate = gate_refusal(spec)
    if gate and decision["action"] in ("build", "attach", "install", "trial"):
        refusals.append(gate)
    if k.source.kind == "proxmox-git" and decision["action"] == "build" and facts["build"].get("headers_installed"):
        # pve-kernel debian/control: Build-Conflicts: proxmox-headers-<KVNAME>; mk-build-deps would remove them
        refusals.append(f"proxmox-headers-{k.version} is installed and pve-kernel's debian/control Build-Conflicts "
                        f"with it: building {k.version} again would remove the headers the NVIDIA stage builds "
                        f"against; purge them first (apt-get purge proxmox-headers-{k.version}) or build another KREL")
    return refusals


def gated(spec: HostSpec) -> bool:
    """Is there a driver to gate the spec's kernel with (nvidia with a modules source)?"""
    return spec.kernel is not None and spec.nvidia is not None and spec.nvidia.modules_source is not None


def gate_refusal(spec: HostSpec) -> str | None:
    """The driver x kernel gate's earlier refusal of this kernel build for this driver, if any."""
    if not gated(spec):
        return None
    k, nv = spec.kernel, spec.nvidia
    assert k is not None and nv is not None and nv.modules_source is not None
    return plan.gate_refusal(k, base_config_of(k), nv.version, nv.modules_source.sha256, fact_once(NvidiaGateRecords))


def prefetch(spec: HostSpec) -> list:
    """The facts this stage reads (deploy.py reads every stage's in one command)."""
    k = spec.kernel
    if k is None:
        return []
    share = [(BuildShareState, {"releases": [], "kernel_base": base_config_of(k)})] if build_share.sharing("kernel") else []
    return [(KernelStageFacts, fact_args(k, base_config_of(k))), (LoaderState, {}), *share,
            *([(NvidiaGateRecords, {}), (NvidiaHostState, nvidia.state_kwargs(spec))] if gated(spec) else []),
            *progress.prefetch()]


@deploy("pvegpu: kernel")
def apply(spec: HostSpec) -> None:
    k = spec.kernel
    if k is None:
        return
    base = base_config_of(k)
    build_dir = plan.build_dir(k, base)
    facts = stage_facts(k)
    build = facts["build"]
    decision = decide(k, facts, base)
    mode = host_loader(facts)
    loader, no_trial = plan.trial_loader(build, mode)
    adv = build.get("grub_advanced_id")
    action = decision["action"]
    logger.info(f"{host.name}: kernel {k.version}: {decision['why']}")
    if build.get("secure_boot_state") == SHIM_VALIDATION_OFF:
        logger.info(f"{host.name}: kernel: Secure Boot is enabled in the firmware but validation disabled in shim "
                    "(MokSBState): shim boots unsigned kernels and the kernel does not lock down")

    # a run of several hosts: one build per input set (operations/build_share.py decides at execution)
    shared = action == "build" and build_share.sharing("kernel")
    key = register_share(k, base, build, action) if build_share.sharing("kernel") else None
    if action in ("build", "attach"):
        jobs = plan.resolve_jobs(k.jobs, build["cores"], build["mem_total_kib"])
        manifest_in = render_template(
            "kernel-build-manifest.json.j2", build_id=plan.build_id(k, base), version=k.version, kind=k.source.kind,
            url=k.source.url, ref=k.source.ref or k.source.sha256, base_config=base,
            fragments=list(k.config_fragments), jobs=jobs)
        to_install = plan.missing_tools(k, facts.get("needs") or {})[0] if action == "build" else []
        when = {"_if": build_share.build_if(host.name, k.version, "kernel")} if shared else {}
        if to_install:
            install_build_tools(name=f"Install the kernel build's packages: {' '.join(to_install)}",
                                packages=to_install, **when)
        last = progress.announce(f"kernel {k.version} build", f"kernel-{plan.build_id(k, base)}")
        total = (build["manifest"] or {}).get("objects") or (last or {}).get("objects") or None
        args = dict(build_dir=build_dir, script=build_script(k, base, jobs, build_dir), manifest_in=manifest_in,
                    systemd=build["systemd"], total=total, start=action == "build",
                    record=f"kernel-{plan.build_id(k, base)}",
                    memory_max_kib=plan.build_memory_max_kib(build["mem_total_kib"], jobs),
                    share=(k.source.kind, k.version, key) if key else None)
        build_kernel(name=f"Build kernel {k.version} ({k.source.kind}, -j{jobs}, detached)", **args, **when)
        if shared:
            receive_kernel(name=f"Receive kernel {k.version} from the run's build", kind=k.source.kind,
                           release=k.version, build_dir=build_dir,
                           _if=build_share.receive_if(host.name, k.version, "kernel"))
            fallback = build_share.fallback_if(host.name, k.version, "kernel")
            if to_install:
                install_build_tools(name=f"Install the kernel build's packages: {' '.join(to_install)} (the copy was "
                                         "not taken)", packages=to_install, _if=fallback)
            build_kernel(name=f"Build kernel {k.version} here (the copy was not taken; -j{jobs}, detached)", **args,
                         _if=fallback)
    running = facts["kernels"].get("running")
    bid = plan.build_id(k, base)
    # the known-good kernel (the running one) is made the default before the install where it is
    # not: a kernel package's postinst would otherwise make the new one the default
    # (zz-proxmox-boot writes `default proxmox-*` without a pin; GRUB boots its first entry)
    # (trial or not: kernel.trial_boot: false installs it without making it the default, issue 38 2.3)
    keeper, no_keep = plan.default_loader(build, mode)
    keep = None
    if keeper and running and running != k.version and decision["default"] != running:
        keep = plan.keep_default_command(running, keeper, adv)
    if gated(spec) and plan.gate_due(action, k, loader):
        nv = spec.nvidia
        assert nv is not None and nv.modules_source is not None
        jobs = plan.resolve_jobs(k.jobs, build["cores"], build["mem_total_kib"])
        nvidia_gate(name=f"Driver x kernel gate: build nvidia {nv.version} against kernel {k.version}'s headers "
                         "before it is installed or booted",
                    fetch=nvidia.fetch_source_command(nv.modules_source.url, nv.modules_source.sha256,
                                                      nvidia.cached_source(nv.modules_source)),
                    script=gate_script(spec, build_dir, jobs, *gate_toolchain(
                        spec, fact_once(NvidiaHostState, **nvidia.state_kwargs(spec)), build["manifest"])))
    if action in ("build", "attach", "install"):
        install_kernel(name=f"Install kernel {k.version} packages" + (f" ({running} made the default first)" if keep else ""),
                       build_dir=build_dir, release=k.version, kind=k.source.kind, keep_default=keep,
                       esps=bool(build["esps"]), trial=bool(k.trial_boot and loader))
    if action in ("build", "attach", "install", "trial") and k.trial_boot and loader:
        trial_boot(name=f"Trial boot {k.version} on the next boot only ({loader} one-shot; {running} the default, "
                        "checked first)",
                   release=k.version, loader=loader, panic_s=k.trial_panic_s, advanced_id=adv,
                   known_good=running if running and running != k.version else None,
                   sign=plan.sign_command(k.version, k.signing.key, k.signing.cert)
                   if k.signing and build.get("secure_boot") else None,
                   expect=plan.host_expectations(spec), retry=bool(decision.get("retry")))
        action = "await-reboot"
    if action == "await-reboot":
        record_trial_boot(k.version, loader or "", bool(build["esps"]), build_id=bid, advanced_id=adv)
        need_reboot("kernel", f"{k.version} is installed and chosen for the next boot only (trial)")
    elif action == "finish" and loader:
        finish_trial(name=f"Trial boot of {k.version}: make it the default, or record that it failed",
                     release=k.version, loader=loader, build_id=bid, advanced_id=adv)
        if running != k.version:
            logger.warning(f"{host.name}: kernel: {decision['why']}")
    elif action == "pin":
        if keeper:
            pin_kernel(name=f"Make kernel {k.version} the default for good", release=k.version, loader=keeper,
                       advanced_id=adv)
        else:
            logger.warning(f"{host.name}: kernel {k.version} runs but is not made the default: {no_keep}")
    elif action == "failed-trial":
        logger.warning(f"{host.name}: {decision['why']}")
    elif action == "wrong-debs":  # refused at preflight; nothing to do here
        logger.error(f"{host.name}: kernel: {decision['why']}")
    if k.remove_old and running == k.version and action in ("done", "pin", "finish"):
        # never the running kernel nor the loader default (the known-good one until the new
        # release is made the default in this run)
        old = plan.old_kernel_packages(build["kernel_packages"], {k.version, running, decision["default"],
                                                                  facts["kernels"].get("pinned")})
        remove_old_kernels(name="Remove old kernels", packages=old)
