"""Benchmark (issue 41, the kernel half): one kernel build per input set in a run of a 3-node cluster twin.

    sudo .venv/bin/python bench/build_share_kernel.py [--json]

Three kpro6 twins in one cluster (tests/twin/runtime.py "Clusters", with the cluster's root SSH
trust), the same kernel spec on each (the tinyconfig build of Debian's 6.1 source that
tests/e2e/test_kernel_build.py runs), converged in one pyinfra run of the kernel stage (no reboot:
each node installs the kernel and arms its own trial). Each node's build records its seconds
(operations/progress.py, /var/lib/pvegpu/durations/kernel-<build id>); the figure is the build
seconds of all three nodes together / one node's build (before issue 41 every node built: ≈ 3;
target ≤ 1.2). Then one more kpro6 twin, in no cluster, with the same kernel spec and the same
seeded ccache as the cluster's builder, converged alone with the same stage deploy: the issue's wall
figure is the 3-node converge's wall / that single node's (target ≤ 1.2); the 3-node converge's
wall / the one build is kept beside it.

--json prints one JSON line {"value", "total_build_s", "one_node_build_s", "builds", "converge_s",
"converge_vs_build", "single_converge_s", "single_build_s", "wall_vs_single", "load_1min" (at the
start of each run), "ccache_seeded"} (bench/run.py reads it). The builder's kernel ccache is
seeded from .cache/kernel-ccache (or PVEGPU_E2E_KERNEL_CCACHE) when there is one, as the e2e does.
Needs root (twins); stops its twins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.build_share import figures, run  # noqa: E402
from plan import kernel as plan  # noqa: E402
from spec.models import KernelSpec  # noqa: E402
from tests.e2e.harness import run_pyinfra  # noqa: E402
from tests.e2e.test_build_share_e2e import write_inventory  # noqa: E402
from tests.e2e.test_kernel_build import CCACHE  # noqa: E402
from tests.e2e.test_kernel_share_e2e import STAGE_DEPLOY, STAGES, build_seconds, kernel_spec, prepare  # noqa: E402
from tests.twin import runtime  # noqa: E402


def converge(names: list[str], cluster: str | None, tarball: Path, kernel: dict,
             build_id: str) -> tuple[float, list[float], float]:
    """Start twins `names` (in `cluster`, or alone), prepare them (the source on each, the seeded
    kernel ccache on the first: the builder), converge them in one run of the kernel stage; the
    run's wall seconds, the build seconds every node recorded and the 1-min load as the run
    started. Raises unless every node installed the kernel. Stops them."""
    twins: list[runtime.Twin] = []
    try:
        for name in names:
            twins.append(runtime.start(name, "kpro6", cluster=cluster, owner=os.getpid()))
        prepare(twins, tarball)
        with tempfile.TemporaryDirectory(dir=REPO / ".cache") as tmp:
            inventory = write_inventory(Path(tmp), twins, {t.name: {"node": t.name, "kernel": kernel} for t in twins})
            load, t0 = os.getloadavg()[0], time.monotonic()
            run = run_pyinfra(inventory, STAGE_DEPLOY, env=STAGES, timeout=5400)
            wall = time.monotonic() - t0
        if run.rc != 0:
            raise RuntimeError(run.output[-3000:])
        builds = [s for t in twins for s in build_seconds(Path(t.root), build_id)]
        installed = [(Path(t.root) / f"boot/vmlinuz-{kernel['version']}").is_file() for t in twins]
    finally:
        for t in twins:
            runtime.stop(t.name)
    if not all(installed):
        raise RuntimeError(f"the kernel is not installed on every node of {names}: {installed}")
    return wall, builds, load


def measure() -> dict:
    fetched = subprocess.run([str(REPO / "scripts" / "fetch-linux-source.sh")], capture_output=True, text=True,
                             check=True, timeout=900)
    path, sha256, upstream = fetched.stdout.split()
    kernel = kernel_spec(sha256, f"{upstream}-pvegpu-ci")
    build_id = plan.build_id(KernelSpec(**kernel), "tinyconfig")
    seeded = Path(os.environ.get("PVEGPU_E2E_KERNEL_CCACHE") or CCACHE).is_dir()
    pid = os.getpid()
    converge_s, builds, load = converge([f"bk{x}-{pid}" for x in "abc"], f"bk{pid}", Path(path), kernel, build_id)
    if not builds:
        raise RuntimeError("no node recorded a kernel build")
    # issue 41's wall figure: one more kpro6 twin, in no cluster, the same spec and the same seeded
    # ccache as the cluster's builder, converged alone right after (the same machine state)
    single_s, single_builds, single_load = converge([f"bks-{pid}"], None, Path(path), kernel, build_id)
    if not single_builds:
        raise RuntimeError("the single node recorded no kernel build")
    return figures(converge_s, builds, load, single_s, single_builds, single_load, ccache_seeded=seeded,
                   release=kernel["version"])


def main() -> int:
    return run(measure, "kernel build seconds", "ccache_seeded", "builder's kernel ccache seeded")

if __name__ == "__main__":
    sys.exit(main())
