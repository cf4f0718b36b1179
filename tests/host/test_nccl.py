"""Host checks for the NCCL environment (stage 8): the files equal the plan recomputed from the
host's own facts (the HardwareProbe and the NCCL stage's state fact, run here through testinfra).

    pytest tests/host --inventory inventories/kpro6.py
"""

from __future__ import annotations

import shlex

import pytest

from facts.guest_state import GuestState, running_containers, with_ct_status
from facts.hardware import HardwareProbe
from operations import nccl

_PLANS: dict[str, tuple[dict, dict]] = {}


def _lines(target, command: str) -> list[str]:
    _, out = target.run(command)
    return out.splitlines()


def planned(target) -> tuple[dict, dict]:
    """``(want, state)``: what the NCCL stage would write on this host, and what the host has."""
    if target.name not in _PLANS:
        spec = target.spec
        hardware = target.fact(HardwareProbe)
        ctids = sorted(int(c) for c, ct in spec.containers.items() if ct.gpus)
        paths = [nccl.NCCL_CONF] + [nccl.dropin_path(nccl.unit_name(s)) for s in spec.nccl.services]
        guests = GuestState().process(_lines(target, GuestState.command))
        found = nccl.NcclState().process(
            _lines(target, nccl.NcclState().command(paths, running_containers(guests, ctids))))
        state = with_ct_status(found, guests)
        _PLANS[target.name] = (nccl.desired(spec, hardware, state["rdma_devices"], state), state)
    return _PLANS[target.name]


def nccl_values(text: str) -> dict[str, str]:
    """What NCCL reads from an nccl.conf: NAME=value lines, '#' lines skipped."""
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or "=" not in line:
            continue
        name, value = line.split("=", 1)
        values[name.strip()] = value
    return values


def differences(where: str, have: str | None, want: str, env: dict[str, dict]) -> list[str]:
    """Sentences on how `have` (None: missing) differs from the planned text `want`."""
    if have is None:
        return [f"{where} is missing (it should set {', '.join(f'{k}={v}' for k, v in nccl_values(want).items()) or 'no variables'})"]
    have_values, want_values = nccl_values(have), nccl_values(want)
    problems = []
    for name, value in want_values.items():
        reason = " ".join(str(env.get(name, {}).get("reason", "")).split())
        if name not in have_values:
            problems.append(f"{where} lacks {name}={value} ({reason})")
        elif have_values[name] != value:
            problems.append(f"{where} sets {name}={have_values[name]}, the plan says {name}={value} ({reason})")
    for name in have_values.keys() - want_values.keys():
        problems.append(f"{where} sets {name}={have_values[name]}, which the plan does not")
    if not problems and have != want:
        problems.append(f"{where} sets the planned variables but its text (reasons) differs from the plan; re-run deploy.py")
    return problems


def test_host_nccl_conf_equals_the_plan(target):
    """The host's `/etc/nccl.conf` is the plan recomputed from the host's facts."""
    want, _ = planned(target)
    have = target.read(nccl.NCCL_CONF)
    problems = differences(nccl.NCCL_CONF, have, want["host"], want["plan"]["host"])
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_each_gpu_containers_nccl_conf_equals_the_plan(target):
    """The same in each GPU container."""
    want, state = planned(target)
    if not want["containers"]:
        pytest.skip(f"{target.name}: no container has GPUs")
    problems, unreachable = [], []
    for ctid, text in sorted(want["containers"].items()):
        status = state["status"].get(ctid)
        ct = state["containers"].get(ctid) or {}
        if status != "running":
            unreachable.append(f"CT {ctid} is {status or 'absent'}")
            continue
        if ct.get("root") and ct["root"] == state["host_root"]:
            unreachable.append(f"CT {ctid}'s / is the host's /")
            continue
        rc, out = target.run(f"pct exec {shlex.quote(str(ctid))} -- cat {shlex.quote(nccl.NCCL_CONF)}")
        problems += differences(f"CT {ctid}'s {nccl.NCCL_CONF}", out if rc == 0 else None, text,
                                want["plan"]["containers"][str(ctid)])
    if not problems and unreachable and len(unreachable) == len(want["containers"]):
        pytest.skip(f"{target.name}: no GPU container's {nccl.NCCL_CONF} could be checked: " + "; ".join(unreachable))
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_services_get_the_nccl_environment_and_nothing_stale(target):
    """`nccl.services` have their drop-in, and no stale drop-in is left."""
    want, state = planned(target)
    problems = []
    for path, (unit, text) in sorted(want["dropins"].items()):
        have = target.read(path)
        if have is None:
            problems.append(f"{unit} has no NCCL drop-in ({path} is missing)")
        elif have != text:
            problems.append(f"{path} differs from the plan for {unit}")
    stale = [p for p in state["dropins"] if p not in want["dropins"]]
    problems += [f"{p} is left from a service the spec no longer lists" for p in stale]
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_gpu_containers_dev_shm_holds_what_nccl_needs(target):
    """A GPU container's `/dev/shm` holds what NCCL's shared-memory transport needs where P2P is off.

    Containers whose GPU pairs are not all usable for P2P run NCCL's intra-host traffic through
    /dev/shm (charged to the container's memory): a missing or small one fails NCCL's init."""
    from plan.nccl import shm_problem

    want, state = planned(target)
    spec = target.spec
    checked, problems = 0, []
    for ctid in sorted(want["plan"]["containers"]):
        gpus = len(spec.containers[int(ctid)].gpus)
        if gpus < 2 or state["status"].get(int(ctid)) != "running":
            continue
        rc, out = target.run(f"pct exec {shlex.quote(str(ctid))} -- df -Pk /dev/shm")
        checked += 1
        problem = shm_problem(f"CT {ctid}", out.splitlines() if rc == 0 else [], gpus)
        if problem:
            problems.append(problem)
    if not checked:
        pytest.skip(f"{target.name}: no running container with two or more GPUs")
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_where_p2p_dma_is_stopped_the_remaining_paths_are_said(target):
    """Where P2P DMA is stopped, the paths NCCL variables do not close are named.

    NCCL_P2P_DISABLE closes NCCL's P2P transport only: the plan names symmetric memory
    (closed by NCCL_WIN_ENABLE=0) and the paths NCCL variables cannot close."""
    want, _ = planned(target)
    problems = []
    for scope, env in [("host", want["plan"]["host"]), *want["plan"]["containers"].items()]:
        p2p = env.get("NCCL_P2P_DISABLE")
        if not p2p or p2p["source"] != "rule":
            continue
        if (env.get("NCCL_WIN_ENABLE") or {}).get("value") != "0":
            problems.append(f"{scope}: NCCL_P2P_DISABLE=1 without NCCL_WIN_ENABLE=0 leaves NCCL's symmetric memory on")
        if not p2p.get("remains"):
            problems.append(f"{scope}: NCCL_P2P_DISABLE=1 does not say which GPU-to-GPU paths remain")
    assert not problems, f"{target.name}: " + "; ".join(problems)


def test_no_service_of_the_spec_bypasses_a_p2p_stop(target):
    """No service of the spec runs a custom allreduce past a P2P stop.

    Where the rules stop P2P DMA, a service that runs vLLM/SGLang with their custom allreduce
    on still does it (that path reads no NCCL variable)."""
    want, _ = planned(target)
    warnings = want.get("service_warnings") or []
    assert not warnings, f"{target.name}: " + "; ".join(warnings)
