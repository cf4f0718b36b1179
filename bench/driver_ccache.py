"""Benchmark: NVIDIA's open tree through the driver stage's build, cold, second release, warm.

    sudo .venv/bin/python bench/driver_ccache.py [--jobs N] [--json] [--breakdown]

--json prints one JSON line {"value": warm/cold, "cold_s", "warm_s", "second_release_s",
"second_vs_first", "source", "releases", "runs": {...}, ...} (bench/run.py reads it).

Runs the driver stage's own `build_command` (operations/nvidia.py) inside a throwaway overlay of
the twin's cached Debian bookworm root (gcc-12/g++-12, ccache, Debian's real headers of two
releases: 6.1.0-57-amd64 and bookworm-security's 6.12) on NVIDIA's open-gpu-kernel-modules
archive that `scripts/fetch-upstream.sh open-gpu-kernel-modules-595.45.04` gives (by URL +
sha256, or the file of that sha256 in ../shared/sources/). In order, as a host does them:

  cold    the first release, empty ccache and conftest cache: src/ (C and C++) + kernel-open/
  second  the second release in the same run: src/ objects reused, kernel-open/ alone
  warm    the first release again after the run's scratch dirs were removed (a rebuild on a
          later run: the tree unpacked afresh), with the ccache and conftest results kept

Prints the times, warm/cold (target <= 0.1) and second/first, each run's phases (conftest /
compile / link, from the tree's mtimes), its ccache counters and the 1-min load average
(sampled every 10 s; numbers are only comparable at similar load). --breakdown adds, before
warm, a rebuild with the ccache alone (conftest results not reused). Needs root (mount
namespace, overlayfs, chroot); touches nothing outside a temp dir.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from operations.nvidia import CCACHE_DIR, build_command, build_dir, cleanup_command, src_dir  # noqa: E402
from tests.twin import runtime  # noqa: E402

TARGET_RATIO = 0.1
SOURCE = "open-gpu-kernel-modules-595.45.04"
ARCHIVE = "/tmp/open-gpu-kernel-modules.tar"  # where the archive sits in the overlay
CC, CXX = "gcc-12", "g++-12"


def headers_releases(root: Path) -> list[str]:
    """The releases with Debian headers in the root, oldest first (6.1.0-57-amd64, 6.12.…+deb12-amd64)."""
    releases = [p.name for p in (root / "lib/modules").iterdir()
                if (root / f"lib/modules/{p.name}/build").is_symlink()
                and (root / str(os.readlink(root / f"lib/modules/{p.name}/build")).lstrip("/") / "Makefile").exists()]
    if len(releases) < 2:
        raise SystemExit(f"the twin root needs headers of two releases under {root}/lib/modules; has {releases}")
    return sorted(releases, key=lambda r: [int(x) for x in re.findall(r"\d+", r.split("+")[0].split("-")[0])])


def fetch_source() -> tuple[Path, str]:
    """(archive path, its version) through the project's fetch script."""
    done = subprocess.run(["bash", str(REPO / "scripts/fetch-upstream.sh"), SOURCE], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"scripts/fetch-upstream.sh {SOURCE} failed:\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1]), SOURCE.rsplit("-", 1)[1]


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
    first, second = headers_releases(lower)[:2]
    archive, version = fetch_source()
    jobs = jobs or 2
    # (name, release, conftest cache, remove the run's scratch dirs first)
    builds = [("cold", first, True, False), ("second", second, True, False)]
    builds += [("ccache_only", first, False, True)] if breakdown else []
    builds += [("warm", first, True, True)]
    lines = ["set -e", "( while :; do echo \"load $(cut -d' ' -f1 /proc/loadavg)\"; sleep 10; done ) & sampler=$!"]
    for name, release, conftest_cache, clean in builds:
        build = build_command(ARCHIVE, version, release, CC, jobs, ccache=True, conftest_cache=conftest_cache, cxx=CXX)
        b, s = build_dir(version, release), src_dir(version, CC, CXX)
        lines += ([cleanup_command(version)] if clean else []) + [
            f"CCACHE_DIR={CCACHE_DIR} ccache -z >/dev/null 2>&1 || true",
            f"echo \"start {name} $(date +%s.%N) $(cut -d' ' -f1 /proc/loadavg)\"",
            f"( {build} ) >/tmp/{name}.out 2>&1 || {{ cat /tmp/{name}.out; tail -n 60 {b}/build.log; exit 1; }}",
            f"echo \"end {name} $(date +%s.%N) $(cut -d' ' -f1 /proc/loadavg)\"",
            f"find {s}/tree {b} -printf '%T@ %P\\n' >/tmp/{name}.mtimes 2>/dev/null || true",
            f"cp {b}/build.log /tmp/{name}.log",
            f"ls -l {b}/out/ | sed 's/^/ko {name} /'",
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
        subprocess.run(["cp", str(archive), str(t / "upper") + ARCHIVE], check=True)
        shell = (
            f"mount -t overlay overlay -o lowerdir={lower},upperdir={t}/upper,workdir={t}/work {t}/merged && "
            f"mount -t proc proc {t}/merged/proc && mount --bind /dev {t}/merged/dev && "
            f"chroot {t}/merged /bin/bash /tmp/bench.sh"
        )
        done = subprocess.run(["unshare", "--mount", "--pid", "--fork", "bash", "-c", shell],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"build failed:\n{done.stdout[-6000:]}{done.stderr[-3000:]}")
        runs = {}
        for name, release, _, _ in builds:
            start = re.search(rf"^start {name} ([\d.]+) ([\d.]+)$", done.stdout, re.M)
            end = re.search(rf"^end {name} ([\d.]+) ([\d.]+)$", done.stdout, re.M)
            assert start and end, f"no start/end line of {name} in the build output"
            t0, t1 = float(start.group(1)), float(end.group(1))
            log = (t / f"upper/tmp/{name}.log").read_text(errors="replace")
            out = (t / f"upper/tmp/{name}.out").read_text(errors="replace")
            runs[name] = {
                "release": release,
                "s": round(t1 - t0, 1), **phases((t / f"upper/tmp/{name}.mtimes").read_text(), t0, t1),
                "conftest_runs": len(re.findall(r"^ CONFTEST: ", log, re.M)),
                "objtool_naked_returns": len(re.findall(r"'naked' return found", log)),
                "restored": "conftest results restored" in out,
                "src_reused": "src/ objects reused" in out,
                "ko_bytes": sum(int(m) for m in re.findall(rf"^ko {name} \S+\s+\d+\s+\S+\s+\S+\s+(\d+) ", done.stdout, re.M)),
                "load_1min": [float(start.group(2)), float(end.group(2))],
                "ccache": {k: int(v) for k, v in re.findall(rf"^stat {name} (\w+)\s+(\d+)$", done.stdout, re.M)},
            }
    samples = [float(x) for x in re.findall(r"^load ([\d.]+)$", done.stdout, re.M)]
    cold, warm, second_s = runs["cold"]["s"], runs["warm"]["s"], runs["second"]["s"]
    return {"value": round(warm / cold, 3), "benchmark": "driver_ccache", "source": SOURCE,
            "source_sha256": subprocess.run(["sha256sum", str(archive)], capture_output=True, text=True).stdout.split()[0],
            "releases": [first, second], "version": version, "jobs": jobs, "compilers": [CC, CXX],
            "cold_s": cold, "warm_s": warm, "second_release_s": second_s, "ratio": round(warm / cold, 3),
            "second_vs_first": round(second_s / cold, 3),
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
    print(f"NVIDIA {result['source']} for {', '.join(result['releases'])}, -j{result['jobs']}, "
          f"load (1 min) mean {result['load_1min_mean']} max {result['load_1min_max']} on {os.cpu_count()} cores")
    for name, r in result["runs"].items():
        print(f"  {name:12} {r['release']:22} {r['s']:7.1f} s  conftest {r['conftest_s']:6.1f}  compile {r['compile_s']:6.1f}  "
              f"link {r['link_s']:6.1f}  tail {r['tail_s']:5.1f}  conftests run {r['conftest_runs']:4}  ccache {r['ccache']}")
    print(f"  ratio warm/cold {result['ratio']:.3f}   target <= {TARGET_RATIO}  {'OK' if result['ok'] else 'MISSED'}")
    print(f"  second release / first {result['second_vs_first']:.3f}")


if __name__ == "__main__":
    main()
