"""Benchmark: NVIDIA module build, cold vs. rebuilt from a clean tree with warm caches.

    sudo .venv/bin/python bench/driver_ccache.py [--jobs N] [--json] [--breakdown]

--json prints one JSON line {"value": ratio, "cold_s", "warm_s", "runs": {...}, ...}
(bench/run.py reads it).

Runs the driver stage's own `build_command` (operations/nvidia.py) inside a throwaway overlay
of the twin's cached Debian bookworm root (real 6.1 headers, gcc-12, ccache, Debian's 535
*proprietary* NVIDIA module tree, nvidia-kernel-source, at /usr/src/nvidia-kernel.tar.xz;
bookworm has no open one): first with an empty ccache and conftest cache, then again — the
command unpacks a fresh tree each time, so the second run is a rebuild after a full clean —
with the ccache and the conftest results the first run stored (as on a host). Prints both
times, their ratio (target <= 0.35), each run's phases (conftest / compile / link, from the
tree's mtimes), its ccache counters and the 1-min load average (sampled every 10 s; the
numbers are only comparable at similar load). --breakdown adds, between the two, a rebuild
with the ccache alone (conftest results not reused). Needs root (mount namespace, overlayfs,
chroot); touches nothing outside a temp dir.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from operations.nvidia import CCACHE_DIR, build_command, build_dir  # noqa: E402
from tests.twin import runtime  # noqa: E402

TARGET_RATIO = 0.35
TARBALL = "/usr/src/nvidia-kernel.tar.xz"


def headers_release(root: Path) -> str:
    """The release of the root's Debian headers (6.1.0-57-amd64 in the twin root)."""
    releases = sorted(p.name for p in (root / "lib/modules").iterdir() if (root / f"usr/src/linux-headers-{p.name}/Makefile").exists())
    if not releases:
        raise SystemExit(f"no kernel headers under {root}/lib/modules")
    return releases[-1]


def tarball_version(root: Path) -> str:
    status = (root / "var/lib/dpkg/status").read_text()
    match = re.search(r"^Package: nvidia-kernel-source\n(?:.+\n)*?Version: (\d+\.\d+\.\d+)", status, re.M)
    if not match:
        raise SystemExit("nvidia-kernel-source is not installed in the twin root")
    return match.group(1)


def phases(listing: str, t0: float, t1: float) -> dict:
    """Where one build's time went, from the mtimes of its tree (`find -printf '%T@ %P'`).

    conftest: until the last conftest/ result was written (the unpack and key included);
    compile: then until the last object compiled from a .c/.S; link: then until the last .ko
    (composite objects, modpost, .mod.o, ld); tail: copying out, vermagic check, cache store.
    Restored conftest results keep their old mtimes, so a restored phase shows as ~0.
    """
    files = {}
    for line in listing.splitlines():
        stamp, _, path = line.partition(" ")
        if path:
            files[path] = float(stamp)
    sources = {p.rsplit(".", 1)[0] for p in files if p.endswith((".c", ".S"))}
    conftest = max([t0] + [m for p, m in files.items() if "/conftest/" in p])
    compiled = max([conftest] + [m for p, m in files.items() if p.endswith(".o") and not p.endswith(".mod.o") and p[:-2] in sources])
    linked = max([compiled] + [m for p, m in files.items() if p.endswith(".ko")])
    return {"conftest_s": round(conftest - t0, 1), "compile_s": round(compiled - conftest, 1),
            "link_s": round(linked - compiled, 1), "tail_s": round(t1 - linked, 1)}


def run(jobs: int | None, breakdown: bool = False) -> dict:
    lower = runtime.ensure_root_cache()
    release, version = headers_release(lower), tarball_version(lower)
    jobs = jobs or 2
    # cold: empty ccache and conftest cache; warm: both as the cold run left them.
    # --breakdown adds, between them, a rebuild with the ccache only (conftest results not reused).
    builds = [("cold", True)] + ([("ccache_only", False)] if breakdown else []) + [("warm", True)]
    lines = ["set -e", "( while :; do echo \"load $(cut -d' ' -f1 /proc/loadavg)\"; sleep 10; done ) & sampler=$!"]
    for name, conftest_cache in builds:
        build = build_command(TARBALL, version, release, "gcc-12", jobs, ccache=True, conftest_cache=conftest_cache)
        lines += [
            f"CCACHE_DIR={CCACHE_DIR} ccache -z >/dev/null 2>&1 || true",
            f"echo \"start {name} $(date +%s.%N) $(cut -d' ' -f1 /proc/loadavg)\"",
            f"( {build} ) >/tmp/{name}.out 2>&1",
            f"echo \"end {name} $(date +%s.%N) $(cut -d' ' -f1 /proc/loadavg)\"",
            f"find {build_dir(version, release)}/src -printf '%T@ %P\\n' >/tmp/{name}.mtimes",
            f"cp {build_dir(version, release)}/build.log /tmp/{name}.log",
            f"CCACHE_DIR={CCACHE_DIR} ccache --print-stats | grep -E '^(direct_cache_hit|preprocessed_cache_hit|cache_miss|"
            f"compile_failed|preprocessor_error|called_for_preprocessing)\\s' | sed 's/^/stat {name} /'",
        ]
    lines.append("kill $sampler")
    script = "\n".join(lines)
    with tempfile.TemporaryDirectory(prefix="pvegpu-bench-") as tmp:
        t = Path(tmp)
        for d in ("upper", "work", "merged"):
            (t / d).mkdir()
        (t / "upper/tmp").mkdir(parents=True)
        (t / "upper/tmp/bench.sh").write_text(script + "\n")
        shell = (
            f"mount -t overlay overlay -o lowerdir={lower},upperdir={t}/upper,workdir={t}/work {t}/merged && "
            f"mount -t proc proc {t}/merged/proc && mount --bind /dev {t}/merged/dev && "
            f"chroot {t}/merged /bin/bash /tmp/bench.sh"
        )
        done = subprocess.run(["unshare", "--mount", "--pid", "--fork", "bash", "-c", shell],
                              capture_output=True, text=True)
        if done.returncode != 0:
            log = (t / "upper/tmp/cold.out")
            raise SystemExit(f"build failed:\n{done.stdout}{done.stderr}\n{log.read_text()[-3000:] if log.exists() else ''}")
        runs = {}
        for name, _ in builds:
            start = re.search(rf"^start {name} ([\d.]+) ([\d.]+)$", done.stdout, re.M)
            end = re.search(rf"^end {name} ([\d.]+) ([\d.]+)$", done.stdout, re.M)
            t0, t1 = float(start.group(1)), float(end.group(1))
            log = (t / f"upper/tmp/{name}.log").read_text(errors="replace")
            runs[name] = {
                "s": round(t1 - t0, 1), **phases((t / f"upper/tmp/{name}.mtimes").read_text(), t0, t1),
                "conftest_runs": len(re.findall(r"^ CONFTEST: ", log, re.M)),
                "restored": "conftest results restored" in (t / f"upper/tmp/{name}.out").read_text(),
                "load_1min": [float(start.group(2)), float(end.group(2))],
                "ccache": {k: int(v) for k, v in re.findall(rf"^stat {name} (\w+)\s+(\d+)$", done.stdout, re.M)},
            }
    samples = [float(x) for x in re.findall(r"^load ([\d.]+)$", done.stdout, re.M)]
    cold, warm = runs["cold"]["s"], runs["warm"]["s"]
    return {"value": round(warm / cold, 3), "benchmark": "driver_ccache", "release": release, "version": version, "jobs": jobs,
            "cold_s": cold, "warm_s": warm, "ratio": round(warm / cold, 3),
            "target_ratio": TARGET_RATIO, "ok": warm / cold <= TARGET_RATIO,
            "load_1min_mean": round(sum(samples) / len(samples), 2) if samples else None,
            "load_1min_max": max(samples) if samples else None, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time a rebuild with the ccache alone (conftest results not reused)")
    args = parser.parse_args()
    result = run(args.jobs, args.breakdown)
    if args.json:
        print(json.dumps(result))
        return
    print(f"NVIDIA {result['version']} modules for {result['release']}, -j{result['jobs']}, "
          f"load (1 min) mean {result['load_1min_mean']} max {result['load_1min_max']} on {os.cpu_count()} cores")
    for name, r in result["runs"].items():
        print(f"  {name:12} {r['s']:7.1f} s  conftest {r['conftest_s']:6.1f}  compile {r['compile_s']:6.1f}  "
              f"link {r['link_s']:6.1f}  tail {r['tail_s']:5.1f}  conftests run {r['conftest_runs']:4}  ccache {r['ccache']}")
    print(f"  ratio warm/cold {result['ratio']:.3f}   target <= {TARGET_RATIO}  {'OK' if result['ok'] else 'MISSED'}")


if __name__ == "__main__":
    main()
