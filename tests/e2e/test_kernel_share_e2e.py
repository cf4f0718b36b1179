"""One kernel build per input set in a run (issue 41, the kernel half), end to end on a 2-node cluster
twin (tests/twin/runtime.py "Clusters", with the root SSH trust `pvecm add` leaves).

The real tinyconfig build of Debian's 6.1 source that tests/e2e/test_kernel_build.py runs (its
fragments, ccache seeded from .cache/kernel-ccache when an earlier run left one), of another release
(another build dir), for two nodes of one cluster with the same kernel spec:
1. `--dry`: the first node builds for the second, which receives node to node; with the second
   node's gcc banner of another Debian revision, it builds alone, the line naming both compilers.
2. The converge (no reboot: the trial stays armed): one build (build.log and the build's time record
   on the first node only); the second node receives the .debs node to node, verifies them and
   installs them through the stage's own install and trial: the same .deb bytes in both nodes'
   build dirs, the same /boot/vmlinuz-<release> installed, the trial armed on each. Seeded (make
   test runs test_kernel_build.py first), the build's compiles are ccache hits though the seed was
   compiled in test_kernel_build's build dir (CCACHE_BASEDIR, hash_dir off: issue 27 part 4).
3. The second node's kernel purged and the first node's kept copy tampered (a byte of the image
   .deb): the second node refuses the copy, saying which file's sha256 differs, and builds the kernel
   itself (its kernel ccache warmed from the first node's), then installs its own build.

PVEGPU_E2E_KERNEL_CCACHE=DIR seeds from DIR instead of .cache/kernel-ccache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from plan import kernel as plan
from spec.models import KernelSpec
from tests.e2e.harness import REPO, run_pyinfra
from tests.e2e.test_build_share_e2e import sh, write_inventory
from tests.e2e.test_driver_build import ccache_counters
from tests.e2e.test_kernel_build import CCACHE, FRAGMENTS, TWIN_CCACHE, TWIN_SOURCE, linux_source  # noqa: F401

pytestmark = [pytest.mark.twin, pytest.mark.slow]

STAGES = {"PVEGPU_STAGES": "operations.kernel,operations.reboot", "PVEGPU_E2E_NO_REBOOT": "1"}
STAGE_DEPLOY = str(REPO / "tests/e2e/stage_deploy.py")
SHARE = "var/cache/pvegpu/kernel-share"
DURATIONS = "var/lib/pvegpu/durations"


def kernel_spec(sha256: str, release: str) -> dict:
    return {"version": release, "source": {"kind": "tarball", "url": TWIN_SOURCE, "sha256": sha256},
            "config_fragments": FRAGMENTS, "base_config": "tinyconfig", "jobs": "auto", "ccache": True}


def debs(root: Path, build_dir: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / build_dir.lstrip("/")).glob("*.deb"))
            if not p.name.startswith("linux-libc-dev")}


def build_seconds(root: Path, build_id: str) -> list[float]:
    """The seconds of each kernel build of `build_id` this node recorded (operations/progress.py)."""
    out = []
    for f in sorted((root / DURATIONS).glob(f"kernel-{build_id}*")) if (root / DURATIONS).is_dir() else []:
        out += [float(line.split()[1]) for line in f.read_text().splitlines() if line.startswith("seconds ")]
    return out


def seed_ccache(root: Path, source: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, root / TWIN_CCACHE, dirs_exist_ok=True)


def prepare(twins, tarball: Path) -> bool:
    """The source in each twin, the first node's kernel ccache seeded; whether there was a seed."""
    seed = Path(os.environ.get("PVEGPU_E2E_KERNEL_CCACHE") or CCACHE)
    for t in twins:
        root = Path(t.root)
        (root / TWIN_SOURCE.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tarball, root / TWIN_SOURCE.lstrip("/"))
    seed_ccache(Path(twins[0].root), seed)
    return seed.is_dir()


def test_cluster_builds_the_kernel_once_receivers_verify_and_refuse_a_tampered_copy(twin_factory, tmp_path,
                                                                                    linux_source):  # noqa: F811
    t0 = time.monotonic()
    tarball, sha256, upstream = linux_source
    release = f"{upstream}-pvegpu-share"  # not test_kernel_build's release: another build dir than the seed's
    kernel = kernel_spec(sha256, release)
    build_dir = plan.build_dir(KernelSpec(**kernel), "tinyconfig")
    build_id = plan.build_id(KernelSpec(**kernel), "tinyconfig")
    cluster = f"k{os.getpid()}"
    twins = [twin_factory("kpro6", name=f"s41k{x}-{os.getpid()}", cluster=cluster) for x in "ab"]
    a, b = twins
    ra, rb = Path(a.root), Path(b.root)
    seeded = prepare(twins, tarball)
    inventory = write_inventory(tmp_path, twins, {t.name: {"node": t.name, "kernel": kernel} for t in twins})
    ip_a = json.loads(sh(b.name, "cat /etc/pve/.members"))["nodelist"][a.name]["ip"]

    # 1. --dry: who builds for whom; then with the second node's gcc of another Debian revision
    dry = run_pyinfra(inventory, STAGE_DEPLOY, "--dry", env=STAGES, timeout=900)
    assert dry.rc == 0, dry.output[-4000:]
    assert f"{a.name}: kernel {release}: builds for {b.name} too (most cores, then memory" in dry.output, dry.output[-4000:]
    assert (f"{b.name}: kernel {release}: receives the build of {a.name} (same inputs, key " in dry.output
            and f"node to node over the cluster's root SSH trust ({a.name}, {ip_a})" in dry.output), dry.output[-4000:]
    banner = sh(b.name, "gcc --version | head -n 1").strip()
    other = re.sub(r"\)\s+(\d+\.\d+\.\d+)$", r"+pvegpu1) \1", banner)
    assert other != banner, banner
    real = sh(b.name, "readlink -f /usr/bin/gcc").strip()
    sh(b.name, f"mv /usr/bin/gcc /root/gcc.real && printf '%s\\n' '#!/bin/sh' "
               f"'[ \"$1\" = --version ] && {{ echo \"{other}\"; exit 0; }}' 'exec {real} \"$@\"' "
               f"> /usr/bin/gcc && chmod 755 /usr/bin/gcc")
    try:
        dry2 = run_pyinfra(inventory, STAGE_DEPLOY, "--dry", env=STAGES, timeout=900)
    finally:
        sh(b.name, "mv -f /root/gcc.real /usr/bin/gcc")
    assert dry2.rc == 0, dry2.output[-4000:]
    assert (f"{b.name}: kernel {release}: builds alone: its compiler gcc {other.split(' ', 1)[1]!r} is not "
            f"{a.name}'s gcc {banner.split(' ', 1)[1]!r}") in dry2.output, dry2.output[-4000:]
    assert not debs(ra, build_dir) and not debs(rb, build_dir)

    # 2. the converge: one build, received by the other node node to node, installed on both
    stats = f"CCACHE_DIR={plan.CCACHE_DIR} ccache"
    sh(a.name, f"{stats} -z")
    t1 = time.monotonic()
    run = run_pyinfra(inventory, STAGE_DEPLOY, env=STAGES, timeout=3600)
    converge_s = time.monotonic() - t1
    try:
        assert run.rc == 0, run.output[-6000:]
    finally:
        if (ra / TWIN_CCACHE).is_dir():
            shutil.copytree(ra / TWIN_CCACHE, CCACHE, dirs_exist_ok=True)
    assert f"{a.name}: kernel {release}: builds for {b.name} too" in run.output
    assert f"{b.name}: pvegpu: kernel {release} received from {a.name} and verified" in run.output, run.output[-6000:]
    assert (ra / build_dir.lstrip("/") / "build.log").exists() and not (rb / build_dir.lstrip("/") / "build.log").exists()
    seconds = {t.name: build_seconds(Path(t.root), build_id) for t in twins}
    assert len(seconds[a.name]) == 1 and seconds[b.name] == [], seconds
    counters = ccache_counters(sh(a.name, f"{stats} --print-stats"))
    hits = counters["direct_cache_hit"] + counters["preprocessed_cache_hit"]
    print(f"\nbuilder's kernel build: ccache {hits} hits, {counters['cache_miss']} misses (seeded: {seeded})")
    if seeded:  # compiled in test_kernel_build's build dir, answered in this one's
        assert build_dir != plan.build_dir(KernelSpec(**{**kernel, "version": f"{upstream}-pvegpu-ci"}), "tinyconfig")
        assert hits > 0 and counters["cache_miss"] * 10 <= hits, counters
    built = debs(ra, build_dir)
    assert sorted(n.split("_")[0] for n in built) == [f"linux-headers-{release}", f"linux-image-{release}"], built.keys()
    assert debs(rb, build_dir) == built  # the same bytes
    (key,) = [p.name for p in (ra / SHARE).iterdir()]
    kept = {n: hashlib.sha256(d).hexdigest() for n, d in built.items()}
    assert all(f"{s}  {n}" in (ra / SHARE / key / "manifest").read_text() for n, s in kept.items())
    for t in twins:
        root = Path(t.root)
        assert (root / f"boot/vmlinuz-{release}").read_bytes() == (ra / f"boot/vmlinuz-{release}").read_bytes()
        assert sh(t.name, f"dpkg-query -W -f='${{Version}}' linux-image-{release}").strip() == "1"
        manifest = json.loads((root / f"var/lib/pvegpu/kernel/{release}.json").read_text())
        assert manifest["build_id"] == build_id and manifest["source_sha"] == sha256
        assert f"kernel: {release} is installed and chosen for the next boot only" in run.output
    assert not list((rb / "var/cache/pvegpu/kernel-received").iterdir())  # the scratch copy is gone

    # 3. a tampered copy is refused and the node builds the kernel itself
    image = next(n for n in built if n.startswith("linux-image-"))
    target = ra / SHARE / key / image
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    sh(b.name, f"dpkg --purge linux-image-{release} linux-headers-{release} >/dev/null && "
               f"rm -rf {build_dir} /var/lib/pvegpu/kernel/{release}.json")
    seed_ccache(rb, ra / TWIN_CCACHE)
    t2 = time.monotonic()
    again = run_pyinfra(inventory, STAGE_DEPLOY, env=STAGES, timeout=3600)
    rebuild_s = time.monotonic() - t2
    assert again.rc == 0, again.output[-6000:]
    assert (f"{b.name}: kernel {release}: receives the build {a.name} already keeps for these inputs"
            in again.output), again.output[-4000:]
    assert (f"pvegpu: refused the copy of kernel {release} from {a.name}: sha256 differs from its manifest: "
            f"{image}: FAILED" in again.output), again.output[-4000:]
    assert "building here instead" in again.output
    assert len(build_seconds(rb, build_id)) == 1 and len(build_seconds(ra, build_id)) == 1
    assert (rb / build_dir.lstrip("/") / "build.log").exists()
    assert sh(b.name, f"dpkg-query -W -f='${{Status}}' linux-image-{release}").strip() == "install ok installed"
    one = seconds[a.name][0]
    print(f"\nkernel build-share e2e: build seconds of the run / one node's build = {sum(seconds[a.name]) / one:.2f} "
          f"(one build {one:.0f} s); converge of 2 nodes {converge_s:.0f} s = {converge_s / one:.2f} x the build; "
          f"refused copy + local rebuild {rebuild_s:.0f} s; whole test {time.monotonic() - t0:.0f} s")
