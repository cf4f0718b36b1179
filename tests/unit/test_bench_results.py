"""bench/run.py keeps figures it did not measure: the other benches' on --only, and the one only a
many-core machine can take on every run; --import-many-cores takes that figure from its file."""

from __future__ import annotations

import json
import re
import sys

from bench import run as bench


def _write(path, results):
    path.write_text(json.dumps({"measured_at": "2026-12-01T00:00:00Z", "results": results}))


def _main(monkeypatch, tmp_path, argv, benches):
    results = tmp_path / "results.json"
    monkeypatch.setattr(bench, "RESULTS", results)
    monkeypatch.setattr(bench, "BENCHES", benches)
    monkeypatch.setattr(sys, "argv", ["bench/run.py", *argv])
    assert bench.main() == 0
    return json.loads(results.read_text())["results"]


MANY = {"value": 1.19, "machine": "16 cores", "measured_at": "2026-12-03T07:26:37Z"}


def test_a_whole_run_keeps_the_many_core_figure_and_drops_the_rest(monkeypatch, tmp_path):
    _write(tmp_path / "results.json", {"fleet8_vs_1_many_cores": MANY, "facts_commands": {"value": 9}})
    got = _main(monkeypatch, tmp_path, [], {"converge": lambda r: r.update(converge_commands={"value": 3})})
    assert got["fleet8_vs_1_many_cores"] == MANY
    assert got["converge_commands"]["value"] == 3 and "facts_commands" not in got


def test_only_keeps_every_figure_not_measured(monkeypatch, tmp_path):
    _write(tmp_path / "results.json", {"fleet8_vs_1_many_cores": MANY, "facts_commands": {"value": 2}})
    got = _main(monkeypatch, tmp_path, ["--only", "converge"],
                {"converge": lambda r: r.update(converge_commands={"value": 3})})
    assert got["fleet8_vs_1_many_cores"]["value"] == 1.19 and got["facts_commands"]["value"] == 2


def test_import_takes_the_other_machines_figure(monkeypatch, tmp_path):
    _write(tmp_path / "results.json", {"fleet8_vs_1": {"value": 1.76}})
    other = tmp_path / "other.json"
    _write(other, {"fleet8_vs_1": {"value": 1.19}, "fleet8_vs_1_many_cores": MANY})
    got = _main(monkeypatch, tmp_path, ["--import-many-cores", str(other)], {})
    assert got == {"fleet8_vs_1": {"value": 1.76}, "fleet8_vs_1_many_cores": MANY}


def test_kernel_second_ref_figure_is_reported_and_kept(monkeypatch, tmp_path, capsys):
    _write(tmp_path / "results.json", {"facts_commands": {"value": 2}})
    figure = {"value": 0.25, "cold_s": 600.0, "warm_s": 150.0,
              "runs": {"warm": {"ccache": {"direct_cache_hit": 700, "preprocessed_cache_hit": 0, "cache_miss": 7}}}}
    got = _main(monkeypatch, tmp_path, ["--only", "kernel"],
                {"kernel": lambda r: r.update(kernel_second_ref_vs_first=dict(figure))})
    assert got["kernel_second_ref_vs_first"]["value"] == 0.25 and got["facts_commands"]["value"] == 2
    assert "kernel_second_ref_vs_first       0.25 (warm 150.0 s / cold 600.0 s" in capsys.readouterr().out


def test_the_cluster_many_core_figure_is_kept_and_imported_too(monkeypatch, tmp_path):
    """cluster3_vs_1_many_cores (3 twins + pyinfra, a core each) is taken on the device machine as
    fleet8_vs_1_many_cores is: a run here keeps it, --import-many-cores brings both."""
    cluster = {"value": 1.14, "machine": "16 cores", "measured_at": "2026-12-04T11:24:20Z"}
    _write(tmp_path / "results.json", {"cluster3_vs_1_many_cores": cluster, "facts_commands": {"value": 9}})
    got = _main(monkeypatch, tmp_path, [], {"converge": lambda r: r.update(converge_commands={"value": 3})})
    assert got["cluster3_vs_1_many_cores"] == cluster and "facts_commands" not in got
    other = tmp_path / "other.json"
    _write(other, {"fleet8_vs_1_many_cores": MANY, "cluster3_vs_1_many_cores": cluster, "cluster3_vs_1": {"value": 1.14}})
    _write(tmp_path / "results.json", {"cluster3_vs_1": {"value": 1.28}})
    got = _main(monkeypatch, tmp_path, ["--import-many-cores", str(other)], {})
    assert got == {"cluster3_vs_1": {"value": 1.28}, "fleet8_vs_1_many_cores": MANY, "cluster3_vs_1_many_cores": cluster}


def test_pve_delay_vs_fact_is_printed_against_its_target_with_both_walls(monkeypatch, tmp_path, capsys):
    """Issue 26 part 5's figure: the delayed no-change converge over the bare fact, target 1.3,
    printed with both medians and the Proxmox CLIs the converges started."""
    figure = {"value": 1.9, "converge_s": 1.52, "fact_s": 0.8, "delay_s": 0.4, "pve_calls": [],
              "walls_s": {"converge": [1.5, 1.52, 1.6], "fact": [0.8, 0.7, 0.9]}}
    _write(tmp_path / "results.json", {})
    got = _main(monkeypatch, tmp_path, ["--only", "converge"],
                {"converge": lambda r: r.update(pve_delay_vs_fact=dict(figure))})
    out = capsys.readouterr().out
    assert got["pve_delay_vs_fact"]["value"] == 1.9 and bench.TARGETS["pve_delay_vs_fact"] == ("<=", 1.3)
    assert "pve_delay_vs_fact               1.9  <=   1.3  NO" in out
    assert "no-change converge 1.52 s (CT 200 running, Proxmox CLIs taking 0.4 s to start, 0 started) / bare fact 0.8 s" in out


def test_a_build_share_run_gives_both_issue_41_figures(monkeypatch, tmp_path, capsys):
    """Issue 41's Measure: the build seconds figure and the wall figure (the 3-node converge / one
    node's converge alone), each against its target of 1.2, from one run of the share script."""
    share = {"value": 1.0, "total_build_s": 28.0, "one_node_build_s": 28.0, "builds": 1, "converge_s": 40.0,
             "converge_vs_build": 1.43, "single_converge_s": 25.0, "single_build_s": 20.0, "wall_vs_single": 1.6,
             "load_1min": [0.5, 1.1]}
    monkeypatch.setattr(bench.subprocess, "run",
                        lambda *a, **k: bench.subprocess.CompletedProcess(a, 0, json.dumps(share) + "\n", ""))
    _write(tmp_path / "results.json", {"facts_commands": {"value": 2}})
    got = _main(monkeypatch, tmp_path, ["--only", "share"],
                {"share": bench.BENCHES["share"], "facts": bench.BENCHES["facts"]})
    assert got["build_share_total_vs_one"]["value"] == 1.0 and got["facts_commands"]["value"] == 2
    assert got["build_share_wall_vs_single"]["value"] == 1.6
    assert bench.TARGETS["build_share_wall_vs_single"] == bench.TARGETS["kernel_share_wall_vs_single"] == ("<=", 1.2)
    out = capsys.readouterr().out
    assert re.search(r"^build_share_wall_vs_single +1\.6  <= +1\.2  NO$", out, re.M), out
    assert "build_share_wall_vs_single: 3-node converge 40.0 s / one node's converge alone 25.0 s" in out
