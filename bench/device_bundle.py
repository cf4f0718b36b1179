"""A bundle to run the fleet, cluster and converge benches on another (many-core) Linux machine
without network.

    .venv/bin/python bench/device_bundle.py [--out .cache/bench-device]
    # then, on the other machine, in a copy of this repository with the bundle at the same path:
    bash bench/device_fleet.sh .cache/bench-device OUT_DIR

Why: `fleet8_vs_1` compares a run against eight twins with one against one twin. On this
project's 2-core development machine the eight twins' side of every command runs on the same
cores as pyinfra, so the figure measures those cores (bench/fleet_profile.py); in a real fleet
every host does its share on its own CPU. A machine with more cores than twins measures what
pvegpu and pyinfra do per extra host. That machine may have no network and no Debian mirror,
and a twin's root (the cache under .cache/twin) is ~900 MB, so the bundle carries only what a
twin opens:

1. Two kpro6 twins are started, converged from scratch, converged twice more (no change) and
   once more alone, then CT 200 is started on the first and it is converged again with its
   Proxmox CLIs delayed, and a bare `pyinfra fact` is run against it (the converge bench), all under `strace -f -e trace=%file,execve`: every path any process asked
   for (the twins' sshd, shells, programs, stand-ins, and the runtime writing their roots).
2. Those paths are resolved inside the cached root (each symlink on the way and its target);
   every one that exists there is kept: files, links and the directories on their way, not
   the directories' other contents. That is ~100 MB (gcc's cc1 for the first converge's build,
   python3, sshd, libraries) and ~26 MB as tar.xz.
3. The Python wheels the runner needs for that machine's Python (default 3.12, manylinux), the
   stand-in client built here (static), and the cache key of the root it stands for.

device_fleet.sh unpacks the root where tests/twin/runtime.py finds its cache, installs the
wheels into a venv, byte-compiles it and runs `bench/run.py --only $BENCHES` (default fleet). The
slim root is only for those benches: a twin started from it converges and re-converges like one
from the full root (the trace covered exactly those steps), anything else may find files missing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# What the runner imports (pyinfra and its dependencies, pvegpu's own): pinned to what this
# machine's .venv has, fetched for the other machine's Python.
RUNNER_DISTRIBUTIONS = [
    "annotated-types", "bcrypt", "cffi", "click", "cryptography", "distro", "gevent", "graphviz",
    "greenlet", "invoke", "Jinja2", "MarkupSafe", "packaging", "paramiko", "proxmoxer", "pycparser",
    "pydantic", "pydantic_core", "PyNaCl", "python-dateutil", "PyYAML", "six", "typeguard",
    "typing-inspection", "typing_extensions", "zope.event", "zope.interface", "pyinfra",
]
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux1_x86_64"]
TRACE_TWINS = ["bundle-trace-1", "bundle-trace-2"]
_CALL = re.compile(r"^\d+\s+\w+\((.*)$")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def trace_lifecycle(trace: Path) -> None:
    """Start two twins, converge, converge twice more, once alone, then the converge bench's steps
    on the first (CT 200 started, a converge with delayed Proxmox CLIs, a bare fact); all under strace."""
    script = (
        f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
        "from tests.twin import runtime\n"
        "from tests.e2e.harness import run_pyinfra\n"
        f"names = {TRACE_TWINS!r}\n"
        "import subprocess\n"
        "twins = [runtime.start(n, 'kpro6') for n in names]\n"
        "try:\n"
        "    for env in [names, names, names, names[:1]]:\n"
        "        r = run_pyinfra('inventories/twin.py', 'deploy.py', env={'PVEGPU_TWINS': ','.join(env)})\n"
        "        print('converge', env, 'rc', r.rc, 'changed', r.changed, flush=True)\n"
        "        assert r.rc == 0, r.output[-3000:]\n"
        # the converge bench's steps (bench/run.py bench_converge): CT 200 started, a converge with
        # the Proxmox CLIs delayed, a bare fact
        "    runtime.set_pve_delay(twins[0].root, 0.4)\n"
        "    subprocess.run(runtime.ssh_command(names[0], ['pct start 200']), check=True, timeout=120)\n"
        "    for _ in range(2):\n"
        "        r = run_pyinfra('inventories/twin.py', 'deploy.py', env={'PVEGPU_TWINS': names[0]})\n"
        "        print('converge with CT 200 running rc', r.rc, 'changed', r.changed, flush=True)\n"
        "        assert r.rc == 0, r.output[-3000:]\n"
        "    from bench.run import _bare_fact\n"
        "    print('bare fact', _bare_fact(twins[0]), flush=True)\n"
        "finally:\n"
        "    for n in names: runtime.stop(n)\n"
    )
    subprocess.run(["strace", "-f", "--seccomp-bpf", "-qq", "-e", "trace=%file,execve", "-o", str(trace),
                    sys.executable, "-c", script], cwd=REPO, check=True)


def traced_paths(trace: Path) -> set[str]:
    """Every absolute path of the first two string arguments of each traced call; paths into a
    twin's root (as the runtime writes them from outside) are taken relative to that root."""
    inside = re.compile(rf"^{re.escape(str(REPO))}/\.twin/[^/]+/(?:root|upper)(/.*)?$")
    paths = set()
    with open(trace, errors="replace") as f:
        for line in f:
            call = _CALL.match(line)
            if not call:
                continue
            for s in _STRING.findall(call.group(1))[:2]:
                if not s.startswith("/") or "\\" in s:
                    continue
                twin = inside.match(s)
                if twin:
                    s = twin.group(1) or "/"
                elif s.startswith(str(REPO)):
                    continue
                paths.add(os.path.normpath(s))
    return paths


def keep_in_root(root: Path, paths: set[str]) -> list[str]:
    """The entries of `root` those paths reach: each component on the way, following symlinks
    inside the root (a link and its target are both kept)."""
    keep: set[str] = set()

    def walk(path: str, depth: int = 0) -> None:
        if depth > 40:
            return
        parts = [p for p in path.split("/") if p]
        current = ""
        for i, part in enumerate(parts):
            nxt = f"{current}/{part}"
            try:
                st = os.lstat(f"{root}{nxt}")
            except OSError:
                return
            keep.add(nxt)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(f"{root}{nxt}")
                base = target if target.startswith("/") else os.path.normpath(f"{current}/{target}")
                rest = "/".join(parts[i + 1:])
                walk(os.path.normpath(f"{base}/{rest}" if rest else base), depth + 1)
                return
            current = nxt

    for path in paths:
        walk(path)
    return sorted(keep)


def fetch_wheels(dest: Path, python_version: str) -> None:
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    for name in RUNNER_DISTRIBUTIONS:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp", "-d", str(dest),
               f"{name}=={version(name)}"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd, check=True)


def main() -> int:
    from tests.twin import hardware, runtime

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / ".cache" / "bench-device"))
    ap.add_argument("--python", default="3.12", help="the other machine's Python (X.Y) for the wheels")
    ap.add_argument("--reuse-trace", action="store_true", help="use the trace of an earlier run")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    root = runtime.ensure_root_cache()
    trace = out.with_name(out.name + "-trace.txt")  # not in the bundle: ~50 MB
    if not (args.reuse_trace and trace.exists()):
        if not shutil.which("strace"):
            print("device_bundle: needs strace (apt-get install strace)", file=sys.stderr)
            return 2
        trace_lifecycle(trace)
    entries = keep_in_root(root, traced_paths(trace))
    (out / "files.txt").write_text("".join(f".{e}\n" for e in entries))
    size = sum(os.lstat(f"{root}{e}").st_size for e in entries if stat.S_ISREG(os.lstat(f"{root}{e}").st_mode))
    tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "--xattrs", "--no-recursion", "-cpf", "-",
                            "-T", str(out / "files.txt")], stdout=subprocess.PIPE)
    with open(out / "root.tar.xz.part", "wb") as f:
        subprocess.run(["xz", "-9", "-T0"], stdin=tar.stdout, stdout=f, check=True)
    if tar.wait() != 0:
        raise SystemExit("device_bundle: tar failed")
    os.replace(out / "root.tar.xz.part", out / "root.tar.xz")
    client = hardware.standin_client()
    for old in out.glob("standin-client-*"):
        old.unlink()
    if client:
        shutil.copy2(client, out / client.name)
    fetch_wheels(out / "wheels", args.python)
    (out / "bundle.json").write_text(json.dumps({
        "cache_key": runtime.cache_key(), "entries": len(entries), "bytes": size,
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": args.python,
        "standin_client": client.name if client else None}, indent=1) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"device bundle in {out}: {len(entries)} root entries ({size / 1e6:.0f} MB, "
          f"{(out / 'root.tar.xz').stat().st_size / 1e6:.0f} MB as tar.xz), "
          f"{len(list((out / 'wheels').glob('*.whl')))} wheels; {total / 1e6:.0f} MB to carry "
          f"{time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
