"""Benchmark: the kernel stage's build of two refs, the first with a cold ccache, the second warm.

    sudo .venv/bin/python bench/kernel_ccache.py [--jobs N] [--json]

--json prints one JSON line {"value": second/first, "cold_s", "warm_s", "ccache": {...}, ...}
(bench/run.py reads it).

Runs the kernel stage's own build.sh (templates/kernel-build.sh.j2 through
operations.kernel.build_script: unpack, tinyconfig + the fragments of
tests/e2e/test_kernel_build.py, `make bindeb-pkg` through ccache) inside a throwaway overlay of
the twin's cached Debian bookworm root, on Debian's linux-source-6.1 (scripts/fetch-linux-source.sh):

  cold    release <ver>-pvegpu-bench1 in its own build dir, the kernel's ccache empty
  warm    release <ver>-pvegpu-bench2 (another ref: another build dir), the ccache the first left

Prints both times, warm/cold and the second build's ccache counters (hits across build dirs:
CCACHE_BASEDIR + hash_dir off). Needs root (mount namespace, overlayfs, chroot); touches nothing
outside a temp dir.
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

from operations.kernel import build_script  # noqa: E402
from plan import kernel as plan  # noqa: E402
from plan.render import render_template  # noqa: E402
from spec.models import KernelSpec  # noqa: E402
from tests.e2e.test_kernel_build import FRAGMENTS  # noqa: E402
from tests.twin import runtime  # noqa: E402

SOURCE = "/tmp/linux-source-6.1.tar.xz"  # where the tarball sits in the overlay


def fetch_source() -> tuple[Path, str, str]:
    done = subprocess.run([str(REPO / "scripts/fetch-linux-source.sh")], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"scripts/fetch-linux-source.sh failed:\n{done.stderr[-2000:]}")
    path, sha256, version = done.stdout.split()
    return Path(path), sha256, version


def run(jobs: int) -> dict:
    lower = runtime.ensure_root_cache()
    tarball, sha256, upstream = fetch_source()
    lines = ["set -e", f"rm -rf {plan.CCACHE_DIR}"]
    builds = []
    for name, suffix in (("cold", "bench1"), ("warm", "bench2")):
        k = KernelSpec(version=f"{upstream}-pvegpu-{suffix}", base_config="tinyconfig", config_fragments=FRAGMENTS,
                       jobs=jobs, ccache=True, source={"kind": "tarball", "url": SOURCE, "sha256": sha256})
        d = plan.build_dir(k, "tinyconfig")
        manifest = render_template("kernel-build-manifest.json.j2", build_id=plan.build_id(k, "tinyconfig"),
                                   version=k.version, kind="tarball", url=SOURCE, ref=sha256, base_config="tinyconfig",
                                   fragments=list(k.config_fragments), jobs=jobs)
        builds.append((name, k.version, d))
        lines += [
            f"mkdir -p {d}",
            f"cat > {d}/build.sh <<'PVEGPU_EOF'\n{build_script(k, 'tinyconfig', jobs, d)}\nPVEGPU_EOF",
            f"cat > {d}/manifest.json.in <<'PVEGPU_EOF'\n{manifest}\nPVEGPU_EOF",
            f"mkdir -p {plan.CCACHE_DIR} && CCACHE_DIR={plan.CCACHE_DIR} ccache -z >/dev/null",
            f"echo \"start {name} $(date +%s.%N) $(cut -d' ' -f1 /proc/loadavg)\"",
            f"/bin/sh {d}/build.sh || {{ tail -n 60 {d}/build.log; exit 1; }}",
            f"echo \"end {name} $(date +%s.%N) $(cut -d' ' -f1 /proc/loadavg)\"",
            f"CCACHE_DIR={plan.CCACHE_DIR} ccache --print-stats | grep -E "
            f"'^(direct_cache_hit|preprocessed_cache_hit|cache_miss)\\s' | sed 's/^/stat {name} /'",
        ]
    with tempfile.TemporaryDirectory(prefix="pvegpu-bench-") as tmp:
        t = Path(tmp)
        for sub in ("upper/tmp", "work", "merged"):
            (t / sub).mkdir(parents=True)
        (t / "upper/tmp/bench.sh").write_text("\n".join(lines) + "\n")
        subprocess.run(["cp", str(tarball), str(t / "upper") + SOURCE], check=True)
        shell = (
            f"mount -t overlay overlay -o lowerdir={lower},upperdir={t}/upper,workdir={t}/work {t}/merged && "
            f"mount -t proc proc {t}/merged/proc && mount --bind /dev {t}/merged/dev && "
            f"chroot {t}/merged /bin/bash /tmp/bench.sh"
        )
        done = subprocess.run(["unshare", "--mount", "--pid", "--fork", "bash", "-c", shell], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"build failed:\n{done.stdout[-6000:]}{done.stderr[-3000:]}")
    runs: dict[str, dict] = {}
    for name, release, d in builds:
        start = re.search(rf"^start {name} ([\d.]+) ([\d.]+)$", done.stdout, re.M)
        end = re.search(rf"^end {name} ([\d.]+) ([\d.]+)$", done.stdout, re.M)
        assert start and end, f"no start/end line of {name} in the build output"
        runs[name] = {"release": release, "build_dir": d, "s": round(float(end.group(1)) - float(start.group(1)), 1),
                      "load_1min": [float(start.group(2)), float(end.group(2))],
                      "ccache": {k: int(v) for k, v in re.findall(rf"^stat {name} (\w+)\s+(\d+)$", done.stdout, re.M)}}
    cold, warm = float(runs["cold"]["s"]), float(runs["warm"]["s"])
    return {"value": round(warm / cold, 3), "benchmark": "kernel_ccache", "source": tarball.name,
            "source_sha256": sha256, "config": "tinyconfig + tests/e2e/test_kernel_build.py FRAGMENTS", "jobs": jobs,
            "cold_s": cold, "warm_s": warm, "ratio": round(warm / cold, 3), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.jobs)
    if args.json:
        print(json.dumps(result))
        return
    print(f"kernel {result['source']} ({result['config']}), -j{result['jobs']}, {os.cpu_count()} cores")
    for name, r in result["runs"].items():
        print(f"  {name:5} {r['release']:26} {r['s']:7.1f} s  ccache {r['ccache']}")
    print(f"  second ref (warm) / first (cold) {result['ratio']:.3f}")


if __name__ == "__main__":
    main()
