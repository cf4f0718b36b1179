"""Part of stage 3 (NVIDIA driver, operations/nvidia.py): one module build per input set in a run of
several hosts (issue 41; plan/build_share.py decides, facts/build_share.py reads).

pyinfra plans every host before it executes anything, and then runs each operation on every host
before the next, so the stage plans each host as if it built (the build operation, the receive and
a local build after a refused copy), records the host's build inputs here (`register`) and leaves
the choice to the moment the operations execute, when every host of the run is known (`_if`
conditions: `build_if`, `receive_if`, `fallback_if`). While planning, the last host to register
prints who builds for whom and why a host builds alone (also under `--dry`).

Execution, per release: the builder builds and keeps the unsigned modules with a manifest under
facts.build_share.SHARE_ROOT/<key>/ (templates/nvidia-build.sh.j2); each receiver then copies that
directory (node to node over the cluster's root SSH trust when both hosts are nodes of one Proxmox
cluster, else through the controller: pyinfra's get_file from the builder, put_file to the
receiver), verifies it (templates/nvidia-receive.sh.j2) and signs it with its own key; a copy that
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

from facts.build_share import MANIFEST, SHARE_ROOT
from facts.shell import operands, word
from plan import build_share as shplan
from plan.render import render_template
from plan.terminal import visible

RECV_ROOT = "/var/cache/pvegpu/nvidia-received"  # root's scratch dirs of the copies being verified
_SUM_LINE = re.compile(r"^[0-9a-f]{64}  ([A-Za-z0-9_-]+\.ko)$")


class ShareRun:
    """What one pyinfra run knows about its hosts' builds (kept per pyinfra State)."""

    def __init__(self) -> None:
        self.hosts: dict[str, dict] = {}
        self.steps: dict[tuple[str, str], dict] | None = None
        self.built: dict[str, str] = {}  # key -> the host whose build of it succeeded
        self.refused: dict[tuple[str, str], str] = {}  # (host, release) -> why its copy was not taken
        self.printed = False


_RUNS: dict[int, ShareRun] = {}


def _run(state=None) -> ShareRun:
    state = state if state is not None else ctx_state.get()
    return _RUNS.setdefault(id(state), ShareRun())


def _nvidia_hosts(state) -> list:
    """The run's hosts still active whose spec has an NVIDIA stage (none where no run is loaded)."""
    active = getattr(state, "active_hosts", None)
    if not active:
        return []
    return [h for h in state.inventory if h in active and getattr(h.data.get("pvegpu_spec"), "nvidia", None) is not None]


def sharing() -> bool:
    """Whether this run shares builds: two or more of its hosts have an NVIDIA spec."""
    return len(_nvidia_hosts(current_state)) > 1


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
    run = _run()
    run.hosts[host.name] = {"cores": nv_state.get("cores"), "mem_total_kib": nv_state.get("mem_total_kib"),
                            "preferred": nv.share_builder,
                            "members": share_state.get("members"), "published": share_state.get("published") or {},
                            "builds": builds}
    if not run.printed and {h.name for h in _nvidia_hosts(current_state)} <= set(run.hosts):
        run.printed = True
        for line in shplan.share_lines(shplan.share_plan(run.hosts)):
            logger.info(line)


def step(name: str, release: str, state=None) -> dict | None:
    """The plan's step for `name`'s build of `release`, decided once every host of the run has
    registered (at execution: over the hosts still in the run)."""
    state = state if state is not None else ctx_state.get()
    run = _run(state)
    if run.steps is None:
        active = {h.name for h in state.active_hosts}
        run.steps = shplan.share_plan({n: v for n, v in run.hosts.items() if n in active})
        if not run.printed:
            run.printed = True
            for line in shplan.share_lines(run.steps):
                logger.info(line)
    return run.steps.get((name, release))


def key_of(name: str, release: str) -> str | None:
    """The build key of `name`'s build of `release` (None: not shared)."""
    build = (_run().hosts.get(name, {}).get("builds") or {}).get(release) or {}
    return build.get("key")


def build_if(name: str, release: str):
    """`_if` of the build: this host builds `release` (its step is a build)."""
    return lambda: (step(name, release) or {"role": "build"})["role"] == "build"


def receive_if(name: str, release: str):
    """`_if` of the receive: this host takes another host's build of `release`."""
    return lambda: (step(name, release) or {}).get("role") == "receive"


def fallback_if(name: str, release: str):
    """`_if` of the local build after a copy that was refused or could not be made."""
    return lambda: (name, release) in _run().refused


def mark_built(state, host, key: str) -> bool:
    """FunctionCommand body after a successful shared build: its receivers may copy it."""
    _run(state).built[key] = host.name
    return True


def receive_command(version: str, release: str, key: str, source: str, via: dict | None = None,
                    local: str | None = None, incoming: bool = False, signing: tuple[str, str] | None = None,
                    sig_hash: str = "sha256") -> str:
    """templates/nvidia-receive.sh.j2: copy (`via`: {"node", "ip"} node to node; `local`: this
    host's own kept build; `incoming`: the controller filled RECV_ROOT/<key>), verify, sign, place in $B/out."""
    from operations.nvidia import BUILD_ROOT, SIGN_FILE

    return render_template(
        "nvidia-receive.sh.j2", version=version, release=release, key=key, source=source, via=via, local=local,
        incoming=incoming, remote=f"tar -C {word(f'{SHARE_ROOT}/{key}')} -cf - .", recv_root=RECV_ROOT,
        build_root=BUILD_ROOT, build_parent=f"{BUILD_ROOT}/{version}", signing=tuple(signing) if signing else None,
        sig_hash=sig_hash, modules_dir="/lib/modules", sign_file=SIGN_FILE)


def _refuse(state, host, release: str, why: str) -> bool:
    _run(state).refused[(host.name, release)] = why
    logger.warning(f"{host.name}: {why}; building here instead")
    return True


def _shell(host, command: str) -> tuple[bool, str, list[str]]:
    ok, output = host.run_shell_command(StringCommand(command))
    said = visible(" ".join(" ".join(output.stderr_lines or output.stdout_lines).split()))
    return ok, said, list(output.stdout_lines)


def receive(state, host, version: str, release: str, signing: tuple[str, str] | None, sig_hash: str) -> bool:
    """FunctionCommand body of `receive_modules`: the copy, its verification and signing; a refusal
    or a failed copy leaves the host to build itself (`fallback_if`); a failed build of its group
    fails the host."""
    run = _run(state)
    this = step(host.name, release, state) or {}
    key, source = this.get("key"), this.get("from")
    if not key or not source:
        return _refuse(state, host, release, f"nvidia {version} for {release}: no build to receive")
    own_copy = source == host.name
    kept = any(release in rels for k, rels in (run.hosts.get(source, {}).get("published") or {}).items() if k == key)
    if not own_copy and not kept and run.built.get(key) != source:
        logger.error(f"{host.name}: nvidia {version} for {release}: the build on {source} for this host's inputs "
                     f"(key {key[:12]}) failed (its error above); the same inputs here would fail the same way")
        return False
    common = dict(version=version, release=release, key=key, source=source, signing=signing, sig_hash=sig_hash)
    if own_copy:
        command = receive_command(local=f"{SHARE_ROOT}/{key}", **common)
    elif this.get("via"):
        command = receive_command(via=this["via"], **common)
    else:
        source_host = state.inventory.get_host(source)
        incoming, why = _through_controller(host, source_host, key)
        if incoming is None:
            return _refuse(state, host, release, f"nvidia {version} for {release}: the copy from {source} through "
                                                 f"the controller failed ({why})")
        command = receive_command(incoming=True, **common)
    ok, said, out = _shell(host, command)
    if not ok:
        return _refuse(state, host, release, said or f"nvidia {version} for {release}: the copy from {source} failed")
    for line in out[-1:]:
        logger.info(f"{host.name}: {visible(line)}")
    return True


def _through_controller(host, source_host, key: str) -> tuple[str | None, str]:
    """Copy SHARE_ROOT/<key>/ of `source_host` into RECV_ROOT/<key>/ (made afresh, root's alone) on
    `host` through the controller (pyinfra get_file, put_file; only the manifest and the modules it
    names): the dir, or None and why."""
    from plan.render import root_dirs

    incoming = f"{RECV_ROOT}/{key}"
    ok, said, _ = _shell(host, root_dirs((RECV_ROOT, "700")) + f"rm -rf {operands(incoming)} && mkdir -m 700 {operands(incoming)}")
    if not ok:
        return None, f"no scratch dir on {host.name}: {said}"
    manifest = BytesIO()
    if not source_host.get_file(f"{SHARE_ROOT}/{key}/{MANIFEST}", manifest):
        return None, f"{source_host.name} has no {SHARE_ROOT}/{key}/{MANIFEST}"
    names = [m.group(1) for m in map(_SUM_LINE.match, manifest.getvalue().decode(errors="replace").splitlines()) if m]
    files: list[tuple[str, Any]] = [(MANIFEST, manifest)]
    for name in names:
        data = BytesIO()
        if not source_host.get_file(f"{SHARE_ROOT}/{key}/{name}", data):
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
