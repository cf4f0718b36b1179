"""Benchmark: NVIDIA module build, cold vs. rebuilt from a clean tree with a warm ccache.

    sudo .venv/bin/python bench/driver_ccache.py [--jobs N] [--json]

--json prints one JSON line {"value": ratio, "cold_s", "warm_s", ...} (bench/run.py reads it).

Runs the driver stage's own `build_command` (operations/nvidia.py) twice inside a throwaway
overlay of the twin's cached Debian bookworm root (real 6.1 headers, gcc-12, ccache, Debian's
535 *proprietary* NVIDIA module tree, nvidia-kernel-source, at /usr/src/nvidia-kernel.tar.xz;
bookworm has no open one): first with an empty ccache, then
again — the command unpacks a fresh tree each time, so the second run is a rebuild after a
full clean — with the ccache the first run filled. Prints both times and their ratio
(target <= 0.35). Needs root (mount namespace, overlayfs, chroot); touches nothing outside
a temp dir.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from operations.nvidia import build_command  # noqa: E402
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


def run(jobs: int | None) -> dict:
    lower = runtime.ensure_root_cache()
    release, version = headers_release(lower), tarball_version(lower)
    jobs = jobs or 2
    build = build_command(TARBALL, version, release, "gcc-12", jobs, ccache=True)
    script = "\n".join([
        "set -e",
        "t0=$(date +%s.%N)", f"( {build} ) >/tmp/cold.out 2>&1", "t1=$(date +%s.%N)",
        "echo cold $(awk \"BEGIN{print $t1-$t0}\")",
        "t0=$(date +%s.%N)", f"( {build} ) >/tmp/warm.out 2>&1", "t1=$(date +%s.%N)",
        "echo warm $(awk \"BEGIN{print $t1-$t0}\")",
        "CCACHE_DIR=/var/cache/pvegpu/ccache ccache -s | grep -Ei 'hits|misses' | sed 's/^/stat /'",
    ])
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
    times = dict(re.findall(r"^(cold|warm) ([\d.]+)$", done.stdout, re.M))
    cold, warm = float(times["cold"]), float(times["warm"])
    return {"value": round(warm / cold, 3), "benchmark": "driver_ccache", "release": release, "version": version, "jobs": jobs,
            "cold_s": round(cold, 1), "warm_s": round(warm, 1), "ratio": round(warm / cold, 3),
            "target_ratio": TARGET_RATIO, "ok": warm / cold <= TARGET_RATIO,
            "ccache": [line[5:] for line in done.stdout.splitlines() if line.startswith("stat ")]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.jobs)
    if args.json:
        print(json.dumps(result))
        return
    print(f"NVIDIA {result['version']} modules for {result['release']}, -j{result['jobs']}")
    print(f"  cold build            {result['cold_s']:8.1f} s")
    print(f"  rebuild, warm ccache  {result['warm_s']:8.1f} s")
    print(f"  ratio                 {result['ratio']:8.3f}   target <= {TARGET_RATIO}  {'OK' if result['ok'] else 'MISSED'}")
    for line in result["ccache"]:
        print(f"  ccache: {line}")


if __name__ == "__main__":
    main()
