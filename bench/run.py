"""pvegpu benchmarks: prints a table of figures with their targets and writes bench/results.json.

    make bench        (or: .venv/bin/python bench/run.py [--only NAME ...])

Figures (issue 9):
  converge_commands      remote commands of a no-change converge of the kpro6 twin   target <= 40
  converge_vs_fact       its wall time / a bare `pyinfra <twin> fact server.Os`       target <= 3.0
  fleet8_vs_1            no-change converge of 8 twins / of 1 twin (wall time)         target <= 1.5
  fleet8_vs_1_many_cores the same where every twin and pyinfra have a core of their own target <= 1.5
                         (measured on a machine with >= 10 cores: bench/device_bundle.py and
                         bench/device_fleet.sh take the bench there; --import-many-cores FILE
                         keeps that machine's figure here)
  ccache_warm_vs_cold    NVIDIA open tree (open-gpu-kernel-modules 595.45.04) module    target <= 0.1
                         rebuild with warm ccache + conftest cache / cold build
  second_release_vs_first  the same tree for a second kernel release in the same run      target <= 0.5
                         (src/ objects reused, kernel-open/ alone) / the first (cold)
  kernel_second_ref_vs_first  the kernel stage's build of a second ref (another build dir) with  (reported)
                         the ccache the first left / the first, cold (bench/kernel_ccache.py)
  facts_commands         remote commands for the full hardware picture                 target <= 3
  pve_calls_nochange     Proxmox CLI calls (pct, qm, pvesh, pveversion) of a no-change  target <= 0
                         converge
  pve_calls_move         the same for a two-GPU move from VM 300 to CT 200 (reported)
  cluster3_vs_1          no-change converge of a 3-node cluster twin (one /etc/pve, the  target <= 1.5
                         kpro6 spec on each node) / of one of its nodes (wall time; with the
                         CPU floor of this machine's cores, as fleet8_vs_1)
  cluster3_vs_1_many_cores  the same where the three twins and pyinfra have a core each   target <= 1.5
                         (>= 4 cores; taken with fleet8_vs_1_many_cores: BENCHES="fleet cluster"
                         bench/device_fleet.sh)
  pve_delay_converge_s   no-change converge wall time with the twin's Proxmox CLIs taking
                         PVE_DELAY_S to start, like the real Perl ones (reported, with the
                         time without the delay)
  pve_delay_vs_fact      issue 26 part 5: the kpro6 twin's no-change converge with CT 200   target <= 1.3
                         running and its Proxmox CLIs taking PVE_DELAY_S to start / a bare
                         `pyinfra <twin> fact server.Os` against the same twin (medians of 9,
                         alternating; taken by the converge bench, with the CLIs it started)
  pve_delay_vs_fact_many_cores  the same on a machine with >= 4 cores, where the twin's side of  target <= 1.3
                         each command runs beside pyinfra instead of taking turns with it on
                         the same cores (a real node does its side on its own CPU):
                         BENCHES=converge bench/device_fleet.sh, then --import-many-cores
  power_cut              issue 38 §3: hosts left unbootable or without GPUs after a power   target <= 0
                         cut at each step of a kernel install + trial, an apt full-upgrade
                         (kernel + systemd-boot-efi in one transaction) and a driver upgrade,
                         then the next converge (bench/power_cut.py; of N cut points)
  build_share_total_vs_one  issue 41: NVIDIA module build seconds of all nodes of a 3-node     target <= 1.2
                         cluster twin converged in one run / one node's build (bench/build_share.py;
                         every node built before: ~3)
  build_share_wall_vs_single  issue 41: that 3-node converge's wall / one node's converge      target <= 1.2
                         alone (one more kpro6 twin, in no cluster, the same spec and seeded caches as
                         the cluster's builder, converged right after by the same script)
  kernel_share_total_vs_one  issue 41: the same for the kernel stage's tinyconfig build      target <= 1.2
                         (bench/build_share_kernel.py)
  kernel_share_wall_vs_single  issue 41: its 3-node converge's wall / one node's alone       target <= 1.2
Each figure is measured, never assumed; one that could not be measured is printed as such.
--only NAME measures those benches and keeps the other figures of bench/results.json (each
figure carries its measured_at). fleet8_vs_1 also records the CPU seconds of the runner and of
the twins and the floor they put on the ratio on this machine's cores (bench/fleet_profile.py
breaks them down further): on a machine with fewer cores than twins + 1 the twins' share of every
command (which each host does on its own CPU in a real fleet) competes with pyinfra for them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e.harness import PYINFRA, PyinfraRun, parse_totals, run_pyinfra  # noqa: E402
from tests.twin import runtime  # noqa: E402

TARGETS = {
    "converge_commands": ("<=", 40),
    "converge_vs_fact": ("<=", 3.0),
    "fleet8_vs_1": ("<=", 1.5),
    "fleet8_vs_1_many_cores": ("<=", 1.5),
    "cluster3_vs_1": ("<=", 1.5),
    "cluster3_vs_1_many_cores": ("<=", 1.5),
    "ccache_warm_vs_cold": ("<=", 0.1),
    "second_release_vs_first": ("<=", 0.5),
    "facts_commands": ("<=", 3),
    "pve_calls_nochange": ("<=", 0),
    "pve_delay_vs_fact": ("<=", 1.3),
    "pve_delay_vs_fact_many_cores": ("<=", 1.3),
    "power_cut": ("<=", 0),
    "build_share_total_vs_one": ("<=", 1.2),
    "kernel_share_total_vs_one": ("<=", 1.2),
    "build_share_wall_vs_single": ("<=", 1.2),
    "kernel_share_wall_vs_single": ("<=", 1.2),
}
PVE_DELAY_S = 0.4  # a real node's pct/qm/pvesh start: 0.3-0.6 s (issue 19)
PVE_DELAY_RUNS = 9  # pve_delay_vs_fact: converge/fact pairs, alternating; the medians make the figure


def _converge(names: list[str], inventory: str | None = None, debug: bool = True) -> tuple[float, int, PyinfraRun]:
    """A converge of twins `names` (inventories/twin.py), or of `inventory` when given. With
    debug=False it runs as a user runs it, without --debug (whose logging of every command and
    operation costs time; the remote command count then reads 0)."""
    env = {"PVEGPU_TWINS": ",".join(names), "PYTHONPATH": str(REPO)}
    inventory = inventory or "inventories/twin.py"
    t0 = time.monotonic()
    if debug:
        run = run_pyinfra(inventory, "deploy.py", env=env)
    else:
        proc = subprocess.run([PYINFRA, "-y", inventory, "deploy.py"], cwd=REPO, capture_output=True, text=True,
                              env={**os.environ, **env, "COLUMNS": "200"}, timeout=600)
        out = proc.stdout + proc.stderr
        run = PyinfraRun(proc.returncode, out, parse_totals(out), 0)
    return time.monotonic() - t0, run.remote_commands, run


def _bare_fact(twin: runtime.Twin) -> float:
    """Wall time of a bare `pyinfra <twin address> fact server.Os` (connection data on the command
    line, no inventory file, no pvegpu code): pyinfra's own fixed cost for one host."""
    t0 = time.monotonic()
    subprocess.run(
        [PYINFRA, "-y", "--data", f"ssh_port={twin.port}", "--data", f"ssh_key={twin.key}",
         "--data", "ssh_user=root", "--data", "ssh_known_hosts_file=/dev/null",
         "--data", "ssh_strict_host_key_checking=no", twin.address, "fact", "server.Os"],
        cwd=REPO, capture_output=True, check=True, timeout=300,
    )
    return time.monotonic() - t0


def _bytecode() -> None:
    """Byte-compile the repo's packages as pip does when it installs one: a session with
    PYTHONDONTWRITEBYTECODE=1 would otherwise make every pyinfra run compile pvegpu's ~65
    modules from source (~0.15 s here) while pyinfra's own come compiled from site-packages."""
    import compileall

    for package in ("spec", "facts", "operations", "plan", "compat", "group_data"):
        compileall.compile_dir(str(REPO / package), quiet=1)


def _median(walls: list[float]) -> float:
    return sorted(walls)[len(walls) // 2]


def bench_converge(results: dict) -> None:
    """converge_commands, converge_vs_fact; then pve_delay_vs_fact, issue 26 part 5's figure: on the
    same twin with CT 200 running (as on a serving host) and its Proxmox CLIs taking PVE_DELAY_S
    to start, the no-change converge of the kpro6 spec against a bare fact, alternating:
    the medians' ratio (PVE_DELAY_RUNS pairs), and every Proxmox CLI the converges started (the
    target needs none), with pyinfra's CPU seconds for each and the load of the machine."""
    names = []
    _bytecode()
    try:
        twin = runtime.start("bench-kpro6", "kpro6")
        names.append(twin.name)
        env = {"PVEGPU_TWINS": twin.name}
        first = run_pyinfra("inventories/twin.py", "deploy.py", env=env)  # converge (may reboot)
        if first.rc != 0:
            raise RuntimeError("converge failed:\n" + first.output[-3000:])
        wall, commands, run = _converge([twin.name])
        fact_wall = _bare_fact(twin)
        results["converge_commands"] = {"value": commands, "changed_ops": run.changed, "wall_s": round(wall, 2)}
        results["converge_vs_fact"] = {"value": round(wall / fact_wall, 2), "converge_s": round(wall, 2),
                                       "fact_s": round(fact_wall, 2)}

        subprocess.run(runtime.ssh_command(twin.name, ["pct start 200"]), check=True, capture_output=True, timeout=120)
        started = run_pyinfra("inventories/twin.py", "deploy.py", env=env)  # its NCCL file in CT 200
        if started.rc != 0:
            raise RuntimeError("converge with CT 200 running failed:\n" + started.output[-3000:])
        runtime.set_pve_delay(twin.root, PVE_DELAY_S)
        runtime.count_pve_calls(twin.root, True)
        from bench.fleet_profile import loadavg

        def runner_cpu() -> float:  # CPU seconds of the finished pyinfra processes (this bench's children)
            ru = resource.getrusage(resource.RUSAGE_CHILDREN)
            return ru.ru_utime + ru.ru_stime

        converges, facts, changed = [], [], 0
        cpu: dict[str, list[float]] = {"converge": [], "fact": []}
        load = [loadavg()]
        for _ in range(PVE_DELAY_RUNS):
            c0 = runner_cpu()
            wall, _commands, run = _converge([twin.name], debug=False)  # as a user runs it, as the fact
            if run.rc != 0:
                raise RuntimeError("converge failed:\n" + run.output[-3000:])
            c1 = runner_cpu()
            converges.append(wall)
            changed += run.changed
            facts.append(_bare_fact(twin))
            cpu["converge"].append(c1 - c0)
            cpu["fact"].append(runner_cpu() - c1)
        load.append(loadavg())
        calls = runtime.count_pve_calls(twin.root, False)
        runtime.set_pve_delay(twin.root, None)
        converge_s, fact_s = _median(converges), _median(facts)
        results["pve_delay_vs_fact"] = {
            "value": round(converge_s / fact_s, 2), "converge_s": round(converge_s, 2), "fact_s": round(fact_s, 2),
            "delay_s": PVE_DELAY_S, "pve_calls": calls, "changed_ops": changed, "ct_running": [200],
            "walls_s": {"converge": [round(w, 2) for w in converges], "fact": [round(w, 2) for w in facts]},
            # pyinfra's own CPU seconds (medians), which the machine's load does not stretch
            "runner_cpu_s": {k: round(_median(v), 2) for k, v in cpu.items()},
            "loadavg": load, "machine": _machine()}
        if (os.cpu_count() or 1) >= CONVERGE_MANY_CORES:
            results["pve_delay_vs_fact_many_cores"] = dict(results["pve_delay_vs_fact"])
    finally:
        for n in names:
            runtime.stop(n)


def _cpu_converge(names: list[str], inventory: str | None = None) -> dict:
    """No-change converge of `names` with its CPU: runner (the pyinfra process, from
    RUSAGE_CHILDREN) and twins (each twin's sshd tree, bench/fleet_profile.py's twin_cpu)."""
    from bench.fleet_profile import loadavg, settle, twin_cpu

    twins0 = sum(twin_cpu(n)["sshd"] for n in names)
    load0 = loadavg()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, commands, run = _converge(names, inventory)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    settle(names)
    if run.rc != 0:
        raise RuntimeError("converge failed:\n" + run.output[-3000:])
    return {"wall_s": wall, "commands": commands, "changed": run.changed, "loadavg": [load0, loadavg()],
            "runner_cpu_s": (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
            "twin_cpu_s": sum(twin_cpu(n)["sshd"] for n in names) - twins0}


MANY_CORES = 10  # 8 twins + the runner + one to spare
# figures only a machine with a core per twin takes (bench/device_fleet.sh); kept by runs elsewhere
MANY_CORE_FIGURES = ("fleet8_vs_1_many_cores", "cluster3_vs_1_many_cores", "pve_delay_vs_fact_many_cores")
CONVERGE_MANY_CORES = 4  # the twin's sshd and shell, the probe's concurrent sections, pyinfra
RESULTS = REPO / "bench" / "results.json"


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    return f"{os.cpu_count()} cores, {model}, Python {sys.version.split()[0]}"


def bench_fleet(results: dict) -> None:
    names = [f"bench-fleet-{i}" for i in range(1, 9)]
    started = []
    try:
        for n in names:
            runtime.start(n, "kpro6")
            started.append(n)
        first = run_pyinfra("inventories/twin.py", "deploy.py", env={"PVEGPU_TWINS": ",".join(names)})
        if first.rc != 0:
            raise RuntimeError("fleet converge failed:\n" + first.output[-3000:])
        # 1 and 8 alternate, 3 times each: the medians (by wall time) are the figures, so one
        # run stretched by other work on the machine does not make the ratio
        ones, eights = [], []
        for _ in range(3):
            ones.append(_cpu_converge(names[:1]))
            eights.append(_cpu_converge(names))
        one = sorted(ones, key=lambda r: r["wall_s"])[1]
        eight = sorted(eights, key=lambda r: r["wall_s"])[1]
        # Everything the 8-twin run needs runs on this machine's cores: its wall time cannot be
        # below its CPU seconds / cores (the twins' side of every command would run on each
        # host's own CPU in a real fleet), nor below the runner's CPU seconds (one process).
        cores = os.cpu_count() or 1
        floor = max((eight["runner_cpu_s"] + eight["twin_cpu_s"]) / cores, eight["runner_cpu_s"])
        results["fleet8_vs_1"] = {
            "value": round(eight["wall_s"] / one["wall_s"], 2), "one_s": round(one["wall_s"], 2),
            "eight_s": round(eight["wall_s"], 2), "changed_ops": eight["changed"],
            "cpu_s": {"one": {"runner": round(one["runner_cpu_s"], 2), "twins": round(one["twin_cpu_s"], 2)},
                      "eight": {"runner": round(eight["runner_cpu_s"], 2), "twins": round(eight["twin_cpu_s"], 2)}},
            "cores": cores, "floor_eight_s": round(floor, 2), "floor_ratio": round(floor / one["wall_s"], 2),
            "cpu_ratio": round(floor / (one["runner_cpu_s"] + one["twin_cpu_s"]), 2),
            "loadavg": {"one": one["loadavg"], "eight": eight["loadavg"]},
            "walls_s": {"one": [round(r["wall_s"], 2) for r in ones], "eight": [round(r["wall_s"], 2) for r in eights]},
            "machine": _machine(),
        }
        if cores >= MANY_CORES:  # every twin and the runner have a core of their own
            results["fleet8_vs_1_many_cores"] = dict(results["fleet8_vs_1"])
    finally:
        for n in started:
            runtime.stop(n)


CLUSTER_INVENTORY = """\
import json
from pathlib import Path
from spec.load import inventory_hosts
specs = dict(inventory_hosts(Path(__file__).with_suffix(".yml")))
gpu_hosts = []
for name in {names!r}:
    twin = json.loads((Path({twins!r}) / name / "twin.json").read_text())
    gpu_hosts.append((name, dict(specs[name], ssh_hostname=twin["address"], ssh_port=twin["port"],
                                 ssh_user="root", ssh_key=twin["key"], ssh_known_hosts_file="/dev/null",
                                 ssh_strict_host_key_checking="no", pvegpu_node=name)))
"""


def bench_cluster(results: dict) -> None:
    """cluster3_vs_1: three kpro6 twins of one cluster (tests/twin/runtime.py "Clusters"), each
    with inventories/twin.yml's kpro6 spec under its own node name (the profile's CT 200 and VM
    300 live on the first node), converged once, then no-change converges of all three and of
    the first alone, alternating, 3 each: the medians' ratio."""
    import tempfile

    import yaml

    names = [f"bench-cl-{i}" for i in range(1, 4)]
    base = yaml.safe_load((REPO / "inventories" / "twin.yml").read_text())["hosts"]["kpro6"]
    tmp = Path(tempfile.mkdtemp(prefix="pvegpu-bench-cluster-"))
    inventories = {}
    for count in (1, 3):
        inv = tmp / f"cluster{count}.py"
        inv.with_suffix(".yml").write_text(yaml.safe_dump({"hosts": {n: dict(base, node=n) for n in names[:count]}}))
        inv.write_text(CLUSTER_INVENTORY.format(names=names[:count], twins=str(runtime.TWINS_DIR)))
        inventories[count] = str(inv)
    started = []
    try:
        for n in names:
            runtime.start(n, "kpro6", cluster="bench-cl")
            started.append(n)
        first = run_pyinfra(inventories[3], "deploy.py", env={"PYTHONPATH": str(REPO)})
        if first.rc != 0:
            raise RuntimeError("cluster converge failed:\n" + first.output[-3000:])
        ones, threes = [], []
        for _ in range(3):
            ones.append(_cpu_converge(names[:1], inventories[1]))
            threes.append(_cpu_converge(names, inventories[3]))
        one = sorted(ones, key=lambda r: r["wall_s"])[1]
        three = sorted(threes, key=lambda r: r["wall_s"])[1]
        cores = os.cpu_count() or 1
        floor = max((three["runner_cpu_s"] + three["twin_cpu_s"]) / cores, three["runner_cpu_s"])
        results["cluster3_vs_1"] = {
            "value": round(three["wall_s"] / one["wall_s"], 2), "one_s": round(one["wall_s"], 2),
            "three_s": round(three["wall_s"], 2), "changed_ops": three["changed"], "commands": three["commands"],
            "cpu_s": {"one": {"runner": round(one["runner_cpu_s"], 2), "twins": round(one["twin_cpu_s"], 2)},
                      "three": {"runner": round(three["runner_cpu_s"], 2), "twins": round(three["twin_cpu_s"], 2)}},
            "cores": cores, "floor_three_s": round(floor, 2), "floor_ratio": round(floor / one["wall_s"], 2),
            "walls_s": {"one": [round(r["wall_s"], 2) for r in ones], "three": [round(r["wall_s"], 2) for r in threes]},
            "machine": _machine(),
        }
        if cores >= 4:  # the three twins and the runner have a core of their own
            results["cluster3_vs_1_many_cores"] = dict(results["cluster3_vs_1"])
    finally:
        for n in reversed(started):
            runtime.stop(n)


def bench_script(results: dict, key: str, script: str, timeout: int = 1800) -> None:
    path = REPO / "bench" / script
    if not path.exists():
        results[key] = {"value": None, "note": f"bench/{script} not present"}
        return
    proc = subprocess.run([sys.executable, str(path), "--json"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    try:
        results[key] = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception:
        results[key] = {"value": None, "note": (proc.stdout + proc.stderr)[-500:]}


def bench_share(results: dict, key: str, wall_key: str, script: str, timeout: int = 1800) -> None:
    """Issue 41's two figures from one run of a build-share bench: its build seconds figure under
    `key`, its 3-node converge wall / the single node's converge wall under `wall_key`."""
    bench_script(results, key, script, timeout=timeout)
    got = results[key]
    if got.get("wall_vs_single") is not None:
        results[wall_key] = {"value": got["wall_vs_single"], "converge_s": got["converge_s"],
                             "single_converge_s": got["single_converge_s"], "load_1min": got.get("load_1min")}


def bench_pve_calls(results: dict) -> None:
    """Proxmox CLI calls of a no-change converge and of a two-GPU move on a kpro6 twin (the
    stand-ins log each call: tests/twin/runtime.count_pve_calls), then the no-change converge's
    wall time with every Proxmox CLI taking PVE_DELAY_S to start (runtime.set_pve_delay)."""
    import tempfile

    from tests.e2e.test_rebind_e2e import BDFS, Run

    twin = runtime.start("bench-pve", "kpro6")
    try:
        run = Run(twin, Path(tempfile.mkdtemp(prefix="pvegpu-bench-pve-")))

        def deploy(ct, vm):
            t0 = time.monotonic()
            rc, out, _ = run.deploy(ct, vm)
            if rc != 0:
                raise RuntimeError("converge failed:\n" + out[-3000:])
            return time.monotonic() - t0

        deploy(BDFS[:4], BDFS[4:])  # converge first
        runtime.count_pve_calls(run.root, True)
        wall = deploy(BDFS[:4], BDFS[4:])
        calls = runtime.count_pve_calls(run.root, True)
        results["pve_calls_nochange"] = {"value": len(calls), "calls": calls, "wall_s": round(wall, 2)}
        deploy(BDFS[:6], BDFS[6:])  # two GPUs from VM 300 to CT 200 (the twin reboots for it)
        move = runtime.count_pve_calls(run.root, True)
        results["pve_calls_move"] = {"value": len(move), "calls": move}
        runtime.set_pve_delay(run.root, PVE_DELAY_S)
        delayed = deploy(BDFS[:6], BDFS[6:])
        calls = runtime.count_pve_calls(run.root, False)
        runtime.set_pve_delay(run.root, None)
        results["pve_delay_converge_s"] = {"value": round(delayed, 2), "delay_s": PVE_DELAY_S,
                                           "calls": len(calls), "without_delay_s": round(wall, 2)}
    finally:
        runtime.stop(twin.name)


def bench_driver(results: dict) -> None:
    """bench/driver_ccache.py: warm/cold and, from the same run, second release / first."""
    bench_script(results, "ccache_warm_vs_cold", "driver_ccache.py")
    driver = results["ccache_warm_vs_cold"]
    if driver.get("second_vs_first") is not None:
        results["second_release_vs_first"] = {
            "value": driver["second_vs_first"], "second_release_s": driver["second_release_s"],
            "first_s": driver["cold_s"], "source": driver.get("source"), "releases": driver.get("releases")}


BENCHES = {
    "converge": bench_converge,
    "fleet": bench_fleet,
    "cluster": bench_cluster,
    "facts": lambda r: bench_script(r, "facts_commands", "facts_commands.py"),
    "ccache": lambda r: bench_driver(r),
    "kernel": lambda r: bench_script(r, "kernel_second_ref_vs_first", "kernel_ccache.py"),
    "pve": bench_pve_calls,
    # every cut point of every case: hours on a 2-core machine (bench/power_cut.py --case/--points for less)
    "powercut": lambda r: bench_script(r, "power_cut", "power_cut.py", timeout=6 * 3600),
    "share": lambda r: bench_share(r, "build_share_total_vs_one", "build_share_wall_vs_single", "build_share.py"),
    "share-kernel": lambda r: bench_share(r, "kernel_share_total_vs_one", "kernel_share_wall_vs_single",
                                          "build_share_kernel.py", timeout=5400),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", choices=sorted(BENCHES))
    ap.add_argument("--import-many-cores", metavar="RESULTS_JSON",
                    help="take the *_many_cores figures from another machine's bench/results.json "
                         "(bench/device_fleet.sh) and measure nothing")
    args = ap.parse_args()
    results: dict = {}
    path = RESULTS
    try:
        old = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        old = {}
    if args.import_many_cores:
        others = json.loads(Path(args.import_many_cores).read_text())["results"]
        for key in MANY_CORE_FIGURES:
            if key in others:
                old.setdefault("results", {})[key] = others[key]
                print(f"{key} {others[key]['value']} ({others[key].get('machine')}, {others[key]['measured_at']})")
        path.write_text(json.dumps(old, indent=2) + "\n")
        return 0
    for name in args.only or BENCHES:
        try:
            BENCHES[name](results)
        except Exception as e:  # report, keep measuring the rest
            results[f"{name}_error"] = {"value": None, "note": str(e)[-800:]}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for val in results.values():
        val["measured_at"] = now
    previous = {}
    if args.only:  # a partial run keeps the other figures it did not measure
        previous = old.get("results", {})
        for val in previous.values():  # files written before figures carried their own time
            if isinstance(val, dict):
                val.setdefault("measured_at", old.get("measured_at"))
        for name in args.only:  # an error of a bench measured now replaces its old figure
            previous.pop(f"{name}_error", None)
    else:  # only another machine takes these
        previous = {k: v for k, v in old.get("results", {}).items() if k in MANY_CORE_FIGURES}
    merged = {**previous, **results}
    print(f"{'figure':24} {'value':>10}  {'target':>8}  ok")
    for key, (op, target) in TARGETS.items():
        value = merged.get(key, {}).get("value")
        ok = "-" if value is None else ("yes" if value <= target else "NO")
        when = "" if key in results or key not in merged else f"  (not measured now: {merged[key].get('measured_at', 'earlier')})"
        print(f"{key:24} {str(value):>10}  {op}{target:>6}  {ok}{when}")
    kernel = results.get("kernel_second_ref_vs_first") or {}
    if kernel.get("value") is not None:
        warm = kernel["runs"]["warm"]["ccache"]
        print(f"{'kernel_second_ref_vs_first':24} {kernel['value']:>10} (warm {kernel['warm_s']} s / cold "
              f"{kernel['cold_s']} s; second ref's ccache: {warm})")
    for key in ("pve_calls_move", "pve_delay_converge_s"):
        if key in results:
            val = results[key]
            extra = (f" (pct/qm/pvesh taking {val['delay_s']} s to start, {val['calls']} calls; "
                     f"{val['without_delay_s']} s without)" if "delay_s" in val else " Proxmox CLI calls")
            print(f"{key:24} {str(val['value']):>10}{extra}")
    delay = results.get("pve_delay_vs_fact") or {}
    if delay:
        print(f"pve_delay_vs_fact: no-change converge {delay['converge_s']} s (CT 200 running, Proxmox CLIs taking "
              f"{delay['delay_s']} s to start, {len(delay['pve_calls'])} started) / bare fact {delay['fact_s']} s; "
              f"walls {delay['walls_s']}; pyinfra CPU {delay.get('runner_cpu_s')}")
    for key in ("build_share_wall_vs_single", "kernel_share_wall_vs_single"):
        if key in results:
            val = results[key]
            print(f"{key}: 3-node converge {val['converge_s']} s / one node's converge alone "
                  f"{val['single_converge_s']} s (1-min load at the two starts {val['load_1min']})")
    for key, val in results.items():
        if key.endswith("_error"):
            print(f"{key}: {val['note']}")
    fleet = results.get("fleet8_vs_1") or {}
    if "floor_ratio" in fleet:
        cpu = fleet["cpu_s"]
        print(f"fleet8_vs_1: the 8-twin run needs {cpu['eight']['runner']} CPU-s of pyinfra (one process) and "
              f"{cpu['eight']['twins']} CPU-s inside the twins on {fleet['cores']} cores, so it takes at least "
              f"{fleet['floor_eight_s']} s here: {fleet['floor_ratio']}x the 1-twin run "
              f"({fleet['one_s']} s; runner {cpu['one']['runner']}, twin {cpu['one']['twins']} CPU-s); "
              f"{fleet['cpu_ratio']}x its CPU seconds")
    if fleet and (fleet.get("cores") or 0) < MANY_CORES:
        print(f"fleet8_vs_1_many_cores: measured only where the 8 twins and pyinfra have a core each "
              f"(>= {MANY_CORES}; bench/device_bundle.py carries the bench to such a machine)")
    doc = {"measured_at": now, "targets": TARGETS, "results": merged}
    if "machine" in old:
        doc["machine"] = old["machine"]
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
