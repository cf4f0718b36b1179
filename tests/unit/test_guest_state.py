"""facts.guest_state: the guests' configs, lxc's running CTs and the VMs' pid files parsed, and the run's one reading of them: kept while
nothing changes guests, read again after an operation yielded a guest stop/start while pyinfra
executes (the rebind transaction, a CT start), kept when that yield came while pyinfra only
generated operations (nothing ran then)."""

from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from facts.guest_state import GuestState, guest_state, guest_state_changes, parse_guest_state, remember_guest_state
from operations.gpus import rebind_gpus
from operations.guests import container_gpu_devices
from tests.unit.operations.test_gpus_ops import NVIDIA, PCT_LIST, PLAN, QM_LIST
from tests.unit.operations.test_guests_ops import IGPU, facts_for

NO_GPUS = {103: {"gpus": [], "gid": 44}}  # CT 103's config already passes exactly these (none)


def test_ct_and_vm_states():
    parsed = parse_guest_state(["@@ lxc", *PCT_LIST.splitlines(), "@@ qemu", *QM_LIST.splitlines()])
    assert parsed == {"pct": True, "lxc": {200: "running", 201: "stopped"}, "qemu": {300: "running"}}
    assert GuestState().process(["@@ qemu"]) == GuestState.default() == {"pct": False, "lxc": {}, "qemu": {}}


def node(lxc: dict):
    """A fake host whose `pct list` shows `host.lxc` at the moment it is read; counts those reads."""
    host = create_host(FakeState(), facts=facts_for({103: IGPU}, {}))
    host.lxc, host.guest_reads = dict(lxc), 0
    fake_get_fact = host.get_fact

    def get_fact(fact_cls, **kwargs):
        if fact_cls is GuestState:
            host.guest_reads += 1
            return {"pct": True, "lxc": dict(host.lxc), "qemu": {}}
        return fake_get_fact(fact_cls, **kwargs)

    host.get_fact = get_fact
    return host


def in_phase(host, executing: bool, call, *args, **kwargs):
    """`call` on `host` while pyinfra generates (executing False) or executes operations; an
    operation's commands as strings (pyinfra runs each as it is yielded)."""
    state = FakeState()
    state.is_executing = executing
    with ctx_state.use(state), ctx_host.use(host):
        result = call(*args, **kwargs)
        return [str(c) for c in result] if hasattr(result, "__next__") else result


def test_one_reading_serves_the_run_while_nothing_changes_guests():
    host = node({103: "running"})
    assert in_phase(host, False, guest_state)["lxc"] == {103: "running"}
    assert in_phase(host, False, guest_state)["lxc"] == {103: "running"}
    assert in_phase(host, True, container_gpu_devices._inner, NO_GPUS, True) == []
    assert host.noop_description == "every container passes exactly its GPUs"
    assert host.guest_reads == 1


def test_a_reading_kept_from_a_combined_fact_costs_no_read():
    host = node({103: "running"})
    in_phase(host, False, remember_guest_state, {"pct": True, "lxc": {103: "stopped"}, "qemu": {}})
    assert in_phase(host, True, guest_state)["lxc"] == {103: "stopped"} and host.guest_reads == 0


def test_read_again_after_the_rebind_transaction_stopped_guests():
    host = node({103: "running"})
    assert in_phase(host, False, guest_state)["lxc"] == {103: "running"}  # the GPU stage's facts
    # generating: pyinfra runs the op up to its first command to see whether it changes anything;
    # nothing runs, so the reading stays
    generated = in_phase(host, False, rebind_gpus._inner, PLAN, NVIDIA)
    assert "pct shutdown 200" in generated[0]
    assert in_phase(host, False, guest_state)["lxc"] == {103: "running"} and host.guest_reads == 1
    # executing: the transaction's script stops the guests (here: CT 103 is stopped afterwards)
    in_phase(host, True, rebind_gpus._inner, PLAN, NVIDIA)
    host.lxc[103] = "stopped"
    # the guests stage sees CT 103 stopped and starts it (a stale "running" would leave it stopped)
    assert in_phase(host, True, container_gpu_devices._inner, NO_GPUS, True, start_after=[103]) == ["pct start 103"]
    assert host.guest_reads == 2
    # that start drops the reading too: whatever reads next sees the node as it is then
    host.lxc[103] = "running"
    assert in_phase(host, True, guest_state)["lxc"] == {103: "running"} and host.guest_reads == 3


def test_guest_state_changes_drops_the_reading_only_while_executing():
    host = node({103: "running"})
    in_phase(host, False, guest_state)
    in_phase(host, False, guest_state_changes)
    in_phase(host, False, guest_state)
    assert host.guest_reads == 1
    in_phase(host, True, guest_state_changes)
    in_phase(host, True, guest_state)
    assert host.guest_reads == 2


def test_vm_section_takes_only_id_and_state_lines():
    """Only `VMID running|stopped` lines count: anything else the shell printed (an error text)
    is not a VM."""
    parsed = parse_guest_state(["@@ qemu", "300 running", "301 stopped", "sh: 1: cannot open x: No such file",
                                "302 paused", "303"])
    assert parsed["qemu"] == {300: "running", 301: "stopped"}
