"""Part of stages 2 and 3 (kernel, operations/kernel.py; NVIDIA driver, operations/nvidia.py): one
build per input set in a run of several hosts (issue 41; plan/build_share.py decides,
facts/build_share.py reads), one code path for both kinds of build ("nvidia": the modules of each
release; "kernel": the kernel stage's .debs), each kind's run kept apart.

pyinfra plans every host before it executes anything, and then runs each operation on every host
before the next, so the stage plans each host as if it built (the build operation, the receive and
a local build after a refused copy), records the host's build inputs here (`register`) and leaves
the choice to the moment the operations execute, when every host of the run is known (`_if`
conditions: `build_if`, `receive_if`, `fallback_if`). While planning, the last host to register
prints who builds for whom and why a host builds alone (also under `--dry`).

Execution, per release: the builder builds and keeps its artefacts with a manifest (key, release,
the sha256 of each file) under facts.build_share.SHARE_ROOT/<key>/ (the unsigned modules:
templates/nvidia-build.sh.j2) or KERNEL_SHARE_ROOT/<key>/ (the .debs and the build's manifest.json:
templates/kernel-publish.sh.j2); each receiver then copies that directory (node to node over the
cluster's root SSH trust when both hosts are nodes of one Proxmox cluster, else through the
controller: pyinfra's get_file from the builder, put_file to the receiver; templates/share-copy.sh.j2),
verifies it (templates/nvidia-receive.sh.j2: and signs it with its own key; kernel-receive.sh.j2: and
puts the .debs where its own build would leave them, for the stage's install and trial); a copy that
is refused or cannot be made is logged with why, and that host builds for itself. A failed build
fails its group: the receivers stop, naming the builder (its first compile error is its output).
"""

from __future__ import annotations

import re
from io import BytesIO
from typing import Any

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.context import ctx_state
from pyinfra.context import state as current_state

from facts.build_share import KERNEL_SHARE_ROOT, MANIFEST, SHARE_ROOT
from facts.shell import operands, word
from plan import build_share as shplan
from plan.render import render_template
from plan.terminal import visible

RECV_ROOT = "/var/cache/pvegpu/nvidia-received"  # root's scratch dirs of the copies being verified
KERNEL_RECV_ROOT = "/var/cache/pvegpu/kernel-received"
# the files a kept build's manifest names, per kind (the receive templates check the same forms)
_SUM_LINE = {"nvidia": re.compile(r"^[0-9a-f]{64}  ([A-Za-z0-9_-]+\.ko)$"),
             "kernel": re.compile(r"^[0-9a-f]{64}  ([A-Za-z0-9][A-Za-z0-9.+~_-]*\.deb|manifest\.json)$")}
SPEC_OF = {"nvidia": "nvidia", "kernel": "kernel"}  # the spec section whose hosts share a kind's build


class ShareRun:
    """What one pyinfra run knows about its hosts' builds (kept per pyinfra State)."""

    def __init__(self) -> None:
        self.hosts: dict[str, dict] = {}
        self.steps: dict[tuple[str, str], dict] | None = None
        self.built: dict[str, str] = {}  # key -> the host whose build of it succeeded
        self.refused: dict[tuple[str, str], str] = {}  # (host, release) -> why its copy was not taken
        self.printed = False


_RUNS: dict[tuple[int, str], ShareRun] = {}


def _run(state=None, kind: str = "nvidia") -> ShareRun:
    state = state if state is not None else ctx_state.get()
    return _RUNS.setdefault((id(state), kind), ShareRun())


def _stage_hosts(state, kind: str = "nvidia") -> list:
    """The run's hosts still active whose spec has the kind's stage (none where no run is loaded)."""
    active = getattr(state, "active_hosts", None)
    if not active:
        return []
    return [h for h in state.inventory
            if h in active and getattr(h.data.get("pvegpu_spec"), SPEC_OF[kind], None) is not None]


def sharing(kind: str = "nvidia") -> bool:
    """Whether this run shares the kind's builds: two or more of its hosts have that stage."""
    return len(_stage_hosts(current_state, kind)) > 1


def register(spec, nv_state: dict, share_state: dict, steps: dict, releases: list[str]) -> None:
    """Record this host's builds (the releases `plan.nvidia.driver_steps` builds) with their inputs,
    its cores, memory, cluster view and the builds it keeps for others; the last host prints the plan."""
    nv = spec.nvidia
    builds = {}
    for release in releases:
        entry = steps["releases"][release]
        if not entry["build"]:
            continue
        inputs, why = shplan.build_inputs(nv.version, nv.modules_source.sha256 if nv.modules_source else None,
                                          release, nv_state, share_state, entry)
        builds[release] = {"version": nv.version, "inputs": inputs, "why": why,
                           "key": shplan.build_key(inputs) if inputs else None}
    register_host("nvidia", nv_state.get("cores"), nv_state.get("mem_total_kib"), nv.share_builder, share_state, builds)


def register_host(kind: str, cores: int | None, mem_total_kib: int | None, preferred: bool, share_state: dict,
                  builds: dict) -> None:
    """Record this host for the kind's sharing: its builds ({release: {"version", "inputs", "why",
    "key"}}, only those it builds this run), cores, memory, the spec's choice of builder, its cluster
    view and the builds it keeps for others; the last host of the run prints the plan."""
    run = _run(kind=kind)
    run.hosts[host.name] = {"cores": cores, "mem_total_kib": mem_total_kib, "preferred": preferred,
                            "members": share_state.get("members"), "published": share_state.get("published") or {},
                            "kept": share_state.get("kept") or {}, "builds": builds}
    if not run.printed and {h.name for h in _stage_hosts(current_state, kind)} <= set(run.hosts):
        run.printed = True
        _print_plan(run.hosts, shplan.share_plan(run.hosts, kind), kind)


def _print_plan(hosts: dict, steps: dict, kind: str) -> None:
    for line in shplan.distrust_lines(hosts, kind):
        logger.warning(line)
    for line in shplan.share_lines(steps):
        logger.info(line)


def step(name: str, release: str, state=None, kind: str = "nvidia") -> dict | None:
    """The plan's step for `name`'s build of `release`, decided once every host of the run has
    registered (at execution: over the hosts still in the run)."""
    state = state if state is not None else ctx_state.get()
    run = _run(state, kind)
    if run.steps is None:
        active = {h.name for h in state.active_hosts}
        run.steps = shplan.share_plan({n: v for n, v in run.hosts.items() if n in active}, kind)
        if not run.printed:
            run.printed = True
            _print_plan(run.hosts, run.steps, kind)
    return run.steps.get((name, release))


def key_of(name: str, release: str, kind: str = "nvidia") -> str | None:
    """The build key of `name`'s build of `release` (None: not shared)."""
    build = (_run(kind=kind).hosts.get(name, {}).get("builds") or {}).get(release) or {}
    return build.get("key")


def inputs_of(name: str, release: str, kind: str = "nvidia") -> str | None:
    """The inputs `key_of`'s key hashes, as a kept build's manifest records them (None: not shared)."""
    build = (_run(kind=kind).hosts.get(name, {}).get("builds") or {}).get(release) or {}
    return shplan.inputs_text(build["inputs"]) if build.get("key") and build.get("inputs") else None


def build_if(name: str, release: str, kind: str = "nvidia"):
    """`_if` of the build: this host builds `release` (its step is a build)."""
    return lambda: (step(name, release, kind=kind) or {"role": "build"})["role"] == "build"


def receive_if(name: str, release: str, kind: str = "nvidia"):
    """`_if` of the receive: this host takes another host's build of `release`."""
    return lambda: (step(name, release, kind=kind) or {}).get("role") == "receive"


def fallback_if(name: str, release: str, kind: str = "nvidia"):
    """`_if` of the local build after a copy that was refused or could not be made."""
    return lambda: (name, release) in _run(kind=kind).refused


def mark_built(state, host, key: str, kind: str = "nvidia") -> bool:
    """FunctionCommand body after a successful shared build: its receivers may copy it."""
    _run(state, kind).built[key] = host.name
    return True


def _roots(kind: str) -> tuple[str, str]:
    """(where builds of the kind are kept, where a receiver's copies are verified): read at call time."""
    return ((SHARE_ROOT, RECV_ROOT) if kind == "nvidia" else (KERNEL_SHARE_ROOT, KERNEL_RECV_ROOT))


def copy_context(kind: str, what: str, key: str, source: str, via: dict | None = None, local: str | None = None,
                 incoming: bool = False) -> dict:
    """The values templates/share-copy.sh.j2 (included by each kind's receive template) copies by:
    `via` {"node", "ip"}: node to node; `local`: this host's own kept build; `incoming`: the
    controller filled the scratch dir already."""
    share_root, recv_root = _roots(kind)
    return dict(what=what, key=key, source=source, via=via, local=local, incoming=incoming, recv_root=recv_root,
                remote=f"tar -C {word(f'{share_root}/{key}')} -cf - .")


def receive_command(version: str, release: str, key: str, source: str, via: dict | None = None,
                    local: str | None = None, incoming: bool = False, signing: tuple[str, str] | None = None,
                    sig_hash: str = "sha256") -> str:
    """templates/nvidia-receive.sh.j2: copy (`via`: {"node", "ip"} node to node; `local`: this
    host's own kept build; `incoming`: the controller filled RECV_ROOT/<key>), verify, sign, place in $B/out."""
    from operations.nvidia import BUILD_ROOT, SIGN_FILE

    return render_template(
        "nvidia-receive.sh.j2", version=version, release=release,
        **copy_context("nvidia", shplan.what("nvidia", version, release), key, source, via, local, incoming),
        build_root=BUILD_ROOT, build_parent=f"{BUILD_ROOT}/{version}", signing=tuple(signing) if signing else None,
        sig_hash=sig_hash, modules_dir="/lib/modules", sign_file=SIGN_FILE)


def _refuse(state, host, release: str, why: str, kind: str = "nvidia") -> bool:
    _run(state, kind).refused[(host.name, release)] = why
    logger.warning(f"{host.name}: {why}; building here instead")
    return True


def _shell(host, command: str) -> tuple[bool, str, list[str]]:
    ok, output = host.run_shell_command(StringCommand(command))
    said = visible(" ".join(" ".join(output.stderr_lines or output.stdout_lines).split()))
    return ok, said, list(output.stdout_lines)


def take_build(state, host, kind: str, release: str, render) -> bool:
    """Copy, verify and take the build of `release` another host of the run made with this host's
    inputs (its step says which and how): `render(**transport)` gives the kind's receive script for
    one transport (`via`, `local` or `incoming`, as `copy_context`). A refusal or a failed copy
    leaves the host to build itself (`fallback_if`); a failed build of its group fails the host."""
    run = _run(state, kind)
    this = step(host.name, release, state, kind) or {}
    key, source = this.get("key"), this.get("from")
    what = this.get("what") or f"{kind} build for {release}"
    if not key or not source:
        return _refuse(state, host, release, f"{what}: no build to receive", kind)
    own_copy = source == host.name
    kept = any(release in rels for k, rels in (run.hosts.get(source, {}).get("published") or {}).items() if k == key)
    if not own_copy and not kept and run.built.get(key) != source:
        logger.error(f"{host.name}: {what}: the build on {source} for this host's inputs "
                     f"(key {key[:12]}) failed (its error above); the same inputs here would fail the same way")
        return False
    share_root, _ = _roots(kind)
    if own_copy:
        command = render(local=f"{share_root}/{key}")
    elif this.get("via"):
        command = render(via=this["via"])
    else:
        source_host = state.inventory.get_host(source)
        incoming, why = _through_controller(host, source_host, key, kind)
        if incoming is None:
            return _refuse(state, host, release, f"{what}: the copy from {source} through the controller failed ({why})",
                           kind)
        command = render(incoming=True)
    ok, said, out = _shell(host, command)
    if not ok:
        return _refuse(state, host, release, said or f"{what}: the copy from {source} failed", kind)
    for line in out[-1:]:
        logger.info(f"{host.name}: {visible(line)}")
    return True


def receive(state, host, version: str, release: str, signing: tuple[str, str] | None, sig_hash: str) -> bool:
    """FunctionCommand body of `receive_modules`: the copy, its verification and signing (`take_build`)."""
    this = step(host.name, release, state) or {}

    def render(**transport) -> str:
        return receive_command(version, release, this.get("key") or "", this.get("from") or "", signing=signing,
                               sig_hash=sig_hash, **transport)
    return take_build(state, host, "nvidia", release, render)


def _through_controller(host, source_host, key: str, kind: str = "nvidia") -> tuple[str | None, str]:
    """Copy the kept build <share root>/<key>/ of `source_host` into <receive root>/<key>/ (made
    afresh, root's alone) on `host` through the controller (pyinfra get_file, put_file; only the
    manifest and the files it names): the dir, or None and why."""
    from plan.render import root_dirs

    share_root, recv_root = _roots(kind)
    incoming = f"{recv_root}/{key}"
    ok, said, _ = _shell(host, root_dirs((recv_root, "700")) + f"rm -rf {operands(incoming)} && mkdir -m 700 {operands(incoming)}")
    if not ok:
        return None, f"no scratch dir on {host.name}: {said}"
    manifest = BytesIO()
    if not source_host.get_file(f"{share_root}/{key}/{MANIFEST}", manifest):
        return None, f"{source_host.name} has no {share_root}/{key}/{MANIFEST}"
    names = [m.group(1) for m in map(_SUM_LINE[kind].match, manifest.getvalue().decode(errors="replace").splitlines())
             if m]
    files: list[tuple[str, Any]] = [(MANIFEST, manifest)]
    for name in names:
        data = BytesIO()
        if not source_host.get_file(f"{share_root}/{key}/{name}", data):
            return None, f"{source_host.name}: {name} could not be read"
        files.append((name, data))
    for name, data in files:
        data.seek(0)
        if not host.put_file(data, f"{incoming}/{name}"):
            return None, f"{name} could not be written to {host.name}"
    return incoming, ""


@operation()
def receive_modules(version: str, release: str, signing: tuple[str, str] | None = None, sig_hash: str = "sha256"):
    """Take the modules another host of the run built for `release` with the same inputs: copy,
    verify, sign (with this host's key), ready to install; refused: this host builds itself.

    + signing: (key, cert) paths on this host, or None
    + sig_hash: the release's CONFIG_MODULE_SIG_HASH
    """
    yield FunctionCommand(receive, (version, release, tuple(signing) if signing else None, sig_hash), {})
