"""NCCL stage: facts in, commands out (fake host); the state fact and the writes run in a real shell,
a container's write through a `pct` that runs it chrooted in the container's own root, the
drop-in checked by systemd-analyze."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from facts.guest_state import GuestState, with_ct_status
from facts.run_state import run_state
from operations import handlers, nccl
from operations.files import sha256_text
from spec.load import load_spec_file
from tests.unit.operations.fake_node import FakeNode, rewrite
from tests.unit.operations.oprun import NO_BUILDS, run_op
from tests.unit.test_nccl import nccl_conf_values
from tests.unit.test_topology_report import kpro6_hardware

ROOT = Path(__file__).resolve().parents[3]




def sh(command, env=None):
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True, env=env).stdout


class ShellHost:
    """A pyinfra host stand-in whose facts run their own command in a local shell (`env`: a PATH
    with the test's pct) and go through their process(); `commands` lists what ran."""

    name = "local"
    noop_description = None

    def __init__(self, env):
        self.env, self.commands, self.data = env, [], {}

    def noop(self, description):
        self.noop_description = description

    def get_fact(self, fact_cls, _env=None, **kwargs):
        fact = fact_cls()
        command = fact.command(**kwargs) if callable(fact.command) else fact.command
        self.commands.append(command)
        # as pyinfra's make_unix_command: the `_env` of a fact read is exported before its command
        exports = "".join(f"export {k}={v}; " for k, v in (_env or {}).items())
        return fact.process(sh(exports + rewrite(self.env, command), self.env).splitlines())


def read_in_shell(env, read, *args):
    """`read(*args)` (e.g. `nccl.nccl_state`) on a fresh `ShellHost`: its result and the commands it ran."""
    shell_host = ShellHost(env)
    with ctx_state.use(FakeState()), ctx_host.use(shell_host):
        return read(*args), shell_host.commands


def kpro6_spec(**nccl_changes):
    spec = load_spec_file(ROOT / "inventories" / "kpro6.yml")["kpro6"]
    if nccl_changes:
        spec = spec.model_copy(update={"nccl": spec.nccl.model_copy(update=nccl_changes)})
    return spec


def guest_lines(**status):
    """What `GuestState`'s command prints for CTs of these states (configs, lxc's running CTs)."""
    return ["@@ lxc", *status, "@@ lxc-active", *(ctid for ctid, st in status.items() if st == "running")]


def state_for(want, *, ct_status="running", ct_root="65:34", systemd=True, dropins=None, converged=True):
    """An NcclState as the fact returns it: converged (every file as wanted) or fresh (nothing written)."""
    files = {nccl.NCCL_CONF: {"mode": "644", "sha256": sha256_text(want["host"])} if converged else None}
    for path, (_, text) in want["dropins"].items():
        files[path] = {"mode": "644", "sha256": sha256_text(text)} if converged else None
    lines = ["@@ files"]
    for path, entry in files.items():
        lines += [f"==> pvegpu-file {path}", *([entry["mode"], entry["sha256"]] if entry else ["MISSING"])]
    lines += ["@@ rdma", "@@ systemd", *(["running"] if systemd else []),
              "@@ dropins", *(dropins if dropins is not None else (want["dropins"] if converged else [])),
              "@@ root", "64:5472336"]
    if ct_status == "running":
        for ctid, text in want["containers"].items():
            lines += [f"@@ ct {ctid}", ct_root,
                      *(["644", sha256_text(text)] if converged else ["MISSING"])]
    guests = GuestState().process(guest_lines(**{str(c): ct_status for c in want["containers"]}))
    return with_ct_status(nccl.NcclState().process(lines), guests)


def commands_of(ops):
    out = []
    for op, kwargs in ops:
        kwargs = {k: v for k, v in kwargs.items() if k != "name"}
        commands, noop = run_op(op, facts=NO_BUILDS, **kwargs)
        out.append((op.__name__, commands, noop))
    return out


# ---------------------------------------------------------------- plan into files

def test_kpro6_host_and_container_files_disable_p2p_with_the_sev_snp_reason():
    want = nccl.desired(kpro6_spec(), kpro6_hardware(), rdma_devices=[])
    host_values = nccl_conf_values(want["host"])
    # no NCCL_IB_DISABLE: without RDMA devices NCCL uses sockets by itself
    assert host_values == {"NCCL_P2P_DISABLE": "1", "NCCL_WIN_ENABLE": "0"}
    assert "P2P DMA is unsafe on this host: SEV-SNP is on" in want["host"]
    assert set(want["containers"]) == {200}
    assert nccl_conf_values(want["containers"][200]) == {"NCCL_P2P_DISABLE": "1", "NCCL_WIN_ENABLE": "0"}
    assert "(container 200)" in want["containers"][200]
    dry = nccl.describe(want)
    assert any(line.startswith("NCCL (host): NCCL_P2P_DISABLE=1  — ") and "P2P DMA is unsafe" in line for line in dry)
    assert any(line.startswith("NCCL (CT 200): NCCL_WIN_ENABLE=0") for line in dry)
    assert any("restarted" in line for line in dry)


def test_services_get_the_host_variables_as_environment():
    spec = kpro6_spec(services=["vllm", "ray-head.service"], overrides={"NCCL_DEBUG": "WARN"})
    want = nccl.desired(spec, kpro6_hardware(), rdma_devices=["mlx5_0"])
    assert "NCCL_IB_DISABLE" not in nccl_conf_values(want["host"])
    assert sorted(want["dropins"]) == ["/etc/systemd/system/ray-head.service.d/pvegpu-nccl.conf",
                                       "/etc/systemd/system/vllm.service.d/pvegpu-nccl.conf"]
    unit, text = want["dropins"]["/etc/systemd/system/vllm.service.d/pvegpu-nccl.conf"]
    assert unit == "vllm.service"
    env_lines = [line for line in text.splitlines() if line.startswith("Environment=")]
    assert env_lines == ['Environment="NCCL_DEBUG=WARN"', 'Environment="NCCL_P2P_DISABLE=1"',
                         'Environment="NCCL_WIN_ENABLE=0"']
    assert "# [override] set by the spec's NCCL overrides" in text


@pytest.mark.parametrize("service, unit", [("vllm", "vllm.service"), ("ray.socket", "ray.socket"),
                                           ("getty@tty1.service", "getty@tty1.service"), ("a.b", "a.b.service"),
                                           ("a..b", "a..b.service"), ("job@.service", "job@.service")])
def test_unit_names(service, unit):
    assert nccl.unit_name(service) == unit


# systemd's unit_name_is_valid() takes "a..b" (-> a..b.service): '/' is what would climb, and it is refused
@pytest.mark.parametrize("service", ["../../etc/passwd", "a/b", "x y", ".hidden", "@x.service", "x" * 250, ""])
def test_paths_and_spaces_are_refused_as_unit_names(service):
    with pytest.raises(ValueError, match="is not a systemd unit name"):
        nccl.unit_name(service)


def test_preflight_refuses_a_service_name_that_would_be_a_path():
    refusals = nccl.preflight(kpro6_spec(services=["vllm", "../x"]))
    assert refusals == ["nccl.services: '../x' is not a systemd unit name: it holds '/' (it becomes a directory name "
                        "under /etc/systemd/system) (letters, digits, ':-_.\\@', like 'vllm' or 'vllm.service')"]
    assert nccl.preflight(kpro6_spec(services=["vllm"])) == []


@pytest.mark.skipif(not shutil.which("systemd-analyze") or not Path("/lib/systemd/system/sysinit.target").exists(),
                    reason="needs systemd-analyze and systemd's units")
def test_dropin_with_awkward_values_passes_systemd_analyze_verify(tmp_path):
    root = tmp_path / "root"
    shutil.copytree("/lib/systemd/system", root / "lib/systemd/system", symlinks=True)
    unit_dir = root / "etc/systemd/system"
    unit_dir.mkdir(parents=True)
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/true").write_text("#!/bin/sh\n")
    (root / "usr/bin/true").chmod(0o755)
    (unit_dir / "vllm.service").write_text("[Unit]\nDescription=x\n[Service]\nExecStart=/usr/bin/true\n")
    env = {"NCCL_DEBUG_SUBSYS": {"value": 'INIT,"x" 100% \\', "reason": "test", "source": "rule"}}
    verify = ["systemd-analyze", "verify", "--man=no", f"--root={root}", "/etc/systemd/system/vllm.service"]
    (unit_dir / "vllm.service.d").mkdir()
    dropin = unit_dir / "vllm.service.d" / nccl.DROPIN_NAME
    # the check can fail: the same value unescaped is reported
    dropin.write_text('[Service]\nEnvironment="NCCL_DEBUG_SUBSYS=INIT,"x" 100% \\"\n')
    bad = subprocess.run(verify, capture_output=True, text=True)
    assert "Invalid syntax, ignoring" in bad.stderr, bad.stderr
    dropin.write_text(nccl.render_dropin("vllm.service", env))
    good = subprocess.run(verify, capture_output=True, text=True)
    assert good.returncode == 0 and good.stderr == "", good.stderr
    assert nccl.systemd_assignment("NCCL_DEBUG_SUBSYS", 'INIT,"x" 100% \\') == '"NCCL_DEBUG_SUBSYS=INIT,\\"x\\" 100%% \\\\"'


# ---------------------------------------------------------------- the stage's operations

class Target:
    """Something to hang a run state on (the handler registry lives there)."""


def reload_runs(want, state, stamps=None):
    """The daemon-reload handler as the end-of-run step would run it after this stage declared."""
    target = Target()
    nccl.declare_reload(want, state, target=target)
    return [r for r in handlers.handler_runs(handlers.pending(target), stamps or {}) if r["handler"] == handlers.DAEMON_RELOAD]


def test_after_the_reboot_daemon_reload_runs_again_only_for_a_dropin_that_pass_changes():
    """The pass after the reboot (operations.nccl:converge, after_reboot) declares the drop-ins
    again: the reasons of the pass before the reboot (already reloaded) do not count, a drop-in
    the new plan changes does."""
    spec = kpro6_spec(services=["vllm"])
    want = nccl.desired(spec, kpro6_hardware(), rdma_devices=[])
    target = Target()
    nccl.declare_reload(want, state_for(want, converged=False), target=target)  # before the reboot: written
    assert handlers.pending(target)[handlers.DAEMON_RELOAD]["reasons"]
    assert nccl.declare_reload_again(want, state_for(want), target=target) is False
    other = nccl.desired(kpro6_spec(services=["vllm"], overrides={"NCCL_DEBUG": "WARN"}), kpro6_hardware(),
                         rdma_devices=[])
    assert nccl.declare_reload_again(other, state_for(want), target=target) is True
    assert handlers.pending(target)[handlers.DAEMON_RELOAD]["reasons"] == ["NCCL environment of vllm.service changed"]


def test_converged_host_every_operation_is_a_noop():
    spec = kpro6_spec(services=["vllm"])
    want = nccl.desired(spec, kpro6_hardware(), rdma_devices=[])
    state = state_for(want)
    results = commands_of(nccl.stage_operations(want, state))
    assert [name for name, _, _ in results] == ["managed_file", "container_nccl_conf", "managed_file"]
    assert all(commands == [] for _, commands, _ in results), results
    assert [noop for _, _, noop in results] == [
        "/etc/nccl.conf is up to date", "CT 200: /etc/nccl.conf is up to date",
        "/etc/systemd/system/vllm.service.d/pvegpu-nccl.conf is up to date"]
    # the drop-in is an input of the daemon-reload handler, with no reason: the stamp of the run
    # that wrote it matches, so nothing reloads
    first = reload_runs(want, state_for(want, converged=False))
    stamp = {handlers.stamp_path(handlers.DAEMON_RELOAD): {"mode": "644", "sha256": sha256_text(first[0]["stamp"])}}
    (run,) = reload_runs(want, state, stamp)
    assert run["reasons"] == [] and run["stamp"] == first[0]["stamp"]
    assert run_op(handlers.run_handler, **{k: v for k, v in run.items() if k != "name"}) == (
        [], "daemon-reload: no stage changed what it depends on")


def test_fresh_host_writes_host_container_dropin_and_reloads_systemd_once_late():
    spec = kpro6_spec(services=["vllm"])
    want = nccl.desired(spec, kpro6_hardware(), rdma_devices=[])
    state = state_for(want, converged=False)
    results = commands_of(nccl.stage_operations(want, state))
    assert [len(c) for _, c, _ in results] == [1, 1, 1]
    host_write, ct_write, dropin_write = (c[0] for _, c, _ in results)
    assert host_write.endswith("mv -f -- /etc/nccl.conf.pvegpu-tmp /etc/nccl.conf")
    assert ct_write.startswith("pct exec 200 -- sh -c 'umask 022 && mkdir -p -- /etc && printf %s ")
    assert "vllm.service.d/pvegpu-nccl.conf" in dropin_write
    (run,) = reload_runs(want, state)
    assert run["reasons"] == ["NCCL environment of vllm.service changed"]
    assert run["name"] == "systemctl daemon-reload once: NCCL environment of vllm.service changed"
    assert run["stamp"].endswith(" 644 /etc/systemd/system/vllm.service.d/pvegpu-nccl.conf\n")
    (command,), _ = run_op(handlers.run_handler, **{k: v for k, v in run.items() if k != "name"})
    assert command.startswith(handlers.SYSTEMD_RELOAD + " && ")


def test_service_dropped_from_the_spec_loses_its_dropin_and_reloads():
    want = nccl.desired(kpro6_spec(), kpro6_hardware(), rdma_devices=[])
    stale = "/etc/systemd/system/old.service.d/pvegpu-nccl.conf"
    state = state_for(want, dropins=[stale], systemd=False)
    results = commands_of(nccl.stage_operations(want, state))
    assert results[-1][:2] == ("absent_file", [f"rm -f -- {stale}"])
    (run,) = reload_runs(want, state)
    assert run["reasons"] == [f"{stale} removed"] and run["stamp"] == ""  # the removed file is no input
    # next run: nothing to remove, the empty stamp matches: no reload again
    assert reload_runs(want, state_for(want, dropins=[])) == []


def test_daemon_reload_runs_only_where_systemd_runs(tmp_path):
    """The handler's command: `systemctl daemon-reload` only with /run/systemd/system (sd_booted)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "systemctl").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/calls\n")
    (bindir / "systemctl").chmod(0o755)
    marker = tmp_path / "run-systemd-system"
    command = handlers.SYSTEMD_RELOAD.replace("/run/systemd/system", str(marker))
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}"}
    sh(command, env)
    assert not (tmp_path / "calls").exists()
    marker.mkdir()
    sh(command, env)
    assert (tmp_path / "calls").read_text() == "daemon-reload\n"


def test_hardware_facts_is_the_runs_reading_not_the_gpu_stages_memo():
    """With GPUs in the spec the stage reads the HardwareProbe like every stage (fact_once), without
    computing the GPU stage's plan (its guest configs, runtime, journal are not needed here)."""
    state = FakeState()
    fake = create_host(state, facts={"hardware.HardwareProbe": kpro6_hardware()})
    spec = kpro6_spec()
    assert spec.gpus
    with ctx_state.use(state), ctx_host.use(fake):
        assert nccl.hardware_facts(spec) == kpro6_hardware()
        assert "gpus" not in run_state(fake).memos


@pytest.mark.parametrize("status, root, noop", [
    ("stopped", "65:34", "CT 200 is stopped: pct exec needs it running, so its /etc/nccl.conf is written by a run while it runs"),
    ("running", "64:5472336", "CT 200 shares the host's root filesystem (pct exec runs on the host's /); "
                              "writing its /etc/nccl.conf would overwrite the host's, so it is skipped"),
])
def test_container_file_is_skipped_with_a_reason_when_pct_exec_cannot_reach_its_own_root(status, root, noop):
    want = nccl.desired(kpro6_spec(), kpro6_hardware(), rdma_devices=[])
    state = state_for(want, ct_status=status, ct_root=root, converged=False)
    assert run_op(nccl.container_nccl_conf, ctid=200, content=want["containers"][200], state=state,
                  facts=NO_BUILDS) == ([], noop)


def test_missing_container_and_host_without_pct_are_noops():
    found = nccl.NcclState().process(["@@ root", "64:2"])
    state = with_ct_status(found, GuestState().process(["@@ lxc", "@@ lxc-active", "@@ qemu"]))
    assert run_op(nccl.container_nccl_conf, ctid=201, content="x\n", state=state, facts=NO_BUILDS) == (
        [], "CT 201 does not exist on this node; its /etc/nccl.conf is written once it exists and runs")
    no_pct = with_ct_status(found, GuestState().process(["@@ qemu"]))
    assert (run_op(nccl.container_nccl_conf, ctid=201, content="x\n", state=no_pct,
                  facts=NO_BUILDS)[1] or "").startswith("CT 201: no pct on this host")


def test_state_fact_runs_in_a_real_shell(tmp_path):
    """On this machine (no pct, maybe no systemd): the fact's own command, parsed by its process()."""
    fact = nccl.NcclState()
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_IB_DISABLE=1\n")
    command = fact.command([str(conf), str(tmp_path / "none")], [])  # no running CT to look into
    assert "pct" not in command  # the run state comes from facts.guest_state
    state = fact.process(sh(command).splitlines())
    assert state["files"] == {str(conf): {"mode": "644", "sha256": sha256_text("NCCL_IB_DISABLE=1\n")},
                              str(tmp_path / "none"): None}
    rdma = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []
    assert state["rdma_devices"] == rdma
    assert state["systemd_running"] == os.path.isdir("/run/systemd/system")
    st = os.stat("/")
    assert state["host_root"] == f"{st.st_dev}:{st.st_ino}" and state["containers"] == {}
    assert GuestState().process(sh(GuestState.command).splitlines())["pct"] is bool(shutil.which("pct"))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root (mount namespace, chroot)")
def test_container_file_goes_through_pct_exec_into_the_containers_own_root(tmp_path):
    """Fact → op → write through `pct exec` → fact again: the CT's file lands in its root, not the
    host's, the fact reads it through the CT's init (no Proxmox CLI), and the second run is a noop."""
    node = FakeNode(tmp_path)
    try:
        ct_root = node.ct(200, "running")
        node.ct(201, "stopped")
        env = node.env
        want = nccl.desired(kpro6_spec(), kpro6_hardware(), rdma_devices=[])
        content = want["containers"][200]
        paths = [str(tmp_path / "host-nccl.conf")]
        state, commands = read_in_shell(env, nccl.nccl_state, paths, [200])
        assert node.calls() == [], "the state is read without a Proxmox CLI"
        assert state["status"] == {200: "running", 201: "stopped"} and state["pct"]
        assert state["containers"][200]["readable"] and state["containers"][200]["file"] is None
        assert state["containers"][200]["root"] != state["host_root"]

        commands, _ = run_op(nccl.container_nccl_conf, ctid=200, content=content, state=state, facts=NO_BUILDS)
        assert len(commands) == 1
        sh(commands[0], env)
        assert (ct_root / "etc" / "nccl.conf").read_text() == content
        assert oct((ct_root / "etc" / "nccl.conf").stat().st_mode & 0o777) == "0o644"

        again, _ = read_in_shell(env, nccl.nccl_state, paths, [200])
        assert run_op(nccl.container_nccl_conf, ctid=200, content=content, state=again, facts=NO_BUILDS) == (
            [], "CT 200: /etc/nccl.conf is up to date")
        # a link in the CT is not followed out of it: read as missing, so the write replaces it
        (ct_root / "etc" / "nccl.conf").unlink()
        (ct_root / "etc" / "nccl.conf").symlink_to(paths[0])
        (tmp_path / "host-nccl.conf").write_text(content)
        linked, _ = read_in_shell(env, nccl.nccl_state, paths, [200])
        assert linked["containers"][200] == {**again["containers"][200], "file": None}
        # the fact looks into every CT of the spec (its arguments come from the spec alone: it is
        # read in the first prefetch round); the stopped one has no init, and nothing of it is kept
        calls = node.calls()
        both, commands = read_in_shell(env, nccl.nccl_state, paths, [200, 201])
        assert "for id in 200 201; do" in commands[-1] and node.calls() == calls
        assert sorted(both["containers"]) == [200] and both["containers"][200] == linked["containers"][200]
    finally:
        node.stop()


def test_nccl_versions_found_on_host_and_in_containers_set_nccls_default_level():
    """The NCCL library's version decides NCCL's own default level (paths.cc: PXB from 2.23)."""
    from facts.nccl import nccl_version_of

    lines = ["@@ root", "64:2", "@@ libnccl", "libnccl /usr/lib/x86_64-linux-gnu/libnccl.so.2.26.5",
             "libnccl /usr/local/lib/python3.11/dist-packages/nvidia_nccl_cu12-2.21.5.dist-info",
             "@@ ct 200", "65:34", "MISSING", "libnccl /usr/lib/x86_64-linux-gnu/libnccl.so.2.27.7"]
    state = nccl.NcclState().process(lines)
    assert state["nccl_versions"] == ["2.21.5", "2.26.5"] and nccl.oldest(state["nccl_versions"]) == "2.21.5"
    assert state["containers"][200]["nccl_versions"] == ["2.27.7"]
    assert state["containers"][200]["readable"] is True and state["containers"][200]["file"] is None
    assert nccl_version_of("/usr/lib/x86_64-linux-gnu/libnccl.so.2") is None


def test_services_running_vllm_with_custom_allreduce_are_warned_where_p2p_stops():
    lines = ["@@ root", "64:2", "@@ unit vllm.service",
             "ExecStart=/opt/vllm/bin/vllm serve /models/m --tensor-parallel-size 2",
             "@@ unit sglang.service",
             "ExecStart=/usr/bin/python3 -m sglang.launch_server --tp 2 --disable-custom-all-reduce"]
    state = nccl.NcclState().process(lines)
    assert set(state["exec_start"]) == {"vllm.service", "sglang.service"}
    spec = kpro6_spec(services=["vllm", "sglang"])
    want = nccl.desired(spec, kpro6_hardware(), rdma_devices=[], state=state)
    assert want["service_warnings"] == [
        "vllm.service runs vLLM with its custom allreduce on: its GPU-to-GPU DMA ignores the NCCL variables; "
        "add --disable-custom-all-reduce to its ExecStart"]
    assert any(line.startswith("NCCL: WARNING: vllm.service runs vLLM") for line in nccl.describe(want))
    command = nccl.NcclState().command([nccl.dropin_path("vllm.service")], [])
    assert "systemctl cat -- vllm.service" in command


# club-3090 docs/PCIE_P2P.md, "Proxmox recipe" for x-nv-gpudirect-clique (a VM config's lines)
CLIQUE_VM_CONF = [
    "cpu: host,flags=+pcid",
    "hostpci0: 0000:81:00.0,pcie=1",
    "hostpci1: 0000:c1:00.0,pcie=1",
    "args: -set device.hostpci0.x-nv-gpudirect-clique=1 -set device.hostpci1.x-nv-gpudirect-clique=1",
    "machine: q35",
]


def test_a_vm_config_whose_args_put_its_gpus_in_one_gpudirect_clique_is_warned_in_dry():
    """Issue 43 item 7 on the host: pvegpu writes no NCCL file inside a VM, so --dry says what the
    operator must set in the guest; the VM config is read by QemuConfigs' own parser. Before: no
    line at all."""
    from facts.proxmox import parse_guest_configs

    configs = parse_guest_configs(["@@ /etc/pve/qemu-server/101.conf", *CLIQUE_VM_CONF,
                                   "@@ /etc/pve/qemu-server/102.conf", "hostpci0: 0000:41:00.0,pcie=1",
                                   "args: -set device.hostpci0.x-nv-gpudirect-clique=2"], "qemu")
    want = nccl.desired(kpro6_spec(), kpro6_hardware(), rdma_devices=[], qemu_configs=configs)
    warned = [line for line in nccl.describe(want) if "GPUDirect clique" in line]
    assert warned == [
        "NCCL: WARNING: VM 101: its args put hostpci0, hostpci1 in GPUDirect clique 1 (x-nv-gpudirect-clique): "
        "inside the VM the NVIDIA driver answers P2P OK across QEMU's virtual root ports, where NCCL used P2P "
        "and hung at its first collective; pvegpu writes no NCCL file inside a VM: set NCCL_P2P_DISABLE=1 in "
        "the guest (its /etc/nccl.conf or the services' environment), or drop the clique from args"]
    from plan.nccl import vm_clique_warnings

    device_form = {"103": {"options": {"args": "-device vfio-pci,host=0000:81:00.0,id=gpu0,x-nv-gpudirect-clique=4 "
                                                "-device vfio-pci,host=0000:c1:00.0,id=gpu1,x-nv-gpudirect-clique=4"}}}
    assert "VM 103: its args put gpu0, gpu1 in GPUDirect clique 4" in vm_clique_warnings(device_form)[0]
