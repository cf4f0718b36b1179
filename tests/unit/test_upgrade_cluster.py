"""Issue 40 item 2: the nodes of a Proxmox cluster are upgraded from 8 to 9 one at a time
(plan/upgrade_perform.py node_phase, cluster_refusals, turn_wait; operations/upgrade.py turn_wait,
confirm). A node starts only when every node of its cluster is in the run, online and quorate,
no other node is still in its upgrade, and no other node claimed the run's turn; a node
counts as done once a run found its host checks passing on 9's kernel (`checked=` in its state)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from pyinfra.context import ctx_host, ctx_state

from plan.reboot import ClusterView, parse_cluster
from plan.upgrade_perform import (
    ON_8,
    UPGRADED,
    UPGRADING,
    NodePhase,
    cluster_refusals,
    job_reading,
    node_phase,
    turn_wait,
)
from tests.unit.test_upgrade_perform import _readings, perform_spec  # noqa: F401 (a fixture)

PVE8 = {"version": "8.4.14", "major": 8, "minor": 4, "running_kernel": "6.8.12-15-pve"}
PVE9_ON_8_KERNEL = {"version": "9.1.1", "major": 9, "minor": 1, "running_kernel": "6.8.12-15-pve"}
PVE9 = {"version": "9.1.1", "major": 9, "minor": 1, "running_kernel": "6.17.2-1-pve"}


def _job(*state: str, lock: str | None = "free") -> dict:
    return job_reading(list(state), lock, [])


@pytest.mark.parametrize("job, pve, phase, words", [
    (_job(), PVE8, ON_8, "on Proxmox VE 8"),
    (_job(), PVE9, UPGRADED, "on Proxmox VE 9"),  # upgraded without pvegpu
    (_job("status=running", "step=full-upgrade", lock="held"), PVE8, UPGRADING, "job runs (step full-upgrade"),
    (_job("status=running", "step=full-upgrade"), PVE8, UPGRADING, "job interrupted at step full-upgrade"),
    (_job("status=failed", "step=dpkg-configure"), PVE9_ON_8_KERNEL, UPGRADING, "failed at step dpkg-configure"),
    (_job("status=done"), PVE9_ON_8_KERNEL, UPGRADING, "still runs 8's kernel 6.8.12-15-pve"),
    (_job("status=done"), PVE9, UPGRADING, "has not passed its host checks"),
    (_job("status=done", "checked=x"), dict(PVE9, running_kernel="6.12.118+deb13-amd64"), UPGRADED, "passed x"),
    (_job("status=done", "checked=2026-12-07T00:01:02Z"), PVE9, UPGRADED, "host checks passed 2026-12-07T00:01:02Z"),
    # a check recorded while 8's kernel runs again (the loader fell back): not done
    (_job("status=done", "checked=2026-12-07T00:01:02Z"), PVE9_ON_8_KERNEL, UPGRADING, "still runs 8's kernel"),
    (_job(), None, "unknown", "could not be read"),
])
def test_a_nodes_phase(job, pve, phase, words):
    found = node_phase(job, pve)
    assert found.phase == phase and words in found.why


def test_a_node_is_done_once_its_moved_guests_are_back():
    checked = _job("status=done", "checked=x")
    found = node_phase(checked, PVE9, ["back qemu 301 b"])
    assert found.phase == UPGRADING and "guests moved away for its upgrade are not back yet (qemu 301 on b)" in found.why
    assert node_phase(checked, PVE9, []).phase == UPGRADED


def test_checked_counts_only_for_a_done_job():
    assert _job("status=running", "checked=x", lock="held")["checked"] is None
    assert _job("status=done", "checked=x")["checked"] == "x"


def _view(online: dict[str, bool], quorate: bool = True, node: str = "a") -> ClusterView:
    members = {"nodename": node, "cluster": {"name": "gpu", "quorate": int(quorate)},
               "nodelist": {n: {"id": i, "online": int(up)} for i, (n, up) in enumerate(online.items(), 1)}}
    return parse_cluster(json.dumps(members), None)


def test_a_cluster_refuses_what_it_cannot_see_or_spare():
    assert cluster_refusals(_view({"a": True, "b": True, "c": True}), {"a", "b", "c"}) == []
    outside = cluster_refusals(_view({"a": True, "b": True, "c": True}), {"a", "b"})
    assert len(outside) == 1 and "node(s) c of cluster gpu are not in this run" in outside[0]
    found = " ".join(cluster_refusals(_view({"a": True, "b": True, "c": False}, quorate=False), {"a", "b", "c"}))
    assert "has no quorum" in found and "node(s) c of cluster gpu are offline" in found
    assert cluster_refusals(parse_cluster(json.dumps({"nodename": "a"}), None), set()) == []  # a single node


def test_one_node_at_a_time():
    on_8, busy = NodePhase(ON_8, "on Proxmox VE 8"), NodePhase(UPGRADING, "its upgrade job runs (step x since y)")
    assert turn_wait("b", "gpu", {"a": on_8, "c": NodePhase(UPGRADED, "on Proxmox VE 9")}, []) is None
    said = turn_wait("b", "gpu", {"a": busy, "c": on_8}, []) or ""
    assert "one at a time" in said and "a: its upgrade job runs" in said
    said = turn_wait("b", "gpu", {"a": on_8, "c": on_8}, ["a"]) or ""
    assert "a starts its upgrade in this run" in said
    assert turn_wait("a", "gpu", {"b": on_8}, ["a"]) is None  # its own start is no reason to wait
    assert "could not be read" in (turn_wait("b", "gpu", {"a": NodePhase("unknown", "its Proxmox VE version could "
                                                                         "not be read")}, []) or "")


# -- operations/upgrade.py over a run of several hosts (pyinfra's state and hosts, the facts given) --

class _Host:
    def __init__(self, name: str, data: dict):
        self.name, self.data = name, data


class _State(SimpleNamespace):
    def is_host_in_limit(self, h):
        return self.limit is None or h in self.limit


def _cluster_run(monkeypatch, jobs: dict[str, tuple[list[str], str | None, dict]], limit: list[str] | None = None,
                 offline: tuple[str, ...] = ()):
    """A run over nodes a, b, c of cluster gpu; each node's (state lines, lock, PveVersion)."""
    from facts.files import FileTexts
    from facts.upgrade import UpgradeJob
    from operations import upgrade

    hosts = {n: _Host(name=n, data={}) for n in jobs}
    state = _State(inventory=list(hosts.values()), activated_hosts=set(hosts.values()),
                   active_hosts={h for n, h in hosts.items() if not limit or n in limit},
                   limit=[hosts[n] for n in limit] if limit else None)
    reads: list[str] = []

    def members(node: str) -> str:
        return json.dumps({"nodename": node, "cluster": {"name": "gpu", "quorate": 1},
                           "nodelist": {n: {"id": i, "online": int(n not in offline)} for i, n in enumerate(jobs, 1)}})

    def fact_once(cls, **kw):
        lines, lock, pve = jobs[ctx_host.get().name]
        readings = _readings(pve["major"], lines, lock, kernel=pve["running_kernel"])
        readings[FileTexts] = {upgrade.CLUSTER_FILES[0]: members(ctx_host.get().name)}
        readings[UpgradeJob] = {**UpgradeJob.default(), **readings[UpgradeJob]}
        return readings.get(cls)

    def read_fact(probe):  # the cross-host read: one command on the other node
        name = ctx_host.get().name
        reads.append(name)
        lines, lock, pve = jobs[name]
        return [{"state": lines, "lock": lock, "log": [], "guests": []}, pve]

    monkeypatch.setattr(upgrade, "fact_once", fact_once)
    monkeypatch.setattr(upgrade, "read_fact", read_fact)
    monkeypatch.setattr(upgrade, "guest_state", lambda: {"lxc": {}, "qemu": {}})
    return upgrade, hosts, state, reads


def _plan(upgrade, hosts, state, spec, order: list[str]) -> dict[str, tuple[list[str], str | None, bool]]:
    """Each host planned as deploy.py does, in the run's order: (refusals, wait, starts)."""
    out = {}
    with ctx_state.use(state):
        for name in order:
            with ctx_host.use(hosts[name]):
                refusals = upgrade.perform_preflight(spec)
                wait = None if refusals else upgrade.turn_wait(spec)
                starting = not refusals and not wait and upgrade.starts(spec)
                out[name] = (refusals, wait, starting)
    return out


def test_the_first_node_starts_and_the_others_wait(monkeypatch, perform_spec):  # noqa: F811
    upgrade, hosts, state, reads = _cluster_run(monkeypatch, {n: ([], None, PVE8) for n in "abc"})
    out = _plan(upgrade, hosts, state, perform_spec, ["a", "b", "c"])
    assert out["a"] == ([], None, True)
    for n in "bc":
        refusals, wait, starting = out[n]
        assert refusals == [] and not starting and "a starts its upgrade in this run" in (wait or "")
    # a read b and c from their hosts (planned after it); b and c found the others' phases registered
    assert sorted(reads) == ["b", "c"]


def test_a_node_in_its_upgrade_holds_the_others(monkeypatch, perform_spec):  # noqa: F811
    # c (planned last) is done and runs 8's kernel: a and b, planned before it, wait all the same
    upgrade, hosts, state, _ = _cluster_run(monkeypatch, {"a": ([], None, PVE8), "b": ([], None, PVE8),
                                                          "c": (["status=done"], "free", PVE9_ON_8_KERNEL)})
    out = _plan(upgrade, hosts, state, perform_spec, ["a", "b", "c"])
    for n in "ab":
        assert not out[n][2] and "c: its upgrade is done and it still runs 8's kernel" in (out[n][1] or "")
    assert out["c"] == ([], None, False)  # c converges on 9 (its reboot is the reboot stage's)


def test_the_next_node_starts_once_the_last_one_is_checked(monkeypatch, perform_spec):  # noqa: F811
    done = (["status=done", "checked=2026-12-07T00:01:02Z"], "free", PVE9)
    upgrade, hosts, state, _ = _cluster_run(monkeypatch, {"a": done, "b": ([], None, PVE8), "c": ([], None, PVE8)})
    out = _plan(upgrade, hosts, state, perform_spec, ["a", "b", "c"])
    assert out["b"] == ([], None, True) and "b starts its upgrade" in (out["c"][1] or "")
    # unchecked on 9's kernel: the others wait for a run to check it
    upgrade, hosts, state, _ = _cluster_run(monkeypatch, {"a": (["status=done"], "free", PVE9),
                                                          "b": ([], None, PVE8), "c": ([], None, PVE8)})
    out = _plan(upgrade, hosts, state, perform_spec, ["b", "c", "a"])
    assert "a: it runs kernel 6.17.2-1-pve and has not passed its host checks" in (out["b"][1] or "")


def test_a_node_outside_the_run_or_offline_refuses_the_start(monkeypatch, perform_spec):  # noqa: F811
    upgrade, hosts, state, _ = _cluster_run(monkeypatch, {n: ([], None, PVE8) for n in "abc"}, limit=["a", "b"])
    out = _plan(upgrade, hosts, state, perform_spec, ["a", "b"])
    assert "node(s) c of cluster gpu are not in this run" in " ".join(out["a"][0])
    upgrade, hosts, state, _ = _cluster_run(monkeypatch, {n: ([], None, PVE8) for n in "abc"}, offline=("c",))
    out = _plan(upgrade, hosts, state, perform_spec, ["a"])
    assert "node(s) c of cluster gpu are offline" in " ".join(out["a"][0])


# -- the check that lets the next node go -----------------------------------------------------------

class _Shell:
    def __init__(self, answers: list[tuple[bool, list[str]]]):
        self.answers, self.name = answers, "a"
        self.commands: list[str] = []

    def run_shell_command(self, command):
        self.commands.append(str(command))
        ok, lines = self.answers.pop(0)
        return ok, SimpleNamespace(stdout_lines=lines, stderr_lines=[])


@pytest.mark.parametrize("answer, passed", [
    ((True, ["kernel=6.17.2-1-pve"]), True),
    ((True, ["kernel=6.8.12-15-pve"]), False),  # the checks hold, but on 8's kernel
    ((True, ["kernel=6.14.8-2-bpo12-pve"]), False),
    ((True, ["kernel=6.12.118+deb13-amd64"]), True),  # not a Proxmox kernel's name (the twin's 9 kernel): not 8's
    ((False, ["kernel=6.17.2-1-pve", "nvidia 580.95.05 not loaded"]), False),
])
def test_confirm_records_checked_only_on_9s_kernel_with_the_checks_passing(answer, passed):
    from operations import upgrade

    shell = _Shell([answer, (True, [])])
    assert upgrade._confirm(None, shell, ["nvidia 580.95.05"]) is passed
    assert "printf '%s\\n' 'nvidia 580.95.05'" in shell.commands[0]
    wrote = [c for c in shell.commands if "checked=" in c]
    assert bool(wrote) is passed and (not wrote or wrote[0].endswith(">> /var/lib/pvegpu/upgrade/state"))
    if wrote:  # under the checked root-only dir, into a regular file that is no link
        assert wrote[0].index("pvegpu_dir /var/lib/pvegpu/upgrade 700") < wrote[0].index("[ ! -L /var/lib/pvegpu/upgrade/state ]")


@pytest.mark.parametrize("state, pve, rebooted, called", [
    (["status=done"], PVE9, False, True),
    (["status=done", "checked=x"], PVE9, False, False),  # once
    (["status=done"], PVE9_ON_8_KERNEL, False, False),  # no reboot allowed: the record waits
    (["status=done"], PVE9_ON_8_KERNEL, True, True),  # this run rebooted it for the upgrade
    (["status=running"], PVE8, False, False),
])
def test_confirm_runs_once_on_9s_kernel(monkeypatch, perform_spec, state, pve, rebooted, called):  # noqa: F811
    from operations import upgrade

    readings = _readings(pve["major"], state, "free" if "status=running" not in state else "held",
                         kernel=pve["running_kernel"])
    monkeypatch.setattr(upgrade, "fact_once", lambda cls, **kw: readings.get(cls))
    monkeypatch.setattr(upgrade, "_rebooted_for_upgrade", lambda: rebooted)
    calls: list = []
    monkeypatch.setattr(upgrade, "confirm_upgrade", lambda **kw: calls.append(kw))
    upgrade.confirm(perform_spec)
    assert bool(calls) is called
    if calls:
        assert calls[0]["checks"][0].startswith("nvidia ")


def test_a_waiting_node_stops_only_itself():
    """pyinfra's CLI ends every host's run on an exception raised while a deploy file loads: the
    waiting (or reporting) node fails itself instead, unless it is the run's last host."""
    from pyinfra.api.exceptions import DeployError

    from operations import upgrade

    a, b = _Host("a", {}), _Host("b", {})
    failed: list = []
    state = _State(active_hosts={a, b}, fail_hosts=lambda hosts: failed.extend(hosts))
    with ctx_state.use(state), ctx_host.use(b):
        upgrade.stop_host("pvegpu: host b: waits")
    assert failed == [b]
    state.active_hosts = {b}
    with ctx_state.use(state), ctx_host.use(b), pytest.raises(DeployError, match="waits"):
        upgrade.stop_host("pvegpu: host b: waits")


# -- reboot.guests: migrate, for the upgrade of a cluster's node -----------------------------------

def test_the_record_of_moved_guests():
    from plan.render import render_template
    from plan.upgrade_perform import parse_moved

    moved = [("back", "qemu", 301, "pve2"), ("ha-back", "vm:302", 302, "pve3"), ("start", "lxc", 200, "pve1")]
    text = render_template("pve-upgrade-moved.j2", moved=moved)
    assert text == "back qemu 301 pve2\nha-back vm:302 302 pve3\nstart lxc 200 pve1\n"
    assert parse_moved(text.splitlines()) == moved
    # not pvegpu's shapes: skipped
    assert parse_moved(["back lxc 200 pve2", "start qemu x pve1", "ha-back 302 302 pve3", "back qemu 1 -x",
                        "start qemu 5 pve1 extra"]) == []


def test_migrate_is_refused_only_outside_a_cluster(monkeypatch, perform_spec):  # noqa: F811
    from plan.upgrade_perform import PerformView, perform_refusals

    view = PerformView(pve8to9=["FAILURES: 0"], proxmox_ve="8.4.1", free_bytes=50 * 10**9,
                       running_gpu_guests=["VM 301"], reboot_guests="migrate")
    from plan.upgrade_perform import parse_sources
    view.sources = parse_sources({"/etc/apt/sources.list": ["deb http://deb.debian.org/debian bookworm main"]})
    assert any("this node is in no cluster" in r for r in perform_refusals(view))
    view.in_cluster = True
    assert perform_refusals(view) == []


def test_the_start_moves_the_guests_in_a_cluster(monkeypatch, perform_spec):  # noqa: F811
    from operations import upgrade

    spec = perform_spec.model_copy(update={"reboot": perform_spec.reboot.model_copy(update={"guests": "migrate"})})
    upgrade_, hosts, state, _ = _cluster_run(monkeypatch, {n: ([], None, PVE8) for n in "ab"})
    assert upgrade_ is upgrade
    operation = upgrade.start_upgrade
    calls: list = []
    monkeypatch.setattr(upgrade, "start_upgrade", lambda **kw: calls.append(kw))
    monkeypatch.setattr(upgrade, "start_commands", lambda spec: ("SCRIPT", "START"))
    monkeypatch.setattr(upgrade, "guest_state", lambda: {"lxc": {200: "running"}, "qemu": {}})
    with ctx_state.use(state), ctx_host.use(hosts["a"]):
        upgrade.start(spec)
    assert calls[0]["migrate"] == ("gpu", "a", spec.reboot.migrate_fallback) and calls[0]["stop"] == []
    assert "GPU guests moved" in calls[0]["name"]
    ops = list(operation._inner(script="s", start="START", stop=[], configs=[], timeout=9,
                                migrate=("gpu", "a", "refuse"), moved_before=[("start", "lxc", 200, "a")]))
    fn = next(op for op in ops if getattr(op, "function", None) is upgrade._clear_for_upgrade)
    assert fn.args == ("gpu", "a", "refuse", 9, [("start", "lxc", 200, "a")])
    assert str(ops[-1]) == "START" and ops.index(fn) < len(ops) - 2  # before the script and the start


def test_clearing_records_what_moved_even_when_a_guest_cannot_leave(monkeypatch):
    import operations.reboot as reboot
    from operations import upgrade

    def clear(state, host, cluster, node, fallback, timeout, occasion=""):
        assert occasion == "the 8 -> 9 upgrade"
        reboot.ROLL_MOVED.setdefault(host.name, []).append(("back", "qemu", 301, "b"))
        return False  # then VM 302 had nowhere to go

    monkeypatch.setattr(reboot, "clear_guests", clear)
    shell = _Shell([(True, [])])
    assert upgrade._clear_for_upgrade(None, shell, "gpu", "a", "refuse", 9, [("start", "lxc", 200, "a")]) is False
    assert "/var/lib/pvegpu/upgrade/guests-moved" in shell.commands[0]
    import base64
    assert base64.b64encode(b"start lxc 200 a\nback qemu 301 b\n").decode() in shell.commands[0]
    assert "a" not in reboot.ROLL_MOVED


@pytest.mark.parametrize("state, checked_now, called", [
    (["status=done", "checked=x"], False, True),
    (["status=done"], True, True),  # this run's confirm (it fails the host first when the checks fail)
    (["status=done"], False, False),
    (["status=running"], False, False),
])
def test_moved_guests_come_back_once_checked(monkeypatch, perform_spec, state, checked_now, called):  # noqa: F811
    from operations import upgrade

    upgrade_, hosts, st, _ = _cluster_run(monkeypatch, {"a": (state, "free", PVE9), "b": ([], None, PVE8)})
    job_fact = {"state": state, "lock": "free", "log": [], "guests": [], "moved": ["back qemu 301 b"]}
    monkeypatch.setattr(upgrade, "_job_fact", lambda: job_fact)
    monkeypatch.setattr(upgrade, "job", lambda spec: job_reading(state, "free", []))
    calls: list = []
    monkeypatch.setattr(upgrade, "restore_moved_guests", lambda **kw: calls.append(kw))
    with ctx_state.use(st), ctx_host.use(hosts["a"]):
        upgrade.restore_moved(perform_spec, checked_now)
    assert bool(calls) is called
    if calls:
        assert calls[0]["moved"] == [("back", "qemu", 301, "b")] and calls[0]["node"] == "a"
        assert "VM 301" in calls[0]["name"]


def test_moved_guests_wait_for_their_node_in_the_run(monkeypatch, perform_spec):  # noqa: F811
    from operations import upgrade

    state_lines = ["status=done", "checked=x"]
    upgrade_, hosts, st, _ = _cluster_run(monkeypatch, {"a": (state_lines, "free", PVE9), "b": ([], None, PVE8)},
                                          limit=["a"])
    monkeypatch.setattr(upgrade, "_job_fact", lambda: {"moved": ["back qemu 301 b"]})
    monkeypatch.setattr(upgrade, "job", lambda spec: job_reading(state_lines, "free", []))
    calls: list = []
    warned: list = []
    monkeypatch.setattr(upgrade, "restore_moved_guests", lambda **kw: calls.append(kw))
    monkeypatch.setattr(upgrade.logger, "warning", warned.append)
    with ctx_state.use(st), ctx_host.use(hosts["a"]):
        upgrade.restore_moved(perform_spec, False)
    assert calls == [] and "stay on node(s) b, which are not in this run" in warned[0]


def test_each_guest_back_then_the_record_shrinks(monkeypatch):
    import operations.reboot as reboot
    from operations import upgrade

    monkeypatch.setattr(upgrade, "guest_state_changes", lambda: None)
    moved = [("start", "lxc", 200, "a"), ("back", "qemu", 301, "b")]
    ops = list(upgrade.restore_moved_guests._inner(cluster="gpu", node="a", moved=moved, timeout=9))
    assert [op.args[2] for op in ops] == [moved[1], moved[0]]  # last first, as restore_guests
    assert [op.args[3] for op in ops] == [moved[:1], []]
    seen: list = []

    def restore(state, host, cluster, node, timeout, occasion="") -> bool:
        assert occasion == "the 8 -> 9 upgrade"
        seen.append(reboot.ROLL_MOVED[host.name])
        return True

    monkeypatch.setattr(reboot, "restore_guests", restore)
    shell = _Shell([(True, [])])
    assert upgrade._restore_one(None, shell, "gpu", "a", moved[1], moved[:1], 9)
    assert seen == [[moved[1]]] and "guests-moved" in shell.commands[0]
    shell = _Shell([(True, [])])
    assert upgrade._restore_one(None, shell, "gpu", "a", moved[0], [], 9)
    assert shell.commands[0] == "rm -f -- /var/lib/pvegpu/upgrade/guests-moved"


def test_a_guest_that_does_not_come_back_after_the_upgrade_stops_no_roll(monkeypatch):
    """restore_guests for the upgrade: its line names the upgrade, and no rolling reboot is marked
    stopped (ROLL_STOPPED is the roll's, in the same run)."""
    import operations.reboot as reboot

    monkeypatch.setattr(reboot, "run_nodes", lambda state: {})
    errors: list[str] = []
    monkeypatch.setattr(reboot.logger, "error", errors.append)
    shell = _Shell([(False, ["CT 200 is locked (backup)"])])
    reboot.ROLL_MOVED["a"] = [("start", "lxc", 200, "a")]
    assert reboot.restore_guests(None, shell, "gpu", "a", 9, occasion="the 8 -> 9 upgrade") is False
    assert "gpu" not in reboot.ROLL_STOPPED
    assert errors == ["a: CT 200 did not start again after the 8 -> 9 upgrade: CT 200 is locked (backup); a later run "
                      "tries again"]
    reboot.ROLL_MOVED["a"] = [("start", "lxc", 200, "a")]
    shell = _Shell([(False, ["CT 200 is locked (backup)"])])
    assert reboot.restore_guests(None, shell, "gpu", "a", 9) is False  # the roll's: it stops
    assert reboot.ROLL_STOPPED.pop("gpu")[0] == "a"
