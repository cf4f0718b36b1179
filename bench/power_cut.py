"""Benchmark (issue 38 §3): a power cut at every step of a kernel install + trial, of an `apt
full-upgrade` bringing a Proxmox kernel and a systemd-boot-efi upgrade in one transaction, and of
a driver upgrade; after each cut the twin boots what its firmware model chooses and the next
converge must leave it on a kernel with its NVIDIA driver, converged, host checks green.

    sudo .venv/bin/python bench/power_cut.py [--case NAME ...] [--points I,J,...] [--json]

Each case's sequence is run once uncut (its steps recorded: tests/e2e/power_cut.py run_steps;
that baseline must end green too), then once per cut point on a fresh twin (each step's start,
and the middle of each step that took >= 0.4 s). Prints one line per cut and the figure
"hosts left unbootable or without GPUs: X of N cut points" (target 0); --json prints one JSON
line (bench/run.py reads it). Needs root (twins).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e import power_cut as pc  # noqa: E402


def sweep(case: pc.Case, points: list[int] | None, log, min_gap: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"pvegpu-power-cut-{case.name}-"))
    name = f"pcut-{os.getpid() % 100000}"
    t0 = time.monotonic()
    run, baseline = pc.record(case, name, tmp)
    cuts = pc.timed_points(run.steps, run.times, min_gap=min_gap)
    log(f"{case.name}: {len(run.steps)} steps, {len(cuts)} cut points; uncut run: {baseline.line()}; "
        f"logs in {tmp}")
    outcomes = []
    for i, point in enumerate(cuts):
        if points is not None and i not in points:
            continue
        outcome = pc.cut_once(case, name, tmp, point)
        outcomes.append(outcome)
        (tmp / f"cut-{i:03}.log").write_text(outcome.line() + "\n\n" + "\n".join(outcome.log))
        log(f"  {i:3} {outcome.seconds:5.1f} s  {outcome.line()}")
    bad = [o for o in outcomes if o.bad]
    return {"case": case.name, "steps": len(run.steps), "min_gap_s": min_gap, "cut_points": len(cuts), "cut": len(outcomes),
            "unbootable_or_no_gpus": len(bad), "other_problems": len([o for o in outcomes if o.problems and not o.bad]),
            "baseline_ok": not baseline.problems and not baseline.bad, "seconds": round(time.monotonic() - t0),
            "bad": [o.line() for o in bad], "problems": [o.line() for o in outcomes if o.problems and not o.bad]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs="*", choices=sorted(pc.CASES), default=None)
    parser.add_argument("--points", default=None, help="comma-separated cut point indices (default: all)")
    parser.add_argument("--min-gap", type=float, default=0.05,
                        help="steps beginning within this many seconds of the last cut point are one (default 0.05)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    points = [int(p) for p in args.points.split(",")] if args.points else None
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    results = [sweep(pc.CASES[c](), points, log, args.min_gap) for c in (args.case or list(pc.CASES))]
    total = sum(r["cut"] for r in results)
    bad = sum(r["unbootable_or_no_gpus"] for r in results)
    summary = {"value": bad, "cut_points": total, "benchmark": "power_cut", "cases": results,
               "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count()}
    for r in results:
        log(f"{r['case']}: {r['cut']} cuts of {r['cut_points']} points, {r['unbootable_or_no_gpus']} left unbootable "
            f"or without GPUs, {r['other_problems']} with other problems ({r['seconds']} s)")
    log(f"power cuts: {total} cut points, hosts left unbootable or without GPUs: {bad} of {total}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
