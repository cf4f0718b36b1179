"""The atomic managed-file write: real shell, real files (no host needed)."""

import subprocess

from facts.files import ManagedFiles
from operations.files import sha256_text, write_file_command


def run(cmd):
    return subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, check=True).stdout


def test_write_is_atomic_keeps_previous_and_quotes_paths(tmp_path):
    path = str(tmp_path / "dir with space" / "it's.conf")
    run(write_file_command(path, "one\n", "600"))
    assert open(path).read() == "one\n"
    run(write_file_command(path, "two; rm -rf /\n$(x)\n", "644"))
    assert open(path).read() == "two; rm -rf /\n$(x)\n"
    assert open(path + ".pvegpu-prev").read() == "one\n"
    assert not (tmp_path / "dir with space" / "it's.conf.pvegpu-tmp").exists()


def test_managed_files_fact_reads_state_in_one_command(tmp_path):
    a = tmp_path / "a.conf"
    a.write_text("hello\n")
    a.chmod(0o640)
    fact = ManagedFiles()
    out = run(fact.command([str(a), str(tmp_path / "missing")])).splitlines()
    state = fact.process(out)
    assert state == {str(a): {"mode": "640", "sha256": sha256_text("hello\n")}, str(tmp_path / "missing"): None}


def test_managed_files_fact_reports_symlink_targets(tmp_path):
    unit = tmp_path / "x.service"
    unit.write_text("[Unit]\n")
    link = tmp_path / "wants" / "x.service"
    link.parent.mkdir()
    link.symlink_to(unit)
    fact = ManagedFiles()
    state = fact.process(run(fact.command([str(link), str(unit)])).splitlines())
    assert state[str(link)] == {"link": str(unit)}
    assert state[str(unit)]["sha256"] == sha256_text("[Unit]\n")
