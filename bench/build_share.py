"""Benchmark (issue 41): one NVIDIA module build per input set in a run of a 3-node cluster twin.

    sudo .venv/bin/python bench/build_share.py [--json]

Three kpro6 twins in one cluster (tests/twin/runtime.py "Clusters", with the cluster's root SSH
trust), the same NVIDIA spec on each (open-gpu-kernel-modules 595.45.04 for 6.1.0-57-amd64, as
tests/e2e/test_driver_build.py builds it), converged in one pyinfra run of the driver stage. Each
node's build records its seconds (operations/progress.py, /var/lib/pvegpu/durations/nvidia-*);
the figure is the build seconds of all three nodes together / one node's build (before issue 41
every node built: ≈ 3; target ≤ 1.2). Then one more kpro6 twin, in no cluster, with the same spec
and the same seeded caches as the cluster's builder, converged alone with the same stage deploy:
the issue's wall figure is the 3-node converge's wall / that single node's (target ≤ 1.2); the
3-node converge's wall / the one build is kept beside it.

--json prints one JSON line {"value", "total_build_s", "one_node_build_s", "builds", "converge_s",
"converge_vs_build", "single_converge_s", "single_build_s", "wall_vs_single", "load_1min" (at the
start of each run), "cache_seeded"} (bench/run.py reads it). PVEGPU_E2E_NVIDIA_CACHE=DIR seeds
the builder's ccache and conftest cache as in the e2e (then both figures are of a warm build).
Needs root (twins); stops its twins.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e.harness import run_pyinfra  # noqa: E402
from tests.e2e.test_build_share_e2e import (  # noqa: E402
    ARCHIVE,
    RELEASE,
    SOURCE,
    STAGE_DEPLOY,
    STAGES,
    VERSION,
    nvidia,
    sh,
    write_inventory,
)
from tests.twin import runtime  # noqa: E402

RECORDS = "var/lib/pvegpu/durations"


def build_seconds(root: Path) -> list[float]:
    """The seconds of each NVIDIA build of VERSION for RELEASE this node recorded."""
    records = root / RECORDS
    out = []
    for f in sorted(records.glob(f"nvidia-{VERSION}-{RELEASE}-*")) if records.is_dir() else []:
        for line in f.read_text().splitlines():
            if line.startswith("seconds "):
                out.append(float(line.split()[1]))
    return out


def prepare(twins: list[runtime.Twin], archive: Path, seed: str | None) -> None:
    """The source archive on every node, no NVIDIA library; the seeded caches on the first (the builder)."""
    for t in twins:
        root = Path(t.root)
        (root / "opt/src").mkdir(parents=True, exist_ok=True)
        shutil.copy(archive, root / ARCHIVE.lstrip("/"))
        sh(t.name, "rm -f /usr/lib/x86_64-linux-gnu/libnvidia-ml.so*")
    for cache in ("ccache", "nvidia-conftest") if seed else ():
        (Path(twins[0].root) / "var/cache/pvegpu").mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", f"{seed}/{cache}", str(Path(twins[0].root) / "var/cache/pvegpu" / cache)],
                       check=True)


def converge(names: list[str], cluster: str | None, archive: Path, sha: str, seed: str | None) -> tuple[float, list[float], float]:
    """Start twins `names` (in `cluster`, or alone), prepare them, converge them in one run of the
    driver stage; the run's wall seconds, the build seconds every node recorded and the 1-min load
    as the run started. Stops them."""
    twins: list[runtime.Twin] = []
    try:
        for name in names:
            twins.append(runtime.start(name, "kpro6", cluster=cluster, owner=os.getpid()))
        prepare(twins, archive, seed)
        with tempfile.TemporaryDirectory(dir=REPO / ".cache") as tmp:
            inventory = write_inventory(Path(tmp), twins, {t.name: {"node": t.name, "nvidia": nvidia(sha)} for t in twins})
            load, t0 = os.getloadavg()[0], time.monotonic()
            run = run_pyinfra(inventory, STAGE_DEPLOY, env=STAGES, timeout=5400)
            wall = time.monotonic() - t0
        if run.rc != 0:
            raise RuntimeError(run.output[-3000:])
        return wall, [s for t in twins for s in build_seconds(Path(t.root))], load
    finally:
        for t in twins:
            runtime.stop(t.name)


def measure() -> dict:
    fetched = subprocess.run(["bash", str(REPO / "scripts/fetch-upstream.sh"), SOURCE], capture_output=True, text=True,
                             check=True)
    archive = Path(fetched.stdout.strip().splitlines()[-1])
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    seed = os.environ.get("PVEGPU_E2E_NVIDIA_CACHE")
    pid = os.getpid()
    converge_s, builds, load = converge([f"bs{x}-{pid}" for x in "abc"], f"bs{pid}", archive, sha, seed)
    if not builds:
        raise RuntimeError("no node recorded a build")
    # issue 41's wall figure: one more kpro6 twin, in no cluster, the same spec and the same seeded
    # caches as the cluster's builder, converged alone right after (the same machine state)
    single_s, single_builds, single_load = converge([f"bss-{pid}"], None, archive, sha, seed)
    if not single_builds:
        raise RuntimeError("the single node recorded no build")
    return figures(converge_s, builds, load, single_s, single_builds, single_load,
                   cache_seeded=bool(seed), source=SOURCE, release=RELEASE)


def figures(converge_s: float, builds: list, load: float, single_s: float, single_builds: list, single_load: float,
            **extra) -> dict:
    """Issue 41's figures of a 3-node run and a lone node's (this bench and bench/build_share_kernel.py)."""
    one = max(builds)
    return {"value": round(sum(builds) / one, 2), "total_build_s": sum(builds), "one_node_build_s": one,
            "builds": len(builds), "converge_s": round(converge_s, 1), "converge_vs_build": round(converge_s / one, 2),
            "single_converge_s": round(single_s, 1), "single_build_s": max(single_builds),
            "wall_vs_single": round(converge_s / single_s, 2), "load_1min": [round(load, 2), round(single_load, 2)],
            **extra}


def run(measure_fn, what: str, seeded_key: str, seeded_text: str) -> int:
    """The command line of both benches: --json prints `measure_fn()`'s figures, else one line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    result = measure_fn()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{what} of the 3-node run / one node's build: {result['value']} "
              f"({result['total_build_s']:.0f} s over {result['builds']} build(s) / {result['one_node_build_s']:.0f} s; "
              f"target <= 1.2); wall: the 3-node converge {result['converge_s']} s / one node's converge alone "
              f"{result['single_converge_s']} s = {result['wall_vs_single']} (target <= 1.2; the 3-node converge = "
              f"{result['converge_vs_build']} x the build; 1-min load at the two starts {result['load_1min']})"
              + (f" ({seeded_text})" if result[seeded_key] else ""))
    return 0


def main() -> int:
    return run(measure, "build seconds", "cache_seeded", "builder's cache seeded")

if __name__ == "__main__":
    sys.exit(main())
