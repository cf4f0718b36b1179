"""Where the CPU of a no-change converge goes, 1 twin vs 8 twins (issue 9, fleet figure).

    .venv/bin/python bench/fleet_profile.py [--twins 8] [--keep] [--json]

Starts twins fleetprof-1..N (kpro6), converges them once, then measures two no-change
converges, of fleetprof-1 alone and of all N in one pyinfra run, and prints CPU seconds
(user+sys) per part:

  runner   the pyinfra process, from os.wait4; split by a SIGPROF sampler (every 2 ms of its
           CPU) into what the innermost non-stdlib frame belongs to: imports, pyinfra core,
           pyinfra CLI output, paramiko/crypto, gevent, jinja2, pydantic, pvegpu facts/plan/
           spec/operations/inventory, deploy.py. Sample counts are scaled to the wait4 total.
  twins    each twin's process tree under its supervisor: the sshd tree (utime+stime of the
           listener plus cutime+cstime: every session, shell and program it ran and reaped)
           and the stand-in server (its own time plus the workers it reaped: the stand-ins'
           Python), and the supervisor's own loop, from /proc/<pid>/stat before and after.
  commands the remote commands of the 1-twin run (from --debug), each run again inside
           fleetprof-1 (nsenter into its sshd's namespaces and root, `bash -c CMD` as sshd
           does), CPU from wait4 (best of 3) plus the stand-in server's CPU for the runs
           (their mean), with the programs it executes (strace, when
           present); and the CPU of each stand-in program and of a bare python3 start.

Then the bound: the 8-twin run needs R8 (runner) + T8 (twins) CPU seconds, all on this
machine's cores, so its wall time is at least (R8 + T8) / cores; divided by the 1-twin wall
time that is the best ratio this machine can show (printed as `floor_ratio`; `serial_floor_ratio`
counts the runner's imports, which come first with nothing beside them, on one core); divided by the
1-twin run's CPU seconds instead (as if it never waited) it is `cpu_ratio`, what the ratio
tends to where both runs are CPU-bound. Wall times come with /proc/loadavg before and after:
other work on the machine stretches wall times (and, less, CPU seconds through shared caches).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PYTHON = str(Path(sys.executable))
PYINFRA_ARGS = ["-y", "--debug", "inventories/twin.py", "deploy.py"]
TICK = os.sysconf("SC_CLK_TCK")
SAMPLE_S = 0.002

# innermost non-stdlib frame -> part of the runner (first match wins)
RUNNER_PARTS = [
    ("paramiko/crypto", re.compile(r"/site-packages/(paramiko|cryptography|nacl|bcrypt)/")),
    ("gevent", re.compile(r"/site-packages/(gevent|greenlet)/")),
    ("jinja2", re.compile(r"/site-packages/(jinja2|markupsafe)/")),
    ("pydantic", re.compile(r"/site-packages/(pydantic|pydantic_core)/")),
    ("yaml", re.compile(r"/site-packages/yaml/")),
    ("pyinfra CLI/output", re.compile(r"/site-packages/(pyinfra_cli|click)/")),
    ("pyinfra core", re.compile(r"/site-packages/pyinfra/")),
    ("other site-packages", re.compile(r"/site-packages/")),
    ("pvegpu facts", re.compile("^" + re.escape(str(REPO)) + r"/facts/")),
    ("pvegpu plan", re.compile("^" + re.escape(str(REPO)) + r"/plan/")),
    ("pvegpu spec", re.compile("^" + re.escape(str(REPO)) + r"/spec/")),
    ("pvegpu operations", re.compile("^" + re.escape(str(REPO)) + r"/operations/")),
    ("pvegpu inventory", re.compile("^" + re.escape(str(REPO)) + r"/inventories/")),
    ("deploy.py", re.compile(r"(^|/)deploy\.py$")),
]


# ---------------------------------------------------------------------------------------------
# Runner side: pyinfra under a SIGPROF sampler (this file re-run as `_sample OUT -- ARGS`)


def _sample_pyinfra(out: str, args: list[str]) -> None:
    """Run the pyinfra CLI in this process; at exit write {"parts": {part: samples},
    "hosts": {host: samples}} to `out`."""
    import atexit
    import signal

    parts: collections.Counter = collections.Counter()
    where: collections.Counter = collections.Counter()  # innermost non-stdlib function
    hosts: collections.Counter = collections.Counter()
    cache: dict = {}

    def part_of(frame) -> tuple[str, Any]:  # (part, the frame it was found in)
        f = frame
        while f is not None:
            name = f.f_code.co_filename
            if name.startswith("<frozen importlib"):
                return "imports", None
            f = f.f_back
        f = frame
        while f is not None:
            name = f.f_code.co_filename
            part = cache.get(name)
            if part is None:
                part = next((p for p, rx in RUNNER_PARTS if rx.search(name)), "")
                cache[name] = part
            if part:
                return part, f
            f = f.f_back
        return "python stdlib", frame

    def on_sample(_sig, frame):
        part, f = part_of(frame)
        parts[part] += 1
        if part != "imports":
            code = f.f_code
            where[f"{code.co_filename.rsplit('/site-packages/', 1)[-1]}:{code.co_name}"] += 1
        # never import from a signal handler (it may interrupt an import); read what is there
        ctx_host = getattr(sys.modules.get("pyinfra.context"), "ctx_host", None)
        try:
            h = ctx_host.get() if ctx_host is not None else None
        except Exception:
            h = None
        hosts[getattr(h, "name", None) or "(no host context)"] += 1

    def dump():
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        Path(out).write_text(json.dumps({"parts": parts, "where": where.most_common(40), "hosts": hosts, "interval_s": SAMPLE_S}))

    atexit.register(dump)
    signal.signal(signal.SIGPROF, on_sample)
    signal.setitimer(signal.ITIMER_PROF, SAMPLE_S, SAMPLE_S)
    sys.argv = [str(Path(PYTHON).with_name("pyinfra")), *args]
    from pyinfra_cli.main import main

    try:
        main()
    finally:
        dump()


def run_sampled(names: list[str], out_dir: Path) -> dict:
    """One no-change converge of `names`: wall, runner CPU by part, remote commands."""
    prof = out_dir / f"runner-{len(names)}.json"
    env = {**os.environ, "PVEGPU_TWINS": ",".join(names), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    t0 = time.monotonic()
    proc = subprocess.Popen([PYTHON, __file__, "_sample", str(prof), "--", *PYINFRA_ARGS], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"pyinfra failed:\n{output[-3000:]}")
    cpu = usage.ru_utime + usage.ru_stime
    samples = json.loads(prof.read_text())
    total = sum(samples["parts"].values()) or 1
    parts = {k: round(cpu * v / total, 3) for k, v in sorted(samples["parts"].items(), key=lambda kv: -kv[1])}
    hosts = {k: round(cpu * v / total, 3) for k, v in sorted(samples["hosts"].items())}
    commands = [m.group(1) for m in re.finditer(r"Running command on [^:]+: \(pty=\w+\) (.*)", output)]
    totals = re.search(r"Grand total\s+(\d+)\s+(\S+)\s+(\S+)\s+(\S+)", re.sub(r"\x1b\[[0-9;]*m", "", output))
    return {"hosts": len(names), "wall_s": round(wall, 3), "runner_cpu_s": round(cpu, 3),
            "runner_parts": parts, "runner_by_host_context": hosts,
            "runner_functions": [(k, round(cpu * v / total, 3)) for k, v in samples["where"]], "samples": total,
            "commands": commands, "changed": totals.group(2) if totals else "?"}


# ---------------------------------------------------------------------------------------------
# Twin side


def _stat(pid: int) -> list[int]:
    """utime, stime, cutime, cstime (ticks) of `pid`."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return [int(x) for x in fields[11:15]]


def _tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(c) for t in Path(f"/proc/{p}/task").iterdir()
                     for c in (t / "children").read_text().split()]
        except OSError:
            pass
    return out


def _supervisor(name: str) -> int:
    """Pid of twin `name`'s supervisor (its twin.json)."""
    return int(json.loads((REPO / ".twin" / name / "twin.json").read_text())["pid"])


def _supervisor_child(name: str, file: str, needle: bytes) -> int | None:
    """The first child of twin `name`'s supervisor whose /proc/<pid>/<file> holds `needle`."""
    sup = _supervisor(name)
    for child in Path(f"/proc/{sup}/task/{sup}/children").read_text().split():
        try:
            if needle in Path(f"/proc/{child}/{file}").read_bytes():
                return int(child)
        except OSError:  # exited meanwhile
            pass
    return None


def twin_cpu(name: str) -> dict:
    """{"sshd": CPU-s the twin's processes used so far, "supervisor": its supervisor's own loop}.

    Each live process of the twin counts its own time plus that of the children it reaped
    (cutime/cstime); a child still alive (a session sshd that has not exited yet) counts
    itself, so every process is counted once, whenever it is read."""
    sup = _supervisor(name)
    u, s, cu, cs = _stat(sup)
    tree = cu + cs
    for pid in _tree(sup)[1:]:
        try:
            tree += sum(_stat(pid))
        except OSError:  # exited between the listing and the read: its parent's cutime has it
            pass
    return {"sshd": tree / TICK, "supervisor": (u + s) / TICK}


def settle(names: list[str], timeout: float = 3.0) -> None:
    """Wait until each twin is back to its supervisor and sshd listener (the sessions of the
    run that just ended have exited), so a CPU reading taken next is complete."""
    deadline = time.monotonic() + timeout
    for name in names:
        sup = _supervisor(name)
        idle = 3 if _standin_server(name) else 2  # supervisor, sshd listener, stand-in server
        while len(_tree(sup)) > idle and time.monotonic() < deadline:
            time.sleep(0.05)


def _sshd_pid(name: str) -> int:
    pid = _supervisor_child(name, "comm", b"sshd\n")
    if pid is None:
        raise RuntimeError(f"twin {name}: no sshd")
    return pid


def in_twin(name: str, argv: list[str], strace_to: str | None = None) -> tuple[float, bytes]:
    """Run argv in the twin (its sshd's mount/pid/uts namespaces and root), as root with the
    PATH sshd gives; (CPU-s of the command and its children, stdout)."""
    sshd = _sshd_pid(name)
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
           "USER": "root", "LOGNAME": "root", "SHELL": "/bin/bash", "LANG": "C.UTF-8"}
    cmd = ["nsenter", "-t", str(sshd), "-m", "-p", "-u", "-r", "-w", "--", *argv]
    if strace_to:
        cmd = ["strace", "-f", "-qq", "-e", "trace=execve", "-e", "signal=none", "-o", strace_to, *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None  # stdout=PIPE
    out = proc.stdout.read()
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_utime + usage.ru_stime, out


def _standin_server(name: str) -> int | None:
    """Pid of twin `name`'s stand-in server (tests/twin/standins/standind.py), if it runs."""
    return _supervisor_child(name, "cmdline", b"standind.py")


def _server_ticks(server: int | None) -> int:
    """CPU ticks of the stand-in server and the workers it reaped (the stand-ins' Python)."""
    return sum(_stat(server)) if server else 0


def _best(name: str, argv: list[str], n: int = 3) -> float:
    """CPU-s of argv in the twin: the best of n runs' own CPU (wait4), plus the mean CPU the
    twin's stand-in server spent on them (its workers run the stand-ins' Python)."""
    server = _standin_server(name)
    before = _server_ticks(server)
    own = min(in_twin(name, argv)[0] for _ in range(n))
    time.sleep(0.05)  # let the server reap the last worker
    return own + (_server_ticks(server) - before) / TICK / n


STANDIN_CALLS = [
    ["python3", "-c", "pass"], ["python3", "-I", "-S", "-c", "pass"],
    ["uname", "-r"], ["pveversion"], ["pct", "list"], ["qm", "list"],
    ["proxmox-boot-tool", "status"], ["proxmox-boot-tool", "kernel", "list"],
    ["nvidia-smi", "topo", "-m"], ["/bin/uname", "-r"], ["readlink", "-f", "/"],
]
STANDINS = ("/usr/local/",)  # where the twin's stand-in programs live


def command_costs(name: str, commands: list[str], out_dir: Path) -> dict:
    """CPU of each remote command run again in twin `name`, and of single programs."""
    base = _best(name, ["true"], 5)  # nsenter's own exec
    rows: list[dict[str, Any]] = []
    have_strace = shutil.which("strace") is not None
    for i, command in enumerate(commands, 1):
        cpu = _best(name, ["bash", "-c", command]) - base
        execs: collections.Counter = collections.Counter()
        if have_strace:
            trace = out_dir / f"exec-{i}.txt"
            in_twin(name, ["bash", "-c", command], strace_to=str(trace))
            for m in re.finditer(r'execve\("([^"]+)".*= 0$', trace.read_text(), re.M):
                execs[m.group(1)] += 1
        standin = sum(v for k, v in execs.items() if k.startswith(STANDINS))
        rows.append({"n": i, "cpu_s": round(cpu, 4), "execs": sum(execs.values()) - 3 if execs else None,
                     "standins": standin if execs else None,
                     "programs": dict(execs.most_common(6)), "head": command[:90]})
    programs = {" ".join(a): round(_best(name, a, 5) - base, 4) for a in STANDIN_CALLS}
    return {"commands": rows, "commands_cpu_s": round(sum(r["cpu_s"] for r in rows), 3),
            "programs_cpu_s": programs}


# ---------------------------------------------------------------------------------------------


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def measure(names: list[str], out_dir: Path) -> dict:
    before = {n: twin_cpu(n) for n in names}
    load0 = loadavg()
    run = run_sampled(names, out_dir)
    load1 = loadavg()
    settle(names)
    after = {n: twin_cpu(n) for n in names}
    per_twin = {n: round(after[n]["sshd"] - before[n]["sshd"], 3) for n in names}
    run["twin_cpu_s"] = round(sum(per_twin.values()), 3)
    run["twin_cpu_by_twin"] = per_twin
    run["supervisors_cpu_s"] = round(sum(after[n]["supervisor"] - before[n]["supervisor"] for n in names), 3)
    run["loadavg"] = [load0, load1]
    return run


def report(one: dict, many: dict, costs: dict) -> dict:
    cores = os.cpu_count() or 1
    n = many["hosts"]
    total8 = many["runner_cpu_s"] + many["twin_cpu_s"] + many["supervisors_cpu_s"]
    floor_wall = total8 / cores
    # the runner's imports come first and nothing runs beside them (one core); the rest can
    # spread over all cores at best
    imports8 = many["runner_parts"].get("imports", 0.0)
    serial_floor = imports8 + (total8 - imports8) / cores
    out = {
        "cores": cores,
        "wall_s": {"1": one["wall_s"], str(n): many["wall_s"]},
        "ratio": round(many["wall_s"] / one["wall_s"], 2),
        "cpu_s": {
            "1": {"runner": one["runner_cpu_s"], "twins": one["twin_cpu_s"], "supervisors": one["supervisors_cpu_s"]},
            str(n): {"runner": many["runner_cpu_s"], "twins": many["twin_cpu_s"],
                     "supervisors": many["supervisors_cpu_s"]},
        },
        "runner_per_extra_host_s": round((many["runner_cpu_s"] - one["runner_cpu_s"]) / (n - 1), 3),
        "twin_per_host_s": round(many["twin_cpu_s"] / n, 3),
        "floor_wall_s": round(floor_wall, 2),
        "floor_ratio": round(floor_wall / one["wall_s"], 2),
        # the same with the 1-twin run taken as pure CPU (wall = its CPU seconds, no waiting):
        # what the ratio tends to on a quiet machine where both runs are CPU-bound
        "cpu_ratio": round(floor_wall / (one["runner_cpu_s"] + one["twin_cpu_s"]), 2),
        "imports_s": round(imports8, 2),
        "serial_floor_wall_s": round(serial_floor, 2),
        "serial_floor_ratio": round(serial_floor / one["wall_s"], 2),
        "loadavg": {"1": one["loadavg"], str(n): many["loadavg"]},
        "remote_commands_per_host": len(one["commands"]),
        "runner_parts": {"1": one["runner_parts"], str(n): many["runner_parts"]},
        "twin_commands": costs,
    }
    return out


def print_report(r: dict) -> None:
    n = [k for k in r["wall_s"] if k != "1"][0]
    print(f"fleet profile on {r['cores']} cores; loadavg 1-run {r['loadavg']['1']}, {n}-run {r['loadavg'][n]}")
    print(f"wall: 1 twin {r['wall_s']['1']:.2f} s, {n} twins {r['wall_s'][n]:.2f} s -> ratio {r['ratio']}")
    print(f"\n{'CPU seconds (user+sys)':34} {'1 twin':>8} {n + ' twins':>9}")
    for key in ("runner", "twins", "supervisors"):
        print(f"  {key:32} {r['cpu_s']['1'][key]:8.2f} {r['cpu_s'][n][key]:9.2f}")
    print(f"  {'total':32} {sum(r['cpu_s']['1'].values()):8.2f} {sum(r['cpu_s'][n].values()):9.2f}")
    print(f"\nrunner by part (sampled, scaled to its CPU){'':3} {'1 twin':>8} {n + ' twins':>9} {'per extra host':>15}")
    parts = sorted(set(r["runner_parts"]["1"]) | set(r["runner_parts"][n]),
                   key=lambda p: -r["runner_parts"][n].get(p, 0))
    for p in parts:
        a, b = r["runner_parts"]["1"].get(p, 0), r["runner_parts"][n].get(p, 0)
        print(f"  {p:42} {a:8.3f} {b:9.3f} {(b - a) / (int(n) - 1):15.3f}")
    c = r["twin_commands"]
    print(f"\ntwin side, per host: {r['twin_per_host_s']:.3f} CPU-s in the run; its {r['remote_commands_per_host']} "
          f"commands re-run in the twin: {c['commands_cpu_s']:.3f} CPU-s "
          f"(rest = sshd sessions: {r['twin_per_host_s'] - c['commands_cpu_s']:.3f})")
    for row in c["commands"]:
        extra = "" if row["execs"] is None else f"  execs {row['execs']:3}, stand-ins {row['standins']}"
        print(f"  {row['n']:2} {row['cpu_s']:6.3f}{extra}  {row['head'][:60]}")
    print("  single programs in the twin (CPU-s):")
    for k, v in c["programs_cpu_s"].items():
        print(f"    {k:36} {v:.4f}")
    print(f"\nbound: the {n}-twin run needs {sum(r['cpu_s'][n].values()):.2f} CPU-s on {r['cores']} cores "
          f"=> wall >= {r['floor_wall_s']:.2f} s => ratio >= {r['floor_ratio']} "
          f"(twins {r['cpu_s'][n]['twins']:.2f} = {n} x {r['twin_per_host_s']:.2f}, "
          f"runner {r['cpu_s'][n]['runner']:.2f} = {r['cpu_s']['1']['runner']:.2f} + {int(n) - 1} x "
          f"{r['runner_per_extra_host_s']:.3f})")
    print(f"       with the 1-twin run as pure CPU ({sum(r['cpu_s']['1'].values()):.2f} CPU-s, no waiting) "
          f"that is {r['cpu_ratio']}")
    print(f"       with the runner's imports ({r['imports_s']:.2f} s, nothing beside them) first: wall >= "
          f"{r['serial_floor_wall_s']:.2f} s => ratio >= {r['serial_floor_ratio']}")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "_sample":
        _sample_pyinfra(sys.argv[2], sys.argv[sys.argv.index("--") + 1:])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--twins", type=int, default=8)
    ap.add_argument("--prefix", default="fleetprof-")
    ap.add_argument("--keep", action="store_true", help="leave the twins running (and reuse running ones)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON line last")
    args = ap.parse_args()
    from tests.twin import runtime

    names = [f"{args.prefix}{i}" for i in range(1, args.twins + 1)]
    started = []
    out_dir = REPO / ".cache" / "bench-fleet-profile"
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        for name in names:
            if not runtime.running(name):
                runtime.start(name, "kpro6")
                started.append(name)
        if started:  # converge (may reboot), then one warm-up no-change run
            run_sampled(names, out_dir)
        run_sampled(names, out_dir)
        one = measure(names[:1], out_dir)
        many = measure(names, out_dir)
        costs = command_costs(names[0], one["commands"], out_dir)
        r = report(one, many, costs)
        print_report(r)
        if args.json:
            print(json.dumps(r))
    finally:
        if not args.keep:
            for name in names:
                runtime.stop(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
